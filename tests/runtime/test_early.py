"""A mean loss's denominator summed early (``runtime.early``): the emitted data-parallel graph
computes the number of labels not ignored and issues its all-reduce at the start of forward (the
labels' own ops hoisted there), the loss kernel divides by it at the end, and the step still
equals the single-device one -- loss, every gradient, clipped AdamW steps -- when the ranks hold
different numbers of ignored labels (-100), one rank none at all but ignored ones. The same run
checks that GPT-2's attention mask is folded into a constant (``runtime.fold``) with the same
values."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar import zoo
from autopar.runtime.build import build_module
from autopar.runtime.launch import run_local
from autopar.tracer import trace
from tests.runtime.test_e2e import check_module, fast_mesh, reference

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from _baselines import restricted_plan  # noqa: E402


class NllNet(nn.Module):
    """log-softmax + ``nll_loss`` (the ``nll_loss`` kernel's denominator), batch of tokens."""

    def __init__(self, vocab: int = 64, hidden: int = 256) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor):
        logits = self.head(torch.tanh(self.emb(input_ids)))
        loss = F.nll_loss(F.log_softmax(logits, -1).flatten(0, 1), labels.flatten(), ignore_index=-100)
        return loss, logits


def _uneven_ignored(labels: torch.Tensor) -> torch.Tensor:
    """Rank 0's half of the batch (dim 0) keeps one label, rank 1's keeps most of them."""
    labels = labels.clone()
    half = labels.shape[0] // 2
    labels[:half] = -100
    labels[0, 1] = 3
    labels[half:, ::3] = -100
    return labels


def _run(rank, world, cases):
    errors, codes = [], []
    for label, model, traced, plan, inputs, ref in cases:
        pm = build_module(model, traced, plan, device=torch.device("cpu"))
        codes.append(pm.code)
        errors += check_module(label, pm, inputs, ref)
    return errors, codes


def _case(label, model, inputs, shape=(2,)):
    plan = restricted_plan(model, inputs, mesh=fast_mesh(shape))
    return label, model, trace(model, inputs), plan, inputs, reference(model, inputs)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(2,), (2, 2)], ids=["2", "2x2"])
def test_denominator_summed_early_with_uneven_ignored_labels_equals_single_device(shape):
    """On (2, 2) the batch splits over both axes: the denominator is one sum on the group
    spanning them, in flight like the one-axis sum (no blocking all-reduce at forward's start)."""
    torch.manual_seed(5)
    gpt2, inputs = zoo.build("gpt2", tiny=True, device="cpu")
    inputs = {**inputs, "labels": _uneven_ignored(inputs["labels"])}
    nll_inputs = {"input_ids": torch.randint(0, 64, (8, 64)), "labels": _uneven_ignored(torch.randint(0, 64, (8, 64)))}
    cases = [_case("gpt2 cross_entropy", gpt2, inputs, shape), _case("nll_loss", NllNet(), nll_inputs, shape)]
    results = run_local(_run, math.prod(shape), cases, timeout=300)
    for rank, (errors, codes) in enumerate(results):
        assert not errors, f"rank {rank}: " + "\n".join(errors)
        for code, kernel in zip(codes, ("cross_entropy", "nll_loss")):
            lines = [line.strip() for line in code.splitlines()]
            early = next(i for i, line in enumerate(lines) if line.startswith(f"{kernel}_early = self.{kernel}_early("))
            first_param = next(i for i, line in enumerate(lines) if "self.grad_bucket(" in line)
            assert early < first_param, code  # issued before the model's first op reads a weight
            call = next(line for line in lines if f"= self.{kernel}(" in line)
            assert call.split("(", 1)[1].split(")")[0].endswith(f"{kernel}_early"), call
        # GPT-2's causal mask and position ids read no input: folded at build (runtime/fold.py).
        assert "self._autopar_folded." in codes[0] and "aten.arange" not in codes[0], codes[0]
        assert codes[0].count("is_causal = True") == 2, codes[0]  # tiny GPT-2's two blocks, as eager runs them


def test_pricing_unchanged_by_the_early_path():
    """The kernel falls back to summing its own summand (the numerical check's path): one
    scalar all-reduce either way, priced as before."""
    from autopar.strategies import get_kernel

    for name in ("cross_entropy", "nll_loss"):
        early = get_kernel(name).early
        assert early is not None and early.reads == ("target", "weight", "ignore_index")
