"""``runtime/pipeline/weights.py``: each micro-batch's weight in the full batch's loss, read off
the inputs -- counted targets for a token mean with ignored labels, 1 for a sum, 1/M otherwise --
and the losses it refuses (per-class weights)."""

import pytest
import torch
from torch import nn

from autopar.runtime.pipeline.weights import LossWeights
from autopar.tracer import trace


class Head(nn.Module):
    def __init__(self, *, reduction="mean", weight=None, loss="ce") -> None:
        super().__init__()
        self.proj = nn.Linear(8, 5)
        self.reduction, self.loss = reduction, loss
        self.register_buffer("class_weight", weight)

    def forward(self, x, labels):
        logits = self.proj(x)[:, :-1].flatten(0, 1)  # shifted like a causal LM's
        target = labels[:, 1:].flatten()
        if self.loss == "mse":
            return nn.functional.mse_loss(logits, torch.zeros_like(logits))
        return nn.functional.cross_entropy(logits, target, weight=self.class_weight, reduction=self.reduction)


def _inputs():
    labels = torch.randint(0, 5, (4, 6))
    labels[0, 2:] = -100  # micro-batch 0 (rows 0-1) counts 1 + 5 targets, micro-batch 1 counts 10
    return {"x": torch.randn(4, 6, 8), "labels": labels}


def _weights(model, inputs, m=2):
    traced = trace(model, inputs)
    by_name = {p.name: inputs[p.fqn] for p in traced.placeholders if p.fqn in inputs}
    return LossWeights(traced, m).weights(by_name, frozenset())


def test_a_token_mean_weighs_micro_batches_by_their_counted_targets():
    inputs = _inputs()
    assert _weights(Head(), inputs).tolist() == pytest.approx([6 / 16, 10 / 16])


def test_a_sum_weighs_one_and_a_mean_over_samples_one_over_m():
    inputs = _inputs()
    assert _weights(Head(reduction="sum"), inputs).tolist() == [1.0, 1.0]
    assert _weights(Head(loss="mse"), inputs).tolist() == [0.5, 0.5]


def test_per_class_weights_are_refused_naming_the_node():
    with pytest.raises(NotImplementedError, match="per-class loss weights.*pipeline=1"):
        _weights(Head(weight=torch.ones(5)), _inputs())


def _criterion_weights(criterion, inputs, m=2):
    """``LossWeights.of_criterion`` as ``step_with`` calls it: outputs ``(logits,)`` of one
    micro-batch, the criterion reading them and the micro-batch dict."""
    micro = {k: v.chunk(m)[0] for k, v in inputs.items()}
    outputs = [torch.empty(micro["x"].shape[:2] + (5,))]
    weights = LossWeights.of_criterion(criterion, lambda out: out[0], outputs, micro, m)
    return weights.criterion_weights([{k: v.chunk(m)[i] for k, v in inputs.items()} for i in range(m)])


def _shifted_ce(reduction):
    def criterion(logits, batch):
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                                           reduction=reduction)
    return criterion


def test_a_criterion_is_weighted_like_the_models_own_loss():
    inputs = _inputs()
    assert _criterion_weights(_shifted_ce("mean"), inputs).tolist() == pytest.approx([6 / 16, 10 / 16])
    assert _criterion_weights(_shifted_ce("sum"), inputs).tolist() == [1.0, 1.0]
    assert _criterion_weights(lambda logits, batch: logits.square().mean(), inputs).tolist() == [0.5, 0.5]


def test_a_criterion_that_reads_values_keeps_one_over_m_and_warns(caplog):
    def reads_values(logits, batch):
        return logits.sum() / int(batch["labels"].ne(-100).sum().item())

    assert _criterion_weights(reads_values, _inputs()).tolist() == [0.5, 0.5]
    assert "could not be traced" in caplog.text


class SumOverConstant(nn.Module):
    """A sum-reduced loss divided by a constant: the micro-batch losses must add up (weight 1),
    and the plain 1/M of an unknown expression would have trained on 1/M of the gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 5)

    def forward(self, x, labels):
        logp = torch.log_softmax(self.proj(x), dim=-1).flatten(0, 1)
        return nn.functional.nll_loss(logp, labels.flatten(), reduction="sum") / 100.0


class BatchNormed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj, self.norm = nn.Linear(8, 5), nn.BatchNorm1d(5)

    def forward(self, x, labels):
        return nn.functional.cross_entropy(self.norm(self.proj(x)), labels)


def test_a_loss_of_unknown_micro_batch_weights_is_refused_naming_the_node():
    with pytest.raises(NotImplementedError, match=r"the loss 'div' \(aten.div.Tensor.*pipeline=1"):
        _weights(SumOverConstant(), _inputs())


def test_batch_norm_with_batch_statistics_is_refused_and_blocks_auto_pipelines():
    from autopar.layout.mesh import MeshSpec
    from autopar.planner.options import PlanOptions
    from autopar.planner.pipeline.candidates import blocker

    model, inputs = BatchNormed(), {"x": torch.randn(8, 8), "labels": torch.randint(0, 5, (8,))}
    with pytest.raises(NotImplementedError, match=r"'batch_norm'.*module norm.*batch norm in training mode"):
        _weights(model, inputs)
    traced = trace(model, inputs)
    why = blocker(traced, inputs, mesh=MeshSpec.preset("cpu", (2,)), options=PlanOptions())
    assert why is not None and "batch norm in training mode" in why
    assert _weights(model.eval(), inputs).tolist() == [0.5, 0.5]  # running statistics: no coupling


class InBatchContrastive(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.text, self.image = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, y):
        logits = self.text(x) @ self.image(y).t()  # every text against every image of the batch
        return nn.functional.cross_entropy(logits, torch.arange(x.shape[0]))


def test_an_in_batch_contrastive_loss_is_refused_and_blocks_auto_pipelines():
    # its cross entropy has known weights, but each micro-batch would contrast only its own samples
    from autopar.layout.mesh import MeshSpec
    from autopar.planner.options import PlanOptions
    from autopar.planner.pipeline.candidates import blocker

    model, inputs = InBatchContrastive(), {"x": torch.randn(8, 8), "y": torch.randn(8, 8)}
    with pytest.raises(NotImplementedError, match=r"node 'matmul'.*combines samples of the batch.*pipeline=1"):
        _weights(model, inputs)
    why = blocker(trace(model, inputs), inputs, mesh=MeshSpec.preset("cpu", (2,)), options=PlanOptions())
    assert why is not None and "node 'matmul'" in why
