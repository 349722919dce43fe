"""A replicated embedding lookup that the plan splits over the batch is emitted as a lookup of
the split ids with the table bucketed (``runtime.local_lookup``): no all-gather of the activation
gradient in backward, no lookup of the other ranks' rows -- and the step still equals the
single-device one (loss, every gradient, clipped AdamW steps, repeated ids and a padding row
included). Where the rewrite would change values (``scale_grad_by_freq``: counts over the whole
batch), another reader needs the table (a tied head) or the table outweighs the batch (its
all-reduce would move more than the plan's all-gather), the plan's own conversion stays."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.layout.mesh import MeshSpec
from autopar.runtime.build import build_module
from autopar.runtime.launch import run_local
from autopar.tracer import trace
from tests.runtime.test_e2e import check_module, reference

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from _baselines import restricted_plan  # noqa: E402


class LookupNet(nn.Module):
    """An untied table about the size of the batch it looks up (1000 x 256 against 8 x 128 x 256,
    the benchmarks' Qwen2-style decoder): the data-parallel plan (real CPU link costs) looks up
    the whole batch on every rank and splits the result."""

    def __init__(self, vocab: int = 1000, hidden: int = 256, *, by_freq: bool = False, tied: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden, padding_idx=0, scale_grad_by_freq=by_freq)
        self.mix = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor):
        logits = self.head(torch.tanh(self.mix(self.emb(input_ids))))
        return (F.cross_entropy(logits.flatten(0, 1), labels.flatten()),)


def _inputs() -> dict:
    ids = torch.randint(0, 24, (8, 128))  # few distinct ids: rows repeat within and across the ranks' halves
    ids[0, :3] = 0  # the padding row
    return {"input_ids": ids, "labels": torch.randint(0, 1000, (8, 128))}


def _run(rank, world, cases):
    out = []
    for label, model, traced, plan, inputs, ref in cases:
        pm = build_module(model, traced, plan, device=torch.device("cpu"))
        out.append((label, pm.code, check_module(label, pm, inputs, ref)))
    return out


@pytest.mark.slow
def test_split_lookup_buckets_the_table_and_equals_single_device():
    torch.manual_seed(11)
    mesh = MeshSpec.preset("cpu", (2,))  # real link costs: moving the activation is cheaper than the table
    cases = []
    for label, kwargs in (("untied", {}), ("scale_grad_by_freq", {"by_freq": True}), ("tied", {"tied": True}),
                          ("large", {"vocab": 4000})):
        model, inputs = LookupNet(**kwargs), _inputs()
        plan = restricted_plan(model, inputs, mesh=mesh)
        cases.append((label, model, trace(model, inputs), plan, inputs, reference(model, inputs)))
    results = run_local(_run, 2, cases, timeout=300)
    for rank, res in enumerate(results):
        for label, code, errors in res:
            assert not errors, f"rank {rank} {label}: " + "\n".join(errors)
        codes = {label: code for label, code, _ in res}
        untied = [line.strip() for line in codes["untied"].splitlines()]
        lookup = next(line for line in untied if "aten.embedding.default(" in line)
        # the table bucketed, looked up by the split ids
        assert "embedding.default(grad_bucket" in lookup, codes["untied"]
        ids = lookup.split("(", 1)[1].split(",")[1].strip().rstrip(");")
        assert any(line.startswith(f"{ids} = self.split(input_ids") for line in untied), codes["untied"]
        assert "all_gather" not in codes["untied"], codes["untied"]
        # the rewrite would count ids per rank / bucket a table 4x the batch: the plan's lookup stays
        for label in ("scale_grad_by_freq", "large"):
            assert "embedding.default(p_emb_weight, input_ids" in codes[label], codes[label]
