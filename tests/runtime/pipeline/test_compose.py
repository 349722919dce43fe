"""Pipelined stages compose with bf16, ZeRO-1, DCP and a global gradient-norm clip (issue 15).

GPT-2 tiny (4 layers, tied ``wte`` on both stages) on 4 gloo ranks as mesh (2, 2), 2 stages,
1F1B with 4 micro-batches of 2, every stage planned on its (2,) sub-mesh:

- bf16 (the plan's precision: ``trace(precision="bf16")``, fp32 masters): 3 AdamW steps track
  the single-device ``torch.autocast(bfloat16)`` run within 2% at every step (the bound the
  non-pipelined bf16 test uses), parameters, gradients and optimizer state are fp32 DTensors,
  the stage graphs compute in bf16; with ZeRO-1 (``pm.optimizer(AdamW, zero_stage=1)``) the same
  losses;
- DCP: ``torch.distributed.checkpoint`` saves ``pm.state_dict()`` and the AdamW state
  (``get_optimizer_state_dict``) of a pipeline after one step; a pipeline built from other
  initial weights loads both, and its next step equals the original's next step exactly;
- ``pm.clip_grad_norm_``: the global norm over both stages (the tied weight counted once)
  equals ``torch.nn.utils.clip_grad_norm_`` of the single-device model, and the clipped
  gradients equal the single-device clipped ones.

One launch, with a timeout; the plans and references are made in the parent.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from autopar import zoo
from autopar.api import plan_traced
from autopar.planner.options import PlanOptions
from autopar.planner.pipeline.assemble import pipeline_plan
from autopar.planner.pipeline.geometry import PIPELINE_CASTS
from autopar.plans import stage_mesh_of
from autopar.runtime.dtensors import local_of
from autopar.runtime.launch import run_local
from autopar.runtime.pipeline import build_pipeline
from autopar.runtime.pipeline.split import split_stages, stage_of_nodes
from autopar.strategies import needs_decomposition
from autopar.tracer import profile, trace
from tests.runtime.pipeline.test_pipeline import close, fast_mesh, warm_strategy_cache

pytestmark = pytest.mark.slow  # many processes

LR, EPS, STEPS, MICRO, NUM_MICRO, MAX_NORM = 1e-3, 1e-5, 3, 2, 4, 0.05


def _plan(model, micro, precision: str):
    # Traced as the API traces a pipeline: a tied weight gets one cast per reading module.
    traced = trace(model, micro, decompose_if=needs_decomposition, precision=precision, param_casts=PIPELINE_CASTS)
    mesh = fast_mesh((2, 2))
    sub = plan_traced(traced, profile(traced), mesh=stage_mesh_of(mesh), options=PlanOptions(precision=precision)).plan
    plan = pipeline_plan(sub, traced, mesh=mesh, num_stages=2, num_microbatches=NUM_MICRO, schedule="1f1b")
    warm_strategy_cache(traced, plan)
    return traced, plan


def _autocast_losses(model, batch) -> list[float]:
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), lr=LR, eps=EPS)
    losses = []
    for _ in range(STEPS):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _clip_reference(model, batch) -> dict:
    m = copy.deepcopy(model)
    m(**batch).loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM)
    return {"norm": norm, "grads": {k: p.grad.clone() for k, p in m.named_parameters(remove_duplicate=False)}}


def _bf16_errors(rank, model, traced, plan, batch, want) -> list[str]:
    errors = []
    for zero in (0, 1):
        pm = build_pipeline(model, traced, plan, device="cpu")
        opt = pm.optimizer(torch.optim.AdamW, lr=LR, eps=EPS, zero_stage=zero)
        losses, dtypes = [], set()
        for _ in range(STEPS):
            losses.append(pm.step(**batch).item())
            dtypes |= {(p.dtype, p.grad.dtype, type(p.grad).__name__) for p in pm.parameters()}
            opt.step()
            opt.zero_grad()
        label = f"rank {rank} bf16 zero{zero}"
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, want))
        if not worst < 0.02:
            errors.append(f"{label}: losses {losses} vs autocast {want} (worst {worst:.4f})")
        if dtypes != {(torch.float32, torch.float32, "DTensor")}:
            errors.append(f"{label}: parameter/gradient dtypes {dtypes}")
        states = {v.dtype for s in opt.state.values() for k, v in s.items() if k != "step"}
        if states != {torch.float32}:
            errors.append(f"{label}: optimizer state dtypes {states}")
        if "torch.bfloat16" not in pm.code:
            errors.append(f"{label}: the stage graphs do not compute in bf16")
        if zero and not opt.pieces:
            errors.append(f"{label}: no ZeRO pieces")
    return errors


def _dcp_errors(rank, model, traced, plan, batch, path) -> list[str]:
    pm = build_pipeline(model, traced, plan, device="cpu")
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    pm.step(**batch)
    opt.step()
    opt.zero_grad()
    dcp.save({"model": pm.state_dict(), "optim": get_optimizer_state_dict(pm, opt)}, checkpoint_id=path)
    pm.step(**batch)
    opt.step()
    want = pm.full_state_dict()
    other = build_pipeline(model, traced, plan, device="cpu", seed=1, init_weights=False)  # zeros
    other_opt = torch.optim.AdamW(other.parameters(), lr=LR, eps=EPS)
    other.step(**batch)  # AdamW state exists (of the wrong values) before the load
    other_opt.step()
    other_opt.zero_grad()
    state = {"model": other.state_dict(), "optim": get_optimizer_state_dict(other, other_opt)}
    dcp.load(state, checkpoint_id=path)
    set_optimizer_state_dict(other, other_opt, state["optim"])
    other.step(**batch)
    other_opt.step()
    got = other.full_state_dict()
    return [f"rank {rank} dcp: {k} differs after load + step" for k in want if not torch.equal(got[k], want[k])]


def _clip_errors(rank, model, traced, plan, batch, ref) -> list[str]:
    pm = build_pipeline(model, traced, plan, device="cpu")
    pm.step(**batch)
    norm = pm.clip_grad_norm_(MAX_NORM)
    errors = close(f"rank {rank} global grad norm", norm, ref["norm"])
    grads = pm.full_gradients()
    errors += [e for k, want in ref["grads"].items() for e in close(f"rank {rank} clipped grad {k}", grads[k], want)]
    held = [p for p in pm.parameters() if p.grad is not None]
    if any(local_of(p.grad).dtype != torch.float32 for p in held) or not held:
        errors.append(f"rank {rank}: no fp32 gradients held")
    return errors


def _body(rank, world, model, fp32, bf16, batch, refs, path):
    errors = _bf16_errors(rank, model, *bf16, batch, refs["autocast"])
    errors += _dcp_errors(rank, model, *fp32, batch, path)
    errors += _clip_errors(rank, model, *fp32, batch, refs["clip"])
    return errors


def test_pipeline_composes_with_bf16_zero1_dcp_and_clipping(tmp_path):
    torch.manual_seed(0)
    model, micro = zoo.build("gpt2", tiny=True, num_layers=4, batch=MICRO, device="cpu")
    torch.manual_seed(1)
    _, batch = zoo.build("gpt2", tiny=True, num_layers=4, batch=MICRO * NUM_MICRO, device="cpu")
    refs = {"autocast": _autocast_losses(model, batch), "clip": _clip_reference(model, batch)}
    assert refs["clip"]["norm"] > 2 * MAX_NORM  # the clip really clips
    fp32, bf16 = _plan(model, micro, "fp32"), _plan(model, micro, "bf16")
    # The tied wte is cast on each stage holding it: no bf16 copy crosses the cut.
    traced, plan = bf16
    wte = next(p.name for p in traced.placeholders if p.fqn == "transformer.wte.weight")
    casts = [u.name for u in traced.node(wte).users if u.target is torch.ops.aten._to_copy.default]
    stage_of = stage_of_nodes(traced, plan.pipeline)
    assert sorted(stage_of[c] for c in casts) == [0, 1]
    assert not set(casts) & {v for st in split_stages(traced, plan.pipeline) for v in st.inputs}
    errors = run_local(_body, 4, model, fp32, bf16, batch, refs, str(tmp_path / "ckpt"), timeout=240)
    flat = [e for rank_errors in errors for e in rank_errors]
    assert not flat, "\n".join(flat[:20])


def test_unknown_precision_and_zero2_are_refused_inside_stages():
    import dataclasses

    model, micro = zoo.build("mlp", tiny=True, num_layers=2, batch=MICRO, device="cpu")
    traced = trace(model, micro, decompose_if=needs_decomposition)
    sub = plan_traced(traced, profile(traced), mesh=(1,)).plan
    plan = pipeline_plan(sub, traced, mesh=fast_mesh((2,)), num_stages=2, num_microbatches=2, schedule="gpipe")
    with pytest.raises(ValueError, match="compute in fp32, bf16 or fp16, the plan asks for 'fp8'"):
        build_pipeline(model, traced, dataclasses.replace(plan, precision="fp8"), device="cpu")
    nodes = tuple(dataclasses.replace(n, zero_stage=2) if n.kind == "parameter" else n for n in plan.nodes)
    with pytest.raises(ValueError, match="ZeRO-1 at most"):
        build_pipeline(model, traced, dataclasses.replace(plan, nodes=nodes), device="cpu")
