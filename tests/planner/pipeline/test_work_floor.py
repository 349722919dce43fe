"""The work floor of a default (``pipeline="auto"``) plan (``pipeline.candidates.work_floor``): a
lower bound on every step the stage search prices for a micro-batch count and schedule, the
schedule actions' overhead included, so that where the overhead alone makes every pipeline lose
no micro-batch graph is traced."""

import pytest

from autopar import zoo
from autopar.api import PlanOptions, plan_auto
from autopar.layout.mesh import MeshSpec
from autopar.planner.orchestrate import _trace_and_profile, plan_traced
from autopar.planner.pipeline.candidates import work_floor
from autopar.planner.pipeline.costs import stage_costs
from autopar.planner.pipeline.schedule import (SCHEDULE_VIRTUAL_STAGES, action_overhead_s, idle_speedup,
                                              schedule_cuts, step_factor)
from autopar.plans import PIPELINE_SCHEDULES
from autopar.stages import Progress
from tests.planner.pipeline.test_default_auto import cheap_actions


@pytest.fixture(scope="module")
def gpt2_full_batch():
    """Tiny GPT-2 with 4 blocks (an interleaved schedule's 2 x 2 chunks fit), batch 8, its
    full-batch trace and profile."""
    model, inputs = zoo.build("gpt2", tiny=True, num_layers=4, batch=8, device="meta")
    traced, prof = _trace_and_profile(model, inputs, precision=PlanOptions().precision, progress=Progress())
    return model, inputs, traced, prof


@pytest.mark.parametrize("cheap", [False, True], ids=["cpu-preset", "cheap-actions"])
def test_work_floor_is_below_every_searched_step(gpt2_full_batch, cheap):
    """For every micro-batch count and schedule, the floor (with the actions' overhead) is at most
    the best cut the exhaustive stage search prices (every stage solved, no budget: a budget only
    raises it), with the cpu preset's gloo-priced actions and with a GPU's; and it is at least
    ``factor x`` that overhead, the term that makes it prune."""
    model, inputs, traced, prof = gpt2_full_batch
    mesh = MeshSpec.preset("cpu", (2, 2))
    mesh = cheap_actions(mesh) if cheap else mesh
    options = PlanOptions(pipeline=None, checkpoint="none")
    flat = plan_traced(traced, prof, mesh=mesh, options=options)
    overhead = action_overhead_s(mesh)
    assert overhead == pytest.approx(60e-6 if cheap else 2 * 1.7e-3, rel=0.05)
    checked = 0
    for m in (2, 4):
        micro, micro_prof = _trace_and_profile(model, inputs, precision=PlanOptions().precision, progress=Progress(),
                                               microbatches=m)
        costs = stage_costs(micro, micro_prof, mesh=mesh, options=options)
        for schedule in PIPELINE_SCHEDULES:
            floor = work_floor(flat.built, num_stages=2, num_microbatches=(m,), schedules=(schedule,))
            factor = step_factor(schedule, num_stages=2, virtual_stages=SCHEDULE_VIRTUAL_STAGES[schedule],
                                 num_microbatches=m, idle_speedup=idle_speedup(mesh))
            assert floor >= factor * overhead
            found = schedule_cuts(costs, schedule=schedule, num_stages=2, num_microbatches=m, budget=None,
                                  prune=False, recompute=(False,))
            assert found[1] is not None, (m, schedule)
            assert 0 < floor <= found[1].objective * (1 + 1e-9), (m, schedule, floor, found[1].objective)
            checked += 1
        # the floor over several counts and schedules is the least of theirs
        each = [work_floor(flat.built, num_stages=2, num_microbatches=(m,), schedules=(s,)) for s in PIPELINE_SCHEDULES]
        assert work_floor(flat.built, num_stages=2, num_microbatches=(m,), schedules=PIPELINE_SCHEDULES) == min(each)
    assert checked == 2 * len(PIPELINE_SCHEDULES)


def test_cpu_preset_tiny_gpt2_traces_no_micro_batch_graph():
    """The cpu preset prices each schedule action at gloo's ~1.7 ms: a tiny GPT-2's ~2 ms step on
    (2, 2) leaves no room for a pipeline's ``(M v + bubble)`` stage actions, so the default plan
    says so per count and traces no micro-batch graph (only the full batch is traced)."""
    model, inputs = zoo.build("gpt2", tiny=True, device="meta")
    progress = Progress()
    chosen = plan_auto(model, inputs, mesh=MeshSpec.preset("cpu", (2, 2)), options=PlanOptions(), progress=progress)
    assert chosen.plan.pipeline is None
    assert "pipeline floors" not in progress.timings, progress.timings
    lines = [c for c in chosen.candidates if c.startswith("pipeline 2:")]
    assert lines and all(": not traced: its work floor " in c for c in lines), chosen.candidates
    counts = [int(c.split(": ")[1].split()[0]) for c in lines]
    assert counts == sorted(counts) and len(counts) >= 2, counts
