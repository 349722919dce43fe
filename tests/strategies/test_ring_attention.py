"""Ring attention (``strategies/_ring_attention.py``) beyond the per-rule numeric check: its
pricing (the zig-zag layout's permutation and balanced causal share), that every rank computes the
same causal work, where it is not offered, and a sequence split over three mesh axes (a ring of
rings, zig-zag routed one axis at a time)."""

import pytest
import torch

from autopar.layout.cost import collective_seconds, ring_seconds
from autopar.layout.mesh import MeshSpec
from autopar.strategies import enumerate_strategies
from autopar.strategies._zigzag import ZigZag, causal_share
from autopar.strategies.check import check_strategy, reference
from autopar.strategies.registry import Sample
from autopar.strategies.samples import rand

SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _ring(sample: Sample, shape: tuple[int, ...]):
    ref = reference(SDPA, sample)
    strategies = enumerate_strategies(ref[0], MeshSpec.preset("cpu", shape), flops=(1e9, 2e9))
    return ref, [s for s in strategies if s.kernel == "ring_attention"]


def test_the_ring_is_priced_as_its_steps():
    """Non-causal: the plain layout, the ring's shifts only. Causal: the same shifts plus the
    zig-zag permutation, one all-to-all each for query, key, value and the output (forward) and
    their gradients (backward)."""
    mesh = MeshSpec.preset("cpu", (4,))
    block = 2 * (4 * 1 * 2 * 4 * 8)  # the local key and value (GQA: one head each travels), float64
    ring_fwd = ring_seconds(block, mesh, (0,), closed=False)
    ring_bwd = ring_fwd + ring_seconds(block, mesh, (0,), closed=True)
    local = {"query": 4 * 2 * 2 * 4 * 8, "key": 4 * 1 * 2 * 4 * 8, "value": 4 * 1 * 2 * 4 * 8, "out": 4 * 2 * 2 * 4 * 8}
    perm = sum(collective_seconds("all_to_all", b * 4, mesh, 0) for b in local.values())
    for causal, extra in ((False, 0.0), (True, perm)):
        args = (rand(4, 2, 8, 4), rand(4, 1, 8, 4), rand(4, 1, 8, 4))
        sample = Sample(args, {"is_causal": causal, "enable_gqa": True})
        _, rings = _ring(sample, (4,))
        assert [s.name for s in rings] == ["S2 x S2 x S2 -> S2"]
        ring = rings[0]
        assert ring.forward_comm_s == pytest.approx(ring_fwd + extra, rel=1e-12)
        assert ring.kernel_bwd_comm_s == pytest.approx(ring_bwd + extra, rel=1e-12)
        assert ring.work_split_axes == (0,) and not any(ring.grad_partial_axes)


def test_causal_work_is_priced_at_the_balanced_share():
    """The profile counts causal attention as the unmasked product (the fused kernels' count). The
    zig-zag ring on ``m`` ranks computes ``2m + 1`` of the ``(2m)^2`` chunk pairs on every rank
    (``causal_share``), so its compute is priced at ``(2m + 1) / (4m^2)`` of that product where the
    plain ring (non-causal here) takes ``1 / m``; a batch split on a second axis divides on top."""
    import torch.nn.functional as F
    from torch import nn

    from autopar.strategies import needs_decomposition
    from autopar.tracer import profile, trace

    class Attention(nn.Module):
        def __init__(self, causal: bool) -> None:
            super().__init__()
            self.proj, self.causal = nn.Linear(16, 16), causal

        def forward(self, x):
            q = self.proj(x).unflatten(-1, (2, 8)).transpose(1, 2)
            return F.scaled_dot_product_attention(q, q, q, is_causal=self.causal).sum()

    flops = []
    for causal in (False, True):
        traced = trace(Attention(causal), (torch.empty(4, 64, 16, device="meta"),), decompose_if=needs_decomposition)
        node = next(n.name for n in traced.compute_nodes() if n.target is SDPA)
        flops.append((profile(traced)[node].fwd_flops, profile(traced)[node].bwd_flops))
    assert flops[0] == flops[1] and flops[0][0] > 0
    assert causal_share(ZigZag(64, 4), ZigZag(64, 4)) == 9 / 64
    assert causal_share(ZigZag(12, 2), ZigZag(12, 2)) == (3 * 3 + 3 * 3 + 3 * 9) / 144  # blocks of 3 rows
    big = (1e12, 2e12)  # compute-bound on the preset: the roofline is the FLOPs' term
    q = rand(4, 2, 64, 4)
    for shape, seq_ranks, others in (((4,), 4, 1), ((2, 2), 2, 2)):
        mesh = MeshSpec.preset("cpu", shape)
        compute = {}
        for causal in (False, True):
            ref = reference(SDPA, Sample((q, q, q), {"is_causal": causal}))
            rings = [s for s in enumerate_strategies(ref[0], mesh, flops=big) if s.kernel == "ring_attention"
                     and s.input_specs[0].shard_axes(2) == (len(shape) - 1,)
                     and (others == 1 or s.input_specs[0].shard_axes(0) == (0,))]
            compute[causal] = rings[0].compute_s
        share = causal_share(ZigZag(64, seq_ranks), ZigZag(64, seq_ranks))
        assert compute[True] == pytest.approx(compute[False] * share * seq_ranks, rel=1e-9)


def test_every_rank_computes_the_same_causal_work(monkeypatch):
    """Counting the score blocks each rank computes (forward and backward) in the per-rule
    check's simulated ranks: on (4,), causal and under HF's causal+padding mask (whose whole-masked
    blocks are skipped by their values), every rank computes the same ``(2m + 1)`` chunk pairs."""
    from collections import Counter

    from autopar.strategies import _ring_attention

    work: Counter = Counter()
    scores = _ring_attention._Problem.scores

    def counted(self, q, k, qseg, kseg):
        s = scores(self, q, k, qseg, kseg)
        if s is not None:
            work[self.ctx.coords()] += qseg[2] * kseg[2]
        return s

    monkeypatch.setattr(_ring_attention._Problem, "scores", counted)
    mask = torch.ones(16, 16, dtype=torch.bool).tril().expand(2, 1, 16, 16)
    for args, kwargs in (((rand(2, 2, 16, 4),) * 3, {"is_causal": True}), ((rand(2, 2, 16, 4),) * 3 + (mask,), {})):
        work.clear()
        sample = Sample(args, kwargs)
        ref, rings = _ring(sample, (4,))
        check_strategy(SDPA, sample, rings[0], (4,), ref=ref)
        assert set(work.values()) == {2 * 9 * 2 * 2}, work  # forward + backward, 9 pairs of 2 x 2 rows


def test_no_ring_under_attention_dropout():
    sample = Sample((rand(4, 2, 8, 4), rand(4, 2, 8, 4), rand(4, 2, 8, 4)), {"dropout_p": 0.2})
    assert _ring(sample, (4,))[1] == []


@pytest.mark.parametrize("label, kwargs, mask", [
    ("causal-gqa", {"is_causal": True, "enable_gqa": True}, None),
    ("bool-mask", {}, torch.ones(8, 8, dtype=torch.bool).tril()),
])
def test_a_sequence_split_over_three_axes(label, kwargs, mask):
    heads_kv = 1 if kwargs.get("enable_gqa") else 2
    args = (rand(2, 2, 8, 4), rand(2, heads_kv, 8, 4), rand(2, heads_kv, 8, 4)) + ((mask,) if mask is not None else ())
    sample = Sample(args, kwargs, label)
    ref, rings = _ring(sample, (2, 2, 2))
    assert any(s.input_specs[0].shard_axes(2) == (0, 1, 2) for s in rings)
    for strategy in rings:
        check_strategy(SDPA, sample, strategy, (2, 2, 2), ref=ref)


def test_half_precision_accumulates_in_fp32():
    """bf16 blocks, fp32 scores, log-sum-exp, output and travelling gradients (as the fused
    kernels accumulate): the ring on 4 ranks is as close to torch's bf16 kernel as bf16 allows."""
    gen = torch.Generator().manual_seed(0)
    shapes = ((2, 4, 64, 16), (2, 2, 64, 16), (2, 2, 64, 16))
    args = tuple(torch.randn(shape, generator=gen).to(torch.bfloat16) for shape in shapes)
    for kwargs in ({"is_causal": True, "enable_gqa": True}, {"enable_gqa": True}):
        sample = Sample(args, kwargs)
        ref, rings = _ring(sample, (4,))
        check_strategy(SDPA, sample, rings[0], (4,), ref=ref, rtol=2e-2, atol=2e-2)
