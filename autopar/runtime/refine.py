"""Timing training steps per op class with torch's profiler: the measuring side of ``refine=True``.

``StepTimer`` profiles a window of whole training steps (from the start of one forward call to the
start of a later one: forward, backward, the optimizer step and everything in between) and
``StepTimes.of_events`` sorts what the profiler saw into the cost model's terms:

- **compute** per op class (``layout.machine.OP_CLASSES``, by ``strategies.combine.op_class`` of
  the ATen op each event names; an event of no class inside one of a class -- the backend kernel
  ``aten::mkldnn_convolution`` inside ``aten::convolution``, the ``aten::empty`` of an op's output
  -- counts as that op's, as the planner prices the op whole): the self time of every ATen event,
  except those run inside the optimizer (``Optimizer.step``/``zero_grad``: the planner does not
  price the optimizer's kernels),
  inside a collective (``c10d::``, the backend's own events) or inside the runtime's communication
  functions (``runtime.collectives``, ``kernels``, ``pending``, ``bucketing``: their copies and
  concatenations are part of the conversion the planner prices as communication);
- **communication**: the time the step is *held* by collectives, read on the threads that issue
  them (the training thread, autograd's): the wall time of every outermost collective span there --
  a runtime communication function (its copies included, as the planner prices a conversion
  whole), a ``c10d::`` call, and the runtime's ``autopar::wait`` range (``runtime.dist_ops``: a
  wait for an asynchronous collective -- a gradient bucket's, a prefetched gather's, a pending
  output's -- or a blocking one called outside those functions) -- each counted once, a span
  inside another not again. torch records no event for a ``Work``'s wait (a synchronous
  ``dist.all_reduce`` waits after its ``c10d::`` event ends): a blocking collective called
  outside the runtime is seen only for its ``c10d::`` call. The
  backend's own events (``gloo:all_reduce`` ..., on its worker thread) run concurrently with
  those spans and are not counted: a synchronous collective's is inside its caller's wait, an
  asynchronous one's is hidden except for the wait. Why the issuing side: a blocking collective
  mid-step holds the step for longer than the backend's event lasts (the ranks arrive apart,
  the waiting thread is woken late: a CNN's channel-split plan measured ~2 ms per batch-norm
  sum against ~0.3 ms of ``gloo:all_reduce``), and that is what the planner must price
  (``MachineProfile.blocking_s``).

On CUDA the device time of each event is used where it has one (the kernel's), else its CPU time;
communication there is the backend's events' device time (NCCL's kernels, which hold the
stream; the issuing thread does not wait for them).
Every figure is per step (the window's sum over its steps). ``agreed`` makes every rank hold the
same figures: the maximum over ranks of each (a step waits for its slowest rank).

The runtime never imports the planner: the planner side (``autopar.planner.refit``) compares these
figures with what the plan priced and refits the mesh's profile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist

from autopar.layout.machine import OP_CLASSES
from autopar.runtime.dist_ops import WAIT_EVENT

__all__ = ["StepTimes", "StepTimer", "op_class_of_event"]

# Events of collectives: the backend's own (the time the collective ran, on its worker thread) and
# the issuing thread's: the c10d entry points (an asynchronous one returns at once, a synchronous
# one when done) and the runtime's waits for asynchronous ones.
_BACKEND_PREFIXES = ("gloo:", "nccl:")
_ISSUING_PREFIXES = ("c10d::", "record_param_comms", WAIT_EVENT)
_COLLECTIVE_PREFIXES = (*_ISSUING_PREFIXES, *_BACKEND_PREFIXES)
# The optimizer's own kernels: not part of the step the planner prices.
_OPTIMIZER_PREFIXES = ("Optimizer.",)


def _runtime_comm_functions() -> frozenset[str]:
    """The names the profiler gives the runtime's communication functions (forward and backward)."""
    from autopar.runtime import bucketing, collectives, dtensors, kernels, pending

    names = set()
    for mod in (collectives, kernels, pending, bucketing, dtensors):
        for value in vars(mod).values():
            if isinstance(value, type) and issubclass(value, torch.autograd.Function):
                names.update((value.__name__, f"{value.__name__}Backward"))
    return frozenset(names)


def op_class_of_event(name: str) -> str:
    """The op class of the ATen op a profiler event names (``"aten::mm"`` -> ``"matmul"``)."""
    from autopar.strategies.combine import op_class

    try:
        packet = getattr(torch.ops.aten, name.removeprefix("aten::"))
        classes = [op_class(getattr(packet, o)) for o in packet.overloads()]
    except (AttributeError, RuntimeError):  # not an ATen op: priced by the roofline
        return "other"
    # The event names the packet, not the overload: the tensor overloads give the class (``add``'s
    # ``default`` is the integer one, untagged; ``add.Tensor`` and ``add.Scalar`` are pointwise).
    return next((c for c in classes if c != "other"), "other")


@dataclass(frozen=True, slots=True)
class StepTimes:
    """Seconds per training step: ``compute`` per op class (``OP_CLASSES`` order), ``comm`` the
    time collectives held the step (module docstring); ``steps``: how many steps the figures are
    the mean of."""

    compute: tuple[float, ...]
    comm: float
    steps: int

    def __post_init__(self) -> None:
        if len(self.compute) != len(OP_CLASSES):
            raise ValueError(f"StepTimes.compute needs one figure per op class {OP_CLASSES}, got {self.compute}")
        if self.steps < 1:
            raise ValueError(f"StepTimes.steps must be >= 1, got {self.steps}")

    def by_class(self) -> dict[str, float]:
        return dict(zip(OP_CLASSES, self.compute))

    @classmethod
    def of_events(cls, events: Iterable[Any], *, steps: int, device_time: bool = False) -> "StepTimes":
        """The figures of a profiler's ``events()`` over ``steps`` steps (module docstring)."""
        skip = _runtime_comm_functions()
        compute = dict.fromkeys(OP_CLASSES, 0.0)
        comm = 0.0
        classes: dict[str, str] = {}
        for e in events:
            name = e.name
            if device_time:
                if name.startswith(_BACKEND_PREFIXES):
                    comm += _seconds(e, device_time, total=True)
                    continue
            elif (name in skip or name.startswith(_ISSUING_PREFIXES)) and not _inside(e, skip, comm_only=True):
                comm += _seconds(e, False, total=True)
                continue
            if not name.startswith("aten::") or _inside(e, skip):
                continue
            compute[_class_within(e, classes)] += _seconds(e, device_time, total=False)
        return cls(tuple(compute[c] / steps for c in OP_CLASSES), comm / steps, steps)

    def agreed(self, *, device: torch.device) -> "StepTimes":
        """Every rank's figures replaced by the maximum over ranks (one all-reduce)."""
        values = torch.tensor([*self.compute, self.comm], dtype=torch.float64,
                              device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        out = values.tolist()
        return StepTimes(tuple(out[:-1]), out[-1], self.steps)


def _class_within(event: Any, classes: dict[str, str]) -> str:
    """The op class of ``event``'s ATen op, else of the nearest enclosing ATen op that has one
    (``classes``: a cache by name); ``"other"`` when none has."""
    while event is not None and event.name.startswith("aten::"):
        if event.name not in classes:
            classes[event.name] = op_class_of_event(event.name)
        if classes[event.name] != "other":
            return classes[event.name]
        event = event.cpu_parent
    return "other"


def _seconds(event: Any, device_time: bool, *, total: bool) -> float:
    if device_time:
        us = event.device_time_total if total else event.self_device_time_total
        if us > 0:
            return us * 1e-6
    return (event.cpu_time_total if total else event.self_cpu_time_total) * 1e-6


def _inside(event: Any, skip: frozenset[str], *, comm_only: bool = False) -> bool:
    """Whether ``event`` ran inside a collective or a runtime communication function, or (unless
    ``comm_only``) the optimizer."""
    parent = event.cpu_parent
    while parent is not None:
        name = parent.name
        if name in skip or name.startswith(_COLLECTIVE_PREFIXES) \
                or (not comm_only and name.startswith(_OPTIMIZER_PREFIXES)):
            return True
        parent = parent.cpu_parent
    return False


class StepTimer:
    """torch's profiler over a window of steps: ``start()`` at the start of the first timed
    step's forward call, ``stop()`` at the start of the forward call after the last one."""

    def __init__(self, *, device: torch.device) -> None:
        self.device = device
        self._profiler: Any = None

    @property
    def running(self) -> bool:
        return self._profiler is not None

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._profiler = profile(activities=activities)
        try:
            self._profiler.__enter__()
        except RuntimeError as exc:  # the profiler refused to start (e.g. one of another kind is on)
            self._profiler = None
            raise ValueError(f"refine=True times training steps with torch.profiler, which could not start "
                             f"({exc}); stop the other profiler or leave refine off") from None

    def stop(self, *, steps: int) -> StepTimes:
        if self._profiler is None:
            raise ValueError("StepTimer.stop() without start()")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        prof, self._profiler = self._profiler, None
        prof.__exit__(None, None, None)
        return StepTimes.of_events(prof.events(), steps=steps, device_time=self.device.type == "cuda")
