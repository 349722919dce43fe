"""``mesh="auto"``: plan every arrangement of a cluster's devices as a mesh and keep the fastest.

The mesh shape is otherwise the user's guess: on 64 GPUs in 8 nodes, ``8x8``, ``4x16`` or
``2x4x8`` give different plans. For ``nodes x devices_per_node`` devices every ordered
factorisation of the device count into one to ``max_axes`` axes of size >= 2 is a candidate
(``mesh_shapes``), costed as ``MeshSpec.cluster`` lays it out: devices fill nodes in row-major
order, so inner axes get the intra-node links and an axis whose groups leave a node the
inter-node ones. The model is traced and profiled once (``search_meshes`` takes a planning
function of the mesh, ``autopar.api`` passes ``plan_traced`` over its trace); each candidate is
planned with the same options, the fastest feasible plan wins (ties: fewer axes, then the
order of ``mesh_shapes``), and every candidate's row -- shape, step time, peak memory,
planning seconds, or why it has no plan -- is kept for the report.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from autopar.layout.mesh import MeshSpec

__all__ = ["MeshRow", "MeshSearch", "mesh_shapes", "predicted_seconds", "search_meshes"]


@dataclass(frozen=True, slots=True)
class MeshRow:
    """One candidate mesh: its plan's estimate, or why it has none."""

    shape: tuple[int, ...]
    step_s: float | None  # None: no plan (``note`` says why)
    peak_bytes: int | None
    plan_s: float  # seconds spent planning this candidate
    note: str = ""

    @property
    def feasible(self) -> bool:
        return self.step_s is not None

    def __str__(self) -> str:
        shape = "x".join(map(str, self.shape))
        if not self.feasible:
            return f"{shape:>10}  {'-':>12}  {'-':>9}  {self.plan_s:7.1f}s  {self.note}"
        return (f"{shape:>10}  {self.step_s * 1e3:9.3f} ms  {self.peak_bytes / 2**30:6.2f} GiB  "
                f"{self.plan_s:7.1f}s  {self.note}")


@dataclass(frozen=True)
class MeshSearch:
    """Every candidate's row (in planning order) and the winning candidate's planning result."""

    rows: tuple[MeshRow, ...]
    best: Any  # the planning function's result for the fastest feasible mesh (None: no feasible one)
    best_shape: tuple[int, ...] | None

    def table(self) -> str:
        head = f"{'mesh':>10}  {'step':>12}  {'peak':>9}  {'planned':>8}"
        lines = [head, "-" * len(head)]
        for row in sorted(self.rows, key=_rank):
            mark = "  <- chosen" if row.shape == self.best_shape else ""
            lines.append(f"{row}{mark}")
        return "\n".join(lines)


def mesh_shapes(num_devices: int, *, max_axes: int = 3) -> list[tuple[int, ...]]:
    """Every ordered factorisation of ``num_devices`` into 1..``max_axes`` factors >= 2, fewer
    axes first (``(num_devices,)`` itself; one device: ``(1,)``)."""
    if not isinstance(num_devices, int) or isinstance(num_devices, bool) or num_devices < 1:
        raise ValueError(f"the device count must be a positive int, got {num_devices!r}")
    if not isinstance(max_axes, int) or max_axes < 1:
        raise ValueError(f"max_axes must be a positive int, got {max_axes!r}")
    if num_devices == 1:
        return [(1,)]
    out: list[tuple[int, ...]] = []

    def grow(prefix: tuple[int, ...], rest: int) -> None:
        if rest == 1:
            out.append(prefix)
            return
        if len(prefix) == max_axes:
            return
        for size in range(2, rest + 1):
            if rest % size == 0:
                grow(prefix + (size,), rest // size)

    grow((), num_devices)
    return sorted(out, key=lambda shape: (len(shape), shape))


def _rank(row: MeshRow) -> tuple:
    return (not row.feasible, row.step_s if row.feasible else 0.0, len(row.shape))


def search_meshes(plan_on: Callable[[MeshSpec, float | None], Any], *, nodes: int, devices_per_node: int,
                  device: str = "h100-80gb", max_axes: int = 3, time_budget: float | None = None,
                  estimate_of: Callable[[Any], Any] = lambda result: result.plan.estimate,
                  report: Callable[[MeshRow], None] | None = None) -> MeshSearch:
    """Plan every candidate mesh with ``plan_on(mesh, seconds_left)`` (a ``ValueError`` -- e.g.
    the budget cannot be met on that mesh -- or a ``RuntimeError`` such as a solver time-out is
    that candidate's note, not the search's end) and keep the fastest feasible result.

    The cluster's own shape (``nodes x devices_per_node``) goes first, so the search never
    returns a slower plan than it; then fewer axes first (more axes mean more strategies per op
    and slower solves). ``time_budget``: seconds for the whole search; ``seconds_left`` tells
    ``plan_on`` what remains (its solver time limit); a candidate whose planning is predicted
    (``predicted_seconds``: from the candidates planned so far) to overrun what remains is left
    out, as are all once it is spent, each with a row saying so. ``report`` receives each row as
    it is planned (progress output)."""
    rows, best, best_row = [], None, None
    start = time.perf_counter()
    shapes = mesh_shapes(nodes * devices_per_node, max_axes=max_axes)
    own = (devices_per_node,) if nodes == 1 else (nodes, devices_per_node)
    if own in shapes:
        shapes.insert(0, shapes.pop(shapes.index(own)))
    took: dict[int, float] = {}  # axis count -> the longest planning of a mesh with that many axes
    for shape in shapes:
        mesh = MeshSpec.cluster(nodes=nodes, devices_per_node=devices_per_node, device=device, shape=shape)
        left = None if time_budget is None else time_budget - (time.perf_counter() - start)
        t0 = time.perf_counter()
        if left is not None and best_row is not None:
            guess = predicted_seconds(len(shape), took)
            why = (f"the search's {time_budget:.0f}s were spent" if left <= 0 else
                   f"~{guess:.0f}s predicted for a {len(shape)}-axis mesh, {left:.0f}s of the search's "
                   f"{time_budget:.0f}s left" if guess is not None and guess > left else None)
            if why is not None:
                row = MeshRow(shape, None, None, 0.0, f"not planned: {why}")
                rows.append(row)
                if report is not None:
                    report(row)
                continue
        try:
            # The cluster's own shape (planned first) gets the full solver time whatever is left:
            # it is the plan the search must never be slower than.
            result = plan_on(mesh, None if left is None or not rows else max(left, 1.0))
        except (ValueError, RuntimeError) as exc:
            row = MeshRow(shape, None, None, time.perf_counter() - t0, _first_line(exc))
        else:
            est = estimate_of(result)
            row = MeshRow(shape, est.step_s, est.peak_bytes, time.perf_counter() - t0)
            if best_row is None or _rank(row) < _rank(best_row):
                best, best_row = result, row
        took[len(shape)] = max(took.get(len(shape), 0.0), row.plan_s)
        rows.append(row)
        if report is not None:
            report(row)
    if best_row is None:
        detail = "; ".join(f"{'x'.join(map(str, r.shape))}: {r.note}" for r in rows)
        raise ValueError(f"mesh='auto': no mesh of {nodes} x {devices_per_node} {device} devices has a plan ({detail})")
    return MeshSearch(tuple(rows), best, best_row.shape)


# Planning a mesh with one more axis takes about this many times longer. Options per op grow
# ~6x per axis and the resharding matrices between ops with their square: Llama-8B on 64 H100s
# has 8.5k options on 64, 48-59k on two axes, 336k on 2x4x8, and 2.8M edge-matrix entries on
# 8x8 against 94M on 2x4x8; planning 8x8 took ~10 s, 2x4x8 over 300 s (strategies 254 s, ILP
# build 71 s for its 1M-column relaxation) on a loaded machine.
AXIS_GROWTH = 30.0


def predicted_seconds(num_axes: int, took: dict[int, float]) -> float | None:
    """What planning a ``num_axes``-axis mesh should take, from the longest planning seen with as
    many axes, else with the most axes below it times ``AXIS_GROWTH`` per missing axis; None
    when nothing was planned yet. Only used to leave out meshes the time budget cannot fit."""
    if num_axes in took:
        return took[num_axes]
    fewer = [k for k in took if k < num_axes]
    if not fewer:
        return None
    k = max(fewer)
    return took[k] * AXIS_GROWTH ** (num_axes - k)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:160]
