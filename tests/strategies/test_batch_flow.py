"""``strategies/batch_flow.py``: a forward that mixes samples across the batch before the loss is
found (micro-batches would each see only their own), one that keeps them apart is not."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar import zoo
from autopar.strategies.batch_flow import batch_mixing, pipeline_hazard
from autopar.planner.orchestrate import trace_for_planning


def trace(model, inputs):
    return trace_for_planning(model, inputs, precision="fp32")  # the graph planner and runtime check


class Contrastive(nn.Module):
    """CLIP's loss: every text against every image of the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.text, self.image = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, y):
        u, v = F.normalize(self.text(x), dim=-1), F.normalize(self.image(y), dim=-1)
        logits = u @ v.t()
        return F.cross_entropy(logits, torch.arange(x.shape[0], device=x.device))


class Centred(nn.Module):
    """Subtracts the batch mean: each sample's activations depend on the others'."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 5)

    def forward(self, x, labels):
        h = self.proj(x)
        return F.cross_entropy(h - h.mean(0, keepdim=True), labels)


class PerSample(nn.Module):
    """Per-sample layers, a mask shared by the batch, and a mean loss: micro-batches are exact."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.cls = nn.Linear(8, 8), nn.Parameter(torch.zeros(1, 1, 8))

    def forward(self, x, labels):
        tokens = torch.cat([self.cls.expand(x.shape[0], -1, -1), self.proj(x)], dim=1)
        mask = torch.ones(tokens.shape[1], tokens.shape[1]).tril().bool().expand(x.shape[0], 1, -1, -1)
        h = F.scaled_dot_product_attention(tokens[:, None], tokens[:, None], tokens[:, None], attn_mask=mask)
        return F.cross_entropy(h[:, 0, 0], labels)


def _xy(batch=4):
    return {"x": torch.randn(batch, 3, 8), "labels": torch.randint(0, 8, (batch,))}


@pytest.mark.parametrize("model, inputs, node", [
    (Contrastive(), {"x": torch.randn(4, 8), "y": torch.randn(4, 8)}, "matmul"),
    (Centred(), {"x": torch.randn(4, 8), "labels": torch.randint(0, 5, (4,))}, "mean"),
])
def test_an_op_that_mixes_samples_is_named(model, inputs, node):
    why = batch_mixing(trace(model, inputs), inputs)
    assert why is not None and f"node {node!r}" in why and "micro-batch" in why


def test_per_sample_layers_a_shared_mask_and_the_loss_reduction_are_not_mixing():
    model, inputs = PerSample(), _xy()
    assert batch_mixing(trace(model, inputs), inputs) is None


@pytest.mark.parametrize("name", ["gpt2", "llama-1b", "bert-base", "vit-base"])
def test_the_zoos_transformers_keep_samples_apart(name):
    model, inputs = zoo.build(name, tiny=True, batch=4, seq=16, device="meta")
    assert pipeline_hazard(trace(model, inputs), inputs) is None


def test_a_training_batch_norm_is_found_by_the_statistics_check_first():
    model, inputs = zoo.build("resnet50", tiny=True, batch=4, seq=16, device="meta")
    assert "batch norm in training mode" in pipeline_hazard(trace(model, inputs), inputs)


def test_one_sample_micro_batches_are_followed_on_the_full_batch():
    import autopar

    model, inputs = Contrastive(), {"x": torch.randn(2, 8), "y": torch.randn(2, 8)}
    assert batch_mixing(trace(model, {k: v[:1] for k, v in inputs.items()})) is None  # nothing to follow
    with pytest.raises(NotImplementedError, match=r"node 'matmul'.*pipeline=1"):
        autopar.plan(model, inputs, mesh=(2,), pipeline=2, microbatches=2)
