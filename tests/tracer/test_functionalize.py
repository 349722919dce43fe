"""In-place writes to activations are removed at trace time (``autopar.tracer.functionalize``):
the traced graph computes what the model computes, values and gradients, with no op left that
writes an activation; a write the pass cannot invert is a clear ``TraceError``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.tracer import TraceError, trace
from autopar.tracer.functionalize import _written_slot


class WritesBlock(nn.Module):
    """Writes through views as models do: DeepSeek-V3's key assembled in slices of an empty
    tensor, a row scaled through ``select``, a routing table filled with ``scatter_``, an
    in-place ``div_``, one half overwritten from the other, and a read of the base between two
    writes."""

    def __init__(self) -> None:
        super().__init__()
        self.nope, self.pe, self.q, self.out = nn.Linear(16, 8), nn.Linear(16, 8), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        key = x.new_empty(x.shape[0], x.shape[1], 16)
        key[..., :8] = self.nope(x)
        early = key[..., :8].mean(-1, keepdim=True)  # read between the two writes: sees the first only
        key[..., 8:] = self.pe(x)
        att = torch.softmax(self.q(x) @ key.transpose(-1, -2), dim=-1) @ key
        att = att.clone()
        att[:, 0] *= 2.0
        top = att.sum(-1).topk(2, dim=-1).indices
        table = torch.zeros_like(att[..., 0]).scatter_(1, top, 1.0)
        att[..., 8:] = att[..., :8] * 0.5  # a write that reads its own base
        h = self.out(att * table.unsqueeze(-1))
        h.div_(2.0)
        return x + h + early


class Writes(nn.Module):
    """Two such blocks (repeated blocks: their sub-modules are recompute units) and a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([WritesBlock(), WritesBlock()])
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _inputs():
    g = torch.Generator().manual_seed(0)
    return {"x": torch.randn(2, 6, 16, generator=g), "labels": torch.randint(0, 5, (2, 6), generator=g)}


def _writes_activation(traced, node) -> bool:
    slot = _written_slot(node)
    if slot is None:
        return False
    value = node.args[slot]
    while value.op != "placeholder" and value.op == "call_function" and value.args:
        value = value.args[0]
    return value.op != "placeholder"


def test_no_activation_is_written_and_the_graph_computes_what_the_model_does():
    torch.manual_seed(0)
    model = Writes()
    inputs = _inputs()
    traced = trace(model, inputs)
    assert not [n.name for n in traced.compute_nodes() if _written_slot(n) is not None], traced.gm.code
    ops = {str(n.target) for n in traced.compute_nodes()}
    assert {"aten.slice_scatter.default", "aten.select_scatter.default", "aten.scatter.value"} <= ops
    assert "aten.new_zeros.default" in ops  # the uninitialised base is zero-filled: deterministic values

    want = model(**inputs)
    want.backward()
    want_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    (got,) = [v for v in traced.gm(*traced.bind(model, inputs)) if isinstance(v, torch.Tensor)]
    got.backward()
    torch.testing.assert_close(got, want)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[k], msg=k)


def test_a_model_without_writes_traces_to_the_same_graph():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    traced = trace(model, (torch.randn(4, 8),))
    assert traced.functionalize() == 0


def test_buffer_writes_stay_for_the_runtime():
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    traced = trace(model.train(), (torch.randn(4, 8),))
    written = [n for n in traced.compute_nodes() if _written_slot(n) is not None]
    assert written and not any(_writes_activation(traced, n) for n in written)


def test_an_in_place_activation_after_a_flatten_is_written_back():
    """MobileNetV2's classifier: ``nn.Dropout(inplace=True)`` on ``x.flatten(1)`` (p=0 here)."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(inplace=True), nn.Flatten(1), nn.Dropout(0.0, inplace=True),
                          nn.Linear(4 * 6 * 6, 3))
    x = torch.randn(2, 3, 8, 8)
    traced = trace(model.train(), (x,))
    assert not [n.name for n in traced.compute_nodes() if _written_slot(n) is not None]
    (got,) = traced.gm(*traced.bind(model, {"input": x}))
    torch.testing.assert_close(got, model(x))


class DiagonalWrite(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        y.diagonal().copy_(torch.ones(4))
        return y.sum()


def test_a_write_through_a_view_it_cannot_invert_is_a_clear_error():
    with pytest.raises(TraceError, match=r"in-place write 'copy_' .*diagonal.*cannot be inverted"):
        trace(DiagonalWrite(), (torch.randn(4, 4),))


class ConvertedThenWritten(nn.Module):
    """Informer's decoder attention: a float32 cumsum converted back, then rows overwritten. A
    conversion that changes the dtype copies (the write stays in the copy); one that changes
    nothing aliases (the write reaches its source, read again afterwards)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        context = x.cumsum(dim=0, dtype=torch.float32).to(x.dtype)  # float64 -> float32 -> float64: a copy
        context[1] = x[0] * 3
        same = x * 2
        alias = same.to(x.dtype)  # no conversion: the same tensor
        alias[0] = x[1]
        return context.sum() + (same * x).sum()


def test_writes_through_conversions_follow_what_aliases():
    torch.manual_seed(0)
    model, x = ConvertedThenWritten(), torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    traced = trace(model, (x,))
    assert not [n.name for n in traced.compute_nodes() if _written_slot(n) is not None]
    want = model(x)
    (want_grad,) = torch.autograd.grad(want, [x])
    (got,) = traced.gm(*traced.bind(model, {"x": x}))
    (got_grad,) = torch.autograd.grad(got, [x])
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_grad, want_grad)
