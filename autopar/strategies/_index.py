"""Slicing, indexing, splitting and joining: slice, select, index.Tensor, gather, index_select,
split / split_with_sizes / chunk / unbind, ``operator.getitem``, cat, stack, pad.
Local op: the same op on local shards (no argument depends on a sharded size).

The rule of the family: a dim that the op indexes, cuts, joins or pads is never split (its
positions would refer to global offsets); every other dim is split on input and output alike.
Every op is linear in its data input, so a pending sum passes through (``P -> P``), except a
pad with a non-zero fill value (every rank would add the fill). Index tensors are integers, so
never ``P``. Indexing ops also split the *index*: with the data replicated, each rank gathers its
share of the output positions exactly; the data's gradient (a scatter-add of the local output
gradient) is then partial, and the derived ``grad_partial`` all-reduces it.

A fused projection's cut (``strategies/fused.py``): a ``split`` / ``split_with_sizes`` /
``chunk`` into exactly ``k`` equal parts takes its input segmented on the cut dim, ``S(d/k)``,
and gives each part ``S(d)`` (each rank's local piece is its share of every part, in order; the
local op cuts with the local part size: ``local_args``); so does a ``slice`` that is one of the
``k`` equal segments of a dim whose slices make such a cut (Phi-3's ``qkv[..., :q]``, ...: local
bounds by ``local_args``). ``cat`` of ``k`` equal parts whose output goes on to such a cut
(``info.segments``) is the reverse.

Tuple outputs (``split``, ``unbind``): one placement per output element, all alike. Convention
for ``operator.getitem(producer, k)``: its one input slot is the producer's element ``k``, so the
layout it receives is the producer's ``output_specs[k]``; getitem is the identity on it (every
split and ``P`` pass through). The planner may resolve it to its producer without a decision
(``registry.needs_no_decision``).
"""

from __future__ import annotations

import operator
from typing import Sequence

import torch

from autopar.layout.placement import Partial, Replicate, Shard
from autopar.strategies.registry import AxisOption, OpInfo, Sample, register
from autopar.strategies.samples import ints, rand
from autopar.strategies.fused import equal_parts, slice_segment

aten = torch.ops.aten
R, P = Replicate(), Partial()


def _untouched_dims(info: OpInfo, touched: Sequence[int], out_dim=lambda d: d, name: str = "self") -> list[AxisOption]:
    """Split every input dim not in ``touched``; a pending sum passes through."""
    ndim = info.input(name).ndim
    touched = {d % ndim for d in touched} if ndim else set()
    outs = info.outputs
    options = []
    for d in range(ndim):
        if d not in touched:
            placement = Shard(out_dim(d))
            options.append(info.option([placement] * len(outs) if info.multi_output else placement,
                                       **{name: Shard(d)}))
    pending = [P] * len(outs) if info.multi_output else P
    options.append(info.option(pending, work_split=False, **{name: P}))
    return options


# ----------------------------------------------------------------------------- slice, select
def _is_full_slice(info: OpInfo) -> bool:
    size = info.input("self").shape[info.arg("dim") % info.input("self").ndim]
    start, end, step = info.arg("start"), info.arg("end"), info.arg("step")
    return (start in (None, 0)) and (end is None or end >= size) and step == 1


def _fused_slice(info: OpInfo) -> tuple[int, int, int] | None:
    """(dim, k, j) when the slice is segment ``j`` of a fused projection's ``k`` (``info.segments``)."""
    dim = info.arg("dim") % info.input("self").ndim
    seg = slice_segment(info.input("self").shape[dim], info.arg("start"), info.arg("end"), info.arg("step"))
    return (dim, *seg) if seg is not None and seg[0] in info.segments else None


def _local_slice(info: OpInfo, bound, input_specs, output_specs, mesh_shape):
    """A segment of an ``S(d/k)`` input: this rank's piece of it is its ``j``-th local segment."""
    fused = _fused_slice(info)
    if fused is not None and input_specs[0].segments(fused[0]) == fused[1]:
        dim, _, j = fused
        length = output_specs[0].local_shape(info.output.shape, mesh_shape)[dim]
        bound["start"], bound["end"] = j * length, (j + 1) * length
    return bound


@register(aten.slice.Tensor, local_args=_local_slice, samples=lambda: [
    Sample((rand(4, 8, 4), 1, 0, 4), label="head"),
    Sample((rand(4, 8), 1, 2, 9223372036854775807, 2), label="strided-to-end"),
    Sample((rand(4, 8), 0, 0, 9223372036854775807), label="full"),
    Sample((rand(4, 24), 1, 8, 16), label="fused-qkv-k", segments=(3,)),  # Phi-3's qkv[..., q:q + kv]
    Sample((rand(4, 24), -1, 16, 9223372036854775807), label="fused-qkv-v", segments=(3,)),
])
def _slice(info: OpInfo) -> list[AxisOption]:
    # A full-range slice (export emits them for ``x[:, 1:]``-style code) cuts nothing.
    options = _untouched_dims(info, [] if _is_full_slice(info) else [info.arg("dim")])
    fused = _fused_slice(info)
    if fused is not None:  # one part of a fused projection: S(d/k) in, that part split out
        options.append(info.option(Shard(fused[0]), self=Shard(fused[0], fused[1])))
    return options


@register(aten.select.int, samples=lambda: [Sample((rand(4, 8, 4), 1, 3)), Sample((rand(4, 8), 0, -1))])
def _select(info: OpInfo) -> list[AxisOption]:
    dim = info.arg("dim") % info.input("self").ndim
    return _untouched_dims(info, [dim], lambda d: d if d < dim else d - 1)


# ---------------------------------------------------------------------------------- index
def _index_samples() -> list[Sample]:
    rows = torch.arange(4).view(4, 1)
    return [
        Sample((rand(4, 8), [rows, ints(8, 1, 8)]), label="all-dims-broadcast"),
        Sample((rand(4, 8), [None, ints(8, 8)]), label="second-dim"),
        Sample((rand(4, 4, 8), [ints(4, 8), None, ints(8, 8)]), label="non-adjacent"),
    ]


@register(aten.index.Tensor, samples=_index_samples)
def _index(info: OpInfo) -> list[AxisOption]:
    self_meta, indices = info.input("self"), info.arg("indices")
    present = [k for k, t in enumerate(indices) if t is not None]
    if any(indices[k].dtype == torch.bool for k in present):
        return []  # a boolean mask gives a data-dependent shape: replicated only
    shape = torch.broadcast_shapes(*(indices[k].shape for k in present))
    rest = [d for d in range(self_meta.ndim) if d not in present]
    adjacent = present == list(range(present[0], present[-1] + 1))
    # Output dims: kept dims before the indexed block, the broadcast index dims, the rest;
    # non-adjacent index tensors put the broadcast dims first (NumPy rules).
    before = [d for d in rest if adjacent and d < present[0]]
    first_index_dim = len(before)
    out_of_rest = {}
    for d in rest:
        out_of_rest[d] = before.index(d) if d in before else len(before) + len(shape) + rest.index(d) - len(before)
    options = [info.option(Shard(out_d), self=Shard(d)) for d, out_d in out_of_rest.items()]
    for b, size in enumerate(shape):
        placements: list = [None] * len(indices)
        for k in present:
            meta = indices[k]
            j = b - (len(shape) - meta.ndim)
            placements[k] = Shard(j) if j >= 0 and meta.shape[j] == size else R
        options.append(info.option(Shard(first_index_dim + b), indices=placements))
    options.append(info.option(P, work_split=False, self=P))
    return options


@register(aten.gather.default, samples=lambda: [
    Sample((rand(4, 8), 1, ints(8, 4, 4)), label="dim-1"),
    Sample((rand(4, 8), 0, ints(4, 4, 8)), label="dim-0"),
    Sample((rand(1, 16), 1, ints(16, 1, 8)), label="narrower-index"),
])
def _gather(info: OpInfo) -> list[AxisOption]:
    data, index = info.input("self"), info.input("index")
    dim = info.arg("dim") % data.ndim
    options = [info.option(Shard(dim), index=Shard(dim))]
    for d in range(data.ndim):
        if d != dim and data.shape[d] == index.shape[d]:
            options.append(info.option(Shard(d), self=Shard(d), index=Shard(d)))
    options.append(info.option(P, work_split=False, self=P))
    return options


@register(aten.index_select.default, samples=lambda: [Sample((rand(4, 8), 1, ints(8, 4))),
                                                     Sample((rand(8, 4), 0, ints(8, 8)))])
def _index_select(info: OpInfo) -> list[AxisOption]:
    if info.input("self").ndim == 0:  # a 0-d self: nothing to split
        return []
    dim = info.arg("dim") % info.input("self").ndim
    return _untouched_dims(info, [dim]) + [info.option(Shard(dim), index=Shard(0))]


# ---------------------------------------------------------------------------------- split
_HOW = {aten.split.Tensor: "split_size", aten.split_with_sizes.default: "split_sizes", aten.chunk.default: "chunks"}


def _split_rule(info: OpInfo) -> list[AxisOption]:
    options = _untouched_dims(info, [info.arg("dim")])
    dim = info.arg("dim") % info.input("self").ndim
    parts = equal_parts(info.target, info.arg(_HOW[info.target]), info.input("self").shape[dim])
    if parts is not None and parts == len(info.outputs):
        options.append(info.option([Shard(dim)] * parts, self=Shard(dim, parts)))
    return options


def _local_split_sizes(info: OpInfo, bound, input_specs, output_specs, mesh_shape):
    """The cut in local part sizes (a split dim's parts are smaller on every rank)."""
    dim = info.arg("dim") % info.input("self").ndim
    sizes = [spec.local_shape(meta.shape, mesh_shape)[dim] for spec, meta in zip(output_specs, info.outputs)]
    if info.target is aten.split.Tensor:
        bound["split_size"] = sizes[0]  # the last part may be shorter; parts are split alike or not at all
    else:
        bound["split_sizes"] = sizes
    return bound


def _unbind_rule(info: OpInfo) -> list[AxisOption]:
    dim = info.arg("dim") % info.input("self").ndim
    return _untouched_dims(info, [dim], lambda d: d if d < dim else d - 1)


register(aten.split.Tensor, local_args=_local_split_sizes, samples=lambda: [
    Sample((rand(4, 12, 8), 4, 1)), Sample((rand(8, 4), 4)),
    Sample((rand(4, 4, 24), 8, 2), label="fused-qkv")])(_split_rule)
register(aten.split_with_sizes.default, local_args=_local_split_sizes, samples=lambda: [
    Sample((rand(4, 12, 8), [4, 8], 1)), Sample((rand(4, 24), [8, 8, 8], 1), label="fused-qkv")])(_split_rule)
register(aten.chunk.default, samples=lambda: [
    Sample((rand(4, 12, 8), 3, -2)), Sample((rand(4, 16), 2, -1), label="fused-gate-up")])(_split_rule)
register(aten.unbind.int, samples=lambda: [Sample((rand(4, 3, 8), 1))])(_unbind_rule)


def _getitem_samples() -> list[Sample]:
    return [Sample(([rand(4, 8), rand(4, 8), rand(4, 8)], 1), label="middle"),
            Sample(([rand(4, 4, 8), rand(4, 4, 8)], 0), label="first")]


@register(operator.getitem, samples=_getitem_samples)
def _getitem(info: OpInfo) -> list[AxisOption]:
    """Identity on the selected element. From an fx node there is one slot (the element); from
    concrete values (the numerical check) one slot per element, the others unused."""
    k = info.arg("arg1")
    picked = [s.index in (None, k) for s in info.slots]
    element = info.output
    options = []
    for p in [Shard(d) for d in range(element.ndim)] + ([P] if element.is_float else []):
        inputs = tuple(p if chosen else R for chosen in picked)
        options.append(AxisOption(inputs, (p,), work_split=not isinstance(p, Partial)))
    return options


# ------------------------------------------------------------------------------- cat, stack
@register(aten.cat.default, samples=lambda: [
    Sample(([rand(4, 4, 8), rand(4, 8, 8)], 1), label="dim-1"),
    Sample(([rand(4, 8), rand(4, 8), rand(4, 8)], -1), label="last-dim"),
    Sample(([rand(4, 8), rand(4, 8), rand(4, 8)], -1), label="fused-parts", segments=(3,)),
])
def _cat(info: OpInfo) -> list[AxisOption]:
    num = len(info.arg("tensors"))
    ndim = info.output.ndim
    dim = info.arg("dim") % ndim
    options = [info.option(Shard(d), tensors=[Shard(d)] * num) for d in range(ndim) if d != dim]
    sizes = {t.shape[dim] for t in info.arg("tensors") if t is not None}
    if num in info.segments and len(sizes) == 1:  # fused parts joined, to be cut again
        options.append(info.option(Shard(dim, num), tensors=[Shard(dim)] * num))
    options.append(info.option(P, work_split=False, tensors=[P] * num))
    return options


@register(aten.stack.default, samples=lambda: [Sample(([rand(4, 8), rand(4, 8)], 1)), Sample(([rand(4, 8)] * 3,))])
def _stack(info: OpInfo) -> list[AxisOption]:
    num = len(info.arg("tensors"))
    dim = info.arg("dim") % info.output.ndim
    options = [info.option(Shard(d if d < dim else d + 1), tensors=[Shard(d)] * num)
               for d in range(info.output.ndim - 1)]
    options.append(info.option(P, work_split=False, tensors=[P] * num))
    return options


# ------------------------------------------------------------------------------------ pad
def _padded_dims(ndim: int, pad: Sequence[int]) -> list[int]:
    # ``pad`` lists (before, after) pairs starting from the LAST dim.
    return [ndim - 1 - i for i in range(len(pad) // 2) if pad[2 * i] or pad[2 * i + 1]]


def _pad_rule(info: OpInfo) -> list[AxisOption]:
    ndim = info.input("self").ndim
    options = _untouched_dims(info, _padded_dims(ndim, info.arg("pad")))
    mode = info.bound.get("mode", "constant")
    value = info.arg("value")
    # Reflect/replicate/circular pads copy values (linear); a constant fill is not.
    if mode == "constant" and value not in (None, 0, 0.0):
        options = [o for o in options if not isinstance(o.outputs[0], Partial)]  # the fill is added once per rank
    return options


register(aten.pad.default, samples=lambda: [
    Sample((rand(4, 8), [0, 1], "constant", -100.0), label="fill"),
    Sample((rand(4, 8, 4), [1, 1, 0, 0]), label="zero-fill"),
    Sample((rand(4, 8, 4), [0, 0, 1, 2], "reflect"), label="reflect"),
])(_pad_rule)
register(aten.constant_pad_nd.default, samples=lambda: [Sample((rand(4, 8, 4), [1, 2], 0.0)),
                                                       Sample((rand(4, 8), [0, 0, 1, 0], 2.0))])(_pad_rule)
