"""Embedding lookup: ``out[..., :] = weight[indices[...], :]``.

Single-axis options:

- split any dim of ``indices`` (batch, sequence): same op on local shards; the replicated
  weight's gradient is partial (all-reduced in backward, derived centrally);
- split the hidden dim (weight dim 1): same op on local shards, output split on its last dim;
- split the vocabulary (weight dim 0) -> ``Partial`` output, custom kernel
  ``vocab_parallel_embedding``: each rank looks up only the ids inside its row range
  ``[lo, hi)``, writes zeros for the others, so the sum over the axis is the full lookup.
  ``padding_idx`` is translated to the local row, or dropped when another rank owns it.

``scale_grad_by_freq`` scales gradients by how often each id occurs in the *whole* batch, which a
rank holding part of the batch or part of the vocabulary cannot count: only the hidden split is
offered then.
"""

from __future__ import annotations

import torch

from autopar.layout.placement import Partial, Shard
from autopar.strategies.kernel_context import KernelContext
from autopar.strategies.registry import AxisOption, OpInfo, Sample, register, register_kernel
from autopar.strategies.samples import ints, rand

aten = torch.ops.aten
P = Partial()


def _no_comm(info, input_specs, output_specs, mesh) -> tuple[float, float]:
    # The partial output is reduced by whoever consumes it (an edge in the plan), not in here.
    return 0.0, 0.0


@register_kernel("vocab_parallel_embedding", comm_cost=_no_comm)
def vocab_parallel_embedding(ctx: KernelContext, weight, indices, padding_idx=-1,
                             scale_grad_by_freq=False, sparse=False):
    lo, hi = ctx.local_range("weight", 0)
    outside = (indices < lo) | (indices >= hi)
    local_ids = (indices - lo).masked_fill(outside, 0)
    local_pad = padding_idx - lo if lo <= padding_idx < hi else -1
    out = aten.embedding.default(weight, local_ids, local_pad, scale_grad_by_freq, sparse)
    # Zeroing the rows also stops their gradient from reaching local row 0.
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


def _embedding_samples() -> list[Sample]:
    return [
        Sample((rand(16, 8), ints(16, 4, 8)), label="2d-ids"),
        Sample((rand(16, 8), ints(16, 4, 4), 3), label="padding-idx"),
        Sample((rand(16, 8), ints(16, 8), -1, True), label="scale-grad-by-freq"),
    ]


@register(aten.embedding.default, samples=_embedding_samples)
def _embedding(info: OpInfo) -> list[AxisOption]:
    ids = info.input("indices")
    options = [info.option(Shard(ids.ndim), weight=Shard(1))]
    if info.arg("scale_grad_by_freq"):
        return options
    options += [info.option(Shard(d), indices=Shard(d)) for d in range(ids.ndim)]
    options.append(info.option(P, weight=Shard(0), kernel="vocab_parallel_embedding"))
    return options
