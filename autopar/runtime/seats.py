"""Where each rank computes, and the wait policy that follows from it.

``shares_cores``: whether some ranks' compute competes for the same cores or device (a host's CPU
ranks' threads outnumber its cores, or two ranks drive one accelerator), from each rank's seat
``(host, device, compute threads, cores it may run on)``; ``ranks_share_cores`` gathers the seats
of every rank of the default group (collective).

``configure_waits(device)`` (collective) switches ``dist_ops``' polling waits on where every CPU
rank has cores of its own and off elsewhere. Why: a rank that sleeps in a blocking gloo collective
is woken late -- its idle vCPU halts -- and on 2 ranks of a 2-core host a blocking all-reduce held
a step 1.3-2.4 ms where the rank polled with ``sched_yield`` 0.5-1.9 ms; a ResNet's channel-split
step with 4 blocking sums ran 78 -> 70 ms, GPT-2's ZeRO-3 step 238 -> 217 ms and its Megatron step
238 -> 209 ms. Where ranks share
cores the polling rank takes the core a peer computes on: a data-parallel ResNet step on 4 ranks of
2 cores ran 118 -> 129-146 ms, so there the ranks sleep. ``AUTOPAR_POLL_WAITS=1`` / ``0`` forces
the policy (a benchmark comparing the two).
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
import torch.distributed as dist

from autopar.runtime.dist_ops import set_polling

__all__ = ["configure_waits", "rank_seat", "ranks_share_cores", "shares_cores", "POLL_ENV"]

POLL_ENV = "AUTOPAR_POLL_WAITS"


def shares_cores(ranks: Sequence[tuple[str, str, int, int]]) -> bool:
    """Whether some ranks' compute competes for the same cores or device, from each rank's
    ``(host, device, compute threads, cores it may run on)``: on a host, the CPU ranks' threads
    outnumber its cores, or two ranks drive one accelerator. Only there does a pipeline bubble's
    waiting rank lend its share to the busy ones (``MachineProfile.idle_speedup``)."""
    cpu_threads: dict[str, int] = {}
    cpu_cores: dict[str, int] = {}
    devices: set[tuple[str, str]] = set()
    for host, device, threads, cores in ranks:
        if device == "cpu":
            cpu_threads[host] = cpu_threads.get(host, 0) + threads
            cpu_cores[host] = max(cpu_cores.get(host, 0), cores)
        elif (host, device) in devices:
            return True
        else:
            devices.add((host, device))
    return any(cpu_threads[host] > cpu_cores[host] for host in cpu_threads)


def rank_seat(device: torch.device) -> tuple[str, str, int, int]:
    """This rank's ``(host, device, compute threads, cores it may run on)`` for ``shares_cores``."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return os.uname().nodename, str(device), torch.get_num_threads(), cores


def ranks_share_cores(device: torch.device) -> bool:
    """``shares_cores`` over every rank of the default group (collective; the same answer on each)."""
    seats: list = [None] * dist.get_world_size()
    dist.all_gather_object(seats, rank_seat(device))
    return shares_cores(seats)


def configure_waits(device: torch.device) -> bool:
    """Poll in blocking collectives (``dist_ops.set_polling``) where this process group's CPU ranks
    each have cores of their own (module docstring); returns the policy. Collective: every rank of
    the default group calls it (``AUTOPAR_POLL_WAITS`` set: no collective, its value decides)."""
    forced = os.environ.get(POLL_ENV)
    if forced is not None:
        if forced not in ("0", "1"):
            raise ValueError(f"{POLL_ENV} must be 0 or 1, got {forced!r}")
        poll = forced == "1"
    else:
        device = torch.device(device)
        poll = (device.type == "cpu" and dist.is_initialized() and dist.get_world_size() > 1
                and not ranks_share_cores(device))
    set_polling(poll)
    return poll
