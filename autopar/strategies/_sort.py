"""Sorting, selection and arg-reductions along one dim: topk, sort, argsort, msort, max.dim, min.dim,
argmax, argmin, kthvalue, median.dim, nanmedian.dim, mode, cummax, cummin.
Local op: the same op on local shards.

Each op works on the 1-D slices along ``dim`` independently, so the single-axis option is:

- split any dim other than ``dim``: the input is sharded on it, every output (values and
  indices alike) on the dim it becomes -- the same dim when the op keeps the rank (sort, topk,
  the scans, ``keepdim=True``), one less for dims after a removed ``dim``. The indices are
  positions along the unsplit ``dim``, so they are global positions on every rank.

Not offered: splitting ``dim`` itself (a local top-k / sort / arg-max gives local positions and
needs the other ranks' candidates: an all-gather and a second pass), and ``Partial`` inputs
(none of these ops is linear). Indices are integer outputs, never ``Partial``.
``argmax``/``argmin`` with ``dim=None`` reduce the flattened tensor: replicated only.
``aten.max.other``/``aten.min.other`` are pointwise-tagged ops: the generic pointwise rule covers
them, not this family.
"""

from __future__ import annotations

import torch

from autopar.layout.placement import Shard
from autopar.strategies.registry import AxisOption, OpInfo, Sample, register
from autopar.strategies.samples import ints, rand

aten = torch.ops.aten

__all__ = ["along_dim_options"]


def along_dim_options(info: OpInfo, dim: int | None, *, removes_dim: bool) -> list[AxisOption]:
    """Split every dim except ``dim``; ``removes_dim``: the outputs lack ``dim``."""
    ndim = info.input("self").ndim
    if dim is None or ndim == 0:
        return []  # a reduction of the flattened tensor (or of a 0-d one): nothing to split
    dim %= ndim
    options = []
    for d in range(ndim):
        if d == dim:
            continue
        out = Shard(d - 1 if removes_dim and d > dim else d)
        options.append(info.option([out] * len(info.outputs) if info.multi_output else out, self=Shard(d)))
    return options


def _keeps_rank(info: OpInfo) -> bool:
    return bool(info.bound.get("keepdim", False))


# ------------------------------------------------------------------------------------ rules
def _dim_rule(info: OpInfo) -> list[AxisOption]:
    """Ops with a ``dim`` argument whose outputs have ``self``'s rank (sort, topk, scans)."""
    return along_dim_options(info, info.arg("dim"), removes_dim=False)


def _reduce_rule(info: OpInfo) -> list[AxisOption]:
    """Ops that reduce ``dim`` away unless ``keepdim`` (max.dim, argmax, median ...)."""
    return along_dim_options(info, info.arg("dim"), removes_dim=not _keeps_rank(info))


def _msort_rule(info: OpInfo) -> list[AxisOption]:
    return along_dim_options(info, 0, removes_dim=False)


# --------------------------------------------------------------------------------- samples
def _with_ties() -> torch.Tensor:
    # Small integers as floats: ``mode`` needs repeated values to be meaningful.
    return ints(3, 4, 8, 4).to(torch.float64)


def _topk_samples() -> list[Sample]:
    return [
        Sample((rand(4, 8, 4), 2, 1), label="middle"),
        Sample((rand(8, 4), 2), label="last-default"),
        Sample((rand(4, 8, 4), 4, 0, False, True), label="smallest-dim0"),
    ]


def _sort_samples() -> list[Sample]:
    return [Sample((rand(4, 8, 4), 1), label="middle"), Sample((rand(4, 8), -1, True), label="descending-last")]


def _sort_stable_samples() -> list[Sample]:
    return [Sample((_with_ties(),), {"stable": True, "dim": 1}, "ties-middle"),
            Sample((rand(8, 4),), {"stable": True, "dim": 0, "descending": True}, "descending-first")]


def _reduce_samples() -> list[Sample]:
    return [
        Sample((rand(4, 8, 4), 1), label="middle"),
        Sample((rand(4, 8, 4), -1, True), label="last-keepdim"),
        Sample((rand(8, 4), 0), label="first"),
    ]


def _arg_samples() -> list[Sample]:
    return [
        Sample((rand(4, 8, 4), 1), label="middle"),
        Sample((rand(4, 8), -1, True), label="last-keepdim"),
        Sample((ints(10, 8, 4), 0), label="int"),
    ]


def _kth_samples() -> list[Sample]:
    return [Sample((rand(4, 8, 4), 3, 1), label="middle"), Sample((rand(4, 8), 2, -1, True), label="last-keepdim")]


def _mode_samples() -> list[Sample]:
    return [Sample((_with_ties(), 1), label="middle"), Sample((_with_ties(), -1, True), label="last-keepdim")]


def _scan_samples() -> list[Sample]:
    return [Sample((rand(4, 8, 4), 1), label="middle"), Sample((rand(8, 4), 0), label="first")]


# ---------------------------------------------------------------------------------- table
_TABLE = {
    aten.topk.default: (_topk_samples, _dim_rule),
    aten.sort.default: (_sort_samples, _dim_rule),
    aten.sort.stable: (_sort_stable_samples, _dim_rule),
    aten.argsort.default: (_sort_samples, _dim_rule),
    aten.argsort.stable: (_sort_stable_samples, _dim_rule),
    aten.msort.default: (lambda: [Sample((rand(8, 4, 4),))], _msort_rule),
    aten.cummax.default: (_scan_samples, _dim_rule),
    aten.cummin.default: (_scan_samples, _dim_rule),
    aten.max.dim: (_reduce_samples, _reduce_rule),
    aten.min.dim: (_reduce_samples, _reduce_rule),
    aten.median.dim: (_reduce_samples, _reduce_rule),
    aten.nanmedian.dim: (_reduce_samples, _reduce_rule),
    aten.argmax.default: (_arg_samples, _reduce_rule),
    aten.argmin.default: (_arg_samples, _reduce_rule),
    aten.kthvalue.default: (_kth_samples, _reduce_rule),
    aten.mode.default: (_mode_samples, _reduce_rule),
}

for _op, (_samples, _rule) in _TABLE.items():
    register(_op, samples=_samples)(_rule)
