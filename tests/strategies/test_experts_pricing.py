"""The expert-parallel option of ``autopar::moe_experts`` is priced from the routing volume.

With routing balanced, a rank that holds ``T_local`` tokens routes ``T_local * k`` pairs, ``1/n``
of them to each rank of an exchange's axis: ``(n-1)/n`` of them cross it, as rows of ``H``
elements of the hidden dtype, there and back in forward and again in backward, each axis on its
own links; the counts and the expert ids travel in forward. The figures below are written out by
hand from alpha, beta and the sizes, not from ``collective_seconds``.
"""

from __future__ import annotations

import pytest
import torch

from autopar.layout.mesh import MeshSpec
from autopar.strategies import strategies_for
from autopar.strategies._experts import routed_pairs
from autopar.tracer import trace
from tests.tracer.test_experts import mixtral

TOKENS, K, HIDDEN = 32, 2, 32  # mixtral(): batch 4 x seq 8, top-2 of 4 experts, hidden 32, fp32


@pytest.fixture(scope="module")
def experts_node():
    ids = torch.randint(0, 101, (4, 8))
    traced = trace(mixtral(), {"input_ids": ids, "labels": ids})
    return next(n for n in traced.graph.nodes if n.target is torch.ops.autopar.moe_experts.default)


def _mesh(per_node: int = 4) -> MeshSpec:
    mesh = MeshSpec.cluster(nodes=2, devices_per_node=per_node)  # axis 0 across nodes, axis 1 inside one
    assert mesh.beta[0] != mesh.beta[1] and mesh.alpha[0] != mesh.alpha[1]
    return mesh


def _exchange(mesh: MeshSpec, axis: int, pairs: float) -> tuple[float, float]:
    """One axis's exchanges by hand: (forward, backward) seconds."""
    n, alpha, beta = mesh.shape[axis], mesh.alpha[axis], mesh.beta[axis]
    crossing = pairs * (n - 1) / n  # pairs sent to the axis's other ranks (as many received)
    rows = alpha + beta * crossing * HIDDEN * 4
    ids = alpha + beta * crossing * 8
    counts = alpha + beta * n * (n - 1) / n * 8  # one int64 count to each other rank
    return counts + ids + 2 * rows, 2 * rows


def _strategy(node, mesh, hidden: str, gate_up: str):
    found = [s for s in strategies_for(node, mesh)
             if str(s.input_specs[0]) == hidden and str(s.input_specs[3]) == gate_up]
    assert found, f"no strategy with hidden {hidden} and experts {gate_up}"
    return found[0]


@pytest.mark.parametrize("per_node,hidden,gate_up,split,axes", [
    (4, "S0R", "S0R", 2, (0,)),        # expert parallel on axis 0 (2 experts a rank)
    (4, "RS0", "RS0", 4, (1,)),        # on axis 1 (1 expert a rank): its own links
    (2, "S0S0", "S0S0", 4, (0, 1)),    # over both axes: one exchange per axis, each of the rank's pairs
    (4, "S0S0", "S0R", 8, (0,)),       # tokens also split on axis 1: fewer pairs per rank
    (2, "S0R", "S0S0", 4, (0,)),       # experts also split on axis 1 (tokens whole there): pairs dropped at the source
])
def test_all_to_all_volume_is_the_expected_pairs_per_rank(experts_node, per_node, hidden, gate_up, split, axes):
    mesh = _mesh(per_node)
    s = _strategy(experts_node, mesh, hidden, gate_up)
    pairs = TOKENS * K / split
    assert routed_pairs(TOKENS, K, mesh.shape, token_axes=s.input_specs[0].shard_axes(0),
                        expert_axes=s.input_specs[3].shard_axes(0)) == pairs
    forward = sum(_exchange(mesh, a, pairs)[0] for a in axes)
    backward = sum(_exchange(mesh, a, pairs)[1] for a in axes)
    assert s.forward_comm_s == pytest.approx(forward, rel=1e-12)
    assert s.kernel_bwd_comm_s == pytest.approx(backward, rel=1e-12)


def test_no_exchange_without_tokens_and_experts_on_one_axis(experts_node):
    mesh = _mesh()
    for hidden, gate_up in (("S0R", "RR"), ("RR", "S0R"), ("S0R", "RS0")):
        s = _strategy(experts_node, mesh, hidden, gate_up)
        assert s.forward_comm_s == 0.0 and s.kernel_bwd_comm_s == 0.0
