"""Mixed precision on real gloo processes (issue 13, point 4).

- bf16: GPT-2 tiny on a (2, 2) mesh trains 20 AdamW steps within 2% of a single-device
  ``torch.autocast(bfloat16)`` run at every step; parameters, gradients and optimizer state are
  fp32 DTensors; the partial gradients of cast weights are summed in fp32 (``reduce_dtype``) in
  the buckets, in bf16 when asked; the plan's activation estimate is about half of fp32's, and
  the bytes really saved for backward match it within 10%.
- fp16: ``autopar.GradScaler`` -- an inf injected into ONE rank's gradient makes every rank skip
  that step and lower the scale; clean steps train.
"""

from __future__ import annotations

import copy
import weakref

import pytest
import torch

import autopar
from autopar import zoo
from autopar.api import plan as make_plan
from autopar.runtime.bucketing import GradBucketer
from autopar.runtime.dtensors import local_of
from autopar.runtime.launch import run_local
from autopar.tracer import trace

pytestmark = pytest.mark.slow

STEPS = 20


def _model(batch=8, seq=32):
    torch.manual_seed(0)
    return zoo.build("gpt2", tiny=True, batch=batch, seq=seq, device="cpu")


def _autocast_losses(model, inputs, steps):
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _bf16_body(rank, world, model, inputs, reduce_dtypes):
    # bf16 sums: 5 steps show the buckets and the training; the 20-step comparison is fp32's
    return [_bf16_run(model, inputs, r, STEPS if r == "fp32" else 5) for r in reduce_dtypes]


def _bf16_run(model, inputs, reduce_dtype, steps):
    pm = autopar.autoparallelize(copy.deepcopy(model), inputs, mesh=(2, 2), precision="bf16", pipeline=1,
                                 reduce_dtype=reduce_dtype, init_weights=False)
    pm.load_full_state_dict(model.state_dict())
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    losses, dtypes = [], set()
    for _ in range(steps):
        loss = pm(**inputs).loss
        loss.backward()
        dtypes |= {(str(p.dtype), str(p.grad.dtype), type(p.grad).__name__) for p in pm.parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state_dtypes = {str(v.dtype) for s in opt.state.values() for k, v in s.items() if k != "step"}
    buckets = [m for m in pm.modules() if isinstance(m, GradBucketer)]
    slot_dtypes = {str(s.dtype) for b in buckets for s in b.slots}
    return losses, dtypes, state_dtypes, slot_dtypes, pm.plan.precision, pm.plan.reduce_dtype


def test_bf16_gpt2_2x2_tracks_single_device_autocast():
    model, inputs = _model(batch=16, seq=64)  # big enough a batch for data-parallel weights
    want = _autocast_losses(model, inputs, STEPS)
    reduce_dtypes = ("fp32", "bf16")
    results = run_local(_bf16_body, 4, model, inputs, reduce_dtypes, timeout=300)
    for (losses, dtypes, state_dtypes, slot_dtypes, precision, reduce), reduce_dtype in (
            (run, r) for rank_runs in results for run, r in zip(rank_runs, reduce_dtypes)):
        assert (precision, reduce) == ("bf16", reduce_dtype)
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, want))  # zip: the first len(losses) steps
        assert worst < 0.02, (worst, losses, want)
        assert losses == results[0][reduce_dtypes.index(reduce_dtype)][0]  # every rank sees the same loss
        assert losses[-1] < losses[0] - (0.5 if len(losses) == STEPS else 0.1)  # it trains
        assert dtypes == {("torch.float32", "torch.float32", "DTensor")}
        assert state_dtypes == {"torch.float32"}
        # Data-parallel gradients of the bf16 weight casts are bucketed, in the reduce dtype.
        assert slot_dtypes == {{"fp32": "torch.float32", "bf16": "torch.bfloat16"}[reduce_dtype]}


def _saved_body(rank, world, model, inputs, plans):
    from autopar.runtime.build import build_module

    out = []
    for precision, plan, traced in plans:
        pm = build_module(model, traced, plan, device=torch.device("cpu"))
        fixed = {local_of(t).untyped_storage().data_ptr() for t in [*pm.parameters(), *pm.buffers(), *inputs.values()]}
        seen = []

        def pack(t):
            if t.untyped_storage().data_ptr() not in fixed:
                seen.append(weakref.ref(t))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            res = pm(**inputs)
        alive = {}
        for ref in seen:
            t = ref()
            if t is not None:
                alive[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        res.loss.backward()
        out.append((precision, sum(alive.values())))
    return out


def test_bf16_activation_estimate_halves_and_matches_what_is_saved():
    """Not exactly half: the bf16 weight copies matmuls save are replicated, and the loss reads
    fp32 logits (as under autocast); at a batch where activations dominate it is ~0.57."""
    model, inputs = _model(batch=32, seq=128)
    plans = [(p, make_plan(model, inputs, mesh=(2, 2), precision=p, checkpoint="none",
                                                pipeline=1)) for p in ("fp32", "bf16")]
    est = {p: plan.checkpoint["activation_bytes"] for p, plan in plans}
    # Up to 0.65: since a view is priced as moving no byte (strategies.combine), a view costs the
    # same sharded or replicated, and the bf16 plan (at the same step estimate within 1%) runs a few
    # ops around views replicated that it ran sharded before: 0.63 of fp32's bytes (0.53 before).
    assert 0.45 < est["bf16"] / est["fp32"] < 0.65, est
    assert plans[1][1].estimate.peak_bytes < plans[0][1].estimate.peak_bytes
    # traced once here per precision, not on every rank
    runs = [(p, plan, trace(model, inputs, precision=p)) for p, plan in plans]
    for rank_result in run_local(_saved_body, 4, model, inputs, runs, timeout=300):
        for precision, saved in rank_result:
            assert abs(saved - est[precision]) <= 0.10 * est[precision], (precision, saved, est[precision])


def _fp16_body(rank, world, model, inputs):
    pm = autopar.autoparallelize(copy.deepcopy(model), inputs, mesh=(2,), precision="fp16", init_weights=False,
                                 pipeline=1)
    pm.load_full_state_dict(model.state_dict())
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    scaler = autopar.GradScaler("cpu", init_scale=2.0**12)
    record = []
    for step in range(6):
        before = {k: v.detach().clone() for k, v in pm.full_state_dict().items()}
        loss = pm(**inputs).loss
        scaler.scale(loss).backward()
        if step == 2 and rank == 1:  # an overflow on ONE rank only
            grad = next(p.grad for p in pm.parameters() if p.grad is not None and local_of(p.grad).numel())
            local_of(grad).view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        after = pm.full_state_dict()
        moved = any(not torch.equal(before[k], after[k]) for k in before)
        record.append((loss.item(), moved, scaler.get_scale()))
    return record


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere():
    model, inputs = _model()
    results = run_local(_fp16_body, 2, model, inputs, timeout=300)
    assert results[0] == results[1]
    losses, moved, scales = zip(*results[0])
    assert moved == (True, True, False, True, True, True)
    assert scales == (2.0**12, 2.0**12, 2.0**11, 2.0**11, 2.0**11, 2.0**11)
    assert losses[-1] < losses[0]  # the clean steps train


def _mismatch_body(rank, world, model, inputs, plan):
    with pytest.raises(ValueError, match="precision='fp32' but the plan was made for bf16"):
        autopar.autoparallelize(copy.deepcopy(model), inputs, plan=plan, precision="fp32")
    pm = autopar.autoparallelize(copy.deepcopy(model), inputs, plan=plan)  # the plan's precision
    return pm.plan.precision, pm(**inputs).loss.dtype


def test_a_loaded_plan_brings_its_precision():
    model, inputs = _model()
    plan = make_plan(model, inputs, mesh=(2,), precision="bf16", pipeline=1)
    assert plan.precision == "bf16" and "bf16 compute" in plan.summary()
    assert autopar.Plan.from_json(plan.to_json()).precision == "bf16"
    for result in run_local(_mismatch_body, 2, model, inputs, plan, timeout=300):
        assert result == ("bf16", torch.float32)
