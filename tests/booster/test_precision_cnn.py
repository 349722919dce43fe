"""A model outside the zoo (the ResNet-style CNN, batch norm included) with ``(img, label)``
batches and the notes' ``criterion(outputs, labels)``, under fp32, fp16 and bf16, for the
planned plugins (AutoParallelPlugin, LowLevelZeroPlugin) on 2 gloo ranks.

fp32 equals one device on the global batch. fp16 and bf16 are compared with one device under
``torch.autocast`` (fp16 with torch's ``GradScaler`` of the plugin's scaler settings): the
plan computes in the low dtype with fp32 master weights and losses in fp32, autocast chooses
per op, so they agree to the low dtype's rounding; the loss scale after the steps is the same.
The default suite runs fp32 (AutoParallelPlugin) and fp16 (LowLevelZeroPlugin); ``-m
full_sweep`` adds AutoParallelPlugin fp16 and bf16 and LowLevelZeroPlugin bf16.
"""

from __future__ import annotations

import copy

import pytest
import torch

from autopar.runtime.launch import run_local
from tests.booster.cnn import fake_cifar, resnet18

WORLD, STEPS, BATCH, LR, SCALE = 2, 3, 8, 0.05, 2.0**12
DTYPES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}
# (loss, parameters) tolerances: fp32 exact up to summation order; the low dtypes to their rounding
TOLERANCE = {"fp32": (1e-5, 1e-5), "fp16": (5e-3, 5e-3), "bf16": (3e-2, 3e-2)}


def _train(rank, world, name, precision, model, dataset):
    from autopar.booster import AutoParallelPlugin, Booster, LowLevelZeroPlugin

    plugin = (LowLevelZeroPlugin(stage=1, precision=precision, initial_scale=SCALE) if name == "LowLevelZeroPlugin"
              else AutoParallelPlugin(precision=precision, initial_scale=SCALE))
    booster = Booster(plugin=plugin)
    loader = plugin.prepare_dataloader(dataset, batch_size=BATCH // world, drop_last=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model, optimizer, criterion, loader, _ = booster.boost(model, optimizer, torch.nn.CrossEntropyLoss(), loader)
    losses = []
    for step, (img, label) in enumerate(loader):
        loss = criterion(model(img), label)
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step + 1 == STEPS:
            break
    scale = optimizer.scaler.get_scale() if optimizer.scaler is not None else None
    return {"losses": losses, "state": model.full_state_dict(), "scale": scale, "loss_dtype": loss.dtype}


def one_device(model, dataset, precision):
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    dtype = DTYPES[precision]
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_factor=2.0, backoff_factor=0.5,
                                  growth_interval=1000, enabled=dtype is torch.float16)
    losses = []
    for step in range(STEPS):
        img, label = dataset[step * BATCH:(step + 1) * BATCH]
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = torch.nn.functional.cross_entropy(model(img), label)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict(), scaler.get_scale() if dtype is torch.float16 else None


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name, precision", [
    ("AutoParallelPlugin", "fp32"), ("LowLevelZeroPlugin", "fp16"),
    # the other two pairs take the same paths (a low-precision plan, the autocast criterion, the
    # scaler or none): the whole sweep runs them
    pytest.param("AutoParallelPlugin", "fp16", marks=pytest.mark.full_sweep),
    pytest.param("AutoParallelPlugin", "bf16", marks=pytest.mark.full_sweep),
    pytest.param("LowLevelZeroPlugin", "bf16", marks=pytest.mark.full_sweep)])
def test_cnn_with_tuple_batches_matches_one_device(name, precision):
    torch.manual_seed(0)
    model, dataset = resnet18(num_classes=10), fake_cifar(BATCH * STEPS)
    want, state, scale = one_device(model, dataset, precision)
    assert not torch.allclose(state["fc.weight"], model.fc.weight)  # the steps were taken, not skipped
    loss_tol, param_tol = TOLERANCE[precision]
    for res in run_local(_train, WORLD, name, precision, model, dataset, timeout=220):
        assert res["loss_dtype"] == torch.float32  # the criterion runs under autocast: losses in fp32
        assert res["losses"] == pytest.approx(want, rel=loss_tol), (res["losses"], want)
        assert res["scale"] == scale
        for key, value in state.items():
            if value.is_floating_point():
                assert torch.allclose(res["state"][key], value, rtol=param_tol, atol=param_tol), key
