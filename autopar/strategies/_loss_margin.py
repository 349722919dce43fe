"""Margin and embedding losses (at::Reduction: 0 none, 1 mean, 2 sum).

Elementwise ones -- one loss per element of the inputs' broadcast shape, then reduced -- use the
rule of ``_loss_elementwise.py`` (split any broadcast dim; ``none`` -> split output, ``sum`` ->
``Partial``, ``mean`` -> ``Partial`` via ``loss_mean``, the local mean over the shard count):

- ``soft_margin_loss``      log(1 + exp(-y x)); not differentiable in ``target``;
- ``hinge_embedding_loss``  x where y = 1, max(0, margin - x) where y = -1;
- ``margin_ranking_loss``   max(0, -y (x1 - x2) + margin).

Per-row ones reduce a row of features or classes to one loss per sample, so only the batch dim 0
is split (the same three outputs as above; ``mean`` divides by the number of samples, which the
even split divides exactly):

- ``multi_margin_loss``      self (N, C), target (N,) class ids, class ``weight`` (C,) replicated
  (not differentiable); sum over classes of max(0, margin - x[y] + x[i])^p;
- ``multilabel_margin_loss`` self (N, C), target (N, C) class ids padded with -1;
- ``cosine_embedding_loss``  input1/input2 (N, D), target (N,): cosine over D;
- ``triplet_margin_loss``    anchor/positive/negative (N, D): p-norm distances over D.

Splitting the class or feature dim would need the target logit, the norms or the distances from
all shards, and a backward that all-reduces their gradients: not offered. Unbatched (1-d)
inputs get only the replicated strategy. No ``Partial`` pass-through: none of these is linear.
"""

from __future__ import annotations

from typing import Sequence

import torch

from autopar.layout.placement import Replicate, Shard
from autopar.strategies.registry import AxisOption, OpInfo, Sample, register
from autopar.strategies.samples import ints, rand, randbool
from autopar.strategies._loss_elementwise import MEAN, NONE, SUM, elementwise_loss_rule, reduced_option

aten = torch.ops.aten
R = Replicate()


def _batch_rule(batched: Sequence[str], no_grad: Sequence[str] = ()):
    """Split dim 0 of a batched call: the ``batched`` inputs with the full batch there follow,
    size-1 ones (broadcast) are replicated; the others (a class ``weight``) stay replicated."""

    def rule(info: OpInfo) -> list[AxisOption]:
        metas = {name: info.input(name) for name in batched if info.input(name) is not None}
        if metas[batched[0]].ndim < 2:
            return []  # unbatched: one sample, nothing to split
        n = max(m.shape[0] for m in metas.values() if m.ndim)
        ins = {k: Shard(0) if m.ndim and m.shape[0] == n else R for k, m in metas.items()}
        return [reduced_option(info, 0, no_grad=no_grad, **ins)]

    rule.__name__ = "batch_loss"
    rule.__module__ = __name__
    return rule


# -------------------------------------------------------------------------------- samples
_REDUCTIONS = ((NONE, "none"), (MEAN, "mean"), (SUM, "sum"))


def _sign(*shape: int) -> torch.Tensor:
    return randbool(*shape).to(torch.float64) * 2 - 1  # targets in {-1, 1}


def _soft_margin_samples() -> list[Sample]:
    out = [Sample((rand(8, 4), _sign(8, 4), r), label=name, no_grad=("target",)) for r, name in _REDUCTIONS]
    return out + [Sample((rand(4, 8, 4), _sign(4, 8, 4), MEAN), label="3d-mean", no_grad=("target",))]


def _hinge_samples() -> list[Sample]:
    out = [Sample((rand(8, 4), _sign(8, 4), 0.5, r), label=name) for r, name in _REDUCTIONS]
    return out + [Sample((rand(4, 8, 4), _sign(4, 8, 4), 1.0, MEAN), label="3d-mean")]


def _ranking_samples() -> list[Sample]:
    out = [Sample((rand(16), rand(16), _sign(16), 0.3, r), label=name) for r, name in _REDUCTIONS]
    return out + [Sample((rand(4, 8), rand(8), _sign(4, 1), 0.1, MEAN), label="broadcast-mean")]


def _multi_margin_samples() -> list[Sample]:
    x, t = rand(8, 5), ints(5, 8)
    return [
        Sample((x, t), label="default-mean"),
        Sample((x, t, 2, 0.5, rand(5, positive=True), SUM), label="p2-weight-sum", no_grad=("weight",)),
        Sample((x, t, 1, 1.5, None, NONE), label="none"),
        # As many classes as samples: the (C,) weight must not be mistaken for a batched input.
        Sample((rand(8, 8), ints(8, 8), 1, 1.0, rand(8, positive=True), MEAN), label="C==N-weight",
               no_grad=("weight",)),
    ]


def _multilabel_samples() -> list[Sample]:
    t = ints(5, 8, 5)
    t[0] = torch.tensor([3, 0, -1, 2, 4])  # labels 3, 0; the rest padding
    t[3] = torch.tensor([1, -1, 1, 1, 1])
    t[5, 2] = -1
    t[6] = torch.tensor([0, 1, 2, 3, 4])  # every class a label: no negatives
    t[7, 0] = -1  # no label at all
    return [Sample((rand(8, 5), t, r), label=name) for r, name in _REDUCTIONS]


def _cosine_embedding_samples() -> list[Sample]:
    out = [Sample((rand(8, 6), rand(8, 6), _sign(8), 0.2, r), label=name) for r, name in _REDUCTIONS]
    return out + [Sample((rand(8, 6), rand(8, 6), _sign(8)), label="default")]


def _triplet_samples() -> list[Sample]:
    a, p, n = rand(8, 6), rand(8, 6), rand(8, 6)
    return [
        Sample((a, p, n), label="default-mean"),
        Sample((a, p, n, 2.0, 1.0, 1e-6, True, SUM), label="p1-swap-sum"),
        Sample((a, p, n, 1.5, 3.0, 1e-6, False, NONE), label="p3-none"),
        Sample((a, p, rand(1, 6), 1.0, 2.0, 1e-6, False, MEAN), label="broadcast-negative"),
    ]


# ---------------------------------------------------------------------------------- table
# op -> (rule, samples); every rule ends in ``reduced_option`` (the reduction-aware output).
_TABLE: dict = {
    aten.soft_margin_loss.default: (elementwise_loss_rule(("target",)), _soft_margin_samples),
    aten.hinge_embedding_loss.default: (elementwise_loss_rule(), _hinge_samples),
    aten.margin_ranking_loss.default: (elementwise_loss_rule(), _ranking_samples),
    aten.multi_margin_loss.default: (_batch_rule(("self", "target"), ("weight",)), _multi_margin_samples),
    aten.multilabel_margin_loss.default: (_batch_rule(("self", "target")), _multilabel_samples),
    aten.cosine_embedding_loss.default: (_batch_rule(("input1", "input2", "target")), _cosine_embedding_samples),
    aten.triplet_margin_loss.default: (_batch_rule(("anchor", "positive", "negative")), _triplet_samples),
}

for _op, (_rule, _samples) in _TABLE.items():
    register(_op, samples=_samples)(_rule)
