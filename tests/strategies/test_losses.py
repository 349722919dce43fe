"""Every torch.nn loss (and distance module), traced as users call it.

1. Every op of the traced graph has a sharding rule (``operator.getitem`` and ops tagged
   ``torch.Tag.pointwise`` aside: those get the generic rule).
2. The graph's loss/distance ops (families ``_loss*`` and ``_distance``) offer a sharded strategy
   on meshes (4,) and (2, 2), and every strategy they offer reproduces the op, forward and
   backward, on the traced shapes and arguments (the values come from running the traced graph).
3. What cannot be traced is reported by the tracer, naming the op: ``GaussianNLLLoss`` with a
   tensor ``var`` (its ``torch.any(var < 0)`` check is data-dependent) and ``CTCLoss`` (ATen's
   ``_ctc_loss`` has no shape function for fake tensors).
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.utils._pytree as pytree

from autopar.layout.mesh import MeshSpec
from autopar.strategies import enumerate_strategies, get_rule
from autopar.strategies.check import StrategyMismatch, check_strategy, reference
from autopar.strategies.registry import Sample
from autopar.tracer import TraceError, trace
from autopar.tracer.graph import BUFFER, INPUT, PARAMETER

aten = torch.ops.aten
MESHES = [(4,), (2, 2)]
_FAMILIES = {"_loss", "_loss_elementwise", "_loss_margin", "_distance"}
# Inputs the op is not differentiable in (autograd refuses them with requires_grad=True).
_NO_GRAD = ("weight", "pos_weight")
_NO_GRAD_BY_OP = {aten.soft_margin_loss.default: ("target",)}

N, C, D = 8, 8, 8  # every split dim divides by 4 and by 2x2


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _randn(g, *shape):
    return torch.randn(shape, dtype=torch.float64, generator=g)


def _prob(g, *shape):
    return torch.sigmoid(_randn(g, *shape))


def _sign(g, *shape):
    return (torch.rand(shape, generator=g) > 0.5).to(torch.float64) * 2 - 1


def _ids(g, high, *shape):
    return torch.randint(0, high, shape, generator=g)


def _multilabel(g):
    t = _ids(g, C, N, C)
    t[:, 3] = -1  # labels end at the first -1
    t[0, 0] = -1
    return t


# name -> (module factory taking the reduction, inputs from a generator)
CASES = {
    "L1Loss": (lambda r: nn.L1Loss(reduction=r), lambda g: (_randn(g, N, D), _randn(g, N, D))),
    "MSELoss": (lambda r: nn.MSELoss(reduction=r), lambda g: (_randn(g, N, D), _randn(g, N, D))),
    "MSELoss-broadcast": (lambda r: nn.MSELoss(reduction=r), lambda g: (_randn(g, 4, N, D), _randn(g, N, D))),
    "SmoothL1Loss": (lambda r: nn.SmoothL1Loss(reduction=r), lambda g: (_randn(g, N, D), _randn(g, N, D))),
    "HuberLoss": (lambda r: nn.HuberLoss(reduction=r, delta=0.5), lambda g: (_randn(g, N, D), _randn(g, N, D))),
    "BCELoss": (lambda r: nn.BCELoss(reduction=r), lambda g: (_prob(g, N, D), _prob(g, N, D))),
    "BCELoss-weight": (lambda r: nn.BCELoss(weight=_prob(_gen(), D), reduction=r),
                       lambda g: (_prob(g, N, D), _prob(g, N, D))),
    "BCEWithLogitsLoss": (lambda r: nn.BCEWithLogitsLoss(reduction=r), lambda g: (_randn(g, N, D), _prob(g, N, D))),
    "BCEWithLogitsLoss-pos_weight": (
        lambda r: nn.BCEWithLogitsLoss(pos_weight=_prob(_gen(), D) + 0.5, reduction=r),
        lambda g: (_randn(g, N, D), _prob(g, N, D))),
    "KLDivLoss": (lambda r: nn.KLDivLoss(reduction=r),
                  lambda g: (torch.log_softmax(_randn(g, N, D), 1), torch.softmax(_randn(g, N, D), 1))),
    "KLDivLoss-log_target": (lambda r: nn.KLDivLoss(reduction=r, log_target=True),
                             lambda g: (torch.log_softmax(_randn(g, N, D), 1),
                                        torch.log_softmax(_randn(g, N, D), 1))),
    "NLLLoss": (lambda r: nn.NLLLoss(reduction=r), lambda g: (torch.log_softmax(_randn(g, N, C), 1), _ids(g, C, N))),
    "NLLLoss-weight-2d": (lambda r: nn.NLLLoss(weight=_prob(_gen(), C), reduction=r, ignore_index=2),
                          lambda g: (torch.log_softmax(_randn(g, 4, C, 4, 4), 1), _ids(g, C, 4, 4, 4))),
    "CrossEntropyLoss": (lambda r: nn.CrossEntropyLoss(reduction=r, label_smoothing=0.1),
                         lambda g: (_randn(g, N, C), _ids(g, C, N))),
    "CrossEntropyLoss-probs": (lambda r: nn.CrossEntropyLoss(reduction=r),
                               lambda g: (_randn(g, N, C), torch.softmax(_randn(g, N, C), 1))),
    "PoissonNLLLoss": (lambda r: nn.PoissonNLLLoss(reduction=r, full=True),
                       lambda g: (_randn(g, N, D), _prob(g, N, D) * 3)),
    "GaussianNLLLoss-float-var": (lambda r: nn.GaussianNLLLoss(reduction=r),
                                  lambda g: (_randn(g, N, D), _randn(g, N, D), 0.5)),
    "SoftMarginLoss": (lambda r: nn.SoftMarginLoss(reduction=r), lambda g: (_randn(g, N, D), _sign(g, N, D))),
    "HingeEmbeddingLoss": (lambda r: nn.HingeEmbeddingLoss(reduction=r),
                           lambda g: (_randn(g, N, D), _sign(g, N, D))),
    "MarginRankingLoss": (lambda r: nn.MarginRankingLoss(margin=0.2, reduction=r),
                          lambda g: (_randn(g, N), _randn(g, N), _sign(g, N))),
    "CosineEmbeddingLoss": (lambda r: nn.CosineEmbeddingLoss(margin=0.1, reduction=r),
                            lambda g: (_randn(g, N, D), _randn(g, N, D), _sign(g, N))),
    "MultiMarginLoss": (lambda r: nn.MultiMarginLoss(reduction=r), lambda g: (_randn(g, N, C), _ids(g, C, N))),
    "MultiMarginLoss-p2-weight": (lambda r: nn.MultiMarginLoss(p=2, weight=_prob(_gen(), C), reduction=r),
                                  lambda g: (_randn(g, N, C), _ids(g, C, N))),
    "MultiLabelMarginLoss": (lambda r: nn.MultiLabelMarginLoss(reduction=r),
                             lambda g: (_randn(g, N, C), _multilabel(g))),
    "MultiLabelSoftMarginLoss": (lambda r: nn.MultiLabelSoftMarginLoss(reduction=r),
                                 lambda g: (_randn(g, N, C), (_sign(g, N, C) + 1) / 2)),
    "TripletMarginLoss": (lambda r: nn.TripletMarginLoss(reduction=r),
                          lambda g: (_randn(g, N, D), _randn(g, N, D), _randn(g, N, D))),
    "TripletMarginWithDistanceLoss": (lambda r: nn.TripletMarginWithDistanceLoss(reduction=r),
                                      lambda g: (_randn(g, N, D), _randn(g, N, D), _randn(g, N, D))),
}
# Modules without a reduction.
PLAIN = {
    "CosineSimilarity": (lambda: nn.CosineSimilarity(), lambda g: (_randn(g, N, D), _randn(g, N, D))),
    "CosineSimilarity-3d": (lambda: nn.CosineSimilarity(dim=2), lambda g: (_randn(g, 4, N, D), _randn(g, 4, N, D))),
    "PairwiseDistance": (lambda: nn.PairwiseDistance(), lambda g: (_randn(g, N, D), _randn(g, N, D))),
    "PairwiseDistance-p1-keepdim": (lambda: nn.PairwiseDistance(p=1.0, keepdim=True),
                                    lambda g: (_randn(g, N, D), _randn(g, N, D))),
}
REDUCTIONS = ("none", "mean", "sum")


# Traced into pointwise ops and ``mean`` only (F.gaussian_nll_loss is Python): no loss op.
_NO_LOSS_OP = {"GaussianNLLLoss-float-var"}


def _params(skip=()):
    out = [pytest.param(name, r, id=f"{name}-{r}") for name in CASES if name not in skip for r in REDUCTIONS]
    out.append(pytest.param("KLDivLoss", "batchmean", id="KLDivLoss-batchmean"))
    out += [pytest.param(name, None, id=name) for name in PLAIN]
    return out


def _build(name: str, reduction: str | None) -> tuple[nn.Module, tuple]:
    make, inputs = CASES[name] if reduction is not None else PLAIN[name]
    module = make(reduction) if reduction is not None else make()
    return module, inputs(_gen())


def _has_rule_or_generic(target) -> bool:
    if target is operator.getitem:
        return True
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        return True  # the generic pointwise rule
    return get_rule(target) is not None


def _node_values(traced, module: nn.Module, inputs: tuple) -> dict[torch.fx.Node, object]:
    """Run the traced graph on concrete values; every node's value."""
    user = iter(x for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor))
    args = []
    for p in traced.placeholders:
        if p.kind == BUFFER:
            args.append(module.get_buffer(p.fqn))
        elif p.kind == PARAMETER:
            args.append(module.get_parameter(p.fqn))
        elif p.kind == INPUT:
            args.append(next(user))
        else:
            raise AssertionError(f"unexpected placeholder {p}")
    values: dict[torch.fx.Node, object] = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            values[n] = super().run_node(n)
            return values[n]

    Recorder(traced.gm).run(*args)
    return values


@pytest.mark.parametrize("name, reduction", _params())
def test_every_op_of_the_traced_loss_has_a_rule(name, reduction):
    module, inputs = _build(name, reduction)
    traced = trace(module, inputs)
    missing = sorted({str(n.target) for n in traced.compute_nodes() if not _has_rule_or_generic(n.target)})
    assert not missing, f"{name} ({reduction}): no rule for {missing}"


@pytest.mark.parametrize("name, reduction", _params(skip=_NO_LOSS_OP))
def test_traced_loss_ops_are_sharded_and_exact(name, reduction):
    module, inputs = _build(name, reduction)
    traced = trace(module, inputs)
    values = _node_values(traced, module, inputs)
    nodes = [n for n in traced.compute_nodes()
             if get_rule(n.target) is not None and get_rule(n.target).family in _FAMILIES]
    assert nodes, f"{name}: no loss or distance op in the traced graph"
    failures = []
    for node in nodes:
        args = pytree.tree_map_only(torch.fx.Node, lambda a: values[a], node.args)
        kwargs = pytree.tree_map_only(torch.fx.Node, lambda a: values[a], node.kwargs)
        no_grad = _NO_GRAD + _NO_GRAD_BY_OP.get(node.target, ())
        sample = Sample(tuple(args), dict(kwargs), f"{name}-{reduction}", no_grad=no_grad)
        ref = reference(node.target, sample)
        for shape in MESHES:
            strategies = enumerate_strategies(ref[0], MeshSpec.preset("cpu", shape), flops=(0.0, 0.0))
            sharded = [s for s in strategies if any(sp is not None and not sp.is_replicated()
                                                    for sp in s.input_specs)]
            assert sharded, f"{name} ({reduction}): {node.target} has only replicated strategies on {shape}"
            for strategy in strategies:
                try:
                    check_strategy(node.target, sample, strategy, shape, ref=ref)
                except StrategyMismatch as exc:
                    failures.append(str(exc))
    assert not failures, "\n".join(failures)


def test_gaussian_nll_with_a_tensor_var_is_reported_by_the_tracer():
    # F.gaussian_nll_loss validates ``torch.any(var < 0)`` in Python: a data-dependent branch.
    g = _gen()
    with pytest.raises(TraceError, match=r"(?s)data-dependent.*gaussian_nll_loss|gaussian_nll_loss.*data-dependent"):
        trace(nn.GaussianNLLLoss(), (_randn(g, N, D), _randn(g, N, D), _prob(g, N, D)))


def test_ctc_loss_is_reported_by_the_tracer():
    # ATen's _ctc_loss has no meta/fake shape function (its log_alpha output is sized by values).
    g = _gen()
    log_probs = torch.log_softmax(_randn(g, 12, N, 6), 2)
    targets = _ids(g, 5, N, 4) + 1
    lengths = (torch.full((N,), 12), torch.full((N,), 4))
    with pytest.raises(TraceError, match="_ctc_loss"):
        trace(nn.CTCLoss(), (log_probs, targets, *lengths))
