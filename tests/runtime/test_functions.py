"""Custom autograd.Functions on gloo ranks: loss, every gradient and the parameters after AdamW steps
equal one device running the Functions' own backwards.

The model applies a straight-through rounding and RecurrentGemma's clipped-gradient square root
(structurally elementwise: they may be sharded like their input) and a Function mixing along the
feature dim with a backward that is not its derivative (replicated only), on meshes (2,) and
(2, 2), with an ample and a tight memory budget; and a Megatron tensor-parallel plan keeps the
elementwise Functions sharded between the column- and the row-split Linear (no gather around them).
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.layout.mesh import MeshSpec
from autopar.layout.placement import TensorSpec
from autopar.planner.options import PlanOptions
from autopar.planner.orchestrate import plan_family
from autopar.runtime.launch import run_local
from tests.budgets import between, smallest_budget
from tests.tracer.test_functions import CumulativeMix, SqrtBoundDerivative, StraightThroughRound

STEPS = 2
OP = "autopar.autograd_function.default"


class Model(nn.Module):
    def __init__(self, width: int = 64, hidden: int = 256):
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)
        self.mix = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x, target):
        h = StraightThroughRound.apply(4 * self.up(x))
        h = SqrtBoundDerivative.apply(h * h)  # |h|, with 0 exactly where the rounding gave 0: the clip
        out = CumulativeMix.apply(self.down(h) / 16, self.mix)
        return F.mse_loss(out, target)


def _setup():
    torch.manual_seed(0)
    model = Model()
    gen = torch.Generator().manual_seed(1)
    inputs = {"x": torch.randn(16, 64, generator=gen), "target": torch.randn(16, 64, generator=gen)}
    return model, inputs


def _single(model, inputs):
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grads = [], None
    for step in range(STEPS):
        loss = model(**inputs)
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
        loss = pm(**inputs)
        loss.backward()
        if step == 0:
            grads = pm.full_gradients()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads, pm.full_state_dict()


def _fast(shape):
    """Nearly free links: the solver splits compute wherever it can."""
    mesh = MeshSpec.preset("cpu", shape)
    return dataclasses.replace(mesh, alpha=(1e-7,) * len(shape), beta=(1e-13,) * len(shape), name="fast-links")


def _equal_to_one_device(model, inputs, plan, mesh):
    ref_losses, ref_grads, ref_params = _single(model, inputs)
    losses, grads, params = run_local(_body, math.prod(mesh), model, inputs, plan, timeout=300)[0]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
    for name, p in ref_params.items():
        torch.testing.assert_close(params[name], p, rtol=1e-4, atol=1e-6, msg=name)


def _function_nodes(plan):
    return [n for n in plan.nodes if n.op == OP]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mesh", [(2,), (2, 2)], ids=str)
@pytest.mark.parametrize("budget", ["ample", "tight"])
def test_custom_functions_train_like_one_device(mesh, budget):
    model, inputs = _setup()
    ample = autopar.plan(model, inputs, mesh=_fast(mesh), cache=False)
    plan = ample
    if budget == "tight":
        low = smallest_budget(lambda b: autopar.plan(model, inputs, mesh=_fast(mesh), memory_budget=b, cache=False))
        plan = autopar.plan(model, inputs, mesh=_fast(mesh), cache=False,
                            memory_budget=between(low, ample.estimate.peak_bytes, 0.25))
        assert plan.estimate.peak_bytes < ample.estimate.peak_bytes
    assert len(_function_nodes(plan)) == 3
    _equal_to_one_device(model, inputs, plan, mesh)


@pytest.mark.timeout(300)
def test_tensor_parallel_keeps_elementwise_functions_sharded():
    model, inputs = _setup()
    plan = plan_family(model, inputs, "megatron", mesh=_fast((2,)), options=PlanOptions(checkpoint="none"))
    rounding, root, mix = _function_nodes(plan)
    for node in rounding, root:  # the column-split Linear's output, sharded on the features: no gather
        assert TensorSpec.parse(node.input_specs[0]).shard_axes(1) == (0,), node.strategy
        assert TensorSpec.parse(node.output_specs[0]).shard_axes(1) == (0,), node.strategy
    assert all(TensorSpec.parse(s).is_replicated() or TensorSpec.parse(s).shard_axes(0)
               for s in mix.input_specs if s), mix.strategy  # never split along the mixed dim
    _equal_to_one_device(model, inputs, plan, (2,))
