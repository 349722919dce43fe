"""Baseline families as restrictions of the built problem (``autopar.planner.baselines``)."""

import re

import torch
from torch import nn

from autopar.layout.mesh import MeshSpec
from autopar.planner.assemble import restricted_problem
from autopar.planner.baselines import make_restriction
from autopar.planner.builder import build_problem
from autopar.planner.options import PlanOptions
from autopar.strategies import needs_decomposition
from autopar.tracer import profile, trace


class _Mlp(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))).sum()


def test_dp_x_tp_splits_bf16_weight_copies_as_megatron():
    """Under bf16 an op reads a ``_to_copy`` of its weight, not the parameter: the dp x tp family
    must judge that copy as a weight (tp may shard its dim 0: Megatron's column split of a
    Linear (out, in) weight; dp reads it whole), else the family loses its column / row splits
    and the baseline is slower than Megatron is."""
    d = 256
    with torch.device("meta"):
        model = _Mlp(d)
    traced = trace(model, (torch.empty(16, 64, d, device="meta"),), decompose_if=needs_decomposition,
                   precision="bf16")
    mesh = MeshSpec.preset("a100-80gb", (2, 4))
    built = build_problem(traced, profile(traced), mesh, budget_bytes=None, options=PlanOptions(precision="bf16"))
    problem = restricted_problem(built, traced, make_restriction(("dp", "tp"), mesh_shape=mesh.shape), "dp x tp")
    copies = [n for n in traced.graph.nodes if n.op == "call_function" and "_to_copy" in str(n.target)
              and n.args[0].op == "placeholder" and n.args[0].meta["val"].ndim == 2]
    assert len(copies) == 2
    for node in copies:
        names = [o.name for o in problem.node(node.name).options]
        assert "RS0 -> RS0" in names and "RS1 -> RS1" in names, names  # tp shards the copy either way
        assert not any(n.startswith("S") for n in names), names  # dp reads it whole


class _Lm(nn.Module):
    """Embedding, an MLP, a head and the cross entropy: every piece Megatron's layout names."""

    def __init__(self, vocab: int = 64, d: int = 32) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, ids, labels):
        x = self.embed(ids)
        x = x + self.down(torch.relu(self.up(x)))
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def test_megatron_family_is_megatrons_layout():
    """``dp x megatron`` on (2, 2): every trainable matrix stored and read split on the tp axis, the
    embedding table read by vocabulary rows, the cross entropy's logits by class; the restricted
    ``BuiltProblem`` (``family_built``) names the same options as its problem; ZeRO-3 still stores
    parameters split."""
    from autopar.planner.assemble import assemble_plan, baseline_problem, family_built
    from autopar.solver.driver import solve

    with torch.device("meta"):
        model = _Lm()
    ids = torch.zeros(8, 16, dtype=torch.long, device="meta")
    traced = trace(model, (ids, ids), decompose_if=needs_decomposition)
    mesh = MeshSpec.preset("cpu", (2, 2))
    built = build_problem(traced, profile(traced), mesh, budget_bytes=None, options=PlanOptions(checkpoint="none"))
    restricted = family_built("dp x megatron", traced, built)
    for node in restricted.problem.nodes:
        assert [o.name for o in node.options] == [c.name for c in restricted.decision(node.name).choices]
    solution = solve(restricted.problem)
    plan = assemble_plan(traced, restricted, choice=solution.choice, solution=solution,
                         evaluation=restricted.problem.evaluate(solution.choice))
    matrices = {n.module: n.output_specs[0] for n in plan.nodes
                if n.kind == "parameter" and n.module in ("embed.weight", "head.weight", "up.weight", "down.weight")}
    assert len(matrices) == 4 and all(re.fullmatch(r"RS\d", spec) for spec in matrices.values()), matrices
    reads = {n.op: n.input_specs[0] for n in plan.nodes if n.op in ("aten.embedding.default",
                                                                     "aten.cross_entropy_loss.default")}
    assert reads == {"aten.embedding.default": "RS0", "aten.cross_entropy_loss.default": "RS1"}, reads
    zero3 = baseline_problem("zero3", traced, built)
    assert any(o.name.startswith("S") for n in zero3.nodes if n.name.startswith("p_") for o in n.options)


def test_hybrid_layout_orders_pp_dp_tp():
    import pytest

    from autopar.planner.baselines import hybrid_layout

    got = hybrid_layout(16, tp_size=2, pp_size=2, zero_stage=1)
    assert (got.shape, got.axis_names, got.family, got.pipeline) == ((2, 4, 2), ("pp", "dp", "tp"), "dp x megatron", 2)
    assert hybrid_layout(4, tp_size=1, pp_size=1, zero_stage=2).family == "zero2"
    assert hybrid_layout(4, tp_size=4, pp_size=1, zero_stage=1).family == "megatron"  # no dp axis to shard over
    assert hybrid_layout(1, tp_size=1, pp_size=1, zero_stage=0).shape == (1,)
    with pytest.raises(ValueError, match="tp_size=3"):
        hybrid_layout(4, tp_size=3, pp_size=1, zero_stage=0)


def test_a_sequence_axis_comes_last_with_weights_whole():
    import pytest

    from autopar.planner.baselines import FAMILY_ZERO, baseline_roles, hybrid_layout

    got = hybrid_layout(16, tp_size=2, pp_size=1, zero_stage=1, sp_size=2)
    assert (got.shape, got.axis_names, got.family) == ((4, 2, 2), ("dp", "tp", "sp"), "zero1 x megatron x sp")
    assert FAMILY_ZERO[got.family] == 1 and baseline_roles(got.family, 3) == ("dp", "megatron", "sp")
    assert hybrid_layout(4, tp_size=1, pp_size=1, zero_stage=0, sp_size=4).family == "sp"
    assert hybrid_layout(4, tp_size=1, pp_size=1, zero_stage=0, sp_size=2, experts=True).family == "ep x sp"
    with pytest.raises(ValueError, match="sp_size=3"):
        hybrid_layout(4, tp_size=1, pp_size=1, zero_stage=0, sp_size=3)
    # The sp role (the last axis) stores every weight whole and lets activations split on any dim
    # there (the sequence, dim 1), where the dp role only splits the batch.
    from autopar.planner.assemble import baseline_problem

    with torch.device("meta"):
        model = _Lm()
    ids = torch.zeros(8, 16, dtype=torch.long, device="meta")
    traced = trace(model, (ids, ids), decompose_if=needs_decomposition)
    built = build_problem(traced, profile(traced), MeshSpec.preset("cpu", (2, 2)), budget_bytes=None,
                          options=PlanOptions(checkpoint="none"))
    problem = baseline_problem("data-parallel x sp", traced, built)
    params = [n for n in problem.nodes if n.name.startswith("p_")]
    assert params and all(o.name.endswith("RR") for n in params for o in n.options), \
        [(n.name, [o.name for o in n.options]) for n in params]
    embedding = next(n for n in problem.nodes if n.name.startswith("embedding"))
    assert any(o.name.endswith("-> S0S1") for o in embedding.options), [o.name for o in embedding.options]
    assert not any(o.name.endswith("-> S1R") for o in embedding.options)  # dp: the batch only
