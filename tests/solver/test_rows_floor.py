"""The least peak the ILP's own memory rows allow (``minimum_budget(rows=True)``'s third figure)
bounds every plan a search of the budgeted ILP can return: a budget below it has none, so a solve
whose minimum-peak plan fits such a budget answers with that plan without the search."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from autopar.solver import driver, ilp
from autopar.solver.driver import minimum_budget, solve
from tests.solver.test_recompute_ilp import chain_problem


def test_rows_floor_bounds_the_budgeted_ilp():
    problem, inputs = chain_problem(100)
    achieved, lower, least, found = minimum_budget(problem, recompute_inputs=inputs, rows=True)
    assert lower <= achieved and lower == min(achieved, least) and least <= found + 1
    # At the rows' floor the ILP has a plan; one byte below it, none (refused, with the minimum).
    sol = solve(problem.with_budget(max(least, achieved)), recompute_inputs=inputs)
    assert sol.peak_bytes <= max(least, achieved)
    if least - 1 < achieved:
        with pytest.raises(ValueError, match="smallest budget any plan meets"):
            solve(problem.with_budget(least - 1), recompute_inputs=inputs)


def _plans_only_at_min_peak(real, prob, report, *, relax, **kw):
    """The child solver ``real`` for relaxations and minimum-peak models; every other MIP (the
    neighbourhood, the search) ends without a plan, on either backend."""
    if relax or prob.name.endswith("_min_peak"):
        return real(prob, report, relax=relax, **kw)
    return "no_solution", np.full(prob.num_columns, np.nan), None


def test_rows_above_the_budget_skip_the_search(monkeypatch, caplog):
    """Rows that count more than ``evaluate`` (the recompute ILP's shared kept values) can put the
    ILP's least peak above a budget its minimum-peak plan meets: then no search can return a plan,
    and the solve answers with the minimum-peak plan without one (Llama tiny on 2x2 at its reported
    minimum: 53 s of search saved). The overcount is simulated on top of the real figures."""
    problem, inputs = chain_problem(100)
    achieved, _ = minimum_budget(problem, recompute_inputs=inputs)
    budget = problem.with_budget(achieved)
    real = driver.minimum_budget

    def overcounting(*args, **kw):
        out = real(*args, **kw)
        return (*out[:2], achieved + 1, max(out[3], achieved + 1)) if kw.get("rows") else out

    runs: list[tuple[str, bool]] = []
    real_run = ilp.IlpModel.run

    def logged(self, backend, **kw):
        runs.append((self.lp.name, kw.get("relax", False)))
        return real_run(self, backend, **kw)

    monkeypatch.setattr(driver, "minimum_budget", overcounting)
    monkeypatch.setattr(ilp.IlpModel, "run", logged)
    for name, solver in (("highs", ilp._solve_highs), ("cbc", ilp._solve_cbc)):
        monkeypatch.setitem(ilp.CHILD_SOLVERS, name, functools.partial(_plans_only_at_min_peak, solver))
    sol = solve(budget, recompute_inputs=inputs)
    ev = problem.evaluate(sol.choice, recompute=sol.recompute, segment_inputs=inputs)
    assert sol.status == "feasible" and ev.peak_bytes <= achieved
    assert any(name.endswith("_min_peak") for name, _ in runs), runs
    assert ("autopar_recompute", False) not in runs  # the search never ran
    assert "memory rows admit no plan" in caplog.text
