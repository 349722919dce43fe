"""Fused projections: which ops may offer a segmented shard ``S(d/k)``, and local pieces of one.

A fused projection computes several tensors in one matmul and cuts them apart later: GPT-2's
``c_attn`` (``q|k|v``, then ``split(hidden, dim=2)``), Phi-3's ``qkv_proj`` (three slices)
and ``gate_up_proj`` (``chunk(2, -1)``). Split plainly over an axis, the fused output gives rank 0
all of ``q`` and half of ``k``; split as ``S(d/k)`` (``layout.placement.Shard(d, segments=k)``)
every rank holds its share of each part, and the cut turns it into a plain ``S(d)`` of each part.

Offering ``S(d/k)`` to every op would multiply every strategy list; only the ops on the way to such
a cut need it. ``fused_segments(node)`` walks forward from ``node`` through the ops that carry the
layout unchanged (views, elementwise ops with that single tensor input) and returns the counts ``k``
of the cuts it reaches: a ``split`` / ``split_with_sizes`` / ``chunk`` into ``k >= 2`` equal parts,
or ``k`` slices of one dim, each one of its ``k`` equal segments (Phi-3's ``qkv[..., :q]``,
``qkv[..., q:2q]``, ...); a slice of such a cut is given its cut's ``k`` too. ``expand.op_info``
hands them to the rules as ``OpInfo.segments`` (the runtime's local arguments see the same), which
offer ``S(d/k)`` for those ``k`` only; whether a given ``S(d/k)`` is exact is still each rule's own
(checked numerically like any option), so the walk decides what is offered, never what is correct. A
parameter's segment counts are its readers' (``placeholder_segments``), so the planner offers it the
same layouts.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
import torch.fx

from autopar.layout.placement import TensorSpec

aten = torch.ops.aten

__all__ = ["fused_segments", "placeholder_segments", "equal_parts", "slice_segment", "take_local", "local_index",
           "take_index"]

# Ops that hand their one tensor input's layout on unchanged in the split dim (up to renumbering).
_CARRY = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default,
    aten.contiguous.default, aten.alias.default, aten.detach.default,
    aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor, aten.div.Tensor,
    aten._to_copy.default, aten.to.dtype,
}
_CUTS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}
_MAX_DEPTH = 4  # matmul -> view -> (cast) -> split: a fused projection cuts within a few ops


def equal_parts(target, how, size: int) -> int | None:
    """The number of equal parts a ``split`` / ``split_with_sizes`` / ``chunk`` makes of a dim
    of ``size`` (``how``: its ``split_size``, ``split_sizes`` or ``chunks`` argument), or None
    when the parts differ or there is only one."""
    if target is aten.split.Tensor:
        parts = size // how if how and size % how == 0 else None
    elif target is aten.split_with_sizes.default:
        parts = len(how) if len(set(how)) == 1 and sum(how) == size else None
    elif target is aten.chunk.default:
        parts = how if how and size % how == 0 else None
    else:
        return None
    return parts if parts is not None and parts >= 2 else None


def _cut_parts(node: torch.fx.Node) -> int | None:
    # The three cuts share the schema (self, <how>, dim=0).
    val = node.args[0].meta.get("val")
    if not isinstance(val, torch.Tensor) or len(node.args) < 2:
        return None
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    return equal_parts(node.target, node.args[1], int(val.shape[dim % max(val.dim(), 1)]))


def slice_segment(size: int, start, end, step) -> tuple[int, int] | None:
    """``(k, j)`` when ``x[start:end:step]`` of a dim of ``size`` is its segment ``j`` of ``k >= 2``
    equal segments, else None."""
    start = 0 if start is None else (start + size if start < 0 else start)
    end = size if end is None else min(end + size if end < 0 else end, size)
    length = end - start
    if step != 1 or length <= 0 or size % length or start % length or size // length < 2:
        return None
    return size // length, start // length


_PROJECTIONS = {aten.mm.default, aten.addmm.default, aten.linear.default, aten.matmul.default}


def _projected(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a matmul's output, up to layout-carrying ops: slices of anything else
    (RoPE's halves of a head) are no fused projection's cut, and offering them ``S(d/k)`` would
    only grow the problem."""
    for _ in range(_MAX_DEPTH):
        if node.op != "call_function":
            return False
        if node.target in _PROJECTIONS:
            return True
        if node.target not in _CARRY or not node.args or not isinstance(node.args[0], torch.fx.Node):
            return False
        node = node.args[0]
    return False


def _slice_cut(source: torch.fx.Node, dim: int) -> int | None:
    """``k`` when the slices of a projection's output ``source`` on ``dim`` are its ``k`` equal
    segments, each once."""
    val = source.meta.get("val")
    if not isinstance(val, torch.Tensor) or not _projected(source):
        return None
    size = int(val.shape[dim])
    found = set()
    for user in source.users:
        if user.target is aten.slice.Tensor and user.args[0] is source and _slice_dim(user, val.dim()) == dim:
            args = list(user.args[2:]) + [None] * 3
            seg = slice_segment(size, args[0], args[1], args[2] if args[2] is not None else 1)
            if seg is None:
                return None
            found.add(seg)
    counts = {k for k, _ in found}
    if len(counts) != 1:
        return None
    k = counts.pop()
    return k if len(found) == k else None  # every segment taken


def _slice_dim(node: torch.fx.Node, ndim: int) -> int:
    return (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % max(ndim, 1)


def fused_segments(node: torch.fx.Node) -> tuple[int, ...]:
    """The segment counts of the cuts reachable from ``node`` through layout-carrying ops (and,
    for a slice that is part of a cut, that cut's)."""
    found: set[int] = set()
    source = node.args[0] if node.target is aten.slice.Tensor and node.args else None
    if isinstance(source, torch.fx.Node) and isinstance(source.meta.get("val"), torch.Tensor):
        k = _slice_cut(source, _slice_dim(node, source.meta["val"].dim()))
        if k is not None:
            found.add(k)
    frontier, seen = [(node, 0)], {node}
    while frontier:
        current, depth = frontier.pop()
        val = current.meta.get("val")
        for dim in {_slice_dim(u, val.dim()) for u in current.users if u.target is aten.slice.Tensor
                    and u.args and u.args[0] is current} if isinstance(val, torch.Tensor) else ():
            k = _slice_cut(current, dim)
            if k is not None:
                found.add(k)
        for user in current.users:
            if user in seen or user.op != "call_function":
                continue
            seen.add(user)
            if user.target in _CUTS and user.args and user.args[0] is current:
                parts = _cut_parts(user)
                if parts is not None:
                    found.add(parts)
            elif user.target in _CARRY and depth + 1 < _MAX_DEPTH:
                frontier.append((user, depth + 1))
    return tuple(sorted(found))


def placeholder_segments(node: torch.fx.Node) -> tuple[int, ...]:
    """A parameter's segment counts: those of the ops that read it."""
    return tuple(sorted({k for user in node.users if user.op == "call_function" for k in fused_segments(user)}))


def take_local(full: torch.Tensor, spec: TensorSpec, mesh_shape: Sequence[int],
               coord: Sequence[int]) -> torch.Tensor:
    """The piece of ``full`` that the device at ``coord`` holds under ``spec`` (a fresh
    contiguous tensor; partial axes select nothing), segmented dims included."""
    return take_index(full, local_index(spec, tuple(full.shape), tuple(mesh_shape), tuple(coord)))


@functools.lru_cache(maxsize=4096)
def local_index(spec: TensorSpec, shape: tuple[int, ...], mesh_shape: tuple[int, ...],
                coord: tuple[int, ...]) -> tuple:
    """``spec.local_index``, memoised: the strategy checks take every strategy's pieces of a sample
    on the same few specs, shapes and coordinates, where computing the index in Python was ~40%
    of a check (the tensors' slicing is cheap)."""
    return spec.local_index(shape, mesh_shape, coord)


def take_index(full: torch.Tensor, index: Sequence[slice | tuple[int, ...]]) -> torch.Tensor:
    """``full`` at ``TensorSpec.local_index``'s ``index`` (a fresh contiguous tensor)."""
    piece = full[tuple(i if isinstance(i, slice) else slice(None) for i in index)]
    for dim, i in enumerate(index):
        if not isinstance(i, slice):  # one index list at a time: several would broadcast together
            piece = piece.index_select(dim, torch.tensor(i, dtype=torch.long, device=piece.device))
    return piece.clone(memory_format=torch.contiguous_format)
