"""Trace-time decomposition of ops without a rule: the pieces are planned, carry metadata, and the
graph still computes the model (value and gradients)."""

import torch
from torch import nn

from autopar.strategies import needs_decomposition, rule_for
from autopar.tracer import trace
from autopar.tracer.decompose import DECOMPOSED_KEY


class GluNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 16)
        self.cell = nn.LSTMCell(8, 8)

    def forward(self, x):
        y = nn.functional.glu(self.proj(x), dim=-1)  # glu: no rule, decomposed into slices, sigmoid, mul
        h, c = self.cell(y)
        return (h + c).pow(2).mean()


def _ops(traced) -> set:
    return {str(n.target) for n in traced.compute_nodes()}


def test_unruled_ops_become_ruled_pieces_with_the_module_path():
    model, x = GluNet(), torch.randn(4, 8)
    plain = trace(model, (x,))
    assert "aten.glu.default" in _ops(plain)
    traced = trace(model, (x,), decompose_if=needs_decomposition)
    assert "aten.glu.default" not in _ops(traced)
    assert "aten.glu.default" in traced.decomposed
    for node in traced.compute_nodes():
        assert rule_for(node.target) is not None or node.target.__name__ == "getitem", node.target
        if node.meta.get(DECOMPOSED_KEY) == "aten.glu.default":
            assert traced.module_path(node) == "" and isinstance(node.meta["val"], torch.Tensor)
    # in-place pieces of decompositions (lstm_cell's sigmoid_) are functionalized away
    assert not any(n.target._schema.is_mutable for n in traced.compute_nodes()
                   if isinstance(n.target, torch._ops.OpOverload))
    assert traced.loss_node is not None


def test_decomposed_graph_computes_the_model_and_its_gradients():
    torch.manual_seed(0)
    model, x = GluNet(), torch.randn(4, 8)
    traced = trace(model, (x,), decompose_if=needs_decomposition)
    values = traced.bind(model, {"x": x})
    got = traced.gm(*values)[0]
    got.backward()
    want = model(x)
    grads = torch.autograd.grad(want, list(model.parameters()))
    assert torch.allclose(got, want)
    for p, g in zip(model.parameters(), grads):
        assert torch.allclose(p.grad, g, atol=1e-6)


def test_no_decomposition_when_every_op_has_a_rule():
    model, x = nn.Sequential(nn.Linear(8, 8), nn.GELU()), torch.randn(4, 8)
    assert trace(model, (x,), decompose_if=needs_decomposition).decomposed == {}


class RepeatedBias(nn.Module):
    """WavLM's relative position bias: a permuted embedding repeated per sample, then viewed."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Embedding(10, 3)

    def forward(self, x):
        pos = torch.arange(5)
        table = self.bias(pos[:, None] - pos[None, :] + 4).permute(2, 0, 1)  # (3, 5, 5), strided
        bias = table.unsqueeze(0).repeat(x.shape[0], 1, 1, 1).view(-1, 5, 5)
        return (x.repeat_interleave(3, 0) * bias).sum()


def test_a_decomposition_keeps_the_contiguous_layout_the_graph_was_traced_with():
    from autopar.tracer import profile

    torch.manual_seed(0)
    model, x = RepeatedBias(), torch.randn(2, 5, 5)
    traced = trace(model, (x,), decompose_if=needs_decomposition)
    assert "aten.repeat.default" in traced.decomposed
    profile(traced)  # the view after the repeat's pieces runs on fake tensors
    got = traced.gm(*traced.bind(model, {"x": x}))[0]
    got.backward()
    want = model(x)
    (grad,) = torch.autograd.grad(want, [model.bias.weight])
    assert torch.allclose(got, want) and torch.allclose(model.bias.weight.grad, grad)
