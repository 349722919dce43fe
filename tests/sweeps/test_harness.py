"""The sweep harness itself: per-entry results survive failures of other entries."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from . import e2e, harness


class Tagged(nn.Module):
    def __init__(self, tag: str) -> None:
        super().__init__()
        self.tag = tag
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x).pow(2).mean()


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return y.sum() if y.sum() > 0 else y.mean()  # branches on a value


def entry(name: str, model_cls=Tagged) -> harness.Entry:
    def build():
        model = model_cls(name) if model_cls is Tagged else model_cls()
        return model, (torch.randn(4, 8),)
    return harness.Entry(name, build)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_hung_and_raising_entries_are_reported_and_the_others_still_run(monkeypatch):
    real = e2e.check_e2e

    def check(model, traced, plan, inputs, ref, *, exact=True):
        if model.tag == "hangs" and dist.get_rank() == 0:
            time.sleep(60)  # rank 1 goes on to the next entry's collectives alone
        if model.tag == "raises":
            raise NotImplementedError("no kernel for this layout")
        return real(model, traced, plan, inputs, ref, exact=exact)

    monkeypatch.setattr(e2e, "check_e2e", check)  # forked ranks inherit the patch
    entries = [entry("first"), entry("hangs"), entry("raises"), entry("last"),
               entry("traces_not", DataDependent)]
    start = time.perf_counter()
    results = {r.name: r for r in harness.sweep(entries, [(2,)], task_timeout=5)}
    assert time.perf_counter() - start < 40, "a hung entry must cost about its task timeout, not the launch's"
    assert results["first"].strict_ok and results["last"].strict_ok, \
        {k: r.cause() for k, r in results.items()}
    hung = results["hangs"].meshes["2"].errors
    assert hung and hung[0].startswith("hung: did not finish within 5 s on rank 0"), hung
    raised = results["raises"].meshes["2"].errors
    assert raised and raised[0].startswith("raised NotImplementedError: no kernel for this layout"), raised
    assert "no kernel" in results["raises"].cause()
    bad = results["traces_not"]
    assert not bad.traced and not bad.meshes and "cannot trace" in bad.trace_error
    groups = harness.group_failures(list(results.values()))
    assert any("hangs" in names for names in groups.values())
    assert all(not r.strict_ok for r in (results["hangs"], results["raises"], bad))
