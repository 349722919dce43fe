"""Scatter and indexed writes, as MoE routing uses them: scatter (src / value), scatter_add,
scatter_reduce, index_add, index_copy, index_fill, index_put, masked_scatter, one_hot, and their
in-place forms (sharded like the out-of-place ones). Local op: the same op on local shards.

Index values are positions along the written ``dim`` of ``self`` (``dim`` here; for index_put the
indexed dims), so those dims of ``self`` are never split. Single-axis options:

- split a dim ``d != dim`` on which ``self``, ``index`` and ``src`` all have the same size
  (``scatter*``'s ``index`` may be smaller than ``self``/``src``; a smaller one covers only a
  corner, which a split would misplace). index_add/index_copy/index_fill take a 1-D ``index``
  along ``dim``: ``self`` and ``source`` are split on ``d`` alike, ``index`` is replicated. For
  index_put the non-indexed dims of ``self`` split, ``values`` follows where it has the dim at
  full size (it broadcasts to the indexed shape; a broadcast dim is read whole).
- ``Partial`` pass-through where the op is linear in its float inputs *jointly* (every output
  element is one of them, or a sum of them, with data-independent weights):
  scatter.src, index_copy, index_put, masked_scatter (copies: ``self P, src P -> P``),
  scatter_add, index_add, scatter_reduce sum/mean (sums and means with fixed counts),
  index_fill with a tensor value (``self P, value P``); a Python scalar fill (scatter.value,
  index_fill.int_Scalar) only when it is 0 -- any other fill would be added once per rank.
  Every rank does the full work.
- split the *scattered* positions of a summing scatter (scatter_add, index_add, scatter_reduce
  sum with ``include_self``, index_put with ``accumulate``): ``index`` and ``src`` are split on
  ``dim`` (index_put: on a dim of the broadcast index shape), ``self`` is ``Partial``, the output
  is ``Partial``: ``self + sum_r scatter(src_r)`` is the sum over ranks of
  ``self_r + scatter(src_r)``. This is how tokens split over ranks are combined into per-token
  outputs. A replacing scatter cannot do this (a rank's write would hide the others' summands).

one_hot: every dim of ``self`` may be split (the class dim is new and whole) when
``num_classes`` is given; with ``num_classes=-1`` the local op would infer the class count from
its shard: replicated only. Boolean-mask index_put (data-dependent shape): replicated only.
masked_scatter consumes ``source`` in the global order of the mask's true entries, which no
split preserves: only the ``Partial`` pass-through.
"""

from __future__ import annotations

from typing import Sequence

import torch

from autopar.layout.placement import Partial, Replicate, Shard
from autopar.strategies.registry import AxisOption, OpInfo, Sample, TensorMeta, register
from autopar.strategies.samples import ints, rand, randbool

aten = torch.ops.aten
R, P = Replicate(), Partial()


def _present(info: OpInfo, names: Sequence[str]) -> list[str]:
    return [n for n in names if info.input(n) is not None]


def _dim(info: OpInfo) -> int:
    ndim = info.input("self").ndim
    return info.arg("dim") % ndim if ndim else 0


def _other_dims(info: OpInfo, split: Sequence[str]) -> list[AxisOption]:
    """Split each dim ``!= dim`` on which every tensor in ``split`` has ``self``'s size."""
    self_meta = info.input("self")
    names = _present(info, split)
    options = []
    for d in range(self_meta.ndim):
        if d == _dim(info):
            continue
        if all(info.input(n).ndim == self_meta.ndim and info.input(n).shape[d] == self_meta.shape[d] for n in names):
            options.append(info.option(Shard(d), **{n: Shard(d) for n in names}))
    return options


def _pass_partial(info: OpInfo, names: Sequence[str]) -> list[AxisOption]:
    return [info.option(P, work_split=False, **{n: P for n in _present(info, names)})]


def _scattered_split(info: OpInfo, index: str, src: str, index_dim: int, src_dim: int) -> list[AxisOption]:
    """Split the scattered positions of a summing scatter: ``self P`` -> ``P`` (see docstring)."""
    index_meta, src_meta = info.input(index), info.input(src)
    if index_meta.ndim <= index_dim or src_meta.ndim <= src_dim:
        return []  # 0-d index or source: a single position, nothing to split
    if index_meta.shape[index_dim] != src_meta.shape[src_dim]:
        return []  # a shorter index reads only the head of ``src``: its chunks would not align
    return [info.option(P, self=P, **{index: Shard(index_dim), src: Shard(src_dim)})]


def _is_zero(value) -> bool:
    return not isinstance(value, TensorMeta) and value == 0


# ----------------------------------------------------------------------------- scatter family
def _scatter_src(info: OpInfo) -> list[AxisOption]:
    return _other_dims(info, ("self", "index", "src")) + _pass_partial(info, ("self", "src"))


def _scatter_value(info: OpInfo) -> list[AxisOption]:
    options = _other_dims(info, ("self", "index"))
    return options + (_pass_partial(info, ("self",)) if _is_zero(info.arg("value")) else [])


def _scatter_add(info: OpInfo) -> list[AxisOption]:
    dim = _dim(info)
    return (_other_dims(info, ("self", "index", "src")) + _pass_partial(info, ("self", "src"))
            + _scattered_split(info, "index", "src", dim, dim))


def _scatter_reduce(info: OpInfo) -> list[AxisOption]:
    options = _other_dims(info, ("self", "index", "src"))
    reduce = info.arg("reduce")
    if reduce in ("sum", "mean"):
        options += _pass_partial(info, ("self", "src"))
    if reduce == "sum" and info.arg("include_self"):
        # Without ``include_self`` a rank's write drops its ``self`` summand where it scatters.
        options += _scattered_split(info, "index", "src", _dim(info), _dim(info))
    return options


def _unique_index(high: int, rows: int, num: int) -> torch.Tensor:
    """(rows, num) positions < high, distinct within each row: a replacing scatter is then
    deterministic (duplicate targets make ``scatter.src`` pick an arbitrary writer)."""
    return rand(rows, high).argsort(-1)[:, :num]


def _scatter_src_samples() -> list[Sample]:
    return [
        Sample((rand(4, 8), 1, _unique_index(8, 4, 4), rand(4, 4)), label="dim-1"),
        Sample((rand(8, 4), 0, _unique_index(8, 4, 4).T.contiguous(), rand(4, 4)), label="dim-0"),
        Sample((rand(8, 8), 1, _unique_index(8, 4, 4), rand(4, 4)), label="corner-index"),
        Sample((torch.zeros(8, 4, dtype=torch.float64), 1, _unique_index(4, 8, 2), rand(8, 2)), label="moe-weights"),
    ]


def _scatter_value_samples() -> list[Sample]:
    return [Sample((rand(4, 8), 1, ints(8, 4, 4), 2.5), label="fill"),
            Sample((rand(4, 4, 8), 2, ints(8, 4, 4, 4), 0.0), label="zero")]


def _scatter_add_samples() -> list[Sample]:
    return [
        Sample((rand(4, 8), 1, ints(8, 4, 8), rand(4, 8)), label="dim-1"),
        Sample((rand(8, 4), 0, ints(8, 8, 4), rand(8, 4)), label="dim-0"),
        Sample((rand(4, 8, 4), 1, ints(8, 4, 4, 4), rand(4, 4, 4)), label="fewer-positions"),
    ]


def _scatter_reduce_samples() -> list[Sample]:
    return [
        Sample((rand(4, 8), 1, ints(8, 4, 8), rand(4, 8), "sum"), label="sum"),
        Sample((rand(4, 8), 1, ints(8, 4, 8), rand(4, 8), "sum"), {"include_self": False}, "sum-exclude"),
        Sample((rand(8, 4), 0, ints(8, 8, 4), rand(8, 4), "mean"), label="mean"),
        Sample((rand(8, 4), 0, ints(8, 8, 4), rand(8, 4), "amax"), {"include_self": False}, "amax"),
    ]


for _ops, _samples, _rule in [
    ((aten.scatter.src, aten.scatter_.src), _scatter_src_samples, _scatter_src),
    ((aten.scatter.value, aten.scatter_.value), _scatter_value_samples, _scatter_value),
    ((aten.scatter_add.default, aten.scatter_add_.default), _scatter_add_samples, _scatter_add),
    ((aten.scatter_reduce.two, aten.scatter_reduce_.two), _scatter_reduce_samples, _scatter_reduce),
]:
    register(*_ops, samples=_samples)(_rule)


# ----------------------------------------------------------------- index_add / copy / fill
def _index_add(info: OpInfo) -> list[AxisOption]:
    return (_other_dims(info, ("self", "source")) + _pass_partial(info, ("self", "source"))
            + _scattered_split(info, "index", "source", 0, _dim(info)))


def _index_copy(info: OpInfo) -> list[AxisOption]:
    return _other_dims(info, ("self", "source")) + _pass_partial(info, ("self", "source"))


def _index_fill(info: OpInfo) -> list[AxisOption]:
    options = _other_dims(info, ("self",))
    value = info.arg("value")
    if isinstance(value, TensorMeta) or _is_zero(value):
        options += _pass_partial(info, ("self", "value"))
    return options


def _index_add_samples() -> list[Sample]:
    return [
        Sample((rand(8, 4), 0, ints(8, 8), rand(8, 4)), {"alpha": 2.0}, "dim-0-alpha"),
        Sample((rand(4, 8, 4), 1, ints(8, 4), rand(4, 4, 4)), label="dim-1"),
    ]


def _index_copy_samples() -> list[Sample]:
    return [Sample((rand(8, 4), 0, torch.randperm(8)[:4], rand(4, 4)), label="dim-0"),
            Sample((rand(4, 8), -1, torch.tensor([5, 0, 3, 6]), rand(4, 4)), label="last")]


def _index_fill_samples() -> list[Sample]:
    return [Sample((rand(8, 4), 0, torch.tensor([1, 6]), 2.5), label="fill"),
            Sample((rand(4, 8, 4), 1, torch.tensor([0, 7, 3]), 0.0), label="zero")]


def _index_fill_tensor_samples() -> list[Sample]:
    return [Sample((rand(8, 4), 0, torch.tensor([1, 6]), rand()), label="dim-0"),
            Sample((rand(4, 8), 1, torch.tensor([2, 3, 2]), rand()), label="dim-1-repeat")]


for _ops, _samples, _rule in [
    ((aten.index_add.default, aten.index_add_.default), _index_add_samples, _index_add),
    ((aten.index_copy.default, aten.index_copy_.default), _index_copy_samples, _index_copy),
    ((aten.index_fill.int_Scalar, aten.index_fill_.int_Scalar), _index_fill_samples, _index_fill),
    ((aten.index_fill.int_Tensor, aten.index_fill_.int_Tensor), _index_fill_tensor_samples, _index_fill),
]:
    register(*_ops, samples=_samples)(_rule)


# -------------------------------------------------------------------------------- index_put
def _indexed_layout(self_meta: TensorMeta, indices: list) -> tuple[list[int], torch.Size, dict[int, int], int]:
    """Where ``self[indices]`` puts things (NumPy rules, as ``aten.index``): the indexed dims,
    the broadcast index shape, result dim of each non-indexed dim, first broadcast result dim."""
    present = [k for k, t in enumerate(indices) if t is not None]
    shape = torch.broadcast_shapes(*(indices[k].shape for k in present))
    rest = [d for d in range(self_meta.ndim) if d not in present]
    adjacent = present == list(range(present[0], present[-1] + 1))
    before = [d for d in rest if adjacent and d < present[0]]
    result = {d: (before.index(d) if d in before else len(shape) + rest.index(d)) for d in rest}
    return present, shape, result, len(before)


def _index_put(info: OpInfo) -> list[AxisOption]:
    self_meta, values, indices = info.input("self"), info.input("values"), info.arg("indices")
    present = [k for k, t in enumerate(indices) if t is not None]
    if not present or any(indices[k].dtype == torch.bool for k in present):
        return []  # a boolean mask: data-dependent shape, replicated only
    present, shape, result, first = _indexed_layout(self_meta, indices)
    num_result = self_meta.ndim - len(present) + len(shape)

    def values_on(r: int, size: int):
        j = r - (num_result - values.ndim)  # ``values`` broadcasts to the result, right-aligned
        return Shard(j) if j >= 0 and values.shape[j] == size else R

    options = [info.option(Shard(d), self=Shard(d), values=values_on(r, self_meta.shape[d]))
               for d, r in result.items()]
    options += _pass_partial(info, ("self", "values"))
    if info.arg("accumulate"):
        for b, size in enumerate(shape):
            placements: list = [None] * len(indices)
            for k in present:
                j = b - (len(shape) - indices[k].ndim)
                placements[k] = Shard(j) if j >= 0 and indices[k].shape[j] == size else R
            options.append(info.option(P, self=P, indices=placements, values=values_on(first + b, size)))
    return options


def _index_put_samples() -> list[Sample]:
    rows = torch.arange(4).view(4, 1)
    return [
        Sample((rand(8, 4), [ints(8, 8)], rand(8, 4), True), label="accumulate"),
        Sample((rand(8, 4), [torch.randperm(8)[:4]], rand(4)), label="copy-broadcast-values"),
        Sample((rand(4, 8), [None, torch.randperm(8)[:4]], rand(4, 4)), label="second-dim"),
        Sample((rand(4, 8, 4), [rows, ints(8, 1, 8)], rand(4, 8, 1), True), label="two-indices-accumulate"),
        Sample((rand(8), [ints(8, 8)], rand(), True), label="scalar-values-accumulate"),
    ]


register(aten.index_put.default, aten.index_put_.default, samples=_index_put_samples)(_index_put)


# --------------------------------------------------------------------- masked_scatter, one_hot
@register(aten.masked_scatter.default, aten.masked_scatter_.default, samples=lambda: [
    Sample((rand(4, 8), randbool(4, 8), rand(4, 8)), label="same-shape"),
    Sample((rand(4, 8), randbool(8), rand(40)), label="broadcast-mask"),
])
def _masked_scatter(info: OpInfo) -> list[AxisOption]:
    return _pass_partial(info, ("self", "source"))


@register(aten.one_hot.default, samples=lambda: [Sample((ints(8, 4, 8), 8), label="2d"),
                                                Sample((ints(4, 8), 4), label="1d")])
def _one_hot(info: OpInfo) -> list[AxisOption]:
    if info.arg("num_classes") < 0:
        return []  # the class count would come from each rank's own shard
    return [info.option(Shard(d), self=Shard(d)) for d in range(info.input("self").ndim)]


# ------------------------------------------------------------ slice_scatter, select_scatter
# What the tracer's functionalization writes through views becomes (``autopar.tracer.functionalize``):
# ``self`` with the part a slice / select picks replaced by ``src``. Every dim but the written one
# splits alike on both (the written dim's offsets are global); copies are linear jointly: P, P -> P.
@register(aten.slice_scatter.default, samples=lambda: [
    Sample((rand(4, 8), rand(4, 3), 1, 2, 5), label="inner"),
    Sample((rand(8, 4), rand(4, 4), 0, 0, 8, 2), label="strided"),
    Sample((rand(4, 4, 16), rand(4, 4, 8), 2, 8), label="tail"),
])
def _slice_scatter(info: OpInfo) -> list[AxisOption]:
    dim = _dim(info)
    return ([info.option(Shard(d), self=Shard(d), src=Shard(d)) for d in range(info.input("self").ndim) if d != dim]
            + _pass_partial(info, ("self", "src")))


@register(aten.select_scatter.default, samples=lambda: [
    Sample((rand(4, 8), rand(8), 0, 2), label="row"),
    Sample((rand(4, 8, 2), rand(4, 2), 1, 3), label="middle"),
])
def _select_scatter(info: OpInfo) -> list[AxisOption]:
    dim = _dim(info)
    return ([info.option(Shard(d), self=Shard(d), src=Shard(d if d < dim else d - 1))
             for d in range(info.input("self").ndim) if d != dim] + _pass_partial(info, ("self", "src")))
