"""What a pipeline stage costs: its intra-stage ILP on the Problem sliced to its decisions.

``StageCosts`` prices the stage holding blocks ``[a, b)`` of a ``StageGeometry``
(:mod:`autopar.planner.pipeline.geometry`): the one micro-batch ``Problem`` built on the stage
sub-mesh, restricted to the stage's decisions (``slice``), and solved. In the slice:

- ``in_flight - 1`` extra micro-batches' saved activations are priced as persistent memory:
  every op option that is saved for backward (a live interval in the Problem) carries
  ``(k - 1) * act_bytes`` more ``param_bytes`` (held the whole step), so the ILP's memory
  constraint sees one micro-batch's activation timeline plus k - 1 micro-batches' saved bytes;
- parameter options (the optimizer step, ZeRO's gather) and the gradient sums an op's option
  prices for the parameters it reads in their own layout (``Decision.bucketed``;
  ``_parameter_sums``) are scaled by ``1 / factor`` (``factor = M v + bubble``): the step runs
  every other cost ``factor`` times on the bottleneck stage but updates and synchronises the
  parameters once (the pipeline runtime sums gradients after the last micro-batch, in buckets:
  the sums are priced as bucket members), so the ILP minimises this stage's share of the step;
- a stage with ``v`` virtual stages per rank gets ``budget / v`` (its rank holds v chunks);
- values crossing the cut are sent replicated (``autopar.runtime.pipeline.split``); the
  conversions at each side of a boundary are not priced, the point-to-point transfer is:
  ``2 (alpha_0 + beta_0 * bytes)`` per micro-batch (activation forward, its gradient back)
  over axis 0's link (``layout.cost.pipeline_transfer_seconds``: ``alpha_0`` the calibrated
  ``MachineProfile.pipeline_transfer_s`` where measured), part of the sending stage's time;
- every stage's micro-batch also pays the schedule's actions beyond their ops and transfers,
  ``overhead_s = STAGE_ACTIONS x pipeline_action_s`` (``pipeline.schedule.action_overhead_s``:
  forward and backward, each the machine's calibrated or preset per-action cost), the last
  stage's too. ``schedule_s(b)`` is what the schedule adds to a stage ending at cut ``b``
  (point-to-point plus overhead): every stage time and every bound on one includes it, so the
  cut search, the assembled estimate, the report and ``inspect`` read one figure.

Solves are memoised by range shape (``RangeMemo``: first?, last?, the blocks' structure classes,
step factor, recompute; then in-flight count and budget): identical middle ranges share one
solve, and a range between a family's shortest and longest solved members takes their common
optimum without a solve (``StageCosts._between``). Lower bounds without a solve
(``quick_bound``) use the block floors of :mod:`autopar.planner.pipeline.bounds` once stored.
At a tight budget many stages fit no layout: the solver's refusal used to find the smallest peak
for an error message nobody read, once per refused (shape, factor, in flight, budget); now the
refusal is terse and that peak is found once per (range geometry, in flight, recompute), the
memory rows' only inputs, so each later budget below it is refused without a solve
(``StageCosts._solve_fitting``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from autopar.layout.blocks import split_block
from autopar.layout.cost import pipeline_transfer_seconds
from autopar.layout.mesh import MeshSpec
from autopar.planner.pipeline.bounds import BlockFloors
from autopar.planner.pipeline.geometry import StageGeometry
from autopar.planner.pipeline.schedule import action_overhead_s, check_pipeline_zero
from autopar.planner.executed import pending_output_refund
from autopar.planner.records import BuiltProblem
from autopar.planner.zero_pricing import zero_gather_cap
from autopar.plans import NodeKind, stage_mesh_of
from autopar.solver.driver import SolveTimeout, terse_infeasible
from autopar.solver.floors import below_parameters
from autopar.solver.problem import Edge, Node, Problem, Solution, StrategyOption
from autopar.solver.timeline import activation_bytes
from autopar.strategies.grad_sums import grad_sync_seconds
from autopar.tracer.graph import TracedGraph

__all__ = ["HELD", "StageCost", "RangeMemo", "StageCosts", "stage_costs"]

# Suffix of the node that holds a value a recomputed stage keeps (``StageCosts.slice``).
HELD = "@held"
# A kept value's layout follows its producer's (``StageCosts.slice``): any other pairing costs
# this many seconds, more than any real step, so an optimum never takes it while one fits.
_TIE_S = 1e4
# Relative slack on a stage's lower bound (the solver proves optima to MIP_REL_GAP = 1e-4): a range
# is skipped only when even its bound, less this, cannot beat the best cut found.
_BOUND_SLACK = 1e-3


@dataclass(frozen=True, slots=True)
class StageCost:
    """One stage's figures: per micro-batch ``time_s`` (ops + resharding + its boundary's
    point-to-point ``p2p_s`` + the schedule actions' ``overhead_s``), once-per-step gradient
    ``sync_s``, per-device ``peak_bytes`` (with its in-flight micro-batches), ``param_bytes``
    (parameters, gradients, optimizer) and ``saved_bytes``: what ONE micro-batch's forward keeps
    saved for backward per device (user inputs left out, as
    ``autopar.solver.timeline.activation_bytes``); the stage holds ``in_flight * saved_bytes`` at
    its peak."""

    time_s: float
    sync_s: float
    p2p_s: float
    compute_s: float
    reshard_s: float
    peak_bytes: int
    param_bytes: int
    in_flight: int
    status: str = "optimal"
    gap: float = 0.0
    saved_bytes: int = 0
    recompute: bool = False  # every block of the stage recomputed in backward (Megatron's "full")
    overhead_s: float = 0.0  # the schedule's actions per micro-batch beyond their work (in ``time_s``)


# A solved stage: (choice, its figures, bytes each further in-flight micro-batch adds).
Found = tuple[dict[str, str], StageCost, int]


class RangeMemo:
    """Stage solves by range shape ``(first?, last?, block classes, factor, recompute)``
    (``StageCosts._shape``): per shape its unconstrained optimum (key ``(*shape, None, None)``,
    and the range it was solved on: its choice names that range's nodes), its figures per
    ``(in_flight, budget)``, and per budget the fewest in-flight micro-batches found not to fit."""

    def __init__(self) -> None:
        self.entries: dict[tuple, Found | None] = {}  # None: nothing fits
        self.solved_on: dict[tuple, tuple[int, int]] = {}  # unconstrained key -> the range solved
        self.unfit: dict[tuple, int] = {}  # (shape, budget) -> fewest in flight found not to fit

    @staticmethod
    def free_key(shape: tuple) -> tuple:
        """The unconstrained optimum's entry: no in-flight count, no budget."""
        return (*shape, None, None)

    def has_free(self, shape: tuple) -> bool:
        return self.free_key(shape) in self.entries

    def set_free(self, shape: tuple, *, found: Found | None, on: tuple[int, int]) -> None:
        self.entries[self.free_key(shape)] = found
        self.solved_on[self.free_key(shape)] = on

    def free(self, shape: tuple) -> Found | None:
        return self.entries[self.free_key(shape)]

    def free_range(self, shape: tuple) -> tuple[int, int]:
        return self.solved_on[self.free_key(shape)]

    def known_unfit(self, shape: tuple, *, budget: int | None, in_flight: int) -> bool:
        """Whether no layout of ``shape`` fits ``budget`` with ``in_flight`` micro-batches in
        flight, known without a solve: none did with as many or fewer, and each further one adds
        bytes >= 0 to every layout's peak."""
        return self.unfit.get((shape, budget), math.inf) <= in_flight

    def note_unfit(self, shape: tuple, *, budget: int | None, in_flight: int) -> None:
        self.unfit[shape, budget] = min(self.unfit.get((shape, budget), math.inf), in_flight)


class StageCosts:
    """Stage slices of one micro-batch Problem and their memoised intra-stage solves (module
    docstring). ``geometry``: the stage ranges; ``memo``: the solves; ``floors``: block floors
    (``pipeline.bounds`` fills them; ``quick_bound`` reads them)."""

    def __init__(self, traced: TracedGraph, built: BuiltProblem, *, mesh: MeshSpec,
                 solve: Callable[[Problem], Solution],
                 min_peak: Callable[[Problem], tuple[int, int]] | None = None) -> None:
        self.geometry = StageGeometry(traced, built)
        self.traced, self.built, self.mesh, self._solve = traced, built, mesh, solve
        self.num_blocks = self.geometry.num_blocks  # what every cut search over the costs asks first
        self.num_solves = self.num_reused = 0
        # ``min_peak(slice)``: (achieved, proven lower bound) of its smallest peak (``solver.driver.
        # minimum_budget``); None: a budget the stage cannot meet is left to ``solve``'s own error
        # (which finds that figure for its message at every refusal). Given, ``least_peak`` keeps it
        # per (range geometry, in flight, recompute) and ``num_unfit_skipped`` counts solves it spared.
        self._min_peak = min_peak
        self.least_peak: dict[tuple, tuple[int, int]] = {}
        self.num_unfit_skipped = 0
        # (shortest, longest) stage length the current cut search asks for (``_between``); None: off
        self.lengths: tuple[int, int] | None = None
        self.memo = RangeMemo()
        self._sums: dict[tuple[str, str], tuple[float, float]] = {}  # _parameter_sums by (op, option)
        self.sum_cap = zero_gather_cap(traced.params)  # the bucket the runtime's deferred sums price in
        self.floors = BlockFloors(self.geometry)
        self._quick: dict[tuple, np.ndarray] = {}  # (factor, recompute) -> prefix sums of ops' cheapest options
        # The same for every stage and schedule (``pipeline.schedule.STAGE_ACTIONS``): memoised
        # figures keep it, only the point-to-point depends on where a range ends.
        self.overhead_s = action_overhead_s(mesh)

    def p2p_s(self, b: int) -> float:
        """Forward send + backward receive over axis 0 at cut ``b`` (0 at the model's end), each
        ``layout.cost.pipeline_transfer_seconds``."""
        crossing = self.geometry.boundary_bytes
        if b >= self.num_blocks or crossing[b] == 0:
            return 0.0
        return 2 * pipeline_transfer_seconds(self.mesh, crossing[b])

    def schedule_s(self, b: int) -> float:
        """What the schedule adds to the micro-batch of a stage ending at cut ``b`` beyond its ops:
        the point-to-point at ``b`` and the actions' overhead (module docstring)."""
        return self.p2p_s(b) + self.overhead_s

    def solve(self, problem: Problem) -> Solution:
        """One intra-stage solve, counted (``num_solves``); raises as the solver does."""
        self.num_solves += 1
        return self._solve(problem)

    # ---------------------------------------------------------------------------- solves
    def _shape(self, a: int, b: int, factor: float, recompute: bool) -> tuple:
        return *self.geometry.shape(a, b), factor, recompute

    def free(self, a: int, b: int, *, factor: float, recompute: bool = False) -> Found | None:
        """The range shape's unconstrained optimum (one solve per shape, or none: ``_between``):
        (choice, cost, in-flight bytes), or None when no layout exists at all."""
        shape = self._shape(a, b, factor, recompute)
        if not self.memo.has_free(shape):
            found = self._between(a, b, factor=factor, recompute=recompute) or \
                self.solve_range(a, b, in_flight=1, factor=factor, budget=None, recompute=recompute)
            self.memo.set_free(shape, found=found, on=(a, b))
        return self.memo.free(shape)

    def free_fits(self, a: int, b: int, *, in_flight: int, factor: float, budget: int | None,
                  recompute: bool = False) -> bool:
        """Whether the unconstrained optimum fits ``budget`` with ``in_flight`` micro-batches (then
        ``cost`` is it, without a solve of its own)."""
        free = self.free(a, b, factor=factor, recompute=recompute)
        return free is not None and (budget is None or free[1].peak_bytes + (in_flight - 1) * free[2] <= budget)

    def lower_bound(self, a: int, b: int, *, factor: float, recompute: bool = False) -> float | None:
        """A lower bound on ``time_s + sync_s / factor`` of the range under ANY budget and
        in-flight count (the unconstrained optimum's value: a budget only removes layouts), less
        the solver's relative gap; None: no bound (the free solve was not proved optimal)."""
        free = self.free(a, b, factor=factor, recompute=recompute)
        if free is None or free[1].status != "optimal":
            return None
        c = free[1]
        return (c.time_s - c.p2p_s + c.sync_s / factor) * (1 - _BOUND_SLACK) + self.p2p_s(b)

    def has_free(self, a: int, b: int, *, factor: float, recompute: bool = False) -> bool:
        return self.memo.has_free(self._shape(a, b, factor, recompute))

    def quick_bound(self, a: int, b: int, *, factor: float, recompute: bool = False) -> float:
        """A lower bound on ``time_s + sync_s / factor`` of the range without a solve of its own:
        each of its ops at its cheapest option (as ``slice`` prices it), no resharding, plus the
        cut's point-to-point (the objective adds edges >= 0 and parameters' syncs >= 0); or,
        where tighter, the sum of its blocks' floors (``pipeline.bounds.step_floor`` stored
        them, at a factor >= ``factor``: valid here) plus the point-to-point."""
        floor = self.floors.range_floor(a, b, factor=factor)
        return max(floor + self.schedule_s(b), self._cheapest(a, b, factor=factor, recompute=recompute))

    def _cheapest(self, a: int, b: int, *, factor: float, recompute: bool) -> float:
        key = (factor, recompute)
        if key not in self._quick:
            geo = self.geometry
            per_block = np.zeros(self.num_blocks + 1)
            for node in self.built.problem.nodes:
                if geo.kind[node.name] != NodeKind.OP:
                    continue
                extra = recompute and node.name in geo.unit_of
                per_block[geo.pos[node.name] + 1] += min(o.cost_s + (o.forward_s if extra else 0.0)
                                                         for o in node.options)
            self._quick[key] = np.cumsum(per_block)
        sums = self._quick[key]
        return float(sums[b] - sums[a]) * (1 - _BOUND_SLACK) + self.schedule_s(b)

    def cost(self, a: int, b: int, *, in_flight: int, factor: float, budget: int | None,
             recompute: bool = False) -> StageCost | None:
        """The memoised stage cost (None: it does not fit ``budget``); ``recompute``: every block of
        the stage recomputed in backward (``slice``)."""
        shape = self._shape(a, b, factor, recompute)
        key = (*shape, in_flight, budget)
        memo = self.memo.entries
        if key not in memo:
            # The unconstrained optimum (one solve per range shape) answers whenever it fits with
            # this in-flight count; only a binding budget needs a solve of its own. Its peak with
            # k micro-batches in flight is its peak with one plus (k - 1) x what one keeps saved
            # (``slice``: the in-flight bytes are linear in k), so no second evaluation is needed.
            free = self.free(a, b, factor=factor, recompute=recompute)
            peak = None if free is None else free[1].peak_bytes + (in_flight - 1) * free[2]
            if free is not None and (budget is None or peak <= budget):
                memo[key] = (free[0], replace(free[1], peak_bytes=peak, in_flight=in_flight), free[2])
            elif self.memo.known_unfit(shape, budget=budget, in_flight=in_flight):
                memo[key] = None
            else:
                memo[key] = self.solve_range(a, b, in_flight=in_flight, factor=factor, budget=budget,
                                             recompute=recompute)
                if memo[key] is None:
                    self.memo.note_unfit(shape, budget=budget, in_flight=in_flight)
        found = memo[key]
        return None if found is None else replace(found[1], time_s=found[1].time_s - found[1].p2p_s + self.p2p_s(b),
                                                  p2p_s=self.p2p_s(b))

    def searched(self, a: int, b: int, *, in_flight: int, factor: float, budget: int | None,
                 recompute: bool = False) -> tuple[dict[str, str], StageCost] | None:
        """The search's (choice, cost) of the stage holding ``[a, b)`` when its memo entry was
        solved on this very range (a range of the same shape elsewhere names other nodes)."""
        cost = self.cost(a, b, in_flight=in_flight, factor=factor, budget=budget, recompute=recompute)
        found = self.memo.entries[(*self._shape(a, b, factor, recompute), in_flight, budget)]
        if cost is None or found is None or set(found[0]) != self.geometry.decisions(a, b):
            return None
        return found[0], cost

    def solve_range(self, a: int, b: int, *, in_flight: int, factor: float, budget: int | None,
                    fixed: dict[str, str] | None = None, recompute: bool = False) -> Found | None:
        """(choice, cost, bytes each further in-flight micro-batch adds) of the stage holding
        ``[a, b)``, placeholders in ``fixed`` held to their option; None when nothing fits."""
        problem = self.slice(self.geometry.decisions(a, b), in_flight=in_flight, factor=factor, budget=budget,
                             fixed=fixed or {}, recompute=recompute)
        sol = self._solve_fitting(problem, key=None if fixed or budget is None or self._min_peak is None
                                  else (self.geometry.shape(a, b), in_flight, recompute))
        if sol is None:  # no layout of this stage fits the budget
            return None
        held = [n.name for n in problem.nodes if n.name.endswith(HELD)]
        if any(sol.choice[h] != sol.choice[h[:-len(HELD)]] for h in held):
            return None  # only a layout change of a kept value (priced _TIE_S) fits: infeasible
        return self._figures(problem, b, sol.choice, in_flight=in_flight, factor=factor, recompute=recompute,
                             status=sol.status, gap=1.0 if sol.gap is None else sol.gap)  # None: no bound known

    def _solve_fitting(self, problem: Problem, *, key: tuple | None) -> Solution | None:
        """``solve(problem)``, None when no layout fits its budget. With ``key`` (the slice's range
        geometry, in-flight count and recompute mode: what its memory rows depend on -- the step
        factor only scales parameters' seconds, the budget is the right-hand side), the smallest
        peak is found once per key: a refusal is asked for tersely (``terse_infeasible``: no
        minimum-peak ILP for an error message nobody reads), and a budget below the key's proven
        least peak is refused without a solve -- the same answer, as no layout peaks lower. A
        refusal whose minimum-peak plan fits after all (the solver's row tolerance at a budget
        right at the minimum) is solved again untersely, where ``solve`` answers with that plan."""
        if key is not None and self._least_peak_floor(key) > problem.budget_bytes:
            self.num_unfit_skipped += 1
            return None
        try:
            if key is None:
                return self.solve(problem)
            with terse_infeasible():
                return self.solve(problem)
        except ValueError:
            if key is None or below_parameters(problem) is not None:
                return None
        if key not in self.least_peak:
            try:
                self.least_peak[key] = self._min_peak(problem)
            except SolveTimeout:  # as ``solve``'s untimely search for the figure: refused
                return None
        if self.least_peak[key][0] > problem.budget_bytes:
            return None
        try:
            return self.solve(problem)
        except ValueError:
            return None

    def _least_peak_floor(self, key: tuple) -> int:
        """The largest proven least peak known for ``key``'s geometry and recompute mode with as
        many micro-batches in flight or fewer (each further one adds bytes >= 0 to every layout's
        peak: ``slice``); -1 when none is known."""
        geometry, in_flight, recompute = key
        return max((lower for (g, k, r), (_, lower) in self.least_peak.items()
                    if g == geometry and r == recompute and k <= in_flight), default=-1)

    def _between(self, a: int, b: int, *, factor: float, recompute: bool) -> Found | None:
        """The unconstrained optimum of ``[a, b)`` without a solve when the family's shortest and
        longest ranges (``lengths``) have one and the same pattern: with aliased interior blocks a
        pattern's objective is linear in the interior count ``n`` (``n A + B``) and the optimum
        ``min over patterns`` is concave in ``n``, so a pattern optimal at both ends of an interval
        is optimal inside it (exact up to the solver's gap). None: solve it."""
        geo = self.geometry
        if geo.family(a, b) is None or self.lengths is None:
            return None
        shortest, longest = max(self.lengths[0], 3), self.lengths[1]
        if not shortest < b - a < longest:
            return None
        ends = [geo.member(a, b, n) for n in (shortest, longest)]
        if None in ends:
            return None
        found = []
        for lo, hi in ends:
            shape = self._shape(lo, hi, factor, recompute)
            if not self.memo.has_free(shape):
                found_end = self.solve_range(lo, hi, in_flight=1, factor=factor, budget=None, recompute=recompute)
                self.memo.set_free(shape, found=found_end, on=(lo, hi))
            if self.memo.free(shape) is None:
                return None
            # The shape may have been solved on another range of it: its choice names that range's nodes.
            found.append(geo.pattern(*self.memo.free_range(shape), self.memo.free(shape)[0]))
        if found[0] is None or found[0] != found[1]:
            return None
        first, inner, last, rest = found[0]
        per, _ = geo.per_block(a, b)
        if any(len(blk) != len(inner) for blk in per[1:-1]) or len(per[0]) != len(first) or len(per[-1]) != len(last):
            return None
        choice = dict(rest)
        for blk, opts in [(per[0], first), (per[-1], last)] + [(blk, inner) for blk in per[1:-1]]:
            choice.update(zip(blk, opts))
        problem = self.slice(geo.decisions(a, b), in_flight=1, factor=factor, budget=None, fixed={},
                             recompute=recompute)
        if set(choice) != {n.name for n in problem.nodes if not n.name.endswith(HELD)}:
            return None
        choice.update({n.name: choice[n.name[:-len(HELD)]] for n in problem.nodes if n.name.endswith(HELD)})
        self.num_reused += 1
        return self._figures(problem, b, choice, in_flight=1, factor=factor, recompute=recompute, status="optimal",
                             gap=max(self.memo.free(self._shape(*e, factor, recompute))[1].gap for e in ends))

    def _figures(self, problem: Problem, b: int, choice: dict[str, str], *, in_flight: int, factor: float,
                 recompute: bool, status: str, gap: float) -> Found:
        """(choice without held values, the stage's figures, in-flight bytes) of ``choice`` on the slice."""
        ev = problem.evaluate(choice)
        original = self.built.problem
        kind = self.geometry.kind

        def chosen(name):
            node = original.node(name)
            return node.options[node.option_index(choice[name])]

        params = [n.name for n in problem.nodes if kind.get(n.name) == NodeKind.PARAMETER]
        sync = sum(chosen(n).cost_s for n in params)
        param_bytes = sum(chosen(n.name).param_bytes for n in problem.nodes
                          if n.name in kind and kind[n.name] != NodeKind.OP)
        extra = sum(self._in_flight_bytes(problem, n, c, recompute=recompute) for n, c in choice.items())
        cost = StageCost(time_s=ev.objective - sync / factor + self.schedule_s(b), sync_s=sync, p2p_s=self.p2p_s(b),
                         compute_s=ev.compute_s, reshard_s=ev.reshard_s, peak_bytes=ev.peak_bytes,
                         param_bytes=param_bytes, in_flight=in_flight, status=status, gap=gap,
                         saved_bytes=activation_bytes(problem, choice), recompute=recompute,
                         overhead_s=self.overhead_s)
        return {n: c for n, c in choice.items() if not n.endswith(HELD)}, cost, extra

    def _in_flight_bytes(self, problem: Problem, name: str, option: str, *, recompute: bool) -> int:
        """Bytes one more in-flight micro-batch keeps for node ``name`` of the stage slice
        ``problem`` (``slice``): a kept value's, or a not-recomputed op's saved activation."""
        if name.endswith(HELD):
            node = problem.node(name)
            return node.options[node.option_index(option)].act_bytes
        base = self.built.problem.node(name)
        geo = self.geometry
        if geo.kind[name] != NodeKind.OP or base.live is None or (recompute and name in geo.unit_of):
            return 0
        return base.options[base.option_index(option)].act_bytes

    def _parameter_sums(self, name: str, option: str) -> tuple[float, float]:
        """Seconds of op ``name``'s option ``option`` that sum its parameters' partial gradients
        (``Decision.bucketed``: parameters read in their own layout): (as its option prices them,
        one collective each; as the pipeline runtime runs them, once per step after the last
        micro-batch in buckets -- ``runtime.pipeline.grad_sums`` -- each paying its share of a
        bucket's latency, the bucket no larger than the model's trainable bytes:
        ``zero_pricing.zero_gather_cap``, the same rule as ZeRO's gather buckets)."""
        key = (name, option)
        if key not in self._sums:
            decision = self.built.decision(name)
            strategy = self.built.choice_of(name, option).strategy if decision.bucketed else None
            slots = [] if strategy is None else [s for s in decision.bucketed if strategy.grad_partial_axes[s]]
            self._sums[key] = (
                sum(grad_sync_seconds(strategy, s, self.built.mesh) for s in slots),
                sum(grad_sync_seconds(strategy, s, self.built.mesh, bucket_cap=self.sum_cap) for s in slots))
        return self._sums[key]

    def _blocking_loss_sum(self, edge: Edge) -> Edge:
        """``edge`` with the last stage's loss sum priced blocking: the flat graph leaves a scalar
        output's all-reduce in flight (``executed.pending_output_refund``, taken off the builder's
        output edges), a stage's graph sums its loss for the schedule's backward at once."""
        out = self.built.decision(edge.dst)
        if out.kind != NodeKind.OUTPUT:
            return edge
        # per option of the Problem's node (a baseline family's problem keeps some of them)
        src = [self.built.choice_of(edge.src, o.name) for o in self.built.problem.node(edge.src).options]
        refunds = [r for v in out.inputs if v is not None and v.producer == edge.src
                   and (r := pending_output_refund(src, v, self.built.mesh)) is not None]
        return replace(edge, costs=edge.array + sum(refunds)) if refunds else edge

    def slice(self, names: set[str], *, in_flight: int, factor: float, budget: int | None,
              fixed: dict[str, str], recompute: bool = False) -> Problem:
        """The Problem restricted to ``names`` and priced for the stage (module docstring).

        ``recompute``: every block unit of the stage is recomputed in backward, written into the
        plain sharding Problem exactly as ``Problem.evaluate(..., recompute=units,
        segment_inputs=...)`` prices it (``autopar.solver.timeline``): its ops cost their
        ``forward_s`` more and hold their activation only from the unit's backward start on; each
        value the units keep (a ``SegmentInput`` made inside the stage) becomes a node
        ``<value>@held`` holding its bytes over the units' span, whose layout is tied to its
        producer's by an edge priced ``_TIE_S`` off the diagonal. The value a stage receives
        over its cut is not priced in either mode. In flight, a recomputed op keeps nothing, a
        kept value ``(k - 1)`` x its bytes."""
        base, geo = self.built.problem, self.geometry
        units = {u for u in geo.units if split_block(u)[1] in geo.stage_blocks(names)} if recompute else set()
        keep: dict[str, list[int]] = {}
        nodes = []
        for node in base.nodes:
            if node.name not in names:
                continue
            idx = [node.option_index(fixed[node.name])] if node.name in fixed else list(range(node.num_options))
            keep[node.name] = idx
            kind = geo.kind[node.name]
            unit = geo.unit_of.get(node.name) if units else None
            unit = unit if unit in units else None
            opts = []
            for i in idx:
                o = node.options[i]
                if kind == NodeKind.OP and (sums := self._parameter_sums(node.name, o.name))[0]:
                    o = replace(o, comm_s=max(o.comm_s - sums[0] + sums[1] / factor, 0.0))
                if kind == NodeKind.PARAMETER:
                    o = replace(o, compute_s=o.compute_s / factor, comm_s=o.comm_s / factor)
                elif unit is not None:
                    o = replace(o, compute_s=o.compute_s + o.forward_s)
                elif kind == NodeKind.OP and node.live is not None and in_flight > 1:
                    o = replace(o, param_bytes=o.param_bytes + (in_flight - 1) * o.act_bytes)
                opts.append(o)
            live = node.live if unit is None or node.live is None else (geo.units[unit].bwd, node.live[1])
            nodes.append(replace(node, options=tuple(opts), live=live))
        edges = []
        for e in base.edges:
            if e.src in keep and e.dst in keep:
                e = self._blocking_loss_sum(e)
                if len(keep[e.src]) == len(e.costs) and len(keep[e.dst]) == len(e.costs[0]):
                    edges.append(e)
                else:
                    edges.append(e.restricted(keep[e.src], keep[e.dst]))
        held: dict[str, list] = {}
        for u in sorted(units):
            g = geo.units[u]
            for si in geo.segment_inputs.get(u, ()):
                if si.node in keep:
                    span = held.setdefault(si.node, [si.bytes, g.start, g.end])
                    span[1], span[2] = min(span[1], g.start), max(span[2], g.end)
        for value, (sizes, first, last) in held.items():
            src, idx = base.node(value), keep[value]
            opts = tuple(StrategyOption(src.options[i].name, 0.0, param_bytes=(in_flight - 1) * sizes[i],
                                        act_bytes=sizes[i]) for i in idx)
            nodes.append(Node(value + HELD, opts, live=(first, last), signature="held|" + src.signature))
            edges.append(Edge(value, value + HELD, [[0.0 if i == j else _TIE_S for j in idx] for i in idx]))
        return replace(base, nodes=tuple(nodes), edges=tuple(edges), budget_bytes=budget,
                       meta={**base.meta_dict, "pipeline_stage": f"{len(nodes)} decisions"})


def stage_costs(traced: TracedGraph, profile, *, mesh: MeshSpec, options,
                solve: Callable[[Problem], Solution] | None = None, family: str | None = None) -> StageCosts:
    """The ``StageCosts`` of the micro-batch graph ``traced`` on ``mesh``'s stage sub-mesh: its
    Problem built with ``options`` (ZeRO 0 or 1) without a checkpoint mode (stages decide
    recompute themselves), solved by ``solve`` (default: the options' solver and time limit).
    ``family``: every stage planned within that family of ``autopar.planner.baselines`` on the
    sub-mesh (``HybridParallelPlugin``'s Megatron / data-parallel stages)."""
    from autopar.planner.assemble import family_built
    from autopar.planner.builder import build_problem
    from autopar.solver.driver import minimum_budget
    from autopar.solver.driver import solve as solve_ilp

    check_pipeline_zero(options.zero_stage)
    # No overlap inside a stage: the pipeline runtime sums data-parallel gradients once per step,
    # after the last micro-batch and on the critical path (``runtime.pipeline.grad_sums``).
    sub = replace(stage_mesh_of(mesh), comm_overlap=0.0)
    built = build_problem(traced, profile, sub, budget_bytes=None, bucket_cap=0,
                          options=replace(options, checkpoint="none", pipeline=None))
    if family is not None:
        built = family_built(family, traced, built)
    if solve is not None:
        return StageCosts(traced, built, mesh=mesh, solve=solve)
    return StageCosts(traced, built, mesh=mesh,
                      solve=lambda p: solve_ilp(p, solver=options.solver, time_limit=options.time_limit),
                      min_peak=lambda p: minimum_budget(p, solver=options.solver, time_limit=options.time_limit))
