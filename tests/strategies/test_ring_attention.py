"""Ring attention (``strategies/_ring_attention.py``) beyond the per-rule numeric check: its
pricing, where it is not offered, and a sequence split over three mesh axes (a ring of rings)."""

import pytest
import torch

from autopar.layout.cost import ring_seconds
from autopar.layout.mesh import MeshSpec
from autopar.strategies import enumerate_strategies
from autopar.strategies.check import check_strategy, reference
from autopar.strategies.registry import Sample
from autopar.strategies.samples import rand

SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _ring(sample: Sample, shape: tuple[int, ...]):
    ref = reference(SDPA, sample)
    strategies = enumerate_strategies(ref[0], MeshSpec.preset("cpu", shape), flops=(1e9, 2e9))
    return ref, [s for s in strategies if s.kernel == "ring_attention"]


def test_the_ring_is_priced_as_its_steps():
    sample = Sample((rand(4, 2, 8, 4), rand(4, 1, 8, 4), rand(4, 1, 8, 4)), {"is_causal": True, "enable_gqa": True})
    mesh = MeshSpec.preset("cpu", (4,))
    _, rings = _ring(sample, (4,))
    assert [s.name for s in rings] == ["S2 x S2 x S2 -> S2"]
    ring = rings[0]
    block = 2 * (4 * 1 * 2 * 4 * 8)  # the local key and value (GQA: one head each travels), float64
    assert ring.forward_comm_s == ring_seconds(block, mesh, (0,), closed=False)
    assert ring.kernel_bwd_comm_s == ring.forward_comm_s + ring_seconds(block, mesh, (0,), closed=True)
    assert ring.work_split_axes == (0,) and not any(ring.grad_partial_axes)


def test_causal_work_is_priced_at_the_last_ranks_share():
    """The profile counts causal attention as the unmasked product (the fused kernels' count), so
    the ring's FLOPs over ``n`` ranks are the last rank's ``n`` blocks: the share the step waits
    for (the zig-zag balance is no per-axis placement; the other ranks idle)."""
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
