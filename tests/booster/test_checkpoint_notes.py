"""Checkpoints as the notes document them, round-tripped on 2 gloo ranks for every plugin.

``save_model(model, checkpoint, shard=False, gather_dtensor=True, prefix=None,
size_per_shard=1024, use_safetensors=False)`` and ``save_optimizer(optimizer, checkpoint,
shard=False, gather_dtensor=True, prefix=None, size_per_shard=1024)`` are called POSITIONALLY in
the notes' order; ``load_model`` / ``load_optimizer`` detect a file or a directory.

Per plugin (AutoParallelPlugin, TorchDDPPlugin, TorchFSDPPlugin, LowLevelZeroPlugin): the CNN
with AdamW and a StepLR trains two steps; the model is saved sharded (Hugging Face safetensors
with the index naming the shard files), as one file, and with a prefix; the optimizer as a DCP
directory and as one file; the scheduler; two more steps give the uninterrupted losses. A
freshly boosted, differently initialised model loads the sharded directory, the optimizer (one
rank count's file or directory, per plugin) and the scheduler, and its two steps repeat those
losses and end at the same parameters. A plain, never boosted model loads the single file and
the directory on every rank and equals the saved state.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from autopar.runtime.launch import run_local
from tests.booster.cnn import fake_cifar, resnet18

WORLD, STEPS = 2, 2


def _plugin(name: str):
    from autopar.booster import AutoParallelPlugin, LowLevelZeroPlugin, TorchDDPPlugin, TorchFSDPPlugin

    if name == "LowLevelZeroPlugin":
        return LowLevelZeroPlugin(2, "fp32")  # stage 2, fp32: exact continuation
    return {"AutoParallelPlugin": AutoParallelPlugin, "TorchDDPPlugin": TorchDDPPlugin,
            "TorchFSDPPlugin": TorchFSDPPlugin}[name]()


def _boosted(name: str, seed: int, dataset):
    from autopar.booster import Booster

    torch.manual_seed(seed)
    model = resnet18(num_classes=10)
    plugin = _plugin(name)
    booster = Booster(plugin=plugin)
    loader = plugin.prepare_dataloader(dataset, batch_size=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, criterion, loader, scheduler = booster.boost(
        model, optimizer, torch.nn.CrossEntropyLoss(), loader, scheduler)
    return booster, model, optimizer, criterion, list(loader), scheduler


def _train(booster, model, optimizer, criterion, batches, scheduler) -> list[float]:
    losses = []
    for img, label in batches:
        loss = criterion(model(img), label)
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
    return losses


def _round_trip(rank, world, name, path, optimizer_file):
    dataset = fake_cifar(32)
    booster, model, optimizer, criterion, batches, scheduler = _boosted(name, 0, dataset)
    before = _train(booster, model, optimizer, criterion, batches[:STEPS], scheduler)
    sharded, single, prefixed = (os.path.join(path, n) for n in ("sharded", "model.safetensors", "prefixed"))
    booster.save_model(model, sharded, True, True, "", 0.002, True)  # the notes' order; ~2 KiB shards
    booster.save_model(model, single, False, True, None, 1024, True)
    booster.save_model(model, prefixed, True, True, "cnn", 0.002)  # .bin shards named cnn-pytorch_model-...
    optim_path = os.path.join(path, "optim.pt" if optimizer_file else "optim")
    booster.save_optimizer(optimizer, optim_path, not optimizer_file, True, None, 1024)
    booster.save_lr_scheduler(scheduler, os.path.join(path, "sched.pt"))
    saved = model.full_state_dict()
    after = _train(booster, model, optimizer, criterion, batches[STEPS:], scheduler)
    final = model.full_state_dict()

    booster2, model2, optimizer2, criterion2, _, scheduler2 = _boosted(name, 1, dataset)
    booster2.load_model(model2, sharded)
    booster2.load_optimizer(optimizer2, optim_path)
    booster2.load_lr_scheduler(scheduler2, os.path.join(path, "sched.pt"))
    loaded = model2.full_state_dict()
    resumed = _train(booster2, model2, optimizer2, criterion2, batches[STEPS:], scheduler2)

    plain = {}
    for label, source in (("single", single), ("sharded", sharded), ("prefixed", prefixed)):
        fresh = resnet18(num_classes=10)  # never boosted
        booster.load_model(fresh, source)
        plain[label] = fresh.state_dict()
    return {"before": before, "after": after, "resumed": resumed, "saved": saved, "loaded": loaded,
            "final": final, "final2": model2.full_state_dict(), "plain": plain,
            "files": {d: sorted(os.listdir(os.path.join(path, d))) for d in ("sharded", "prefixed")}}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, optimizer_file", [
    ("AutoParallelPlugin", True), ("TorchDDPPlugin", False),
    # the default suite's time: these two run with `pytest -m full_sweep`
    pytest.param("TorchFSDPPlugin", True, marks=pytest.mark.full_sweep),
    pytest.param("LowLevelZeroPlugin", False, marks=pytest.mark.full_sweep)])
def test_checkpoints_round_trip_into_boosted_and_plain_models(tmp_path, name, optimizer_file):
    results = run_local(_round_trip, WORLD, name, str(tmp_path), optimizer_file, timeout=280)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"]) == set(results[0]["saved"])  # every tensor, named as the model names it
    assert (tmp_path / "model.safetensors").is_file()
    buffers = {n for n, _ in resnet18(num_classes=10).named_buffers()}
    for rank, res in enumerate(results):
        assert res["files"]["sharded"] == sorted([*shards, "model.safetensors.index.json"])
        assert "cnn-pytorch_model.bin.index.json" in res["files"]["prefixed"]
        assert all(f.startswith("cnn-pytorch_model") for f in res["files"]["prefixed"])
        assert res["resumed"] == pytest.approx(res["after"], rel=1e-5), (res["after"], res["resumed"])
        # rank 0's tensors: DDP's batch-norm statistics are each rank's own until the next forward
        # broadcasts rank 0's, and rank 0 writes the files
        for key, value in results[0]["saved"].items():
            assert torch.equal(res["loaded"][key], value), key
            for label, state in res["plain"].items():
                assert torch.equal(state[key], value), (label, key)
            if rank == 0 or key not in buffers:  # (FSDP2 never syncs them: rank 1's own differ)
                assert torch.allclose(res["final2"][key], res["final"][key], rtol=1e-5, atol=1e-7), key


def _refusals(rank, world, path):
    from autopar.booster import Booster, TorchDDPPlugin

    booster = Booster(plugin=TorchDDPPlugin())
    net = resnet18(num_classes=10)
    model, optimizer, *_ = booster.boost(net, torch.optim.SGD(net.parameters(), lr=1.0))
    booster.save_model(model, os.path.join(path, "model.pt"))
    messages = []
    for call in (lambda: booster.load_model(resnet18(num_classes=10), os.path.join(path, "nothing")),
                 lambda: booster.load_model(resnet18(num_classes=5), os.path.join(path, "model.pt")),
                 lambda: booster.save_model(model, os.path.join(path, "x"), True, True, "a/b"),
                 lambda: booster.load_optimizer(optimizer, os.path.join(path, "nothing"))):
        try:
            call()
            messages.append(None)
        except ValueError as exc:
            messages.append(str(exc))
    return messages


@pytest.mark.timeout(120)
def test_checkpoint_refusals_name_the_problem(tmp_path):
    for messages in run_local(_refusals, WORLD, str(tmp_path), timeout=100):
        assert "no such model checkpoint" in messages[0]
        assert "fc.weight: checkpoint shape [10, 8], model [5, 8]" in messages[1]
        assert "prefix must be None or a file-name prefix" in messages[2]
        assert "no such optimizer checkpoint" in messages[3]
