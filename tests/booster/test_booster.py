"""The product notes' Booster example, adapted, on real gloo processes.

GPT-2 (tiny, dropout 0) with AdamW in two param groups (decay / no decay, different learning
rates), a LambdaLR warm-up, ``max_norm`` clipping and ``plugin.prepare_dataloader`` over a
map-style dataset of token sequences (shuffled, seeded):

Each mesh gets a memory budget under which its plan shards parameters.

- on 2 ranks (mesh (2,)): ``boost``, ``booster.backward``, ``optimizer.step`` for a few steps;
  the losses equal single-device training with the same clipping, groups and schedule
  (rtol 1e-4); every group's hyper-parameters survive by name and the scheduler drives the
  rebuilt optimizer; then ``save_model(shard=True, use_safetensors=True)`` with a small
  ``size_per_shard`` (several shards), ``save_optimizer`` and ``save_lr_scheduler``, and two more steps;
- on 4 ranks (mesh (2, 2), another world size and plan): a fresh, differently initialised model
  is boosted, ``load_model`` / ``load_optimizer`` / ``load_lr_scheduler`` restore it, and its
  next two steps give the losses of the uninterrupted run (so the model, the AdamW state and the
  learning rate all came back);
- in the test process: ``transformers``' ``from_pretrained`` loads the saved directory and gives
  the same loss on the same batch.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from autopar import zoo
from autopar.api import plan as make_plan
from autopar.booster.dataloader import batch_split
from autopar.layout.placement import TensorSpec
from autopar.runtime.launch import run_local

STEPS, SEQ, BATCH, SAMPLES, MAX_NORM, SEED = 3, 16, 8, 48, 0.5, 7
LRS = (2e-3, 1e-3)  # decay group, no-decay group


class TokenDataset(torch.utils.data.Dataset):
    """Map-style: sample i is a dict of (SEQ,) token tensors."""

    def __init__(self, vocab: int, n: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, SEQ), generator=gen)
        self.labels = torch.randint(0, vocab, (n, SEQ), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def criterion(outputs, batch) -> torch.Tensor:
    return outputs.loss


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 8)


def make_training(model):
    """AdamW over two named groups (biases and norms without weight decay) and a LambdaLR."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "ln_" not in n]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "ln_" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "lr": LRS[0], "weight_decay": 0.1},
                             {"params": rest, "lr": LRS[1], "weight_decay": 0.0, "betas": (0.8, 0.99)}],
                            lr=5e-3, eps=1e-5, foreach=True)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, warmup)


def global_batches(dataset, n: int) -> list[dict[str, torch.Tensor]]:
    """The first ``n`` global batches in the loader's order (the plugin's seeded shuffle)."""
    from autopar.booster.dataloader import GlobalBatchSampler

    sampler = GlobalBatchSampler(len(dataset), BATCH, shuffle=True, seed=SEED, drop_last=True)
    out = []
    for indices in sampler:
        out.append({k: torch.stack([dataset[i][k] for i in indices]) for k in ("input_ids", "labels")})
        if len(out) == n:
            return out
    raise AssertionError("dataset too small")


def single_device(model, batches) -> list[float]:
    model = copy.deepcopy(model)
    opt, sched = make_training(model)
    losses = []
    for batch in batches:
        loss = criterion(model(**batch), batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses


def sharded_names(pm) -> list[str]:
    return sorted(n for n, p in pm.parameters_by_fqn().items() if p.to_local().shape != p.shape)


def _train_and_save(rank, world, model, dataset, path, budget):
    from autopar.booster import AutoParallelPlugin, Booster

    plugin = AutoParallelPlugin(mesh=(2,), memory_budget=budget, max_norm=MAX_NORM)
    booster = Booster(plugin=plugin)
    # batch_size is per data-parallel rank: the same global batches of BATCH as the 4-rank resume
    loader = plugin.prepare_dataloader(dataset, BATCH // world, shuffle=True, seed=SEED, drop_last=True)
    opt, sched = make_training(model)
    names = {id(p): n for n, p in model.named_parameters()}
    groups_by_name = [{names[id(p)] for p in g["params"]} for g in opt.param_groups]
    pm, bopt, crit, loader, sched = booster.boost(model, opt, criterion, loader, sched)
    assert crit is criterion
    # hyper-parameters and membership of every group, by name
    by_fqn = pm.parameters_by_fqn()
    # (a parameter the plan gives a ZeRO stage is stepped through its piece)
    param_of = {id(piece.master): piece.param for piece in bopt.zero.pieces}
    for group, want in zip(bopt.param_groups, groups_by_name):
        assert {id(param_of.get(id(p), p)) for p in group["params"]} == {id(by_fqn[n]) for n in want}
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in bopt.param_groups]
    losses, lrs, pieces = [], [], []
    for step, batch in enumerate(loader):
        pieces.append(tuple(batch["input_ids"].shape))
        loss = crit(pm(**batch), batch)
        booster.backward(loss, bopt)
        bopt.step()
        bopt.zero_grad()
        sched.step()
        if step == STEPS - 1:  # checkpoint after STEPS steps, then two more steps
            booster.save_model(pm, os.path.join(path, "model"), shard=True, size_per_shard=0.05, use_safetensors=True)
            booster.save_optimizer(bopt, os.path.join(path, "optim"))
            booster.save_lr_scheduler(sched, os.path.join(path, "sched.pt"))
        lrs.append([g["lr"] for g in bopt.param_groups])
        losses.append(loss.item())
        if step == STEPS + 1:
            break
    final = {k: v.clone() for k, v in pm.full_state_dict().items()}
    return {"losses": losses, "lrs": lrs, "hyper": hyper, "final": final, "pieces": pieces,
            "local_inputs": pm.local_inputs, "sharded": sharded_names(pm),
            "specs": {k: str(v) for k, v in pm.input_specs.items()}}


def _load_and_step(rank, world, model, dataset, path, budget):
    from autopar.booster import AutoParallelPlugin, Booster

    plugin = AutoParallelPlugin(mesh=(2, 2), memory_budget=budget, max_norm=MAX_NORM)
    booster = Booster(plugin=plugin)
    loader = plugin.prepare_dataloader(dataset, BATCH // world, shuffle=True, seed=SEED, drop_last=True)
    opt, sched = make_training(model)
    pm, bopt, _, loader, sched = booster.boost(model, opt, criterion, loader, sched)
    booster.load_model(pm, os.path.join(path, "model"))
    booster.load_optimizer(bopt, os.path.join(path, "optim"))
    booster.load_lr_scheduler(sched, os.path.join(path, "sched.pt"))
    lrs_before = [g["lr"] for g in bopt.param_groups]
    losses, pieces = [], []
    for batch in list(loader)[STEPS:STEPS + 2]:
        pieces.append(tuple(batch["input_ids"].shape))
        loss = criterion(pm(**batch), batch)
        booster.backward(loss, bopt)
        bopt.step()
        bopt.zero_grad()
        sched.step()  # from the loaded epoch count: the second step's lr needs it
        losses.append(loss.item())
    final = {k: v.clone() for k, v in pm.full_state_dict().items()}
    return {"losses": losses, "lrs_before": lrs_before, "final": final,
            "lrs_after": [g["lr"] for g in bopt.param_groups], "local_inputs": pm.local_inputs, "pieces": pieces,
            "sharded": sharded_names(pm), "specs": {k: str(v) for k, v in pm.input_specs.items()}}


def check_loading_rule(res: dict, mesh_shape: tuple[int, ...], steps: int) -> None:
    """Each rank loads 1/k of every global batch when the plan splits both inputs' batch dim
    k > 1 ways alike (the model then takes pieces), else the whole batch (the model takes it)."""
    specs = {k: TensorSpec.parse(v) for k, v in res["specs"].items()}
    piece = batch_split(specs, {"input_ids": (BATCH, SEQ), "labels": (BATCH, SEQ)}, BATCH, mesh_shape,
                        (0,) * len(mesh_shape))
    assert res["local_inputs"] == (piece is not None and piece[1] > 1)
    rows = BATCH // piece[1] if piece else BATCH
    assert res["pieces"] == [(rows, SEQ)] * steps


@pytest.mark.timeout(240)
def test_booster_example_trains_like_one_device_and_checkpoints_across_meshes(tmp_path):
    torch.manual_seed(0)
    model, inputs = zoo.build("gpt2", tiny=True, device="cpu", batch=BATCH, seq=SEQ)
    dataset = TokenDataset(model.config.vocab_size, SAMPLES)
    # budgets that make each mesh's plan shard parameters (as tests/runtime/test_reshard.py): with
    # bucketed gradient sums priced as they run, data parallelism (ZeRO, recompute) holds out longer
    # (pipeline=1: the plugin's default plans no pipeline; "auto" would trace twice more for its floors)
    budgets = {shape: int(fraction * make_plan(model, inputs, mesh=shape, pipeline=1).estimate.peak_bytes)
               for shape, fraction in (((2,), 0.5), ((2, 2), 0.4))}
    batches = global_batches(dataset, STEPS + 2)
    want = single_device(model, batches)

    results = run_local(_train_and_save, 2, model, dataset, str(tmp_path), budgets[(2,)], timeout=200)
    for res in results:
        assert res["sharded"], "the budget should shard parameters"
        assert res["losses"] == pytest.approx(want, rel=1e-4), (res["losses"], want)
        check_loading_rule(res, (2,), STEPS + 2)
        assert res["hyper"][0]["lr"] == pytest.approx(LRS[0] * warmup(0))
        assert res["hyper"][0]["weight_decay"] == 0.1 and res["hyper"][0]["betas"] == (0.9, 0.999)
        assert res["hyper"][1]["weight_decay"] == 0.0 and res["hyper"][1]["betas"] == (0.8, 0.99)
        assert res["hyper"][1]["eps"] == 1e-5 and res["hyper"][1]["foreach"] is True
        # the scheduler drives the rebuilt optimizer
        assert [lr[0] for lr in res["lrs"]] == pytest.approx([LRS[0] * warmup(s + 1) for s in range(STEPS + 2)])
        assert [lr[1] for lr in res["lrs"]] == pytest.approx([LRS[1] * warmup(s + 1) for s in range(STEPS + 2)])

    model_dir = tmp_path / "model"
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors", files
    assert sorted(os.listdir(model_dir)) == sorted(files + ["model.safetensors.index.json", "config.json"])
    state = model.state_dict()
    assert set(index["weight_map"]) == set(state) - {"lm_head.weight"}  # the tied head is stored once

    torch.manual_seed(1)  # a fresh model with other weights: everything must come from the files
    fresh, _ = zoo.build("gpt2", tiny=True, device="cpu", batch=BATCH, seq=SEQ)
    loaded = run_local(_load_and_step, 4, fresh, dataset, str(tmp_path), budgets[(2, 2)], timeout=200)
    for res in loaded:
        assert res["sharded"], "the budget should shard parameters"
        # the first loss needs the model back, the second the AdamW state and learning rate too
        assert res["losses"] == pytest.approx(want[STEPS:], rel=1e-4), (res["losses"], want[STEPS:])
        check_loading_rule(res, (2, 2), 2)
        assert res["lrs_before"] == pytest.approx([LRS[0] * warmup(STEPS), LRS[1] * warmup(STEPS)])
        # the scheduler resumed from its epoch count
        assert res["lrs_after"] == pytest.approx([LRS[0] * warmup(STEPS + 2), LRS[1] * warmup(STEPS + 2)])
        # and the AdamW state: the parameters after the two steps are the uninterrupted run's
        want_final = results[0]["final"]
        assert set(res["final"]) == set(want_final)
        wrong = [k for k, v in want_final.items() if not torch.allclose(res["final"][k], v, rtol=1e-4, atol=1e-6)]
        assert not wrong, wrong[:5]

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir))
    assert type(hf) is type(model)
    hf.train()  # as trained (dropout is 0 anyway)
    batch = batches[STEPS]
    assert hf(**batch).loss.item() == pytest.approx(want[STEPS], rel=1e-4)
