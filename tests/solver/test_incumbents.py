"""A feasible budget always gives a plan: a solve that finds none in time answers with a known
plan that fits (``autopar.solver.incumbents``), status "feasible", with an honest gap; the
neighbourhood of the relaxation finds a first plan at a tight budget.

Searches are cut short through the seam the watchdog's child looks backends up in
(``ilp.CHILD_SOLVERS``): a MIP search stopped before its first plan (``plan_limit=0``), or a
relaxation that never finishes, at the same point on any machine -- never a tiny wall-clock
limit, which strikes at a point that depends on the machine's speed and load.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from autopar.solver import driver, ilp, incumbents
from autopar.solver.driver import SolveTimeout, minimum_budget, remembering, solve
from autopar.solver.simplify import simplify
from tests.solver.test_recompute_ilp import brute_force, chain_problem

BUDGET = 100  # chain_problem's minimum is 80; at 100 its relaxation is fractional (8.25 s against 14.5 s)


def _no_plan(real, prob, report, *, relax, spare=(), **kw):
    """The child solver ``real`` with its MIP searches stopped before their first plan (models
    whose name ends with a suffix in ``spare`` search normally); relaxations solve."""
    if relax or prob.name.endswith(tuple(spare)):
        return real(prob, report, relax=relax, **kw)
    return real(prob, report, relax=relax, plan_limit=0, **kw)


def _no_relaxation(prob, report, *, relax, **kw):
    """A backend whose relaxation never finishes (nor does anything else): no plan, no bound."""
    return "no_solution", np.full(prob.num_columns, np.nan), None


@pytest.fixture
def backends(monkeypatch):
    """``use(**kw)``: every backend replaced as ``_no_plan`` with ``kw`` (or ``relax=False``: by
    ``_no_relaxation``)."""
    def use(*, relaxation: bool = True, spare=()):
        for name, real in (("highs", ilp._solve_highs), ("cbc", ilp._solve_cbc)):
            fake = functools.partial(_no_plan, real, spare=spare) if relaxation else _no_relaxation
            monkeypatch.setitem(ilp.CHILD_SOLVERS, name, fake)

    return use


def test_search_without_a_plan_answers_with_the_minimum_peak_plan(backends):
    problem, inputs = chain_problem(BUDGET)
    with remembering():
        need, _ = minimum_budget(problem, recompute_inputs=inputs)  # its plan is kept
        assert need <= BUDGET
        backends(spare=("_min_peak",))
        sol = solve(problem, recompute_inputs=inputs)
    ev = problem.evaluate(sol.choice, recompute=sol.recompute, segment_inputs=inputs)
    assert sol.status == "feasible" and ev.peak_bytes <= BUDGET and sol.peak_bytes == ev.peak_bytes
    assert sol.objective == pytest.approx(ev.objective)
    assert sol.lp_bound is not None and sol.lp_bound < sol.objective  # the relaxation finished: its bound
    assert sol.gap == pytest.approx((sol.objective - sol.lp_bound) / sol.objective)


def test_relaxation_that_does_not_finish_answers_with_a_known_plan_and_an_unknown_bound(backends):
    problem, inputs = chain_problem(BUDGET)
    with remembering():
        minimum_budget(problem, recompute_inputs=inputs)
        backends(relaxation=False)
        sol = solve(problem, recompute_inputs=inputs)
    assert sol.status == "feasible" and sol.peak_bytes <= BUDGET
    assert sol.lp_bound is None and sol.dual_bound is None and sol.gap is None  # not invented
    assert "LP bound unknown, gap unknown" in str(sol)


def test_a_known_plan_that_does_not_fit_is_no_answer(backends):
    problem, inputs = chain_problem(BUDGET)
    with remembering():
        free = solve(problem.with_budget(10_000), recompute_inputs=inputs)  # a plan of the graph, over BUDGET
        assert free.peak_bytes > BUDGET
        backends(relaxation=False)
        # the message names the knob that buys the solver time (a busy machine hits wall-clock limits)
        with pytest.raises(SolveTimeout, match="LP relaxation did not finish.*larger time_limit"):
            solve(problem, recompute_inputs=inputs)


def test_without_a_known_plan_the_solve_finds_the_minimum_peak_plan_in_its_own_time(backends):
    # No plan known and every search but the minimum-peak one stopped: the solve's neighbourhood
    # step finds the minimum-peak plan itself (within its time limit) and answers with a plan.
    problem, inputs = chain_problem(BUDGET)
    backends(spare=("_min_peak",))
    sol = solve(problem, recompute_inputs=inputs)
    assert sol.status == "feasible" and sol.peak_bytes <= BUDGET and sol.lp_bound is not None


def test_the_neighbourhood_finds_a_plan_when_the_search_finds_none(backends):
    problem, inputs = chain_problem(BUDGET)
    backends(spare=("_nbhd", "_min_peak"))
    sol = solve(problem, recompute_inputs=inputs)
    best, _ = brute_force(problem, inputs)
    assert sol.status == "feasible" and sol.peak_bytes <= BUDGET
    assert best - 1e-9 <= sol.objective and sol.gap == pytest.approx((sol.objective - sol.lp_bound) / sol.objective)


def test_restrict_keeps_objective_and_memory_for_the_options_left():
    problem, _ = chain_problem(BUDGET)
    reduced = simplify(problem)
    keep = [np.array([len(c) - 1]) if g % 2 else np.arange(len(c)) for g, c in enumerate(reduced.cost)]
    sub = incumbents.restrict(reduced, keep)
    for picks in np.ndindex(*(len(k) for k in keep)):
        full = [int(k[p]) for k, p in zip(keep, picks)]
        assert sub.expand(list(picks)) == reduced.expand(full)
        assert sub.objective(list(picks)) == pytest.approx(reduced.objective(full))


def test_known_plans_are_kept_only_inside_the_scope():
    problem, inputs = chain_problem(BUDGET)
    with remembering():
        solve(problem, recompute_inputs=inputs)
        assert incumbents.fitting(problem, inputs) is not None
        assert incumbents.fitting(problem.with_budget(1), inputs) is None  # exact evaluation: over budget
    assert incumbents.known(problem, inputs) == []


def test_fallback_finds_the_minimum_peak_plan_or_says_why_not():
    problem, inputs = chain_problem(BUDGET)
    sol = driver.fallback(problem, recompute_inputs=inputs)
    assert sol.status == "feasible" and sol.peak_bytes <= BUDGET and sol.gap is None
    with pytest.raises(ValueError, match="smallest budget any plan meets is 80 bytes"):
        driver.fallback(problem.with_budget(79), recompute_inputs=inputs)
    with pytest.raises(SolveTimeout, match="no plan that fits"):
        driver.fallback(problem, recompute_inputs=inputs, search=False)


def test_a_known_plan_that_breaks_fixed_decisions_is_no_answer(backends):
    problem, inputs = chain_problem(BUDGET)
    with remembering():
        minimum_budget(problem, recompute_inputs=inputs)
        (plan, _), = incumbents.fits(problem, inputs)
        backends(relaxation=False)
        kept = solve(problem, recompute_inputs=inputs, fixed={u: True for u in plan.recompute})
        assert kept.status == "feasible" and set(kept.recompute) == set(plan.recompute)
        unit = plan.recompute[0]
        with pytest.raises(SolveTimeout, match="LP relaxation did not finish"):
            solve(problem, recompute_inputs=inputs, fixed={unit: False})


def _infeasible_but(real, prob, report, *, relax, **kw):
    """A backend calling every model infeasible but the minimum-peak one (a solver judging its
    rows within its scaled tolerance, or the recompute ILP counting a value once per reader)."""
    if prob.name.endswith("_min_peak"):
        return real(prob, report, relax=relax, **kw)
    return "infeasible", np.full(prob.num_columns, np.nan), None


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "sharding"])
def test_a_budget_called_infeasible_that_the_minimum_peak_plan_meets_gets_that_plan(monkeypatch, recompute):
    problem, inputs = chain_problem(BUDGET)
    inputs = inputs if recompute else None
    need, _ = minimum_budget(problem, recompute_inputs=inputs)
    for name, real in (("highs", ilp._solve_highs), ("cbc", ilp._solve_cbc)):
        monkeypatch.setitem(ilp.CHILD_SOLVERS, name, functools.partial(_infeasible_but, real))
    sol = solve(problem.with_budget(need), recompute_inputs=inputs)  # the budget the refusal would name
    ev = problem.evaluate(sol.choice, recompute=sol.recompute, segment_inputs=inputs)
    assert sol.status == "feasible" and ev.peak_bytes <= need
