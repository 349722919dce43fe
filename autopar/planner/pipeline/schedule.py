"""The pipeline schedules' cost formulas and the stage-cut dynamic program (numpy-free; torch only through
``pipeline.order``, which reads the interleaved schedules' in-flight counts off torch's own action order).

Notation: ``S`` pipeline ranks (mesh axis 0), ``v`` virtual stages per rank (K = S * v stages in
pipeline order, stage k on rank ``k % S``), ``M`` micro-batches, ``t_k`` stage k's time for ONE
micro-batch (forward + backward, its sharded ops on the stage sub-mesh, plus sending its output
forward and receiving its gradient back over axis 0's link, plus ``action_overhead_s``: the
schedule's ``STAGE_ACTIONS = 2`` actions per micro-batch, forward and backward, each costing the
machine's ``pipeline_action_s``), ``sync_k`` its once-per-step gradient synchronisation over the
sub-mesh. Priced in one place, ``pipeline.costs.StageCosts`` (its ``StageCost.time_s``), which the
cut search, the bounds, the assembled plan's estimate and the report all read.

Step time (``step_time``) = ``(M * v + bubble) * max_k t_k + max_k sync_k`` with the idle slots

- GPipe, 1F1B: ``S - 1`` (``(M + S - 1) * t``: the classic fill and drain);
- interleaved 1F1B: ``S - 1`` in units of a chunk: ``(M + (S - 1) / v) * (v * t)``, Megatron's
  bubble divided by ``v``;
- zero-bubble (torch's interleaved zero-bubble schedule, ZB-H1 of Qi et al. 2023): the
  weight-gradient passes fill about two thirds of the 1F1B bubble when forward, input-gradient
  and weight-gradient passes take a third of ``t`` each: ``(S - 1) / 3`` (torch's own order for
  it, played with equal thirds, gives exactly this), and the whole step ``1 + SPLIT_BACKWARD``
  times longer: the split backward's two autograd calls cost more compute than one;

scaled by ``2 / idle_speedup - 1`` (``bubble``; ``idle_speedup``: the calibrated machine's
``MachineProfile.idle_speedup``, 1 on a preset, where the scale is 1). Why: every rank waits
``bubble * t`` of the step, with about half the ranks waiting at any time it waits (exactly so
for 2 ranks: played out, their waits never coincide; the fill's and drain's staircases average
half for more). So ``2 * bubble * t`` of the step runs half the ranks, and where ranks share
cores those run ``idle_speedup`` times faster: that part takes ``2 * bubble * t / idle_speedup``,
the step ``(M v - bubble + 2 bubble / idle_speedup) t``. With 2 ranks on 2 stages and 2
micro-batches this is exact for the played-out 1F1B order; ``idle_speedup = 2`` (waiting ranks
lend all their cores) leaves ``M v t``, the ranks' own work, and the scale is clamped at 0 there
(a larger measured speedup is other jobs yielding, which no schedule can bank on).

Balanced chunks are assumed for interleaving (a rank's time per micro-batch is ``v`` times the
slowest chunk's): the DP bounds the slowest chunk, which bounds every rank's sum.

In-flight micro-batches (``in_flight``), whose saved activations stage k holds at its peak:

- GPipe: ``M`` (every forward runs before the first backward);
- 1F1B: ``min(S - r, M)`` on rank ``r`` (its warm-up forwards plus the one in flight);
- interleaved 1F1B: the most micro-batches the chunk holds at any point of torch's own action
  order for its rank (``pipeline.order.chunk_peaks``; a chunk's peak, the rank's chunks peaking
  at different times -- ``pipeline.order.rank_counts`` gives the rank's exact mix);
- zero-bubble: ``M``, as GPipe: torch's input-gradient pass keeps the gradients of the
  intermediate values for the deferred weight-gradient pass, and measured (GPT-2, 2 ranks x 2
  chunks, 8 micro-batches) rank 1 held 11 of its 16 chunk micro-batches' saved bytes, beyond any
  1F1B-like count; every micro-batch is the bound that holds.

``best_cuts`` finds the contiguous cut of ``B`` blocks into ``K`` stages minimising
``factor * max_k t_k + max_k sync_k`` exactly: for each candidate bottleneck T (every stage time,
ascending) a DP over cut points minimises the largest sync among cuts whose stages all take at
most T; it stops once ``factor * T`` alone cannot beat the best found.

``schedule_cuts`` prices the stages with a ``StageCosts`` (:mod:`autopar.planner.pipeline.costs`,
passed in: that module builds on this one) and runs the DP through ``LazyCuts``, which solves a
stage whose memory budget binds only when its lower bound can still beat the best cut found.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable

from autopar.layout.cost import pipeline_action_seconds
from autopar.planner.pipeline.order import chunk_peaks
from autopar.plans import PIPELINE_SCHEDULES

__all__ = ["SCHEDULE_VIRTUAL_STAGES", "SPLIT_BACKWARD", "STAGE_ACTIONS", "action_overhead_s",
           "stage_window", "schedules_for", "check_pipeline_zero", "idle_speedup", "bubble",
           "step_factor",
           "in_flight", "step_time", "Cuts", "best_cuts", "LazyCuts", "PipelineCandidate", "schedule_cuts"]

# Actions of one stage (chunk) per micro-batch that pay the machine's per-action overhead
# (``layout.cost.pipeline_action_seconds``), the same under every schedule: GPipe, 1F1B and
# interleaved 1F1B run a forward and a full backward; zero-bubble splits the backward into the
# input-gradient pass (I, which sends the gradient back) and the weight-gradient pass (W, local to
# the rank). Measured with trivial stages on 2 gloo ranks x 2 chunks (M = 2 vs 8, lockstep
# medians): interleaved 1F1B 7.40 ms and zero-bubble 7.56 ms per micro-batch per rank, i.e. W adds
# ~0.08 ms against ~1.85 ms for each transferring action: W is not counted.
STAGE_ACTIONS = 2

# What torch's split backward adds to zero-bubble's compute, as a fraction of a chunk's time per
# micro-batch: the input-gradient and weight-gradient passes are two autograd calls over the
# chunk where the other schedules run one (measured on 2 gloo ranks x 2 chunks, GPT-2 with real
# stages: ~5 ms per chunk micro-batch more than one full backward, ~7% of a 75 ms chunk; in
# proportion to the compute, unlike the per-action overhead). Without it zero-bubble was priced
# 3% below interleaved 1F1B and measured 8% above it.
SPLIT_BACKWARD = {"zero-bubble": 0.07}

# Virtual stages per rank each schedule is planned with (the runtime's torch schedules run
# gpipe/1f1b with one stage per rank; the interleaved ones with two or more).
SCHEDULE_VIRTUAL_STAGES = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zero-bubble": 2}


def check_pipeline_zero(zero_stage) -> None:
    """Pipelined stages are planned (and run) with ZeRO-0 or ZeRO-1 per parameter over the stage
    sub-mesh: ``zero_stage=1`` prices each replicated parameter's optimizer state split over its
    replicas plus the all-gather after the step (``autopar.planner.zero_pricing``)."""
    if zero_stage not in (0, 1):
        raise ValueError(f"pipelined plans take zero_stage 0 or 1, got {zero_stage!r}: the schedule accumulates "
                         f"each gradient over the micro-batches before the once-per-step data-parallel sum, so "
                         f"ZeRO-2 has no per-micro-batch gradient to reduce-scatter")


def schedules_for(schedule: str) -> tuple[str, ...]:
    if schedule == "auto":
        return PIPELINE_SCHEDULES
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"schedule must be 'auto' or one of {PIPELINE_SCHEDULES}, got {schedule!r}")
    return (schedule,)


# Deeper models than this get a stage-length window under ``window="auto"``.
AUTO_WINDOW_BLOCKS = 24


def stage_window(window: int | str | None, *, num_blocks: int, parts: int) -> int | None:
    """The stage-length window for cutting ``num_blocks`` blocks into ``parts`` stages: each stage
    holds between ``B / K - w`` and ``B / K + w`` blocks (None: any count). ``"auto"``: none up to
    ``AUTO_WINDOW_BLOCKS`` blocks, else ``max(2, ceil(B / K / 2))`` -- with uniform blocks the best
    cuts are near even (the first and last stages, holding the embedding and the head, a block or
    two shorter), and the cut DP over every length of a 96-block model on 32 stages runs over 60k
    stage ranges per pass."""
    if window == "auto":
        return None if num_blocks <= AUTO_WINDOW_BLOCKS else max(2, math.ceil(num_blocks / parts / 2))
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise ValueError(f"window must be None, 'auto' or a block count >= 0, got {window!r}")
    return window


def _check(schedule: str) -> None:
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r} is not one of {PIPELINE_SCHEDULES}")


def action_overhead_s(mesh) -> float:
    """Seconds the schedule's actions add to every stage's per-micro-batch time on ``mesh``:
    ``STAGE_ACTIONS`` x the machine's per-action overhead (calibrated, else the preset's)."""
    return STAGE_ACTIONS * pipeline_action_seconds(mesh)


def idle_speedup(mesh) -> float:
    """The mesh's calibrated ``MachineProfile.idle_speedup`` (1: a preset, or a device per rank)."""
    machine = getattr(mesh, "machine", None)
    return 1.0 if machine is None else machine.idle_speedup


def bubble(schedule: str, *, num_stages: int, idle_speedup: float = 1.0) -> float:
    """Idle slots per rank, in units of the slowest stage's time per micro-batch, as they cost
    the step (module docstring): the schedule's ``S - 1`` (zero-bubble: a third of it) scaled by
    ``max(0, 2 / idle_speedup - 1)`` -- the half of the ranks still busy in those slots run
    ``idle_speedup`` times faster where ranks share cores (on 4 gloo ranks on 2 cores, GPT-2's
    2-stage 1F1B with 2 micro-batches measured 1.8-1.9 times its priced stage time, where the
    unscaled formula says 3)."""
    _check(schedule)
    slots = (num_stages - 1) / 3.0 if schedule == "zero-bubble" else float(num_stages - 1)
    return slots * max(0.0, 2.0 / idle_speedup - 1.0)


def step_factor(schedule: str, *, num_stages: int, virtual_stages: int, num_microbatches: int,
                idle_speedup: float = 1.0) -> float:
    """How many times the slowest stage's per-micro-batch time the step takes: ``M v + bubble``,
    times ``1 + SPLIT_BACKWARD`` for a schedule that splits the backward."""
    slots = num_microbatches * virtual_stages + bubble(schedule, num_stages=num_stages, idle_speedup=idle_speedup)
    return slots * (1.0 + SPLIT_BACKWARD.get(schedule, 0.0))


def in_flight(schedule: str, *, index: int, num_stages: int, virtual_stages: int, num_microbatches: int) -> int:
    """Micro-batches whose saved activations stage ``index`` holds at its peak (module docstring)."""
    _check(schedule)
    rank, m = index % num_stages, num_microbatches
    if schedule in ("gpipe", "zero-bubble"):
        return m
    if virtual_stages == 1:
        return min(num_stages - rank, m)
    return chunk_peaks(schedule, rank=rank, num_stages=num_stages, virtual_stages=virtual_stages,
                       num_microbatches=m)[index // num_stages]


def step_time(schedule: str, *, times, syncs, num_stages: int, virtual_stages: int, num_microbatches: int,
              idle_speedup: float = 1.0) -> float:
    """The step's seconds for per-stage micro-batch ``times`` and gradient ``syncs``."""
    factor = step_factor(schedule, num_stages=num_stages, virtual_stages=virtual_stages,
                         num_microbatches=num_microbatches, idle_speedup=idle_speedup)
    return factor * max(times) + max(syncs, default=0.0)


@dataclass(frozen=True, slots=True)
class Cuts:
    """Stage k holds blocks ``[bounds[k], bounds[k + 1])`` and runs its option ``picks[k]`` (of
    those ``cost`` gave it); ``objective`` = factor * max time + max sync."""

    bounds: tuple[int, ...]
    objective: float
    max_time: float
    max_sync: float
    picks: tuple[int, ...] = ()


Option = tuple[float, float]  # (time per micro-batch, gradient sync per step)


def best_cuts(num_blocks: int, num_parts: int,
              cost: Callable[[int, int, int], Option | list[Option] | None], *, factor: float) -> Cuts | None:
    """The best contiguous cut of ``num_blocks`` blocks into ``num_parts`` non-empty stages, or
    None when no cut has every stage feasible. ``cost(k, a, b)``: (time, sync) of stage k
    holding blocks ``[a, b)``, or a list of such options (e.g. with and without activation
    recompute: the DP picks one per stage), or None when it does not fit.

    Exact: for a bottleneck ``T`` every stage takes, among its options no slower than ``T``, the
    one of least sync (the objective only grows with a stage's sync once ``T`` is fixed), so the
    threshold sweep over every option's time finds the optimum over cuts and options together."""
    if num_parts < 1 or num_blocks < num_parts:
        raise ValueError(f"cannot cut {num_blocks} blocks into {num_parts} non-empty stages")
    table: dict[tuple[int, int, int], tuple[Option, ...]] = {}
    for k in range(num_parts):
        for a in range(k, num_blocks - num_parts + k + 1):
            for b in range(a + 1, num_blocks - num_parts + k + 2):
                c = cost(k, a, b)
                if c is None:
                    continue
                opts = tuple(c) if isinstance(c, list) else (c,)
                if opts:
                    table[k, a, b] = opts
    ends: dict[tuple[int, int], list] = {}  # (k, a) -> [(b, options)]: the DP's inner loop
    for (k, a, b), opts in table.items():
        ends.setdefault((k, a), []).append((b, opts))
    best: Cuts | None = None
    limits = sorted({t for opts in table.values() for t, _ in opts})
    # A cut with every stage within a limit exists from some limit on: bisect for the first one
    # (the sweep below would try every smaller limit in vain).
    lo, hi = 0, len(limits)
    while lo < hi:
        mid = (lo + hi) // 2
        if _min_sync(num_blocks, num_parts, ends, limits[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    for limit in limits[lo:]:
        if best is not None and factor * limit >= best.objective:
            break  # syncs are >= 0: no larger bottleneck can win
        found = _min_sync(num_blocks, num_parts, ends, limit)
        if found is None:
            continue
        sync, bounds = found
        picks = tuple(_pick(table[k, bounds[k], bounds[k + 1]], limit) for k in range(num_parts))
        time = max(table[k, bounds[k], bounds[k + 1]][i][0] for k, i in enumerate(picks))
        if best is None or factor * time + sync < best.objective:
            best = Cuts(bounds, factor * time + sync, time, sync, picks)
    return best


def _pick(opts: tuple[Option, ...], limit: float) -> int | None:
    """The option of least sync (then least time) no slower than ``limit``; None: none is."""
    fit = [i for i, (t, _) in enumerate(opts) if t <= limit]
    return min(fit, key=lambda i: (opts[i][1], opts[i][0])) if fit else None


def _min_sync(num_blocks: int, num_parts: int, ends, limit: float) -> tuple[float, tuple[int, ...]] | None:
    """Cut points minimising the largest sync with every stage time <= ``limit`` (``ends``:
    (k, a) -> the stages k starting at a, as (b, options))."""
    inf = math.inf
    # f[k][b]: least max-sync of stages 0..k-1 covering blocks [0, b); back[k][b]: stage k-1's start.
    f = [[inf] * (num_blocks + 1) for _ in range(num_parts + 1)]
    back = [[-1] * (num_blocks + 1) for _ in range(num_parts + 1)]
    f[0][0] = 0.0
    for k in range(num_parts):
        for a in range(num_blocks):
            if f[k][a] == inf:
                continue
            for b, opts in ends.get((k, a), ()):
                i = _pick(opts, limit)
                if i is None:
                    continue
                v = max(f[k][a], opts[i][1])
                if v < f[k + 1][b]:
                    f[k + 1][b], back[k + 1][b] = v, a
    if f[num_parts][num_blocks] == inf:
        return None
    bounds = [num_blocks]
    for k in range(num_parts, 0, -1):
        bounds.append(back[k][bounds[-1]])
    return f[num_parts][num_blocks], tuple(reversed(bounds))


@dataclass(frozen=True, slots=True)
class PipelineCandidate:
    """One (micro-batch count, schedule) tried: its step time, or why it has none. ``assembled``:
    ``step_s`` is the assembled plan's estimate (the chosen candidate: layouts shared across
    stages fixed, which can only add time), else the stage search's objective."""

    num_microbatches: int
    schedule: str
    virtual_stages: int
    step_s: float | None
    note: str = ""
    assembled: bool = False

    def __str__(self) -> str:
        if self.step_s is None:
            what = self.note
        else:  # say which figure it is: the two are not comparable to the last microsecond
            what = f"{self.step_s * 1e3:.3f} ms/step ({'plan' if self.assembled else 'stage search'})"
            what += f", {self.note}" if self.note else ""
        return f"{self.schedule} x{self.virtual_stages}, {self.num_microbatches} micro-batches: {what}"


def _stage_budget(budget: int | None, virtual_stages: int) -> int | None:
    return None if budget is None else budget // virtual_stages


def schedule_cuts(costs, *, schedule: str, num_stages: int, num_microbatches: int, budget: int | None,
                  window: int | str | None = None, allowed: Callable[[int, int, int], bool] | None = None,
                  recompute: tuple[bool, ...] = (False, True), prune: bool = True, bound: float | None = None):
    """(candidate, cuts, factor, in-flight counts, stage budget, recompute per stage) of the best
    cut under ``schedule`` (the last five None when no cut fits). ``allowed(k, a, b)``: which
    stage ranges may be used (benchmarks price fixed cuts with it). ``recompute``: the modes each
    stage may run (``StageCosts.slice``); the DP picks one per stage (``best_cuts``).
    ``prune``: solve a budget-bound stage only when its lower bound can beat the best cut found
    (``LazyCuts``; the same optimum as solving every stage, which ``prune=False`` does).
    ``bound``: the best step another schedule reached; a cut not beating it is reported as such
    (its figure is then only an upper bound of this schedule's best)."""
    v = SCHEDULE_VIRTUAL_STAGES[schedule]
    parts = num_stages * v
    none = (None,) * 5
    if costs.num_blocks < parts:
        return (PipelineCandidate(num_microbatches, schedule, v, None, f"{costs.num_blocks} blocks < {parts} stages"),
                *none)
    window = stage_window(window, num_blocks=costs.num_blocks, parts=parts)
    if schedule == "zero-bubble":
        recompute = tuple(r for r in recompute if not r)  # the runtime refuses recompute under zero-bubble
    factor = step_factor(schedule, num_stages=num_stages, virtual_stages=v, num_microbatches=num_microbatches,
                         idle_speedup=idle_speedup(costs.mesh))
    flight = [in_flight(schedule, index=k, num_stages=num_stages, virtual_stages=v,
                        num_microbatches=num_microbatches) for k in range(parts)]
    stage_budget = _stage_budget(budget, v)
    even = costs.num_blocks / parts
    longest = costs.num_blocks - parts + 1
    costs.lengths = None if allowed is not None else (1, longest) if window is None else \
        (max(1, math.ceil(even - window)), min(longest, math.floor(even + window)))

    def usable(k, a, b):
        return (window is None or abs((b - a) - even) <= window) and (allowed is None or allowed(k, a, b))

    lazy = LazyCuts(costs, parts, usable, flight=flight, factor=factor, budget=stage_budget, recompute=recompute)
    cuts, modes = lazy.search(math.inf if bound is None else bound) if prune else lazy.solve_all()
    if bound is not None and prune and (cuts is None or cuts.objective >= bound):
        return (PipelineCandidate(num_microbatches, schedule, v, None,
                                  f"no cut beats {bound * 1e3:.3f} ms/step (stages bounded, not all solved)"), *none)
    if cuts is None:
        budget_text = "no budget" if budget is None else f"the budget of {budget / 2**30:.2f} GiB"
        return PipelineCandidate(num_microbatches, schedule, v, None, f"no cut fits {budget_text}"), *none
    picked = tuple(modes[k, cuts.bounds[k], cuts.bounds[k + 1]][i] for k, i in enumerate(cuts.picks))
    note = f"recompute in stages {[k for k, r in enumerate(picked) if r]}" if any(picked) else ""
    return (PipelineCandidate(num_microbatches, schedule, v, cuts.objective, note), cuts, factor, flight, stage_budget,
            picked)


class LazyCuts:
    """The cut DP over stage options, solving a stage only when it can matter.

    A usable (stage k, range, mode) is *pending* until solved, with a lower bound ``lb`` on its
    ``time + sync / factor`` that holds under any budget: first ``costs.quick_bound`` (each op at
    its cheapest option, no solve), once its range shape's unconstrained optimum is solved (one
    solve per shape, shared by all k) that optimum's value. Where the optimum fits the stage's
    budget with its in-flight micro-batches it is the stage's cost; where not, the stage needs a
    solve of its own. A cut holding a pending stage is worth at least ``factor * lb`` (the step
    is ``factor * max time + max sync``), so once a cut worth ``U`` is known, stages with
    ``factor * lb >= U`` need no solve: no cut through them beats ``U``. The search: (0) solve the
    even cut's stages: when they all fit, the DP over the solved stages is a real cut, ``U``;
    else (1) run the DP with pending stages at a guess (their unconstrained figures, or ``(lb, 0)``), solve what the
    guessed cut uses, and repeat until it uses nothing pending: a real cut, ``U``; (2) solve pending
    stages in increasing ``lb`` while ``factor * lb < U``, lowering ``U`` when one helps; (3) the
    DP over the solved stages is the optimum over all of them. Without recompute when the plain
    stage's unconstrained optimum fits (recompute only adds forward seconds to its layouts)."""

    def __init__(self, costs, parts: int, usable, *, flight: list[int], factor: float,
                 budget: int | None, recompute: tuple[bool, ...]) -> None:
        self.costs, self.parts, self.factor = costs, parts, factor
        self.flight, self.budget = flight, budget
        self.known: dict[tuple[int, int, int, bool], tuple[float, float] | None] = {}  # solved (None: no fit)
        # pending -> (guess or None: the shape is not solved yet, lower bound or None: none)
        self.pending: dict[tuple[int, int, int, bool], tuple[tuple[float, float] | None, float | None]] = {}
        self.order: dict[tuple[int, int, int], list[bool]] = {}  # candidate modes, in ``recompute`` order
        n = costs.num_blocks
        for k in range(parts):
            for a in range(k, n - parts + k + 1):
                for b in range(a + 1, n - parts + k + 2):
                    if not usable(k, a, b):
                        continue
                    self.order[k, a, b] = list(recompute)
                    for r in recompute:
                        if r not in self.order[k, a, b]:
                            continue  # dropped: the plain stage's optimum fits
                        if costs.has_free(a, b, factor=factor, recompute=r):
                            self._classify((k, a, b, r))
                        else:
                            self.pending[k, a, b, r] = (None, costs.quick_bound(a, b, factor=factor, recompute=r))

    def _classify(self, key: tuple[int, int, int, bool]) -> None:
        """Place a stage whose shape's unconstrained optimum is solved: known or pending a solve."""
        k, a, b, r = key
        costs, kw = self.costs, dict(in_flight=self.flight[k], factor=self.factor, budget=self.budget)
        self.pending.pop(key, None)
        free = costs.free(a, b, factor=self.factor, recompute=r)
        if free is None:
            self.known[key] = None
        elif costs.free_fits(a, b, recompute=r, **kw):
            c = costs.cost(a, b, recompute=r, **kw)
            self.known[key] = (c.time_s, c.sync_s)
            if not r:  # recompute only adds forward seconds to the fitting optimum's layouts
                self.order[k, a, b] = [m for m in self.order[k, a, b] if not m]
                self.pending.pop((k, a, b, True), None)
                self.known.pop((k, a, b, True), None)
        else:
            c = free[1]
            self.pending[key] = ((c.time_s - c.p2p_s + costs.p2p_s(b), c.sync_s),
                                 costs.lower_bound(a, b, factor=self.factor, recompute=r))

    def _solve(self, key: tuple[int, int, int, bool]) -> None:
        """One step closer: the shape's unconstrained optimum, or the stage's own solve."""
        if self.pending[key][0] is None:
            self._classify(key)
            return
        k, a, b, r = key
        self.pending.pop(key)
        c = self.costs.cost(a, b, in_flight=self.flight[k], factor=self.factor, budget=self.budget, recompute=r)
        self.known[key] = None if c is None else (c.time_s, c.sync_s)
        if c is None and not r:
            self._unfit_around(k, a, b)

    def _unfit_around(self, k: int, a: int, b: int) -> None:
        """Stage ``k`` holding ``[a, b)`` fits no layout without recompute: neither does any
        stage holding a range that contains it with as many micro-batches in flight or more. A
        wider range's decisions include the narrower's, and with any layout every moment of its
        memory timeline holds at least what the narrower range's restriction holds there
        (another block adds live bytes, never removes any), so its least peak is no lower."""
        flight = self.flight[k]
        for key in [p for p in self.pending if not p[3] and p[1] <= a and p[2] >= b and self.flight[p[0]] >= flight]:
            self.pending.pop(key)
            self.known[key] = None

    def _dp(self, *, guess: bool):
        """The best cut over the solved stages (and, with ``guess``, the pending ones at their
        guesses); also the (k, a, b) -> modes its options list."""
        table: dict[tuple[int, int, int], list] = {}
        modes: dict[tuple[int, int, int], list[bool]] = {}
        for (k, a, b), tried in self.order.items():
            for r in tried:
                opt = self.known.get((k, a, b, r))
                if opt is None and guess and (k, a, b, r) in self.pending:
                    fig, lb = self.pending[k, a, b, r]
                    opt = fig if fig is not None else (lb or 0.0, 0.0)
                if opt is not None:
                    table.setdefault((k, a, b), []).append(opt)
                    modes.setdefault((k, a, b), []).append(r)
        return best_cuts(self.costs.num_blocks, self.parts, lambda k, a, b: table.get((k, a, b)),
                         factor=self.factor), modes

    def _even_cut(self) -> Cuts | None:
        """Solve the stages of the even cut (each stage ``B / K`` blocks, rounded down at its
        start) and return the best cut over the stages solved so far, or None when the even
        cut is not usable or a stage of it fits no mode. Its step bounds the search from the
        start: the guided DP over every pending stage (``_dp(guess=True)``, the costly part for
        deep models on many stages) is not needed to find a first real cut."""
        n, parts = self.costs.num_blocks, self.parts
        spans = [(k, k * n // parts, (k + 1) * n // parts) for k in range(parts)]
        if any(span not in self.order for span in spans):
            return None
        for k, a, b in spans:
            for r in list(self.order[k, a, b]):
                while (k, a, b, r) in self.pending and r in self.order[k, a, b]:
                    self._solve((k, a, b, r))
            if not any(self.known.get((k, a, b, r)) is not None for r in self.order[k, a, b]):
                return None
        return self._dp(guess=False)[0]

    def solve_all(self):
        while self.pending:
            self._solve(next(iter(self.pending)))
        return self._dp(guess=False)

    def search(self, bound: float = math.inf):
        """The best cut (class docstring), or, given a ``bound`` (another schedule's step), the
        best cut if one beats it: else a cut no better than it, or None."""
        if bound == math.inf:  # (0) the even cut, when every stage of it fits: a real cut at once
            even = self._even_cut()
            bound = math.inf if even is None else even.objective
        while self.pending and bound == math.inf:  # (1) a real cut, guided by the guesses
            cuts, modes = self._dp(guess=True)
            if cuts is None:
                break
            used = [(k, cuts.bounds[k], cuts.bounds[k + 1], modes[k, cuts.bounds[k], cuts.bounds[k + 1]][i])
                    for k, i in enumerate(cuts.picks)]
            used = [key for key in used if key in self.pending]
            if not used:
                break
            for key in used:
                if key in self.pending:  # (a plain stage that fits drops its recompute twin)
                    self._solve(key)
        best = self._dp(guess=False)[0]
        bound = bound if best is None else min(bound, best.objective)
        # (2) the pending stages that could still beat it, most promising first
        heap = [(_bound(lb), key) for key, (_, lb) in self.pending.items()]
        heapq.heapify(heap)
        helped, next_dp = 0, 1
        while heap:
            lb, key = heapq.heappop(heap)
            if key not in self.pending or _bound(self.pending[key][1]) != lb:
                continue  # solved or dropped since, or its bound was tightened (pushed again)
            if self.factor * lb >= bound:
                break  # the smallest bound left: no pending stage can beat it
            solves = self.costs.num_solves
            self._solve(key)
            if key in self.pending:  # now with its unconstrained optimum's (tighter) bound
                heapq.heappush(heap, (_bound(self.pending[key][1]), key))
                continue
            opt = self.known.get(key)
            # A new option below the bound may lower it; one from the memo (a shape solved for
            # another stage) rarely does: rerun the DP then only, and after the 1st, 2nd, 4th, 8th
            # ... such option (a DP over tens of thousands of stage ranges costs a second; a bound
            # lowered late only means more solves, never another answer: (3) decides).
            if opt is not None and self.factor * opt[0] + opt[1] < bound and self.costs.num_solves > solves:
                helped += 1
                if helped == next_dp:
                    next_dp *= 2
                    best = self._dp(guess=False)[0]
                    bound = bound if best is None else min(bound, best.objective)
        return self._dp(guess=False)  # (3)


def _bound(lb: float | None) -> float:
    return -math.inf if lb is None else lb
