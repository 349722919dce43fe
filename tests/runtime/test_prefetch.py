"""Sharded parameters gathered one reader ahead (``runtime.prefetch``): a ZeRO-3 plan's emitted
graph issues each parameter's all-gather right after the previous parameter's wait, waits where
the blocking gather stood, and trains exactly as one device does (loss, every gradient, clipped
AdamW steps); with ``AUTOPAR_PREFETCH=0`` the same plan keeps its blocking gathers."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from autopar import zoo
from autopar.planner.options import PlanOptions
from autopar.planner.orchestrate import plan_family
from autopar.runtime.build import build_module
from autopar.runtime.launch import run_local
from autopar.tracer import trace
from tests.runtime.test_e2e import check_module, fast_mesh, reference

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from _measure import sharded_state_budget  # noqa: E402


def _build(rank, world, model, traced, plan, inputs, ref):
    del rank, world
    errors, codes = [], []
    for prefetch in ("1", "0"):
        os.environ["AUTOPAR_PREFETCH"] = prefetch
        pm = build_module(model, traced, plan, device=torch.device("cpu"))
        codes.append(pm.code)
        if prefetch == "1":
            errors += check_module("gpt2 zero3 prefetched", pm, inputs, ref)
    return errors, codes


def _order_errors(code: str) -> list[str]:
    """Every wait after its own start; each start (but the first) after the previous wait."""
    lines = [line.strip() for line in code.splitlines()]
    starts = {line.split("key = '")[1].split("'")[0]: i for i, line in enumerate(lines) if "self.gather_start(" in line}
    waits = {line.split("key = '")[1].split("'")[0]: i for i, line in enumerate(lines) if "self.gather_wait(" in line}
    errors = [] if starts and set(starts) == set(waits) else [f"starts {sorted(starts)} vs waits {sorted(waits)}"]
    order = sorted(waits, key=waits.get)
    for prev, key in zip(order, order[1:]):
        if not waits[prev] < starts[key] < waits[key]:
            errors.append(f"{key}: start at line {starts[key]}, previous wait {waits[prev]}, own wait {waits[key]}")
    return errors


@pytest.mark.slow
def test_zero3_gathers_prefetched_one_ahead_train_like_one_device():
    torch.manual_seed(3)
    model, inputs = zoo.build("gpt2", tiny=True, device="cpu")
    mesh = fast_mesh((2,))
    dp = plan_family(model, inputs, "data-parallel", mesh=mesh, options=PlanOptions(checkpoint="none"))
    # a budget data parallelism misses by most of its state: ZeRO-3 then shards the parameters
    budget = sharded_state_budget(dp.estimate, 2)
    plan = plan_family(model, inputs, "zero3", mesh=mesh, options=PlanOptions(memory_budget=budget, checkpoint="none"))
    sharded = [n.name for n in plan.nodes if n.kind.name == "PARAMETER" and n.strategy != "R"]
    assert len(sharded) >= 3, f"the zero3 family stores only {sharded} sharded"
    results = run_local(_build, 2, model, trace(model, inputs), plan, inputs, reference(model, inputs), timeout=240)
    for rank, (errors, (on, off)) in enumerate(results):
        assert not errors, f"rank {rank}: " + "\n".join(errors)
        assert not _order_errors(on), _order_errors(on)
        assert "gather_start" not in off  # AUTOPAR_PREFETCH=0: the same plan, blocking gathers
        split = off.count("self.all_gather(") - on.count("self.all_gather(")
        assert split == on.count("self.gather_wait(") > 0, (split, on.count("self.gather_wait("))
