"""The zig-zag layout of a sequence split over ``m`` ranks: the load balance of causal ring attention.

With a plain contiguous split, rank ``i`` of a causal ring computes ``i + 1`` of the ``m`` key
blocks, and the ring (lockstep: every step is a shift) waits for the last rank's ``m``. Cut the
sequence into ``2m`` chunks instead and give rank ``r`` chunks ``r`` and ``2m - 1 - r`` (an early
and a late one): at the first step each rank computes its two diagonal chunk pairs and one full
one, at every later step exactly two full chunk pairs, so every rank does the same causal work,
``(2m + 1)`` of the ``(2m)^2`` chunk pairs (torch's ``context_parallel`` head-tail load balancer
and ring-flash-attention's zig-zag do the same).

Where the permutation happens: inside the kernel. The op's inputs and output keep the plain
``Shard(seq)`` layout and ``route`` moves the chunks there and back with all-to-alls (the
backward: the reverse exchanges, through ``Comm.all_to_all``'s autograd). The other choice --
permuting the tokens once at the model input -- is exact only if every op between the input and
the attention is position-blind: Hugging Face models build RoPE positions and the causal mask from
``arange(seq)`` inside the forward, and the causal-LM loss shifts the labels along the sequence,
so a permuted token order would silently rotate the wrong positions, mask the wrong keys and
score each token against the wrong next token. Inside the kernel nothing else sees the order.

Chunk sizes: a rank's contiguous block of ``b`` rows is cut into halves ``b // 2`` and
``b - b // 2``; chunks ``r`` and ``2m - 1 - r`` have opposite parities, so every rank holds ``b``
rows in either layout (the ring's blocks keep one shape) whatever ``b``'s parity.

Several mesh axes splitting the sequence (major first) are one flat ring of ``m`` ranks (their
odometer index); ``route`` moves chunks one axis at a time, innermost first, each an all-to-all
along that axis (a chunk's coordinate on that axis set to its destination's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["ZigZag", "route", "causal_share"]


@dataclass(frozen=True)
class ZigZag:
    """A sequence of ``length`` positions split evenly over ``m`` ranks, in ``2m`` chunks."""

    length: int
    m: int

    def chunk(self, c: int) -> tuple[int, int]:
        """Global [start, stop) of chunk ``c``: half ``c % 2`` of the plain block ``c // 2``."""
        b = self.length // self.m
        start = (c // 2) * b
        return (start, start + b // 2) if c % 2 == 0 else (start + b // 2, start + b)

    def rows(self, c: int) -> int:
        start, stop = self.chunk(c)
        return stop - start

    def plain(self, r: int) -> tuple[int, int]:
        """The chunks flat rank ``r`` holds in the plain (contiguous) layout, in local order."""
        return 2 * r, 2 * r + 1

    def zigzag(self, r: int) -> tuple[int, int]:
        """The chunks flat rank ``r`` holds in the zig-zag layout, in local order."""
        return r, 2 * self.m - 1 - r

    def owner(self, c: int) -> int:
        """The flat rank holding chunk ``c`` in the zig-zag layout."""
        return c if c < self.m else 2 * self.m - 1 - c

    def segments(self, r: int) -> list[tuple[int, int, int]]:
        """(global start, local start, rows) of rank ``r``'s zig-zag chunks, in local order."""
        out, local = [], 0
        for c in self.zigzag(r):
            start, stop = self.chunk(c)
            out.append((start, local, stop - start))
            local += stop - start
        return out


def _digits(r: int, sizes: tuple[int, ...]) -> list[int]:
    """The odometer coordinates (major first) of flat index ``r``."""
    out = []
    for n in reversed(sizes):
        out.append(r % n)
        r //= n
    return out[::-1]


def _flat(digits: list[int], sizes: tuple[int, ...]) -> int:
    r = 0
    for d, n in zip(digits, sizes):
        r = r * n + d
    return r


def flat_index(coords: tuple[int, ...], axes: tuple[int, ...], mesh_shape: tuple[int, ...]) -> int:
    """This rank's index in the flat ring of ``axes`` (major first)."""
    return _flat([coords[a] for a in axes], tuple(mesh_shape[a] for a in axes))


def route(comm, tensor: torch.Tensor, dim: int, layout: ZigZag, axes: tuple[int, ...],
          mesh_shape: tuple[int, ...], me: int, *, to_zigzag: bool) -> torch.Tensor:
    """This rank's piece of ``tensor`` along ``dim`` moved from the plain layout to the zig-zag one
    (or back): one all-to-all per axis of ``axes`` of size > 1, innermost first. Differentiable
    (``Comm.all_to_all``'s backward is the reverse exchange). Every rank simulates every rank's
    holdings (a pure function of the layout) to know its send and receive counts and orders."""
    sizes = tuple(mesh_shape[a] for a in axes)
    m = math.prod(sizes)
    hold = {r: list(layout.plain(r) if to_zigzag else layout.zigzag(r)) for r in range(m)}
    dest = layout.owner if to_zigzag else (lambda c: c // 2)
    x = tensor.movedim(dim, 0)
    bool_rows = x.dtype == torch.bool  # sent as bytes: not every backend's all-to-all takes bool
    if bool_rows:
        x = x.to(torch.uint8)
    for i in reversed(range(len(axes))):
        n = sizes[i]
        if n == 1:
            continue
        digit = {c: _digits(dest(c), sizes)[i] for r in range(m) for c in hold[r]}
        new_hold: dict[int, list[int]] = {r: [] for r in range(m)}
        for r in range(m):  # flat order: a receiver's sources arrive in their coordinate's order
            for c in sorted(hold[r], key=lambda c: digit[c]):
                target = _digits(r, sizes)
                target[i] = digit[c]
                new_hold[_flat(target, sizes)].append(c)
        mine = sorted(hold[me], key=lambda c: digit[c])
        x = _reorder(x, hold[me], mine, layout)
        send = [sum(layout.rows(c) for c in mine if digit[c] == j) for j in range(n)]
        recv = [0] * n
        my_digits = _digits(me, sizes)
        for j in range(n):
            src = list(my_digits)
            src[i] = j
            s = _flat(src, sizes)
            recv[j] = sum(layout.rows(c) for c in hold[s] if digit[c] == my_digits[i])
        x = comm.all_to_all(x, axes[i], send, recv)
        hold = new_hold
    x = _reorder(x, hold[me], list(layout.zigzag(me) if to_zigzag else layout.plain(me)), layout)
    if bool_rows:
        x = x.to(torch.bool)
    return x.movedim(0, dim)


def _reorder(x: torch.Tensor, held: list[int], want: list[int], layout: ZigZag) -> torch.Tensor:
    """Rows of ``x`` (chunks ``held``, in order) rearranged into the order ``want``."""
    if held == want:
        return x
    starts, pos = {}, 0
    for c in held:
        starts[c] = pos
        pos += layout.rows(c)
    return torch.cat([x.narrow(0, starts[c], layout.rows(c)) for c in want])


def causal_share(queries: ZigZag, keys: ZigZag) -> float:
    """The share of the unmasked product ``L x S`` the busiest rank computes in a causal zig-zag
    ring: every (query chunk, key chunk) pair with any visible key (``key start <= last query
    row``, the causal mask on global positions, top-left aligned), computed whole."""
    busiest = 0
    for r in range(queries.m):
        work = 0
        for q0, _, rows in queries.segments(r):
            for c in range(2 * keys.m):
                k0, k1 = keys.chunk(c)
                if rows and k1 > k0 and k0 <= q0 + rows - 1:
                    work += rows * (k1 - k0)
        busiest = max(busiest, work)
    return busiest / (queries.length * keys.length)
