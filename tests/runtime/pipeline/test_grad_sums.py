"""A pipeline stage's deferred gradient sums, bucketed (``runtime.pipeline.grad_sums``)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autopar.runtime.launch import run_local
from autopar.runtime.pipeline.grad_sums import DeferredSums
from autopar.runtime.process_mesh import ProcessMesh

SHAPES = {"a": (3, 5), "b": (7,), "c": (2, 2, 2), "d": (4,), "frozen": (3,)}


def _grads(rank: int) -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(100 + rank)
    out = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    out["frozen"] = None  # no gradient this step: every rank skips it
    return out


def _sum_on_ranks(rank: int, world: int, cap_bytes: int, spanning: bool) -> dict:
    pmesh = ProcessMesh(init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp")))
    if not spanning:  # as on a pipeline stage's sub-mesh, which forms no group over several axes
        pmesh.group_over = lambda axes: None
    leaves = {n: torch.zeros(s, requires_grad=True) for n, s in SHAPES.items()}
    for n, g in _grads(rank).items():
        leaves[n].grad = g
    # "a".."c" summed over dp, "d" over both axes (one collective on the group spanning them,
    # or a chain of two), "frozen" has no gradient.
    deferred = {"a": (1,), "b": (1,), "c": (1,), "d": (0, 1), "frozen": (1,)}
    sums = DeferredSums(deferred, leaves, pmesh=pmesh, cap_bytes=cap_bytes)
    calls = []
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        sums.run(leaves)
    finally:
        dist.all_reduce = real
    return {"grads": {n: None if t.grad is None else t.grad.clone() for n, t in leaves.items()},
            "calls": calls, "buckets": [b.names for b in sums.buckets]}


@pytest.mark.parametrize("spanning", [True, False], ids=["spanning-group", "chain"])
def test_deferred_sums_in_buckets_equal_the_per_parameter_sums(spanning):
    os.environ.pop("AUTOPAR_BUCKET_CAP_MB", None)
    coords = [(r // 2, r % 2) for r in range(4)]  # (pp, dp) of each rank
    per_rank = [_grads(r) for r in range(4)]
    d_calls = 1 if spanning else 2
    for cap, n_calls in ((2**20, 1 + d_calls), (0, 3 + d_calls)):
        results = run_local(_sum_on_ranks, 4, cap, spanning, timeout=120)
        for rank, res in enumerate(results):
            pp, dp = coords[rank]
            dp_peers = [r for r, c in enumerate(coords) if c[0] == pp]
            for name in ("a", "b", "c"):
                want = sum(per_rank[r][name] for r in dp_peers)
                assert torch.allclose(res["grads"][name], want, rtol=0, atol=1e-6), (cap, rank, name)
            want_d = sum(per_rank[r]["d"] for r in range(4))
            assert torch.allclose(res["grads"]["d"], want_d, rtol=0, atol=1e-6), (cap, rank)
            assert res["grads"]["frozen"] is None
            # One collective per bucket and group: "a", "b", "c" in one bucket over dp, "d" alone
            # (other axes); without a cap one per parameter.
            assert len(res["calls"]) == n_calls, (cap, res["calls"])
            if cap:
                assert sorted(map(sorted, res["buckets"])) == [["a", "b", "c", "frozen"], ["d"]]
                assert sorted(res["calls"]) == sorted([4] * d_calls + [7 + 15 + 8])


def _sum_transposed(rank: int, world: int) -> torch.Tensor:
    pmesh = ProcessMesh(init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)))
    leaf = torch.zeros(3, 5, requires_grad=True)
    leaf.grad = torch.full((5, 3), float(rank + 1)).t()  # alone in its bucket, not contiguous
    DeferredSums({"w": (0,)}, {"w": leaf}, pmesh=pmesh).run({"w": leaf})
    return leaf.grad.clone()


def test_a_lone_non_contiguous_gradient_is_summed_in_place():
    for got in run_local(_sum_transposed, 2, timeout=120):
        assert torch.equal(got, torch.full((3, 5), 3.0))
