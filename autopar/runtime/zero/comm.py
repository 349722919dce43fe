"""Batched collectives of ZeRO pieces (:mod:`autopar.runtime.zero`), laid out once, buffers kept.

A piece is a nested block of its parameter's local tensor: ZeRO axes ``a1 < a2 < ...`` split
tensor dim ``d`` in mesh order, each splitting the block the previous one left, with
``torch.chunk`` sizes (DTensor's ``Shard``: ``ceil(n/k)`` rows each, the last ones short or
empty) -- so every block, at every level, is a range of rows of the local tensor (``Level``).
A collective carries many pieces at once, each piece's chunk padded to the largest chunk of
that split so that every rank sends the same number of elements:

- ``GatherPlan``: after the step, axes from the last to the first: each piece's block at that
  level is all-gathered over the axis and its peers' chunks are copied straight into the rows
  of the parameter's local tensor they belong to (this device's chunk is already there: the
  piece is a view of it). Pieces go in buckets of at most ``cap_bytes`` gathered bytes (the
  gradient buckets' cap, ``layout.buckets``; 0: one collective per piece), one collective per
  bucket, mesh axis and dtype -- the planner prices each piece's share of a bucket's latency
  (``planner.zero_pricing.zero_gather_seconds``).
- ``ScatterPlan``: a ZeRO-2 gradient bucket (``runtime.bucketing``), axes from the first to the
  last: a partial gradient is reduce-scattered over an axis it is partial on; on an axis where
  every device holds the same gradient (not partial) this device just keeps its chunk. Each
  gradient is copied into the first round's send buffer as it arrives in backward
  (``ScatterWork.add``, one copy, as a data-parallel bucket's), the first round can be left in
  flight, and this device's summed chunk is a view of the last round's receive buffer.

Every copy is one strided view per run of equal chunks (``Level.spans``: ``torch.chunk``'s
sizes make one run, or two with a short last chunk), not one per chunk: a piece's gradient goes
into the send buffer in one copy as a data-parallel bucket's does, and the gather's views of its
buffers and of the parameters are laid out once (rebuilt only when a local tensor or its memory
is replaced) and copied in one ``torch._foreach_copy_`` on each side of the collective (a copy
per chunk per piece cost GPT-2's ZeRO-2 step about 15 ms of Python here, session 23).

The layouts are computed once. The gather's buffers (at most ``cap_bytes``) and the
reduce-scatter's receive buffers (the pieces' gradients, 1/dp of the parameters) are kept across
steps -- a fresh allocation of a large buffer costs its page faults on every step on CPU -- but
a receive buffer an earlier step's gradient still lives in (``master.grad``, when gradients
accumulate over steps) is not reused. The reduce-scatter's send buffer (the full local
gradients) is never held across steps (that would undo ZeRO-2's saving): it borrows the
gather's receive buffer, idle in backward (``Scratch``), fresh where that is too small.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from autopar.layout.cost import collective_seconds
from autopar.layout.mesh import MeshSpec
from autopar.runtime.counting import record
from autopar.runtime.dist_ops import all_gather_single, blocking, issue, reduce_scatter_single, wait
from autopar.runtime.dtensors import grad_like, local_of

__all__ = ["GatherPlan", "Level", "ScatterPlan", "ScatterWork", "Scratch", "chunk_sizes", "deliver_grad",
           "gather_pieces", "levels", "scatter_grads"]


def chunk_sizes(n: int, k: int) -> list[int]:
    """``torch.chunk``'s sizes of ``n`` rows over ``k`` devices (trailing chunks may be empty)."""
    full = -(-n // k) if n else 0
    return [max(0, min(full, n - i * full)) for i in range(k)]


@dataclass(frozen=True)
class Level:
    """One ZeRO axis of a piece: it splits the block of rows ``start ..`` of the parameter's
    local tensor into chunks of ``sizes`` rows; this device holds chunk ``coord``."""

    axis: int
    start: int
    sizes: tuple[int, ...]
    coord: int

    def row(self, chunk: int) -> int:
        """The first row of ``chunk`` in the local tensor."""
        return self.start + sum(self.sizes[:chunk])

    def spans(self, *, skip: int | None = None) -> tuple["_Span", ...]:
        """The non-empty chunks (but ``skip``) as runs of neighbours of equal size: ``torch.chunk``'s
        ``full, ..., full, short, 0, ...`` is one run or two -- each run one strided copy, where a
        copy per chunk cost a slice, a view and a copy per chunk per piece per step."""
        out, j, k = [], 0, len(self.sizes)
        while j < k:
            if j == skip or not self.sizes[j]:
                j += 1
                continue
            end = j + 1
            while end < k and end != skip and self.sizes[end] == self.sizes[j]:
                end += 1
            out.append(_Span(j, end - j, self.sizes[j]))
            j = end
        return tuple(out)


@dataclass(frozen=True)
class _Span:
    """Chunks ``first .. first + n`` of a level, ``rows`` rows each."""

    first: int
    n: int
    rows: int


def levels(piece) -> tuple[Level, ...]:
    """``piece``'s ZeRO axes in mesh order, each with the block it splits."""
    mesh = piece.param.device_mesh
    rows, start, out = local_of(piece.param).shape[piece.dim], 0, []
    for a in piece.axes:
        sizes = tuple(chunk_sizes(rows, mesh.size(a)))
        coord = mesh.get_local_rank(a)
        out.append(Level(a, start, sizes, coord))
        start += sum(sizes[:coord])
        rows = sizes[coord]
    return tuple(out)


def _all_reduce_cheaper(rnd: "_Round", mesh: MeshSpec) -> bool:
    """Does ``mesh`` price an all-reduce of ``rnd``'s buffer below its reduce-scatter?"""
    nbytes = rnd.k * rnd.seg * torch.empty((), dtype=rnd.dtype).element_size()
    return (collective_seconds("all_reduce", nbytes, mesh, rnd.axis)
            < collective_seconds("reduce_scatter", nbytes, mesh, rnd.axis))


def _rows_first(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t.movedim(dim, 0) if dim else t


@dataclass(frozen=True)
class _Member:
    """One tensor in one collective: its level, the shape of a row, its offset in every
    rank's segment of the flat buffer (elements)."""

    item: int
    level: Level
    rest: tuple[int, ...]
    offset: int

    @property
    def width(self) -> int:
        return math.prod(self.rest)

    def part(self, seg: torch.Tensor, chunk: int) -> torch.Tensor:
        """Chunk ``chunk``'s rows in ``seg`` (one rank's segment of the flat buffer)."""
        n = self.level.sizes[chunk]
        return seg[self.offset:self.offset + n * self.width].view(n, *self.rest)

    def in_buffer(self, buf: torch.Tensor, seg: int, span: _Span) -> torch.Tensor:
        """``span``'s chunks in the flat buffer ``buf`` (one segment of ``seg`` elements per
        chunk), shaped ``(n, rows, *rest)``: one strided view across the segments."""
        stride = [math.prod(self.rest[i:]) for i in range(1, len(self.rest) + 1)]
        return buf.as_strided((span.n, span.rows, *self.rest), (seg, self.width, *stride),
                              buf.storage_offset() + span.first * seg + self.offset)

    def in_rows(self, rows: torch.Tensor, span: _Span, *, base: int = 0) -> torch.Tensor:
        """``span``'s chunks in ``rows`` (rows first, its row 0 the local tensor's row ``base``),
        shaped ``(n, rows, *rest)``."""
        start = self.level.row(span.first) - base
        return rows.narrow(0, start, span.n * span.rows).unflatten(0, (span.n, span.rows))

    @functools.cached_property
    def spans(self) -> tuple[_Span, ...]:
        """Every chunk of the level, as ``Level.spans`` runs (none: a row of no elements)."""
        return self.level.spans() if self.width else ()


@dataclass(frozen=True)
class _Round:
    """One collective over mesh ``axis`` of the group ``mesh`` for ``members`` of ``dtype``:
    ``k`` segments of ``seg`` elements (the gathered, or the reduce-scattered, buffer)."""

    axis: int
    mesh: object
    dtype: torch.dtype
    members: tuple[_Member, ...]
    seg: int

    @property
    def k(self) -> int:
        return self.mesh.size(self.axis)

    def group(self):
        return self.mesh.get_group(self.axis)


class _Buffers:
    """Flat buffers kept across steps, one per (role, device, dtype), grown to the largest
    request; ``take`` hands out a prefix."""

    def __init__(self) -> None:
        self.kept: dict[tuple, torch.Tensor] = {}

    def take(self, role: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self.kept.get((role, device, dtype))
        if buf is None or buf.numel() < numel:
            buf = self.kept[(role, device, dtype)] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]


# ----------------------------------------------------------------------------------- gather
class GatherPlan:
    """The all-gathers that put ``pieces`` (after the optimizer updated them) back into their
    replicated parameters: buckets of at most ``cap_bytes`` gathered bytes per (mesh axis,
    mesh, dtype), axes from the last to the first (the module docstring)."""

    def __init__(self, pieces: Sequence, *, cap_bytes: int) -> None:
        if cap_bytes < 0:
            raise ValueError(f"cap_bytes must be >= 0, got {cap_bytes}")
        self.pieces = list(pieces)
        self.levels = [levels(p) for p in self.pieces]
        self.rounds: list[_Round] = []
        for axis in sorted({a for p in self.pieces for a in p.axes}, reverse=True):
            groups = defaultdict(list)  # (mesh, dtype) -> (item, level) split by this axis
            for i, p in enumerate(self.pieces):
                level = next((lv for lv in self.levels[i] if lv.axis == axis), None)
                if level is not None:
                    groups[(p.param.device_mesh, p.master.dtype)].append((i, level))
            for (mesh, dtype), items in groups.items():
                self._bucket(axis, mesh, dtype, items, cap_bytes)
        self.buffers = _Buffers()
        self._built: tuple | None = None  # (key, the tensors it names, the program): ``_program``

    def _bucket(self, axis: int, mesh, dtype: torch.dtype, items: list, cap_bytes: int) -> None:
        """Pieces in order, a new collective where the gathered bytes would pass ``cap_bytes``."""
        k, size = mesh.size(axis), torch.empty((), dtype=dtype).element_size()
        members, seg = [], 0
        for i, level in items:
            p = self.pieces[i]
            rest = tuple(_rows_first(local_of(p.param), p.dim).shape[1:])
            n = max(level.sizes) * math.prod(rest)
            if members and (not cap_bytes or (seg + n) * k * size > cap_bytes):
                self.rounds.append(_Round(axis, mesh, dtype, tuple(members), seg))
                members, seg = [], 0
            members.append(_Member(i, level, rest, seg))
            seg += n
        if members:
            self.rounds.append(_Round(axis, mesh, dtype, tuple(members), seg))

    def _rows(self, item: int) -> torch.Tensor:
        p = self.pieces[item]
        return _rows_first(local_of(p.param), p.dim)

    @torch.no_grad()
    def run(self) -> None:
        """Every piece's block all-gathered back into its parameter's local tensor: per round,
        one batched copy in (``_foreach_copy_``), the collective, one batched copy out -- the
        views laid out once (``_program``)."""
        copy_in, rounds = self._program()
        for rows, mine in copy_in:  # a piece is a view of its rows; one that is not is copied in first
            rows.copy_(mine)
        for group, send, recv, into_send, out_of_recv in rounds:
            if into_send[0]:
                torch._foreach_copy_(*into_send)
            record("all_gather", recv.numel() * recv.element_size())
            blocking(all_gather_single, recv, send, group=group)
            if out_of_recv[0]:
                torch._foreach_copy_(*out_of_recv)

    def scratch(self, device: torch.device) -> torch.Tensor:
        """The largest receive buffer on ``device``, as bytes (empty: none), at its final size:
        idle between the gathers after the step, it holds ZeRO-2's send buffers in backward
        (``Scratch``)."""
        self._program()
        bufs = [b for (role, dev, _), b in self.buffers.kept.items() if role == "recv" and dev == device]
        if not bufs:
            return torch.empty(0, dtype=torch.uint8, device=device)
        return max(bufs, key=lambda b: b.numel() * b.element_size()).view(torch.uint8)

    def _tensors(self) -> list[torch.Tensor]:
        return [t for p in self.pieces for t in (local_of(p.param), local_of(p.master))]

    def _program(self) -> tuple[list, list]:
        """(masters to copy into their rows, per round: its group, send and receive buffers and
        the (destinations, sources) of its copies in and out), built once and again only when a
        parameter's or piece's local tensor, or its memory, was replaced (``load_state_dict``
        with ``assign``, ``.to()``, the chunk runtime's ``set_``)."""
        tensors = self._tensors()
        key = [(id(t), t.data_ptr()) for t in tensors]
        if self._built is not None and self._built[0] == key:
            return self._built[2]
        copy_in = []
        for p in self.pieces:
            mine, rows = local_of(p.master), local_of(p.param)[p.slices]
            if mine.data_ptr() != rows.data_ptr() or mine.stride() != rows.stride():
                copy_in.append((rows, mine))
        need: dict[tuple, int] = defaultdict(int)  # the buffers at their largest first: views stay valid
        for rnd in self.rounds:
            device = local_of(self.pieces[rnd.members[0].item].param).device
            need[("send", device, rnd.dtype)] = max(need[("send", device, rnd.dtype)], rnd.seg)
            need[("recv", device, rnd.dtype)] = max(need[("recv", device, rnd.dtype)], rnd.k * rnd.seg)
        for (role, device, dtype), numel in need.items():
            self.buffers.take(role, numel, dtype, device)
        rounds = []
        for rnd in self.rounds:
            device = local_of(self.pieces[rnd.members[0].item].param).device
            send = self.buffers.take("send", rnd.seg, rnd.dtype, device)
            recv = self.buffers.take("recv", rnd.k * rnd.seg, rnd.dtype, device)
            into_send, out_of_recv = ([], []), ([], [])
            for m in rnd.members:
                lv, rows = m.level, self._rows(m.item)
                if m.width and lv.sizes[lv.coord]:  # this device's block at this level, from its rows
                    n = lv.sizes[lv.coord]  # (the send buffer is one segment: its chunk 0)
                    into_send[0].append(m.in_buffer(send, rnd.seg, _Span(0, 1, n)))
                    into_send[1].append(m.in_rows(rows, _Span(lv.coord, 1, n)))
                for span in (lv.spans(skip=lv.coord) if m.width else ()):  # the peers' blocks
                    out_of_recv[0].append(m.in_rows(rows, span))
                    out_of_recv[1].append(m.in_buffer(recv, rnd.seg, span))
            rounds.append((rnd.group(), send, recv, into_send, out_of_recv))
        # (the tensors themselves are held: an id is only unique while its object lives)
        self._built = (key, tensors, (copy_in, rounds))
        return self._built[2]


def gather_pieces(pieces: Sequence, *, cap_bytes: int = 0) -> None:
    """``GatherPlan(pieces, cap_bytes=...).run()`` once (``cap_bytes`` 0: one bucket per piece)."""
    if pieces:
        GatherPlan(pieces, cap_bytes=cap_bytes).run()


# ---------------------------------------------------------------------------------- scatter
class Scratch:
    """Memory a backward pass's ZeRO-2 send buffers borrow: the gather's receive buffer, kept and
    idle from one step's gather to the next. A fresh send buffer every step cost its page faults
    on CPU (GPT-2's ZeRO-2: 1,400 a step a rank), one kept per bucket would hold the gradient
    ZeRO-2 saves. ``reserve`` gives each shard bucket's collective a disjoint byte range (buckets
    are in flight together); one past the buffer's end is fresh."""

    def __init__(self, gather: GatherPlan) -> None:
        self.gather, self.used = gather, 0
        self._bytes: dict[torch.device, torch.Tensor] = {}

    def reserve(self, nbytes: int, *, align: int) -> int:
        at = -(-self.used // align) * align
        self.used = at + nbytes
        return at

    def take(self, at: int, nbytes: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        arena = self._bytes.get(device)
        if arena is None:
            arena = self._bytes[device] = self.gather.scratch(device)
        return arena[at:at + nbytes].view(dtype) if at + nbytes <= arena.numel() else None


class ScatterPlan:
    """The reduce-scatter of a fixed list of ``items`` -- (piece, the mesh axes its gradient
    is partial on, the dtype it is summed in) -- one round per mesh axis of the pieces, each
    a collective per (mesh, dtype) for every item partial on that axis (the module docstring).
    ``keep``: keep the buffers for the next ``work`` (a shard bucket's plan, used every step).
    ``mesh``: the plan's ``MeshSpec``; where its calibrated links price an all-reduce of a
    collective's buffer below its reduce-scatter (gloo's reduce-scatter is not a ring of its
    own), that collective all-reduces and keeps this device's segment -- the cheaper of the
    two, which is what the planner prices (``planner.zero_pricing.zero2_extra_s``).
    ``scratch``: where the first round's send buffers live for the pass that owns the kept
    buffers (``Scratch``; None: fresh ones)."""

    def __init__(self, items: Sequence[tuple], *, keep: bool = True, mesh: MeshSpec | None = None,
                 scratch: Scratch | None = None) -> None:
        self.items = [(p, tuple(partial), dtype) for p, partial, dtype in items]
        self.axes, links = sorted({a for p, _, _ in self.items for a in p.axes}), mesh
        lvs = [levels(p) for p, _, _ in self.items]
        # Per round (axis): its collectives and the items that keep their chunk without one.
        self.rounds: list[tuple[list[_Round], list[tuple[int, Level]]]] = []
        for axis in self.axes:
            groups, cut = defaultdict(list), []
            for i, (p, partial, dtype) in enumerate(self.items):
                level = next((lv for lv in lvs[i] if lv.axis == axis), None)
                if level is None:
                    continue
                if axis in partial:
                    groups[(p.param.device_mesh, dtype)].append((i, level))
                else:  # every device holds the same gradient here: keep this device's chunk
                    cut.append((i, level))
            collectives = []
            for (mesh, dtype), members in groups.items():
                out, seg = [], 0
                for i, level in members:
                    p = self.items[i][0]
                    rest = tuple(_rows_first(local_of(p.param), p.dim).shape[1:])
                    out.append(_Member(i, level, rest, seg))
                    seg += max(level.sizes) * math.prod(rest)
                collectives.append(_Round(axis, mesh, dtype, tuple(out), seg))
            self.rounds.append((collectives, cut))
        # (round, collective) -> summed by an all-reduce instead (``mesh``'s links say it is cheaper)
        self.all_reduced = {(r, c): links is not None and _all_reduce_cheaper(rnd, links)
                            for r, (collectives, _) in enumerate(self.rounds) for c, rnd in enumerate(collectives)}
        # item -> (its member in the first round's collective c) where it is one
        self.first = {m.item: (c, m) for c, rnd in enumerate(self.rounds[0][0] if self.rounds else ())
                      for m in rnd.members}
        # (round, collective) -> the (start, end) element ranges of its send buffer that pad a
        # short chunk (zeroed in each fresh buffer)
        self.pads = {(r, c): _pads(rnd) for r, (collectives, _) in enumerate(self.rounds)
                     for c, rnd in enumerate(collectives)}
        self.keep, self.scratch = keep, scratch
        self._at = {}  # first-round collective -> (its byte offset in ``scratch``, bytes)
        for c, rnd in enumerate(self.rounds[0][0] if self.rounds and scratch is not None else ()):
            size = torch.empty((), dtype=rnd.dtype).element_size()
            self._at[c] = (scratch.reserve(rnd.k * rnd.seg * size, align=size), rnd.k * rnd.seg * size)
        self._kept: dict[tuple, torch.Tensor] = {}  # (round, collective, device) -> receive buffer
        # The work holding the kept buffers until its ``wait`` (a weak reference: a backward pass
        # that raised is dropped with its work, and the buffers are free again).
        self._holder = lambda: None

    def work(self) -> "ScatterWork":
        """One backward pass's reduce-scatter over this plan (the kept buffers unless another
        pass -- a reentrant backward inside this one -- holds them)."""
        work = ScatterWork(self, own=self.keep and self._holder() is None)
        if work.own:
            self._holder = weakref.ref(work)
        return work

    def send_buffer(self, r: int, c: int, device: torch.device, *, own: bool = False) -> torch.Tensor:
        """Round ``r``'s collective ``c``'s send buffer (``k`` segments of ``seg``), its padding
        zeroed. Never kept: a full-size gradient buffer held between steps is what ZeRO-2 saves;
        the first round's of the pass that ``own``s the plan's buffers is borrowed (``scratch``)."""
        rnd = self.rounds[r][0][c]
        send = None
        if r == 0 and own and c in self._at:
            send = self.scratch.take(*self._at[c], rnd.dtype, device)
        if send is None:
            send = torch.empty(rnd.k * rnd.seg, dtype=rnd.dtype, device=device)
        for lo, hi in self.pads[(r, c)]:
            send[lo:hi].zero_()
        return send

    def recv_buffer(self, r: int, c: int, device: torch.device, *, own: bool) -> torch.Tensor:
        """Round ``r``'s collective ``c``'s receive buffer (``seg``): the kept one (``own``)
        unless a piece's gradient still lives in it."""
        rnd = self.rounds[r][0][c]
        key = (r, c, device)
        buf = self._kept.get(key) if own else None
        if buf is None or self._aliased(buf, rnd):
            buf = torch.empty(rnd.seg, dtype=rnd.dtype, device=device)
            if own:
                self._kept[key] = buf
        return buf

    def _aliased(self, buf: torch.Tensor, rnd: _Round) -> bool:
        ptr = buf.untyped_storage().data_ptr()
        for m in rnd.members:
            grad = self.items[m.item][0].master.grad
            if grad is not None and local_of(grad).untyped_storage().data_ptr() == ptr:
                return True
        return False


def _pads(rnd: _Round) -> list[tuple[int, int]]:
    """The element ranges of ``rnd``'s send buffer (``k`` segments of ``seg``) that pad a chunk
    shorter than its member's largest, adjacent ranges merged."""
    out: list[list[int]] = []
    for chunk in range(rnd.k):
        for m in rnd.members:
            most, n = max(m.level.sizes) * m.width, m.level.sizes[chunk] * m.width
            lo, hi = chunk * rnd.seg + m.offset + n, chunk * rnd.seg + m.offset + most
            if n < most:
                if out and out[-1][1] == lo:
                    out[-1][1] = hi
                else:
                    out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


class ScatterWork:
    """One pass of a ``ScatterPlan``: ``add`` each item's local partial gradient as it
    arrives, ``start`` the first round (``async_op``: left in flight), ``wait`` for the
    rest; ``wait`` returns each item's summed block (the master's local shape; None for an
    item that received no gradient)."""

    def __init__(self, plan: ScatterPlan, *, own: bool) -> None:
        self.plan, self.own = plan, own
        n = len(plan.items)
        self.data: list[torch.Tensor | None] = [None] * n  # rows-first: the item's current block
        self.added = [False] * n
        self.sends: dict[int, torch.Tensor] = {}  # first-round collective -> its send buffer
        self.pending: list[tuple] = []  # (work or None, round, collective, recv, send) in flight
        self.next_round = 0
        self.started = False

    def _send(self, c: int, device: torch.device) -> torch.Tensor:
        send = self.sends.get(c)
        if send is None:
            send = self.sends[c] = self.plan.send_buffer(0, c, device, own=self.own)
        return send

    @torch.no_grad()
    def add(self, i: int, grad: torch.Tensor) -> None:
        """Item ``i``'s local partial gradient (the parameter's local shape); a second one in
        the same pass is added to the first."""
        if self.started:
            raise RuntimeError(f"gradient of {self.plan.items[i][0].name!r} after its reduce-scatter left")
        p, _, dtype = self.plan.items[i]
        rows = _rows_first(grad, p.dim)
        first = self.plan.first.get(i)
        if first is None:  # not in the first collective: kept until its round (a copy: autograd's tensor)
            self.data[i] = rows.to(dtype, copy=True) if self.data[i] is None else self.data[i].add_(rows)
        else:  # straight into the send buffer: one strided copy per run of equal chunks
            c, m = first
            send, seg = self._send(c, grad.device), self.plan.rounds[0][0][c].seg
            for span in m.spans:
                part, src = m.in_buffer(send, seg, span), m.in_rows(rows, span, base=m.level.start)
                if self.added[i]:
                    part.add_(src)
                else:
                    part.copy_(src)
        self.added[i] = True

    def start(self, *, async_op: bool) -> None:
        """Issue the first round (a collective per (mesh, dtype)); ``async_op``: left in flight."""
        self.started = True
        if self.plan.rounds:
            self._round(0, async_op=async_op)

    def _round(self, r: int, *, async_op: bool) -> None:
        collectives, cut = self.plan.rounds[r]
        self.next_round = r + 1
        for i, level in cut:
            if self.data[i] is not None:
                lo = level.row(level.coord) - level.start
                self.data[i] = self.data[i][lo:lo + level.sizes[level.coord]]
        for c, rnd in enumerate(collectives):
            device = self._device(rnd)
            if r == 0:
                send = self._send(c, device)
                for m in rnd.members:
                    if not self.added[m.item]:  # no gradient this pass: its rows from the last must not count
                        for span in m.spans:
                            m.in_buffer(send, rnd.seg, span).zero_()
            else:
                send = self.plan.send_buffer(r, c, device)
                for m in rnd.members:
                    block = self.data[m.item]
                    for span in m.spans:
                        part = m.in_buffer(send, rnd.seg, span)
                        if block is None:
                            part.zero_()
                        else:
                            part.copy_(m.in_rows(block, span, base=m.level.start))
            recv = self.plan.recv_buffer(r, c, device, own=self.own)
            if self.plan.all_reduced[(r, c)]:
                record("all_reduce", send.numel() * send.element_size())
                work = (issue if async_op else blocking)(dist.all_reduce, send, group=rnd.group())
            else:
                record("reduce_scatter", send.numel() * send.element_size())
                work = reduce_scatter_single(recv, send, group=rnd.group(), async_op=async_op)
            self.pending.append((work if async_op else None, r, c, recv, send))

    def _device(self, rnd: _Round) -> torch.device:
        return local_of(self.plan.items[rnd.members[0].item][0].param).device

    def _drain(self) -> None:
        for work, r, c, recv, send in self.pending:  # (the send buffer lives until its collective is done)
            if work is not None:
                wait(work)
            if self.plan.all_reduced[(r, c)]:  # every segment summed: keep this device's
                rnd = self.plan.rounds[r][0][c]
                recv.copy_(send.view(rnd.k, rnd.seg)[rnd.mesh.get_local_rank(rnd.axis)])
            for m in self.plan.rounds[r][0][c].members:
                if self.added[m.item]:
                    self.data[m.item] = m.part(recv, m.level.coord)
        self.pending, self.sends = [], {}

    def wait(self) -> list[torch.Tensor | None]:
        if not self.started:
            self.start(async_op=False)
        self._drain()
        while self.next_round < len(self.plan.rounds):
            self._round(self.next_round, async_op=False)
            self._drain()
        if self.own:
            self.plan._holder = lambda: None
        return [None if d is None or not self.added[i] else d.movedim(0, p.dim) if p.dim else d
                for i, (d, (p, _, _)) in enumerate(zip(self.data, self.plan.items))]


@torch.no_grad()
def deliver_grad(master: torch.Tensor, mine: torch.Tensor) -> None:
    """Add ``mine`` (a piece's summed block from ``ScatterWork.wait``) to ``master.grad``. The
    first becomes it as it is, a view of the kept receive buffer: a contiguous copy of a piece
    that ZeRO splits along a later dim (a column block, strided in the buffer) would hold its
    bytes twice, the buffer staying alive through its row-block neighbours' views -- the
    pieces' gradients are 1/dp of the parameters', as ``planner.zero_pricing`` prices them. A
    wrapper (``grad_like``), not ``from_local``, once per piece per step."""
    mine = mine.to(master.dtype)
    if master.grad is None:
        master.grad = grad_like(mine, master)
    else:
        local_of(master.grad).add_(mine)


@torch.no_grad()
def scatter_grads(items: Sequence[tuple], *, async_op: bool = False) -> ScatterWork:
    """``items``: (piece, the parameter's local partial gradient, the mesh axes it is partial
    on); a one-off ``ScatterPlan`` with the work started (``.wait()`` gives the blocks)."""
    work = ScatterPlan([(p, partial, grad.dtype) for p, grad, partial in items], keep=False).work()
    for i, (_, grad, _) in enumerate(items):
        work.add(i, grad)
    work.start(async_op=async_op)
    return work
