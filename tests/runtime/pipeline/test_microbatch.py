"""A pipeline whose inputs are not all batch-major trains like the single-device model.

The model takes ``input_ids (B, S)``, ``positions (S,)`` (one positions tensor for every sample)
and ``labels (B, S)``. The planner traces one micro-batch by the micro-batch rule
(:mod:`autopar.tracer.microbatch`): ``input_ids`` and ``labels`` cut, ``positions`` whole; the
runtime splits the full batch by the same rule and tells torch's schedule so (``positions`` is
given whole to every micro-batch). On 2 gloo ranks (2 stages, 2 micro-batches, 1F1B) the loss,
every gradient, the forward-only logits and a criterion's per-micro-batch view equal one device
(and the module is a ``ParallelModule``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.api import plan_traced
from autopar.layout.mesh import MeshSpec
from autopar.planner.pipeline.assemble import pipeline_plan
from autopar.planner.pipeline.geometry import micro_inputs
from autopar.runtime.launch import run_local
from autopar.runtime.parallel_module import ParallelModule
from autopar.runtime.pipeline import build_pipeline
from autopar.strategies import needs_decomposition
from autopar.tracer import profile, trace
from tests.runtime.pipeline.test_pipeline import close

pytestmark = pytest.mark.slow  # forked gloo ranks

VOCAB, HIDDEN, BATCH, SEQ, MICRO = 32, 16, 4, 6, 2  # SEQ != BATCH: positions are not batch-major


class PositionsModel(nn.Module):
    """Token plus position embeddings, residual MLP blocks, a head and the mean token loss."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Embedding(SEQ, HIDDEN)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(),
                                                  nn.Linear(2 * HIDDEN, HIDDEN)) for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor):
        x = self.tok(input_ids) + self.pos(positions)  # (B, S, H) + (S, H)
        for block in self.blocks:
            x = x + block(x)
        logits = self.head(x)
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)), logits


def test_positions_input_is_whole_in_every_micro_batch():
    torch.manual_seed(0)
    model = PositionsModel()
    full = {"input_ids": torch.randint(0, VOCAB, (BATCH, SEQ)),
            "positions": torch.arange(SEQ).flip(0),  # not arange: a wrong split would change the result
            "labels": torch.randint(0, VOCAB, (BATCH, SEQ))}
    micro = micro_inputs(full, MICRO)
    assert micro["input_ids"].shape == (BATCH // MICRO, SEQ) and micro["positions"] is full["positions"]
    traced = trace(model, micro, decompose_if=needs_decomposition)
    one = plan_traced(traced, profile(traced), mesh=(1,)).plan
    plan = pipeline_plan(one, traced, mesh=MeshSpec.preset("cpu", (2,)), num_stages=2, num_microbatches=MICRO,
                         schedule="1f1b")
    ref_model = copy.deepcopy(model)
    loss, logits = ref_model(**full)
    loss.backward()
    ref = {"loss": loss.detach(), "logits": logits.detach(),
           "grads": {k: p.grad.clone() for k, p in ref_model.named_parameters()}}

    def body(rank, world):
        pm = build_pipeline(model, traced, plan, device="cpu")
        errors = [] if isinstance(pm, ParallelModule) else [f"rank {rank}: not a ParallelModule"]
        errors += close(f"rank {rank} loss", pm.step(**full), ref["loss"])
        grads = pm.full_gradients()
        errors += [e for k, want in ref["grads"].items() for e in close(f"rank {rank} grad {k}", grads.get(k), want)]
        out = pm(**full)
        errors += close(f"rank {rank} forward loss", out[0], ref["loss"])
        errors += close(f"rank {rank} forward logits", out[1], ref["logits"], atol=1e-5)
        seen = []

        def criterion(outputs, batch):  # the model's loss again, from this micro-batch's labels
            if not batch["input_ids"].is_meta:  # (once on meta tensors: traced for its micro-batch weights)
                seen.append((tuple(batch["input_ids"].shape), tuple(batch["positions"].shape)))
            return F.cross_entropy(outputs[1].reshape(-1, VOCAB), batch["labels"].reshape(-1))

        loss, merged = pm.step_with(criterion, return_outputs=True, **full)
        errors += close(f"rank {rank} criterion loss", loss, ref["loss"])
        errors += close(f"rank {rank} step_with logits", merged[1], ref["logits"], atol=1e-5)
        return errors, seen, pm.pp_rank

    results = run_local(body, 2, timeout=120)
    assert [e for errors, _, _ in results for e in errors] == []
    last = next(seen for _, seen, pp_rank in results if pp_rank == 1)
    assert last == [((BATCH // MICRO, SEQ), (SEQ,))] * MICRO  # the criterion sees positions whole
