"""The memory items of a simplified model (``autopar.solver.simplify``): bytes a group's option
(``MemItem``) or a pair of groups' options (``EdgeItem``) holds on a timeline interval, and the
points where their total can peak. No torch import."""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

__all__ = ["MemItem", "EdgeItem", "settle_edge_items", "peak_candidates", "undominated_rows", "equal_lines"]


@dataclass(frozen=True, slots=True)
class MemItem:
    """``bytes[s]`` held on timeline points ``start..end`` when the group picks option ``s``."""

    group: int
    start: int
    end: int
    bytes: np.ndarray
    segment: str | None = None

    def __str__(self) -> str:
        return f"mem[g{self.group} t{self.start}..{self.end} max {int(self.bytes.max())}B]"


@dataclass(frozen=True, slots=True)
class EdgeItem:
    """``bytes[s, t]`` held on timeline points ``start..end`` when group ``a`` picks ``s`` and
    group ``b`` picks ``t`` (module docstring: pairwise memory)."""

    a: int
    b: int
    start: int
    end: int
    bytes: np.ndarray

    def oriented(self, g: int) -> np.ndarray:
        """The bytes with ``g``'s options as rows."""
        return self.bytes if g == self.a else self.bytes.T

    def __str__(self) -> str:
        return f"mem[g{self.a},g{self.b} t{self.start}..{self.end} max {int(self.bytes.max())}B]"


def settle_edge_items(pairs, num_options) -> tuple[tuple[MemItem, ...], tuple[EdgeItem, ...]]:
    """Pairwise items as (``MemItem``s, the ``EdgeItem``s left, oriented ``a < b``): an item touching
    a 1-option group is the other group's ``MemItem``, a separable one ``bytes[s, t] = r[s] + c[t]``
    two with non-negative parts (``r = bytes[:, t0]``, ``c = bytes[s0, :] - bytes[s0, t0]`` at the
    row minimum ``t0``: exact and both >= 0 when separable)."""
    items, kept = [], []
    for it in pairs:
        if it.a > it.b:
            it = EdgeItem(it.b, it.a, it.start, it.end, it.bytes.T)
        mat = it.bytes
        if num_options[it.a] == 1 or num_options[it.b] == 1 or not mat.any():
            if num_options[it.b] == 1:
                items.append(MemItem(it.a, it.start, it.end, mat[:, 0].copy()))
            else:
                items.append(MemItem(it.b, it.start, it.end, mat[0, :].copy()))
            continue
        t0 = int(mat[0].argmin())
        rows, cols = mat[:, t0], mat[0, :] - mat[0, t0]
        if np.abs(mat - rows[:, None] - cols[None, :]).max() <= 0.5:  # whole bytes: exact
            items += [MemItem(it.a, it.start, it.end, rows.copy()), MemItem(it.b, it.start, it.end, cols.copy())]
            continue
        kept.append(it)
    return tuple(items), tuple(kept)


def peak_candidates(items: tuple[MemItem, ...] | list[MemItem]) -> list[int]:
    """Timeline points whose live item sets are maximal (no other point's set contains them).

    The total of non-negative interval loads peaks at some interval start; a start ``p`` whose
    live set is also live at the next start ``q`` (every live interval outlasts ``q``) is
    dominated by ``q``. So ``p`` is a candidate iff some interval live at ``p`` ends before ``q``.
    """
    starts = sorted({it.start for it in items})
    by_start: dict[int, list[int]] = defaultdict(list)
    for it in items:
        by_start[it.start].append(it.end)
    heap: list[int] = []
    out = []
    for k, p in enumerate(starts):
        for end in by_start[p]:
            heapq.heappush(heap, end)
        while heap and heap[0] < p:
            heapq.heappop(heap)
        nxt = starts[k + 1] if k + 1 < len(starts) else None
        if nxt is None or heap[0] < nxt:
            out.append(p)
    return out


def undominated_rows(coef: np.ndarray, const: np.ndarray) -> list[int]:
    """Indices (ascending) of the memory rows ``const[k] + coef[k] . x`` that no other row
    dominates coefficient-wise: a dominated row can never be the binding peak."""
    order = np.argsort(-(const + coef.sum(axis=1)), kind="stable")
    kept: list[int] = []
    for k in order:
        # Dominators are usually the largest rows, which come first: compare with those only,
        # which bounds this loop to candidates x 64 x slots.
        top = kept[:64]
        if top and ((coef[top] >= coef[k] - 1e-12).all(axis=1) & (const[top] >= const[k] - 1e-12)).any():
            continue
        kept.append(int(k))
    return sorted(kept)


def equal_lines(mat: np.ndarray) -> list[list[int]]:
    """The row indices of ``mat`` grouped by equal rows (exactly equal: a class's cost is its
    first row's), in order of first appearance."""
    classes: dict[bytes, list[int]] = {}
    for i, row in enumerate(np.ascontiguousarray(mat)):
        classes.setdefault(row.tobytes(), []).append(i)
    return list(classes.values())
