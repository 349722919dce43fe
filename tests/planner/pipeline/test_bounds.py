"""Step floors of pipelined configurations (``autopar.planner.pipeline.bounds``): every floor is
below every plan the stage search can find, the floors tighten the search's own stage bounds
without changing its optimum, and configurations searched in floor order keep the exhaustive
optimum."""

import math

import pytest

from autopar.api import plan_pipelined
from autopar import zoo
from autopar.layout.mesh import MeshSpec
from autopar.planner.options import PlanOptions
from autopar.planner.pipeline.bounds import block_floor, config_floors, in_bound_order, step_floor
from autopar.planner.pipeline.schedule import schedule_cuts, step_factor
from autopar.planner.pipeline.search import search_stages
from tests.planner.pipeline.test_search import _stage_costs

CASES = [("gpt2", (2, 2)), ("gpt2", (4, 2)), ("llama-1b", (2, 2))]


# GPT-2 on (4, 2) runs with the whole sweeps: its floors are the same code as on (2, 2) at another
# step factor, and gpt2-shape0 and llama-1b-shape2 of this test stay in the default run
@pytest.mark.parametrize("name,shape", [CASES[0], pytest.param(*CASES[1], marks=pytest.mark.full_sweep), CASES[2]])
def test_block_floors_bound_every_stage_range(traced_models, name, shape):
    """For every range [a, b) and both recompute modes, the sum of its blocks' floors plus the
    cut's point-to-point and the schedule actions' overhead (``schedule_s``) is at most the
    range's unconstrained optimum (time + sync / factor), hence at most any budgeted plan of it;
    the floors of one class are one solve."""
    costs = _stage_costs(traced_models, name, shape)
    factor = step_factor("1f1b", num_stages=shape[0], virtual_stages=1, num_microbatches=4)
    floors = [block_floor(costs, j, factor=factor) for j in range(costs.num_blocks)]
    assert all(f > 0 for f in floors)
    assert costs.num_solves <= 4  # first, middle, last (+ the second block when it differs)
    for a in range(costs.num_blocks):
        for b in range(a + 1, costs.num_blocks + 1):
            for recompute in (False, True):
                free = costs.free(a, b, factor=factor, recompute=recompute)[1]
                value = free.time_s + free.sync_s / factor
                assert sum(floors[a:b]) + costs.schedule_s(b) <= value * (1 + 1e-9), (a, b, recompute)
    # Tight where it matters: a middle block alone is its own floor's problem but for shared inputs.
    mid = costs.num_blocks // 2
    one = costs.free(mid, mid + 1, factor=factor)[1]
    assert floors[mid] >= 0.5 * (one.time_s - one.p2p_s - one.overhead_s + one.sync_s / factor)


# with the whole sweeps (15 s); test_floors_tighten_the_search_without_changing_its_optimum stays
@pytest.mark.parametrize("name,shape", [pytest.param(*c, marks=pytest.mark.full_sweep) for c in CASES])
def test_step_floor_is_below_the_exhaustive_search(traced_models, name, shape):
    """``step_floor`` (and ``config_floors``' shared floors at the largest factor) is at most the
    best cut of an exhaustive search (every stage solved), under no budget and a tight one."""
    probe = _stage_costs(traced_models, name, shape)
    factor = step_factor("1f1b", num_stages=shape[0], virtual_stages=1, num_microbatches=8)
    one = probe.cost(0, 1, in_flight=1, factor=factor, budget=None)
    for budget in (None, int(one.peak_bytes * 1.3)):
        costs = _stage_costs(traced_models, name, shape)  # its memo is shared by the schedules' searches
        for schedule in ("1f1b", "interleaved-1f1b", "gpipe", "zero-bubble"):
            kw = dict(schedule=schedule, num_stages=shape[0], num_microbatches=8)
            floor = step_floor(costs, **kw)
            shared = config_floors(costs, schedules=("1f1b", schedule), num_stages=shape[0], num_microbatches=8)
            found = schedule_cuts(costs, budget=budget, prune=False, **kw)
            if found[1] is None:
                continue
            assert 0 < shared[schedule] <= floor * (1 + 1e-12) <= found[1].objective * (1 + 1e-9), (schedule, budget)
        with pytest.raises(ValueError, match="below the schedule's step factor"):
            step_floor(costs, schedule="1f1b", num_stages=shape[0], num_microbatches=8, floor_factor=1.0)


def test_floors_tighten_the_search_without_changing_its_optimum(traced_models):
    """With the floors stored (``step_floor``), the lazy search's stage bounds are the floors
    where tighter: the same cut, modes and step as solving every stage, in no more solves."""
    probe = _stage_costs(traced_models, "gpt2", (4, 2))
    factor = step_factor("1f1b", num_stages=4, virtual_stages=1, num_microbatches=8)
    one, four = (probe.cost(0, 2, in_flight=k, factor=factor, budget=None) for k in (1, 4))
    budget = (one.peak_bytes + four.peak_bytes) // 2
    kw = dict(schedule="1f1b", num_stages=4, num_microbatches=8)
    plain = _stage_costs(traced_models, "gpt2", (4, 2))
    floored = _stage_costs(traced_models, "gpt2", (4, 2))
    step_floor(floored, **kw)
    before = floored.num_solves
    got_plain = schedule_cuts(plain, budget=budget, **kw)
    plain_solves = plain.num_solves
    # Every stage solved: on the plain search's memo, whose entries are exact solves, so only
    # the ranges it skipped are solved here.
    want = schedule_cuts(plain, budget=budget, prune=False, **kw)
    got = schedule_cuts(floored, budget=budget, **kw)
    # The floors bind somewhere (here the first and last blocks, whose embedding and head the
    # ops' cheapest options price below what the block's own solve proves).
    assert any(floored.quick_bound(a, b, factor=factor) > plain.quick_bound(a, b, factor=factor)
               for a in range(floored.num_blocks) for b in range(a + 1, floored.num_blocks + 1))
    for found in (got, got_plain):
        assert found[1].objective == pytest.approx(want[1].objective, rel=1e-9)
        assert found[1].bounds == want[1].bounds and found[5] == want[5]
    assert floored.num_solves - before <= plain_solves


def test_in_bound_order_skips_only_what_cannot_win():
    steps = {"a": 5.0, "b": 3.0, "c": None, "d": 9.0, "e": 3.5}
    bounds = {"a": 4.0, "b": 2.5, "c": 1.0, "d": 3.2, "e": 2.9}
    seen, skipped = [], []

    def search(key, incumbent):
        seen.append((key, incumbent))
        return steps[key]

    out = in_bound_order(bounds, search, step_of=lambda s: s, skipped=lambda k, f, inc: skipped.append((k, f, inc)))
    assert seen == [("c", math.inf), ("b", math.inf), ("e", 3.0)]
    assert sorted(skipped) == [("a", 4.0, 3.0), ("d", 3.2, 3.0)]
    assert min(s for s in out.values() if s is not None) == min(s for s in steps.values() if s is not None)
    # No plan yet: an infinite bound (too few blocks for the stages) is searched, to say why.
    tried = []
    out = in_bound_order({"x": math.inf, "y": math.inf}, lambda k, inc: tried.append(k), step_of=lambda s: None)
    assert sorted(tried) == ["x", "y"] and set(out) == {"x", "y"}


def test_search_below_a_bound_returns_no_plan(traced_models):
    """Given another configuration's step as ``bound``, a search that cannot beat it says so
    (floors above it: not searched) and returns no plan; a loose bound changes nothing."""
    traced, prof = traced_models["gpt2"]
    mesh = MeshSpec.preset("cpu", (2, 2))
    kw = dict(mesh=mesh, options=PlanOptions(), num_stages=2, num_microbatches=4, schedules=("1f1b", "gpipe"))
    free = search_stages(traced, prof, **kw)
    step = free.plan.estimate.step_s
    loose = search_stages(traced, prof, bound=step * 2, **kw)
    assert loose.plan.estimate.step_s == pytest.approx(step)
    tight = search_stages(traced, prof, bound=step * 0.5, **kw)
    assert tight.plan is None and all(c.step_s is None for c in tight.candidates)
    assert any("not searched: its floor" in c.note for c in tight.candidates), [str(c) for c in tight.candidates]


def test_auto_microbatches_equal_the_best_single_count(micro_traces_once):
    """``microbatches="auto"`` searches the counts in floor order, skipping those whose floor
    cannot win: its plan is as fast as the best count planned alone (on the graphs "auto" traced:
    ``micro_traces_once``)."""
    model, inputs = zoo.build("gpt2", tiny=True, num_layers=4, batch=16, device="meta")
    mesh = MeshSpec.preset("cpu", (2, 2))
    auto = plan_pipelined(model, inputs, mesh=mesh, options=PlanOptions(pipeline=2, microbatches="auto",
                                                                        schedule="1f1b"))
    alone = {m: plan_pipelined(model, inputs, mesh=mesh, options=PlanOptions(pipeline=2, microbatches=m,
                                                                             schedule="1f1b")).plan.estimate.step_s
             for m in (2, 4, 16)}
    assert auto.plan.estimate.step_s == pytest.approx(min(alone.values()), rel=1e-9), (alone, auto.candidates)
    assert auto.plan.pipeline.num_microbatches == min(alone, key=alone.get)
    assert {m for _, m, _ in micro_traces_once} >= set(alone)  # the counts alone reused auto's graphs


def test_a_range_that_does_not_fit_makes_every_wider_range_unfit(traced_models):
    """What ``LazyCuts._unfit_around`` relies on, checked by solving every range: without
    recompute, if blocks [a, b) with k micro-batches in flight fit no layout under a budget, no
    range containing them fits with k or more in flight."""
    costs = _stage_costs(traced_models, "gpt2", (4, 2))
    factor = step_factor("1f1b", num_stages=4, virtual_stages=1, num_microbatches=8)
    one = costs.cost(0, 2, in_flight=1, factor=factor, budget=None)
    budget = int(one.peak_bytes * 1.15)
    n = costs.num_blocks
    fits = {(a, b, k): costs.cost(a, b, in_flight=k, factor=factor, budget=budget) is not None
            for a in range(n) for b in range(a + 1, n + 1) for k in (1, 3)}
    assert any(fits.values()) and not all(fits.values())
    for (a, b, k), ok in fits.items():
        if not ok:
            wider = [key for key, ok2 in fits.items() if key[0] <= a and key[1] >= b and key[2] >= k and ok2]
            assert not wider, ((a, b, k), wider)


def test_stage_window():
    from autopar.planner.pipeline.schedule import stage_window

    assert stage_window("auto", num_blocks=24, parts=8) is None
    assert stage_window("auto", num_blocks=96, parts=16) == 3 and stage_window("auto", num_blocks=96, parts=32) == 2
    assert stage_window(None, num_blocks=96, parts=16) is None and stage_window(4, num_blocks=96, parts=16) == 4
    for bad in (-1, 1.5, True, "wide"):
        with pytest.raises(ValueError, match="window must be None, 'auto' or a block count"):
            stage_window(bad, num_blocks=96, parts=16)
