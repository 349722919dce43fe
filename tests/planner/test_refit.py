"""The planner's side of ``refine=True`` (``autopar.planner.refit``): what a plan priced, the
profile scaled to measured figures, and the re-plan under it -- without processes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autopar.layout.cost import collective_seconds, compute_seconds
from autopar.layout.machine import OP_CLASSES, ComputeProfile, LinkFit, MachineProfile, RateTable
from autopar.layout.mesh import MeshSpec
from autopar.planner.options import PlanOptions
from autopar.planner.orchestrate import plan_traced, trace_for_planning
from autopar.planner.refit import Priced, check_refinable, priced_parts, refit_mesh, replan
from autopar.plans import RecomputeRegion
from autopar.tracer import profile
from tests.test_refine import MLP  # the model the refine runs train


def _priced(**compute: float) -> Priced:
    return Priced({c: compute.get(c, 0.0) for c in OP_CLASSES},
                  compute.get("comm", 0.0))


def test_a_preset_mesh_is_refit_per_part():
    mesh = MeshSpec.preset("cpu", (2, 2))
    refit, ratios = refit_mesh(mesh, measured={"matmul": 4.0, "elementwise": 0.5, "other": 3.0}, measured_comm=20.0,
                               priced=_priced(matmul=1.0, elementwise=1.0, other=1.0, comm=2.0))
    assert ratios == {"matmul": 4.0, "elementwise": 0.5, "other": 3.0, "comm": 10.0}
    for op_class, factor in (("matmul", 4.0), ("elementwise", 0.5), ("other", 3.0), ("norm", 1.0)):
        for flops, nbytes in ((1e12, 1.0), (1.0, 1e10), (1.0, 1.0)):  # compute-, memory- and floor-bound
            assert compute_seconds(flops, nbytes, refit, op_class=op_class) == pytest.approx(
                factor * compute_seconds(flops, nbytes, mesh, op_class=op_class))
    for axes in (0, 1, (0, 1)):
        assert collective_seconds("all_reduce", 1e6, refit, axes) == pytest.approx(
            10 * collective_seconds("all_reduce", 1e6, mesh, axes))
    assert refit.shape == mesh.shape and "refit" in refit.machine.note
    assert MeshSpec.from_json(refit.to_json()) == refit  # a refit mesh saves and loads like a calibrated one


def test_a_calibrated_mesh_keeps_its_curves_and_fits_scaled():
    table = RateTable((1e6, 1e9), (1e9, 1e11))
    machine = MachineProfile(ComputeProfile((("matmul", "fp32", table),)),
                             (LinkFit("all_gather", 0, 1e-4, 1e-9),), (2,), ("x",), note="calibrated",
                             blocking_s=(2e-4,))
    mesh = dataclasses.replace(MeshSpec.preset("cpu", (2,)), machine=machine)
    # nothing measured for a part (no collective ran): it keeps its figures
    refit, ratios = refit_mesh(mesh, measured={"matmul": 2.0}, measured_comm=0.0, priced=_priced(matmul=1.0, comm=1.0))
    assert ratios == {"matmul": 2.0}
    assert refit.machine.compute == machine.compute and refit.machine.links == machine.links
    assert refit.machine.blocking_s == machine.blocking_s
    assert refit.alpha == mesh.alpha and refit.machine.time_scale == (("matmul", 2.0),)
    for flops in (1e5, 1e7, 1e10):
        assert compute_seconds(flops, 1.0, refit, op_class="matmul") == pytest.approx(
            2 * compute_seconds(flops, 1.0, mesh, op_class="matmul"))
    again, _ = refit_mesh(refit, measured={"matmul": 3.0}, measured_comm=3.0, priced=_priced(matmul=1.0, comm=1.0))
    assert again.machine.time_scale == (("matmul", 6.0),)  # factors compose
    fit = again.machine.link("all_gather", 0)
    assert (fit.alpha, fit.beta) == pytest.approx((3e-4, 3e-9))
    # a blocking collective's mid-step wait is link time too: scaled with the links
    assert again.machine.blocking_s == pytest.approx((6e-4,))
    assert collective_seconds("all_gather", 1e6, again, 0) == pytest.approx(
        3 * collective_seconds("all_gather", 1e6, mesh, 0))
    assert again.machine.note.startswith("calibrated; refit")


def test_the_fits_and_waits_over_several_axes_are_scaled_with_the_links():
    machine = MachineProfile(ComputeProfile(()), (LinkFit("all_reduce", 0, 1e-4, 1e-9),
                                                 LinkFit.over("all_reduce", (0, 1), 3e-4, 2e-9)),
                             (2, 2), ("x", "y"), blocking_s=(1e-4, 1e-4), blocking_over=(((0, 1), 5e-4),),
                             pipeline_transfer_s=2e-4)
    mesh = dataclasses.replace(MeshSpec.preset("cpu", (2, 2)), machine=machine)
    refit, _ = refit_mesh(mesh, measured={}, measured_comm=3.0, priced=_priced(comm=1.0))
    assert refit.machine.blocking_over == (((0, 1), pytest.approx(1.5e-3)),)
    assert refit.machine.pipeline_transfer_s == pytest.approx(6e-4)  # a pipeline transfer's latency too
    assert collective_seconds("all_reduce", 1e6, refit, (0, 1)) == pytest.approx(
        3 * collective_seconds("all_reduce", 1e6, mesh, (0, 1)))


def test_time_scales_are_checked():
    with pytest.raises(ValueError, match="time_scale.*'convolution'"):
        MachineProfile(ComputeProfile(()), (), (2,), ("x",), time_scale=(("convolution", 2.0),))
    with pytest.raises(ValueError, match="time_scale.*-1"):
        MachineProfile(ComputeProfile(()), (), (2,), ("x",), time_scale=(("matmul", -1.0),))


@pytest.fixture(scope="module")
def traced():
    torch.manual_seed(0)
    return trace_for_planning(MLP(), (torch.randn(32, 64), torch.randn(32, 64)), precision="fp32")


def _fast(shape=(2,)) -> MeshSpec:
    return dataclasses.replace(MeshSpec.preset("cpu", shape), alpha=(1e-7,), beta=(1e-13,), name="fast")


def test_a_plan_measured_as_priced_is_kept(traced):
    prof, options = profile(traced), PlanOptions()
    plan = plan_traced(traced, prof, mesh=_fast(), options=options).plan
    priced = priced_parts(traced, prof, plan, options=options)
    assert priced.comm > 0 and priced.compute["matmul"] > 0
    refit = replan(traced, prof, plan, options=options, measured=priced.compute, measured_comm=priced.comm)
    assert refit.plan is plan and refit.gain == 0.0
    assert refit.current_s == pytest.approx(plan.estimate.step_s, rel=1e-6)  # the same model: the same price


def test_slow_measured_links_replan_without_communication(traced):
    prof, options = profile(traced), PlanOptions()
    plan = plan_traced(traced, prof, mesh=_fast(), options=options).plan
    priced = priced_parts(traced, prof, plan, options=options)
    refit = replan(traced, prof, plan, options=options, measured=priced.compute, measured_comm=priced.comm * 1e6)
    assert refit.ratios == pytest.approx({**{c: 1.0 for c, v in priced.compute.items() if v > 0}, "comm": 1e6})
    assert refit.plan is not plan and refit.gain > 0.5
    assert refit.plan.estimate.comm_s + refit.plan.estimate.reshard_s < priced.comm


def test_the_refit_mesh_prices_the_plan_at_what_was_measured(traced):
    prof, options = profile(traced), PlanOptions()
    plan = plan_traced(traced, prof, mesh=_fast(), options=options).plan
    priced = priced_parts(traced, prof, plan, options=options)
    measured = {c: 7.0 * v if c == "matmul" else 40.0 * v for c, v in priced.compute.items()}
    mesh, _ = refit_mesh(plan.mesh, measured=measured, measured_comm=1e3 * priced.comm, priced=priced)
    refit = priced_parts(traced, prof, plan, options=options, mesh=mesh)
    assert refit.compute == pytest.approx(measured, rel=1e-9)  # floor-bound kernels included
    assert refit.comm == pytest.approx(1e3 * priced.comm, rel=1e-6)


def test_plans_refine_cannot_carry_are_refused(traced):
    plan = plan_traced(traced, profile(traced), mesh=_fast(), options=PlanOptions()).plan
    check_refinable(plan)
    rotor = dataclasses.replace(plan, recompute=(RecomputeRegion("a", ("linear",)),), checkpoint={"method": "rotor"})
    with pytest.raises(NotImplementedError, match="refine=True.*'rotor'.*'a'"):
        check_refinable(rotor)
    with pytest.raises(NotImplementedError, match="refine=True.*offload"):
        check_refinable(dataclasses.replace(plan, offload={"p_a_weight": ("host", "host")}))
