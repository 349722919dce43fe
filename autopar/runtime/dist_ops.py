"""The flat-tensor collectives under torch 2.13's names, on older torch as well, and the one way
the runtime waits for an asynchronous collective.

torch 2.13 calls them ``all_gather_single`` / ``reduce_scatter_single``; earlier releases (the
2.11 that GPU machines' images carry) only have ``all_gather_into_tensor`` /
``reduce_scatter_tensor``, the same operations under their old names. Every caller in the runtime
takes them from here, so the runtime runs on both.

``wait(work)``: ``work.wait()`` inside a profiler range named ``WAIT_EVENT``; ``waiting()``: that
range around a synchronous collective called outside the runtime's communication functions;
``blocking(collective, ...)``: a collective the step waits for at once, issued the one way the
runtime waits. With ``set_polling(True)`` (``runtime.seats.configure_waits``: CPU ranks with cores
of their own) it polls the work, yielding the core, instead of sleeping in ``work.wait()``: a
rank asleep in a gloo collective is woken late (its idle vCPU halts), ~1-2 ms a blocking
collective on a 2-core host; polling gave that back (``runtime.seats``). ``issue(collective,
...)``: an asynchronous collective whose work's ``wait()`` waits so too. Only collectives whose
gloo work reports completion before ``wait()`` are polled (``_POLLABLE``: gloo's reduce-scatter
does not, and a ``Work`` does not tell).
torch's profiler records no event for a ``Work``'s wait (a synchronous ``dist.all_reduce`` waits
after its ``c10d::`` event has ended), so without it the time a step spends waiting for a gradient
bucket, a prefetched gather or a blocking collective would be invisible to
``runtime.refine.StepTimes``. The range is only opened while a profiler runs: opening one costs
10-15 us even with none (a dispatcher call), about 20 times a step on a ResNet's data-parallel
step before its batch norms' sums were coalesced.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, ContextManager

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
WAIT_EVENT = "autopar::wait"

__all__ = ["WAIT_EVENT", "all_gather_single", "blocking", "issue", "polling", "reduce_scatter_single", "set_polling",
           "wait", "waiting"]

_POLL = [False]  # this process's wait policy (set_polling)


def set_polling(enabled: bool) -> None:
    """Whether this process's waits poll their work (yielding the core) instead of sleeping."""
    _POLL[0] = bool(enabled)


def polling() -> bool:
    """This process's wait policy (``set_polling``)."""
    return _POLL[0]


# The collectives whose gloo work reports completion while it is polled: a reduce-scatter's work
# (``reduce_scatter_single``) stays incomplete until ``wait()`` is called, so it is never polled.
_POLLABLE = frozenset({dist.all_reduce, all_gather_single, dist.all_to_all_single})


class _PolledWork:
    """A pollable collective's work whose ``wait()`` waits as the policy waits (``set_polling``)."""

    __slots__ = ("work",)

    def __init__(self, work: Any) -> None:
        self.work = work

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        if _POLL[0]:
            while not self.work.is_completed():
                os.sched_yield()
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


def issue(collective: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``collective(*args, async_op=True, **kwargs)``'s work; one of ``_POLLABLE``'s waits as the
    policy waits."""
    work = collective(*args, async_op=True, **kwargs)
    return _PolledWork(work) if collective in _POLLABLE else work


def blocking(collective: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """``collective(*args, **kwargs)`` run to completion before returning, as the wait policy
    waits (polling, for a collective in ``_POLLABLE``: issued asynchronously and its work polled)."""
    if _POLL[0] and collective in _POLLABLE:
        issue(collective, *args, **kwargs).wait()
    else:
        collective(*args, **kwargs)


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
