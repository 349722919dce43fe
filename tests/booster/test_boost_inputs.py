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
