"""The CUDA branches of calibration and the benchmarks, checked on the CPU: which device and
backend a run picks, the GPU a rank takes, CUDA-event timing and the allocator's peak. Only
torch.cuda's entry points are mocked (this machine has no GPU); everything else runs as is."""

from __future__ import annotations

import os
import sys
from unittest import mock

import pytest
import torch

from autopar.runtime import calibrate as calibrate_module
from autopar.runtime.links import Stopwatch, default_device, rank_device

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))


def test_the_device_and_backend_come_from_the_environment():
    with mock.patch("torch.cuda.device_count", return_value=1):
        assert default_device() == ("cuda", "nccl")
    with mock.patch("torch.cuda.device_count", return_value=0):
        assert default_device() == ("cpu", "gloo")


def test_asking_for_the_device_leaves_cuda_uninitialised_for_the_forked_ranks():
    # is_available() runs cuInit; a rank forked after it cannot use the GPU.
    with mock.patch("torch.cuda.is_available", side_effect=AssertionError("cuInit before fork")), \
            mock.patch("torch.cuda.device_count", return_value=1):
        assert default_device() == ("cuda", "nccl")


def test_a_rank_takes_the_gpu_its_local_rank_names():
    with mock.patch.dict(os.environ, {"LOCAL_RANK": "3"}), \
            mock.patch("torch.cuda.set_device") as set_device, \
            mock.patch("torch.cuda.current_device", return_value=3):
        assert rank_device("cuda") == torch.device("cuda", 3)
    set_device.assert_called_once_with(3)
    with mock.patch("torch.cuda.set_device") as set_device:
        assert rank_device("cpu") == torch.device("cpu")
    set_device.assert_not_called()


class _Event:
    """torch.cuda.Event as far as the stopwatch uses it: ``record`` stamps a fake GPU clock."""

    clock_ms = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at = None

    def record(self) -> None:
        self.at = _Event.clock_ms

    def elapsed_time(self, end: "_Event") -> float:
        assert self.at is not None and end.at is not None, "elapsed_time of an unrecorded event"
        return end.at - self.at


def test_the_stopwatch_times_a_gpu_by_events_read_after_synchronising():
    device = torch.device("cuda", 1)
    with mock.patch("torch.cuda.Event", _Event), mock.patch("torch.cuda.synchronize") as sync:
        watch = Stopwatch(device)
        _Event.clock_ms = 10.0
        watch.start()
        _Event.clock_ms = 260.0  # the kernels took 250 ms on the GPU, whatever the host did
        assert watch.stop() == pytest.approx(0.25)
    sync.assert_called_once_with(device)
    with pytest.raises(RuntimeError, match=r"stop\(\) before start\(\)"):
        watch.stop()


def test_the_stopwatch_times_the_cpu_by_the_host_clock():
    with mock.patch("torch.cuda.Event") as event, mock.patch("time.perf_counter", side_effect=[5.0, 5.125]):
        watch = Stopwatch("cpu")
        watch.start()
        assert watch.stop() == pytest.approx(0.125)
    event.assert_not_called()


def test_calibration_runs_nccl_on_cuda_where_cuda_is_available():
    seen = {}

    def fake_run_local(fn, world, *args, backend, timeout):
        seen.update(world=world, device_type=args[1], backend=backend)
        return ["profile"] * world

    with mock.patch("torch.cuda.device_count", return_value=1), \
            mock.patch("autopar.runtime.launch.run_local", fake_run_local):
        assert calibrate_module.calibrate_detailed((2,), local=2, quick=True) == "profile"
    assert seen == {"world": 2, "device_type": "cuda", "backend": "nccl"}
    # On CUDA the collective sizes are a GPU's (MiBs up), not the CPU's.
    assert calibrate_module.QUICK_SIZES["cuda"][0] >= 1 << 20
    with mock.patch("torch.cuda.device_count", return_value=0), \
            mock.patch("autopar.runtime.launch.run_local", fake_run_local):
        calibrate_module.calibrate_detailed((2,), local=2, quick=True)
    assert seen["backend"] == "gloo" and seen["device_type"] == "cpu"


def test_the_benchmarks_read_the_cuda_allocators_peak_and_none_on_the_cpu():
    from _measure import PeakAllocated  # benchmarks/_measure.py

    device = torch.device("cuda", 0)
    with mock.patch("torch.cuda.synchronize"), mock.patch("torch.cuda.reset_peak_memory_stats") as reset, \
            mock.patch("torch.cuda.max_memory_allocated", return_value=123 << 20) as peak:
        assert PeakAllocated(device).peak() == 123 << 20
    reset.assert_called_once_with(device)
    peak.assert_called_once_with(device)
    with mock.patch("torch.cuda.max_memory_allocated") as peak:
        assert PeakAllocated(torch.device("cpu")).peak() is None
    peak.assert_not_called()


def test_local_ranks_fork_on_a_cpu_build_and_spawn_on_a_cuda_build():
    from autopar.runtime.launch import start_method

    with mock.patch.dict(os.environ, {}, clear=False):
        os.environ.pop("AUTOPAR_START_METHOD", None)
        with mock.patch("torch.version.cuda", None), mock.patch("torch.version.hip", None):
            assert start_method() == "fork"
        # a CUDA build's parent has started autograd's device threads by its first backward
        with mock.patch("torch.version.cuda", "13.0"):
            assert start_method() == "spawn"
        with mock.patch.dict(os.environ, {"AUTOPAR_START_METHOD": "forkserver"}):
            assert start_method() == "forkserver"
        with mock.patch.dict(os.environ, {"AUTOPAR_START_METHOD": "threads"}), \
                pytest.raises(ValueError, match="AUTOPAR_START_METHOD"):
            start_method()
