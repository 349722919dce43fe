"""``model.eval()`` on a module traced in training mode: the eval-mode outputs one device computes.

A validation pass in the middle of training (``pm.eval(); with torch.no_grad(): pm(batch)``) runs
on a gathered eval-mode replica (``autopar/runtime/eval_replica.py``): batch norms use the running
statistics the training steps updated, dropout is off, no gradient is tracked. Each model trains
2 SGD steps on forked gloo ranks, evaluates a validation batch, goes back to ``.train()`` and
trains a 3rd step. Reference: the same model on mesh ``(1,)`` (one rank: autopar's counter-based
dropout draws, ``strategies/rng.py``, are one device's) for the 3 training steps without any
evaluation, and the plain model loaded with its state after 2 steps, in ``.eval()``, for the
validation batch. Also: ``local_inputs`` pieces (and whole global batches) on (2,), a pipelined
GPT-2 on 2 stages, eval after per-rank batch statistics, and a model that draws in eval mode
(ranks agree, torch's generator untouched). A budget below the full model's bytes is refused,
naming it, as is a mixed-precision plan (the replica would not compute by the precision pass's
policy).
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch
from torch import nn

import autopar
from autopar.runtime.build import build_module
from autopar.runtime.launch import run_local
from tests.runtime import random_models as rm

LR = 0.1


class SmallCNN(nn.Module):
    """Conv, batch norm, dropout, a linear head; the loss and the logits in a dict."""

    def __init__(self, p: float = 0.25) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)  # (a bias before a batch norm: no gradient but noise)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(8 * 6 * 6, 5)

    def forward(self, x, labels):
        h = self.drop(torch.relu(self.bn(self.conv(x))))
        logits = self.head(h.flatten(1))
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def _cnn():
    torch.manual_seed(0)
    model = SmallCNN().train()
    train = {"x": torch.randn(8, 3, 6, 6), "labels": torch.randint(0, 5, (8,))}
    val = {"x": torch.randn(8, 3, 6, 6) * 2 + 1, "labels": torch.randint(0, 5, (8,))}
    return model, train, val


def _gpt2():
    model, train = rm.build("gpt2")
    ids = torch.randint(0, rm.VOCAB, (rm.BATCH, rm.SEQ), generator=torch.Generator().manual_seed(5))
    return model, train, {"input_ids": ids, "labels": ids}


MODELS = {"cnn": _cnn, "gpt2": _gpt2}


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _step(pm, opt, batch) -> torch.Tensor:
    opt.zero_grad()
    loss = pm(**batch)["loss"]
    loss.backward()
    opt.step()
    return loss.detach().clone()


def _with_eval(rank, world, model, traced, plan, train, val):
    """2 steps, an evaluation (twice: with and without no_grad), .train(), 1 step."""
    counted = _Count()
    logging.getLogger("autopar.runtime.eval_replica").addHandler(counted)
    logging.getLogger("autopar.runtime.eval_replica").setLevel(logging.INFO)
    autopar.manual_seed(rm.SEED)
    pm = build_module(model, traced, plan, device=torch.device("cpu"))
    # torch's optimizer steps the DTensors, the module's steps their local tensors (ZeRO's path)
    opt = torch.optim.SGD(pm.parameters(), lr=LR) if world == 2 else pm.optimizer(torch.optim.SGD, lr=LR)
    losses = [_step(pm, opt, train) for _ in range(2)]
    pm.eval()
    with torch.no_grad():
        first = pm(**val)
    again = pm(**val)  # no new gather (nothing changed), and no gradient even outside no_grad
    pm.train()
    losses.append(_step(pm, opt, train))
    pm.eval()  # after an update: gathered again, still one log line
    after = pm(**val)["logits"]
    state = pm.full_state_dict()
    opt.step()  # an update while in eval mode (the 3rd step's gradients once more): seen
    plain = copy.deepcopy(model)
    plain.load_state_dict(pm.full_state_dict())
    updated = torch.allclose(pm(**val)["logits"], plain.eval()(**val)["logits"], rtol=1e-5, atol=1e-6)
    return {"updated": updated, "losses": torch.stack(losses), "loss": first["loss"], "logits": first["logits"],
            "again_equal": torch.equal(again["logits"], first["logits"]),
            "again_grad": again["logits"].requires_grad or again["loss"].requires_grad,
            "after": after, "state": state, "log": counted.lines}


def _reference(rank, world, model, traced, plan, train, val):
    """Mesh (1,): 3 training steps without evaluation; the plain model's eval after 2."""
    autopar.manual_seed(rm.SEED)
    pm = build_module(model, traced, plan, device=torch.device("cpu"))
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    losses, evals = [], []
    for _ in range(3):
        losses.append(_step(pm, opt, train))
        plain = copy.deepcopy(model)
        plain.load_state_dict(pm.full_state_dict())
        with torch.no_grad():
            evals.append(plain.eval()(**val))
    return {"losses": torch.stack(losses), "loss": evals[1]["loss"], "logits": evals[1]["logits"],
            "after": evals[2]["logits"], "state": pm.full_state_dict()}


@pytest.fixture(scope="module", params=sorted(MODELS))
def case(request):
    model, train, val = MODELS[request.param]()
    traced, prof = rm.traced_of(model, train)
    ref = run_local(_reference, 1, model, traced, rm.plan_for(traced, prof, (1,)), train, val, timeout=240)[0]
    return request.param, model, train, val, traced, prof, ref


def _close(a, b) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("shape", [(2,), (2, 2)], ids=["2", "2x2"])
def test_eval_in_the_middle_of_training_is_one_devices_eval(case, shape):
    name, model, train, val, traced, prof, ref = case
    plan = rm.plan_for(traced, prof, shape)
    world = 2 if shape == (2,) else 4
    results = run_local(_with_eval, world, model, traced, plan, train, val, timeout=420)
    for rank, got in enumerate(results):
        where = f"{name} on {shape}, rank {rank}"
        assert _close(got["losses"], ref["losses"]), f"{where}: losses {got['losses']} != {ref['losses']}"
        assert _close(got["logits"], ref["logits"]), f"{where}: eval logits differ"
        assert _close(got["loss"], ref["loss"]), f"{where}: eval loss {got['loss']} != {ref['loss']}"
        assert got["again_equal"] and not got["again_grad"] and got["updated"], where
        assert _close(got["after"], ref["after"]), f"{where}: eval after the 3rd step differs"
        for k, want in ref["state"].items():
            assert _close(got["state"][k], want), f"{where}: {k} after the 3rd step"
        if rank == 0:  # one line, rank 0's
            assert len(got["log"]) == 1 and "gathered eval-mode replica" in got["log"][0], got["log"]
            distinct = {id(t): t for t in ref["state"].values()}.values()  # a tied weight once
            assert f"{sum(t.numel() * t.element_size() for t in distinct)} bytes" in got["log"][0], got["log"]
        else:
            assert got["log"] == [], got["log"]
    # the evaluation really is eval mode: batch statistics or dropout would give other logits
    plain = copy.deepcopy(model).train()
    with torch.no_grad():
        assert not torch.allclose(plain(**val)["logits"], ref["logits"], rtol=1e-3)


def _refused(rank, world, model, traced, plan, train):
    pm = build_module(model, traced, dataclasses.replace(plan, budget_bytes=1000), device=torch.device("cpu"))
    pm(**train)["loss"].backward()  # training runs: only the replica is over the budget
    pm.eval()
    with pytest.raises(ValueError) as budget:
        pm(**train)
    low = autopar.autoparallelize(model, train, mesh=(2,), precision="bf16", cache=False)
    low.eval()
    with pytest.raises(NotImplementedError) as precision:
        low(**train)
    return str(budget.value), str(precision.value)


@pytest.mark.timeout(240)
def test_a_replica_over_the_budget_or_of_a_mixed_precision_plan_is_refused():
    model, train, _ = _cnn()
    traced, prof = rm.traced_of(model, train)
    for said, low in run_local(_refused, 2, model, traced, rm.plan_for(traced, prof, (2,)), train, timeout=200):
        assert "SmallCNN in evaluation mode runs on a replica of the whole model" in said, said
        assert "Plan.budget_bytes" in said and "1000 bytes (0.000 GiB) per device" in said, said
        assert "autoparallelize the model in evaluation mode" in said, said
        assert "SmallCNN was traced and planned in training mode, and its batch norm (BatchNorm2d 'bn')" in low, low
        assert "the plan computes in bf16" in low, low


def _reference_of(name: str):
    model, train, val = MODELS[name]()
    traced, prof = rm.traced_of(model, train)
    ref = run_local(_reference, 1, model, traced, rm.plan_for(traced, prof, (1,)), train, val, timeout=240)[0]
    return model, train, val, traced, prof, ref


def _local_inputs(rank, world, model, traced, plan, train, val):
    """Each rank passes its pieces of the inputs (the Booster's ``prepare_dataloader`` path)."""
    from autopar.runtime.materialize import slice_local

    autopar.manual_seed(rm.SEED)
    pm = build_module(model, traced, plan, device=torch.device("cpu"), local_inputs=True)

    def pieces(batch):
        return {k: slice_local(v, pm.input_specs[k], pm.pmesh) if k in pm.input_specs else v
                for k, v in batch.items()}

    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    losses = [_step(pm, opt, pieces(train)) for _ in range(2)]
    pm.eval()
    with torch.no_grad():
        out = pm(**pieces(val))
        whole = pm(**val)  # a validation loader's whole global batches are taken as they are
    pm.train()
    losses.append(_step(pm, opt, pieces(train)))
    split = any(not s.is_replicated() for s in pm.input_specs.values())
    return {"losses": torch.stack(losses), "logits": out["logits"], "whole": whole["logits"], "split": split}


@pytest.mark.timeout(300)
def test_eval_with_local_inputs_gathers_the_pieces():
    model, train, val, traced, prof, ref = _reference_of("cnn")
    plan = rm.plan_for(traced, prof, (2,))
    for got in run_local(_local_inputs, 2, model, traced, plan, train, val, timeout=240):
        assert got["split"], "the plan should split the batch: else the pieces are whole"
        assert _close(got["logits"], ref["logits"]) and _close(got["losses"], ref["losses"])
        assert _close(got["whole"], ref["logits"])


def _pipeline(rank, world, model, traced, plan, train, val):
    from autopar.runtime.pipeline import build_pipeline

    autopar.manual_seed(rm.SEED)
    pm = build_pipeline(model, traced, plan, device="cpu")
    opt = torch.optim.SGD(pm.parameters(), lr=LR)

    def step():
        opt.zero_grad()
        loss = pm.step(**train)
        opt.step()
        return loss.detach().clone()

    losses = [step(), step()]
    pm.eval()
    with torch.no_grad():
        out = pm(**val)
    pm.train()
    losses.append(step())
    return {"losses": torch.stack(losses), "logits": out["logits"], "loss": out["loss"]}


@pytest.mark.timeout(400)
def test_a_pipelined_gpt2_evaluates_in_the_middle_of_training():
    model, train, val, _, _, ref = _reference_of("gpt2")
    traced, plan = rm.pipeline_plan_for(model, train, (2,))
    assert plan.pipeline is not None
    for got in run_local(_pipeline, 2, model, traced, plan, train, val, timeout=300):
        assert _close(got["losses"], ref["losses"]), f"{got['losses']} != {ref['losses']}"
        assert _close(got["logits"], ref["logits"]) and _close(got["loss"], ref["loss"])


def _per_rank(rank, world, model, train, val):
    pm = autopar.autoparallelize(model, train, mesh=(2,), batch_norm_stats="per_rank", cache=False)
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    _step(pm, opt, train)
    pm.eval()
    with torch.no_grad():
        got = pm(**val)["logits"]
    plain = copy.deepcopy(model)
    plain.load_state_dict(pm.full_state_dict())
    moved = not torch.equal(plain.bn.running_mean, model.bn.running_mean)
    with torch.no_grad():
        return moved, torch.allclose(got, plain.eval()(**val)["logits"], rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(240)
def test_eval_after_per_rank_batch_statistics_uses_the_running_statistics_they_wrote():
    """``batch_norm_stats="per_rank"`` rewrites the trace's batch norms (one chunk per rank); the
    replica is the original model, on the running statistics the training step wrote."""
    _, train, val = _cnn()
    torch.manual_seed(0)
    for moved, same in run_local(_per_rank, 2, SmallCNN(p=0.0).train(), train, val, timeout=200):
        assert moved and same


class Jitter(nn.Module):
    """Draws whatever its mode (``torch.rand_like`` outside any dropout)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return h + torch.rand_like(h)


def _jitter(rank, world, model, x):
    autopar.manual_seed(rm.SEED)  # autopar's draws: one seed on every rank (checked at build)
    pm = autopar.autoparallelize(model, (x,), mesh=(2,), cache=False)
    torch.manual_seed(100 + rank)  # torch's own generators differ between the ranks
    pm(x).sum().backward()
    pm.eval()
    before = torch.get_rng_state()
    with torch.no_grad():
        first, second = pm(x), pm(x)
    return first, second, torch.equal(before, torch.get_rng_state())


@pytest.mark.timeout(240)
def test_draws_in_eval_mode_agree_across_ranks_and_leave_the_generator_alone():
    torch.manual_seed(0)
    model, x = Jitter().train(), torch.randn(4, 8)
    (a1, a2, kept_a), (b1, b2, kept_b) = run_local(_jitter, 2, model, x, timeout=200)
    assert torch.equal(a1, b1) and torch.equal(a2, b2) and kept_a and kept_b
    assert not torch.equal(a1, a2)  # each eval call draws afresh
    noise = a1 - model.fc(x).detach()
    assert 0 <= noise.min() and noise.max() < 1
