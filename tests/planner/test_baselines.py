"""Baseline families as restrictions of the built problem (``autopar.planner.baselines``)."""

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
