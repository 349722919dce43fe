"""Batch norm on a batch-sharded layout uses synchronised statistics, on real gloo processes.

A conv + BatchNorm2d + linear model is planned data parallel (restricted to the data-parallel
family, on a mesh with nearly free links, so the batch is split before the batch norm). The
emitted code must call the ``sync_batch_norm`` kernel; the forward output, the loss, the
running statistics, every gradient and the state after two AdamW steps must equal the
single-device model's. The data is chosen so that per-shard statistics would NOT match (the
two halves of the batch have different means), so a plain local batch norm fails this test.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.api import autoparallelize
from autopar.layout.mesh import MeshSpec
from autopar.runtime.launch import run_local

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from _baselines import restricted_plan  # noqa: E402

pytestmark = pytest.mark.slow

RTOL, ATOL = 1e-4, 1e-6
STEPS = 2


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)  # a bias before BN has no gradient
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor, labels: torch.Tensor):
        h = F.relu(self.bn(self.conv(x)))
        logits = self.head(h.mean((2, 3)))
        return F.cross_entropy(logits, labels), logits


def fast_mesh(shape):
    mesh = MeshSpec.preset("cpu", shape)
    return dataclasses.replace(mesh, alpha=(1e-7,) * len(shape), beta=(1e-13,) * len(shape), name="fast-links")


def _inputs(batch: int = 8) -> dict:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(batch, 3, 8, 8, generator=gen)
    x[batch // 2:] = 2.0 * x[batch // 2:] + 1.5  # the halves differ: local statistics would be wrong
    return {"x": x, "labels": torch.randint(0, 5, (batch,), generator=gen)}


def _reference(model, inputs) -> dict:
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5)
    loss, logits = model(**inputs)
    loss.backward()
    out = {"loss": loss.detach(), "logits": logits.detach(),
           "stats": {k: v.clone() for k, v in model.state_dict().items() if k.startswith("bn.running")},
           "grads": {k: p.grad.clone() for k, p in model.named_parameters()}}
    opt.step()
    for _ in range(STEPS - 1):
        opt.zero_grad()
        model(**inputs)[0].backward()
        opt.step()
    out["state"] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


def _run(rank, world, model, inputs, plan):
    pm = autoparallelize(model, inputs, plan=plan)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=1e-5)
    loss, logits = pm(**inputs)
    loss.backward()
    full = pm.full_state_dict()
    out = {"code": pm.code, "loss": loss.detach(), "logits": logits.detach(),
           "stats": {k: v.clone() for k, v in full.items() if k.startswith("bn.running")},
           "grads": {k: g.clone() for k, g in pm.full_gradients().items()}}
    opt.step()
    for _ in range(STEPS - 1):
        opt.zero_grad()
        pm(**inputs)[0].backward()
        opt.step()
    out["state"] = pm.full_state_dict()
    return out


def _close(got, want, what):
    assert got.shape == want.shape, what
    assert torch.allclose(got, want, rtol=RTOL, atol=ATOL), \
        f"{what}: max abs error {(got - want).abs().max().item():.3g}"


@pytest.mark.parametrize("shape", [(2,), (2, 2)], ids=["2", "2x2"])
def test_batch_split_batch_norm_uses_synchronised_statistics(shape):
    torch.manual_seed(0)
    model = ConvBN().train()
    inputs = _inputs()
    plan = restricted_plan(model, inputs, mesh=fast_mesh(shape))
    bn = [n for n in plan.nodes if n.op.startswith("aten.batch_norm") or "native_batch_norm" in n.op]
    assert len(bn) == 1, [n.op for n in plan.nodes]
    assert "S0" in bn[0].input_specs[0], f"the plan must split the batch norm's batch: {bn[0]}"
    ref = _reference(model, inputs)
    # The data separates global from per-shard statistics.
    half = copy.deepcopy(model)
    half(**{k: v[: len(v) // 2] for k, v in inputs.items()})
    assert not torch.allclose(half.bn.running_mean, ref["stats"]["bn.running_mean"], rtol=1e-2)

    results = run_local(_run, 2 if shape == (2,) else 4, model, inputs, plan)
    for rank, res in enumerate(results):
        assert "self.sync_batch_norm(" in res["code"], res["code"]
        _close(res["loss"], ref["loss"], f"rank {rank} loss")
        _close(res["logits"], ref["logits"], f"rank {rank} logits")
        for k, want in ref["stats"].items():
            _close(res["stats"][k], want, f"rank {rank} {k} after one step")
        for k, want in ref["grads"].items():
            _close(res["grads"][k], want, f"rank {rank} grad {k}")
        assert set(res["state"]) == set(ref["state"])
        for k, want in ref["state"].items():
            if want.dtype.is_floating_point:
                _close(res["state"][k], want, f"rank {rank} {k} after {STEPS} AdamW steps")
            else:
                assert torch.equal(res["state"][k], want), k
