"""Planned offload executed (issue 16): ``autoparallelize(..., offload=...)`` runs the plan's
tiers in the chunk runtime, and the manager's own ledger measures what the plan estimated.

The quantity compared is the plan's ``offload_info["device_model_bytes"]``: the model states the
plan keeps on the device tier -- each trainable parameter's chosen option's device bytes
(parameter + gradient + optimizer state on the device; parameter + gradient under ``off:o``;
nothing under ``off:po``) plus the device room the runtime needs beyond them -- the streamed
parameters pinned at once (the two largest, or every one an op or a recomputed region reads
together) and the largest ZeRO-2 gradient waiting whole for its reduce-scatter -- against the
ledger's device-tier bytes after every chunk move (payloads, gradient chunks, optimizer state,
fetched host chunks). Host tier: the plan's ``host_bytes`` against the ledger's host peak, exact
up to the chunks' padding (16 B per padded element on the host: fp32 master or payload, two
moments, gradient or landing buffer). On this CPU-only machine both tiers are host memory; the
accounting is the same.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch.utils._pytree import tree_map

import autopar
from autopar import zoo
from autopar.layout.mesh import MeshSpec
from autopar.offload import OffloadPolicy
from autopar.runtime.gemini.chunk import DEVICE, HOST
from autopar.runtime.launch import run_local
from tests.budgets import between, smallest_budget

STEPS, EPS, LR = 5, 1e-5, 1e-3


def _clone(x):
    return x.clone() if isinstance(x, torch.Tensor) else x


def _model(name):
    torch.manual_seed(0)
    return zoo.build(name, tiny=True, batch=4, seq=16, device="cpu")


def _reference(model, inputs):
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), lr=LR, eps=EPS)
    for _ in range(STEPS):
        m(**inputs).loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in m.state_dict().items()}


def _smallest(model, inputs, mesh, **options) -> int:
    return smallest_budget(lambda budget: autopar.plan(model, inputs, mesh=mesh, memory_budget=budget, **options))


def _tight_budget(model, inputs, mesh, *, zero_stage=0, fraction: float = 0.5, smallest_offload=None) -> int:
    """``fraction`` of the way from the smallest budget a plan with offload meets to the smallest
    one without (no recompute either way): something must go to the host. ``smallest_offload``:
    the first figure when the caller has it already (``_recompute_budget``), not solved again."""
    options = dict(zero_stage=zero_stage, checkpoint="none")
    if smallest_offload is None:
        smallest_offload = _smallest(model, inputs, mesh, offload="auto", **options)
    # pipeline=1: the figure read is the unpipelined plan's either way (tests/budgets.py), without
    # the pipeline candidates' search
    return between(smallest_offload, _smallest(model, inputs, mesh, pipeline=1, **options), fraction)


def _recompute_budget(model, inputs, mesh) -> int:
    """The smallest budget offload alone meets in the ILP: its plans need device room on top (the
    streamed parameters pinned at once), so the plan must offload AND recompute -- regions that
    then re-read streamed chunks in backward."""
    return _smallest(model, inputs, mesh, zero_stage=0, checkpoint="none", offload="auto")


def _fast(shape):
    """Cheap links: data-parallel plans, where ZeRO has replicated parameters to shard. No
    overlap credit (the scenarios below were sized with every collective priced in full). Not
    free: 10 us a collective keeps a sharded weight's all-gather per reader dearer than ZeRO-2's
    per-piece work (``planner.zero_pricing.zero2_copy_seconds``)."""
    mesh = MeshSpec.preset("cpu", shape)
    return dataclasses.replace(mesh, alpha=(1e-5,) * len(shape), beta=(1e-13,) * len(shape), name="fast-links",
                               comm_overlap=0.0)


def _train(rank, world, jobs, tmp):
    out = []
    for name, model, inputs, budget, checkpoint, mesh, zero_stage, offload in jobs:
        # The public path: rank 0 plans with offload, every rank builds and places the tiers.
        pm = autopar.autoparallelize(copy.deepcopy(model), inputs, mesh=mesh, memory_budget=budget,
                                     offload=offload, checkpoint=checkpoint, zero_stage=zero_stage,
                                     init_weights=False)
        pm.load_full_state_dict(model.state_dict())
        opt = pm.optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
        manager = pm.gemini.manager
        start = len(manager.ledger.log)
        backward_grads = []
        for step in range(STEPS):
            pm(**inputs).loss.backward()
            # Gradients are in their chunks before the step: device-home ones on the device,
            # host-home ones on the host, each .grad a view of its chunk.
            backward_grads.append(sorted({(c.home, c.grad is not None) for c in manager.chunks}))
            opt.step()
            opt.zero_grad()
            if step == 2:  # checkpoint mid-run: a fresh module from the same plan resumes it
                state, optim_state = pm.full_state_dict(), tree_map(_clone, opt.state_dict())
                pm2 = autopar.autoparallelize(copy.deepcopy(model), inputs, plan=pm.plan, init_weights=False)
                pm2.load_full_state_dict(state)
                opt2 = pm2.optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
                opt2.load_state_dict(optim_state)
        for _ in range(STEPS - 3):
            pm2(**inputs).loss.backward()
            opt2.step()
            opt2.zero_grad()
        moves = manager.ledger.log[start:]
        # 16 B per padded element on the host (a ZeRO chunk's state: its shard's share of them).
        padding_host = sum(16 * (c.state_elems - sum(s.numel for s in c.slots) / (c.num_shards if c.zero else 1))
                           for c in manager.chunks if HOST in (c.home, c.optim_tier))
        zero = [(c.zero, c.capacity, c.num_shards, c.master.numel(), c.exp_avg.numel(),
                 None if c.grad is None else c.grad.numel(), c.optim_tier) for c in manager.chunks if c.zero]
        # A ZeRO-2 chunk's whole gradient exists until its reduce-scatter (in the plan's room).
        in_flight = max((c.padded_bytes for c in manager.chunks if c.zero == 2), default=0)
        out.append((name, checkpoint, zero, in_flight, manager.regathered, pm.plan, pm.full_state_dict(),
                    pm2.full_state_dict(),
                    [m.device_bytes for m in moves], manager.ledger.peak[HOST], padding_host, backward_grads,
                    {(c.home, c.optim_tier) for c in manager.chunks},
                    {m.event for m in moves if m.tier == HOST}, {m.event for m in moves if m.tier == DEVICE}))
    return out


@pytest.mark.parametrize("name", [
    "gpt2",
    # The same two offload scenarios on a second decoder (untied embeddings, RMSNorm, rotary);
    # the gpt2 case above runs both scenarios, and the ZeRO ones, in the default run.
    pytest.param("llama-1b", marks=pytest.mark.full_sweep),
])
def test_autoparallelize_offload_executes_the_plan_within_its_device_budget(tmp_path, name):
    model, inputs = _model(name)
    want = {name: _reference(model, inputs)}
    recompute_budget = _recompute_budget(model, inputs, (2,))
    jobs = [(name, model, inputs, _tight_budget(model, inputs, (2,), smallest_offload=recompute_budget), "none",
             (2,), None, "auto"),
            # Offload and activation recompute planned jointly, both executed.
            (name, model, inputs, recompute_budget, "auto", (2,), None, "auto")]
    if name == "gpt2":
        # Offload and ZeRO planned jointly (a data-parallel plan: ZeRO-2 on replicated parameters;
        # below what ZeRO alone reaches, the plan takes both, with a ZeRO-2 gradient wait in its room).
        jobs.append(("gpt2", model, inputs, _tight_budget(model, inputs, _fast((2,)), zero_stage="auto"), "none",
                     _fast((2,)), "auto", "auto"))
        # ZeRO-Offload: ZeRO-2 with the optimizer state of the replicated parameters on the host.
        jobs.append(("gpt2", model, inputs, None, "none", _fast((2,)), 2, OffloadPolicy(offload_optim_frac=1.0)))
    for result in run_local(_train, 2, jobs, str(tmp_path), timeout=300):
        assert len(result) == len(jobs)
        assert [bool(r[2]) for r in result] == [False] * 2 + [True] * (len(jobs) - 2)  # ZeRO chunks: the last two
        for (name, checkpoint, zero, in_flight, regathered, plan, full, resumed, device_series, host_peak, padding_host,
             backward_grads, tiers, host_events, device_events) in result:
            want_params = want[name]
            name = f"{name} checkpoint={checkpoint} zero={bool(zero)} {plan.offload_info['policy']}"
            stages = {n.zero_stage for n in plan.nodes if n.kind == "parameter"}
            assert bool(zero) == (stages != {0}), (name, stages, zero)
            for stage, capacity, num_shards, master, moment, grad, _ in zero:  # state 1/dp, payload whole
                assert num_shards == 2 and master == moment == -(-capacity // num_shards), (name, zero)
                assert grad is None, (name, zero)  # freed by zero_grad after the step
            if plan.offload_info["policy"].startswith("static"):  # ZeRO-Offload: ZeRO-2 state on the host
                assert {(stage, optim) for stage, *_, optim in zero} == {(2, HOST)}, (name, zero)
            info = plan.offload_info
            assert info["num_offloaded"] > 0 and plan.estimate.host_link_s > 0, (name, info)
            # The recomputed regions re-read streamed chunks in backward (fetched and pinned again).
            assert (len(plan.recompute) > 0) == (checkpoint == "auto") == (regathered > 0), (name, regathered)
            assert (HOST, HOST) in tiers or (DEVICE, HOST) in tiers, (name, tiers)
            for k, v in full.items():  # the planned tiers train like one device
                assert torch.allclose(v, want_params[k], rtol=1e-4, atol=1e-5), f"{name}: {k}"
            for k, v in resumed.items():  # and so does the run resumed from its checkpoint
                assert torch.allclose(v, want_params[k], rtol=1e-4, atol=1e-5), f"{name} resumed: {k}"
            # Device tier: the plan fits its budget with the room the runtime needs beyond the
            # ILP's figures; the ledger stays within the budget at every chunk move; its peak is
            # the plan's within 10% (recomputed regions and ZeRO-2 gradient waits included).
            room = info["stream_buffer_bytes"] + info["grad_wait_bytes"]
            assert plan.budget_bytes is None or plan.estimate.peak_bytes + room <= plan.budget_bytes, (name, room)
            assert plan.budget_bytes is None or max(device_series) <= plan.budget_bytes, (name, plan.budget_bytes)
            assert (info["grad_wait_bytes"] > 0) == (in_flight > 0), (name, info["grad_wait_bytes"], in_flight)
            peak, planned = max(device_series), info["device_model_bytes"]
            assert abs(peak - planned) <= 0.1 * planned, (name, peak, planned, peak / planned)
            # Host tier: as planned, up to the chunks' padding.
            assert abs(host_peak - info["host_bytes"] - padding_host) <= len(plan.offload), (  # plan: B per parameter
                name, host_peak, info["host_bytes"], padding_host)
            # Gradients went into chunks during backward, on their payload's tier.
            if any(home == DEVICE for home, _ in tiers):  # (a tight plan may stream every parameter)
                assert "alloc_grad" in device_events and "free_grad" in device_events, (name, device_events)
            if any(home == HOST for home, _ in tiers):
                assert "alloc_grad" in host_events and "fetch" in device_events, (name, host_events, device_events)
            assert all((home, True) in grads for grads in backward_grads for home, _ in tiers), backward_grads


def test_offload_options_are_checked():
    from autopar.offload import runtime_options

    base = {"offload": "auto", "zero_stage": None, "checkpoint": "auto"}
    assert runtime_options(base, plan_given=False) == {**base, "zero_stage": 0}  # recompute planned jointly
    assert runtime_options({**base, "checkpoint": "full"}, plan_given=False)["checkpoint"] == "full"
    assert runtime_options({**base, "offload": "none"}, plan_given=False)["zero_stage"] is None
    assert runtime_options({**base, "zero_stage": "auto"}, plan_given=False)["zero_stage"] == "auto"  # joint ZeRO
    with pytest.raises(ValueError, match="the plan brings its own offload decisions"):
        runtime_options(base, plan_given=True)
    with pytest.raises(ValueError, match="offload must be 'auto', 'none' or an OffloadPolicy"):
        runtime_options({**base, "offload": "yes"}, plan_given=False)
