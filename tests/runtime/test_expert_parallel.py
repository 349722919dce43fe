"""Expert parallelism on gloo: experts split over a mesh axis, tokens sent by all-to-all, equal to one device.

Mixtral tiny, Qwen2-MoE tiny (4 experts, top-2) and DeepSeek-V3 tiny (shared plus 4 routed
experts, top-2 within the best 1 of 2 groups), pinned with ``ep_size``: loss and every gradient
equal the single-device model's, on (2,), (4,) and (2, 2) (expert parallelism on one axis, the
planner's choice on the other), and after AdamW steps the parameters too.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import autopar
from autopar.layout.placement import TensorSpec
from autopar.runtime.launch import run_local
from tests.tracer.test_experts import mixtral, qwen2_moe

STEPS = 2


def _inputs():
    ids = torch.randint(0, 101, (8, 8), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "labels": ids}


def _single(model, inputs):
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grads = [], None
    for step in range(STEPS):
        loss = model(**inputs).loss
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _body(rank, world, model, inputs, plan):
    pm = autopar.autoparallelize(copy.deepcopy(model), inputs, plan=plan)
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-3)
    losses, grads = [], None
    for step in range(STEPS):
        loss = pm(**inputs).loss
        loss.backward()
        if step == 0:
            grads = pm.full_gradients()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads, pm.full_state_dict()


def deepseek_v3():
    """Shared plus routed experts with group-limited routing (the sweep's tiny DeepSeek-V3)."""
    from tests.sweeps.hf_catalog import deepseek_entry

    torch.manual_seed(0)
    model = deepseek_entry().build()[0]
    config = model.config  # routing limited to the best topk_group of n_group expert groups
    assert config.n_group > config.topk_group >= 1 and config.n_shared_experts >= 1
    return model


@pytest.mark.parametrize("make,mesh", [
    pytest.param(mixtral, (2,), id="mixtral-2"),
    pytest.param(qwen2_moe, (4,), id="qwen2moe-4", marks=pytest.mark.full_sweep),  # default suite's time
    pytest.param(qwen2_moe, (2, 2), id="qwen2moe-2x2"),
    pytest.param(mixtral, (2, 2), id="mixtral-2x2", marks=pytest.mark.full_sweep),
    pytest.param(deepseek_v3, (2,), id="deepseek-v3-2"),
    pytest.param(deepseek_v3, (2, 2), id="deepseek-v3-2x2", marks=pytest.mark.full_sweep)])
def test_expert_parallel_equals_one_device(make, mesh):
    model, inputs = make(), _inputs()
    ep = mesh[0]
    plan = autopar.plan(model, inputs, mesh=mesh, ep_size=ep, pipeline=1, cache=False)  # no pipeline candidates
    experts = [n for n in plan.nodes if n.op == "autopar.moe_experts.default"]
    assert experts
    for n in experts:  # experts split ep ways, the tokens over the same axes (the all-to-all dispatch)
        hidden, gate_up = TensorSpec.parse(n.input_specs[0]), TensorSpec.parse(n.input_specs[3])
        assert math.prod(mesh[a] for a in gate_up.shard_axes(0)) == ep
        assert set(gate_up.shard_axes(0)) <= set(hidden.shard_axes(0))
    ref_losses, ref_grads, ref_params = _single(model, inputs)
    losses, grads, params = run_local(_body, math.prod(mesh), model, inputs, plan, timeout=300)[0]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
    for name, p in ref_params.items():
        torch.testing.assert_close(params[name], p, rtol=1e-4, atol=1e-6, msg=name)
