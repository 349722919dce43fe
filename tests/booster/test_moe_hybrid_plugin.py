"""``MoeHybridParallelPlugin``: the hybrid plugin with expert parallelism over the data-parallel ranks.

On 4 gloo ranks Mixtral tiny (4 experts, top-2) with ``ep_size`` over every data-parallel rank --
tp=2 x (dp=ep=2) -- trains 3 SGD steps through the booster like one device
(losses, every first-step gradient, final parameters), and the plan splits every experts op by
expert over the data-parallel axis with its tokens (the all-to-all dispatch). Under ``full_sweep``
also ep=4 alone and ep=2 with Ulysses sequence parallelism on an sp axis of 2 (the later releases'
``enable_sequence_parallelism=True, sp_size=2``: mesh (dp, sp)).
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

from autopar.booster import Booster, HybridParallelPlugin, MoeHybridParallelPlugin
from autopar.layout.placement import TensorSpec
from autopar.runtime.launch import run_local
from tests.tracer.test_experts import mixtral

LR, STEPS = 1e-2, 3


def test_signature_extends_the_hybrid_plugin():
    params = list(inspect.signature(MoeHybridParallelPlugin.__init__).parameters)[1:4]
    assert params == ["tp_size", "pp_size", "ep_size"]
    plugin = MoeHybridParallelPlugin(2, 1, 2, "fp32")  # the hybrid plugin's arguments follow, in its order
    assert isinstance(plugin, HybridParallelPlugin)
    assert (plugin.tp_size, plugin.ep_size, plugin.precision) == (2, 2, "fp32")
    assert plugin.layout(4).family == "ep x megatron"
    assert MoeHybridParallelPlugin(1, 1, 4).layout(4).family == "ep"
    assert MoeHybridParallelPlugin(2, 1, 1).layout(4).family == "dp x megatron"  # ep 1: no expert split


def test_ep_size_is_checked():
    with pytest.raises(ValueError, match="ep_size"):
        MoeHybridParallelPlugin(1, 1, 0)
    with pytest.raises(NotImplementedError, match="ep_size=2"):
        MoeHybridParallelPlugin(1, 1, 2).layout(4)  # part of the 4 data-parallel ranks


def _batches():
    g = torch.Generator().manual_seed(5)
    return [{"input_ids": (ids := torch.randint(0, 128, (8, 8), generator=g)), "labels": ids} for _ in range(STEPS)]


def _single(model, batches):
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses, grads = [], None
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        grads = grads or {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads, {n: p.detach() for n, p in model.named_parameters()}


def _body(rank, world, model, batches, tp, ep, sp):
    extra = dict(enable_sequence_parallelism=True, sp_size=sp) if sp > 1 else {}  # Ulysses, the product's default
    booster = Booster(plugin=MoeHybridParallelPlugin(tp, 1, ep, precision="fp32", **extra))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    pm, opt, *_ = booster.boost(model, opt, meta_inputs=batches[0])
    losses, grads = [], None
    for batch in batches:
        loss = pm(**batch).loss
        booster.backward(loss, opt)
        grads = grads or pm.full_gradients()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads, pm.full_state_dict(), pm.plan


@pytest.mark.slow
# ep=4 alone: with the whole sweeps; the expert split over the data-parallel axis and its all-to-all
# dispatch train like one device in the default suite's tp2-ep2.
@pytest.mark.parametrize("tp,ep,sp", [(2, 2, 1), pytest.param(1, 4, 1, marks=pytest.mark.full_sweep),
                                      pytest.param(1, 2, 2, marks=pytest.mark.full_sweep)],
                         ids=["tp2-ep2", "ep4", "ep2-sp2-all_to_all"])
def test_trains_like_one_device(tp, ep, sp):
    model, batches = mixtral(vocab=128), _batches()  # a vocabulary tp splits
    ref_losses, ref_grads, ref_params = _single(model, batches)
    losses, grads, params, plan = run_local(_body, 4, model, batches, tp, ep, sp, timeout=400)[0]
    if sp > 1:  # Ulysses on the sp axis (the last): every attention split on its heads there
        attention = [n for n in plan.nodes if n.op == "aten.scaled_dot_product_attention.default"]
        assert attention and all(TensorSpec.parse(n.input_specs[0]).shard_axes(1) == (1,) for n in attention)
    experts = [n for n in plan.nodes if n.op == "autopar.moe_experts.default"]
    assert experts
    for n in experts:  # split by expert over the data-parallel axis (0), the tokens with them
        assert TensorSpec.parse(n.input_specs[3]).shard_axes(0) == (0,)
        assert 0 in TensorSpec.parse(n.input_specs[0]).shard_axes(0)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
    # SGD with momentum: an update proportional to the gradients, so rounding-level gradient
    # differences stay rounding-level (Adam would scale an element's at-rounding gradient up to lr).
    for name, p in ref_params.items():
        torch.testing.assert_close(params[name], p, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
