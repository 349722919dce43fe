"""Activation checkpointing for a plan: which op ranges backward recomputes instead of keeping.

Modes (``plan(..., checkpoint=...)``):

* ``"none"``  the sharding ILP alone (no recompute).
* ``"ilp"``   stage 1 only: sharding and recompute decided together by the joint ILP
  (``autopar.solver.recompute_ilp``; units = repeated blocks and their sub-modules).
* ``"rotor"`` stage 2 only: the sharding ILP without recompute (under the budget; when nothing
  fits, the fastest sharding whose parameters fit), then Rotor on the linearised sharded graph.
* ``"both"``  stage 1, then stage 2 refines the recompute placement over stage 1's sharding;
  the better of the two placements is kept.
* ``"auto"``  (default) the faster estimate of ``"both"`` and ``"rotor"``; ``"none"`` when the
  budget cannot bind (every choice fits).

Stage 2 (``rotor_refine``): the chosen sharding's op sequence is cut into a chain wherever a
single activation crosses (the residual stream between sub-blocks of a transformer; values made
before the first repeated block, e.g. masks, are held throughout and do not break a cut); every
stage gets forward/backward seconds of its ops *and* of the layout conversions feeding them,
its tape (saved bytes, its output included, its input left out when a node of the stage saves
it), its output bytes and the conversion buffers as transient bytes. Ops after the last cut form
the final stage (the loss); ops before the first repeated block, parameters and user inputs are
held throughout and come off the budget. Rotor's schedule says which stages run their forward
twice; each maximal run of such stages becomes one ``torch.utils.checkpoint`` region (what the
runtime can execute), which is re-evaluated in the same cost model as stage 1 (``estimate``) and
kept only when it fits the budget. Rotor's slot rounding and its deeper multi-level schedules
do not map one to one onto single-level regions, so stage 2 tries a few Rotor budgets (from the
real one down) and keeps the fastest region set that fits.

The estimate of a region set (``estimate``) is ``Problem.evaluate`` with the regions recomputed
(the joint ILP's memory and time model, exact per node) plus the forward seconds of the
conversions a region re-runs, less what several consumers share (``planner.executed``: a
conversion or a gradient sum runs once for all of them).

Search cost (``plan_recompute``, exact: the answer is the exhaustive search's). The per-sharding
parts of ``estimate`` are computed once per sharding (``ChoiceCosts``). The Rotor sharding is
solved first; each refinement then only has to beat the candidates already found, and
``recompute_lower_bound`` (no-recompute estimate + a fractional knapsack of forward seconds per
byte the peak must lose) skips a refinement, and a region set within one, that cannot — never
on a tie. The Rotor sharding's own refinement is skipped outright when its no-recompute plan
fits (recompute only adds time to it). A graph without recompute units (no repeated blocks or
sub-modules, as in most hand-written toys) skips the joint ILP when the Rotor sharding fits: it
would be that same budgeted sharding ILP, searched on to a proof for a few percent. Rotor's DP
shares the rows of identical subchains (``autopar.solver.rotor``: a chain of repeated blocks is
periodic). The joint ILP, then every Rotor solve, is reported through ``progress``. A joint ILP
that finds no plan within the time limit answers with a known plan that fits
(``autopar.solver.incumbents``), else leaves the Rotor candidates to answer; with none, the
minimum-peak plan does (``autopar.solver.driver.fallback``: it fits every budget at or above the
minimum the planner reports), and only when no plan that fits is found is the error
``SolveTimeout``.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from autopar.planner.options import CHECKPOINT_MODES as MODES  # the modes above
from autopar.plans import NodeKind, RecomputeRegion
from autopar.planner.executed import shared_savings, unique_conversions
from autopar.planner.records import BuiltProblem, InputSlot
from autopar.planner.segments import holder_of_producer, mutates_state, segment_inputs
from autopar.layout.blocks import block_of
from autopar.solver.overlap import hidden_seconds
from autopar.solver.problem import Problem
from autopar.solver.timeline import Evaluation, SegmentInput, activation_bytes, edge_bytes_at, segment_geometry

__all__ = ["MODES", "RecomputePlan", "ChoiceCosts", "plan_recompute", "estimate", "recompute_lower_bound",
           "rotor_refine", "regions_of", "strip_segments"]


@dataclass(frozen=True)
class RecomputePlan:
    """Outcome of ``plan_recompute``: the sharding, the regions and their estimate.

    ``problem`` is the problem the units are segments of, ``segment_inputs`` what each unit keeps
    (the inputs it was evaluated with): the built problem's, or for a Rotor refinement its own,
    with the Rotor regions as segments."""

    problem: Problem
    segment_inputs: Mapping[str, tuple[SegmentInput, ...]]
    choice: dict[str, str]
    solution: Any  # the sharding ILP's Solution (stage 1 or the plain ILP)
    units: tuple[str, ...]  # recomputed units (segment names or chain-stage region names)
    regions: tuple[RecomputeRegion, ...]
    evaluation: Evaluation
    method: str  # none | ilp | rotor
    activation_bytes: int
    info: dict = field(default_factory=dict)

    @property
    def copies_at_peak(self) -> int:
        """Of the estimate's peak: parameter copies readers gathered and keep for backward (``Edge.mem``)."""
        at = self.evaluation.peak_time
        return 0 if at is None else edge_bytes_at(self.problem, self.choice, at)


def strip_segments(problem: Problem) -> Problem:
    """``problem`` without recompute segments (the plain sharding ILP merges more without them)."""
    if not any(n.segment for n in problem.nodes):
        return problem
    return replace(problem, nodes=tuple(replace(n, segment=None) if n.segment else n for n in problem.nodes))


def regions_of(problem: Problem, units) -> tuple[RecomputeRegion, ...]:
    """The op names each recomputed unit (fine segment or block) spans, in graph order."""
    geometry = segment_geometry(problem)  # once: it walks every node
    members: dict[str, list[str]] = {}  # unit -> its ops in graph order (a segment, and its block)
    for n in problem.nodes:
        if n.segment is not None:
            for unit in dict.fromkeys((n.segment, block_of(n.segment))):
                members.setdefault(unit, []).append(n.name)
    return tuple(RecomputeRegion(u, tuple(members.get(u, ()))) for u in sorted(units, key=lambda u: geometry[u].start))


class ChoiceCosts:
    """The parts of ``estimate`` that depend on the sharding alone (the conversions the runtime
    runs, what several consumers share), computed once per choice: a search evaluates many
    recompute sets over one or two shardings, and these passes dominate each evaluation."""

    def __init__(self, built) -> None:
        self.built = built
        self._by_choice: dict[tuple, tuple] = {}

    def of(self, choice) -> tuple[tuple[tuple[str, float], ...], tuple[float, float]]:
        """((consumer, forward seconds) of each conversion run, in order; shared savings)."""
        key = tuple(choice[n.name] for n in self.built.problem.nodes)
        hit = self._by_choice.get(key)
        if hit is None:
            first, shared = unique_conversions(self.built, choice)
            runs = tuple((c.consumer, c.conversion.forward_s) for c in first)
            hit = self._by_choice[key] = (runs, shared_savings(self.built, choice, shared=shared))
        return hit


def estimate(built, problem: Problem, choice, units, inputs, *, costs: ChoiceCosts | None = None) -> Evaluation:
    """Step time and peak of ``choice`` with ``units`` recomputed (module docstring). ``costs``:
    a cache of the sharding-only parts (same result, computed once per choice)."""
    ev = problem.evaluate(choice, recompute=units, segment_inputs=inputs)
    runs, (comm_saved, reshard_saved) = (costs or ChoiceCosts(built)).of(choice)
    inside = {name for r in regions_of(problem, units) for name in r.nodes} if units else set()
    extra = sum(f for consumer, f in runs if consumer in inside) if inside else 0.0
    # A gradient sum priced twice may be an asynchronous one the evaluator hid: what runs hides
    # no more than its share of the asynchronous seconds left (at worst all the savings were those).
    hidden = ev.hidden_s
    if comm_saved > 0 and hidden > 0:
        hidden = min(hidden, hidden_seconds(problem.comm_overlap, max(ev.async_s - comm_saved, 0.0), hidden))
    return replace(ev, objective=ev.objective + extra - comm_saved - reshard_saved + (ev.hidden_s - hidden),
                   comm_s=ev.comm_s - comm_saved, reshard_s=ev.reshard_s + extra - reshard_saved, hidden_s=hidden)


def _finish(built, problem, choice, solution, units, inputs, method, info, *, costs=None, ev=None) -> RecomputePlan:
    ev = ev or estimate(built, problem, choice, units, inputs, costs=costs)
    return RecomputePlan(problem, inputs, choice, solution, tuple(units), regions_of(problem, units), ev, method,
                         activation_bytes(problem, choice, recompute=units, segment_inputs=inputs), info)


def _unless_known_beats(built, plain: Problem, sol, inputs, method: str, info: dict) -> RecomputePlan:
    """``sol``'s plan (no recompute), or a known plan without recompute that fits (``solver.incumbents``:
    the data-parallel one the planner seeds) where ``estimate`` prices it lower. The ILP's objective
    counts a gradient sum that several readers share once per reader, which ``estimate`` takes back
    (``ChoiceCosts``), so its optimum can be priced above another plan: on GPT-2 on 2x2 its tied
    token table's sum put data parallelism 1.4 ms over its estimate and a layout splitting the table
    0.6 ms, which the ILP chose and which measured 17% slower."""
    from autopar.solver import incumbents

    costs = ChoiceCosts(built)
    best = _finish(built, built.problem, sol.choice, sol, (), inputs, method, info, costs=costs)
    for plan, ev in incumbents.fits(plain):
        if plan.recompute or plan.choice == sol.choice:
            continue
        other = estimate(built, built.problem, plan.choice, (), inputs, costs=costs)
        if other.objective < best.evaluation.objective:
            best = _finish(built, built.problem, plan.choice, incumbents.adopted(sol, plan, ev), (), inputs, method,
                           info, ev=other)
    return best


class _Silent:
    """A progress sink that reports nothing (``plan_recompute`` without one)."""

    @contextmanager
    def stage(self, name: str, detail: str = ""):
        yield


# A lower bound prunes a candidate only when it exceeds the bound by more than float noise (the
# bound and the estimate add the same terms in different orders): ties are always evaluated.
_PRUNE_RTOL = 1e-9


def _beyond(lower: float, bound: float | None) -> bool:
    return bound is not None and lower > bound + _PRUNE_RTOL * abs(bound)


def recomputable_ops(built) -> frozenset[str]:
    """Ops any recompute unit may hold: the op sequence from the first segmented op on (every
    fine segment, block and Rotor chain stage lies there)."""
    ops = [n for n in built.problem.nodes if built.decisions[n.name].kind == NodeKind.OP]
    first = next((i for i, n in enumerate(ops) if n.segment is not None), len(ops))
    return frozenset(n.name for n in ops[first:])


def recompute_lower_bound(built, choice, *, costs: ChoiceCosts | None = None,
                          recomputable: frozenset[str] | None = None) -> float:
    """A lower bound on the estimate of ``choice`` with *any* recompute set that fits the budget
    (inf when none can fit). Exact reasoning, no search:

    * a recompute set only adds time: ``estimate(c, R) >= estimate(c, ()) + sum of forward_s``
      over the recomputed ops (re-run conversions add more, never less);
    * at the timeline point ``t`` of the no-recompute peak, recomputing op ``n`` frees at most its
      activation, and only if it is live at ``t`` (it moves to ``[bwd, end]``; kept inputs only
      add memory). Fitting needs ``sum(freed) >= peak - budget``.

    The least forward seconds freeing that much is at least the fractional knapsack's optimum
    (``_knapsack_bound``). ``recomputable``: the ops any unit may hold (``recomputable_ops``)."""
    base = estimate(built, built.problem, choice, (), {}, costs=costs)
    recomputable = recomputable_ops(built) if recomputable is None else recomputable
    return _knapsack_bound(built.problem, choice, base, [(name,) for name in recomputable])


def _knapsack_bound(problem: Problem, choice, base: Evaluation, groups) -> float:
    """``base.objective`` plus the least forward seconds that free the bytes the no-recompute peak
    exceeds the budget by, at the peak's timeline point, when only whole ``groups`` of ops are
    recomputed (each group's seconds and the bytes it frees there), fractional knapsack (a group
    by seconds per byte, the last in part): a lower bound (``recompute_lower_bound``)."""
    need = base.peak_bytes - problem.budget_bytes
    if need <= 0:
        return base.objective
    t = base.peak_time
    if t is None:  # parameters alone exceed the budget: recompute cannot help
        return math.inf
    items = []
    for group in groups:
        seconds = freed = 0
        for name in group:
            n = problem.node(name)
            o = n.options[n.option_index(choice[name])]
            seconds += o.forward_s
            if n.live is not None and n.live[0] <= t <= n.live[1]:
                freed += o.act_bytes
        if freed > 0:
            items.append((seconds / freed, freed, seconds))
    extra = 0.0
    for per_byte, size, seconds in sorted(items):
        if size >= need:
            return base.objective + extra + per_byte * need
        extra += seconds
        need -= size
    return math.inf  # recomputing every group live at the peak still does not fit


def plan_recompute(traced, prof, built, *, mode: str = "auto", solver: str = "auto", time_limit: float = 60.0,
                   solve_plain=None, progress=None, prune: bool = True) -> RecomputePlan:
    """Sharding + recompute for ``built`` (module docstring). ``solve_plain(problem)`` solves the
    sharding ILP without recompute (the caller's, for progress reporting); ``progress``: an object
    whose ``stage(name, detail)`` context reports each step (``autopar.stages.Progress``).

    ``prune`` skips Rotor refinements (and region sets within one) that a lower bound shows
    cannot beat a candidate already found (``recompute_lower_bound``; never on a tie), and the
    refinement of a sharding whose no-recompute plan fits (recompute only adds time to it): the
    answer is the exhaustive search's. ``prune=False`` runs every step (for tests)."""
    from autopar.solver.driver import remembering

    with remembering():
        return _plan_recompute(traced, prof, built, mode=mode, solver=solver, time_limit=time_limit,
                               solve_plain=solve_plain, progress=progress, prune=prune)


def _plan_recompute(traced, prof, built, *, mode: str, solver: str, time_limit: float, solve_plain, progress,
                    prune: bool) -> RecomputePlan:
    from autopar.solver.driver import SolveTimeout, fallback, simplified, solve, terse_infeasible

    if mode not in MODES:
        raise ValueError(f"checkpoint must be one of {MODES}, got {mode!r}")
    progress = progress or _Silent()
    solve_plain = solve_plain or (lambda p: solve(p, solver=solver, time_limit=time_limit))
    problem, inputs = built.problem, built.segment_inputs
    plain = strip_segments(problem)
    if mode == "auto" and problem.budget_bytes is None:
        mode = "none"
    if mode == "auto":
        with progress.stage("budget check", "can any sharding exceed the budget"):
            if not simplified(plain).memory_can_bind:
                mode = "none"
    if mode == "auto":
        # Recompute only adds forward time, so the unconstrained optimum bounds every mode from
        # below: when it fits the budget as it is, it is the answer and the search is skipped.
        try:
            free = solve_plain(plain.with_budget(None))
        except SolveTimeout:  # only a shortcut: the budgeted search below decides
            free = None
        if free is not None and plain.evaluate(free.choice).peak_bytes <= problem.budget_bytes:
            return _unless_known_beats(built, plain, free, inputs, "none", {"unconstrained_fits": True})
    if mode == "none" or problem.budget_bytes is None:
        try:
            sol = solve_plain(plain)
        except SolveTimeout as exc:  # no plan in time: a known one that fits, else the error (one solve's
            try:                     # time limit is this mode's: tests/solver/test_watchdog.py)
                sol = fallback(plain, solver=solver, time_limit=time_limit, search=False)
            except SolveTimeout:
                raise exc from None
        return _unless_known_beats(built, plain, sol, inputs, "none", {})
    costs = ChoiceCosts(built)
    search = _Search(traced, prof, built, costs=costs, progress=progress, prune=prune)
    # Listed (and tie-broken) in the order [ILP, its refinement, Rotor's sharding, its refinement];
    # the Rotor sharding is solved first so that its plan bounds the ILP's refinement.
    stage1: list[RecomputePlan] = []
    stage2: list[RecomputePlan] = []
    errors: list[Exception] = []
    rotor_error: Exception | None = None
    rotor_sol = None
    if mode in ("rotor", "auto"):
        try:
            try:
                with terse_infeasible():  # its error is caught here: the smallest budget is not needed
                    rotor_sol = solve_plain(plain)
            except ValueError:  # nothing fits without recompute: the fastest sharding whose params fit
                rotor_sol = solve_plain(_params_only(plain))
            with progress.stage("estimate", "the plan without recompute"):
                ev = estimate(built, problem, rotor_sol.choice, (), inputs, costs=costs)
                if ev.peak_bytes <= problem.budget_bytes:
                    stage2.append(_finish(built, problem, rotor_sol.choice, rotor_sol, (), inputs, "rotor", {}, ev=ev))
        except (ValueError, SolveTimeout) as exc:
            rotor_error, rotor_sol = exc, None
    # Without units (no repeated blocks or sub-modules: most hand-written toys) the joint ILP is the
    # budgeted sharding ILP the Rotor branch has just solved, searched on to a proof: a 3-linear
    # gated MLP on (2, 2) at 1.1x its smallest budget took 31 s there for a 1.8% faster step.
    unitless = not inputs and mode == "auto" and bool(stage2)
    if mode in ("ilp", "both", "auto") and not unitless:
        try:
            with progress.stage("recompute ILP", f"{problem.num_nodes} decisions, {len(inputs)} units"):
                sol = solve(problem, recompute_inputs=inputs, solver=solver, time_limit=time_limit)
            with progress.stage("estimate", f"the ILP's plan, {len(sol.recompute)} units recomputed"):
                stage1.append(_finish(built, problem, sol.choice, sol, sol.recompute, inputs, "ilp", {}, costs=costs))
            if mode in ("both", "auto"):
                bound = min(c.evaluation.objective for c in stage1 + stage2)
                refined = search.refine(sol.choice, sol, "ILP sharding", bound=bound)
                if refined is not None:
                    stage1.append(refined)
        except (ValueError, SolveTimeout) as exc:  # no plan in time: the Rotor candidates may still answer
            errors.append(exc)
    if rotor_error is not None:
        errors.append(rotor_error)
    elif rotor_sol is not None and not (prune and stage2):
        # A fitting no-recompute plan of this sharding is listed before its refinement, which
        # only adds recompute time to it: the refinement can at best tie, and ties go first.
        try:
            bound = min((c.evaluation.objective for c in stage1), default=None)
            refined = search.refine(rotor_sol.choice, rotor_sol, "Rotor sharding", bound=bound)
            if refined is not None:
                stage2.append(refined)
        except ValueError as exc:
            errors.append(exc)
    candidates = stage1 + stage2
    if not candidates and any(isinstance(e, SolveTimeout) for e in errors):
        # No plan in time: a known plan that fits, else the minimum-peak plan (with recompute, where
        # the mode allows it: Rotor's mode only keeps known plans); the first error otherwise.
        try:
            sol = fallback(problem if mode != "rotor" else plain, solver=solver, time_limit=time_limit,
                           recompute_inputs=inputs if mode != "rotor" else None, search=mode != "rotor")
        except (ValueError, SolveTimeout):
            raise errors[0] from None
        method = "rotor" if mode == "rotor" else "ilp"
        candidates = [_finish(built, problem, sol.choice, sol, sol.recompute, inputs, method, {"fallback": True},
                              costs=costs)]
    if not candidates:
        if errors:
            raise errors[0]
        raise ValueError(f"checkpoint={mode!r}: Rotor found no recompute placement within the budget "
                         f"{problem.budget_bytes} bytes for the sharding the ILP chose; try checkpoint='ilp'")
    best = min(candidates, key=lambda c: c.evaluation.objective)
    candidate_objectives = {f"{c.method}#{i}": c.evaluation.objective for i, c in enumerate(candidates)}
    return replace(best, info={**best.info, "candidates": candidate_objectives, **search.stats})


def _params_only(problem: Problem) -> Problem:
    """``problem`` whose activations weigh nothing: the budget then binds parameters only."""
    nodes = tuple(replace(n, live=None, options=tuple(replace(o, act_bytes=0) for o in n.options))
                  if n.live is not None else n for n in problem.nodes)
    return replace(problem, nodes=nodes)


ROTOR_BUDGET_FRACTIONS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)


def build_chain(prof, built: BuiltProblem, choice):
    """The chosen sharding's ops as a Rotor ``Chain`` (module docstring). Returns
    ``(chain, stages, held_bytes)``: ``stages[i]`` the op names of stage ``i``, ``held_bytes``
    the activation bytes held outside the chain (ops before it, user inputs)."""
    from autopar.solver.rotor import Chain

    problem = built.problem
    ops = [n for n in problem.nodes if built.decisions[n.name].kind == NodeKind.OP]
    first = next((i for i, n in enumerate(ops) if n.segment is not None), None)
    if first is None:
        return None
    index = {n.name: i for i, n in enumerate(ops)}
    consumers: dict[tuple[str, int], int] = {}  # value -> last consuming op index
    readers: dict[tuple[str, int], set] = {}  # value made before the chain -> blocks reading it
    values: dict[tuple[str, int], InputSlot] = {}  # value -> as its consumers read it
    for dst in built.decisions.values():
        if dst.name not in index:
            continue
        for value in dst.inputs:
            if value is not None and value.producer in index:
                key = (value.producer, value.index)
                values[key] = value
                consumers[key] = max(consumers.get(key, -1), index[dst.name])
                if index[value.producer] < first:
                    readers.setdefault(key, set()).add(block_of(ops[index[dst.name]].segment or "") or "")
    # Values made before the chain count only when one block reads them (the chain's input, not
    # a mask or position table shared by every block: those are held throughout).
    consumers = {k: v for k, v in consumers.items() if index[k[0]] >= first or len(readers.get(k, ())) == 1}
    produced_until: dict[int, list] = {}
    for key, last in consumers.items():
        produced_until.setdefault(max(index[key[0]], first), []).append((key, last))
    cuts, live = [], {}
    for k in range(first, len(ops) - 1):
        for key, last in produced_until.get(k, ()):
            live[key] = last
        live = {key: last for key, last in live.items() if last > k}
        if len(live) == 1:
            cuts.append((k, next(iter(live))))
    if not cuts:
        return None
    option = {n.name: n.options[n.option_index(choice[n.name])] for n in ops}
    conv_f: dict[str, float] = {}
    conv_b: dict[str, float] = {}
    for c in built.conversions(choice):
        conv_f[c.consumer] = conv_f.get(c.consumer, 0.0) + c.conversion.forward_s
        conv_b[c.consumer] = conv_b.get(c.consumer, 0.0) + c.conversion.backward_s

    def local_bytes(key) -> int:
        value = values[key]
        spec = built.choice_of(value.producer, choice[value.producer]).output_specs[value.index]
        return value.local_bytes(spec, built.mesh.shape)

    first_saver = holder_of_producer(prof)  # producer -> the node whose activation counts its storage
    bounds = [first] + [k + 1 for k, _ in cuts] + [len(ops)]
    crossing = [None] + [key for _, key in cuts]  # the value entering each stage
    stages, fwd, bwd, out_b, tape, x0 = [], [], [], [], [], 0
    for i in range(len(bounds) - 1):
        names = [n.name for n in ops[bounds[i]:bounds[i + 1]]]
        stages.append(tuple(names))
        f = sum(option[n].forward_s + conv_f.get(n, 0.0) for n in names)
        total = sum(option[n].cost_s + conv_f.get(n, 0.0) + conv_b.get(n, 0.0) for n in names)
        fwd.append(f)
        bwd.append(max(total - f, 0.0))
        saved = sum(option[n].act_bytes for n in names)
        if i > 0:
            inp = crossing[i]
            a_in = local_bytes(inp)
            if first_saver.get(inp[0]) in names:
                saved = max(saved - a_in, 0)  # the stage input is x_i, counted apart
        out = local_bytes(crossing[i + 1]) if i + 1 < len(crossing) else 0
        out_b.append(out)
        tape.append(saved + out)
    # x_0: the chain's input (what the first stage reads from before the chain), held apart
    held = 0
    for n in problem.nodes:
        o = n.options[n.option_index(choice[n.name])]
        if n.live is not None and (built.decisions[n.name].kind != NodeKind.OP or index.get(n.name, first) < first):
            held += o.act_bytes
    chain = Chain(tuple(fwd), tuple(bwd), x0, tuple(out_b), tuple(tape), (0,) * len(fwd), (0,) * len(fwd),
                  tuple(f"stage{i}" for i in range(len(fwd))))
    return chain, stages, held


def _runs(stages) -> list[list[int]]:
    """Maximal runs of consecutive stage indices."""
    runs: list[list[int]] = []
    for i in stages:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


class _Search:
    """Stage 2 over one or more shardings (``refine``), sharing the per-choice costs, with the
    pruning of ``plan_recompute`` and a progress stage per Rotor solve."""

    def __init__(self, traced, prof, built, *, costs: ChoiceCosts, progress, prune: bool) -> None:
        self.traced, self.prof, self.built = traced, prof, built
        self.costs, self.progress, self.prune = costs, progress, prune
        self.stats = {"rotor_solves": 0, "region_sets_evaluated": 0, "region_sets_pruned": 0, "refinements_pruned": 0}

    def refine(self, choice, solution, label: str, *, bound: float | None = None) -> RecomputePlan | None:
        """The fastest Rotor region set for ``choice`` that fits (module docstring), or None. With
        pruning, None too when nothing it could find would beat ``bound`` (see ``_beyond``)."""
        from autopar.solver.rotor import solve_rotor

        built, problem = self.built, self.built.problem
        bound = bound if self.prune else None
        base_ev = estimate(built, problem, choice, (), {}, costs=self.costs)
        made = build_chain(self.prof, built, choice)
        if made is None:
            return None
        chain, stages, held = made
        # Stages that update model state (running statistics) are never recomputed.
        stateful = {i for i, names in enumerate(stages) if any(mutates_state(self.traced.node(n)) for n in names)}
        if self.prune:  # a region set recomputes whole stages, never a stateful one
            groups = [names for i, names in enumerate(stages) if i not in stateful]
            lower = _knapsack_bound(problem, choice, base_ev, groups)
            if lower == math.inf or _beyond(lower, bound):
                self.stats["refinements_pruned"] += 1
                beat = "fits the budget" if bound is None or lower == math.inf else f"beats {bound * 1e3:.3f} ms"
                with self.progress.stage("rotor", f"{label}: skipped, no region set {beat}"):
                    pass
                return None
        avail = problem.budget_bytes - base_ev.param_bytes - held
        if avail <= 0:
            return None
        base = base_ev.objective
        option = {n.name: n.options[n.option_index(choice[n.name])] for n in problem.nodes}
        saves = {n.name for n in problem.nodes if n.live is not None and any(o.act_bytes for o in n.options)}
        best: tuple[float, tuple, dict] | None = None  # (objective, evaluated plan parts, info)
        tried = set()
        for frac in ROTOR_BUDGET_FRACTIONS:
            try:
                with self.progress.stage("rotor", f"{label}: {chain.num_stages} stages at {frac:.0%} of "
                                                  f"{avail / 2**30:.2f} GiB"):
                    sched = solve_rotor(chain, max(int(avail * frac), 1))
                self.stats["rotor_solves"] += 1
            except ValueError:
                break
            if stateful.intersection(sched.recomputed_stages):
                continue
            runs = _runs(sched.recomputed_stages)
            # One region per run of recomputed stages (only the run's input kept), or one per stage
            # (each stage's input kept: Rotor's checkpoints of x_i); both are what torch can run.
            for grouping in (runs, [[i] for r in runs for i in r]):
                key = tuple(map(tuple, grouping))
                if not grouping or key in tried:
                    continue
                tried.add(key)
                region_of = {name: f"rotor[{r[0]}-{r[-1]}]" for r in grouping for i in r for name in stages[i]}
                if self.prune:
                    # Recompute seconds of the regions that save (segment_geometry's units), in
                    # graph order; the conversions a region re-runs only add to it.
                    regions = {region_of[name] for name in saves if name in region_of}
                    lower = base + sum(option[n].forward_s for n in region_of if region_of[n] in regions)
                    ceiling = bound if best is None else best[0] if bound is None else min(bound, best[0])
                    if _beyond(lower, ceiling):
                        self.stats["region_sets_pruned"] += 1
                        continue
                nodes = tuple(replace(n, segment=region_of.get(n.name)) for n in problem.nodes)
                p2 = replace(problem, nodes=nodes)
                inputs2 = segment_inputs(self.traced, self.prof, built.decisions, built.mesh.shape, region_of)
                geo = segment_geometry(p2)
                units = tuple(u for u in dict.fromkeys(region_of.values()) if u in geo)  # regions that save
                ev = estimate(built, p2, choice, units, inputs2, costs=self.costs)
                self.stats["region_sets_evaluated"] += 1
                if ev.peak_bytes <= problem.budget_bytes and (best is None or ev.objective < best[0]):
                    best = (ev.objective, (p2, units, inputs2, ev),
                            {"rotor_stages": len(stages), "rotor_budget_fraction": frac})
        if best is None:
            return None
        p2, units, inputs2, ev = best[1]
        return _finish(built, p2, choice, solution, units, inputs2, "rotor", best[2], ev=ev)


def rotor_refine(traced, prof, built, choice, solution) -> RecomputePlan | None:
    """Stage 2 (module docstring) on ``choice``, every Rotor budget tried; None when no Rotor
    placement fits the budget."""
    search = _Search(traced, prof, built, costs=ChoiceCosts(built), progress=_Silent(), prune=False)
    return search.refine(choice, solution, "sharding")
