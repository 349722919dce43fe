"""Resharding checkpoints through ``torch.distributed.checkpoint``: a checkpoint saved under one
plan and mesh loads exactly into a module planned for another.

GPT-2 (tiny) under a budget that forces sharded parameters: trained 2 AdamW steps on 2 ranks
(mesh (2,)) and saved with ``get_state_dict(pm, opt)``; loaded on 4 ranks under mesh (2, 2) and
under mesh (4,) with ``set_state_dict``: parameters and AdamW state are exact, and the next 2
steps give the losses of the uninterrupted 2-rank run. The (2, 2) load saves again, and 2 ranks
load that back exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from autopar import zoo
from autopar.planner.options import PlanOptions
from autopar.planner.orchestrate import plan_traced, trace_for_planning
from autopar.runtime.build import build_module
from autopar.runtime.launch import run_local
from autopar.tracer import profile, trace
from tests.budgets import between, smallest_budget

pytestmark = pytest.mark.slow

LR, STEPS = 1e-3, 2


def _loss(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out.loss


def _full_state(pm, opt) -> dict[str, torch.Tensor]:
    """Parameters (original names) and AdamW state (``<FQN>.<key>``), full tensors."""
    out = {f"param {k}": v for k, v in pm.full_state_dict().items()}
    _, optim_sd = get_state_dict(pm, opt)
    for fqn, state in optim_sd["state"].items():
        for key, value in state.items():
            # a copy: a replicated DTensor's full_tensor() is its live local tensor
            out[f"optim {fqn}.{key}"] = (value.full_tensor() if isinstance(value, DTensor) else value).clone()
    return out


def _steps(pm, opt, inputs) -> list[float]:
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = _loss(pm(**inputs))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _save_body(rank, world, model, inputs, traced, plan, path):
    pm = build_module(model, traced, plan, device=torch.device("cpu"))
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    _steps(pm, opt, inputs)
    model_sd, optim_sd = get_state_dict(pm, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    saved = _full_state(pm, opt)
    return saved, _steps(pm, opt, inputs)


def _load_body(rank, world, model, inputs, traced, plan, path, save_path):
    pm = build_module(model, traced, plan, device=torch.device("cpu"), seed=1)  # other weights
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    model_sd, optim_sd = get_state_dict(pm, opt)  # initialises the AdamW state to load into
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(pm, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = _full_state(pm, opt)
    if save_path is not None:
        model_sd, optim_sd = get_state_dict(pm, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=save_path)
    return loaded, _steps(pm, opt, inputs)


def _assert_same(label: str, got: dict, want: dict) -> None:
    assert set(got) == set(want), (label, sorted(set(got) ^ set(want))[:6])
    assert any(k.startswith("optim") and k.endswith("exp_avg") for k in want), "AdamW state is compared"
    wrong = [k for k, v in want.items() if not torch.equal(got[k], v)]
    assert not wrong, f"{label}: {wrong[:6]}"


def test_checkpoint_reshards_across_meshes_and_world_sizes(tmp_path):
    torch.manual_seed(0)
    model, inputs = zoo.build("gpt2", tiny=True, device="cpu")
    traced = trace(model, inputs)
    # One planning trace and profile for the five plans (``autopar.plan`` would trace each anew).
    planning = trace_for_planning(model, inputs, precision="fp32")
    prof = profile(planning)

    def make_plan(*, mesh, memory_budget):
        return plan_traced(planning, prof, mesh=mesh, options=PlanOptions(memory_budget=memory_budget,
                                                                          pipeline=1)).plan

    # Without a pipeline: its stages would hold whole parameters, and what is resharded here is
    # DTensor pieces. A quarter of the way from mesh (2,)'s smallest budget (the largest of the
    # three meshes') to its unconstrained peak: every mesh must shard parameters to fit.
    replicated = make_plan(mesh=(2,), memory_budget=None)
    low = smallest_budget(lambda budget: make_plan(mesh=(2,), memory_budget=budget))
    budget = between(low, replicated.estimate.peak_bytes, 0.25)
    plans = {shape: make_plan(mesh=shape, memory_budget=budget)
             for shape in ((2,), (2, 2), (4,))}
    layouts = {shape: plan.placements() for shape, plan in plans.items()}
    for shape, layout in layouts.items():  # so each rank's pieces differ between the meshes
        assert any("Shard(" in p for ps in layout.values() for p in ps), f"mesh {shape}: no sharded parameter"
    first, second = str(tmp_path / "mesh2"), str(tmp_path / "mesh2x2")
    saved, continued = run_local(_save_body, 2, model, inputs, traced, plans[(2,)], first, timeout=300)[0]
    for shape, save_path in (((2, 2), second), ((4,), None)):
        for rank, (loaded, losses) in enumerate(run_local(_load_body, 4, model, inputs, traced, plans[shape],
                                                          first, save_path, timeout=300)):
            _assert_same(f"mesh {shape} rank {rank}", loaded, saved)
            assert losses == pytest.approx(continued, rel=1e-4), (shape, losses, continued)
    for rank, (loaded, _) in enumerate(run_local(_load_body, 2, model, inputs, traced, plans[(2,)], second, None,
                                                 timeout=300)):
        _assert_same(f"back on mesh (2,) rank {rank}", loaded, saved)
