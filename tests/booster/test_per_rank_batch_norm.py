"""``AutoParallelPlugin(batch_norm_stats="per_rank")`` trains a ResNet-style CNN as torch DDP does.

Through the product notes' loop (``prepare_dataloader``, ``boost`` with a criterion,
``booster.backward``, ``optimizer.step()``) on gloo ranks, against torch's DDP run in the same
processes on each rank's contiguous chunk of the same global batches: the losses and the
parameters after SGD steps agree, while the plugin's default (global statistics) does not.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from autopar.booster import AutoParallelPlugin, Booster
from autopar.runtime.launch import run_local
from tests.booster.cnn import fake_cifar, resnet18

WORLD, BATCH, STEPS = 2, 4, 2  # BATCH: samples per rank per step


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=5e-4)


def _train(rank, world, model, dataset):
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    ddp_opt = _sgd(ddp.parameters())
    global_batch = BATCH * world
    ddp_losses = []
    for step in range(STEPS):  # torch DDP: rank r takes rows [r BATCH, (r + 1) BATCH) of global batch `step`
        start = step * global_batch + rank * BATCH
        img, label = dataset[start:start + BATCH]
        loss = torch.nn.functional.cross_entropy(ddp(img), label)
        loss.backward()
        ddp_opt.step()
        ddp_opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        ddp_losses.append(mean.item() / world)
    out = {"ddp": (ddp_losses, {k: v.detach().clone() for k, v in ddp.module.named_parameters()})}
    for stats in ("per_rank", "global"):
        plugin = AutoParallelPlugin(mesh=(world,), batch_norm_stats=stats)
        booster = Booster(plugin=plugin)
        local = copy.deepcopy(model)
        loader = plugin.prepare_dataloader(dataset, batch_size=BATCH, drop_last=True)
        module, optimizer, criterion, loader, _ = booster.boost(local, _sgd(local.parameters()),
                                                                torch.nn.CrossEntropyLoss(), dataloader=loader)
        losses = []
        for _, (img, label) in zip(range(STEPS), loader):
            loss = criterion(module(img), label)
            booster.backward(loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss))
        out[stats] = (losses, {k: v.detach().clone() for k, v in module.full_state_dict().items()})
    return out


@pytest.mark.timeout(200)
def test_per_rank_plugin_trains_as_torch_ddp():
    torch.manual_seed(0)
    model = resnet18(num_classes=10).double().train()  # float64: rounding far below a wrong statistic
    images, labels = fake_cifar(BATCH * WORLD * STEPS).tensors
    dataset = torch.utils.data.TensorDataset(images.double(), labels)
    for out in run_local(_train, WORLD, model, dataset, timeout=180):
        ddp_losses, ddp_params = out["ddp"]
        losses, params = out["per_rank"]
        assert losses == pytest.approx(ddp_losses, rel=1e-9, abs=1e-12)
        for name, want in ddp_params.items():
            assert torch.allclose(params[name], want, rtol=1e-8, atol=1e-10), name
        # The default keeps the whole batch's statistics: another training.
        assert out["global"][0][0] != pytest.approx(ddp_losses[0], rel=1e-6)


def test_the_plugin_checks_and_passes_the_option():
    assert AutoParallelPlugin(batch_norm_stats="per_rank").autoparallelize_kwargs()["batch_norm_stats"] == "per_rank"
    with pytest.raises(ValueError, match=r"batch_norm_stats must be one of \('global', 'per_rank'\), got 'local'"):
        AutoParallelPlugin(batch_norm_stats="local")
