"""checkpoint='auto' search: the pruned search (lower bounds, cached per-sharding costs, no
refinement of a fitting no-recompute plan) returns exactly the exhaustive search's plan, and
reports its steps through the progress object."""

from __future__ import annotations

import math
from contextlib import contextmanager

import pytest
import torch

from autopar import zoo
from autopar.api import PlanOptions, plan
from autopar.planner.builder import build_problem
from autopar.planner.checkpointing import (ChoiceCosts, estimate, plan_recompute, recompute_lower_bound,
                                           rotor_refine)
from autopar.solver import driver
from autopar.tracer import profile, trace
from tests.budgets import smallest_budget


class _Recorder:
    def __init__(self):
        self.stages: list[tuple[str, str]] = []

    @contextmanager
    def stage(self, name, detail=""):
        self.stages.append((name, detail))
        yield


def _case(name: str):
    """(traced, profile, peak of the fastest plan without a budget): trace and profile once,
    the budgets of the tests are fractions of that peak."""
    model, inputs = zoo.build(name, tiny=True, batch=4, seq=64, num_layers=2, device="meta")
    traced = trace(model, inputs)
    prof = profile(traced)
    free = build_problem(traced, prof, PlanOptions().mesh((2,)), budget_bytes=None, options=PlanOptions())
    return traced, prof, driver.solve(free.problem).peak_bytes


@pytest.fixture(scope="module")
def gpt2():
    return _case("gpt2")


@pytest.fixture(scope="module")
def llama():
    return _case("llama-1b")


def _built(case, fraction):
    traced, prof, peak = case
    return build_problem(traced, prof, PlanOptions().mesh((2,)), budget_bytes=int(fraction * peak),
                         options=PlanOptions())


_SOLVED: dict = {}  # shared by this module's tests: each ILP solved once


@pytest.fixture
def solve_once(monkeypatch):
    """Both searches solve the same ILPs: solve each once (the solver is deterministic here)."""
    real, memo = driver.solve, _SOLVED

    def solve(problem, **kwargs):
        key = (problem, kwargs.get("recompute_inputs") is not None, tuple(sorted(kwargs.get("fixed") or {})))
        if key not in memo:
            memo[key] = real(problem, **kwargs)
        return memo[key]

    monkeypatch.setattr(driver, "solve", solve)


def _same(fast, full):
    assert fast.method == full.method
    assert fast.units == full.units
    assert fast.choice == full.choice
    assert fast.evaluation == full.evaluation
    assert fast.regions == full.regions
    assert fast.activation_bytes == full.activation_bytes


@pytest.mark.parametrize("case, fraction, prunes", [("gpt2", 0.7, True), ("gpt2", 0.5, False), ("llama", 0.6, None)])
def test_pruned_search_returns_the_exhaustive_plan(case, fraction, prunes, request, solve_once):
    traced, prof, _ = data = request.getfixturevalue(case)
    built = _built(data, fraction)
    full = plan_recompute(traced, prof, built, mode="auto", prune=False)
    rec = _Recorder()
    fast = plan_recompute(traced, prof, built, mode="auto", prune=True, progress=rec)
    _same(fast, full)
    assert full.units, "the budget must force recompute"
    assert full.info["region_sets_pruned"] == 0 and full.info["refinements_pruned"] == 0
    if prunes is not None:  # the bounds cut region sets exactly where they cannot win
        assert (fast.info["region_sets_evaluated"] < full.info["region_sets_evaluated"]) == prunes
    names = [name for name, _ in rec.stages]
    assert "recompute ILP" in names
    assert names.count("rotor") >= fast.info["rotor_solves"] > 0  # one stage per Rotor solve tried


def test_budget_that_cannot_bind_returns_the_unconstrained_plan(gpt2, solve_once):
    traced, prof, _ = gpt2
    built = _built(gpt2, 1.0)
    rec = _Recorder()
    fast = plan_recompute(traced, prof, built, mode="auto", progress=rec)
    full = plan_recompute(traced, prof, built, mode="auto", prune=False)
    _same(fast, full)
    assert fast.method == "none" and fast.info.get("unconstrained_fits")
    assert [name for name, _ in rec.stages] == ["budget check"]  # nothing searched


def test_rotor_mode_skips_refining_a_sharding_that_fits(gpt2, solve_once):
    """Recompute only adds time to a sharding whose plan fits: its refinement can at best tie."""
    traced, prof, _ = gpt2
    built = _built(gpt2, 1.0)
    fast = plan_recompute(traced, prof, built, mode="rotor")
    full = plan_recompute(traced, prof, built, mode="rotor", prune=False)
    _same(fast, full)
    assert fast.method == "rotor" and fast.units == ()
    assert fast.info["rotor_solves"] == 0 and full.info["rotor_solves"] > 0


def test_lower_bound_holds_for_every_recompute_set(gpt2, solve_once):
    traced, prof, _ = gpt2
    built = _built(gpt2, 0.5)
    problem, inputs = built.problem, built.segment_inputs
    sol = driver.solve(problem, recompute_inputs=inputs)
    costs = ChoiceCosts(built)
    lower = recompute_lower_bound(built, sol.choice, costs=costs)
    assert sol.recompute and math.isfinite(lower)
    assert estimate(built, problem, sol.choice, sol.recompute, inputs).objective >= lower
    refined = rotor_refine(traced, prof, built, sol.choice, sol)
    assert refined is not None and refined.evaluation.objective >= lower
    # no recompute set fits below what the parameters and the non-recomputable values need
    low = build_problem(traced, prof, PlanOptions().mesh((2,)), budget_bytes=problem.evaluate(sol.choice).param_bytes,
                        options=PlanOptions())
    assert recompute_lower_bound(low, sol.choice) == math.inf
    # a fitting plan: the bound is its own estimate
    roomy = _built(gpt2, 10.0)
    assert recompute_lower_bound(roomy, sol.choice) == estimate(roomy, roomy.problem, sol.choice, (), {}).objective


def test_cached_costs_give_the_same_estimate(gpt2, solve_once):
    built = _built(gpt2, 0.5)
    sol = driver.solve(built.problem, recompute_inputs=built.segment_inputs)
    costs = ChoiceCosts(built)
    for units in ((), sol.recompute):
        plain = estimate(built, built.problem, sol.choice, units, built.segment_inputs)
        for _ in range(2):  # the first call fills the cache, the second reads it
            assert estimate(built, built.problem, sol.choice, units, built.segment_inputs, costs=costs) == plain
    assert len(costs._by_choice) == 1


class _GatedMLP(torch.nn.Module):
    """No repeated blocks, so no recompute units: a hand-written toy."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.up = torch.nn.Linear(d, 4 * d, bias=False)
        self.down = torch.nn.Linear(2 * d, d, bias=False)

    def forward(self, x):
        gate, val = self.up(x).chunk(2, dim=-1)
        return (x + self.down(torch.nn.functional.silu(gate) * val)).square().mean()


def test_without_units_auto_keeps_the_fitting_sharding_and_skips_the_joint_ilp():
    """With nothing to recompute the joint ILP is the budgeted sharding ILP already solved, searched
    on to a proof (31 s on (2, 2) at 1.1x the smallest budget for a toy like this, for 1.8% of
    step): 'auto' answers with the sharding that fits, as 'rotor' does."""
    torch.manual_seed(0)
    model, inputs = _GatedMLP(), (torch.randn(8, 16, 32),)
    low = smallest_budget(lambda budget: plan(model, inputs, mesh=(2, 2), memory_budget=budget, cache=False,
                                              pipeline=1))
    traced = trace(model, inputs)
    prof = profile(traced)
    built = build_problem(traced, prof, PlanOptions().mesh((2, 2)), budget_bytes=int(1.1 * low), options=PlanOptions())
    assert not built.segment_inputs
    rec = _Recorder()
    auto = plan_recompute(traced, prof, built, mode="auto", progress=rec)
    assert "recompute ILP" not in [name for name, _ in rec.stages]
    # the sharding is the Rotor branch's (its time-limited solve, not compared across two runs on a busy host)
    assert auto.method == "rotor" and auto.units == () and auto.evaluation.peak_bytes <= int(1.1 * low)
