"""The measuring side of ``refine=True`` (``autopar.runtime.refine``): torch profiler events sorted
into the cost model's op classes, the optimizer's kernels left out. One process, no collectives
(the gloo runs of ``tests/test_refine.py`` time those)."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from autopar.layout.machine import OP_CLASSES
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
