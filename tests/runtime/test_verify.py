"""Plans prove themselves (``autopar.runtime.verify``, ``autopar.verify``): on real gloo ranks,
random shardings with recompute regions of a model that writes activations in place are exact
(the tracer's functionalization; before it, a write through a converted view was lost), a
sabotaged op is named as the first diverging node -- by value, or by gradient -- and
``autoparallelize(verify=...)`` checks the module it returns."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import autopar
from autopar.layout.blocks import block_of
from autopar.planner.assemble import node_plans
from autopar.planner.builder import build_problem
from autopar.planner.checkpointing import regions_of
from autopar.planner.options import PlanOptions
from autopar.runtime.build import build_module
from autopar.runtime.launch import run_local
from autopar.runtime.passes import TRACED_NAME_KEY
from autopar.runtime.verify import PlanVerificationError, verify_inputs, verify_module
from autopar.solver.timeline import segment_geometry
from autopar.strategies import needs_decomposition
from autopar.tracer import profile, trace
from tests.tracer.test_functionalize import Writes, _inputs

aten = torch.ops.aten


def _random_plans(model, inputs, mesh: tuple[int, ...], seeds) -> tuple:
    """(trace, [plan with a random option per decision and a random half of the recompute units])."""
    traced = trace(model, inputs, decompose_if=needs_decomposition)
    base = autopar.plan(model, inputs, mesh=mesh, cache=False, pipeline=1)  # verify runs unpipelined plans
    options = PlanOptions()
    built = build_problem(traced, profile(traced), options.mesh(mesh), budget_bytes=None, options=options)
    units = sorted(segment_geometry(built.problem))
    fine = [u for u in units if block_of(u) != u] or units  # sub-block units never overlap
    plans = []
    for seed in seeds:
        rng = random.Random(seed)
        choice = {n.name: rng.choice(n.options).name for n in built.problem.nodes}
        regions = regions_of(built.problem, [u for u in fine if rng.random() < 0.5])
        plans.append(dataclasses.replace(base, nodes=node_plans(built, choice), recompute=regions))
    return traced, plans


def _check_random_plans(rank, world, model, traced, plans, inputs):
    out = []
    for p in plans:
        try:  # every plan's outcome, not just the first failure's
            verify_module(build_module(model, traced, p, device=torch.device("cpu")), inputs)
            out.append(None)
        except Exception as exc:  # noqa: BLE001 -- reported per plan by the test
            out.append(f"{type(exc).__name__}: {exc}"[:400])
    return out


@pytest.mark.timeout(600)
# (2,) with the whole sweeps: [2x2] draws random options and recompute units on both axes of the
# same model (the 1-D mesh's options are its single-axis ones), and the sabotage tests below run (2,).
@pytest.mark.parametrize("mesh", [pytest.param((2,), marks=pytest.mark.full_sweep), (2, 2)], ids=["2", "2x2"])
def test_random_shardings_with_recompute_of_a_model_writing_activations_are_exact(mesh):
    torch.manual_seed(0)
    model, inputs = Writes(), _inputs()
    traced, plans = _random_plans(model, inputs, mesh, range(6))
    assert any(p.recompute for p in plans)
    results = run_local(_check_random_plans, int(torch.tensor(mesh).prod()),
                        model, traced, plans, inputs, timeout=500)
    assert results[0] == [None] * len(plans), results[0]


def _sabotaged(rank, world, model, traced, plan, inputs, target, replacement):
    module = build_module(model, traced, plan, device=torch.device("cpu"))
    node = next(n for n in module.graph_module.graph.nodes if n.op == "call_function" and n.target == target)
    node.target = replacement
    module.graph_module.recompile()
    try:
        verify_module(module, inputs)
    except PlanVerificationError as exc:
        return node.meta[TRACED_NAME_KEY], exc.divergence, str(exc)
    return node.meta[TRACED_NAME_KEY], None, "passed"


class _TripleGrad(torch.autograd.Function):
    """``a / b`` whose backward is three times too large for ``a``."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.b = b
        return a / b

    @staticmethod
    def backward(ctx, grad):
        return 3 * grad / ctx.b, None


def _wrong_grad_div(a, b):
    return _TripleGrad.apply(a, b)


def _run_sabotaged(target, replacement):
    """(traced, plan, the sabotaged node's traced name, the divergence found, the message) on 2 ranks."""
    torch.manual_seed(0)
    model, inputs = Writes(), _inputs()
    traced = trace(model, inputs, decompose_if=needs_decomposition)
    plan = autopar.plan(model, inputs, mesh=(2,), cache=False, pipeline=1)
    name, divergence, message = run_local(_sabotaged, 2, model, traced, plan, inputs, target, replacement,
                                          timeout=240)[0]
    assert divergence is not None, message
    return traced, plan, name, divergence, message


@pytest.mark.timeout(300)
def test_a_wrong_op_is_named_as_the_first_diverging_value():
    _, plan, name, divergence, message = _run_sabotaged(aten.softmax.int, aten.log_softmax.int)
    assert (divergence.node, divergence.what) == (name, "value"), message
    assert divergence.op == "aten.softmax.int" and divergence.strategy == plan.node(name).strategy
    assert f"the value of node {name!r}" in message and "strategy" in message


@pytest.mark.timeout(300)
def test_a_wrong_backward_is_named_by_the_gradient_it_spoils():
    traced, _, name, divergence, message = _run_sabotaged(aten.div.Tensor, _wrong_grad_div)
    spoiled = traced.node(name).args[0].name  # the div's input: its gradient is the first wrong one
    assert (divergence.node, divergence.what) == (spoiled, "gradient"), message
    assert any(c.startswith(name + " ") for c in divergence.consumers), message


def _autoparallelize_verified(rank, world, model, meta):
    module = autopar.autoparallelize(model, meta, mesh=(2,), verify=True)
    assert all(p.grad is None for p in module.parameters())  # left as it was
    report = autopar.verify(module, meta)
    with pytest.raises(ValueError, match="verify= takes True or the inputs"):
        autopar.autoparallelize(model, meta, mesh=(2,), verify="yes")
    return str(report)


@pytest.mark.timeout(300)
def test_autoparallelize_verifies_on_inputs_made_from_meta_shapes():
    torch.manual_seed(0)
    model = Writes()
    meta = {k: v.to("meta") for k, v in _inputs().items()}
    (report, _) = run_local(_autoparallelize_verified, 2, model, meta, timeout=240)
    assert report.startswith("verified: loss") and "gradients" in report


def test_made_up_inputs_stay_in_the_range_the_graph_indexes():
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=37, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, type_vocab_size=2, num_labels=3, max_position_embeddings=32)
    model = BertForSequenceClassification(config).eval()
    meta = {"input_ids": torch.empty(4, 8, dtype=torch.long, device="meta"),
            "token_type_ids": torch.empty(4, 8, dtype=torch.long, device="meta"),
            "attention_mask": torch.empty(4, 8, dtype=torch.long, device="meta"),
            "labels": torch.empty(4, dtype=torch.long, device="meta")}
    made = verify_inputs(trace(model, meta), meta, seed=3)
    assert 0 <= int(made["input_ids"].min()) and int(made["input_ids"].max()) < 37
    assert int(made["input_ids"].max()) > 2  # drawn, not a constant
    assert int(made["token_type_ids"].max()) < 2 and int(made["labels"].max()) < 3
    assert bool((made["attention_mask"] == 1).all())
    assert torch.equal(made["input_ids"], verify_inputs(trace(model, meta), meta, seed=3)["input_ids"])
