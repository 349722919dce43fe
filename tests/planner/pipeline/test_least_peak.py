"""A stage's least peak, found once per (range geometry, in flight, recompute) by ``StageCosts``
when it is given ``min_peak`` (as ``stage_costs`` builds it): a budget below it is refused without
a solve, and every such refusal is one the solver itself makes."""

import pytest

from tests.planner.pipeline.test_search import _stage_costs


def _with_least_peak(plain):
    from autopar.planner.pipeline.costs import StageCosts
    from autopar.solver.driver import minimum_budget, solve

    return StageCosts(plain.traced, plain.built, mesh=plain.mesh, solve=lambda p: solve(p, time_limit=30),
                      min_peak=lambda p: minimum_budget(p, time_limit=30))


def test_refusals_below_the_least_peak_skip_the_solve_and_agree_with_it(traced_models):
    plain = _stage_costs(traced_models)  # llama-1b on (2, 2); no min_peak: every refusal is a solve
    costs = _with_least_peak(plain)
    a, b = 0, 2
    probe = plain.slice(plain.geometry.decisions(a, b), in_flight=2, factor=3.0, budget=None, fixed={})
    from autopar.solver.driver import minimum_budget

    achieved, lower = minimum_budget(probe, time_limit=30)
    assert 0 < lower <= achieved
    tight = lower - 1
    # The first refusal is a solve (asked tersely) and stores the least peak of this geometry.
    assert costs.solve_range(a, b, in_flight=2, factor=3.0, budget=tight) is None
    assert costs.num_solves == 1 and costs.num_unfit_skipped == 0
    assert costs.least_peak[(costs.geometry.shape(a, b), 2, False)] == (achieved, lower)
    # Another step factor (another schedule) and more micro-batches in flight: refused unsolved ...
    for in_flight, factor in ((2, 5.0), (3, 5.0), (4, 3.0)):
        assert costs.solve_range(a, b, in_flight=in_flight, factor=factor, budget=tight) is None
        # ... and the solver refuses each of them too: a skipped stage could not have been used.
        assert plain.solve_range(a, b, in_flight=in_flight, factor=factor, budget=tight) is None
    assert costs.num_solves == 1 and costs.num_unfit_skipped == 3
    # Fewer in flight, or recompute (another memory timeline): not covered by the stored figure.
    costs.solve_range(a, b, in_flight=1, factor=3.0, budget=tight)
    costs.solve_range(a, b, in_flight=2, factor=3.0, budget=tight, recompute=True)
    assert costs.num_solves == 3 and costs.num_unfit_skipped == 3
    # At the least peak itself a plan fits (the minimum-peak plan at least), as without the memo.
    got = costs.solve_range(a, b, in_flight=2, factor=3.0, budget=achieved)
    want = plain.solve_range(a, b, in_flight=2, factor=3.0, budget=achieved)
    assert got is not None and want is not None
    assert got[1].peak_bytes <= achieved and got[1].time_s == pytest.approx(want[1].time_s, rel=1e-6)


@pytest.mark.full_sweep  # 40 s of cut searches; the refusals' test above stays in the default run
def test_stage_costs_searches_the_same_cut_with_the_least_peak(traced_models):
    """The cut search over costs with the least-peak memo finds the cut, modes and step of the
    search without it, under a budget where some stages fit no layout."""
    from autopar.planner.pipeline.schedule import schedule_cuts, step_factor

    plain = _stage_costs(traced_models)
    factor = step_factor("1f1b", num_stages=2, virtual_stages=1, num_microbatches=4)
    one = plain.cost(0, 2, in_flight=1, factor=factor, budget=None)
    budget = int(one.peak_bytes * 0.9)
    costs = _with_least_peak(plain)
    for schedule in ("gpipe", "1f1b", "interleaved-1f1b"):  # one memo across schedules, as search_stages shares it
        kw = dict(schedule=schedule, num_stages=2, num_microbatches=4, budget=budget)
        want, got = schedule_cuts(plain, **kw), schedule_cuts(costs, **kw)
        assert (want[1] is None) == (got[1] is None), schedule
        if want[1] is not None:
            assert got[1].objective == pytest.approx(want[1].objective, rel=1e-6), schedule
            assert got[1].bounds == want[1].bounds and got[5] == want[5], schedule
    assert costs.least_peak  # some stage was refused: the memo was exercised
