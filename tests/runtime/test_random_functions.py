"""Custom autograd.Functions that draw random numbers (SEW-D's ``XDropout``) train on gloo ranks like
autopar on mesh ``(1,)``: the loss, every gradient and the parameters after 3 AdamW steps.

Each call draws from torch's generator seeded with the key of autopar's draw and its node
(``autopar.strategies._functions``), on every rank alike; its backward reseeds it to recompute
the forward, so the Function's saved mask is the forward's. On mesh ``(1,)`` the first step's
masks are the eager Function's under those seeds (``autopar/strategies/rng.py``'s contract: one
device means autopar on ``(1,)``). Also: inside recompute regions, the pipeline's refusal naming
the Function, and HF SEW-D at its default dropout 0.1 in training mode on (2,).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.layout.placement import TensorSpec
from autopar.runtime.build import build_module
from autopar.runtime.launch import run_local
from autopar.runtime.nodes import KernelCall
from autopar.strategies import rng
from tests.runtime.random_models import assert_same, plan_for, traced_of
from autopar.tracer.functions import function_call, function_draws
from tests.tracer.test_functions import MaskDropout

SEED, STEPS = 1234, 3
OP = torch.ops.autopar.autograd_function.default
KERNEL = "autograd_function_seeded"


class Dropping(nn.Module):
    """``MaskDropout``; with ``seeds`` set (the eager reference), each call under the next seed."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p, self.seeds = p, None

    def forward(self, x):
        if self.seeds is None:
            return MaskDropout.apply(x, self.p)
        with torch.random.fork_rng():
            torch.manual_seed(self.seeds.pop(0))
            return MaskDropout.apply(x, self.p)


class Block(nn.Module):
    def __init__(self, width: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(width, hidden), nn.Linear(hidden, width), Dropping(0.25)

    def forward(self, x):
        return x + self.down(self.drop(torch.tanh(self.up(x))))


class Model(nn.Module):
    def __init__(self, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(depth))

    def forward(self, x, target):
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(x, target)


def _setup():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    return Model(), {"x": torch.randn(8, 16, generator=gen), "target": torch.randn(8, 16, generator=gen)}


def _train(rank, world, model, traced, plan, inputs):
    autopar.manual_seed(SEED)
    pm = build_module(model, traced, plan, device=torch.device("cpu"))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    losses, first = [], None
    for _ in range(STEPS):
        opt.zero_grad()
        out = pm(**inputs)
        loss = out if isinstance(out, torch.Tensor) else out.loss
        loss.backward()
        losses.append(loss.detach().clone())
        if first is None:
            first = pm.full_gradients()
        opt.step()
    kernels = sum(isinstance(m, KernelCall) and m.name == KERNEL for m in pm.modules())
    return torch.stack(losses), first, pm.full_state_dict(), kernels


def _run(model, traced, plan, inputs):
    world = 1
    for s in plan.mesh.shape:
        world *= s
    results = run_local(_train, world, model, traced, plan, inputs, timeout=240)
    for other in results[1:]:
        assert torch.equal(other[0], results[0][0]), "ranks disagree on the loss"
    return results[0]


def _eager_first_step(model, inputs, traced):
    """The loss and gradients of the plain model, each Function call under the seed autopar's
    kernel gives it at step 0 (the key of ``Draw(SEED, 0)`` and the call's node)."""
    model = copy.deepcopy(model)
    draw = rng.Draw(SEED, 0)
    seeds = [draw.key(n.name) for n in traced.nodes if n.target is OP]
    drops = [m for m in model.modules() if isinstance(m, Dropping)]
    assert len(seeds) == len(drops)
    for m, seed in zip(drops, seeds):
        m.seeds = [seed]
    loss = model(**inputs)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def one_device():
    model, inputs = _setup()
    traced, prof = traced_of(model, inputs)
    return model, inputs, traced, prof, _run(model, traced, plan_for(traced, prof, (1,)), inputs)


@pytest.mark.timeout(600)
def test_mesh_one_draws_the_eager_functions_masks_under_the_same_seeds(one_device):
    model, inputs, traced, _, got = one_device
    losses, grads, _, kernels = got
    assert kernels == 2  # every call runs the seeded kernel, a size-1 mesh too
    want_loss, want_grads = _eager_first_step(model, inputs, traced)
    torch.testing.assert_close(losses[0], want_loss)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, msg=name)
    assert len(set(losses.tolist())) == STEPS  # each step draws other masks (and trains)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("shape,recompute", [((2,), False), ((2, 2), False), ((2,), True)],
                         ids=["(2,)", "(2, 2)", "(2,)-recompute"])
def test_drawing_functions_train_like_mesh_one(one_device, shape, recompute):
    model, inputs, traced, prof, want = one_device
    plan = plan_for(traced, prof, shape, recompute=recompute)
    calls = [n for n in plan.nodes if "autograd_function" in n.op]
    assert len(calls) == 2
    for node in calls:  # replicated only: a shard would draw the whole tensor's first numbers
        assert all(TensorSpec.parse(s).is_replicated() for s in (*node.input_specs, *node.output_specs) if s), \
            node.strategy
    if recompute:
        assert sum("autograd_function" in name for region in plan.recompute for name in region.nodes) == 2
    got = _run(model, traced, plan, inputs)
    assert got[3] == 2
    assert_same(f"{shape} recompute={recompute}", got, want)


@pytest.mark.timeout(300)
def test_a_pipeline_is_refused_naming_the_drawing_function():
    """A micro-batch would draw the full batch's first numbers from torch's generator, not its rows."""
    model, inputs = _setup()
    with pytest.raises(NotImplementedError, match=r"node 'autograd_function.*MaskDropout.*draws random numbers"):
        autopar.plan(model, inputs, mesh=(2,), pipeline=2, cache=False)


def _sew_d():
    """HF SEW-D at its default dropout (0.1 hidden, activation, attention and final: ``XDropout``
    inside ``StableDropout``), tiny; SpecAugment off (``mask_time_prob`` 0: it draws with numpy)."""
    import transformers as tf

    cfg = tf.SEWDConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                        conv_dim=[16, 16, 16], conv_stride=[5, 2, 2], conv_kernel=[10, 3, 3],
                        num_feat_extract_layers=3, num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=4,
                        squeeze_factor=2, mask_time_prob=0.0, classifier_proj_size=16, max_position_embeddings=64,
                        position_buckets=16)
    assert (cfg.hidden_dropout, cfg.activation_dropout, cfg.attention_dropout) == (0.1, 0.1, 0.1)  # the defaults
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    inputs = {"input_values": torch.randn(4, 400, generator=gen), "labels": torch.randint(0, 2, (4,), generator=gen)}
    return tf.SEWDForSequenceClassification(cfg).train(), inputs


@pytest.mark.timeout(600)
def test_sew_d_at_its_default_dropout_trains_on_two_ranks_like_mesh_one():
    model, inputs = _sew_d()
    traced, prof = traced_of(model, inputs)
    drawing = [n for n in traced.nodes if n.target is OP and function_draws(n.args[0])]
    assert {function_call(n.args[0]).name.rsplit(".", 1)[-1] for n in drawing} == {"XDropout"}
    want = _run(model, traced, plan_for(traced, prof, (1,)), inputs)
    got = _run(model, traced, plan_for(traced, prof, (2,)), inputs)
    assert want[3] == got[3] == len(drawing)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)  # every step: the draws agree
    for name, g in want[1].items():
        torch.testing.assert_close(got[1][name], g, rtol=1e-4, atol=1e-8, msg=name)
    # AdamW steps each element by ~lr (1e-2) whatever its gradient's size: where |g| is near eps
    # (1e-8) float summation noise (1e-10 here) moves the step by a percent; a wrong mask would
    # change the loss curve and the gradients above.
    for name, p in want[2].items():
        torch.testing.assert_close(got[2][name], p, rtol=1e-4, atol=2e-4, msg=name)
