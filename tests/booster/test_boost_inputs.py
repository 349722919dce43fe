"""What ``boost`` reads of a batch and of its arguments, without processes: which elements of a
tuple batch are the model's inputs under the notes' ``criterion(output, label)``, the swapped
(dataloader, criterion) of the notes' plugin pages, and ``mixed_precision`` with torch plugins."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.booster import AutoParallelPlugin, Booster, TorchDDPPlugin, TorchFSDPPlugin
from autopar.booster.dataloader import model_inputs


class One(nn.Module):
    def forward(self, x):
        return x


class TwoAndOptional(nn.Module):
    def forward(self, x, y, mask=None):
        return x


class Starred(nn.Module):
    def forward(self, *xs):
        return xs


class AllOptional(nn.Module):  # Hugging Face style: every argument has a default
    def forward(self, input_ids=None, labels=None):
        return input_ids


def test_tuple_batches_split_into_inputs_and_targets():
    img, label, extra = torch.zeros(2, 3), torch.zeros(2), torch.zeros(2, 1)
    assert model_inputs((img, label), One().forward) == ((img,), 1)
    assert model_inputs([img, label, extra], TwoAndOptional().forward) == ((img, label), 1)
    assert model_inputs((img, label), Starred().forward) == ((img, label), 0)
    assert model_inputs((img, label), AllOptional().forward) == ((img,), 1)
    assert model_inputs((img, label), None) == ((img, label), 0)  # no criterion: all are the model's
    batch = {"input_ids": img, "labels": label}
    assert model_inputs(batch, One().forward) == (batch, 0)
    assert model_inputs(img, One().forward) == ((img,), 0)


def test_the_notes_swapped_dataloader_and_criterion_are_refused():
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 2)), batch_size=2)
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"criterion must be callable, got DataLoader; .*pass them by keyword"):
        Booster(plugin=TorchDDPPlugin()).boost(model, None, loader, nn.MSELoss())
    with pytest.raises(ValueError, match="criterion must be callable, got DataLoader"):
        Booster(plugin=AutoParallelPlugin()).boost(model, None, loader, nn.MSELoss())


def test_mixed_precision_with_torch_plugins_is_torch_amp():
    from torch.distributed.fsdp import MixedPrecision

    assert Booster(mixed_precision="fp16", plugin=TorchDDPPlugin())._autocast is torch.float16
    assert Booster(mixed_precision=torch.bfloat16, plugin=TorchFSDPPlugin())._autocast is torch.bfloat16
    assert Booster(mixed_precision="fp32", plugin=TorchDDPPlugin())._autocast is None
    with pytest.raises(ValueError, match="conflicts with TorchFSDPPlugin's own mixed_precision"):
        Booster(mixed_precision="bf16", plugin=TorchFSDPPlugin(mixed_precision=MixedPrecision(torch.bfloat16)))
    with pytest.raises(ValueError, match="mixed_precision must be one of"):
        Booster(mixed_precision="fp8", plugin=TorchDDPPlugin())


def test_fp16_torch_mixed_precision_record_maps_onto_planned_plugins():
    from autopar.booster import FP16TorchMixedPrecision, LowLevelZeroPlugin

    record = FP16TorchMixedPrecision(init_scale=1024.0, growth_interval=3)
    planned = Booster(mixed_precision=record, plugin=AutoParallelPlugin(max_norm=1.0)).plugin
    assert (planned.precision, planned.initial_scale, planned.growth_interval, planned.max_norm) == \
        ("fp16", 1024.0, 3, 1.0)
    # LowLevelZeroPlugin's own constructor: the copy keeps its stage (dataclasses.replace could not)
    zero = Booster(mixed_precision="fp16", plugin=LowLevelZeroPlugin(stage=2, precision="fp32")).plugin
    assert isinstance(zero, LowLevelZeroPlugin) and (zero.precision, zero.stage, zero.zero_stage) == ("fp16", 2, 2)
    assert Booster(mixed_precision=record, plugin=LowLevelZeroPlugin()).plugin.initial_scale == 1024.0
    with pytest.raises(ValueError, match="conflicts with the plugin's initial_scale=8.0"):
        Booster(mixed_precision=record, plugin=AutoParallelPlugin(initial_scale=8.0))
    with pytest.raises(ValueError, match="backoff_factor must be in"):
        FP16TorchMixedPrecision(backoff_factor=1.5)


def _ddp_with_record(rank, world):
    from autopar.booster import FP16TorchMixedPrecision

    booster = Booster(mixed_precision=FP16TorchMixedPrecision(init_scale=256.0, growth_interval=1),
                      plugin=TorchDDPPlugin())
    net = nn.Linear(4, 2)
    model, optimizer, criterion, *_ = booster.boost(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.MSELoss())
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    scales, dtypes = [], []
    for _ in range(2):
        out = model(x)
        loss = criterion(out, y)
        dtypes.append((out.dtype, loss.dtype))
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        scales.append(optimizer.scaler.get_scale())
    return scales, dtypes


@pytest.mark.timeout(60)
def test_fp16_torch_mixed_precision_record_sets_the_torch_plugins_scaler():
    from autopar.runtime.launch import run_local

    for scales, dtypes in run_local(_ddp_with_record, 2, timeout=50):
        assert scales == [512.0, 1024.0]  # from 256, grown after every step without overflow
        assert dtypes == [(torch.float16, torch.float32)] * 2  # autocast forward, the loss in fp32
