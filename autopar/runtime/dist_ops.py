"""The flat-tensor collectives under torch 2.13's names, on older torch as well, and the one way
the runtime waits for an asynchronous collective.

torch 2.13 calls them ``all_gather_single`` / ``reduce_scatter_single``; earlier releases (the
2.11 that GPU machines' images carry) only have ``all_gather_into_tensor`` /
``reduce_scatter_tensor``, the same operations under their old names. Every caller in the runtime
takes them from here, so the runtime runs on both.

``wait(work)``: ``work.wait()`` inside a profiler range named ``WAIT_EVENT``; ``waiting()``: that
range around a synchronous collective called outside the runtime's communication functions.
torch's profiler records no event for a ``Work``'s wait (a synchronous ``dist.all_reduce`` waits
after its ``c10d::`` event has ended), so without it the time a step spends waiting for a gradient
bucket, a prefetched gather or a blocking collective would be invisible to
``runtime.refine.StepTimes``. The range is only opened while a profiler runs: opening one costs
10-15 us even with none (a dispatcher call), about 20 times a step on a ResNet's data-parallel
step before its batch norms' sums were coalesced.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
WAIT_EVENT = "autopar::wait"

__all__ = ["WAIT_EVENT", "all_gather_single", "reduce_scatter_single", "wait", "waiting"]


def waiting() -> ContextManager:
    """The profiler range ``WAIT_EVENT`` (nothing when no profiler runs): code inside it waits for
    collectives."""
    return record_function(WAIT_EVENT) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


def wait(work: Any) -> Any:
    """``work.wait()`` (its result), timed by the profiler as ``WAIT_EVENT``."""
    if not torch.autograd._profiler_enabled():
        return work.wait()
    with record_function(WAIT_EVENT):
        return work.wait()
