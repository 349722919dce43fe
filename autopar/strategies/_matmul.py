"""Matmul family: mm, addmm, bmm, baddbmm, linear, matmul. Local op: the same op on local shards.

Each op is described einsum-style (one label per tensor dim) and ``einsum_options`` derives the
single-axis options from the labels:

- split an OUTPUT label (batch, row or column): every input holding that label is sharded on
  it (a broadcast size-1 dim stays replicated), the output is sharded on it;
- split a CONTRACTION label: every factor is sharded on it, the output is ``Partial``, and an
  additive input (bias) must be ``Partial`` too, or it would be added once per rank;
- carry a pending sum: one factor ``Partial``, the other factors replicated, additive inputs
  ``Partial`` -> ``Partial`` output (the op is linear in each factor). The work is not divided;
- a fused projection (``info.segments``, ``strategies/fused.py``): split the LAST output label
  into ``k`` segments, each split over the axis (``S(d/k)``), inputs holding it likewise -- the
  columns are independent, so any column subset is exact, and this one keeps q, k and v (or gate
  and up) of the same heads together.

Replicated inputs of a split computation get partial gradients (derived centrally).
"""

from __future__ import annotations

import string
from typing import Sequence

import torch

from autopar.layout.placement import Partial, Replicate, Shard
from autopar.strategies.registry import AxisOption, OpInfo, Sample, register
from autopar.strategies.samples import rand

aten = torch.ops.aten
R, P = Replicate(), Partial()

__all__ = ["einsum_options"]


def einsum_options(info: OpInfo, factors: dict[str, str], out: str, *,
                   additive: Sequence[str] = ()) -> list[AxisOption]:
    """Single-axis options of ``out = prod(factors) [+ additive]`` given dim labels per factor.

    ``factors`` maps a tensor argument name to its labels (one char per dim); ``additive`` names
    inputs added to the product, aligned to the right of ``out`` (broadcasting).
    """
    labels = dict(factors)
    for name in additive:
        meta = info.input(name)
        if meta is not None:
            labels[name] = out[len(out) - meta.ndim:] if meta.ndim else ""
    present = {n: label for n, label in labels.items() if info.input(n) is not None}
    out_sizes = dict(zip(out, info.output.shape))
    options = []
    for d, label in enumerate(out):
        ins = {}
        for name, lab in present.items():
            if label in lab:
                j = lab.index(label)
                # A broadcast (size-1) dim is read whole by every rank.
                ins[name] = Shard(j) if info.input(name).shape[j] == out_sizes[label] else R
        options.append(info.option(Shard(d), **ins))
    if out:
        label, d = out[-1], len(out) - 1
        for k in info.segments:
            ins = {name: Shard(j, k) if info.input(name).shape[j] == out_sizes[label] else R
                   for name, lab in present.items() if label in lab for j in [lab.index(label)]}
            options.append(info.option(Shard(d, k), **ins))
    contracted = [c for c in dict.fromkeys("".join(factors.values())) if c not in out]
    for label in contracted:
        if not all(label in factors[n] for n in factors if n in present):
            continue
        ins = {n: Shard(present[n].index(label)) for n in factors if n in present}
        ins.update({n: P for n in additive if n in present})
        options.append(info.option(P, **ins))
    for name in factors:
        if name not in present:
            continue
        ins = {name: P, **{n: P for n in additive if n in present}}
        options.append(info.option(P, work_split=False, **ins))
    return options


# ------------------------------------------------------------------------------ the rules
@register(aten.mm.default, has_flops=True, samples=lambda: [
    Sample((rand(8, 4), rand(4, 8))), Sample((rand(8, 4), rand(4, 16)), label="fused", segments=(2,))])
def _mm(info: OpInfo) -> list[AxisOption]:
    return einsum_options(info, {"self": "mk", "mat2": "kn"}, "mn")


def _addmm_samples() -> list[Sample]:
    return [
        Sample((rand(8), rand(4, 8), rand(8, 8)), {"beta": 0.5, "alpha": 2.0}, "bias-1d"),
        Sample((rand(4, 8), rand(4, 8), rand(8, 8)), label="bias-2d"),
        Sample((rand(1, 8), rand(4, 4), rand(4, 8)), label="bias-broadcast-rows"),
        # GPT-2's c_attn: q|k|v fused in the columns, cut in three afterwards.
        Sample((rand(24), rand(4, 8), rand(8, 24)), label="fused-qkv", segments=(3,)),
    ]


@register(aten.addmm.default, has_flops=True, samples=_addmm_samples)
def _addmm(info: OpInfo) -> list[AxisOption]:
    return einsum_options(info, {"mat1": "mk", "mat2": "kn"}, "mn", additive=["self"])


@register(aten.bmm.default, has_flops=True, samples=lambda: [Sample((rand(4, 4, 8), rand(4, 8, 4)))])
def _bmm(info: OpInfo) -> list[AxisOption]:
    return einsum_options(info, {"self": "bmk", "mat2": "bkn"}, "bmn")


@register(aten.baddbmm.default, has_flops=True,
          samples=lambda: [Sample((rand(4, 1, 8), rand(4, 4, 8), rand(4, 8, 8)), {"beta": 0.5})])
def _baddbmm(info: OpInfo) -> list[AxisOption]:
    return einsum_options(info, {"batch1": "bmk", "batch2": "bkn"}, "bmn", additive=["self"])


def _linear_samples() -> list[Sample]:
    return [
        Sample((rand(4, 8, 8), rand(4, 8), rand(4)), label="3d-bias"),
        Sample((rand(8, 4), rand(8, 4)), label="2d-nobias"),
        # Phi-3's gate_up_proj (cut in two) and qkv_proj (in three).
        Sample((rand(4, 4, 8), rand(16, 8)), label="fused-gate-up", segments=(2,)),
        Sample((rand(4, 8), rand(24, 8), rand(24)), label="fused-qkv", segments=(3,)),
    ]


@register(aten.linear.default, has_flops=True, samples=_linear_samples)
def _linear(info: OpInfo) -> list[AxisOption]:
    batch = string.ascii_uppercase[: info.input("input").ndim - 1]
    return einsum_options(info, {"input": batch + "k", "weight": "nk"}, batch + "n", additive=["bias"])


def _matmul_samples() -> list[Sample]:
    return [
        Sample((rand(4, 8, 4), rand(4, 8)), label="3d@2d"),
        Sample((rand(4, 1, 4, 8), rand(4, 8, 4)), label="broadcast-batch"),
        Sample((rand(4, 8), rand(8)), label="2d@1d"),
        Sample((rand(8), rand(4, 8, 4)), label="1d@3d"),
        Sample((rand(8), rand(8)), label="dot"),
    ]


@register(aten.matmul.default, has_flops=True, samples=_matmul_samples)
def _matmul(info: OpInfo) -> list[AxisOption]:
    a, b = info.input("self").ndim, info.input("other").ndim
    if a == 1 and b == 1:
        return einsum_options(info, {"self": "k", "other": "k"}, "")
    if b == 1:
        batch = string.ascii_uppercase[: a - 2]
        return einsum_options(info, {"self": batch + "mk", "other": "k"}, batch + "m")
    if a == 1:
        batch = string.ascii_uppercase[: b - 2]
        return einsum_options(info, {"self": "k", "other": batch + "kn"}, batch + "n")
    num_batch = max(a, b) - 2
    batch = string.ascii_uppercase[:num_batch]
    return einsum_options(
        info, {"self": batch[num_batch - (a - 2):] + "mk", "other": batch[num_batch - (b - 2):] + "kn"},
        batch + "mn",
    )
