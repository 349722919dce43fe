"""The product notes' examples, transcribed, run on 2 gloo ranks against one device.

Each ``_example_*`` function is a page's code as the notes give it, with only these changes
(each marked ``# notes:`` where it happens):

- the import lines: ``colossalai`` -> ``autopar`` (``import autopar as colossalai``),
  ``colossalai.booster.plugin`` -> ``autopar.booster``, ``colossalai.nn.lr_scheduler`` ->
  ``autopar.optim.lr_scheduler``, ``colossalai.cluster.dist_coordinator`` ->
  ``autopar.runtime.launch``, ``colossalai.logging.get_dist_logger`` -> ``logging.getLogger``,
  and torchvision's ``resnet18``/``resnet34``/``CIFAR10`` -> the test's CNN and fake data
  (``tests/booster/cnn.py``);
- sizes: tiny images, batches and dataset; ``.cuda()`` / ``.to('cuda')`` -> the CPU
  (gloo ranks); the script's ``sys.argv`` is ``["train.py"]``;
- what the notes leave undefined (``param_by_iter``, ``use_safetensors``, ``save_path``'s
  place, the ``...`` of the plugin pages) is given.

The plugin pages' last line, ``model, optimizer, train_dataloader, criterion =
booster.boost(model, optimizer, train_dataloader, criterion)``, swaps the criterion and the
loader against ``boost``'s documented order (model, optimizer, criterion, dataloader,
lr_scheduler) and unpacks four of its five results: it is checked to fail with a ValueError
that says so, then run in the documented order.

One device: torch's DDP and FSDP2 normalise a batch-norm layer over each rank's own samples, so
their reference is one device running each rank's samples separately and averaging the
gradients (what data parallelism computes); the planned plugins (LowLevelZeroPlugin) are exact
for the whole global batch, so theirs is the plain model on it.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

from autopar.runtime.launch import run_local
from tests.booster.cnn import IMAGE, fake_cifar, resnet18, resnet34

DEVICE = "cpu"  # notes: 'cuda'; these ranks are gloo processes on the CPU
WORLD = 2


# ------------------------------------------------------------------------------ Booster API page
def _example_booster_api(rank, world_size, port, save_path, use_safetensors, plugin_name):
    import torch
    from torch.optim import SGD

    import autopar as colossalai  # notes: import colossalai
    from autopar.booster import Booster  # notes: from colossalai.booster import Booster
    from autopar.booster import AutoParallelPlugin, TorchDDPPlugin  # notes: ...booster.plugin import TorchDDPPlugin

    colossalai.launch(config=dict(), rank=rank, world_size=world_size, port=port, host='localhost')
    plugin = {"TorchDDPPlugin": TorchDDPPlugin, "AutoParallelPlugin": AutoParallelPlugin}[plugin_name]()
    booster = Booster(plugin=plugin)
    model = resnet18()
    criterion = lambda x: x.mean()  # noqa: E731 -- the notes' line
    optimizer = SGD((model.parameters()), lr=0.001)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)
    model, optimizer, criterion, _, scheduler = booster.boost(model, optimizer, criterion, lr_scheduler=scheduler)

    x = torch.randn(4, 3, IMAGE, IMAGE)  # notes: (4, 3, 224, 224)
    x = x.to(DEVICE)
    output = model(x)
    loss = criterion(output)
    booster.backward(loss, optimizer)
    optimizer.clip_grad_by_norm(1.0)
    optimizer.step()
    scheduler.step()

    # notes: save_path = "./model"
    booster.save_model(model, save_path, True, True, "", 10, use_safetensors=use_safetensors)

    new_model = resnet18()
    booster.load_model(new_model, save_path)
    return {"loss": loss.item(), "trained": model.full_state_dict(), "loaded": new_model.state_dict(),
            "lr": scheduler.get_last_lr(), "files": sorted(os.listdir(save_path))}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("plugin_name, use_safetensors", [("TorchDDPPlugin", True), ("TorchDDPPlugin", False),
                                                          ("AutoParallelPlugin", True)])
def test_booster_api_example(tmp_path, plugin_name, use_safetensors):
    """The page's TorchDDPPlugin, and the same script planned (AutoParallelPlugin: boost without
    a loader plans at the first forward)."""
    from autopar.runtime.launch import free_port

    torch.manual_seed(1024)  # what launch seeds every rank with
    ref = resnet18()
    x = torch.randn(4, 3, IMAGE, IMAGE)
    opt = torch.optim.SGD(ref.parameters(), lr=0.001)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    loss = ref(x).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    opt.step()
    sched.step()
    want = ref.state_dict()
    path = str(tmp_path / "model")
    for res in run_local(_example_booster_api, WORLD, free_port(), path, use_safetensors, plugin_name, timeout=180):
        assert res["loss"] == pytest.approx(loss.item(), rel=1e-5)
        assert res["lr"] == pytest.approx(sched.get_last_lr())
        for name, value in want.items():  # identical batches on every rank: one device's step
            assert torch.allclose(res["trained"][name], value, rtol=1e-5, atol=1e-7), name
            assert torch.equal(res["loaded"][name], res["trained"][name]), name  # a plain model loads it
        # shard=True: a directory in Hugging Face's layout (one shard file: no index needed)
        assert res["files"] == ["model.safetensors" if use_safetensors else "pytorch_model.bin"]


# ------------------------------------------------------------------- gradient accumulation page
def _example_gradient_accumulation(rank, world_size, samples):
    import torch

    import autopar as colossalai  # notes: import colossalai
    from autopar.booster import Booster  # notes: from colossalai.booster import Booster
    from autopar.booster import TorchDDPPlugin  # notes: from colossalai.booster.plugin import TorchDDPPlugin
    from autopar.runtime.launch import priority_execution  # notes: colossalai.cluster.dist_coordinator

    sys.argv = ["train.py"]  # notes: the script's command line
    # initialize distributed setting
    parser = colossalai.get_default_parser()
    args = parser.parse_args()  # noqa: F841 -- the notes' line
    # launch from torch
    colossalai.launch_from_torch(config=dict())

    # define the training hyperparameters
    BATCH_SIZE = 4  # notes: 128
    GRADIENT_ACCUMULATION = 4

    # build resnet
    model = resnet18(num_classes=10)

    # build dataloaders
    with priority_execution():
        train_dataset = fake_cifar(samples)  # notes: CIFAR10(root=..., download=True, transform=...)

    # build criterion
    criterion = torch.nn.CrossEntropyLoss()

    # optimizer
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)

    plugin = TorchDDPPlugin()
    booster = Booster(plugin=plugin)
    train_dataloader = plugin.prepare_dataloader(train_dataset, batch_size=BATCH_SIZE, shuffle=True, drop_last=True)
    model, optimizer, criterion, train_dataloader, _ = booster.boost(model=model,
                                                                     optimizer=optimizer,
                                                                     criterion=criterion,
                                                                     dataloader=train_dataloader)

    param_by_iter = []  # notes: used, not defined
    optimizer.zero_grad()
    for idx, (img, label) in enumerate(train_dataloader):
        sync_context = booster.no_sync(model)
        img = img.to(DEVICE)  # notes: img.cuda()
        label = label.to(DEVICE)  # notes: label.cuda()
        if idx % (GRADIENT_ACCUMULATION - 1) != 0:
            with sync_context:
                output = model(img)
                train_loss = criterion(output, label)
                booster.backward(train_loss, optimizer)
        else:
            output = model(img)
            train_loss = criterion(output, label)
            booster.backward(train_loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()

        ele_1st = next(model.parameters()).flatten()[0]
        param_by_iter.append(str(ele_1st.item()))

        if idx != 0 and idx % (GRADIENT_ACCUMULATION - 1) == 0:
            break

    for iteration, val in enumerate(param_by_iter):
        print(f'iteration {iteration} - value: {val}')

    if param_by_iter[-1] != param_by_iter[0]:
        print('The parameter is only updated in the last iteration')
    return {"param_by_iter": param_by_iter, "params": dict(model.model.named_parameters())}


def rank_batches(dataset, batch: int, *, seed: int = 1024) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Step -> each rank's (images, labels), as the torch plugins' ``prepare_dataloader``
    (``DistributedSampler``, shuffled) deals them."""
    per_rank = []
    for rank in range(WORLD):
        sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=WORLD, rank=rank, shuffle=True, seed=seed,
                                                      drop_last=True)
        indices = list(sampler)
        per_rank.append([dataset[indices[i:i + batch]] for i in range(0, len(indices) - batch + 1, batch)])
    return [list(step) for step in zip(*per_rank)]


def data_parallel_backward(model, pieces, loss_fn, scaler=None) -> list[float]:
    """Each rank's piece forward and backward on one device (the loss scaled by ``scaler``),
    gradients averaged over the ranks (DDP's and FSDP2's sum / world); the per-rank losses."""
    losses = []
    for img, label in pieces:
        loss = loss_fn(model, img, label)
        ((loss if scaler is None else scaler.scale(loss)) / len(pieces)).backward()
        losses.append(loss.item())
    return losses


def _cross_entropy(model, img, label):
    return torch.nn.functional.cross_entropy(model(img), label)


@pytest.mark.timeout(200)
def test_gradient_accumulation_example():
    samples, accumulation = 48, 4
    torch.manual_seed(1024)
    ref = resnet18(num_classes=10)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    first = []
    for idx, pieces in enumerate(rank_batches(fake_cifar(samples), 4)):
        data_parallel_backward(ref, pieces, _cross_entropy)
        if idx % (accumulation - 1) == 0:  # the notes' loop steps at idx 0 and idx 3
            opt.step()
            opt.zero_grad()
        first.append(next(ref.parameters()).flatten()[0].item())
        if idx != 0 and idx % (accumulation - 1) == 0:
            break
    want = dict(ref.named_parameters())
    for res in run_local(_example_gradient_accumulation, WORLD, samples, timeout=180):
        got = [float(v) for v in res["param_by_iter"]]
        assert got == pytest.approx(first, rel=1e-5, abs=1e-7)
        assert got[0] == got[1] == got[2] != got[3]  # accumulated without stepping, then one step
        for name, value in want.items():
            assert torch.allclose(res["params"][name], value, rtol=1e-4, atol=1e-6), name


# ---------------------------------------------------------------------- gradient clipping page
def _example_gradient_clipping(rank, world_size, samples):
    from logging import getLogger as get_dist_logger  # notes: from colossalai.logging import get_dist_logger

    import torch

    import autopar as colossalai  # notes: import colossalai
    from autopar.booster import Booster  # notes: from colossalai.booster import Booster
    from autopar.booster import TorchDDPPlugin  # notes: from colossalai.booster.plugin import TorchDDPPlugin
    from autopar.optim.lr_scheduler import CosineAnnealingLR  # notes: from colossalai.nn.lr_scheduler import ...

    colossalai.launch_from_torch(config=dict())
    logger = get_dist_logger()

    # define training hyperparameters
    NUM_EPOCHS = 200
    BATCH_SIZE = 4  # notes: 128
    GRADIENT_CLIPPING = 0.1
    # build resnet
    model = resnet34(num_classes=10)
    # build dataloaders
    train_dataset = fake_cifar(samples)  # notes: CIFAR10(root=..., download=True, transform=...)
    # build criterion
    criterion = torch.nn.CrossEntropyLoss()

    # optimizer
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)

    # lr_scheduler
    lr_scheduler = CosineAnnealingLR(optimizer, total_steps=NUM_EPOCHS)

    plugin = TorchDDPPlugin()
    booster = Booster(mixed_precision='fp16', plugin=plugin)
    train_dataloader = plugin.prepare_dataloader(train_dataset, batch_size=BATCH_SIZE, shuffle=True, drop_last=True)
    model, optimizer, criterion, train_dataloader, lr_scheduler = booster.boost(model, optimizer, criterion,
                                                                                train_dataloader, lr_scheduler)

    # verify gradient clipping
    losses = []
    model.train()
    for idx, (img, label) in enumerate(train_dataloader):
        img = img.to(DEVICE)  # notes: img.cuda()
        label = label.to(DEVICE)  # notes: label.cuda()

        model.zero_grad()
        output = model(img)
        train_loss = criterion(output, label)
        booster.backward(train_loss, optimizer)
        optimizer.clip_grad_by_norm(max_norm=GRADIENT_CLIPPING)
        optimizer.step()
        lr_scheduler.step()

        ele_1st = next(model.parameters()).flatten()[0]
        logger.info(f'iteration {idx}, loss: {train_loss}, 1st element of parameters: {ele_1st.item()}')
        losses.append(train_loss.item())

        # only run for 4 iterations
        if idx == 3:
            break
    return {"losses": losses, "params": dict(model.model.named_parameters()), "lr": lr_scheduler.get_last_lr(),
            "scale": optimizer.scaler.get_scale()}


def _autocast_cross_entropy(model, img, label):
    with torch.autocast("cpu", dtype=torch.float16):
        return torch.nn.functional.cross_entropy(model(img), label)


@pytest.mark.timeout(200)
def test_gradient_clipping_example():
    """Booster(mixed_precision='fp16') with TorchDDPPlugin: torch AMP (autocast, a loss scaler of
    the notes' FP16TorchMixedPrecision settings), clipping the unscaled gradients to 0.1."""
    samples = 48
    torch.manual_seed(1024)
    ref = resnet34(num_classes=10)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=200)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                                  growth_interval=2000)
    want = []
    for idx, pieces in enumerate(rank_batches(fake_cifar(samples), 4)):
        opt.zero_grad()
        want.append(data_parallel_backward(ref, pieces, _autocast_cross_entropy, scaler=scaler))
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        scaler.step(opt)
        scaler.update()
        sched.step()
        if idx == 3:
            break
    for rank, res in enumerate(run_local(_example_gradient_clipping, WORLD, samples, timeout=180)):
        assert res["losses"] == pytest.approx([step[rank] for step in want], rel=2e-3)
        assert res["lr"] == pytest.approx(sched.get_last_lr())
        assert res["scale"] == scaler.get_scale()
        for name, value in ref.named_parameters():
            assert torch.allclose(res["params"][name], value, rtol=1e-3, atol=1e-5), name


# -------------------------------------------------------------------------- plugin pages' blocks
def _example_plugin(rank, world_size, plugin_name, steps):
    import torch

    from autopar.booster import Booster  # notes: from colossalai.booster import Booster
    from autopar.booster import LowLevelZeroPlugin, TorchDDPPlugin, TorchFSDPPlugin  # notes: ...booster.plugin

    # notes: model, train_dataset, optimizer, criterion = ...
    torch.manual_seed(0)
    model = resnet18(num_classes=10)
    train_dataset = fake_cifar(64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    criterion = torch.nn.CrossEntropyLoss()

    plugin = {"TorchDDPPlugin": TorchDDPPlugin, "TorchFSDPPlugin": TorchFSDPPlugin,
              "LowLevelZeroPlugin": LowLevelZeroPlugin}[plugin_name]()
    if plugin_name == "TorchFSDPPlugin":  # that page's name for it
        train_dataloader = plugin.prepare_train_dataloader(train_dataset, batch_size=8)
    else:
        train_dataloader = plugin.prepare_dataloader(train_dataset, batch_size=8)
    booster = Booster(plugin=plugin)
    try:  # the pages' line, as written
        model, optimizer, train_dataloader, criterion = booster.boost(model, optimizer, train_dataloader, criterion)
        refusal = None
    except ValueError as exc:
        refusal = str(exc)
    # notes: ... = booster.boost(model, optimizer, train_dataloader, criterion), in boost's order
    model, optimizer, criterion, train_dataloader, _ = booster.boost(model, optimizer, criterion, train_dataloader)

    losses = []
    for step, (img, label) in enumerate(train_dataloader):
        loss = criterion(model(img), label)
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step + 1 == steps:
            break
    params = model.full_state_dict()
    return {"refusal": refusal, "losses": losses, "params": params, "shape": tuple(img.shape),
            "scale": optimizer.scaler.get_scale() if optimizer.scaler is not None else None}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("plugin_name", ["TorchDDPPlugin", "TorchFSDPPlugin", "LowLevelZeroPlugin"])
def test_plugin_page_examples(plugin_name):
    steps = 2
    torch.manual_seed(0)
    ref = resnet18(num_classes=10)
    dataset = fake_cifar(64)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    want = []
    if plugin_name == "LowLevelZeroPlugin":
        # its defaults: ZeRO-1, fp16 with a loss scale of 2**32 (the first steps overflow and are
        # skipped, as one device's torch AMP with that scaler skips them)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**32, growth_factor=2, backoff_factor=0.5,
                                      growth_interval=1000)
        for step in range(steps):
            img, label = dataset[step * 16:(step + 1) * 16]  # 8 per rank x 2: the global batch, in order
            loss = _autocast_cross_entropy(ref, img, label)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            want.append([loss.item()] * WORLD)
    else:
        for step in range(steps):
            # DistributedSampler without shuffling: rank r takes samples r, r + 2, ...
            pieces = [dataset[list(range(step * 16 + r, (step + 1) * 16, WORLD))] for r in range(WORLD)]
            want.append(data_parallel_backward(ref, pieces, _cross_entropy))
            opt.step()
            opt.zero_grad()
    for rank, res in enumerate(run_local(_example_plugin, WORLD, plugin_name, steps, timeout=220)):
        assert "pass them by keyword" in res["refusal"]
        rel = 2e-3 if plugin_name == "LowLevelZeroPlugin" else 1e-5
        assert res["losses"] == pytest.approx([step[rank] for step in want], rel=rel)
        for name, value in ref.named_parameters():
            assert torch.allclose(res["params"][name], value, rtol=10 * rel, atol=1e-6), name
        if plugin_name == "LowLevelZeroPlugin":
            assert res["shape"] == (16, 3, IMAGE, IMAGE)  # the global batch: the criterion's labels are whole
            # The notes' scaler backs off at the hysteresis-th (2nd) consecutive overflow, torch's at
            # every one: the same skipped steps, one halving fewer.
            overflows = round(math.log2(2.0**32 / scaler.get_scale()))
            assert res["scale"] == 2.0**32 * 0.5 ** max(0, overflows - 1)
