"""A feasible budget always gives a plan: at a tight budget, with every search of the planner's
ILPs stopped before its first plan (only the minimum-peak searches run), planning still answers
with a plan that fits, status "feasible", never ``SolveTimeout``: the recompute planner
(``plan_recompute``) and the offload refit that re-solves under lower budgets
(``fit_device_room``, where a recompute re-solve used to raise ``SolveTimeout``).

The searches are stopped through the backend seam (``ilp.CHILD_SOLVERS``, ``plan_limit=0``): at
the same point on any machine, unlike a tiny wall-clock limit.
"""

from __future__ import annotations

import functools

import pytest

from autopar import zoo
from autopar.api import PlanOptions, Progress, plan_traced
from autopar.solver import ilp
from autopar.tracer import profile, trace
from tests.budgets import smallest_budget
from tests.solver.test_incumbents import _no_plan


@pytest.fixture(scope="module")
def gpt2():
    model, inputs = zoo.build("gpt2", tiny=True, batch=4, seq=32, device="meta")
    traced = trace(model, inputs)
    return traced, profile(traced)


def _smallest_budget(gpt2, mesh, **options) -> int:
    traced, prof = gpt2
    return smallest_budget(lambda budget: plan_traced(traced, prof, mesh=mesh,
                                                      options=PlanOptions(memory_budget=budget, **options)))


@pytest.fixture
def searches_find_nothing(monkeypatch):
    for name, real in (("highs", ilp._solve_highs), ("cbc", ilp._solve_cbc)):
        monkeypatch.setitem(ilp.CHILD_SOLVERS, name, functools.partial(_no_plan, real, spare=("_min_peak",)))


@pytest.mark.parametrize("checkpoint", ["auto", "ilp"])
def test_tight_budget_plans_when_no_search_finds_a_plan(gpt2, checkpoint, searches_find_nothing):
    traced, prof = gpt2
    need = _smallest_budget(gpt2, (2,), checkpoint=checkpoint)
    budget = int(1.1 * need)
    plan = plan_traced(traced, prof, mesh=(2,), options=PlanOptions(memory_budget=budget, checkpoint=checkpoint)).plan
    assert plan.estimate.peak_bytes <= budget
    assert plan.solver["status"] == "feasible"


def test_offload_refit_plans_when_no_search_finds_a_plan(gpt2, searches_find_nothing):
    """The issue's path: ``fit_device_room`` re-solves the recompute plan under lower budgets."""
    traced, prof = gpt2
    options = {"checkpoint": "auto", "offload": "auto"}
    need = _smallest_budget(gpt2, (1,), **options)
    budget = int(1.3 * need)  # the first plan's peak plus its device room exceeds it: one refit
    lines = []
    plan = plan_traced(traced, prof, mesh=(1,), options=PlanOptions(memory_budget=budget, **options),
                       progress=Progress(verbose=True, sink=lines.append)).plan
    info = plan.offload_info
    assert any("offload refit 1" in line for line in lines), lines
    assert plan.estimate.peak_bytes + info["stream_buffer_bytes"] + info["grad_wait_bytes"] <= budget
    assert plan.solver["status"] == "feasible"
