"""The measuring side of ``refine=True`` (``autopar.runtime.refine``): torch profiler events sorted
into the cost model's op classes, the optimizer's kernels left out; and, on a real profiler trace of
2 gloo ranks, communication read as the time collectives held the issuing thread (a blocking
collective's wait counted, an asynchronous one's hidden run not)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from autopar.layout.machine import OP_CLASSES
from autopar.runtime.dist_ops import wait
from autopar.runtime.launch import run_local
from autopar.runtime.refine import StepTimer, StepTimes, op_class_of_event


@pytest.mark.parametrize("name,cls", [("aten::mm", "matmul"), ("aten::addmm", "matmul"), ("aten::add", "elementwise"),
                                      ("aten::native_layer_norm", "norm"), ("aten::_softmax", "norm"),
                                      ("aten::scaled_dot_product_attention", "attention"), ("aten::sum", "other"),
                                      ("aten::no_such_op", "other")])
def test_events_are_classed_as_the_cost_model_classes_ops(name, cls):
    assert op_class_of_event(name) == cls


def _step(model, opt, x):
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def test_a_step_is_timed_per_class_without_the_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.LayerNorm(256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256)
    _step(model, opt, x)
    timer = StepTimer(device=torch.device("cpu"))
    timer.start()
    assert timer.running
    for _ in range(2):
        _step(model, opt, x)
    times = timer.stop(steps=2)
    assert not timer.running and times.steps == 2 and times.comm == 0.0
    by = times.by_class()
    assert set(by) == set(OP_CLASSES) and by["matmul"] > 0 and by["norm"] > 0
    # the optimizer alone: nothing the planner prices
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        opt.step()
    assert StepTimes.of_events(prof.events(), steps=1).compute == (0.0,) * len(OP_CLASSES)


def test_a_timer_stops_only_once_started_and_times_whole_steps():
    timer = StepTimer(device=torch.device("cpu"))
    with pytest.raises(ValueError, match="without start"):
        timer.stop(steps=1)
    with pytest.raises(ValueError, match="steps.*0"):
        StepTimes((0.0,) * len(OP_CLASSES), 0.0, 0)


class _Event:
    """A profiler event as ``StepTimes.of_events`` reads it (self and total CPU microseconds)."""

    def __init__(self, name: str, self_us: float, parent: "_Event | None" = None) -> None:
        self.name, self.cpu_parent = name, parent
        self.self_cpu_time_total = self.cpu_time_total = self_us


def test_a_classless_kernel_inside_a_classed_op_counts_as_that_op():
    # aten::convolution dispatches to aten::mkldnn_convolution (no class of its own) and allocates
    # its output with aten::empty: the planner prices the convolution whole, so all of it is conv.
    conv = _Event("aten::convolution", 10.0)
    events = [conv, _Event("aten::mkldnn_convolution", 300.0, conv), _Event("aten::empty", 5.0, conv),
              _Event("aten::sum", 40.0), _Event("aten::empty", 7.0, _Event("aten::sum", 1.0))]
    by = StepTimes.of_events(events, steps=1).by_class()
    assert by["conv"] == pytest.approx(315e-6)
    assert by["other"] == pytest.approx(40e-6 + 7e-6)


SKEW_S, HIDDEN_S, COMPUTE_S = 0.1, 0.15, 0.4


def _matmuls_for(seconds: float, a: torch.Tensor) -> None:
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, a)


def _skewed_step(rank, world):
    """One step with a blocking all-reduce that rank 0 reaches ``SKEW_S`` before rank 1, then an
    asynchronous one that rank 1 issues ``HIDDEN_S`` late while rank 0 computes ``COMPUTE_S``
    before waiting for it: rank 0's backend runs that one ~``HIDDEN_S`` (waiting for rank 1) under
    its compute, hidden."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.runtime.kernels import DistComm
    from autopar.runtime.process_mesh import ProcessMesh

    comm = DistComm(ProcessMesh(init_device_mesh("cpu", (2,))))
    # products of about a millisecond: a few hundred profiler events, not tens of thousands (whose
    # parsing took seconds)
    x, y, a = torch.ones(1024), torch.ones(1024), torch.randn(256, 256)
    comm.all_reduce(x, 0)  # connections up before the trace
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        # The ranks' profilers start apart (tens of ms under load): meet again inside the trace,
        # so the skew is the sleep's. (A barrier's wait has no event: it adds its c10d call only.)
        dist.barrier()
        start = time.perf_counter()
        if rank == 1:
            time.sleep(SKEW_S)
        x = comm.all_reduce(x, 0)  # the runtime's blocking sum: rank 0 waits for rank 1 here
        if rank == 1:
            time.sleep(HIDDEN_S)
        work = dist.all_reduce(y, async_op=True)
        if rank == 0:
            _matmuls_for(COMPUTE_S, a)
        wait(work)  # the runtime's wait for an asynchronous collective
        wall = time.perf_counter() - start
    events = prof.events()
    backend = sum(e.cpu_time_total for e in events if e.name.startswith("gloo:")) * 1e-6
    return StepTimes.of_events(events, steps=1), wall, backend


def test_a_blocking_collective_counts_its_wait_and_a_hidden_one_only_its_exposed_wait():
    (times, wall, backend), _ = run_local(_skewed_step, 2, timeout=120)
    # Rank 0: the blocking all-reduce held it for rank 1's skew; the asynchronous one ran under
    # its matmuls (its backend event lasted about HIDDEN_S, waiting for rank 1) and was done when
    # waited on. The backend's events are not the measure: they count the hidden run too.
    assert times.comm >= 0.8 * SKEW_S, (times, backend)
    assert times.comm < SKEW_S + 0.5 * HIDDEN_S, (times, backend)
    assert backend > times.comm - 0.01, (times, backend)  # (what the backend's events would have said)
    assert times.by_class()["matmul"] >= 0.5 * COMPUTE_S  # (the loop's Python between products is not an op)
    # compute and communication are disjoint spans of the step: together no more than its wall time
    assert sum(times.compute) + times.comm <= wall * 1.02 + 1e-3, (times, wall)
