"""Views and layout ops: view, reshape, flatten, unflatten, (un)squeeze, expand, permute, transpose, unfold,
identity copies. Local op: the same op on local shards, shape arguments rewritten to local sizes.

Which input dim becomes which output dim
----------------------------------------
A reshape from ``in`` to ``out`` is cut into *groups*: the shortest runs of input dims and output
dims with equal products (``(4, 16, 64) -> (4, 16, 4, 16)`` gives ``0->0``, ``1->1``,
``2->(2, 3)``). Within a group the elements are the same contiguous range in both shapes, so
splitting the group's MAJOR dim (its first dim of size > 1) into ``n`` equal chunks splits that
range into ``n`` contiguous chunks, which is also a split of the other side's major dim -- exact
exactly when both major dims divide by ``n`` (``expand.py`` checks both). A minor dim of a merged
group is never split: its chunks are strided in the merged dim. Dims that map 1:1 are groups of
one. Several mesh axes on the same major dim keep their major/minor order on both sides.

Every op here is linear, so a pending sum passes through: ``P -> P`` (the work is not split).

A segmented shard (``S(d/k)``, offered for the counts in ``info.segments``: a fused projection on
its way to the cut) maps like a plain one: each segment is a contiguous range of the group, cut
into ``n`` contiguous pieces, so a major dim's segmented split is the other side's major dim's
(both dividing by ``k * n``, which ``expand.py`` checks).

Runtime rewrite (``local_args``): ``view``/``reshape``/``_unsafe_view`` get the local output
shape as ``size`` (``-1`` entries become explicit), ``unflatten`` its local ``sizes``, ``expand``
the local ``size``. Splits are even, so the arguments are the same on every rank.

``expand`` also splits a broadcast dim: an input of size 1 (or a new leading dim) is read whole
by every rank and expanded to the local size; its gradient (a sum over the expanded rows) is then
partial over the axis, which the derived ``grad_partial`` all-reduces.

``squeeze.default`` is not registered: on a rank whose shard of a dim has size 1 it would squeeze
a dim the global op keeps.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from autopar.layout.placement import Partial, Replicate, Shard
from autopar.strategies.registry import AxisOption, OpInfo, Sample, register
from autopar.strategies.samples import rand

aten = torch.ops.aten
R, P = Replicate(), Partial()

__all__ = ["view_groups", "reshape_dim_map", "identity_options"]


# ------------------------------------------------------------------------------ dim groups
def view_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Cut a reshape ``src -> dst`` into the shortest (src dims, dst dims) runs of equal product."""
    if _prod(src) != _prod(dst):
        raise ValueError(f"cannot view shape {tuple(src)} as {tuple(dst)}: {_prod(src)} != {_prod(dst)} elements")
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        src_dims, dst_dims, src_size, dst_size = [], [], 1, 1
        if i < len(src):
            src_dims.append(i)
            src_size, i = src[i], i + 1
        if j < len(dst):
            dst_dims.append(j)
            dst_size, j = dst[j], j + 1
        while src_size != dst_size:
            # Both sides are finite and their products are equal, so one of them can grow.
            if src_size < dst_size and i < len(src):
                src_dims.append(i)
                src_size, i = src_size * src[i], i + 1
            elif j < len(dst):
                dst_dims.append(j)
                dst_size, j = dst_size * dst[j], j + 1
            else:
                raise ValueError(f"cannot group the view {tuple(src)} -> {tuple(dst)}")
        groups.append((src_dims, dst_dims))
    return groups


def _prod(shape: Sequence[int]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _major(dims: list[int], shape: Sequence[int]) -> int | None:
    return next((d for d in dims if shape[d] > 1), None)


def reshape_dim_map(src: Sequence[int], dst: Sequence[int]) -> dict[int, int]:
    """Input dim -> output dim for every input dim whose split is an exact split of the output."""
    out = {}
    for src_dims, dst_dims in view_groups(src, dst):
        a, b = _major(src_dims, src), _major(dst_dims, dst)
        if a is not None and b is not None:
            out[a] = b
    return out


def _dim_map_options(info: OpInfo, dim_map: dict[int, int], name: str = "self") -> list[AxisOption]:
    options = [info.option(Shard(out_dim, k), **{name: Shard(in_dim, k)})
               for k in (1, *info.segments) for in_dim, out_dim in dim_map.items()]
    options.append(info.option(P, work_split=False, **{name: P}))
    return options


def identity_options(info: OpInfo, name: str = "self") -> list[AxisOption]:
    """Every dim maps to itself; a pending sum passes through."""
    return _dim_map_options(info, {d: d for d in range(info.input(name).ndim)}, name)


# ----------------------------------------------------------------------- local arguments
def _local_out_shape(info: OpInfo, output_specs, mesh_shape) -> list[int]:
    return list(output_specs[0].local_shape(info.output.shape, mesh_shape))


def _local_size(arg: str):
    def rewrite(info: OpInfo, bound: dict[str, Any], input_specs, output_specs, mesh_shape) -> dict[str, Any]:
        bound[arg] = _local_out_shape(info, output_specs, mesh_shape)
        return bound

    return rewrite


def _local_unflatten_sizes(info: OpInfo, bound, input_specs, output_specs, mesh_shape):
    dim = info.arg("dim") % info.input("self").ndim
    bound["sizes"] = _local_out_shape(info, output_specs, mesh_shape)[dim: dim + len(info.arg("sizes"))]
    return bound


# ------------------------------------------------------------------------------ the rules
def _reshape_rule(info: OpInfo) -> list[AxisOption]:
    src, dst = info.input("self").shape, info.output.shape
    if 0 in src or 0 in dst:
        return [info.option(P, work_split=False, self=P)]  # an empty tensor: nothing to split
    return _dim_map_options(info, reshape_dim_map(src, dst))


def _squeeze_rule(info: OpInfo) -> list[AxisOption]:
    """A named dim of global size > 1 stays (a no-op), but it must not be split: a shard of size
    1 would be squeezed by the local op."""
    ndim = info.input("self").ndim
    named = info.arg("dim")
    named = {d % ndim for d in ([named] if isinstance(named, int) else named)} if ndim else set()
    return [o for o in _reshape_rule(info)
            if not any(isinstance(p, Shard) and p.dim in named for p in o.inputs if p is not None)]


def _view_samples() -> list[Sample]:
    return [
        Sample((rand(16, 24), [4, 4, 24]), label="fused-rows", segments=(3,)),
        Sample((rand(4, 24, 2), [4, 48]), label="fused-merge", segments=(3,)),
        Sample((rand(4, 8, 16), [4, 8, 4, -1]), label="split-last"),
        Sample((rand(8, 4, 4), [-1, 16]), label="merge"),
        Sample((rand(4, 1, 8), [4, 8]), label="drop-size-1"),
        Sample((rand(4, 8), [8, 4]), label="regroup"),
    ]


for _op, _arg in ((aten.view.default, "size"), (aten._unsafe_view.default, "size"), (aten.reshape.default, "shape")):
    register(_op, samples=_view_samples, local_args=_local_size(_arg))(_reshape_rule)


@register(aten.flatten.using_ints,
          samples=lambda: [Sample((rand(4, 8, 2, 2), 1), label="from-1"), Sample((rand(4, 4, 8), 0, 1), label="0-1")])
def _flatten(info: OpInfo) -> list[AxisOption]:
    return _reshape_rule(info)


@register(aten.unflatten.int, samples=lambda: [Sample((rand(4, 16), 1, [4, -1])), Sample((rand(8, 4), -2, [4, 2]))],
          local_args=_local_unflatten_sizes)
def _unflatten(info: OpInfo) -> list[AxisOption]:
    return _reshape_rule(info)


def _squeeze_samples() -> list[Sample]:
    return [Sample((rand(4, 1, 8), 1), label="size-1"), Sample((rand(4, 8), 0), label="no-op")]


register(aten.unsqueeze.default, samples=lambda: [Sample((rand(4, 8), 1)), Sample((rand(4, 8), -1))])(_reshape_rule)
register(aten.squeeze.dim, samples=_squeeze_samples)(_squeeze_rule)
register(aten.squeeze.dims, samples=lambda: [Sample((rand(4, 1, 8, 1), [1, 3])),
                                             Sample((rand(4, 8), [0, 1]), label="no-op")])(_squeeze_rule)


@register(aten.expand.default, local_args=_local_size("size"), samples=lambda: [
    Sample((rand(1, 8), [4, -1]), label="broadcast-rows"),
    Sample((rand(4, 1, 8), [4, 4, 8]), label="broadcast-middle"),
    Sample((rand(8), [4, 4, 8]), label="new-leading-dims"),
])
def _expand(info: OpInfo) -> list[AxisOption]:
    src, dst = info.input("self").shape, info.output.shape
    offset = len(dst) - len(src)
    options = []
    for d, size in enumerate(dst):
        j = d - offset
        if j >= 0 and src[j] == size:
            options.append(info.option(Shard(d), self=Shard(j)))
        else:
            options.append(info.option(Shard(d)))  # a broadcast dim: every rank reads the input whole
    options.append(info.option(P, work_split=False, self=P))
    return options


@register(aten.permute.default, samples=lambda: [Sample((rand(4, 8, 4), [2, 0, 1]))])
def _permute(info: OpInfo) -> list[AxisOption]:
    ndim = info.input("self").ndim
    return _dim_map_options(info, {d % ndim: k for k, d in enumerate(info.arg("dims"))})


@register(aten.transpose.int, samples=lambda: [Sample((rand(4, 8, 4), 1, 2)), Sample((rand(4, 8), -1, 0))])
def _transpose(info: OpInfo) -> list[AxisOption]:
    ndim = info.input("self").ndim
    a, b = info.arg("dim0") % ndim, info.arg("dim1") % ndim
    return _dim_map_options(info, {d: {a: b, b: a}.get(d, d) for d in range(ndim)})


@register(aten.t.default, samples=lambda: [Sample((rand(4, 8),)), Sample((rand(8),))])
def _t(info: OpInfo) -> list[AxisOption]:
    ndim = info.input("self").ndim
    return _dim_map_options(info, {d: ndim - 1 - d for d in range(ndim)})


def _complex_samples() -> list[Sample]:
    return [Sample((torch.complex(rand(4, 8), rand(4, 8)),))]


# Complex <-> real pairs (FNet's ``fft(...).real``): the complex dims are the first dims of the real
# view, whose last dim (real, imaginary) is never split; a pending sum passes through (linear).
register(aten.view_as_real.default, samples=_complex_samples)(identity_options)


@register(aten.view_as_complex.default, samples=lambda: [Sample((rand(4, 8, 2),))])
def _view_as_complex(info: OpInfo) -> list[AxisOption]:
    return _dim_map_options(info, {d: d for d in range(info.input("self").ndim - 1)})


# Identity copies and aliases: every dim stays where it is.
for _op in (aten.contiguous.default, aten.alias.default, aten.clone.default, aten.detach.default,
            aten.lift_fresh_copy.default):
    register(_op, samples=lambda: [Sample((rand(4, 8, 4),))])(identity_options)


def _unfold_samples() -> list[Sample]:
    return [Sample((rand(4, 16, 3), 1, 4, 4), label="patches"),
            Sample((rand(4, 10, 3), -2, 4, 2), label="overlapping"),
            Sample((rand(4, 3, 14), 2, 4, 4), label="remainder-dropped")]


@register(aten.unfold.default, samples=_unfold_samples)
def _unfold(info: OpInfo) -> list[AxisOption]:
    """``x.unfold(dim, size, step)`` (PatchTST's patches): the windows of ``dim`` become that
    dim, their elements a new last dim; every other dim keeps its index. ``dim`` itself splits
    only when the windows tile it exactly (``step == size`` dividing its length): a shard then
    holds whole windows, which ``expand.py``'s divisibility check on both sides keeps so.
    Overlapping windows or a dropped remainder would straddle or shift at a shard's edge."""
    shape = info.input("self").shape
    ndim = len(shape)
    dim = info.arg("dimension") % ndim if ndim else 0
    size, step = info.arg("size"), info.arg("step")
    dim_map = {d: d for d in range(ndim) if d != dim}
    if ndim and size == step and shape[dim] % size == 0:
        dim_map[dim] = dim
    return _dim_map_options(info, dim_map)
