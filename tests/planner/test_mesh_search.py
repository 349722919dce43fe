"""mesh="auto" (autopar.planner.mesh_search): every 1-3 axis arrangement of a cluster, the fastest kept."""

from __future__ import annotations

import math

import pytest
import torch

from autopar import zoo
from autopar.api import plan as autopar_plan
from autopar.api import plan_model, plan_traced
from autopar.layout.mesh import MeshSpec
from autopar.planner.mesh_search import mesh_shapes, search_meshes
from autopar.planner.options import PlanOptions


def test_shapes_are_every_ordered_factorisation_up_to_three_axes():
    shapes = mesh_shapes(64)
    assert shapes[0] == (64,) and all(math.prod(s) == 64 and min(s) >= 2 for s in shapes)
    assert len(shapes) == len(set(shapes)) == 1 + 5 + 10  # 2^6 into 1, 2, 3 ordered parts
    assert (8, 8) in shapes and (2, 4, 8) in shapes and (8, 4, 2) in shapes
    assert mesh_shapes(12, max_axes=2) == [(12,), (2, 6), (3, 4), (4, 3), (6, 2)]
    assert mesh_shapes(1) == [(1,)] and mesh_shapes(7) == [(7,)]
    with pytest.raises(ValueError, match="positive int"):
        mesh_shapes(0)


def test_cluster_puts_intra_node_links_on_inner_axes():
    mesh = MeshSpec.cluster(nodes=8, devices_per_node=8, shape=(2, 4, 8))
    inter, intra = MeshSpec.cluster(nodes=2, devices_per_node=1).alpha[0], mesh.alpha[2]
    assert mesh.alpha == (inter, inter, intra) and intra < inter
    assert MeshSpec.cluster(nodes=8, devices_per_node=8).shape == (8, 8)
    with pytest.raises(ValueError, match="has 32 devices"):
        MeshSpec.cluster(nodes=8, devices_per_node=8, shape=(4, 8))


def test_search_keeps_the_fastest_feasible_mesh_and_reports_every_candidate():
    torch.manual_seed(0)
    model, inputs = zoo.build("gpt2", tiny=True, batch=8, seq=32, device="meta")
    first = plan_model(model, inputs, mesh=(4,), options=PlanOptions(checkpoint="none"))
    seen = []

    def plan_on(mesh, left):
        assert left is None
        if mesh.shape == (2, 2):
            raise ValueError("no plan fits\nsecond line")
        return plan_traced(first.traced, first.profile, mesh=mesh, options=PlanOptions(checkpoint="none"))

    found = search_meshes(plan_on, nodes=2, devices_per_node=2, device="a100-80gb", report=seen.append)
    assert [r.shape for r in found.rows] == [(2, 2), (4,)] and seen == list(found.rows)  # the cluster's own first
    assert found.best_shape == (4,) and found.best.plan.mesh.shape == (4,)
    assert found.rows[0].note == "ValueError: no plan fits" and not found.rows[0].feasible
    assert "<- chosen" in found.table().splitlines()[2]  # sorted: the fastest first
    # Every candidate's own plan is no faster than the chosen one.
    assert all(r.step_s >= found.best.plan.estimate.step_s for r in found.rows if r.feasible)
    with pytest.raises(ValueError, match="no mesh of 1 x 2"):
        search_meshes(lambda mesh, left: (_ for _ in ()).throw(ValueError("nope")), nodes=1, devices_per_node=2)


class _FakeTime:
    """Stands for the ``time`` module in ``autopar.planner.mesh_search``: the fake planners below
    advance it by what their planning "takes", so which meshes fit a time budget does not
    depend on how long a sleep or a call really takes on a loaded machine."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def fake_time(monkeypatch):
    from autopar.planner import mesh_search

    clock = _FakeTime()
    monkeypatch.setattr(mesh_search, "time", clock)
    return clock


def test_time_budget_plans_the_clusters_own_shape_and_reports_the_rest(fake_time):
    calls = []

    class Result:
        def __init__(self, step_s):
            self.plan = type("P", (), {"estimate": type("E", (), {"step_s": step_s, "peak_bytes": 1})()})()

    def plan_on(mesh, left):
        calls.append((mesh.shape, left))
        fake_time.now += 0.05
        return Result(1.0 / len(mesh.shape))

    found = search_meshes(plan_on, nodes=2, devices_per_node=4, device="a100-80gb", time_budget=0.01)
    assert calls == [((2, 4), None)]  # its own shape, with the full solver time limit
    assert found.best_shape == (2, 4) and [r.shape for r in found.rows][0] == (2, 4)
    assert all("not planned" in r.note for r in found.rows[1:]) and len(found.rows) == len(mesh_shapes(8))


def test_plan_mesh_auto_and_inspect_mesh_auto(capsys):
    from autopar.cli.main import main

    torch.manual_seed(0)
    model, inputs = zoo.build("mlp", tiny=True, device="meta")
    plan = autopar_plan(model, inputs, mesh="auto", nodes=1, devices_per_node=4, preset="a100-80gb",
                        checkpoint="none")
    assert plan.mesh.shape in mesh_shapes(4)
    with_baselines = autopar_plan(model, inputs, mesh="auto", nodes=1, devices_per_node=4, preset="a100-80gb",
                                  checkpoint="none", baselines=True)  # solved for the chosen mesh only
    assert with_baselines.mesh.shape == plan.mesh.shape and with_baselines.baselines
    assert with_baselines.estimate == plan.estimate
    with pytest.raises(ValueError, match="needs nodes= and devices_per_node="):
        autopar_plan(model, inputs, mesh="auto")
    with pytest.raises(ValueError, match="go with mesh='auto'"):
        autopar_plan(model, inputs, mesh=(4,), nodes=1)
    assert main(["inspect", "mlp", "--mesh", "auto", "--nodes", "1", "--devices-per-node", "4", "-q",
                 "--no-baselines", "--no-layers", "--checkpoint", "none"]) == 0
    out = capsys.readouterr().out
    assert "mesh search: 1 nodes x 4 a100-80gb devices, 2 meshes" in out and "<- chosen" in out


def test_a_mesh_predicted_to_overrun_the_budget_is_reported_not_started(fake_time):
    from autopar.planner.mesh_search import AXIS_GROWTH, predicted_seconds

    assert predicted_seconds(2, {}) is None
    assert predicted_seconds(2, {2: 3.0, 1: 1.0}) == 3.0
    assert predicted_seconds(3, {1: 1.0, 2: 2.0}) == 2.0 * AXIS_GROWTH
    assert predicted_seconds(3, {1: 1.0}) == AXIS_GROWTH ** 2
    calls = []

    class Result:
        def __init__(self, step_s):
            self.plan = type("P", (), {"estimate": type("E", (), {"step_s": step_s, "peak_bytes": 1})()})()

    def plan_on(mesh, left):
        calls.append(mesh.shape)
        fake_time.now += 0.02 * len(mesh.shape)
        return Result(1.0 / len(mesh.shape))

    # 8 devices: 1- and 2-axis meshes take 0.02-0.04 s (fake), so a 3-axis one is predicted at
    # 0.04 * AXIS_GROWTH s, more than the budget leaves: none is started.
    found = search_meshes(plan_on, nodes=2, devices_per_node=4, device="a100-80gb", time_budget=0.5,
                          restrict="never")  # exact 3-axis planning, as predicted
    three = [r for r in found.rows if len(r.shape) == 3]
    assert three and not any(len(s) == 3 for s in calls)
    assert all(r.note.startswith("not planned: ~") and "predicted for a 3-axis mesh" in r.note for r in three)
    assert {r.shape for r in found.rows if r.feasible} == set(calls) and len(calls) == 3
    assert found.best_shape == (2, 4)  # the fastest of the planned ones (fake: fewer axes are slower)


# ------------------------------------------------------------------ restricted 3-axis plans
def _mlp_search(restrict: str):
    torch.manual_seed(0)
    model, inputs = zoo.build("mlp", batch=4, seq=64, num_layers=2, device="meta")
    options = PlanOptions(checkpoint="none", preset="h100-80gb")
    first = plan_model(model, inputs, mesh=(4,), options=options, cache=False)
    calls = []

    def plan_on(mesh, left, fixed=None):
        calls.append((mesh.shape, fixed))
        return plan_traced(first.traced, first.profile, mesh=mesh, options=options, fixed=fixed)

    return search_meshes(plan_on, nodes=4, devices_per_node=4, device="h100-80gb", restrict=restrict), calls


# Every 3-axis shape of 16 devices planned twice (20 s): with the whole sweeps (pytest -m full_sweep).
@pytest.mark.full_sweep
def test_every_three_axis_mesh_gets_a_restricted_plan_never_better_than_the_exact_one():
    restricted, calls = _mlp_search("always")
    exact, _ = _mlp_search("never")
    three = [r for r in restricted.rows if len(r.shape) == 3]
    assert {r.shape for r in three} == {(2, 2, 4), (2, 4, 2), (4, 2, 2)}
    for row in three:  # a real plan, costed by the same model, whose note says how it was found
        assert row.feasible and row.step_s > 0 and row.peak_bytes > 0 and row.restricted
        assert "pinned-axis descent from" in row.note and row.note.endswith(", converged")
        # The first step pins the axis a 2-axis parent shares, then every step pins one axis.
        pins = [str(fixed) for shape, fixed in calls if shape == row.shape]
        assert pins[0].endswith("'s plan") and all(p.startswith("axis ") for p in pins) and len(pins) >= 3
    exact_rows = {r.shape: r for r in exact.rows}
    assert not any(r.restricted for r in exact.rows)
    for row in restricted.rows:
        # 1-2 axis meshes are planned exactly either way; a restricted plan's options are a
        # subset of the exact problem's, so it is never faster (to the solver's tolerance).
        if len(row.shape) <= 2:
            assert row.step_s == exact_rows[row.shape].step_s
        else:
            assert row.step_s >= exact_rows[row.shape].step_s * (1 - 1e-6)
    # The search's choice is the fastest row, never slower than the cluster's own 4x4.
    assert restricted.best.plan.estimate.step_s <= exact_rows[(4, 4)].step_s


def test_a_pinned_problem_keeps_a_subset_of_the_options_and_the_pinned_plan():
    from autopar.planner.mesh_search import pinned, pins_of

    torch.manual_seed(0)
    model, inputs = zoo.build("mlp", batch=4, seq=64, num_layers=2, device="meta")
    options = PlanOptions(checkpoint="none", preset="h100-80gb")
    mesh = MeshSpec.cluster(nodes=2, devices_per_node=4, device="h100-80gb", shape=(2, 2, 2))
    full = plan_model(model, inputs, mesh=mesh, options=options, cache=False)
    pins = pins_of(full)
    for axis in range(3):
        part = plan_traced(full.traced, full.profile, mesh=mesh, options=options,
                           fixed=pinned(pins, src_axis=axis, dst_axis=axis))
        whole = {n.name: {o.name for o in n.options} for n in full.built.problem.nodes}
        smaller = False
        for node in part.built.problem.nodes:
            names = {o.name for o in node.options}
            assert names <= whole[node.name]
            smaller |= names < whole[node.name]
        assert smaller
        # The exact plan is in every space pinned from it: the restricted optimum equals it.
        assert part.plan.estimate.step_s == pytest.approx(full.plan.estimate.step_s, rel=1e-6)


def test_descent_keeps_the_best_step_stops_when_two_pins_gain_nothing_and_skips_far_candidates():
    class Result:
        def __init__(self, step_s):
            self.plan = type("P", (), {"estimate": type("E", (), {"step_s": step_s, "peak_bytes": 1})()})()

    exact = {(8,): 9.0, (2, 4): 2.0, (4, 2): 3.0}
    # Restricted steps per 3-axis shape (8 devices: only 2x2x2), in call order: the first step,
    # a gain, a loss (not kept), then two pins without gain -> converged.
    script = {(2, 2, 2): [2.1, 1.9, 2.5, 1.9]}
    pins = []

    def plan_on(mesh, left, fixed=None):
        if fixed is None:
            return Result(exact[mesh.shape])
        pins.append(str(fixed))
        return Result(script[mesh.shape].pop(0))

    found = search_meshes(plan_on, nodes=2, devices_per_node=4, device="a100-80gb", time_budget=60.0, restrict="always",
                          pins_of=lambda result: {})
    row = next(r for r in found.rows if r.shape == (2, 2, 2))
    assert row.step_s == 1.9 and row.note.endswith("4 steps, converged") and found.best_shape == (2, 2, 2)
    assert pins == ["axis 0 pinned as 2x4's plan", "axis 1 pinned step 2", "axis 2 pinned step 3",
                    "axis 0 pinned step 4"]  # after the gain (pin 1) pins 2 and 0 gained nothing
    # Under a budget, a candidate over 10% slower than the fastest plan keeps its first step.
    exact[(2, 4)] = 1.0
    script[(2, 2, 2)] = [2.1]
    found = search_meshes(plan_on, nodes=2, devices_per_node=4, device="a100-80gb", time_budget=60.0, restrict="always",
                          pins_of=lambda result: {})
    row = next(r for r in found.rows if r.shape == (2, 2, 2))
    assert row.step_s == 2.1 and "1 step, not refined (over 10% slower" in row.note and found.best_shape == (2, 4)


# ------------------------------------------------------------- given meshes (calibrated profiles)
def _slow_links(mesh: MeshSpec, factor: float) -> MeshSpec:
    from dataclasses import replace

    return replace(mesh, alpha=tuple(a * factor for a in mesh.alpha), beta=tuple(b * factor for b in mesh.beta))


def test_plan_candidates_keeps_the_mesh_its_own_costs_price_fastest():
    """Each given mesh is priced by its own links (as two machine profiles would be): whichever
    mesh has the cheaper links wins, and the winner's plan lists every candidate's row."""
    from autopar.planner.orchestrate import plan_candidates

    torch.manual_seed(0)
    model, inputs = zoo.build("gpt2", tiny=True, batch=8, seq=32, device="meta")
    options = PlanOptions(checkpoint="none", pipeline=None)
    flat, square = MeshSpec.preset("cpu", (4,)), MeshSpec.preset("cpu", (2, 2))
    for slow, fast in ((flat, square), (square, flat)):
        found = plan_candidates(model, inputs, meshes=[_slow_links(slow, 1e3), fast], options=options)
        assert found.best_shape == fast.shape and found.best.mesh.shape == fast.shape
        steps = {r.shape: r.step_s for r in found.rows}
        assert steps[fast.shape] < steps[slow.shape]
        assert found.best.estimate.step_s == steps[fast.shape]
        assert len(found.best.solver["meshes"]) == 2
        assert sum("<- chosen" in row for row in found.best.solver["meshes"]) == 1


def test_search_given_reports_failures_and_refuses_mixed_candidates():
    from autopar.planner.mesh_search import search_given

    class Plan:
        def __init__(self, step_s):
            self.estimate = type("E", (), {"step_s": step_s, "peak_bytes": 1})()

    def plan_on(mesh):
        if mesh.shape == (2, 2):
            raise ValueError("no plan fits\nmore")
        return Plan(1.0)

    meshes = [MeshSpec.preset("cpu", (2, 2)), MeshSpec.preset("cpu", (4,))]
    found = search_given(plan_on, meshes, estimate_of=lambda p: p.estimate)
    assert found.best_shape == (4,) and found.rows[0].note == "ValueError: no plan fits"
    with pytest.raises(ValueError, match=r"no candidate mesh has a plan \(2x2: ValueError: no plan fits"):
        search_given(plan_on, meshes[:1], estimate_of=lambda p: p.estimate)
    with pytest.raises(ValueError, match="different device counts"):
        search_given(plan_on, [meshes[1], MeshSpec.preset("cpu", (2,))])
    with pytest.raises(ValueError, match="repeat a shape"):
        search_given(plan_on, [meshes[1], meshes[1]])
    with pytest.raises(ValueError, match="at least one"):
        search_given(plan_on, [])


def test_on_one_machine_keeps_each_meshes_links_and_shares_the_machine():
    from dataclasses import replace

    from autopar.layout.machine import ComputeProfile, LinkFit, MachineProfile, RateTable
    from autopar.planner.mesh_search import on_one_machine

    def calibrated(shape, rate, overlap, idle, alpha):
        compute = ComputeProfile((("matmul", "fp32", RateTable((1e6, 1e9), (rate / 4, rate))),))
        links = tuple(LinkFit("all_reduce", axis, alpha, 1e-9) for axis in range(len(shape)))
        if len(shape) > 1:  # the 4-rank group spanning both axes, fitted on its own
            links += (LinkFit.over("all_reduce", range(len(shape)), 3e-3, 1e-9),)
        machine = MachineProfile(compute, links, shape, tuple(f"ax{i}" for i in range(len(shape))),
                                 idle_speedup=idle, blocking_over=(((0, 1), 1e-3),) if len(shape) > 1 else ())
        return replace(MeshSpec.preset("cpu", shape), machine=machine, comm_overlap=overlap, peak_flops=rate,
                       alpha=(alpha,) * len(shape))

    flat, square = calibrated((4,), 37e9, 0.0, 2.0, 3e-3), calibrated((2, 2), 40e9, 0.6, 1.4, 2e-3)
    a, b = on_one_machine([flat, square])
    assert a is flat  # the reference: as calibrated
    assert b.shape == (2, 2) and b.alpha == square.alpha and b.machine.links == square.machine.links
    assert b.machine.link_over("all_reduce", (0, 1)).alpha == 3e-3  # the group's fit travels with its mesh
    assert b.machine.blocking_of((0, 1)) == 1e-3  # and so does its blocking wait
    assert b.machine.measured_shape == (2, 2)
    assert b.machine.compute == flat.machine.compute and b.peak_flops == 37e9
    assert b.comm_overlap == 0.0 and b.machine.idle_speedup == 2.0
    assert hash(b.machine) != hash(square.machine)  # a cache key: the shared figures are part of it
    preset = MeshSpec.preset("cpu", (2, 2))
    assert on_one_machine([preset, flat])[0] is preset and on_one_machine([preset])[0] is preset


def test_rank_groups_name_the_same_ranks_whichever_mesh_names_them():
    from autopar.planner.mesh_search import rank_groups

    assert rank_groups((2, 2), (0, 1)) == rank_groups((4,), (0,)) == frozenset({frozenset(range(4))})
    assert rank_groups((2, 2), (0,)) == frozenset({frozenset({0, 2}), frozenset({1, 3})})
    assert rank_groups((2, 2), (1,)) == frozenset({frozenset({0, 1}), frozenset({2, 3})})
    assert rank_groups((2, 2, 2), (0, 1)) == rank_groups((4, 2), (0,))
    assert rank_groups((2, 4), (1,)) == rank_groups((2, 2, 2), (1, 2)) != rank_groups((2, 2, 2), (0, 2))


def test_one_group_of_ranks_gets_one_price_on_every_mesh():
    """The (4,) mesh's axis and the (2, 2) mesh's spanning group are the same 4 ranks: each kind
    fitted on both is priced by the mean of the two fits on both meshes; what only one mesh has
    (its 2-rank axes, a kind fitted on one of them) stays as measured."""
    from dataclasses import replace

    from autopar.layout.cost import collective_seconds
    from autopar.layout.machine import ComputeProfile, LinkFit, MachineProfile, RateTable
    from autopar.planner.mesh_search import on_one_machine

    compute = ComputeProfile((("matmul", "fp32", RateTable((1e6, 1e9), (1e10, 4e10))),))

    def calibrated(shape, links, alpha):
        machine = MachineProfile(compute, links, shape, tuple(f"ax{i}" for i in range(len(shape))))
        return replace(MeshSpec.preset("cpu", shape), machine=machine, alpha=(alpha,) * len(shape),
                       beta=(2e-9,) * len(shape))

    flat = calibrated((4,), (LinkFit("all_reduce", 0, 5e-3, 1.2e-9),), 4e-3)
    square = calibrated((2, 2), (LinkFit("all_reduce", 1, 2.4e-3, 0.9e-9),
                                 LinkFit.over("all_reduce", (0, 1), 3e-3, 1.0e-9),
                                 LinkFit.over("all_gather", (0, 1), 2e-3, 2e-9)), 1e-3)
    a, b = on_one_machine([flat, square])
    for mesh, axes in ((a, (0,)), (b, (0, 1))):
        fit = mesh.machine.link_over("all_reduce", axes)
        assert (fit.alpha, fit.beta) == pytest.approx((4e-3, 1.1e-9))
        # all_gather: the (2, 2) group's own fit and the (4,) axis's all-kind figures, pooled.
        fit = mesh.machine.link_over("all_gather", axes)
        assert (fit.alpha, fit.beta) == pytest.approx((3e-3, 2e-9))
    for nbytes in (4, 1 << 20):
        assert collective_seconds("all_reduce", nbytes, a, (0,), blocking=False) == pytest.approx(
            collective_seconds("all_reduce", nbytes, b, (0, 1), blocking=False))
    assert b.machine.link("all_reduce", 1) == square.machine.link("all_reduce", 1)  # a 2-rank axis: its own
    assert b.machine.link_over("reduce_scatter", (0, 1)) is None  # measured on one mesh only: not pooled
