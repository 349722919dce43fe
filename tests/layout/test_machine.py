"""The measured machine (``layout/machine.py``): rate interpolation, the JSON round trip on
``MeshSpec`` (version 9, older versions still read), and the cost model priced from it."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from autopar.layout.cost import KERNEL_FLOOR_S, collective_seconds, compute_seconds, optimizer_seconds
from autopar.layout.machine import ComputeProfile, LinkFit, MachineProfile, RateTable, overlap_fraction
from autopar.layout.mesh import MeshSpec
from autopar.layout.placement import Replicate, TensorSpec
from autopar.planner.zero_pricing import zero_cost
from autopar.plans import stage_mesh_of


def _profile(shape=(2, 2)) -> MachineProfile:
    compute = ComputeProfile((
        ("matmul", "fp32", RateTable((1e6, 1e9), (10e9, 40e9))),
        ("matmul", "bf16", RateTable((1e6, 1e9), (5e9, 200e9))),
        ("elementwise", "fp32", RateTable((1e4, 1e7), (50e9, 5e9))),
        ("norm", "fp32", RateTable((1e4,), (3e9,))),
    ))
    links = (LinkFit("all_reduce", 0, 1e-3, 2e-9), LinkFit("all_gather", 1, 5e-4, 4e-9))
    return MachineProfile(compute, links, shape, ("ax0", "ax1")[:len(shape)], note="unit test")


def _mesh(shape=(2, 2), **kw) -> MeshSpec:
    """The cpu preset's mesh carrying a made-up calibration."""
    return replace(MeshSpec.preset("cpu", shape), **{"machine": _profile(shape), "comm_overlap": 0.4, **kw})


# ------------------------------------------------------------------------------ rate tables
def test_rate_table_follows_the_power_law_between_points_and_holds_its_ends():
    table = RateTable((1e3, 1e5, 1e7), (1.0, 3.0, 2.0))
    assert table.at(1e3) == 1.0 and table.at(1e5) == 3.0 and table.at(1e7) == 2.0
    assert table.at(1e4) == pytest.approx(3.0 ** 0.5)  # halfway in log(size): halfway in log(rate)
    assert table.at(1e6) == pytest.approx(6.0 ** 0.5)
    assert table.at(10 ** 3.5) == pytest.approx(3.0 ** 0.25)
    assert table.at(1.0) == 1.0 and table.at(1e12) == 2.0  # beyond the ends: the end rates
    # A flat time between two points (a call's fixed work) stays flat: the rate grows with the size.
    flat = RateTable((1e3, 1e5), (1e3 / 50e-6, 1e5 / 50e-6))
    assert [s / flat.at(s) for s in (1e3, 3e3, 1e4, 4e4, 1e5)] == pytest.approx([50e-6] * 5)
    with pytest.raises(ValueError, match="positive"):
        table.at(0)


def test_rate_table_merges_equal_sizes_and_checks_its_points():
    # A skinny and a square product of the same FLOPs: one point at their geometric mean.
    merged = RateTable.of([(1e6, 8.0), (1e3, 1.0), (1e6, 2.0)])
    assert merged.sizes == (1e3, 1e6) and merged.rates == (1.0, pytest.approx(4.0))
    with pytest.raises(ValueError, match="strictly increasing"):
        RateTable((2.0, 1.0), (1.0, 1.0))
    with pytest.raises(ValueError, match="positive and finite"):
        RateTable((1.0,), (-1.0,))
    with pytest.raises(ValueError, match="as many rates as sizes"):
        RateTable((1.0, 2.0), (1.0,))


def test_compute_profile_lookups_and_checks():
    profile = _profile().compute
    assert profile.rate("matmul", "fp32", 1e6) == 10e9
    assert profile.rate("matmul", "fp16", 1e6) is None  # not measured
    assert profile.rate("attention", "fp32", 1e6) is None
    with pytest.raises(ValueError, match="unknown op class 'gather'"):
        ComputeProfile((("gather", "fp32", RateTable((1.0,), (1.0,))),))
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        ComputeProfile((("matmul", "fp8", RateTable((1.0,), (1.0,))),))
    with pytest.raises(ValueError, match="two tables"):
        ComputeProfile((("norm", "fp32", RateTable((1.0,), (1.0,))),) * 2)
    with pytest.raises(ValueError, match="unknown collective kind 'broadcast'"):
        LinkFit("broadcast", 0, 1e-3, 1e-9)
    assert LinkFit("all_reduce", 0, 0.0, 1e-9).alpha == 0.0  # a fit's latency may come out 0 under load
    with pytest.raises(ValueError, match="alpha must be >= 0 and beta positive"):
        LinkFit("all_reduce", 0, -1e-6, 1e-9)
    with pytest.raises(ValueError, match="alpha must be >= 0 and beta positive"):
        LinkFit("all_reduce", 0, 1e-6, 0.0)


def test_overlap_fraction_is_clamped():
    assert overlap_fraction(1.0, 2.0, 2.0) == 1.0  # the shorter one fully hidden
    assert overlap_fraction(1.0, 2.0, 3.0) == 0.0  # serial
    assert overlap_fraction(1.0, 2.0, 2.5) == pytest.approx(0.5)
    assert overlap_fraction(1.0, 2.0, 4.0) == 0.0 and overlap_fraction(1.0, 2.0, 1.0) == 1.0
    with pytest.raises(ValueError, match="positive times"):
        overlap_fraction(0.0, 1.0, 1.0)


# ------------------------------------------------------------------------------------- JSON
def test_calibrated_mesh_round_trips_as_the_current_version():
    mesh = _mesh()
    data = json.loads(mesh.to_json())
    assert data["version"] == 9 and data["comm_overlap"] == 0.4
    assert data["machine"]["compute"][0] == {"op_class": "matmul", "dtype": "fp32", "sizes": [1e6, 1e9],
                                             "rates": [10e9, 40e9]}
    assert data["machine"]["measured_shape"] == [2, 2]
    back = MeshSpec.from_json(mesh.to_json())
    assert back == mesh and back.machine.link("all_gather", 1).beta == 4e-9
    assert json.loads(MeshSpec.preset("cpu", (2,)).to_json())["machine"] is None


def test_older_versions_still_read_and_cannot_carry_a_machine():
    data = json.loads(_mesh().to_json())
    v3 = {**data, "version": 3, "machine": None}  # comm_overlap may sit in a version 3 file
    assert MeshSpec.from_json(json.dumps(v3)) == _mesh(machine=None)
    del v3["comm_overlap"], v3["machine"]
    assert MeshSpec.from_json(json.dumps(v3)).comm_overlap == 0.0
    with pytest.raises(ValueError, match="version 3 has no machine profile"):
        MeshSpec.from_json(json.dumps({**data, "version": 3}))
    with pytest.raises(ValueError, match="malformed machine profile"):
        MeshSpec.from_json(json.dumps({**data, "machine": {"compute": []}}))
    with pytest.raises(ValueError, match=r"comm_overlap must be a number in \[0, 1\].*got 1.5"):
        _mesh(comm_overlap=1.5)
    with pytest.raises(ValueError, match=r"link fits for axes \[1\] of a 1-D mesh"):
        _mesh(shape=(4,), machine=_profile((2, 2)))


def test_blocking_wait_round_trips_and_a_version_4_profile_reads_as_none():
    mesh = _mesh(machine=replace(_profile(), blocking_s=(4e-4, 0.0)))
    data = json.loads(mesh.to_json())
    assert data["machine"]["blocking_s"] == [4e-4, 0.0] and MeshSpec.from_json(mesh.to_json()) == mesh
    assert hash(mesh.machine) != hash(_profile())  # a mesh is a cache key
    # A version-4 file (written before the blocking stage): none measured, priced as it was.
    v4 = {**json.loads(_mesh().to_json()), "version": 4}
    assert MeshSpec.from_json(json.dumps(v4)).machine.blocking_s == ()
    with pytest.raises(ValueError, match="version 4 has no blocking_s"):
        MeshSpec.from_json(json.dumps({**data, "version": 4}))
    assert mesh.select_axes([1]).machine.blocking_s == (0.0,)  # a sub-mesh keeps its axes' figures
    assert mesh.select_axes([0]).machine.blocking_s == (4e-4,)
    for bad in ((-1e-3,), (math.nan, 0.0), ("1e-3",), (True,)):
        with pytest.raises(ValueError, match="blocking_s needs one finite number of seconds >= 0"):
            replace(_profile(), blocking_s=bad)


def test_a_blocking_collective_pays_its_axes_wait_an_asynchronous_one_does_not():
    base = _mesh()
    mesh = _mesh(machine=replace(_profile(), blocking_s=(4e-4, 1e-4)))
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        plain = collective_seconds(kind, 1e6, base, 0)
        assert collective_seconds(kind, 1e6, mesh, 0) == pytest.approx(plain + 4e-4)
        assert collective_seconds(kind, 1e6, mesh, 1) == pytest.approx(collective_seconds(kind, 1e6, base, 1) + 1e-4)
        assert collective_seconds(kind, 1e6, mesh, 0, blocking=False) == plain
    # one collective over both axes: one wait, its slowest axis's
    assert collective_seconds("all_reduce", 1e6, mesh, (0, 1)) == pytest.approx(
        collective_seconds("all_reduce", 1e6, base, (0, 1)) + 4e-4)
    # a bucketed one is issued asynchronously: no wait, whatever ``blocking`` says
    assert collective_seconds("all_reduce", 1e6, mesh, 0, bucket_cap=2**20) == \
        collective_seconds("all_reduce", 1e6, base, 0, bucket_cap=2**20)
    assert collective_seconds("split", 1e6, mesh, 0) == collective_seconds("split", 1e6, base, 0)  # a local copy
    # an axis of size 1 never communicates, nor waits; a generator of axes is read once
    flat = _mesh(shape=(1, 2), machine=replace(_profile((1, 2)), links=(), blocking_s=(9e-3, 1e-4)))
    assert collective_seconds("all_reduce", 1e6, flat, iter((0, 1))) == pytest.approx(
        collective_seconds("all_reduce", 1e6, flat, 1, blocking=False) + 1e-4)


def test_idle_speedup_round_trips_and_is_checked():
    mesh = _mesh(machine=replace(_profile(), idle_speedup=2.5))
    data = json.loads(mesh.to_json())
    assert data["machine"]["idle_speedup"] == 2.5 and MeshSpec.from_json(mesh.to_json()) == mesh
    assert "idle_speedup" not in json.loads(_mesh().to_json())["machine"]  # files before it read as 1
    assert MeshSpec.from_json(_mesh().to_json()).machine.idle_speedup == 1.0
    assert hash(mesh.machine) != hash(_profile())  # a mesh is a cache key
    assert stage_mesh_of(mesh).machine.idle_speedup == 2.5  # a pipeline stage's sub-mesh keeps it
    for bad in (0.5, math.inf, True, "2"):
        with pytest.raises(ValueError, match="idle_speedup must be a finite number >= 1"):
            replace(_profile(), idle_speedup=bad)


def test_the_kernel_floor_round_trips_is_checked_and_prices_the_smallest_op():
    from autopar.layout.cost import KERNEL_FLOOR_S, compute_seconds

    mesh = _mesh(machine=replace(_profile(), kernel_floor_s=15e-6))
    assert MeshSpec.from_json(mesh.to_json()) == mesh and hash(mesh.machine) != hash(_profile())
    assert "kernel_floor_s" not in json.loads(_mesh().to_json())["machine"]  # older files: the default
    # A one-byte add costs the measured floor, not the default's 2 us; a large one its rate.
    assert compute_seconds(0, 8, mesh, op_class="elementwise") == pytest.approx(15e-6)
    assert compute_seconds(0, 8, _mesh(), op_class="elementwise") == pytest.approx(KERNEL_FLOOR_S)
    big = compute_seconds(0, 1e9, mesh, op_class="elementwise")
    assert big == compute_seconds(0, 1e9, _mesh(), op_class="elementwise") > 15e-6
    for bad in (0.0, -1e-6, math.inf, 2.0, "1e-6"):
        with pytest.raises(ValueError, match="kernel_floor_s must be a positive number"):
            replace(_profile(), kernel_floor_s=bad)


def test_the_pipeline_action_round_trips_is_checked_and_defaults_to_the_presets():
    from autopar.layout.cost import pipeline_action_seconds
    from autopar.layout.mesh import PRESETS

    mesh = _mesh(machine=replace(_profile(), pipeline_action_s=1.2e-3))
    data = json.loads(mesh.to_json())
    assert data["machine"]["pipeline_action_s"] == 1.2e-3 and MeshSpec.from_json(mesh.to_json()) == mesh
    assert hash(mesh.machine) != hash(_profile())  # a mesh is a cache key
    assert stage_mesh_of(mesh).machine.pipeline_action_s == 1.2e-3  # a stage's sub-mesh keeps it
    assert pipeline_action_seconds(mesh) == 1.2e-3
    # 0 is a measurement (the transfers' price covered the whole action), not "unmeasured"
    zero = _mesh(machine=replace(_profile(), pipeline_action_s=0))
    assert pipeline_action_seconds(zero) == 0.0 and MeshSpec.from_json(zero.to_json()) == zero
    # Not measured: absent from the file, the preset's default (a profiled CPU's: the cpu preset's).
    assert "pipeline_action_s" not in json.loads(_mesh().to_json())["machine"]
    cpu = PRESETS["cpu"].pipeline_action_s
    assert pipeline_action_seconds(_mesh()) == cpu and pipeline_action_seconds(MeshSpec.preset("cpu", (2,))) == cpu
    assert pipeline_action_seconds(replace(_mesh(), name="profiled-cpu (refit)")) == cpu
    gpu = pipeline_action_seconds(MeshSpec.preset("h100-80gb", (8,)))
    assert gpu == PRESETS["a100-80gb"].pipeline_action_s == pipeline_action_seconds(replace(_mesh(), name="custom"))
    assert 1e-6 < gpu < 1e-4 < cpu < 1e-2  # a GPU's tens of microseconds, gloo's milliseconds
    # A version-5 file (written before it): none measured; a version-5 file cannot carry one.
    v5 = {**json.loads(_mesh().to_json()), "version": 5}
    assert MeshSpec.from_json(json.dumps(v5)).machine.pipeline_action_s is None
    with pytest.raises(ValueError, match="version 5 has no pipeline_action_s"):
        MeshSpec.from_json(json.dumps({**data, "version": 5}))
    for bad in (-1e-3, math.nan, math.inf, 1.5, "1e-3", True):
        with pytest.raises(ValueError, match=r"pipeline_action_s must be a finite number of seconds in \[0, 1\)"):
            replace(_profile(), pipeline_action_s=bad)


def test_a_pipeline_transfers_measured_latency_round_trips_and_prices_it_else_the_axis_alpha():
    from autopar.layout.cost import pipeline_transfer_seconds

    plain = _mesh()
    assert pipeline_transfer_seconds(plain, 1000) == pytest.approx(plain.alpha[0] + plain.beta[0] * 1000)
    assert "pipeline_transfer_s" not in json.loads(plain.to_json())["machine"]
    mesh = _mesh(machine=replace(_profile(), pipeline_transfer_s=0.4e-3))
    assert pipeline_transfer_seconds(mesh, 1000) == pytest.approx(0.4e-3 + mesh.beta[0] * 1000)
    data = json.loads(mesh.to_json())
    assert data["version"] == 9 and data["machine"]["pipeline_transfer_s"] == 0.4e-3
    assert MeshSpec.from_json(mesh.to_json()) == mesh and hash(mesh.machine) != hash(_profile())
    assert stage_mesh_of(mesh).machine.pipeline_transfer_s == 0.4e-3  # a stage's sub-mesh keeps it
    zero = _mesh(machine=replace(_profile(), pipeline_transfer_s=0))
    assert pipeline_transfer_seconds(zero, 0) == 0.0 and MeshSpec.from_json(zero.to_json()) == zero
    # A version-7 file has none (the alpha prices it, as it did) and cannot carry one.
    assert MeshSpec.from_json(json.dumps({**json.loads(plain.to_json()), "version": 7})) == plain
    with pytest.raises(ValueError, match="version 7 has no pipeline_transfer_s"):
        MeshSpec.from_json(json.dumps({**data, "version": 7}))
    for bad in (-1e-3, math.nan, math.inf, 1.5, "1e-3", True):
        with pytest.raises(ValueError, match=r"pipeline_transfer_s must be a finite number of seconds in \[0, 1\)"):
            replace(_profile(), pipeline_transfer_s=bad)


def test_pointwise_factors_round_trip_are_checked_and_scale_only_their_elementwise_op():
    mesh = _mesh(machine=replace(_profile(), pointwise=(("tanh", 16.0, 1.5), ("exp", 6.0, 1.2))))
    data = json.loads(mesh.to_json())
    assert data["version"] == 9 and data["machine"]["pointwise"] == {"tanh": [16.0, 1.5], "exp": [6.0, 1.2]}
    assert MeshSpec.from_json(mesh.to_json()) == mesh and hash(mesh.machine) != hash(_profile())
    assert stage_mesh_of(mesh).machine.pointwise == mesh.machine.pointwise  # a stage's sub-mesh keeps them
    nbytes = 10 ** 5.5
    add = compute_seconds(0, nbytes, mesh, op_class="elementwise", op="add")
    assert add == compute_seconds(0, nbytes, mesh, op_class="elementwise")  # not measured: factor 1
    assert compute_seconds(0, nbytes, mesh, op_class="elementwise", op="tanh") == pytest.approx(16 * add)
    assert compute_seconds(0, nbytes, mesh, op_class="elementwise", op="tanh", backward=True) == pytest.approx(
        1.5 * add)
    # Another class of the same name is not an elementwise kernel; a preset has no factors.
    assert compute_seconds(0, 1e6, mesh, op_class="norm", op="tanh") == compute_seconds(0, 1e6, mesh, op_class="norm")
    preset = MeshSpec.preset("cpu", (2, 2))
    assert compute_seconds(0, 1e6, preset, op_class="elementwise", op="tanh") == compute_seconds(0, 1e6, preset)
    # A version-8 file has none (every pointwise op at the add rate, as it was) and cannot carry them.
    plain = _mesh()
    assert MeshSpec.from_json(json.dumps({**json.loads(plain.to_json()), "version": 8})) == plain
    with pytest.raises(ValueError, match="version 8 has no pointwise factors"):
        MeshSpec.from_json(json.dumps({**data, "version": 8}))
    for bad in ((("tanh", 0.0, 1.0),), (("tanh", 1.0),), ((3, 1.0, 1.0),), (("tanh", 2.0, 1.0), ("tanh", 3.0, 1.0))):
        with pytest.raises(ValueError, match="MachineProfile.pointwise"):
            replace(_profile(), pointwise=bad)


def test_a_pipeline_stage_mesh_keeps_the_fits_of_its_axes():
    stage = stage_mesh_of(_mesh())  # drops axis 0: axis 1's all-gather fit becomes axis 0's
    assert stage.shape == (2,) and stage.machine.links == (LinkFit("all_gather", 0, 5e-4, 4e-9),)
    assert stage.machine.compute == _profile().compute and stage.machine.measured_shape == (2, 2)


# ------------------------------------------------------------------------------- cost model
def test_compute_is_priced_at_the_measured_rate_of_its_class_size_and_dtype():
    mesh, preset = _mesh(), MeshSpec.preset("cpu", (2, 2))
    flops, nbytes = 1e9, 1e3
    assert compute_seconds(flops, nbytes, mesh, op_class="matmul") == pytest.approx(flops / 40e9)
    assert compute_seconds(1e6, 0, mesh, op_class="matmul") == pytest.approx(1e6 / 10e9)
    # bf16 (itemsize 2) has its own table; fp16 was not measured: the roofline's half peak.
    assert compute_seconds(flops, 0, mesh, itemsize=2, op_class="matmul") == pytest.approx(flops / 200e9)
    assert compute_seconds(flops, 0, mesh, itemsize=2, op_class="matmul", dtype="fp16") == pytest.approx(
        flops / mesh.half_peak_flops)
    # Memory-bound classes: bytes over the measured bandwidth at that size (10^5.5 B: halfway in
    # log size, the rates' geometric mean).
    mid = 10 ** 5.5
    assert compute_seconds(0, mid, mesh, op_class="elementwise") == pytest.approx(mid / (50e9 * 5e9) ** 0.5)
    assert compute_seconds(10.0, 1e6, mesh, op_class="norm") == pytest.approx(1e6 / 3e9)
    # Other ops and uncalibrated meshes: the roofline, exactly as before.
    for m in (mesh, preset):
        roofline = max(flops / m.peak_flops, nbytes / m.mem_bandwidth)
        assert compute_seconds(flops, nbytes, m, op_class="other") == roofline
    assert compute_seconds(flops, nbytes, preset, op_class="matmul") == compute_seconds(flops, nbytes, preset)
    assert compute_seconds(1.0, 1.0, mesh, op_class="matmul") == KERNEL_FLOOR_S
    with pytest.raises(ValueError, match="unknown op class 'gemm'"):
        compute_seconds(1.0, 1.0, mesh, op_class="gemm")


def test_a_profile_without_the_newer_classes_prices_them_by_the_roofline():
    # A version-4 file written before conv, pool and the optimizer step were measured.
    mesh = MeshSpec.from_json(_mesh().to_json())
    flops, nbytes = 1e9, 1e6
    roofline = max(flops / mesh.peak_flops, nbytes / mesh.mem_bandwidth)
    for op_class in ("conv", "pool"):
        for backward in (False, True):
            assert compute_seconds(flops, nbytes, mesh, op_class=op_class, backward=backward) == roofline
    assert optimizer_seconds(1e6, mesh, optimizer_multiplier=2.0) == 0.0


def test_the_optimizer_step_is_priced_per_parameter_byte_where_it_was_measured():
    table = ("optimizer", "fp32", RateTable((1e3, 1e6), (1e7, 1e9)))
    machine = replace(_profile(), compute=ComputeProfile(_profile().compute.tables + (table,)))
    mesh = _mesh(machine=machine)
    assert optimizer_seconds(1e6, mesh, optimizer_multiplier=2.0) == pytest.approx(1e6 / 1e9)
    assert optimizer_seconds(1e3, mesh, optimizer_multiplier=2.0) == pytest.approx(1e3 / 1e7)
    # Below the smallest parameter measured, its time: a foreach step's per-tensor work is flat
    # there, so a ZeRO shard of a small parameter steps no faster than the whole one.
    assert optimizer_seconds(250, mesh, optimizer_multiplier=2.0) == pytest.approx(1e3 / 1e7)
    # The table is Adam's (m = 2, 7 bytes moved per parameter byte); SGD with momentum (m = 1) moves 5.
    assert optimizer_seconds(1e6, mesh, optimizer_multiplier=1.0) == pytest.approx(5 / 7 * 1e6 / 1e9)
    assert optimizer_seconds(0, mesh, optimizer_multiplier=2.0) == 0.0
    assert optimizer_seconds(1e6, MeshSpec.preset("cpu", (2, 2)), optimizer_multiplier=2.0) == 0.0
    with pytest.raises(ValueError, match="parameter bytes must be >= 0"):
        optimizer_seconds(-1, mesh, optimizer_multiplier=2.0)
    # A ZeRO rank steps its 1/dp of a replicated parameter; a frozen parameter is not stepped.
    spec = TensorSpec((Replicate(), Replicate()))
    local = 4 * 2**20
    assert zero_cost(spec, mesh, local, stage=0, ndim=2, optimizer_multiplier=2.0)[3] == pytest.approx(local / 1e9)
    assert zero_cost(spec, mesh, local, stage=1, ndim=2, optimizer_multiplier=2.0)[3] == pytest.approx(
        optimizer_seconds(local / 4, mesh, optimizer_multiplier=2.0))
    assert zero_cost(spec, mesh, local, stage=2, ndim=2, optimizer_multiplier=2.0, trainable=False)[2:] == (0, 0.0)


def test_collectives_use_the_per_kind_fit_where_there_is_one():
    mesh, nbytes = _mesh(), 1 << 20
    assert collective_seconds("all_reduce", nbytes, mesh, 0) == pytest.approx(1e-3 + 2e-9 * nbytes)
    assert collective_seconds("all_gather", nbytes, mesh, 1) == pytest.approx(5e-4 + 4e-9 * nbytes / 2)
    # No fit of its own on that axis: the axis's all-kind alpha/beta (the preset's here).
    assert collective_seconds("all_gather", nbytes, mesh, 0) == pytest.approx(
        mesh.alpha[0] + mesh.beta[0] * nbytes / 2)
    # Over both axes: the slowest link of the group, per kind.
    assert collective_seconds("all_reduce", nbytes, mesh, (0, 1)) == pytest.approx(
        max(1e-3, mesh.alpha[1]) + max(2e-9, mesh.beta[1]) * nbytes * 2 * 3 / 4)
    assert math.isclose(collective_seconds("split", nbytes, mesh, 0), 2 * nbytes / 2 / mesh.mem_bandwidth)


# ------------------------------------------------------------------- fits over several axes
def _spanning(shape=(2, 2), *, alpha=3.6e-3, beta=1.04e-9, axes=(0, 1)) -> MeshSpec:
    """``_mesh`` whose profile also has an all-reduce fitted on the group spanning ``axes``."""
    machine = _profile(shape[:2])
    machine = replace(machine, links=machine.links + (LinkFit.over("all_reduce", axes, alpha, beta),),
                      measured_shape=shape, measured_axis_names=("ax0", "ax1", "ax2")[:len(shape)])
    return _mesh(shape, machine=machine)


def test_a_collective_over_several_axes_is_priced_by_the_fit_of_exactly_that_group():
    mesh, nbytes = _spanning(), 1 << 20
    assert mesh.machine.link_over("all_reduce", (1, 0)).axes == (0, 1)
    assert mesh.machine.link("all_reduce", 0).alpha == 1e-3  # the one-axis fit is still its axis's
    four = 3.6e-3 + 1.04e-9 * nbytes * 2 * 3 / 4
    assert collective_seconds("all_reduce", nbytes, mesh, (0, 1), blocking=False) == pytest.approx(four)
    assert collective_seconds("all_reduce", nbytes, mesh, (1, 0), blocking=False) == pytest.approx(four)
    # The same 4 ranks doing the same collective cost the same whichever mesh names them.
    line = _mesh((4,), machine=MachineProfile(_profile().compute, (LinkFit("all_reduce", 0, 3.6e-3, 1.04e-9),),
                                              (4,), ("ax0",)))
    assert collective_seconds("all_reduce", nbytes, line, 0, blocking=False) == pytest.approx(four)
    # A bucket member pays its share of the group's latency.
    assert collective_seconds("all_reduce", nbytes, mesh, (0, 1), bucket_cap=4 << 20) == pytest.approx(
        3.6e-3 / 4 + 1.04e-9 * nbytes * 2 * 3 / 4)
    # A kind not fitted on the group: the slowest of its axes' links (the fallback, as before).
    assert collective_seconds("all_gather", nbytes, mesh, (0, 1)) == pytest.approx(
        max(mesh.alpha[0], 5e-4) + max(mesh.beta[0], 4e-9) * nbytes * 3 / 4)
    # One axis alone is that axis's fit, never the group's.
    assert collective_seconds("all_reduce", nbytes, mesh, 0) == pytest.approx(1e-3 + 2e-9 * nbytes)


def test_axes_of_size_one_add_no_rank_to_the_group_and_a_bigger_group_has_its_own_fit():
    nbytes = 1 << 20
    flat = _spanning((2, 2, 1))
    assert collective_seconds("all_reduce", nbytes, flat, (0, 1, 2), blocking=False) == \
        collective_seconds("all_reduce", nbytes, flat, (0, 1), blocking=False) == \
        pytest.approx(3.6e-3 + 1.04e-9 * nbytes * 2 * 3 / 4)
    # The (0, 1) group's fit does not price the 8 ranks of (0, 1, 2) nor the (0, 2) group.
    cube = _spanning((2, 2, 2))
    fallback = _mesh((2, 2, 2), machine=replace(cube.machine, links=_profile().links))
    for axes in ((0, 1, 2), (0, 2)):
        assert collective_seconds("all_reduce", nbytes, cube, axes) == \
            collective_seconds("all_reduce", nbytes, fallback, axes)


def test_a_blocking_collective_over_several_axes_adds_its_slowest_axis_wait_to_the_group_fit():
    mesh = _spanning()
    mesh = replace(mesh, machine=replace(mesh.machine, blocking_s=(4e-4, 1e-4)))
    assert collective_seconds("all_reduce", 1e6, mesh, (0, 1)) == pytest.approx(
        collective_seconds("all_reduce", 1e6, mesh, (0, 1), blocking=False) + 4e-4)


def test_a_blocking_sum_over_several_axes_pays_the_wait_measured_on_exactly_them():
    # Measured on the runtime's chain of per-axis all-reduces: 2.5 ms beyond the group's lockstep price.
    mesh = _spanning((2, 2, 2))
    mesh = replace(mesh, machine=replace(mesh.machine, blocking_s=(4e-4, 1e-4, 2e-4),
                                         blocking_over=(((0, 1), 2.5e-3),)))
    lockstep = collective_seconds("all_reduce", 1e6, mesh, (0, 1), blocking=False)
    assert collective_seconds("all_reduce", 1e6, mesh, (1, 0)) == pytest.approx(lockstep + 2.5e-3)
    assert mesh.machine.blocking_of((0, 1)) == 2.5e-3
    # A set not measured, or one axis: the largest of its axes' own waits, as before.
    assert mesh.machine.blocking_of((1, 2)) == 2e-4 and mesh.machine.blocking_of((0,)) == 4e-4
    assert collective_seconds("all_reduce", 1e6, mesh, (0, 1, 2)) == pytest.approx(
        collective_seconds("all_reduce", 1e6, mesh, (0, 1, 2), blocking=False) + 4e-4)
    # Bucketed or asynchronous sums wait for nothing; an axis of size 1 adds no rank to the set.
    assert collective_seconds("all_reduce", 1e6, mesh, (0, 1), bucket_cap=1 << 20) == \
        collective_seconds("all_reduce", 1e6, mesh, (0, 1), bucket_cap=1 << 20, blocking=False)
    flat = replace(_spanning((2, 2, 1)), machine=replace(mesh.machine, measured_shape=(2, 2, 1)))
    assert collective_seconds("all_reduce", 1e6, flat, (0, 1, 2)) == pytest.approx(
        collective_seconds("all_reduce", 1e6, flat, (0, 1), blocking=False) + 2.5e-3)
    # JSON, the sub-mesh of its axes (reordered), and the checks.
    assert MeshSpec.from_json(mesh.to_json()) == mesh and hash(mesh.machine) != hash(_spanning((2, 2, 2)).machine)
    assert json.loads(mesh.to_json())["machine"]["blocking_over"] == [{"axes": [0, 1], "seconds": 2.5e-3}]
    assert mesh.select_axes([1, 0]).machine.blocking_over == (((0, 1), 2.5e-3),)
    assert mesh.select_axes([0, 2]).machine.blocking_over == ()
    v6 = {**json.loads(_mesh().to_json()), "version": 6}
    v6["machine"]["blocking_over"] = [{"axes": [0, 1], "seconds": 1e-3}]
    with pytest.raises(ValueError, match="version 6 has no link fits over several axes or blocking_over"):
        MeshSpec.from_json(json.dumps(v6))
    for bad in ((((0,), 1e-3),), (((1, 0), 1e-3),), (((0, 1), -1e-3),), (((0, 1), "1"),), ((0, 1),),
                (((0, 1), 1e-3), ((0, 1), 2e-3))):
        with pytest.raises(ValueError, match="blocking_over"):
            replace(_profile(), blocking_over=bad)


def test_fits_over_several_axes_round_trip_and_a_version_6_profile_prices_as_before():
    mesh = _spanning()
    data = json.loads(mesh.to_json())
    assert data["machine"]["links"][-1] == {"kind": "all_reduce", "axis": 0, "alpha": 3.6e-3, "beta": 1.04e-9,
                                            "axes": [0, 1]}
    # A one-axis fit's record is the version-6 one: files written before read unchanged.
    assert data["machine"]["links"][0] == {"kind": "all_reduce", "axis": 0, "alpha": 1e-3, "beta": 2e-9}
    assert MeshSpec.from_json(mesh.to_json()) == mesh and hash(mesh.machine) != hash(_profile())
    # A version-6 file as it was written (per-axis fits only): read, and priced by the old rule.
    v6 = {**json.loads(_mesh().to_json()), "version": 6}
    old = MeshSpec.from_json(json.dumps(v6))
    assert old == _mesh() and all(f.axes == (f.axis,) for f in old.machine.links)
    assert collective_seconds("all_reduce", 1e6, old, (0, 1)) == pytest.approx(
        max(1e-3, old.alpha[1]) + max(2e-9, old.beta[1]) * 1e6 * 2 * 3 / 4)
    with pytest.raises(ValueError, match="version 6 has no link fits over several axes"):
        MeshSpec.from_json(json.dumps({**data, "version": 6}))
    bad = json.loads(mesh.to_json())
    bad["machine"]["links"][0]["group"] = [0, 1]
    with pytest.raises(ValueError, match="malformed machine profile.*unexpected link fit fields"):
        MeshSpec.from_json(json.dumps(bad))
    with pytest.raises(ValueError, match=r"link fits for axes \[2\] of a 2-D mesh"):
        _mesh(machine=replace(_profile(), links=(LinkFit.over("all_reduce", (0, 2), 1e-3, 1e-9),)))


def test_a_fit_over_several_axes_is_checked_and_kept_by_a_sub_mesh_holding_all_of_them():
    assert LinkFit.over("all_gather", (1, 0), 1e-3, 1e-9) == LinkFit("all_gather", 0, 1e-3, 1e-9, (0, 1))
    for bad in ((1, 0), (0, 0), (1, 2), (0, -1)):
        with pytest.raises(ValueError, match="LinkFit axes must be increasing mesh axis indices"):
            LinkFit("all_reduce", 0, 1e-3, 1e-9, bad)
    with pytest.raises(ValueError, match="two link fits for one"):
        replace(_profile(), links=(LinkFit.over("all_reduce", (0, 1), 1e-3, 1e-9),) * 2)
    cube = _spanning((2, 2, 2), axes=(0, 2))
    kept = cube.select_axes([2, 0]).machine  # reordered: the same two groups of ranks
    assert kept.link_over("all_reduce", (0, 1)) == LinkFit.over("all_reduce", (0, 1), 3.6e-3, 1.04e-9)
    assert cube.select_axes([0, 1]).machine.link_over("all_reduce", (0, 1)) is None  # axis 2 dropped
    assert stage_mesh_of(_spanning()).machine.links == (LinkFit("all_gather", 0, 5e-4, 4e-9),)


# ------------------------------------------------------------------------ profile as preset
def test_a_profile_path_is_a_preset_for_its_own_shape_only(tmp_path):
    path = tmp_path / "machine.json"
    _mesh().save(str(path))
    assert MeshSpec.coerce((2, 2), preset=str(path)) == _mesh()
    assert MeshSpec.coerce("2x2", preset=str(path)).machine == _profile()
    assert MeshSpec.coerce(str(path)) == _mesh()  # the path as the mesh: its own shape
    with pytest.raises(ValueError, match=r"measured on mesh \(2, 2\), not the 4 mesh.*autopar calibrate --mesh 4"):
        MeshSpec.coerce((4,), preset=str(path))
    missing = str(tmp_path / "nope.json")
    with pytest.raises(ValueError, match=r"mesh profile '.*nope.json' not found.*autopar calibrate"):
        MeshSpec.coerce((2, 2), preset=missing)
