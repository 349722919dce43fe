"""A validation pass through the Booster: ``prepare_dataloader`` loaders, ``model.eval()`` between
training steps, on 2 gloo ranks, equal to one device.

The model: a small CNN with a batch norm (dropout 0, so the eager model is the one-device
reference: its training draws nothing), boosted with ``LowLevelZeroPlugin`` (ZeRO-1 data
parallelism) and a ``prepare_dataloader`` training loader; a second ``prepare_dataloader`` loader
gives the validation batches, whole global batches on every rank. 2 SGD steps, an eval
pass over the validation loader (the running statistics the steps wrote), ``.train()`` and a 3rd
step: losses, eval outputs and parameters equal the eager model's.
"""

from __future__ import annotations

import copy

import pytest
import torch

from autopar.booster import Booster
from autopar.runtime.launch import run_local
from tests.runtime.test_eval_mode import SmallCNN

BATCH, LR = 8, 0.1


class Images(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, 6, 6, generator=gen) * (1 + seed)
        self.labels = torch.randint(0, 5, (n,), generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i) -> dict[str, torch.Tensor]:  # a slice: a batch
        return {"x": self.x[i], "labels": self.labels[i]}


def criterion(outputs, batch):
    return outputs["loss"]


def _boosted(rank, world, model, train, val):
    from autopar.booster import LowLevelZeroPlugin

    # data parallel (ZeRO-1): the plan splits the batch, so each rank loads its piece of a training batch
    plugin = LowLevelZeroPlugin(stage=1, precision="fp32")
    booster = Booster(plugin=plugin)
    loader = plugin.prepare_dataloader(train, BATCH // world, drop_last=True)
    val_loader = plugin.prepare_dataloader(val, BATCH // world, drop_last=True)
    pm, opt, crit, loader, _ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=LR), criterion, loader)
    losses, evals, pieces = [], [], []

    def step(batch):
        pieces.append(tuple(batch["x"].shape))
        loss = crit(pm(**batch), batch)
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())

    batches = iter(loader)
    for _ in range(2):
        step(next(batches))
    pm.eval()
    with torch.no_grad():
        evals = [pm(**batch)["logits"] for batch in val_loader]
    pm.train()
    step(next(batches))
    return {"losses": torch.stack(losses), "evals": evals, "pieces": pieces, "local": pm.local_inputs,
            "state": pm.full_state_dict()}


def _one_device(model, train, val, *, optimizer=torch.optim.SGD):
    model = copy.deepcopy(model)
    opt = optimizer(model.parameters(), lr=LR)
    train_batches = [train[i * BATCH:(i + 1) * BATCH] for i in range(3)]
    losses, evals = [], []
    for k, batch in enumerate(train_batches):
        loss = model(**batch)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        if k == 1:
            model.eval()
            with torch.no_grad():
                evals = [model(**val[i * BATCH:(i + 1) * BATCH])["logits"] for i in range(len(val) // BATCH)]
            model.train()
    return torch.stack(losses), evals, model.state_dict()


@pytest.mark.timeout(300)
def test_a_booster_validation_pass_between_steps_is_one_devices():
    torch.manual_seed(0)
    model = SmallCNN(p=0.0).train()
    train, val = Images(3 * BATCH, 0), Images(2 * BATCH, 1)
    want_losses, want_evals, want_state = _one_device(model, train, val)
    for got in run_local(_boosted, 2, model, train, val, timeout=240):
        # the plan leaves the inputs replicated (splitting one costs nothing), so the module takes
        # whole global batches (``tests/runtime/test_eval_mode.py`` evaluates ``local_inputs`` pieces)
        assert not got["local"] and got["pieces"] == [(BATCH, 3, 6, 6)] * 3, got["pieces"]
        assert torch.allclose(got["losses"], want_losses, rtol=1e-5, atol=1e-6), (got["losses"], want_losses)
        assert len(got["evals"]) == len(want_evals) == 2
        for g, w in zip(got["evals"], want_evals):
            assert torch.allclose(g, w, rtol=1e-5, atol=1e-6)
        for k, w in want_state.items():
            assert torch.allclose(got["state"][k].to(w.dtype), w, rtol=1e-5, atol=1e-6), k


def _gemini(rank, world, model, batches, val):
    from autopar.booster import GeminiPlugin

    booster = Booster(GeminiPlugin(precision="fp32"))
    pm, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR), meta_inputs=batches[0])
    losses = []

    def step(batch):
        loss = pm(**batch)["loss"]
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())

    step(batches[0])
    step(batches[1])
    pm.eval()
    with torch.no_grad():
        evals = [pm(**val[i * BATCH:(i + 1) * BATCH])["logits"] for i in range(len(val) // BATCH)]
    pm.train()
    step(batches[2])
    chunked = pm.gemini is not None and all(c.sharded for c in pm.gemini.manager.chunks)
    return {"losses": torch.stack(losses), "evals": evals, "chunked": chunked, "state": pm.full_state_dict()}


@pytest.mark.timeout(300)
def test_a_validation_pass_of_a_chunked_zero3_module_is_one_devices():
    """``GeminiPlugin``: the parameters view chunk copies that exist only while gathered, and
    the chunk optimizer writes the chunks; the eval pass gathers through the chunk runtime."""
    torch.manual_seed(0)
    model = SmallCNN(p=0.0).train()
    train, val = Images(3 * BATCH, 0), Images(2 * BATCH, 1)
    want_losses, want_evals, want_state = _one_device(model, train, val, optimizer=torch.optim.AdamW)
    batches = [train[i * BATCH:(i + 1) * BATCH] for i in range(3)]
    for got in run_local(_gemini, 2, model, batches, val, timeout=240):
        assert got["chunked"]
        assert torch.allclose(got["losses"], want_losses, rtol=1e-5, atol=1e-6), (got["losses"], want_losses)
        for g, w in zip(got["evals"], want_evals, strict=True):
            assert torch.allclose(g, w, rtol=1e-5, atol=1e-6), (g - w).abs().max()
        for k, w in want_state.items():
            assert torch.allclose(got["state"][k].to(w.dtype), w, rtol=1e-5, atol=1e-6), k
