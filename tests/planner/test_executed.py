"""What a plan executes (autopar.planner.executed) against what the ILP prices.

The runtime sums a partial gradient once per (value, layout, axes) and converts a value to a
layout once for all its readers; the ILP prices gradient sums along each value's reader chain,
which is exact when the readers agree (Megatron's column-parallel projections all read one
replicated activation), and the estimate and the report count what runs.
"""

from __future__ import annotations

import pytest
import torch

from autopar import zoo
from autopar.api import plan_model
from autopar.planner.assemble import baseline_problem
from autopar.planner.checkpointing import estimate
from autopar.planner.executed import grad_syncs, shared_savings, unique_conversions
from autopar.planner.options import PlanOptions
from autopar.plans import NodeKind
from autopar.report.analysis import comm_breakdown
from autopar.solver.driver import solve


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    model, inputs = zoo.build("llama-1b", tiny=True, batch=4, seq=16, device="meta")
    free = plan_model(model, inputs, mesh=(2,), options=PlanOptions(checkpoint="none")).plan.estimate.peak_bytes
    # a budget under which Megatron must shard the projections (column-parallel: partial input gradients);
    # at 0.7 of the free plan's peak the family may keep attention's replicated (its sums' backward
    # priced as autograd runs it, session 27), and at 0.6-0.65 it shards all of them
    return plan_model(model, inputs, mesh=(2,), options=PlanOptions(checkpoint="none", memory_budget=int(0.63 * free)))


def test_megatron_projections_share_one_gradient_sum_and_are_priced_once(llama):
    problem = baseline_problem("megatron-tp", llama.traced, llama.built)
    choice = solve(problem).choice
    syncs, extra = grad_syncs(llama.built, choice)
    by_value = {}
    for name, d in llama.built.decisions.items():
        if d.kind == NodeKind.OP and "proj" in (d.module or ""):
            c = llama.built.choice_of(name, choice[name])
            for slot, axes in enumerate(c.strategy.grad_partial_axes):
                if axes:
                    by_value.setdefault(d.inputs[slot].producer, []).append(name)
    shared = {v: readers for v, readers in by_value.items() if len(readers) > 1}
    # q/k/v read one normalised activation, gate/up another: per layer 2 shared values
    assert len(shared) == 2 * 2 and all(len(r) in (2, 3) for r in shared.values()), shared
    assert extra == 0.0  # the chain prices each shared sum once
    assert len(syncs) < sum(len(r) for r in by_value.values())
    # The ILP's evaluation prices exactly the collectives the report lists (which count what
    # runs), plus what several readers share; the estimate is the former.
    plain = problem.evaluate(choice)
    saved = sum(shared_savings(llama.built, choice))
    rows = comm_breakdown(llama.built, choice, llama.built.mesh)
    assert plain.comm_s + plain.reshard_s == pytest.approx(sum(r.seconds for r in rows) + saved, rel=1e-9)
    ev = estimate(llama.built, problem, choice, (), llama.built.segment_inputs)
    assert ev.objective == pytest.approx(plain.objective - saved, rel=1e-12)


def test_shared_conversions_run_once(llama):
    choice = llama.recompute.choice
    unique, shared = unique_conversions(llama.built, choice)
    keys = [(llama.built.decisions[c.consumer].inputs[c.slot].producer, str(c.conversion.dst)) for c in unique]
    assert len(keys) == len(set(keys))
    for c in shared:
        key = (llama.built.decisions[c.consumer].inputs[c.slot].producer, str(c.conversion.dst))
        assert key in keys
