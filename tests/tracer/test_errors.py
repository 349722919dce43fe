"""TraceError names the op, the module path and the user's source line, with a hint."""

import inspect

import pytest
import torch
from torch import nn

from autopar import TraceError as LazyTraceError
from autopar.tracer import TraceError, trace


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        y = self.proj(x)
        if y.sum() > 0:  # data-dependent control flow
            return y * 2
        return y


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), Gate()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class Truncate(nn.Module):
    def forward(self, x, length):
        return x[:, : int(length)]  # a tensor used as a size


def _line_of(cls, text):
    lines, start = inspect.getsourcelines(cls)
    return start + next(i for i, line in enumerate(lines) if text in line)


def test_data_dependent_branch_names_module_line_and_op():
    with pytest.raises(TraceError) as info:
        trace(Net(), (torch.empty(4, 8, device="meta"),))
    err = info.value
    assert err.module_path == "blocks.1"
    assert err.source.startswith(f"{__file__}:{_line_of(Gate, 'if y.sum() > 0')}")
    assert "if y.sum() > 0" in err.source
    assert "__bool__" in err.op or "item" in err.op
    assert "data-dependent" in err.hint
    message = str(err)
    assert "blocks.1" in message and "test_errors.py" in message and "hint:" in message
    assert LazyTraceError is TraceError  # the package re-exports the same class


def test_tensor_used_as_size_hints_constant():
    with pytest.raises(TraceError) as info:
        trace(Truncate(), {"x": torch.empty(2, 10), "length": torch.tensor(3)})
    err = info.value
    assert err.module_path == ""
    assert "int(length)" in err.source
    assert "pass that value as a constant" in err.hint
    # the same value passed as a Python number is a constant and traces
    traced = trace(Truncate(), {"x": torch.empty(2, 10), "length": 3})
    assert traced.flat_outputs[0].meta["val"].shape == (2, 3)


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="nn.Module"):
        trace(lambda x: x, (torch.empty(2),))
    with pytest.raises(ValueError, match="tuple .* or a dict"):
        trace(Net(), "x")
    with pytest.raises(ValueError, match="positional inputs do not fit"):
        trace(Net(), (torch.empty(4, 8), torch.empty(4, 8)))


class Config:
    scale = 2.0


class Scaled(nn.Module):
    def forward(self, batch, cfg=None):
        x, inner = batch
        return x * (cfg or inner).scale


def test_non_tensor_object_inside_inputs_names_the_input():
    with pytest.raises(TraceError) as info:
        trace(Scaled(), {"batch": [torch.empty(2, 3), Config()]})
    assert "input batch[1] is a Config" in str(info.value)
    assert "pass it as a constant" in info.value.hint
    # as its own keyword input, the object is a constant and the model traces
    traced = trace(Scaled(), {"batch": [torch.empty(2, 3), None], "cfg": Config()})
    assert "aten.mul.Tensor" in traced.op_counts()
