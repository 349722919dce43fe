"""The wait policy (``runtime.seats``) and the collectives issued under it (``runtime.dist_ops``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from autopar.runtime import dist_ops
from autopar.runtime.launch import run_local
from autopar.runtime.seats import POLL_ENV, configure_waits, shares_cores


@pytest.fixture(autouse=True)
def _policy_restored():
    before = dist_ops.polling()
    yield
    dist_ops.set_polling(before)


@pytest.mark.parametrize("value, polls", [("1", True), ("0", False)])
def test_the_environment_forces_the_policy_without_a_collective(monkeypatch, value, polls):
    monkeypatch.setenv(POLL_ENV, value)
    assert configure_waits(torch.device("cpu")) is polls and dist_ops.polling() is polls


def test_a_bad_policy_value_is_named(monkeypatch):
    monkeypatch.setenv(POLL_ENV, "yes")
    with pytest.raises(ValueError, match=f"{POLL_ENV} must be 0 or 1, got 'yes'"):
        configure_waits(torch.device("cpu"))


def test_one_process_never_polls(monkeypatch):
    monkeypatch.delenv(POLL_ENV, raising=False)
    assert not configure_waits(torch.device("cpu"))  # no process group: nothing to wait for


def test_only_ranks_with_cores_of_their_own_poll():
    assert not shares_cores([("h", "cpu", 1, 2)] * 2)
    assert shares_cores([("h", "cpu", 1, 2)] * 4)


def _every_kind(rank: int, world: int, poll: bool) -> list[list[float]]:
    dist_ops.set_polling(poll)
    full = torch.arange(8.0) + 10 * rank
    piece = torch.full((8 // world,), float(rank + 1))
    gathered, scattered, swapped = torch.empty(8), torch.empty(8 // world), torch.empty(8 // world)
    summed = full.clone()
    dist_ops.blocking(dist.all_reduce, summed)
    dist_ops.blocking(dist_ops.all_gather_single, gathered, piece)
    dist_ops.blocking(dist_ops.reduce_scatter_single, scattered, full)  # never polled: runs synchronously
    dist_ops.blocking(dist.all_to_all_single, swapped, piece)
    later = full.clone()
    dist_ops.issue(dist.all_reduce, later).wait()
    return [t.tolist() for t in (summed, gathered, scattered, swapped, later)]


@pytest.mark.timeout(120)
def test_polled_collectives_give_what_sleeping_ones_give():
    polled = run_local(_every_kind, 2, True, timeout=90)
    slept = run_local(_every_kind, 2, False, timeout=90)
    assert polled == slept
    assert polled[0][0] == [2 * i + 10 for i in range(8)]  # ranks 0 and 1 summed
    assert polled[1][1] == [1.0] * 4 + [2.0] * 4
