"""The recompute ILP's first plan (``autopar.solver.dive``) and how the driver uses it: the
folded model with fixed decisions has the same optimum as the one with fixed rows; the descent
returns a feasible plan no better than the optimum; a plan within ``RECOMPUTE_GAP`` of the
relaxation is the answer, anything else goes on to the search."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from autopar.solver import driver
from autopar.solver.dive import alternate
from autopar.solver.recompute_ilp import RECOMPUTE_GAP, RecomputeModel
from autopar.solver.simplify import simplify
from autopar.solver.timeline import segment_geometry
from tests.solver.test_recompute_ilp import brute_force, chain_problem, repeated_blocks


def _model(problem, inputs, fixed=None):
    m = RecomputeModel(simplify(problem, alias=False), problem, inputs, fixed=fixed)
    m.build_fastest(float(problem.budget_bytes))
    return m


@pytest.mark.parametrize("budget", [300, 210, 150])
def test_folded_fixed_decisions_keep_the_optimum(budget):
    """Fixed units folded into the forms (no z): the same optimum as the full model with the
    decisions imposed by bounds, for every assignment of the units."""
    problem, inputs = chain_problem(budget)
    units = sorted(segment_geometry(problem))
    for mask in itertools.product((False, True), repeat=len(units)):
        fixed = dict(zip(units, mask))
        folded = _model(problem, inputs, fixed).run("highs", time_limit=10)
        full = _model(problem, inputs)
        for u, v in fixed.items():
            full.lp.set_bounds(full.r[u], lower=int(v), upper=int(v))
        want = full.run("highs", time_limit=10)
        assert folded.status == want.status
        if want.value is not None:
            assert folded.value == pytest.approx(want.value, rel=1e-9)


@pytest.mark.parametrize("budget", [410, 250, 180, 150])
def test_descent_plan_is_feasible_and_bounded_by_the_optimum(budget):
    problem, inputs = chain_problem(budget)
    best = brute_force(problem, inputs)
    model = _model(problem, inputs)
    lp = model.run("highs", relax=True, time_limit=10)
    start = alternate(model, "highs", sharding_model=lambda fixed: _model(problem, inputs, fixed),
                      limits=lambda: {"time_limit": 10.0})
    assert start is not None  # the chain admits a sharding for every rounding
    ev = problem.evaluate(driver.simplify(problem, alias=False).expand(model.choice()),
                          recompute=model.recomputed(), segment_inputs=inputs)
    assert ev.peak_bytes <= budget
    assert ev.objective == pytest.approx(start.value, rel=1e-9)
    assert lp.value - 1e-9 <= best[0] <= start.value + 1e-9


def test_driver_answers_within_the_gap_and_never_above_the_search(monkeypatch):
    """The driver's answer is within RECOMPUTE_GAP of the brute-force optimum, through the
    descent (forced: these small relaxations leave recompute decisions fractional, where the
    driver searches directly); a descent that is made useless (no plan) still leaves the search
    to find the optimum."""
    calls = []
    real = driver.alternate
    monkeypatch.setattr(driver, "_integral", lambda variables: True)
    monkeypatch.setattr(driver, "alternate", lambda *a, **k: calls.append(1) or real(*a, **k))
    for budget in (250, 180, 150):
        problem, inputs = chain_problem(budget)
        best = brute_force(problem, inputs)[0]
        sol = driver.solve(problem, recompute_inputs=inputs, alias=False)
        assert best - 1e-9 <= sol.objective <= best * (1 + RECOMPUTE_GAP) + 1e-9
        assert sol.gap <= RECOMPUTE_GAP
    assert len(calls) == 3
    monkeypatch.setattr(driver, "alternate", lambda *a, **k: None)
    problem, inputs = chain_problem(150)
    sol = driver.solve(problem, recompute_inputs=inputs, alias=False)
    assert sol.objective == pytest.approx(brute_force(problem, inputs)[0], rel=RECOMPUTE_GAP)


def test_descent_on_repeated_blocks_matches_the_search():
    """Identical blocks (aliased x, symmetry rows): the driver's plan equals a plain search's."""
    problem, inputs = repeated_blocks(4, None)
    tight = problem.with_budget(int(0.6 * problem.evaluate(
        {n.name: n.options[0].name for n in problem.nodes}).peak_bytes))
    sol = driver.solve(tight, recompute_inputs=inputs)
    plain = _model(tight, inputs)
    want = plain.run("highs", time_limit=10)
    assert sol.objective <= want.value * (1 + RECOMPUTE_GAP) + 1e-9


def test_descent_only_from_decided_recompute_binaries():
    """The driver starts the descent only when the relaxation left every recompute binary 0 or 1."""
    assert driver._integral(np.array([0.0, 1.0, 1 - 1e-9, np.nan]))  # unknown (NaN) counts as 0
    assert not driver._integral(np.array([0.0, 0.4]))
