"""``autopar.calibrate`` on real gloo ranks: the lockstep median rule, a quick 2-rank calibration
that writes a profile of every op class and dtype, and that profile taken as a preset by
``plan`` and ``autoparallelize`` (whose module still trains like the all-replicated one)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import autopar
from autopar.layout.machine import BACKWARD_CLASSES, COMPUTE_BOUND, DTYPES, MEMORY_BOUND, OPTIMIZER, POINTWISE_MEASURED
from autopar.layout.mesh import MeshSpec
from autopar.planner.options import PlanOptions
from autopar.runtime.calibrate import _fit_links, calibrate, calibrate_detailed, shares_cores, spanned_axis_sets
from autopar.runtime.calibrate_compute import QUICK_GRID
from autopar.runtime.launch import run_local
from autopar.runtime.links import KINDS, Timing, fit_alpha_beta, ring_factor, slowest_medians


def _slowest(rank, world):
    mine = {0: [1.0, 10.0, 3.0], 1: [2.0, 0.5, 5.0]}[rank]
    return slowest_medians([mine, [float(rank)] * 3], torch.device("cpu"))


def test_a_figure_is_the_median_of_the_slowest_rank_per_repetition():
    # Per repetition the slowest rank: [2, 10, 5] -> 5. (The median per rank, then the slowest
    # rank, would say 3; a best-of, 0.5 or 1.)
    assert run_local(_slowest, 2, timeout=120) == [[5.0, 1.0]] * 2


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("calibrate") / "machine.json")
    detailed = calibrate_detailed((2,), local=2, quick=True)
    detailed.mesh.save(path)
    return detailed, path


def test_quick_calibration_measures_every_class_and_dtype(calibrated):
    detailed, path = calibrated
    spec = detailed.mesh
    assert MeshSpec.load(path) == spec and spec.shape == (2,) and spec.name == "profiled-cpu"
    machine = spec.machine
    assert machine.measured_shape == (2,) and "quick calibration" in machine.note
    sizes = {"matmul": 3 * len(QUICK_GRID.linear) + len(QUICK_GRID.mm) + len(QUICK_GRID.bmm),
             "attention": len(QUICK_GRID.attention),
             "conv": len(QUICK_GRID.conv), "conv_backward": len(QUICK_GRID.conv),
             "elementwise": len(QUICK_GRID.elementwise), "norm": len(QUICK_GRID.norm_rows),
             "pool": len(QUICK_GRID.pool), "pool_backward": len(QUICK_GRID.pool),
             "batch_norm": len(QUICK_GRID.batch_norm), "batch_norm_backward": len(QUICK_GRID.batch_norm)}
    for op_class in COMPUTE_BOUND + MEMORY_BOUND + tuple(BACKWARD_CLASSES.values()):
        for dtype in DTYPES:
            table = machine.compute.table(op_class, dtype)
            assert table is not None, (op_class, dtype)
            assert 1 <= len(table.sizes) <= sizes[op_class] and all(r > 0 for r in table.rates)
    # The optimizer step is measured in fp32 (it updates fp32 masters), one size per grid point.
    steps = machine.compute.table(OPTIMIZER, "fp32")
    assert steps.sizes == tuple(4.0 * n for n in QUICK_GRID.optimizer)
    assert machine.compute.table(OPTIMIZER, "bf16") is None
    # The roofline's figures are the tables' steady states.
    assert spec.peak_flops == machine.compute.table("matmul", "fp32").rates[-1]
    assert spec.half_peak_flops == machine.compute.table("matmul", "bf16").rates[-1]
    assert spec.mem_bandwidth == machine.compute.table("elementwise", "fp32").rates[-1]
    assert 0.0 <= spec.comm_overlap <= 1.0
    # half of 2 ranks computing while the other waits; measured only where they share cores (the
    # forked ranks run one thread each)
    if shares_cores([("h", "cpu", 1, len(os.sched_getaffinity(0)))] * 2):
        assert 1.0 <= machine.idle_speedup <= 2.0
    else:
        assert machine.idle_speedup == 1.0
    assert 1e-7 < machine.kernel_floor_s < 1e-3  # a CPU dispatches a small op in microseconds
    # Each math function's kernels over add's time per byte, forward and backward, at least 1;
    # tanh's forward computes more than it moves: 9.5-12.3x add's (cold) time per byte in full
    # calibrations on this project's 2-core host, 1.8x in a quick one beside the other test shard
    assert [op for op, _, _ in machine.pointwise] == list(POINTWISE_MEASURED)
    assert all(1 <= f < 1e3 and 1 <= b < 1e3 for _, f, b in machine.pointwise)
    assert machine.pointwise_factor("tanh") > 1.0
    # one blocking wait per axis, beyond the lockstep price (0 where a step's blocking all-reduce
    # held it no longer than the fit says); well under a 1 ms burst's worth on 2 gloo ranks
    assert len(machine.blocking_s) == 1 and 0.0 <= machine.blocking_s[0] < 0.05
    # 1F1B over the 2 ranks: each schedule action costs ~1.7 ms beyond its transfer on this host;
    # 0 where the links' fitted alpha (noisy under load) prices the whole micro-batch as transfers
    # (the measurement itself is positive: tests/runtime/test_calibrate_pipeline.py)
    assert machine.pipeline_action_s is not None and 0.0 <= machine.pipeline_action_s < 0.05
    # a transfer's own latency only where the fit priced the micro-batch's transfers above it,
    # and then below the fit's alpha with no action overhead left
    transfer = machine.pipeline_transfer_s
    assert transfer is None or (0.0 <= transfer <= spec.alpha[0] and machine.pipeline_action_s == 0.0)
    assert spec.alpha[0] > 0 and spec.beta[0] > 0
    # Each kind has its own fit exactly when its timings determine one.
    for kind in KINDS:
        points = [(t.nbytes * ring_factor(kind, 2), t.seconds) for t in detailed.timings if t.kind == kind]
        fit = machine.link(kind, 0)
        try:
            expected = fit_alpha_beta(points)
        except ValueError:
            assert fit is None
        else:
            assert (fit.alpha, fit.beta) == pytest.approx(expected)


def test_every_set_of_several_wide_axes_is_a_group_to_calibrate():
    # (A 2x2 calibration on 4 ranks: tests/runtime/test_mesh_profile.py, full sweep.)
    assert spanned_axis_sets((4,)) == [] and spanned_axis_sets((2, 1)) == []
    assert spanned_axis_sets((2, 2)) == [(0, 1)] and spanned_axis_sets((2, 1, 2)) == [(0, 2)]
    assert spanned_axis_sets((2, 2, 2)) == [(0, 1), (0, 2), (1, 2), (0, 1, 2)]


def test_a_group_of_several_axes_gets_a_fit_per_kind_its_own_where_its_timings_grow():
    # Model timings of a 4-rank group: every kind grows with size but all-to-all, which is flat.
    sizes, alpha, beta = (64 * 1024, 1 << 20, 4 << 20), 3e-3, 1e-9
    timings = [Timing(0, k, s, 2e-3 if k == "all_to_all" else alpha + beta * s * ring_factor(k, 4), (0, 1))
               for k in KINDS for s in sizes]
    assert str(timings[0]).startswith("axes01 all_reduce")
    _, _, fits = _fit_links((0, 1), 4, timings, lambda line: None)
    by_kind = {f.kind: f for f in fits}
    assert set(by_kind) == set(KINDS) and all(f.axes == (0, 1) for f in fits)
    assert (by_kind["all_reduce"].alpha, by_kind["all_reduce"].beta) == pytest.approx((alpha, beta), rel=1e-3)
    # Flat all-to-all: no fit of its own; no mesh field holds a group's figures, so its all-kind fit is recorded.
    group = fit_alpha_beta([(t.nbytes * ring_factor(t.kind, 4), t.seconds) for t in timings])
    assert (by_kind["all_to_all"].alpha, by_kind["all_to_all"].beta) == pytest.approx(group)
    # On one axis the same flat kind gets none (the axis's all-kind alpha/beta price it).
    one = [Timing(0, t.kind, t.nbytes, t.seconds) for t in timings]
    assert "all_to_all" not in {f.kind for f in _fit_links((0,), 4, one, lambda line: None)[2]}


class _Regression(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))

    def forward(self, x, y):
        return nn.functional.mse_loss(self.net(x), y)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return _Regression()


def test_plan_takes_the_profile_as_a_preset_for_its_shape_only(calibrated):
    _, path = calibrated
    inputs = (torch.randn(8, 32), torch.randn(8, 16))
    plan = autopar.plan(_mlp(), inputs, mesh=(2,), preset=path, cache=False)
    assert plan.mesh == MeshSpec.load(path) and plan.mesh.machine is not None
    preset = autopar.plan(_mlp(), inputs, mesh=(2,), preset="cpu", cache=False)
    assert preset.mesh.machine is None and plan.estimate != preset.estimate
    with pytest.raises(ValueError, match=r"measured on mesh \(2,\), not the 2x2 mesh.*autopar calibrate --mesh 2x2"):
        autopar.plan(_mlp(), inputs, mesh=(2, 2), preset=path, cache=False)
    missing = os.path.join(os.path.dirname(path), "absent.json")
    with pytest.raises(ValueError, match=r"preset: mesh profile '.*absent.json' not found"):
        autopar.plan(_mlp(), inputs, mesh=(2,), preset=missing, cache=False)
    with pytest.raises(ValueError, match="absent.json' not found"):
        PlanOptions(preset=missing)


def test_the_plugin_takes_the_profile_as_its_mesh(calibrated):
    from autopar.booster import AutoParallelPlugin

    _, path = calibrated
    assert AutoParallelPlugin(mesh=path).mesh == MeshSpec.load(path)
    with pytest.raises(ValueError, match="absent.json' not found"):
        AutoParallelPlugin(mesh=os.path.join(os.path.dirname(path), "absent.json"))


def _autoparallelized(rank, world, path):
    meta = (torch.empty(8, 32, device="meta"), torch.empty(8, 16, device="meta"))
    module = autopar.autoparallelize(_mlp(), meta, mesh=(2,), preset=path, verify=True)
    assert module.plan.mesh == MeshSpec.load(path)
    torch.manual_seed(1)
    return str(autopar.verify(module, (torch.randn(8, 32), torch.randn(8, 16))))


def test_autoparallelize_plans_on_the_profile_and_trains_like_one_device(calibrated):
    _, path = calibrated
    reports = run_local(_autoparallelized, 2, path, timeout=240)
    assert all(r.startswith("verified: loss") for r in reports), reports


def test_calibrate_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"local=3.*\(2, 2\)"):
        autopar.calibrate((2, 2), local=3)
    with pytest.raises(ValueError, match="repeats must be a positive int, got 0"):
        calibrate((2,), local=2, repeats=0)
    with pytest.raises(ValueError, match="quick must be a bool, got 'yes'"):
        calibrate((2,), local=2, quick="yes")
    with pytest.raises(ValueError, match="device 'cpu' or 'cuda', got 'mps'"):
        calibrate((2,), device="mps", local=2)
    env = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE") if k in os.environ}
    try:
        with pytest.raises(ValueError, match="torchrun"):
            calibrate((2,))
    finally:
        os.environ.update(env)


def test_a_repetition_holds_each_output_until_it_ends_as_a_step_does(monkeypatch):
    # Each call must not write into the block the previous call just freed (a forward keeps
    # what it computes): the outputs live until the repetition ends, or until HOLD_BYTES of them
    # are held.
    import weakref

    from autopar.runtime import calibrate_compute

    made: list = []
    live_at_call: list[int] = []

    def run():
        live_at_call.append(sum(r() is not None for r in made))
        out = torch.empty(1024)  # 4 KiB
        made.append(weakref.ref(out))
        return (out,)  # a gradient's tuple counts too

    calibrate_compute._repeated(run, 5)()
    assert live_at_call == [0, 1, 2, 3, 4] and all(r() is None for r in made)
    made.clear()
    live_at_call.clear()
    monkeypatch.setattr(calibrate_compute, "HOLD_BYTES", 8 << 10)  # two outputs; the third lets them go
    calibrate_compute._repeated(run, 5)()
    assert live_at_call == [0, 1, 2, 0, 1] and all(r() is None for r in made)


def _probed(rank, world):
    import time

    from autopar.runtime.calibrate_compute import Kernel, _inner_counts

    ran: set[float] = set()

    def kernel(size: float, seconds: float, op_class: str = "elementwise") -> Kernel:
        def run():
            ran.add(size)
            time.sleep(seconds)
        return Kernel(op_class, "fp32", size, f"{op_class} {size:g}", run)

    # Smallest first per table: the 1 KB call takes 30 ms, above SLOW_CALLS (10) repetitions of
    # 2 ms, so the 100 KB point is never called. A table's first point is always timed.
    points = [kernel(1e3, 0.03), kernel(1e5, 0.0), kernel(10.0, 0.0), kernel(1e9, 0.0, "norm")]
    kept, counts = _inner_counts(points, torch.device("cpu"), 2e-3)
    return [k.label for k in kept], len(counts), sorted(ran)


def test_the_points_above_a_call_slower_than_slow_calls_repetitions_are_left_out():
    labels, counts, ran = run_local(_probed, 2, timeout=120)[0]
    assert labels == ["elementwise 10", "elementwise 1000", "norm 1e+09"] and counts == 3
    assert ran == [10.0, 1e3, 1e9]  # the left-out point never ran


def test_ranks_share_cores_only_where_their_threads_outnumber_a_hosts_cores_or_they_share_a_device():
    """``idle_speedup`` is measured only where a waiting rank can lend its share to a busy one."""
    assert not shares_cores([("h", "cpu", 1, 2), ("h", "cpu", 1, 2)])  # 2 ranks, 2 cores
    assert shares_cores([("h", "cpu", 1, 2)] * 4)  # 4 ranks on 2 cores
    assert shares_cores([("h", "cpu", 2, 2), ("h", "cpu", 1, 2)])  # threads, not ranks, count
    assert not shares_cores([("a", "cpu", 2, 2), ("b", "cpu", 2, 2)])  # one rank per host
    assert not shares_cores([("h", "cuda:0", 1, 2), ("h", "cuda:1", 1, 2), ("g", "cuda:0", 1, 2)])
    assert shares_cores([("h", "cuda:0", 1, 2), ("h", "cuda:0", 1, 2)])
