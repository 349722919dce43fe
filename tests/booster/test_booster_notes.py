"""Issue 29: the product notes' ``Booster(mixed_precision="fp16", plugin=...)``.

The keyword maps onto the plugin's precision (the plugin plans fp16 compute and owns the loss
scaler); a plugin already set to another non-default precision is refused naming both values.
"""

from __future__ import annotations

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
