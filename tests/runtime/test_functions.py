"""Custom autograd.Functions on gloo ranks: loss, every gradient and the parameters after AdamW steps
equal one device running the Functions' own backwards.

The model applies a straight-through rounding and RecurrentGemma's clipped-gradient square root
(structurally elementwise: they may be sharded like their input) and a Function mixing along the
feature dim with a backward that is not its derivative (replicated only), on meshes (2,) and
(2, 2), with an ample and a tight memory budget; a Megatron tensor-parallel plan keeps the
elementwise Functions sharded between the column- and the row-split Linear (no gather around them).
A deeper model's blocks run them inside recompute regions and in a pipeline (elementwise only: one
that may combine samples blocks micro-batching), and at bf16.
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


class HalfGradientTanh(torch.autograd.Function):
    """tanh with half its derivative as the gradient: elementwise and smooth (a rounding's ties
    would let float noise flip a value between training steps)."""

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return 0.5 * grad * (1 - y * y)


class Block(nn.Module):
    def __init__(self, width: int = 64, hidden: int = 256, mix: bool = True):
        super().__init__()
        self.mixes = mix
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)
        self.mix = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x):
        h = HalfGradientTanh.apply(self.up(x))
        h = SqrtBoundDerivative.apply(h * h)
        out = self.down(h) / 64
        return x + (CumulativeMix.apply(out, self.mix) if self.mixes else out * self.mix)


class Deep(nn.Module):
    def __init__(self, depth: int = 4, mix: bool = True):
        super().__init__()
        self.blocks = nn.ModuleList(Block(mix=mix) for _ in range(depth))

    def forward(self, x, target):
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(x, target)


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


# AdamW on the small model; SGD with momentum on the deep one, whose near-zero gradient elements
# (cancelling sums, |g| << eps) make an Adam step amplify float32 summation-order noise, data
# parallelism's alike: the gradients, not the optimizer, are what is tested.
OPTIMIZERS = {"adamw": (torch.optim.AdamW, {"lr": 1e-3}), "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})}


def _single(model, inputs, optimizer="adamw"):
    model = copy.deepcopy(model)
    cls, kwargs = OPTIMIZERS[optimizer]
    opt = cls(model.parameters(), **kwargs)
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


def _body(rank, world, model, inputs, plan, optimizer="adamw"):
    pm = autopar.autoparallelize(copy.deepcopy(model), inputs, plan=plan)
    cls, kwargs = OPTIMIZERS[optimizer]
    opt = pm.optimizer(cls, **kwargs)
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


def _equal_to_one_device(model, inputs, plan, mesh, optimizer="adamw"):
    ref_losses, ref_grads, ref_params = _single(model, inputs, optimizer)
    losses, grads, params = run_local(_body, math.prod(mesh), model, inputs, plan, optimizer, timeout=300)[0]
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
    # pipeline=1 throughout: no pipeline candidates searched (what is tested is the sharded Functions)
    ample = autopar.plan(model, inputs, mesh=_fast(mesh), pipeline=1, cache=False)
    plan = ample
    if budget == "tight":
        low = smallest_budget(lambda b: autopar.plan(model, inputs, mesh=_fast(mesh), memory_budget=b, pipeline=1,
                                                     cache=False))
        plan = autopar.plan(model, inputs, mesh=_fast(mesh), pipeline=1, cache=False,
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


def _deep(mix: bool = True):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    return Deep(mix=mix), {"x": torch.randn(256, 64, generator=gen), "target": torch.randn(256, 64, generator=gen)}


@pytest.mark.timeout(600)
def test_recompute_regions_rerun_functions_like_one_device():
    """Half the no-recompute peak: blocks are recomputed in backward, their Functions with them."""
    model, inputs = _deep()
    base = autopar.plan(model, inputs, mesh=(2,), memory_budget=None, checkpoint="none", pipeline=1, cache=False)
    plan = autopar.plan(model, inputs, mesh=(2,), memory_budget=base.estimate.peak_bytes // 2, pipeline=1,
                        cache=False)
    assert any("autograd_function" in name for region in plan.recompute for name in region.nodes)
    _equal_to_one_device(model, inputs, plan, (2,), "sgd")


@pytest.mark.timeout(600)
def test_a_pipeline_runs_elementwise_functions_like_one_device():
    """Micro-batches run a Function on part of the batch: right for an elementwise one (it may be
    split on the batch dim); a Function only ever replicated is refused, naming it."""
    model, inputs = _deep()
    with pytest.raises(NotImplementedError, match=r"node 'autograd_function.*combines samples of the batch"):
        autopar.plan(model, inputs, mesh=(2,), pipeline=2, cache=False)
    model, inputs = _deep(mix=False)
    plan = autopar.plan(model, inputs, mesh=(2,), pipeline=2, cache=False)
    assert plan.pipeline is not None
    _equal_to_one_device(model, inputs, plan, (2,), "sgd")


def _bf16_body(rank, world, model, inputs):
    pm = autopar.autoparallelize(copy.deepcopy(model), inputs, mesh=(2,), precision="bf16", pipeline=1)
    loss = pm(**inputs)
    loss.backward()
    return loss.item(), pm.full_gradients()


@pytest.mark.timeout(300)
def test_bf16_runs_functions_at_bf16_like_one_device():
    """precision='bf16': the Functions compute at bf16 on the ranks as the bf16 graph does on one
    device, with their own backward (the inlined derivatives would be off by half: the tanh's
    gradient is halved); bf16 summation order allows a few percent."""
    from autopar.tracer import trace

    model, inputs = _deep()
    one = copy.deepcopy(model)
    traced = trace(one, inputs, precision="bf16")
    calls = [n for n in traced.nodes if n.target is torch.ops.autopar.autograd_function.default]
    assert calls and all(v.meta["val"].dtype == torch.bfloat16 for n in calls for v in n.args[1])
    (want_loss,) = traced.gm(*traced.bind(one, inputs))
    want_loss.backward()
    loss, grads = run_local(_bf16_body, 2, model, inputs, timeout=300)[0]
    assert loss == pytest.approx(want_loss.item(), rel=2e-2)
    for name, p in one.named_parameters():
        # in norm: the clipped square root of tanh(.)^2 magnifies bf16 rounding near 0 (1/(2|h|))
        assert (grads[name] - p.grad).norm() <= 5e-2 * p.grad.norm(), name
