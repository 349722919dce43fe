"""Issue 29: the product notes' ``Booster(mixed_precision="fp16", plugin=...)``.

The keyword maps onto the plugin's precision (the plugin plans fp16 compute and owns the loss
scaler); a plugin already set to another non-default precision is refused naming both values.
And ``boost(model, optimizer, criterion, lr_scheduler=...)`` without a data loader: the model is
planned at its first forward (2 gloo ranks, the same losses and weights as one device).
"""

from __future__ import annotations

import copy

import pytest
import torch

from autopar import zoo
from autopar.booster import AutoParallelPlugin, Booster
from autopar.runtime.launch import run_local


def test_mixed_precision_maps_onto_the_plugin_and_conflicts_raise():
    plugin = AutoParallelPlugin(max_norm=1.0, initial_scale=1024.0)
    booster = Booster(mixed_precision="fp16", plugin=plugin)
    assert booster.plugin.precision == "fp16" and booster.plugin.max_norm == 1.0
    assert booster.plugin.initial_scale == 1024.0 and plugin.precision == "fp32"  # the caller's plugin is unchanged
    same = Booster(plugin=AutoParallelPlugin(precision="bf16"), mixed_precision=torch.bfloat16)
    assert same.plugin.precision == "bf16"
    assert Booster(mixed_precision="fp16").plugin.precision == "fp16"
    with pytest.raises(ValueError, match=r"mixed_precision='fp16'.*precision='bf16'"):
        Booster(mixed_precision="fp16", plugin=AutoParallelPlugin(precision="bf16"))
    with pytest.raises(ValueError, match="mixed_precision must be one of"):
        Booster(mixed_precision="fp8", plugin=AutoParallelPlugin())


def _boost(rank, world, model, inputs):
    booster = Booster(mixed_precision="fp16", plugin=AutoParallelPlugin())
    pm, bopt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1), meta_inputs=inputs)
    booster.backward(pm(**inputs)[0], bopt)
    bopt.step()
    return pm.plan.precision, bopt.scaler is not None


@pytest.mark.timeout(120)
def test_mixed_precision_fp16_trains_with_a_loss_scaler_on_2_ranks():
    torch.manual_seed(0)
    model, inputs = zoo.build("mlp", tiny=True, device="cpu", batch=8, seq=4)
    for precision, scaled in run_local(_boost, 2, model, inputs, timeout=100):
        assert precision == "fp16" and scaled


def _no_loader(rank, world, model, batches):
    import contextlib
    import io

    from autopar.booster.deferred import DeferredModule

    booster = Booster(AutoParallelPlugin(max_norm=1.0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        pm, bopt, crit, loader, sched = booster.boost(model, opt, None, lr_scheduler=sched)
    assert isinstance(pm, DeferredModule) and loader is None and crit is None
    try:
        bopt.step()
        early = None
    except RuntimeError as exc:
        early = str(exc)
    losses = []
    for batch in batches:
        bopt.zero_grad()  # before the first forward too: the notes' loop starts with it
        loss = pm(**batch)[0]
        booster.backward(loss, bopt)
        bopt.step()
        sched.step()
        losses.append(loss.item())
    return {"losses": losses, "early": early, "printed": printed.getvalue(), "lr": bopt.param_groups[0]["lr"],
            "state": pm.full_state_dict()}


@pytest.mark.timeout(120)
def test_boost_without_a_dataloader_plans_at_the_first_forward():
    torch.manual_seed(0)
    model, inputs = zoo.build("mlp", tiny=True, device="cpu", batch=8, seq=4)
    gen = torch.Generator().manual_seed(1)
    batches = [{k: (torch.randn(v.shape, generator=gen) if v.is_floating_point() else v) for k, v in inputs.items()}
               for _ in range(3)]
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    want = []
    for batch in batches:
        opt.zero_grad()
        loss = ref(**batch)[0]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        sched.step()
        want.append(loss.item())
    for rank, res in enumerate(run_local(_no_loader, 2, model, batches, timeout=100)):
        assert res["early"] and "planned at its first forward" in res["early"]
        assert res["losses"] == pytest.approx(want, rel=1e-4)
        assert res["lr"] == pytest.approx(1e-2 * 0.5 ** 3)  # the scheduler drives the rebuilt optimizer
        state = ref.state_dict()
        assert all(torch.allclose(res["state"][k], state[k], rtol=1e-4, atol=1e-6) for k in state)
        assert ("planned at its first forward" in res["printed"]) == (rank == 0)
