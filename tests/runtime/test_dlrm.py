"""DLRM (bottom MLP, four EmbeddingBag tables pooling by sum/mean/max/sum over jagged bags, pairwise
dot interaction, top MLP, BCE loss) trains exactly like the single-device model on (2,) and (2, 2),
without the replicate fallback.

Plans: the solver's own under a budget that forces the tables to be sharded; three with each
table's placement pinned on mesh axis 0 (``fixed``: the rest of the plan, and axis 1, are solved),
mixing TorchRec's placements as autopar expresses them -- row-wise (partial sums, partial max),
column-wise and data-parallel -- over every pooling mode; and every table family
(``planner.table_families``: all tables row-wise, column-wise, data-parallel, dp x row-wise) on
every axis at once ((2,) with ``pytest -m full_sweep``). Each rank checks the loss, every gradient,
the gradient norms and the state after clipped AdamW steps (``tests/runtime/test_e2e.check_module``).
"""

from __future__ import annotations

import pytest
import torch

from autopar import zoo
from autopar.api import PlanOptions, autoparallelize, plan_traced
from autopar.layout.placement import Replicate, Shard
from autopar.planner.table_families import TABLE_FAMILIES, table_family_plan
from autopar.runtime.build import build_module
from autopar.runtime.launch import run_local
from autopar.strategies import needs_decomposition
from autopar.strategies.registry import module_path_of
from autopar.tracer import profile, trace
from tests.runtime.test_e2e import check_module, reference

pytestmark = pytest.mark.slow

# Placement of each table's lookup on mesh axis 0: (weight, output) -- None leaves it to the solver.
ROW, COLUMN, DATA = (Shard(0), None), (Shard(1), Shard(1)), (Replicate(), Shard(0))
PINNED = {
    "row-wise everywhere": (ROW, ROW, ROW, ROW),
    "mixed": (DATA, COLUMN, COLUMN, DATA),
    "mixed, max data-parallel": (COLUMN, DATA, DATA, ROW),
}


BAGS = (torch.ops.aten._embedding_bag.default, torch.ops.aten._embedding_bag_forward_only.default)


def pin(placements):
    """``plan_traced``'s ``fixed``: table ``t``'s ``_embedding_bag`` placed ``placements[t]`` on axis 0."""
    def fixed(node):
        if node.target not in BAGS:
            return None
        weight, out = placements[int(module_path_of(node).rsplit(".", 1)[-1])]
        return 0, (weight, None, None), (out, None, None, None)
    return fixed


def _train(rank, world, model, traced, plans, inputs, ref):
    errors = []
    for i, (label, plan) in enumerate(plans):
        if i == 0:  # the public path once per launch (every rank traces again)
            pm = autoparallelize(model, inputs, plan=plan)
        else:
            pm = build_module(model, traced, plan, device=torch.device("cpu"))
        errors += check_module(label, pm, inputs, ref)
    return errors


def tables_of(plan) -> dict[str, str]:
    return {n.module: n.strategy for n in plan.nodes if n.op in {str(op) for op in BAGS}}


# (2,) with the whole sweeps: (2, 2) below pins the same placements on axis 0 (and solves axis 1)
# and puts every table family on both axes; test_frozen_table_trains_like_one_device runs (2,).
@pytest.mark.parametrize("shape", [pytest.param((2,), marks=pytest.mark.full_sweep), (2, 2)])
def test_dlrm_trains_like_one_device(shape):
    torch.manual_seed(0)
    model, inputs = zoo.build("dlrm", tiny=True, device="cpu")
    traced = trace(model, inputs, decompose_if=needs_decomposition)
    prof = profile(traced)
    result = plan_traced(traced, prof, mesh=shape, options=PlanOptions())
    replicated = result.plan
    assert not replicated.fallbacks
    tables = sum(p.numel() * p.element_size() for p in model.tables.parameters())
    # Ample for everything but the replicated tables: the solver must shard some of them.
    budget = replicated.estimate.peak_bytes - tables // 3
    tight = plan_traced(traced, prof, mesh=shape, options=PlanOptions(memory_budget=budget)).plan
    assert tight.estimate.peak_bytes <= budget
    assert any(not set(s.split(" -> ")[0].split(" x ")[0]) <= {"R"} for s in tables_of(tight).values()), \
        tables_of(tight)
    plans = [(f"dlrm {shape} budget", tight)]
    for label, placements in PINNED.items():
        plan = plan_traced(traced, prof, mesh=shape, options=PlanOptions(), fixed=pin(placements)).plan
        plans.append((f"dlrm {shape} {label}: {tables_of(plan)}", plan))
    for family in TABLE_FAMILIES:
        plan = table_family_plan(traced, result.built, family)
        plans.append((f"dlrm {shape} tables {family}: {tables_of(plan)}", plan))
    ref = reference(model, inputs)
    errors = run_local(_train, len(shape) * 2 if len(shape) == 2 else 2, model, traced, plans, inputs, ref,
                       timeout=300)
    flat = [e for rank_errors in errors for e in rank_errors]
    assert not flat, "\n".join(flat[:20])


def test_frozen_table_trains_like_one_device():
    """A table that takes no gradient is looked up with ``_embedding_bag_forward_only``: the same
    placements, on (2,), with the frozen table row-wise, column-wise and data-parallel."""
    torch.manual_seed(0)
    model, inputs = zoo.build("dlrm", tiny=True, device="cpu")
    model.tables[2].weight.requires_grad_(False)  # the max-pooling table
    traced = trace(model, inputs, decompose_if=needs_decomposition)
    assert any(n.target is torch.ops.aten._embedding_bag_forward_only.default for n in traced.nodes)
    prof = profile(traced)
    plans = []
    for label, placements in PINNED.items():
        plan = plan_traced(traced, prof, mesh=(2,), options=PlanOptions(), fixed=pin(placements)).plan
        assert not plan.fallbacks
        plans.append((f"frozen table, {label}", plan))
    ref = reference(model, inputs)
    errors = run_local(_train, 2, model, traced, plans, inputs, ref, timeout=300)
    flat = [e for rank_errors in errors for e in rank_errors]
    assert not flat, "\n".join(flat[:20])
