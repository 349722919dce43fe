"""Mixture-of-experts routing pieces: token counts per expert and grouped matrix products.

``histc(self, bins, min, max)`` counts values into bins. Any dim of ``self`` may be split: each
rank counts its own values and the counts add up, so the output is ``Partial`` (a float count;
an integer count cannot be a pending sum and is pruned centrally). Counts are not
differentiable.

Grouped matrix product ``grouped_mm(input (S, K), weight (E, K, N), offs (E,)) -> (S, N)``: row
block ``offs[e-1]:offs[e]`` of ``input`` is multiplied by expert ``e``'s matrix. The rows are
sorted by expert and the offsets are global, so rows are never split. Single-axis options:

- output-feature split: ``weight`` S(2) -> output S(1) (each rank computes its columns);
- contraction split: ``input`` S(1), ``weight`` S(1) -> output ``P``;
- pending sums: ``input`` P (weight R) or ``weight`` P (input R) -> ``P`` (the product is
  bilinear), every rank doing the full work.

This is the op transformers 5 runs its experts with on CPU (``transformers::grouped_mm_fallback``,
registered by ``transformers.integrations.moe``); ``aten._grouped_mm`` has the same semantics but
no CPU kernel to check against. Foreign ops are looked up by name (``derived.FOREIGN_RULES``) so
that autopar does not import transformers.
"""

from __future__ import annotations

import torch

from autopar.layout.placement import Partial, Replicate, Shard
from autopar.strategies.registry import AxisOption, OpInfo, Sample, register
from autopar.strategies.samples import rand

aten = torch.ops.aten
R, P = Replicate(), Partial()

__all__ = ["grouped_mm_rule", "grouped_mm_samples"]


def _histc_rule(info: OpInfo) -> list[AxisOption]:
    return [info.option(P, self=Shard(d)) for d in range(info.input("self").ndim)]


register(aten.histc.default, samples=lambda: [
    Sample((torch.tensor([float(i % 4) for i in range(16)], dtype=torch.float64).reshape(4, 4), 4, 0, 3)),
])(_histc_rule)


def grouped_mm_rule(info: OpInfo) -> list[AxisOption]:
    x, w = info.slots[0].arg, info.slots[1].arg
    return [
        info.option(Shard(1), **{w: Shard(2)}),
        info.option(P, **{x: Shard(1), w: Shard(1)}),
        info.option(P, work_split=False, **{x: P}),
        info.option(P, work_split=False, **{w: P}),
    ]


def grouped_mm_samples() -> list[Sample]:
    offs = torch.tensor([4, 4, 12, 16], dtype=torch.int32)  # expert 1 gets no rows
    return [Sample((rand(16, 8), rand(4, 8, 12), offs), label="4 experts", no_grad=())]
