"""``runtime.dist_ops.wait``/``waiting``: the ``WAIT_EVENT`` profiler range is recorded under a
profiler and not opened without one (opening it costs a dispatcher call every wait)."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from autopar.runtime import dist_ops
from autopar.runtime.dist_ops import WAIT_EVENT, wait, waiting


class _Work:
    def __init__(self) -> None:
        self.waited = 0

    def wait(self) -> str:
        self.waited += 1
        return "done"


def test_wait_is_timed_under_a_profiler():
    work = _Work()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert wait(work) == "done"
        with waiting():
            torch.ones(2).sum()
    names = [e.name for e in prof.events()]
    assert names.count(WAIT_EVENT) == 2 and work.waited == 1, names


def test_no_range_without_a_profiler(monkeypatch):
    def refuse(name):
        raise AssertionError(f"record_function({name!r}) opened with no profiler running")

    monkeypatch.setattr(dist_ops, "record_function", refuse)
    work = _Work()
    assert wait(work) == "done" and work.waited == 1
    with waiting():
        pass
