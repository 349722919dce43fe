"""Every plugin on every model family (issue 29 point 4): the Booster's plugins trained the
product notes' way on 4 gloo ranks equal one device.

The matrix: ``TorchDDPPlugin``, ``TorchFSDPPlugin``, ``LowLevelZeroPlugin`` stage 1 and 2,
``GeminiPlugin`` (static ZeRO-3 chunks), ``HybridParallelPlugin`` tp=2 x dp=2, tp=2 x pp=2 and
pp=2 x dp=2, and ``AutoParallelPlugin``, x GPT-2 tiny, Llama tiny and a transformers family
outside ``autopar.zoo`` (Qwen2: grouped-query attention, biased q/k/v projections). Each case is
``plugin.prepare_dataloader`` (``batch_size`` per data-parallel rank) -> ``booster.boost`` ->
``booster.backward`` (or ``booster.execute_pipeline`` for a pipeline) -> ``optimizer.step()``,
5 AdamW steps of a different batch each; fp32: every gradient of the first step, every step's
loss and every parameter after the steps equal single-device training on the whole batch (rtol
1e-4). fp16: the notes' AMP page (``TorchDDPPlugin``, ``Booster(mixed_precision="fp16")``,
``LinearWarmupLR``) and ZeRO-2 fp16 against one device's autocast + GradScaler with the same
scaler settings, within twice that reference's own distance from fp32.

The default suite runs one case (ZeRO-2 on the model outside the zoo); ``pytest -m full_sweep``
runs the rest.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist

from autopar import zoo
from autopar.layout.mesh import MeshSpec
from autopar.runtime.launch import run_local
from tests.booster.test_hybrid_plugin import lm_batches

WORLD, STEPS, BATCH, SEQ, LR = 4, 5, 8, 16, 1e-3
# Adam divides by sqrt(v) + eps: a gradient that is zero in exact arithmetic (attention's key bias)
# is rounding, which a tiny eps would turn into lr-sized steps differing with the summation order.
EPS, PARAM_ATOL, GRAD_ATOL = 1e-6, 1e-5, 1e-6
FP16_EPS = 1e-4  # large enough that a gradient left scaled (or unscaled twice) moves the update


def _plugin(name: str, precision: str = "fp32"):
    from autopar.booster import (AutoParallelPlugin, GeminiPlugin, HybridParallelPlugin, LowLevelZeroPlugin,
                                 TorchDDPPlugin, TorchFSDPPlugin)

    return {
        "torch-ddp": lambda: TorchDDPPlugin(),
        "torch-fsdp": lambda: TorchFSDPPlugin(),
        "zero1": lambda: LowLevelZeroPlugin(stage=1, precision=precision),
        "zero2": lambda: LowLevelZeroPlugin(stage=2, precision=precision, initial_scale=2.0**16),
        "gemini": lambda: GeminiPlugin(precision=precision),
        "tp2": lambda: HybridParallelPlugin(tp_size=2, pp_size=1, precision=precision),
        "tp2xpp2": lambda: HybridParallelPlugin(tp_size=2, pp_size=2, precision=precision, num_microbatches=2),
        "pp2": lambda: HybridParallelPlugin(tp_size=1, pp_size=2, precision=precision, num_microbatches=2),
        "auto": lambda: AutoParallelPlugin(precision=precision),
        # Candidate meshes: (4,) priced with links 1000x slower, so the plan on (2, 2) must win.
        "auto-meshes": lambda: AutoParallelPlugin(mesh=[_slow_flat(), MeshSpec.preset("cpu", (2, 2))],
                                                  pp_size="auto", precision=precision),
    }[name]()


def _slow_flat():
    from dataclasses import replace

    flat = MeshSpec.preset("cpu", (WORLD,))
    return replace(flat, alpha=tuple(a * 1e3 for a in flat.alpha), beta=tuple(b * 1e3 for b in flat.beta))


PLUGINS = ("torch-ddp", "torch-fsdp", "zero1", "zero2", "gemini", "tp2", "tp2xpp2", "pp2", "auto", "auto-meshes")
MODELS = ("gpt2", "llama-8b", "qwen2")


def _build(name: str):
    torch.manual_seed(0)
    if name == "qwen2":  # outside the zoo
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                             attn_implementation="sdpa", use_cache=False, tie_word_embeddings=False)
        model = Qwen2ForCausalLM(config).train()
    else:
        model, _ = zoo.build(name, tiny=True, batch=BATCH, seq=SEQ, device="cpu")
    return model, lm_batches(model.config.vocab_size, batch=BATCH, seq=SEQ, steps=STEPS)


def _scheduler(optimizer, warmup: bool):
    from autopar.optim.lr_scheduler import LinearWarmupLR

    return LinearWarmupLR(optimizer, total_steps=2 * STEPS, warmup_steps=2) if warmup else None


def _single_device(model, batches, *, fp16: bool = False, eps: float = EPS, init_scale: float = 2.0**16,
                   growth_interval: int = 2000, warmup: bool = False):
    """Losses, first-step gradients (unscaled) and final parameters of AdamW on the whole batch;
    under ``fp16`` with autocast and torch's GradScaler of the given settings."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=eps)
    sched = _scheduler(opt, warmup)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval, enabled=fp16)
    losses, grads = [], None
    for batch in batches:
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            loss = model(**batch).loss
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if grads is None:
            grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses, grads, {k: v.detach().clone() for k, v in model.named_parameters()}


def _train(rank, world, model, batches, name, precision, mixed_precision, eps, warmup):
    from autopar.booster import Booster
    from autopar.booster.torch_plugins import TorchParallelModule

    torch.manual_seed(rank)  # the plugins, not the seed, must make the ranks agree
    plugin = _plugin(name, precision)
    booster = Booster(plugin=plugin, mixed_precision=mixed_precision)
    dp = plugin.data_parallel_size() if hasattr(plugin, "data_parallel_size") else world
    # The notes' loader: batch_size samples per data-parallel rank, global batches in order.
    dataset = [{k: v[i] for k, v in batch.items()} for batch in batches for i in range(BATCH)]
    loader = plugin.prepare_dataloader(dataset, batch_size=BATCH // dp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=eps)
    module, optimizer, _, loader, scheduler = booster.boost(model, optimizer, dataloader=loader,
                                                            lr_scheduler=_scheduler(optimizer, warmup))
    plan = getattr(module, "plan", None)
    losses, grads = [], None
    for batch in loader:
        if plan is not None and plan.pipeline is not None:
            loss = booster.execute_pipeline(iter([batch]), module, None, optimizer)["loss"]
        else:
            loss = module(**batch).loss
            booster.backward(loss, optimizer)
        if grads is None:
            grads = module.full_gradients()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        loss = loss.detach().float().clone()
        if isinstance(module, TorchParallelModule):  # torch's engines return this rank's samples' loss
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
    return losses, grads, module.full_state_dict(), None if plan is None else tuple(plan.mesh.shape)


def _check_fp32(plugin: str, model_name: str) -> None:
    model, batches = _build(model_name)
    ref_losses, ref_grads, ref_params = _single_device(model, batches)
    results = run_local(_train, WORLD, model, batches, plugin, "fp32", None, EPS, False, timeout=600)
    for rank, (losses, grads, state, mesh) in enumerate(results):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"rank {rank} losses: {m}")
        for key, value in ref_grads.items():
            torch.testing.assert_close(grads[key], value, rtol=1e-4, atol=GRAD_ATOL,
                                       msg=lambda m, k=key: f"rank {rank} first-step gradient {k}: {m}")
        for key, value in ref_params.items():
            torch.testing.assert_close(state[key], value, rtol=1e-4, atol=PARAM_ATOL,
                                       msg=lambda m, k=key: f"rank {rank} parameter {k}: {m}")
        want = {"tp2": (2, 2), "tp2xpp2": (2, 2), "pp2": (2, 2), "auto-meshes": (2, 2)}.get(plugin)
        assert want is None or mesh == want, (plugin, mesh)  # the plugin's layout, not a fallback


DEFAULT_CASE = ("zero2", "qwen2")


@pytest.mark.slow
@pytest.mark.timeout(660)
@pytest.mark.parametrize("plugin, model_name", [
    (p, m) if (p, m) == DEFAULT_CASE else pytest.param(p, m, marks=pytest.mark.full_sweep)
    for p in PLUGINS for m in MODELS])
def test_fp32_equals_one_device(plugin, model_name):
    _check_fp32(plugin, model_name)


def _relative_update(got: dict, want: dict, start: dict) -> float:
    """|got - want| over |want - start|, over all parameters: the distance of two runs relative to
    how far training moved the weights."""
    diff = sum(float(((got[k] - want[k]).double() ** 2).sum()) for k in want)
    norm = sum(float(((want[k] - start[k]).double() ** 2).sum()) for k in want)
    return math.sqrt(diff / norm)


@pytest.mark.slow
@pytest.mark.full_sweep
@pytest.mark.timeout(660)
@pytest.mark.parametrize("plugin", ["torch-ddp", "zero2"])
def test_fp16_within_autocast_tolerance(plugin):
    """fp16 with a dynamic loss scale against one device's autocast + GradScaler of the same
    settings (torch-ddp: the notes' AMP page, ``Booster(mixed_precision="fp16")`` and
    ``LinearWarmupLR``; ZeRO-2: the plugin's own fp16, initial scale 2**16, growth interval
    1000): losses within 1e-3 and the weights within twice the reference's own distance from fp32
    training (relative to how far the weights moved)."""
    model, batches = _build("gpt2")
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    warmup = plugin == "torch-ddp"
    settings = dict(eps=FP16_EPS, warmup=warmup, growth_interval=2000 if warmup else 1000)
    ref_losses, _, ref16 = _single_device(model, batches, fp16=True, **settings)
    _, _, ref32 = _single_device(model, batches, **settings)
    tolerance = 2 * _relative_update(ref16, ref32, start) + 1e-3
    precision, mixed = ("fp32", "fp16") if warmup else ("fp16", None)
    for losses, _, state, _ in run_local(_train, WORLD, model, batches, plugin, precision, mixed, FP16_EPS, warmup,
                                         timeout=600):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-3, atol=1e-3)
        assert _relative_update(state, ref16, start) <= tolerance, tolerance
