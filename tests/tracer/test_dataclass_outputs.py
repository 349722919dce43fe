"""A forward returning the user's own dataclass (not a transformers ModelOutput) traces, and the
traced graph rebuilds that dataclass with the eager values; a dataclass that cannot be rebuilt
from its fields still raises the TraceError naming it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from autopar.tracer import TraceError, trace


@dataclasses.dataclass
class Parts:
    hidden: torch.Tensor
    scale: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class StepOutput:
    loss: torch.Tensor
    parts: Parts


@dataclasses.dataclass
class WithDerived:
    logits: torch.Tensor
    norm: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self):
        self.norm = self.logits.norm()


class ReturnsDataclass(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 3)

    def forward(self, x, y):
        h = self.proj(x)
        return StepOutput(loss=nn.functional.cross_entropy(h, y), parts=Parts(hidden=h))


class ReturnsDerived(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 3)

    def forward(self, x):
        return WithDerived(self.proj(x))


def test_a_nested_dataclass_output_traces_and_is_rebuilt_with_the_eager_values():
    torch.manual_seed(0)
    model, inputs = ReturnsDataclass(), {"x": torch.randn(6, 4), "y": torch.randint(0, 3, (6,))}
    traced = trace(model, inputs)
    assert traced.loss_node is not None
    with torch.no_grad():
        rebuilt = traced.unflatten_outputs(traced.gm(*traced.bind(model, inputs)))
        want = model(**inputs)
    assert isinstance(rebuilt, StepOutput) and isinstance(rebuilt.parts, Parts)
    assert rebuilt.parts.scale is None
    torch.testing.assert_close(rebuilt.loss, want.loss)
    torch.testing.assert_close(rebuilt.parts.hidden, want.parts.hidden)


def test_a_dataclass_with_a_field_outside_init_is_named_in_the_error():
    with pytest.raises(TraceError) as info:
        trace(ReturnsDerived(), (torch.randn(6, 4),))
    assert "output is a WithDerived holding tensors" in str(info.value)
    assert "torch.export.register_dataclass" in info.value.hint
