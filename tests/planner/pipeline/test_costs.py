"""What a pipeline stage costs beyond its ops (``planner/pipeline/costs.py``): the schedule actions'
overhead, priced once per stage in ``StageCost.time_s`` and so in the plan's estimate and report."""

import dataclasses

import pytest

from autopar.layout.machine import ComputeProfile, MachineProfile
from autopar.layout.mesh import MeshSpec
from autopar.planner.options import PlanOptions
from autopar.planner.pipeline.order import _rank_actions
from autopar.planner.pipeline.schedule import STAGE_ACTIONS, action_overhead_s, step_time
from autopar.planner.pipeline.search import search_stages


def _mesh(action_s: float | None, transfer_s: float | None = None) -> MeshSpec:
    preset = MeshSpec.preset("cpu", (2, 2))
    machine = MachineProfile(ComputeProfile(()), (), (2, 2), preset.axis_names, pipeline_action_s=action_s,
                             pipeline_transfer_s=transfer_s)
    return dataclasses.replace(preset, machine=machine)


@pytest.mark.parametrize("schedule, microbatches", [("1f1b", 4), ("zero-bubble", 2)])
def test_a_pipeline_step_pays_every_stage_actions_overhead(traced_models, schedule, microbatches):
    """With a per-action overhead of ``c`` every stage's micro-batch costs ``STAGE_ACTIONS * c``
    more (the last stage's too), the layouts and cuts stay (a constant on every stage moves no
    optimum), and the step rises by ``factor * STAGE_ACTIONS * c``, the schedule's formula."""
    traced, prof = traced_models["gpt2"]
    found = {}
    for action_s in (0.0, 4e-3):
        found[action_s] = search_stages(traced, prof, mesh=_mesh(action_s), options=PlanOptions(), num_stages=2,
                                        num_microbatches=microbatches, schedules=(schedule,)).plan
    base, paid = found[0.0], found[4e-3]
    assert action_overhead_s(_mesh(4e-3)) == STAGE_ACTIONS * 4e-3 == 8e-3
    record = paid.solver["pipeline"]
    assert [st.layers for st in paid.pipeline.stages] == [st.layers for st in base.pipeline.stages]
    assert paid.nodes == base.nodes
    for before, after in zip(base.solver["pipeline"]["stages"], record["stages"]):
        assert before["overhead_s"] == 0.0 and after["overhead_s"] == 8e-3
        assert after["time_s"] == pytest.approx(before["time_s"] + 8e-3, rel=1e-9)
    factor = record["factor"]
    assert paid.estimate.step_s == pytest.approx(base.estimate.step_s + factor * 8e-3, rel=1e-9)
    v = paid.pipeline.virtual_stages
    assert paid.estimate.step_s == pytest.approx(step_time(
        schedule, times=[f["time_s"] for f in record["stages"]], syncs=[f["sync_s"] for f in record["stages"]],
        num_stages=2, virtual_stages=v, num_microbatches=microbatches), rel=1e-9)
    assert " actions " in paid.summary() and "   8.000 " in paid.summary()  # the stage table's column


def test_a_measured_transfer_latency_prices_each_stage_point_to_point(traced_models):
    """``MachineProfile.pipeline_transfer_s`` replaces axis 0's alpha in every point-to-point (two
    per micro-batch at each cut): a stage's ``p2p_s`` drops by twice the difference (every cut of
    a GPT-2 carries one residual stream's bytes), the step with it; the last stage sends nothing."""
    traced, prof = traced_models["gpt2"]
    found = {}
    for transfer_s in (None, 0.0):
        found[transfer_s] = search_stages(traced, prof, mesh=_mesh(0.0, transfer_s), options=PlanOptions(),
                                          num_stages=2, num_microbatches=4, schedules=("1f1b",)).plan
    alpha = _mesh(0.0).alpha[0]
    fitted, measured = (found[k].solver["pipeline"]["stages"] for k in (None, 0.0))
    assert fitted[-1]["p2p_s"] == measured[-1]["p2p_s"] == 0.0
    first, low = fitted[0], measured[0]
    assert first["p2p_s"] - low["p2p_s"] == pytest.approx(2 * alpha, rel=1e-9)
    assert found[0.0].estimate.step_s < found[None].estimate.step_s


def test_an_unmeasured_overhead_is_the_presets():
    """None on the profile: the cpu preset's default, the same as the plain preset mesh's."""
    assert action_overhead_s(_mesh(None)) == action_overhead_s(MeshSpec.preset("cpu", (2, 2))) > 0


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zero-bubble"])
def test_stage_actions_is_what_torch_runs_per_chunk_and_micro_batch(schedule):
    """torch's own action order: every chunk runs each micro-batch's forward and one pass that
    sends its gradient back (a full backward, or zero-bubble's input-gradient pass): the
    ``STAGE_ACTIONS`` priced; zero-bubble's weight-gradient passes (local, measured ~20x cheaper
    than a transferring action) are the only others."""
    from torch.distributed.pipelining.schedules import _ComputationType as Kind

    num_stages, v, m = 2, 2, 4
    for rank in range(num_stages):
        actions = [a for a in _rank_actions(schedule, rank=rank, num_stages=num_stages, virtual_stages=v,
                                            num_microbatches=m) if a is not None]
        kinds = [a.computation_type for a in actions]
        sending = kinds.count(Kind.FORWARD) + kinds.count(Kind.FULL_BACKWARD) + kinds.count(Kind.BACKWARD_INPUT)
        assert sending == STAGE_ACTIONS * v * m
        local = kinds.count(Kind.BACKWARD_WEIGHT)
        assert len(kinds) == sending + local and local == (v * m if schedule == "zero-bubble" else 0)
