"""Pointwise and broadcasting ops. Local op: the same op on local shards.

Single-axis options of an elementwise op with output shape ``O``:

- split output dim ``d``: each tensor input is aligned to ``O`` from the right (broadcasting);
  an input that has dim ``d`` at full size is sharded on it, an input that lacks it or has
  size 1 there is replicated (and so gets a partial gradient, derived centrally); likewise
  segmented (``S(d/k)``) for the counts in ``info.segments`` (a fused projection on its way to
  its cut: elementwise, any layout of the elements is exact when every input has the same);
- pass a pending sum through where the op is linear: ``neg(P) -> P``; ``add/sub(P, P) -> P`` when
  both operands are tensors (a Python scalar would be added once per rank);
  ``mul(P, R) -> P`` either way round; ``div(P, R) -> P``; ``mul/div(P, scalar) -> P``. Every
  rank does the full-size work on its summand, so the work is not split.
"""

from __future__ import annotations

from typing import Callable

import torch

from autopar.layout.placement import Partial, Replicate, Shard
from autopar.strategies.registry import AxisOption, OpInfo, Sample, TensorMeta, register
from autopar.strategies.samples import rand, randbool

aten = torch.ops.aten
R, P = Replicate(), Partial()

__all__ = ["broadcast_options", "pointwise_rule"]


def broadcast_options(info: OpInfo) -> list[AxisOption]:
    """Split each output dim; inputs follow it when they have it at full size, else replicate."""
    out = info.output
    options = []
    for k in (1, *info.segments):
        for d in range(out.ndim):
            ins = {}
            for slot in info.slots:
                meta = slot.meta
                if meta is None:
                    continue
                j = d - (out.ndim - meta.ndim)
                ins[slot.arg] = Shard(j, k) if j >= 0 and meta.shape[j] == out.shape[d] else R
            options.append(info.option(Shard(d, k), **ins))
    return options


def pointwise_rule(partial: Callable[[OpInfo], list[AxisOption]] | None = None) -> Callable[[OpInfo], list[AxisOption]]:
    """A rule: broadcast splits, plus the ``Partial`` pass-throughs given by ``partial``."""

    def rule(info: OpInfo) -> list[AxisOption]:
        options = broadcast_options(info)
        if partial is not None:
            options += partial(info)
        return options

    rule.__name__ = f"pointwise_{partial.__name__ if partial else 'plain'}"
    rule.__module__ = __name__
    return rule


def _tensor_args(info: OpInfo) -> list[str]:
    return [s.arg for s in info.slots if s.meta is not None]


def _all_partial(info: OpInfo) -> list[AxisOption]:
    """Sum-like (add, sub, neg): every operand must be a tensor and all of them ``P``."""
    names = _tensor_args(info)
    if any(not isinstance(info.arg(n), TensorMeta) for n in ("self", "other") if n in info.bound):
        return []  # a Python scalar operand would be added on every rank
    return [info.option(P, work_split=False, **{n: P for n in names})]


def _one_partial(info: OpInfo) -> list[AxisOption]:
    """Product-like (mul): any one tensor operand ``P``, the others replicated."""
    return [info.option(P, work_split=False, **{n: P}) for n in _tensor_args(info)]


def _numerator_partial(info: OpInfo) -> list[AxisOption]:
    """Quotient (div): the numerator ``P``, the denominator replicated."""
    return [info.option(P, work_split=False, self=P)]


# --------------------------------------------------------------------------------- samples
def _unary_samples(positive: bool = False, **kwargs) -> Callable[[], list[Sample]]:
    return lambda: [Sample((rand(4, 8, positive=positive),), dict(kwargs), "2d")]


def _binary_samples(positive: bool = False, scalar: bool = False) -> Callable[[], list[Sample]]:
    def samples() -> list[Sample]:
        out = [
            Sample((rand(4, 8, positive=positive), rand(4, 8, positive=positive)), label="same"),
            Sample((rand(4, 8, positive=positive), rand(8, positive=positive)), label="broadcast-rows"),
            Sample((rand(4, 1, positive=positive), rand(1, 4, 8, positive=positive)), label="broadcast-both"),
            Sample((rand(4, 24, positive=positive), rand(24, positive=positive)), label="fused", segments=(3,)),
        ]
        if scalar:
            out.append(Sample((rand(4, 8, positive=positive), 1.5), label="scalar"))
        return out

    return samples


def _scalar_samples(value: float = 1.5, positive: bool = False) -> Callable[[], list[Sample]]:
    return lambda: [Sample((rand(4, 8, positive=positive), value))]


def _bool_samples() -> list[Sample]:
    return [Sample((randbool(4, 8), randbool(8)), label="broadcast")]


def _where_samples() -> list[Sample]:
    return [
        Sample((randbool(4, 8), rand(4, 8), rand(8)), label="broadcast"),
        Sample((randbool(1, 8), rand(4, 8), rand(4, 8)), label="mask-broadcast"),
    ]


def _masked_fill_samples() -> list[Sample]:
    return [Sample((rand(4, 4, 8), randbool(4, 1, 8), -1e4), label="broadcast-mask")]


# ---------------------------------------------------------------------------------- table
# op -> (samples, Partial pass-through); applied in one registration loop below.
_TABLE: dict = {
    aten.neg.default: (_unary_samples(), _all_partial),
    aten.add.Tensor: (_binary_samples(scalar=True), _all_partial),
    aten.sub.Tensor: (_binary_samples(scalar=True), _all_partial),
    aten.mul.Tensor: (_binary_samples(scalar=True), _one_partial),
    aten.div.Tensor: (_binary_samples(positive=True, scalar=True), _numerator_partial),
    aten.mul.Scalar: (_scalar_samples(), _one_partial),
    aten.div.Scalar: (_scalar_samples(), _numerator_partial),
    aten.add.Scalar: (_scalar_samples(), None),
    aten.sub.Scalar: (_scalar_samples(), None),
    aten.rsub.Scalar: (_scalar_samples(), None),
    aten.pow.Tensor_Scalar: (_scalar_samples(3.0), None),
    aten.pow.Tensor_Tensor: (_binary_samples(positive=True), None),
    aten.maximum.default: (_binary_samples(), None),
    aten.minimum.default: (_binary_samples(), None),
    aten.where.self: (_where_samples, None),
    aten.masked_fill.Scalar: (_masked_fill_samples, None),
    aten.gelu.default: (_unary_samples(approximate="tanh"), None),
    aten.silu.default: (_unary_samples(), None),
    aten.relu.default: (_unary_samples(), None),
    aten.tanh.default: (_unary_samples(), None),
    aten.sigmoid.default: (_unary_samples(), None),
    aten.exp.default: (_unary_samples(), None),
    aten.log.default: (_unary_samples(positive=True), None),
    aten.sqrt.default: (_unary_samples(positive=True), None),
    aten.rsqrt.default: (_unary_samples(positive=True), None),
    aten.reciprocal.default: (_unary_samples(positive=True), None),
    aten.abs.default: (_unary_samples(), None),
    aten.erf.default: (_unary_samples(), None),
    aten.sin.default: (_unary_samples(), None),
    aten.cos.default: (_unary_samples(), None),
    aten.eq.Tensor: (_binary_samples(), None),
    aten.ne.Tensor: (_binary_samples(), None),
    aten.lt.Tensor: (_binary_samples(), None),
    aten.le.Tensor: (_binary_samples(), None),
    aten.gt.Tensor: (_binary_samples(), None),
    aten.ge.Tensor: (_binary_samples(), None),
    aten.eq.Scalar: (_scalar_samples(0.0), None),
    aten.ne.Scalar: (_scalar_samples(0.0), None),
    aten.lt.Scalar: (_scalar_samples(0.0), None),
    aten.le.Scalar: (_scalar_samples(0.0), None),
    aten.gt.Scalar: (_scalar_samples(0.0), None),
    aten.ge.Scalar: (_scalar_samples(0.0), None),
    aten.__and__.Tensor: (_bool_samples, None),
    aten.__or__.Tensor: (_bool_samples, None),
    aten.logical_and.default: (_bool_samples, None),
    aten.logical_or.default: (_bool_samples, None),
    aten.logical_not.default: (lambda: [Sample((randbool(4, 8),))], None),
    # Fills (export keeps the in-place ones on fresh buffers; the tracer's functionalization makes
    # them out of place): the filled tensor keeps its layout.
    aten.fill_.Scalar: (_scalar_samples(2.0), None),
    aten.fill_.Tensor: (lambda: [Sample((rand(4, 8), rand()))], None),
    aten.fill.Scalar: (_scalar_samples(2.0), None),
    aten.fill.Tensor: (lambda: [Sample((rand(4, 8), rand()))], None),
}

for _op, (_samples, _partial) in _TABLE.items():
    register(_op, samples=_samples)(pointwise_rule(_partial))
