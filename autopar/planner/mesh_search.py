"""``mesh="auto"``: plan every arrangement of a cluster's devices as a mesh and keep the fastest.

The mesh shape is otherwise the user's guess: on 64 GPUs in 8 nodes, ``8x8``, ``4x16`` or
``2x4x8`` give different plans. For ``nodes x devices_per_node`` devices every ordered
factorisation of the device count into one to ``max_axes`` axes of size >= 2 is a candidate
(``mesh_shapes``), costed as ``MeshSpec.cluster`` lays it out: devices fill nodes in row-major
order, so inner axes get the intra-node links and an axis whose groups leave a node the
inter-node ones. The model is traced and profiled once (``search_meshes`` takes a planning
function of the mesh, ``autopar.api`` passes ``plan_traced`` over its trace); each candidate is
planned with the same options and cost model, the fastest feasible plan wins (ties: fewer axes,
then the order of ``mesh_shapes``), and every candidate's row -- shape, step time, peak memory,
planning seconds, or why it has no plan -- is kept for the report.

Exact and restricted plans
--------------------------
One- and two-axis meshes are planned exactly (the full strategy space). A three-axis mesh has
~6x the options per op and ~30x the resharding-matrix entries of a two-axis one (Llama-8B on 64
H100s: 59k options on 8x8 against 336k on 2x4x8, 991k ILP columns; exact planning 20-60 s a
mesh against ~1.5 s), so when the time budget cannot fit exact plans for all of them, each gets
a **restricted** plan instead, by *pinned-axis descent*:

1. Start from the faster of its two-axis parents, ``(a, b*c)`` and ``(a*b, c)`` (already
   planned): pin the axis the parent shares with it (axis 0, or axis 2) -- every op keeps the
   placements the parent's plan gave it on that axis -- and plan the other two axes freely
   (``build_problem(fixed=)``, ``enumerate_strategies(fixed=)``: options of two-axis size).
   Parameter layouts, ZeRO and recompute stay free.
2. Then, while time is left (the fastest candidate first), pin another axis of the current plan
   and re-plan the other two. The current plan is in each step's space, so the step time never
   rises; a candidate has *converged* when pinning either other axis improves nothing, i.e. its
   plan is optimal against changing any two axes at once.

What is lost: plans that differ from the start on all three axes at once and are reached by no
chain of two-axis improvements. On Llama-8B (64 H100s), run to convergence, the descent reached
the exact optimum on every 3-axis shape compared -- 2x4x8 213.530 ms, 4x2x8 213.491, 8x4x2
213.758, 8x2x4 215.233, 4x4x4 244.718 -- in 3-5 steps of 1.5-4 s, where exact planning took
34-44 s a shape (load ~4.5 on 2 cores). The restricted plan is a real plan of the mesh,
costed by the same model; it is never better than the exact one (its options are a subset), and
its row says ``restricted: ...``. A ``restrict="auto"`` search plans a three-axis mesh exactly
when the prediction says all of them fit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from autopar.layout.mesh import MeshSpec
from autopar.strategies import FixedAxis, axis_placements

__all__ = ["MeshRow", "MeshSearch", "Pinned", "mesh_shapes", "predicted_seconds", "search_meshes", "search_given",
           "on_one_machine", "pinned", "pooled_links", "rank_groups", "pins_of", "RESTRICT_MODES"]

RESTRICT_MODES = ("auto", "always", "never")


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

    @property
    def restricted(self) -> bool:
        return self.note.startswith("restricted")

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


# ------------------------------------------------------------------------------ pinned axes
def pins_of(result: Any) -> dict[str, Any]:
    """Op decision -> the ``Strategy`` a planning result (``autopar.planner.orchestrate.PlanResult``) chose."""
    out = {}
    for name, option in result.recompute.choice.items():
        choice = result.built.choice_of(name, option)
        if choice.strategy is not None:
            out[name] = choice.strategy
    return out


def pinned(pins: dict[str, Any], *, src_axis: int, dst_axis: int, label: str = "") -> "Pinned":
    """``build_problem(fixed=)``: every op of ``pins`` keeps, on mesh axis ``dst_axis``, the
    placements its pinned strategy has on ``src_axis`` (of its own mesh, possibly another one
    with an axis of the same size); other decisions stay free."""
    return Pinned(pins, src_axis, dst_axis, label or f"axis {dst_axis} pinned")


@dataclass(frozen=True)
class Pinned:
    """``pinned``'s callable: op node -> its ``FixedAxis`` (None: free); ``str``: for progress lines."""

    pins: dict[str, Any]
    src_axis: int
    dst_axis: int
    label: str

    def __call__(self, node: Any) -> FixedAxis | None:
        strategy = self.pins.get(node.name)
        if strategy is None:
            return None
        _, ins, outs = axis_placements(strategy, self.src_axis)
        return self.dst_axis, ins, outs

    def __str__(self) -> str:
        return self.label


def _parents(shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], int, int]]:
    """A 3-axis mesh's two-axis parents: (parent shape, parent axis, the same axis here)."""
    a, b, c = shape
    return [((a, b * c), 0, 0), ((a * b, c), 1, 2)]


@dataclass
class _Descent:
    """A restricted candidate: its best plan so far and which axes were pinned since it improved."""

    shape: tuple[int, ...]
    parent: tuple[int, ...]
    result: Any = None
    step_s: float = float("inf")
    peak_bytes: int = 0
    plan_s: float = 0.0
    steps: int = 0
    last_pin: int = 0
    tried: set[int] = field(default_factory=set)  # axes pinned without improvement since the last gain
    error: str = ""
    behind: bool = False  # left unrefined: over DESCENT_WINDOW slower than the fastest plan

    @property
    def converged(self) -> bool:
        return self.result is None or len(self.tried) >= 2

    def next_pin(self) -> int:
        return next(k for k in ((self.last_pin + i) % 3 for i in (1, 2)) if k not in self.tried)

    def row(self) -> MeshRow:
        if self.result is None:
            return MeshRow(self.shape, None, None, self.plan_s, self.error)
        state = ("converged" if self.converged else
                 f"not refined (over {DESCENT_WINDOW:.0%} slower than the fastest)" if self.behind else
                 "not converged (time)")
        plural = "s" if self.steps > 1 else ""
        return MeshRow(self.shape, self.step_s, self.peak_bytes, self.plan_s,
                       f"restricted: pinned-axis descent from {'x'.join(map(str, self.parent))}'s plan, "
                       f"{self.steps} step{plural}, {state}")


# ---------------------------------------------------------------------------------- search
def search_meshes(plan_on: Callable[..., Any], *, nodes: int, devices_per_node: int,
                  device: str = "h100-80gb", max_axes: int = 3, time_budget: float | None = None,
                  estimate_of: Callable[[Any], Any] = lambda result: result.plan.estimate,
                  report: Callable[[MeshRow], None] | None = None, restrict: str = "auto",
                  pins_of: Callable[[Any], dict[str, Any]] = pins_of) -> MeshSearch:
    """Plan every candidate mesh with ``plan_on(mesh, seconds_left)`` (a ``ValueError`` -- e.g.
    the budget cannot be met on that mesh -- or a ``RuntimeError`` such as a solver time-out is
    that candidate's note, not the search's end) and keep the fastest feasible result.

    The cluster's own shape (``nodes x devices_per_node``) goes first, so the search never
    returns a slower plan than it; then fewer axes first (more axes mean more strategies per op
    and slower solves). ``time_budget``: seconds for the whole search; ``seconds_left`` tells
    ``plan_on`` what remains (its solver time limit); a candidate whose planning is predicted
    (``predicted_seconds``: from the candidates planned so far) to overrun what remains is left
    out, as are all once it is spent, each with a row saying so. ``report`` receives each row as
    it is planned (progress output; a restricted candidate's again after each descent step).

    ``restrict``: how meshes of three axes are planned -- ``"never"``: exactly, like the others;
    ``"always"``: restricted (module docstring: ``plan_on(mesh, seconds_left, fixed=...)``
    plans with one axis pinned, ``pins_of(result)`` reads a plan's strategy per op);
    ``"auto"``: exactly when a time budget is given and the exact planning of all of them is
    predicted to fit in what the one- and two-axis meshes leave, restricted otherwise."""
    if restrict not in RESTRICT_MODES:
        raise ValueError(f"restrict must be one of {RESTRICT_MODES}, got {restrict!r}")
    search = _Search(plan_on, nodes=nodes, devices_per_node=devices_per_node, device=device,
                     time_budget=time_budget, estimate_of=estimate_of, report=report, pins_of=pins_of)
    shapes = mesh_shapes(nodes * devices_per_node, max_axes=max_axes)
    own = (devices_per_node,) if nodes == 1 else (nodes, devices_per_node)
    if own in shapes:
        shapes.insert(0, shapes.pop(shapes.index(own)))
    three = [s for s in shapes if len(s) == 3]
    for shape in shapes:
        if len(shape) <= 2:
            search.exact(shape)
    if three and search.restricting(three, restrict):
        search.restricted(three)
    else:
        for shape in three:
            search.exact(shape)
    for shape in shapes:  # max_axes > 3: more axes, planned exactly
        if len(shape) > 3:
            search.exact(shape)
    return search.result(shapes)


def on_one_machine(meshes: Sequence[MeshSpec]) -> list[MeshSpec]:
    """Calibrated candidate meshes priced as one machine: each keeps its own links (per-axis
    alpha/beta, per-kind link fits -- on each axis and on each group of several axes -- and blocking
    waits: what differs between arrangements of the ranks), and all
    take the first calibrated one's machine-wide figures -- compute rate tables, time scales,
    steady-state peaks, ``comm_overlap`` and ``idle_speedup``. Why: those describe the machine,
    not how its ranks are arranged, and two calibrations taken minutes apart differ in them by
    the load of the moment (4 gloo ranks on 2 shared cores: overlap 0% in a (4,) profile, 61% in
    the (2, 2) one calibrated next; fp32 matmul 37 vs 40 GFLOP/s) -- a difference that would
    pick the mesh, not the links.

    A group of ranks two meshes both have is one set of links, so it gets one price: where the
    same partition of the ranks is a mesh axis (or set of axes) in several profiles -- the (4,)
    mesh's axis and the (2, 2) mesh's group spanning both axes are the same 4 ranks -- each
    collective kind fitted on it is priced by the mean of the profiles' fits (``pooled_links``).
    Why: two calibrations of that one group differed by 20% in all-reduce latency (5.1 vs 4.2 ms),
    which priced data parallelism 3% faster on (2, 2) than on (4,) -- the same collectives on
    the same ranks. Meshes without a machine profile are returned as they are."""
    from dataclasses import replace

    meshes = list(meshes)
    ref = next((m for m in meshes if m.machine is not None), None)
    if ref is None:
        return meshes
    out = []
    for mesh in meshes:
        if mesh is ref or mesh.machine is None:
            out.append(mesh)
            continue
        machine = replace(ref.machine, links=mesh.machine.links, blocking_s=mesh.machine.blocking_s,
                          blocking_over=mesh.machine.blocking_over,
                          measured_shape=mesh.machine.measured_shape,
                          measured_axis_names=mesh.machine.measured_axis_names, note=mesh.machine.note)
        out.append(replace(mesh, peak_flops=ref.peak_flops, half_peak_flops=ref.half_peak_flops,
                           mem_bandwidth=ref.mem_bandwidth, comm_overlap=ref.comm_overlap, machine=machine))
    return pooled_links(out)


def rank_groups(shape: Sequence[int], axes: Sequence[int]) -> frozenset[frozenset[int]]:
    """The groups of ranks (row-major, as ``init_device_mesh`` lays them out) that a collective
    over mesh ``axes`` of a mesh of ``shape`` runs on: the partition that names the group."""
    import numpy as np

    ranks = np.arange(int(np.prod(shape))).reshape(tuple(shape))
    moved = np.moveaxis(ranks, tuple(axes), tuple(range(len(shape) - len(axes), len(shape))))
    width = int(np.prod([shape[a] for a in axes]))
    return frozenset(frozenset(int(r) for r in row) for row in moved.reshape(-1, width))


def pooled_links(meshes: Sequence[MeshSpec]) -> list[MeshSpec]:
    """``meshes`` with every collective kind on a group of ranks that several of them measured
    priced by the mean of their fits (``on_one_machine``). A mesh's fit of a kind on one axis is
    its per-kind fit, else the axis's all-kind ``alpha``/``beta``; on several axes only a per-kind
    fit counts (a fallback there is not a measurement of the group). Blocking waits are left as
    measured: a sum over several axes blocks as a chain of per-axis all-reduces, a different
    collective from one all-reduce on the same ranks."""
    import itertools
    from dataclasses import replace

    from autopar.layout.machine import LINK_KINDS, LinkFit

    seen: dict[tuple, list[tuple[int, tuple[int, ...], float, float]]] = {}
    for i, mesh in enumerate(meshes):
        if mesh.machine is None:
            continue
        wide = [a for a, n in enumerate(mesh.shape) if n > 1]
        for axes in (c for k in range(1, len(wide) + 1) for c in itertools.combinations(wide, k)):
            group = rank_groups(mesh.shape, axes)
            for kind in LINK_KINDS:
                fit = mesh.machine.link_over(kind, axes)
                if fit is not None:
                    seen.setdefault((group, kind), []).append((i, axes, fit.alpha, fit.beta))
                elif len(axes) == 1:
                    seen.setdefault((group, kind), []).append((i, axes, mesh.alpha[axes[0]], mesh.beta[axes[0]]))
    pooled: dict[int, dict[tuple, LinkFit]] = {}
    for (_, kind), fits in seen.items():
        if len({i for i, *_ in fits}) < 2:
            continue
        alpha = sum(f[2] for f in fits) / len(fits)
        beta = sum(f[3] for f in fits) / len(fits)
        for i, axes, _, _ in fits:
            pooled.setdefault(i, {})[kind, axes] = LinkFit.over(kind, axes, alpha, beta)
    out = list(meshes)
    for i, fits in pooled.items():
        machine = out[i].machine
        links = tuple(fits.pop((f.kind, f.axes), f) for f in machine.links) + tuple(fits.values())
        if links != machine.links:
            out[i] = replace(out[i], machine=replace(machine, links=links))
    return out


def search_given(plan_on: Callable[[MeshSpec], Any], meshes: Sequence[MeshSpec], *,
                 estimate_of: Callable[[Any], Any] = lambda result: result.plan.estimate,
                 report: Callable[[MeshRow], None] | None = None) -> MeshSearch:
    """Plan each of the given ``meshes`` (of one device count, each priced by its own costs --
    machine profiles of the shapes a world allows, from ``autopar calibrate``) with
    ``plan_on(mesh)`` and keep the result estimated fastest (ties: fewer axes, then the given
    order). A ``ValueError`` or ``RuntimeError`` of one mesh is its row's note; none feasible
    raises a ``ValueError`` listing every row. Unlike ``search_meshes`` the shapes are the
    caller's and the links their profiles' (no cluster preset), all planned exactly."""
    meshes = list(meshes)
    if not meshes:
        raise ValueError("search_given needs at least one candidate mesh")
    shapes = [tuple(m.shape) for m in meshes]
    counts = {m.num_devices for m in meshes}
    if len(counts) > 1:
        raise ValueError(f"the candidate meshes {shapes} have different device counts {sorted(counts)}")
    if len(set(shapes)) != len(shapes):
        raise ValueError(f"the candidate meshes {shapes} repeat a shape: give one machine profile per shape")
    rows, results = [], {}
    for mesh, shape in zip(meshes, shapes):
        t0 = time.perf_counter()
        try:
            result = plan_on(mesh)
        except (ValueError, RuntimeError) as exc:
            row = MeshRow(shape, None, None, time.perf_counter() - t0, _first_line(exc))
        else:
            est = estimate_of(result)
            results[shape] = result
            row = MeshRow(shape, est.step_s, est.peak_bytes, time.perf_counter() - t0)
        rows.append(row)
        if report is not None:
            report(row)
    feasible = [r for r in rows if r.feasible]
    if not feasible:
        detail = "; ".join(f"{'x'.join(map(str, r.shape))}: {r.note}" for r in rows)
        raise ValueError(f"no candidate mesh has a plan ({detail})")
    best = min(feasible, key=lambda r: (_rank(r), shapes.index(r.shape)))
    return MeshSearch(tuple(rows), results[best.shape], best.shape)


# A restricted 3-axis step builds and solves options of about a two-axis mesh's size, with
# three-axis conversion graphs: Llama-8B on 2x4x8 took 1.4-4.0 s a step against 1.4 s for 8x8.
RESTRICTED_GROWTH = 3.0
# A descent step (an improvement, not a row) starts only when this many times the longest step
# so far is left: steps vary 2x on a loaded machine, and the search should end within its budget.
DESCENT_MARGIN = 2.0
# Under a time budget, only candidates within this fraction of the fastest plan found are refined
# by descent (the budget goes to likely winners). On Llama-8B descent gained 1.3% on the leaders
# (8x4x2 216.5 -> 213.8 ms) and up to 16% further back (4x4x4 293 -> 245 ms), which still left
# every candidate outside the window over 10% behind the fastest.
DESCENT_WINDOW = 0.10


class _Search:
    """The state of one ``search_meshes`` call: rows by shape, results, the clock."""

    def __init__(self, plan_on, *, nodes, devices_per_node, device, time_budget, estimate_of, report, pins_of):
        self.plan_on, self.estimate_of, self.report, self.pins_of = plan_on, estimate_of, report, pins_of
        self.cluster = dict(nodes=nodes, devices_per_node=devices_per_node, device=device)
        self.time_budget, self.start = time_budget, time.perf_counter()
        self.rows: dict[tuple[int, ...], MeshRow] = {}
        self.results: dict[tuple[int, ...], Any] = {}
        self.took: dict[int, float] = {}  # axis count -> the longest exact planning of a mesh with that many axes
        self.step_took = 0.0  # the longest restricted step so far

    # -- clock
    def left(self) -> float | None:
        return None if self.time_budget is None else self.time_budget - (time.perf_counter() - self.start)

    def _skip_note(self, guess: float | None, what: str) -> str | None:
        """Why a planning predicted to take ``guess`` s is not started (None: start it)."""
        left = self.left()
        if left is None or not self.rows:
            return None
        if left <= 0:
            return f"not planned: the search's {self.time_budget:.0f}s were spent"
        if guess is not None and guess > left:
            return f"not planned: ~{guess:.0f}s predicted for {what}, {left:.0f}s of the search's " \
                   f"{self.time_budget:.0f}s left"
        return None

    def _emit(self, row: MeshRow) -> None:
        self.rows[row.shape] = row
        if self.report is not None:
            self.report(row)

    def _call(self, shape, **kwargs):
        mesh = MeshSpec.cluster(**self.cluster, shape=shape)
        left = self.left()
        # The cluster's own shape (planned first) gets the full solver time whatever is left:
        # it is the plan the search must never be slower than.
        return self.plan_on(mesh, None if left is None or not self.rows else max(left, 1.0), **kwargs)

    # -- exact planning
    def exact(self, shape: tuple[int, ...]) -> None:
        why = self._skip_note(predicted_seconds(len(shape), self.took), f"a {len(shape)}-axis mesh")
        if why is not None:
            self._emit(MeshRow(shape, None, None, 0.0, why))
            return
        t0 = time.perf_counter()
        try:
            result = self._call(shape)
        except (ValueError, RuntimeError) as exc:
            row = MeshRow(shape, None, None, time.perf_counter() - t0, _first_line(exc))
        else:
            est = self.estimate_of(result)
            self.results[shape] = result
            row = MeshRow(shape, est.step_s, est.peak_bytes, time.perf_counter() - t0)
        self.took[len(shape)] = max(self.took.get(len(shape), 0.0), row.plan_s)
        self._emit(row)

    def restricting(self, shapes: list[tuple[int, ...]], mode: str) -> bool:
        if mode != "auto":
            return mode == "always"
        left = self.left()
        guess = predicted_seconds(3, self.took)
        return left is not None and (guess is None or guess * len(shapes) > left)

    # -- restricted planning (pinned-axis descent)
    def restricted(self, shapes: list[tuple[int, ...]]) -> None:
        runs = []
        for shape in shapes:
            parents = [(self.rows[p].step_s, p, src, dst) for p, src, dst in _parents(shape)
                       if p in self.results and self.rows[p].feasible]
            if not parents:
                names = " nor ".join("x".join(map(str, p)) for p, _, _ in _parents(shape))
                why = f"not planned: neither two-axis parent ({names}) has a plan"
                self._emit(MeshRow(shape, None, None, 0.0, why))
                continue
            _, parent, src, dst = min(parents)
            runs.append((self.rows[parent].step_s, _Descent(shape, parent, last_pin=dst), src))
        # First steps, the most promising parent first, so a short budget plans the likely winners.
        for _, run, src in sorted(runs, key=lambda r: r[0]):
            self._step(run, source=self.results[run.parent], src=src, dst=run.last_pin)
        # Descent, the fastest candidate first, while time is left; under a time budget,
        # candidates far behind the fastest plan of any mesh keep their first step.
        live = [run for _, run, _ in runs]
        window = float("inf") if self.time_budget is None else 1 + DESCENT_WINDOW
        while True:
            fastest = min((r.step_s for r in self.rows.values() if r.feasible), default=float("inf"))
            todo = sorted((r for r in live if not r.converged and r.step_s <= fastest * window),
                          key=lambda r: r.step_s)
            # Twice the longest step: a step started late must not overrun the budget.
            if not todo or self._skip_note(DESCENT_MARGIN * self.step_took, "a descent step") is not None:
                break
            run = todo[0]
            k = run.next_pin()
            self._step(run, source=run.result, src=k, dst=k)
        for run in live:
            if not run.converged and run.step_s > fastest * window:
                run.behind = True
                self._emit(run.row())

    def _step(self, run: _Descent, *, source: Any, src: int, dst: int) -> None:
        """Plan ``run``'s mesh with axis ``dst`` pinned as ``source``'s plan has its axis ``src``."""
        first = run.steps == 0 and run.result is None and not run.error
        guess = self.step_took or (RESTRICTED_GROWTH * self.took[2] if 2 in self.took else None)
        why = self._skip_note(guess, "a restricted 3-axis mesh")
        if why is not None:
            if first:
                run.error = why
                self._emit(run.row())
            else:
                run.tried.update({0, 1, 2})  # out of time: stop its descent
            return
        t0 = time.perf_counter()
        try:
            origin = f"as {'x'.join(map(str, run.parent))}'s plan" if first else f"step {run.steps + 1}"
            result = self._call(run.shape, fixed=pinned(self.pins_of(source), src_axis=src, dst_axis=dst,
                                                         label=f"axis {dst} pinned {origin}"))
        except (ValueError, RuntimeError) as exc:
            took = time.perf_counter() - t0
            run.plan_s += took
            if first:
                run.error = f"restricted: {_first_line(exc)}"
            else:
                run.tried.add(dst)
            self._emit(run.row())
            return
        took = time.perf_counter() - t0
        self.step_took = max(self.step_took, took)
        est = self.estimate_of(result)
        run.plan_s += took
        run.steps += 1
        # Relative tolerance: the solver's own gap must not count as progress (no cycling on ties).
        if run.result is None or est.step_s < run.step_s * (1 - 1e-9):
            run.result, run.step_s, run.peak_bytes = result, est.step_s, est.peak_bytes
            run.last_pin, run.tried = dst, set()
        else:
            run.tried.add(dst)
        self.results[run.shape] = run.result
        self._emit(run.row())

    # -- outcome
    def result(self, shapes: list[tuple[int, ...]]) -> MeshSearch:
        rows = [self.rows[s] for s in shapes]
        feasible = [r for r in rows if r.feasible]
        if not feasible:
            detail = "; ".join(f"{'x'.join(map(str, r.shape))}: {r.note}" for r in rows)
            c = self.cluster
            raise ValueError(f"mesh='auto': no mesh of {c['nodes']} x {c['devices_per_node']} {c['device']} devices "
                             f"has a plan ({detail})")
        best = min(feasible, key=lambda r: (_rank(r), shapes.index(r.shape)))
        order = sorted(rows, key=lambda r: list(self.rows).index(r.shape))  # planning order
        return MeshSearch(tuple(order), self.results[best.shape], best.shape)


# Planning a mesh with one more axis exactly takes about this many times longer. Options per op
# grow ~6x per axis and the resharding matrices between ops with their square: Llama-8B on 64
# H100s has 8.5k options on 64, 48-59k on two axes, 336k on 2x4x8, and 2.8M edge-matrix entries
# on 8x8 against 94M on 2x4x8; planning 8x8 took ~1.5 s, 2x4x8 exactly 23 s, 2x2x16 15 s.
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
