"""Solving a ``Problem`` end to end: simplify, build the ILP, solve, check, explain failures.

One pipeline for both model families: the sharding ILP (``autopar.solver.ilp.IlpModel``) and,
when ``recompute_inputs`` are given, the joint sharding + recompute ILP
(``autopar.solver.recompute_ilp.RecomputeModel``). Every answer is re-evaluated with
``Problem.evaluate`` (with the chosen recompute) and checked against the solver's objective and
the budget. An infeasible budget raises ``ValueError`` with the smallest budget any plan meets
(a second ILP minimising the peak). A solve that finds no plan within the time limit answers
with the fastest plan known in the planning call that fits (``autopar.solver.incumbents``:
every plan a solve returned, every minimum-peak plan), status "feasible", its gap against the
LP bound, or an unknown bound (None) when the relaxation did not finish; ``SolveTimeout`` only
when no known plan fits. At a binding budget a relaxation that is not integral first gets a
plan from its neighbourhood (``incumbents.neighbourhood``); the search then has what is left
of a share of the time limit to improve on it (``_Clock.window``), and the better plan is the
answer.
The time limit is hard: the solver runs of one call share it and return by ``HARD_FACTOR`` x it
even when a backend ignores it (``IlpModel.run``'s watchdog). No torch import.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import numpy as np

from autopar.solver import incumbents
from autopar.solver.ilp import HARD_FACTOR, INTEGRAL_TOL, MEM_UNIT, MIP_REL_GAP, IlpModel, Outcome, pick_backend
from autopar.solver.problem import Problem, Solution
from autopar.solver.dive import alternate, blockwise
from autopar.solver.floors import at_least, below_parameters, parameter_floor
from autopar.solver.recompute_ilp import RECOMPUTE_GAP, RecomputeModel, floor_model
from autopar.solver.simplify import Reduced, simplify
from autopar.solver.timeline import Evaluation, SegmentInputs

__all__ = ["solve", "minimum_budget", "parameter_floor", "fallback", "simplified", "remembering", "terse_infeasible",
           "SolveTimeout"]


log = logging.getLogger(__name__)


class SolveTimeout(RuntimeError):
    """The solver found no plan within the time limit."""


class _FitsAfterAll(SolveTimeout):
    """The solver called a budget infeasible that a known plan meets: answered with that plan."""


# The LP relaxation is told the first share of one call's time limit and stopped at the second,
# so a HiGHS hang in it leaves CBC time to redo it and to search; it normally takes a tiny fraction.
_LP_SHARE, _LP_HARD_SHARE = 0.4, 0.6
# Each step of the recompute ILP's first-plan descent gets this share of the time left, and so
# does the neighbourhood MIP (``incumbents.neighbourhood``).
_DIVE_SHARE = 0.25
# The neighbourhood MIP and, once it has a plan not yet within the tolerance of the bound, the
# search that may improve on it share this share of the time limit (``_Clock.window``), the
# search at most ``_SEARCH_SHARE`` of it (the rest of a quick neighbourhood's window too). At a
# tight budget the relaxation is weak and HiGHS's search closes the gap slowly while the
# neighbourhood's plan is already near the optimum: Llama tiny on 2x2 at 1.1x its minimum
# budget, 25% at the root, proved at node 127 after 54 s, the neighbourhood's plan 0.13% above
# that optimum in 0.35 s; T5 tiny at 1.1x, 30% at the root, proved 226 s later 6% below the
# neighbourhood's plan. Over Llama, Qwen2-MoE, T5, ResNet and DeepseekV3 tiny at 1.1x their
# minimum budgets a 3 s search after the first plan improved none of them (it proved ResNet's
# plan optimal), while a longer neighbourhood MIP found T5 a 6% faster plan: the neighbourhood
# goes first and the search gets what it leaves, at most enough to prove a small model's plan
# (ResNet's in about a second). The gap left is reported.
_IMPROVE_SHARE, _SEARCH_SHARE = 0.1, 0.03
# A joint model with more rows than this (its untied size) is not relaxed: its plan comes from its
# block classes (``dive.blockwise``). Mixtral-8x22B on 8x8: 44,327 rows, a relaxation of 38 s under
# load that ran out its share of the limit; its 4,969-row tied model relaxes in 0.6 s. Only
# problems with this many recompute units (a deep stack of identical blocks) build the tied model.
_BLOCKWISE_ROWS, _BLOCKWISE_UNITS = 30_000, 256
_RSTEP_TIE = 8  # the finest recompute step decides per run of this many identical blocks (``dive.blockwise``)
_MIN_SEARCH_S = 0.2  # a search told less than this is not started (a run costs a fork and the model's transfer)


@dataclass(frozen=True, slots=True)
class _Clock:
    """One call's solver time: the LP relaxation, then the MIP search with what is left; every
    run returns by ``HARD_FACTOR`` x ``time_limit`` after ``start``."""

    start: float
    time_limit: float

    def lp(self) -> dict[str, float]:
        return {"time_limit": _LP_SHARE * self.time_limit, "hard_limit": _LP_HARD_SHARE * self.time_limit}

    def mip(self) -> dict[str, float]:
        now = time.monotonic()
        left = max(self.start + self.time_limit - now, 1e-3)
        return {"time_limit": left, "hard_limit": max(self.start + HARD_FACTOR * self.time_limit - now, left)}

    def step(self, share: float) -> dict[str, float]:
        """A ``share`` of the time left, for one step of a multi-step search (hard within the call)."""
        mip = self.mip()
        return {"time_limit": share * mip["time_limit"], "hard_limit": share * mip["hard_limit"]}

    def window(self, end: float, share: float = 1.0) -> dict[str, float]:
        """``share`` of the time left, until ``end`` at the latest (the first plan's improvement
        window: ``_IMPROVE_SHARE``)."""
        mip, until = self.step(share), max(end - time.monotonic(), 1e-3)
        return {"time_limit": min(mip["time_limit"], until), "hard_limit": min(mip["hard_limit"], HARD_FACTOR * until)}

    def left(self) -> float:
        return self.start + self.time_limit - time.monotonic()


_memo: dict | None = None  # (id(problem), alias, merge) -> (problem, Reduced), inside ``remembering``
_terse = False  # inside ``terse_infeasible``: an infeasible budget's error does not look for the minimum


@contextmanager
def terse_infeasible() -> Iterator[None]:
    """Within the block, a budget no plan meets raises ``ValueError`` without the smallest budget
    that works (a second ILP): for a caller that catches it and moves on (the recompute planner's
    plain sharding, whose figure it never shows: 1.5-2.5 s of the tight-budget plans of Swin and
    DeepseekV3 tiny)."""
    global _terse
    outer, _terse = _terse, True
    try:
        yield
    finally:
        _terse = outer


@contextmanager
def remembering() -> Iterator[None]:
    """Within the block, ``simplified`` remembers each problem object's result: the recompute
    planner simplifies the same problem for its budget check and then solves it (0.3-0.5 s on
    Llama-70B); and the plans solves find are kept as incumbents (``incumbents.keeping``).
    Scoped so that no problem outlives the planning call in a cache."""
    global _memo
    outer, _memo = _memo, ({} if _memo is None else _memo)
    try:
        with incumbents.keeping():
            yield
    finally:
        _memo = outer


def simplified(problem: Problem, *, alias: bool = True, merge: bool = True) -> Reduced:
    """``simplify(problem, ...)``, remembered by object within ``remembering`` (problems are
    immutable; the entry keeps its problem alive, so an id is never reused for another)."""
    if _memo is None:
        return simplify(problem, alias=alias, merge=merge)
    key = (id(problem), alias, merge)
    if key not in _memo:
        _memo[key] = (problem, _unbudgeted(problem, alias, merge) or simplify(problem, alias=alias, merge=merge))
    return _memo[key][1]


def _unbudgeted(problem: Problem, alias: bool, merge: bool) -> Reduced | None:
    """For a problem without a budget, a remembered simplification of the same nodes and edges
    under a budget: it kept only the memory-safe merges, which are exact for step time at any
    budget, so it serves without memory rows (the recompute planner's unconstrained solve after
    its budget check: one simplification instead of two, the growth of a 96-layer GPT-2's plan
    over its 12-layer twin's)."""
    if problem.budget_bytes is not None:
        return None
    for (other, reduced), (_, other_alias, other_merge) in zip(_memo.values(), _memo):
        if (other.nodes is problem.nodes and other.edges is problem.edges
                and (other_alias, other_merge) == (alias, merge)):
            return dataclasses.replace(reduced, budget_bytes=None, memory_can_bind=False)
    return None


def _relaxation_then_search(model: IlpModel, backend: str, clock: _Clock, *, msg: bool = False,
                            gap: float = MIP_REL_GAP, check: Callable[[Outcome], None] | None = None,
                            sharding_model: Callable[[dict[str, bool]], IlpModel] | None = None,
                            first_plan: Callable[[IlpModel, Callable[[], dict]], Outcome | None] | None = None,
                            ) -> tuple[Outcome, Outcome]:
    """The LP relaxation, ``check(lp)`` (may raise), then the MIP search. A backend the watchdog
    replaced in the relaxation is not tried again for the search.

    An optimal relaxation whose integer variables all came out integral is the MIP's optimum
    (a relaxation's optimum that is feasible for the MIP): the search is skipped and the
    relaxation is the answer, proved optimal with gap 0. Sharding models are often integral
    at the root (Llama-8B on 8x8: the search took 70% of the solver's time to re-find it).

    Otherwise first plans are sought. The joint recompute ILP (a ``RecomputeModel`` minimising
    step time; ``sharding_model``: it rebuilt with fixed recompute decisions) whose relaxation
    decided every recompute binary gets one from ``autopar.solver.dive.alternate``; a model with
    memory rows gets one from its relaxation's neighbourhood (``first_plan(model, limits)``,
    ``incumbents.neighbourhood``) unless the descent's is already close enough. A first plan
    within the tolerance of the relaxation's bound is the answer ("optimal" to that tolerance):
    ``RECOMPUTE_GAP`` of the whole step time for the joint ILP (the cost model is far coarser
    than 0.1%, and proving the last 0.1% cost Llama-70B on 16x8 45 s of search), ``gap`` of the
    objective without its constant (as HiGHS measures it) for the sharding ILP. Otherwise the
    search runs (not started from it: see ``autopar.solver.ilp._solve_highs``), stops within the
    same tolerance, and the better of the plans is the answer (its status "feasible" when it is
    the first plan, with the search's bound). After a descent's plan the search has the time
    left; the neighbourhood and the search after its plan share ``_IMPROVE_SHARE`` of the time
    limit, the search at most ``_SEARCH_SHARE`` (``_Clock.window``): at a tight budget the bound
    is what is weak, not the plan."""
    lp = model.run(backend, relax=True, msg=msg, **clock.lp())
    if check is not None:
        check(lp)
    if lp.status == "optimal" and lp.value is not None and model.integral():
        return lp, dataclasses.replace(lp, dual_bound=lp.value, seconds=0.0)
    backend = lp.backend or backend
    if lp.status != "optimal" or lp.value is None:
        return lp, model.run(backend, msg=msg, gap=gap, **clock.mip())
    joint = isinstance(model, RecomputeModel) and model.objective == "time"
    tolerance = RECOMPUTE_GAP * abs(lp.value) if joint else gap * abs(lp.value - model.lp.constant)
    lp_values = _values(model)
    best: Outcome | None = None
    best_values: list | None = None
    if sharding_model is not None and joint and _integral(model.lp.values[list(model.r.values())]):
        best = alternate(model, backend, sharding_model=sharding_model, limits=lambda: clock.step(_DIVE_SHARE),
                         target=lp.value + tolerance)
        best_values = _values(model) if best is not None else None
    search = clock.mip  # the search's limits: the time left, or what the improvement window leaves
    if first_plan is not None and (best is None or best.value - lp.value > tolerance):
        _restore(model, lp_values)  # the neighbourhood is read off the relaxation's values
        end = time.monotonic() + _IMPROVE_SHARE * clock.time_limit
        found = first_plan(model, lambda: clock.window(end, _DIVE_SHARE))
        if found is not None and (best is None or found.value < best.value):
            search_end = min(end, time.monotonic() + _SEARCH_SHARE * clock.time_limit)
            best, best_values, search = found, _values(model), (lambda: clock.window(search_end))
    if best is None:
        return lp, model.run(backend, msg=msg, gap=gap, abs_gap=tolerance if joint else None, **clock.mip())
    _restore(model, best_values)
    if best.value - lp.value <= tolerance:
        return lp, dataclasses.replace(best, status="optimal", dual_bound=lp.value, note="")
    limits = search()
    if limits["time_limit"] < _MIN_SEARCH_S:  # the neighbourhood used the window: no search worth a run
        return lp, dataclasses.replace(best, status="feasible", dual_bound=lp.value)
    # No CBC retry when HiGHS finds nothing in this window: the first plan is in hand already.
    out = model.run(backend, msg=msg, gap=gap, abs_gap=tolerance if joint else None, fallback=False, **limits)
    if out.value is None or out.value > best.value:
        _restore(model, best_values)  # the search did worse: keep the first plan (proved if the search proved its own)
        out = dataclasses.replace(best, status="optimal" if out.status == "optimal" else "feasible",
                                  dual_bound=max(out.dual_bound or lp.value, lp.value),
                                  seconds=best.seconds + out.seconds, note=out.note)
    return lp, out


def _values(model: IlpModel) -> np.ndarray | None:
    return None if model.lp.values is None else model.lp.values.copy()


def _restore(model: IlpModel, values: np.ndarray | None) -> None:
    model.lp.values = None if values is None else values.copy()


def _integral(values: np.ndarray) -> bool:
    """Whether the relaxation decided these binaries: the first plan's descent starts from them,
    and from fractional ones it is a guess that can cost more than the search (Llama tiny on 2x2
    at 60% of its peak: 12 of 20 recompute decisions fractional, descent 10 s then the search
    anyway; Llama-70B on 16x8: all 800 integral, descent 5 s instead of a 45 s search)."""
    values = np.nan_to_num(np.asarray(values, dtype=float))  # unknown counts as 0
    return bool(np.all(np.abs(values - np.round(values)) <= INTEGRAL_TOL))


def _note(out: Outcome) -> str:
    return f" ({out.note})" if out.note else ""


def _model(problem: Problem, reduced: Reduced, recompute_inputs: SegmentInputs | None, *, suffix: str = "",
           fixed: Mapping[str, bool] | None = None, symmetry: bool = True) -> IlpModel:
    """The model family ``recompute_inputs`` selects: the sharding ILP without them."""
    if recompute_inputs is None:
        return IlpModel(reduced, "autopar" + suffix)
    return RecomputeModel(reduced, problem, recompute_inputs, "autopar_recompute" + suffix, fixed=fixed,
                          order=symmetry)


def minimum_budget(problem: Problem, *, recompute_inputs: SegmentInputs | None = None, solver: str = "auto",
                   time_limit: float = 60.0, alias: bool = True, rows: bool = False) -> tuple[int, ...]:
    """``(achieved, lower_bound)``: the smallest per-device peak any plan reaches (a second ILP
    that minimises the peak, step time ignored) and a proven lower bound on the ILP's minimum
    (equal when proved optimal; never above ``achieved``). ``alias`` as in ``solve``: with it,
    "any plan" means any plan that ``solve`` can return. ``recompute_inputs``: plans may
    recompute too (``solve``). ``rows``: two more figures, that bound not capped at ``achieved``
    (the least peak the ILP's own memory rows allow: they may count more than ``evaluate``) and
    the rows' peak of the plan found."""
    backend = pick_backend(solver)
    # Budget 0 makes every simplification memory-safe, hence exact for the peak objective too.
    reduced = simplify(problem.with_budget(0), alias=alias, merge=True)
    model = _model(problem, reduced, recompute_inputs, suffix="_min_peak")
    model.build_min_peak()
    # gap 0: an exact figure for the error message
    lp, out = _relaxation_then_search(model, backend, _Clock(time.monotonic(), time_limit), gap=0.0)
    if out.value is None:
        raise SolveTimeout(f"no plan found within {time_limit}s while minimising peak memory{_note(out)}")
    choice = reduced.expand(model.choice())
    achieved = problem.evaluate(choice, recompute=model.recomputed(), segment_inputs=recompute_inputs).peak_bytes
    incumbents.remember(problem, choice, model.recomputed(), recompute_inputs)  # fits every budget >= achieved
    bound = out.dual_bound if out.dual_bound is not None else (lp.value or 0.0)
    if out.status == "optimal":
        bound = out.value
    least = int(np.ceil(bound * MEM_UNIT - 1e-3))
    figures = (achieved, min(achieved, least))
    return (*figures, least, int(out.value * MEM_UNIT)) if rows else figures


def _infeasible(problem: Problem, recompute_inputs: SegmentInputs | None, fixed: Mapping[str, bool] | None,
                backend: str, time_limit: float, alias: bool) -> Exception:
    """The error for a budget no plan meets, naming the smallest budget that one does (found
    within ``time_limit``, the call's time left)."""
    if fixed:
        return ValueError(f"no plan fits the budget {problem.budget_bytes} bytes with the fixed recompute "
                          f"decisions {dict(fixed)}")
    mesh = "x".join(map(str, problem.mesh_shape)) or "?"
    if _terse:
        return ValueError(f"memory budget {problem.budget_bytes} bytes per device cannot be met on mesh {mesh}")
    below = below_parameters(problem)
    if below is not None:
        return below
    try:
        achieved, lower = minimum_budget(problem, recompute_inputs=recompute_inputs, solver=backend,
                                         time_limit=time_limit, alias=alias)
    except SolveTimeout:
        return ValueError(f"memory budget {problem.budget_bytes} bytes per device cannot be met on mesh {mesh}; "
                          f"the smallest budget any plan meets was not found within the time limit")
    # The recompute ILP counts a value several recomputed units read once per unit, and a solver
    # judges rows within its scaled tolerance: its "infeasible" may stand for a plan that fits.
    # The minimum-peak plan is known (``minimum_budget`` remembered it): the caller answers with it.
    if achieved <= problem.budget_bytes:
        # no " (" in the text: ``_known_plan`` logs what comes before one
        return _FitsAfterAll(f"{backend} reported budget {problem.budget_bytes} infeasible, yet the minimum-peak "
                             f"plan, at {achieved} bytes, fits it")
    need = f"{achieved} bytes ({achieved / 2**30:.3f} GiB)" if achieved == lower else (
        f"between {lower} and {achieved} bytes ({lower / 2**30:.3f}-{achieved / 2**30:.3f} GiB)")
    if recompute_inputs is None:
        where, hint = "", "Try a bigger mesh (more devices to shard over), activation recompute, or a larger budget."
    else:
        where, hint = " even with recompute", "Try a bigger mesh or a larger budget."
    return ValueError(
        f"memory budget {problem.budget_bytes} bytes ({problem.budget_bytes / 2**30:.3f} GiB) per device "
        f"cannot be met on mesh {mesh}{where}: the smallest budget any plan meets is {need}. {hint}"
    )


def solve(problem: Problem, *, recompute_inputs: SegmentInputs | None = None,
          fixed: Mapping[str, bool] | None = None, solver: str = "auto", time_limit: float = 60.0,
          alias: bool = True, merge: bool = True, msg: bool = False, symmetry: bool = True) -> Solution:
    """The fastest plan for ``problem`` within its budget.

    recompute_inputs: unit -> the ``SegmentInput``s it keeps when recomputed
                (``BuiltProblem.segment_inputs``). Given, sharding and recompute are decided
                together (``autopar.solver.recompute_ilp``; needs a budget):
                ``Solution.recompute`` lists the recomputed units and ``objective``/``peak_bytes``
                include them. Omitted, the sharding ILP alone (``autopar.solver.ilp``).
    fixed:      unit -> recomputed or not, imposed (needs ``recompute_inputs``).
    solver:     ``"auto"`` (HiGHS when available), ``"highs"`` or ``"cbc"``.
    time_limit: seconds for the solver runs together: the LP relaxation (for ``lp_bound``; up
                to 40%), then the MIP search (the rest); at the limit the best plan found is
                returned with ``status="feasible"`` and its gap to the best proven bound. Hard:
                the call returns by ``HARD_FACTOR`` (1.1) x ``time_limit`` after simplification
                and model building even if the backend ignores it; a HiGHS that hangs or fails
                is replaced by CBC (``Solution.backend``; a warning is logged).
    alias:      share decisions between identical repeated blocks (``simplify`` item 1).
    merge:      dominated-option pruning and exact follow-merge (``simplify`` items 3-4).
    msg:        show the backend's log.
    symmetry:   the recompute ILP's symmetry-breaking rows between identical blocks
                (``autopar.solver.recompute_ilp``, "Symmetry"; exact, off only to check that).

    Raises ``ValueError`` when no plan fits the budget (with the smallest budget that does),
    ``SolveTimeout`` when no plan is found within the time limit and no known plan fits (module
    docstring: a search that runs out of time answers with a known plan, "feasible").
    """
    with incumbents.keeping():  # a solve on its own keeps its minimum-peak plan for its fallback too
        return _solve(problem, recompute_inputs=recompute_inputs, fixed=fixed, solver=solver, time_limit=time_limit,
                      alias=alias, merge=merge, msg=msg, symmetry=symmetry)


def _solve(problem: Problem, *, recompute_inputs: SegmentInputs | None, fixed: Mapping[str, bool] | None,
           solver: str, time_limit: float, alias: bool, merge: bool, msg: bool, symmetry: bool) -> Solution:
    if not time_limit > 0:
        raise ValueError(f"time_limit must be positive seconds, got {time_limit!r}")
    if recompute_inputs is not None and problem.budget_bytes is None:
        raise ValueError("recompute needs a memory budget (budget_bytes=None never recomputes)")
    if fixed and recompute_inputs is None:
        raise ValueError(f"fixed recompute decisions {dict(fixed)} need recompute_inputs")
    backend = pick_backend(solver)
    below = below_parameters(problem)
    if below is not None:
        raise below
    t0 = time.perf_counter()
    reduced = simplified(problem, alias=alias, merge=merge)
    t1 = time.perf_counter()
    if recompute_inputs is not None and not fixed and len(recompute_inputs) >= _BLOCKWISE_UNITS:
        found = _blockwise_solution(problem, reduced, recompute_inputs, backend=backend, time_limit=time_limit,
                                    symmetry=symmetry, alias=alias, simplify_s=t1 - t0)
        if found is not None:
            return found
    # The recompute ILP always has its memory rows: they are what its recompute decisions answer.
    binds = recompute_inputs is not None or reduced.memory_can_bind
    model = _model(problem, reduced, recompute_inputs, fixed=fixed, symmetry=symmetry)
    model.build_fastest(float(problem.budget_bytes) if binds else None)
    t2 = time.perf_counter()
    clock = _Clock(time.monotonic(), time_limit)

    def infeasible_or_unsolved(lp: Outcome) -> None:
        if lp.status == "infeasible":
            raise _infeasible(problem, recompute_inputs, fixed, lp.backend, max(clock.left(), 0.1 * time_limit), alias)
        if lp.status != "optimal":
            # The limit is wall-clock: on a machine shared with other jobs the solver gets a share of a
            # core, so say which knob buys it more time rather than leave the user at a dead end.
            raise SolveTimeout(f"the LP relaxation did not finish within {time_limit}s{_note(lp)} ({problem}); "
                               f"the limit is wall-clock time per solve: on a busy machine give a larger "
                               f"time_limit (plan/autoparallelize keyword, the CLI's --time-limit)")

    def sharding_model(decisions: dict[str, bool]) -> IlpModel:
        sub = _model(problem, reduced, recompute_inputs, suffix="_dive", fixed={**decisions, **(fixed or {})},
                     symmetry=symmetry)
        sub.build_fastest(float(problem.budget_bytes))
        return sub

    def first_plan(m: IlpModel, limits) -> Outcome | None:
        found = incumbents.neighbourhood(m, problem, recompute_inputs, backend, limit=float(problem.budget_bytes),
                                         limits=limits)
        if found is None and incumbents.fitting(problem, recompute_inputs) is None:
            # No known plan fits, and the relaxation's support alone admits none: the minimum-peak
            # plan fits every feasible budget, and with its options the neighbourhood has a plan.
            lp_values = _values(m)
            if limits()["time_limit"] < _MIN_SEARCH_S:  # a run told 0.4 ms is a CBC retry's, not a search
                return None
            peak = dict(recompute_inputs=recompute_inputs, solver=backend, alias=alias, rows=True)
            try:
                achieved, _, least, found_rows = minimum_budget(problem, time_limit=limits()["time_limit"], **peak)
                if least <= problem.budget_bytes < found_rows:  # whether any plan meets the rows is open: half the
                    # time left to the minimum (``fallback`` solves it after a search that finds nothing), as
                    # no search meets rows above the budget (Llama tiny on 2x2 at its reported minimum: 53 s)
                    achieved, _, least, _ = minimum_budget(problem, time_limit=clock.step(0.5)["time_limit"], **peak)
            except SolveTimeout:
                return None
            if least > problem.budget_bytes * (1 + 1e-6) and achieved <= problem.budget_bytes:  # rows unmet: no search
                raise _FitsAfterAll(f"{backend}'s memory rows admit no plan within {problem.budget_bytes} bytes, their "
                                    f"least peak being {least}, yet the minimum-peak plan, at {achieved} bytes, fits")
            _restore(m, lp_values)
            found = incumbents.neighbourhood(m, problem, recompute_inputs, backend,
                                             limit=float(problem.budget_bytes), limits=limits)
        return found

    stats, timings = {**reduced.stats, **model.stats}, {"simplify_s": t1 - t0, "build_s": t2 - t1}
    known = {"problem": problem, "recompute_inputs": recompute_inputs, "fixed": fixed, "model": model,
             "stats": stats, "timings": timings}
    try:
        lp, out = _relaxation_then_search(model, backend, clock, msg=msg, check=infeasible_or_unsolved,
                                          sharding_model=sharding_model if recompute_inputs is not None else None,
                                          first_plan=first_plan if binds else None)
    except SolveTimeout as exc:  # the relaxation did not finish: no bound is known
        return _known_plan(exc, None, backend=backend, **known)
    if out.status == "infeasible":
        refused = _infeasible(problem, recompute_inputs, fixed, out.backend, max(clock.left(), 0.1 * time_limit),
                              alias)
        if isinstance(refused, _FitsAfterAll):
            return _known_plan(refused, lp, backend=out.backend, **known)
        raise refused
    if out.status == "no_solution":
        other = "cbc" if out.backend == "highs" else "highs"
        exc = SolveTimeout(f"{out.backend} found no plan within time_limit={time_limit}s{_note(out)} ({problem}); "
                           f"LP bound {lp.value:.6g}s. Raise time_limit or try solver={other!r}.")
        return _known_plan(exc, lp, backend=out.backend, **known)
    choice = reduced.expand(model.choice())
    recompute = model.recomputed()
    ev = problem.evaluate(choice, recompute=recompute, segment_inputs=recompute_inputs)
    solution = _checked_solution(choice, ev, out, lp, budget=problem.budget_bytes, backend=out.backend, model=model,
                                 stats=stats, recompute=recompute, timings=timings)
    incumbents.remember(problem, choice, recompute, recompute_inputs)
    return solution if solution.gap == 0 else incumbents.unless_faster(solution, problem, recompute_inputs, fixed)


def _blockwise_solution(problem: Problem, reduced: Reduced, recompute_inputs: SegmentInputs, *, backend: str,
                        time_limit: float, symmetry: bool, alias: bool, simplify_s: float) -> Solution | None:
    """The joint ILP's plan by ``dive.blockwise`` when the model is too big to relax in time
    (``_BLOCKWISE_ROWS``, estimated from the tied model's shared rows); None otherwise, or when
    the descent finds no plan (the caller then solves the full model), unless a relaxation of the
    smallest peak (``recompute_ilp.floor_model``) shows the budget cannot be met: ValueError.
    Status "feasible", bound unknown: the tied relaxation is of a restriction."""
    t0 = time.perf_counter()
    budget = float(problem.budget_bytes)
    tied = RecomputeModel(reduced, problem, recompute_inputs, "autopar_recompute_tied", order=symmetry,
                          tie=len(recompute_inputs))
    tied.build_fastest(budget)
    if tied.lp.num_rows + tied.shared_rows <= _BLOCKWISE_ROWS:
        return None
    clock = _Clock(time.monotonic(), time_limit)

    def sharding_model(decisions: dict[str, bool]) -> IlpModel:
        # No ordering rows: the decisions are fixed, and a run of blocks may recompute after one that does not.
        sub = _model(problem, reduced, recompute_inputs, suffix="_dive", fixed=decisions, symmetry=False)
        sub.build_fastest(budget)
        return sub

    def recompute_model(options: list[int], tie: int) -> RecomputeModel:
        sub = RecomputeModel(incumbents.restrict(reduced, [np.array([k]) for k in options]), problem,
                             recompute_inputs, "autopar_recompute_rstep", order=symmetry, tie=tie)
        sub.build_fastest(budget)
        return sub

    found = blockwise(tied, backend, sharding_model=sharding_model, recompute_model=recompute_model,
                      limits=lambda: clock.step(_DIVE_SHARE), ties=(len(recompute_inputs), _RSTEP_TIE))
    if found is None:
        # No plan of the block classes: before the full model (whose relaxation this size does
        # not finish in time, then a minimum-peak search as long), a bound that may refuse the budget.
        floor = floor_model(simplify(problem.with_budget(0), alias=alias), problem, recompute_inputs)
        lp = floor.run(backend, relax=True, **clock.step(_DIVE_SHARE))
        least = int(np.floor(lp.value * MEM_UNIT)) if lp.status == "optimal" and lp.value is not None else 0
        if least > problem.budget_bytes:
            raise at_least(problem, least, where="even with recompute", hint="a bigger mesh or a larger budget",
                           why="the peak at the end of forward of a relaxation with every repeated block alike")
        return None
    choice = reduced.expand(found.options)
    ev = problem.evaluate(choice, recompute=found.recompute, segment_inputs=recompute_inputs)
    # The restricted model keeps every term: its objective is the plan's (as _checked_solution checks).
    assert abs(ev.objective - found.value) <= 1e-4 * (1 + abs(ev.objective)), (ev.objective, found.value)
    if ev.peak_bytes > problem.budget_bytes:
        raise RuntimeError(f"{backend}'s plan peaks at {ev.peak_bytes} bytes, over the budget "
                           f"{problem.budget_bytes} (solver tolerance?); retry with the other backend")
    incumbents.remember(problem, choice, found.recompute, recompute_inputs)
    return Solution(choice=choice, objective=ev.objective, lp_bound=None, dual_bound=None, gap=None,
                    status="feasible", backend=backend,
                    timings={"simplify_s": simplify_s, "solve_s": time.perf_counter() - t0},
                    peak_bytes=ev.peak_bytes, num_variables=tied.num_variables,
                    num_constraints=tied.num_constraints, recompute=found.recompute,
                    stats={**reduced.stats, **tied.stats, "blockwise_rounds": found.rounds,
                           "tied_lp_bound": found.tied_lp})


def _known_plan(exc: SolveTimeout, lp: Outcome | None, *, problem: Problem, recompute_inputs: SegmentInputs | None,
                fixed: Mapping[str, bool] | None, backend: str, model: IlpModel, stats: dict,
                timings: dict) -> Solution:
    """A solve that found no plan in time: the fastest known plan that fits the budget
    (``incumbents.fitting``; with ``fixed`` decisions, only one that keeps them), status
    "feasible", its gap against the relaxation ``lp`` (None, with the bound, when the
    relaxation did not finish: the bound is unknown); raises ``exc`` when no known plan fits."""
    keeps = incumbents.fits(problem, recompute_inputs, fixed=fixed)
    if not keeps:
        raise exc
    plan, ev = keeps[0]
    log.warning("autopar: %s; answering with the fastest known plan that fits (%.6gs)", str(exc).split(" (")[0],
                ev.objective)
    bound = None if lp is None or lp.value is None else min(lp.value, ev.objective)
    gap = None if bound is None else (ev.objective - bound) / ev.objective if ev.objective > 0 else 0.0
    return Solution(choice=dict(plan.choice), objective=ev.objective, lp_bound=bound, dual_bound=bound, gap=gap,
                    status="feasible", backend=backend, timings={**timings, "lp_s": lp.seconds if lp else 0.0},
                    peak_bytes=ev.peak_bytes, num_variables=model.num_variables,
                    num_constraints=model.num_constraints, recompute=plan.recompute, stats=stats)


def fallback(problem: Problem, *, recompute_inputs: SegmentInputs | None = None, solver: str = "auto",
             time_limit: float = 60.0, alias: bool = True, search: bool = True) -> Solution:
    """A plan that fits ``problem``'s budget when its solves found none in time (the planner's
    last resort): the fastest known plan that fits, else (``search``) the minimum-peak plan
    (``minimum_budget``, one more solve of ``time_limit``; with recompute when ``recompute_inputs``
    are given), which fits every budget at or above the minimum the planner reports. Status
    "feasible", bound unknown (None). ``ValueError`` when the minimum is above the budget,
    ``SolveTimeout`` when no plan is known (or, searching, found in time)."""
    with incumbents.keeping():  # minimum_budget's plan is found as a known plan
        found = incumbents.fitting(problem, recompute_inputs)
        if found is None and not search:
            raise SolveTimeout(f"no plan that fits the budget {problem.budget_bytes} bytes is known")
        if found is None:
            achieved, _ = minimum_budget(problem, recompute_inputs=recompute_inputs, solver=solver,
                                         time_limit=time_limit, alias=alias)
            found = incumbents.fitting(problem, recompute_inputs)
    if found is None:
        raise ValueError(f"memory budget {problem.budget_bytes} bytes per device cannot be met: the smallest "
                         f"budget any plan meets is {achieved} bytes")
    plan, ev = found
    return Solution(choice=dict(plan.choice), objective=ev.objective, lp_bound=None, dual_bound=None, gap=None,
                    status="feasible", backend=pick_backend(solver), timings={}, peak_bytes=ev.peak_bytes,
                    num_variables=0, num_constraints=0, recompute=plan.recompute, stats={"fallback": 1})


def _checked_solution(choice: dict[str, str], ev: Evaluation, out: Outcome, lp: Outcome, *, budget: int | None,
                      backend: str, model: IlpModel, stats: dict, timings: dict,
                      recompute: tuple[str, ...]) -> Solution:
    """The ``Solution`` for ``choice`` (evaluated as ``ev``), after checking that the cost model
    agrees with the solver's objective and that the plan fits the budget; the gap is measured
    against the best proven bound (never below the LP relaxation)."""
    assert abs(ev.objective - out.value) <= 1e-4 * (1 + abs(ev.objective)), (ev.objective, out.value)
    if budget is not None and ev.peak_bytes > budget:
        raise RuntimeError(f"{backend}'s plan peaks at {ev.peak_bytes} bytes, over the budget "
                           f"{budget} (solver tolerance?); retry with the other backend")
    dual = out.dual_bound if out.dual_bound is not None else lp.value
    dual = min(max(dual, lp.value), ev.objective)
    gap = (ev.objective - dual) / ev.objective if ev.objective > 0 else 0.0
    return Solution(
        choice=choice, objective=ev.objective, lp_bound=lp.value, dual_bound=dual, gap=gap,
        status=out.status, backend=backend,
        timings={**timings, "lp_s": lp.seconds, "solve_s": out.seconds},
        peak_bytes=ev.peak_bytes, num_variables=model.num_variables, num_constraints=model.num_constraints,
        recompute=recompute, stats=stats,
    )
