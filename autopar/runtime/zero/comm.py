"""Batched collectives of ZeRO pieces (:mod:`autopar.runtime.zero`): one per mesh axis and dtype.

A piece is a nested block of its parameter's local tensor: ZeRO axes ``a1 < a2 < ...`` split
tensor dim ``d`` in mesh order, each splitting the block the previous one left, with
``torch.chunk`` sizes (DTensor's ``Shard``: ``ceil(n/k)`` rows each, the last ones short or
empty). Every collective carries all pieces at once, each piece's chunk padded to the largest
chunk of that split so that every rank sends the same number of elements:

- ``gather_pieces``: after the step, axes from the last to the first: all-gather each piece's
  block over the axis and stitch the chunks into the block one level up; the top level is the
  parameter's local tensor.
- ``scatter_grads``: in backward, per bucket of ZeRO-2 gradients (``runtime.bucketing``), axes
  from the first to the last: a partial gradient is reduce-scattered over an axis it is partial
  on; on an axis where every device holds the same gradient (not partial) this device just
  keeps its chunk. The first axis's collective can be left in flight (``ScatterWork``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Sequence

import torch

from autopar.runtime.counting import record
from autopar.runtime.dtensors import local_of
from autopar.runtime.dist_ops import all_gather_single, reduce_scatter_single

__all__ = ["ScatterWork", "chunk_sizes", "gather_pieces", "scatter_grads"]


def chunk_sizes(n: int, k: int) -> list[int]:
    """``torch.chunk``'s sizes of ``n`` rows over ``k`` devices (trailing chunks may be empty)."""
    full = -(-n // k) if n else 0
    return [max(0, min(full, n - i * full)) for i in range(k)]


def _levels(piece) -> list[tuple[int, list[int], int]]:
    """Per ZeRO axis (in order): (axis, chunk sizes of the block it splits, this device's chunk)."""
    mesh = piece.param.device_mesh
    rows = local_of(piece.param).shape[piece.dim]
    out = []
    for a in piece.axes:
        sizes = chunk_sizes(rows, mesh.size(a))
        coord = mesh.get_local_rank(a)
        out.append((a, sizes, coord))
        rows = sizes[coord]
    return out


def _rows_first(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t.movedim(dim, 0) if dim else t


@torch.no_grad()
def gather_pieces(pieces: Sequence) -> None:
    """Every piece's block all-gathered back into its parameter's local tensor."""
    if not pieces:
        return
    levels = {id(p): _levels(p) for p in pieces}
    blocks = {id(p): _rows_first(local_of(p.master).detach(), p.dim).contiguous() for p in pieces}
    for axis in sorted({a for p in pieces for a in p.axes}, reverse=True):
        batch = defaultdict(list)  # (mesh, dtype) -> pieces split by this axis
        for p in pieces:
            if axis in p.axes:
                batch[(p.param.device_mesh, p.master.dtype)].append(p)
        for group in batch.values():
            _gather_round(group, axis, levels, blocks)
    for p in pieces:
        _rows_first(local_of(p.param), p.dim).copy_(blocks[id(p)])


def _gather_round(pieces: list, axis: int, levels: dict, blocks: dict) -> None:
    mesh = pieces[0].param.device_mesh
    k = mesh.size(axis)
    plan, total = [], 0
    for p in pieces:
        _, sizes, _ = next(lv for lv in levels[id(p)] if lv[0] == axis)
        rest = blocks[id(p)].shape[1:]
        seg = max(sizes) * math.prod(rest)
        plan.append((p, sizes, rest, total, seg))
        total += seg
    send = blocks[id(pieces[0])].new_zeros(total)
    for p, sizes, rest, offset, seg in plan:
        block = blocks[id(p)].reshape(-1)
        send[offset:offset + block.numel()].copy_(block)
    recv = send.new_empty(k * total)
    record("all_gather", recv.numel() * recv.element_size())
    all_gather_single(recv, send, group=mesh.get_group(axis))
    recv = recv.view(k, total)
    for p, sizes, rest, offset, seg in plan:
        width = math.prod(rest)
        parts = [recv[c, offset:offset + sizes[c] * width].view(sizes[c], *rest) for c in range(k)]
        blocks[id(p)] = torch.cat(parts, dim=0)


@torch.no_grad()
def scatter_grads(items: Sequence[tuple], *, async_op: bool = False) -> "ScatterWork":
    """``items``: (piece, the parameter's local partial gradient, the mesh axes it is partial
    on). Starts the batched reduce-scatter; ``.wait()`` returns each piece's summed gradient
    block (the master's local shape). ``async_op``: the first axis's collectives are left in
    flight (the bucketer overlaps them with the rest of backward); the others run in ``wait``."""
    return ScatterWork(items, async_op=async_op)


class ScatterWork:
    """One batched ZeRO-2 reduce-scatter (``scatter_grads``), axes from the first to the last:
    each axis's round depends on the block the previous one left."""

    def __init__(self, items: Sequence[tuple], *, async_op: bool) -> None:
        self.items = list(items)
        self.blocks = {i: _rows_first(grad, p.dim).contiguous() for i, (p, grad, _) in enumerate(self.items)}
        self.levels = {i: _levels(p) for i, (p, _, _) in enumerate(self.items)}
        self.axes = sorted({a for p, _, _ in self.items for a in p.axes})
        self.pending: list[tuple] = []  # (work or None, finish) of the round in flight
        self.next_axis = 0
        if self.axes:
            self._round(async_op=async_op)

    def _round(self, *, async_op: bool) -> None:
        axis = self.axes[self.next_axis]
        self.next_axis += 1
        batch = defaultdict(list)  # (mesh, dtype) -> items reduce-scattered over this axis
        for i, (p, _, partial) in enumerate(self.items):
            if axis not in p.axes:
                continue
            _, sizes, coord = next(lv for lv in self.levels[i] if lv[0] == axis)
            if axis in partial:
                batch[(p.param.device_mesh, self.blocks[i].dtype)].append(i)
            else:  # every device holds the same gradient here: keep this device's chunk
                start = sum(sizes[:coord])
                self.blocks[i] = self.blocks[i][start:start + sizes[coord]]
        for group in batch.values():
            self.pending.append(self._scatter_round(group, axis, async_op=async_op))

    def _scatter_round(self, group: list[int], axis: int, *, async_op: bool) -> tuple:
        mesh = self.items[group[0]][0].param.device_mesh
        k = mesh.size(axis)
        plan, total = [], 0
        for i in group:
            _, sizes, coord = next(lv for lv in self.levels[i] if lv[0] == axis)
            rest = self.blocks[i].shape[1:]
            plan.append((i, sizes, coord, rest, total))
            total += max(sizes) * math.prod(rest)
        send = self.blocks[group[0]].new_zeros(k, total)
        for i, sizes, coord, rest, offset in plan:
            start = 0
            for c in range(k):
                rows = self.blocks[i][start:start + sizes[c]].reshape(-1)
                send[c, offset:offset + rows.numel()].copy_(rows)
                start += sizes[c]
        recv = send.new_empty(total)
        record("reduce_scatter", send.numel() * send.element_size())
        work = reduce_scatter_single(recv, send.view(-1), group=mesh.get_group(axis), async_op=async_op)

        def finish() -> None:
            for i, sizes, coord, rest, offset in plan:
                self.blocks[i] = recv[offset:offset + sizes[coord] * math.prod(rest)].view(sizes[coord], *rest)

        return (work if async_op else None), finish

    def _drain(self) -> None:
        for work, finish in self.pending:
            if work is not None:
                work.wait()
            finish()
        self.pending = []

    def wait(self) -> list[torch.Tensor]:
        self._drain()
        while self.next_axis < len(self.axes):
            self._round(async_op=False)
            self._drain()
        return [self.blocks[i].movedim(0, p.dim) if p.dim else self.blocks[i] for i, (p, _, _) in enumerate(self.items)]
