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


# ---- one clear message, a hint per cause ------------------------------------------------------
def test_failed_trace_prints_nothing_and_restores_torch_loggers(capfd):

    import io
    import logging

    # Under pytest, torch's own handler writes elsewhere than capfd sees: listen on the logger too.
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    heard = io.StringIO()
    listener = logging.StreamHandler(heard)
    fake_log.addHandler(listener)
    capfd.readouterr()
    try:
        with pytest.raises(TraceError) as info:  # fake_tensor logs "failed while attempting to run meta"
            trace(nn.Linear(8, 4), (torch.empty(2, 5),))
    finally:
        fake_log.removeHandler(listener)
    out, err = capfd.readouterr()
    assert err == "" and out == "" and heard.getvalue() == ""
    assert info.value.op == "aten.mm.default"
    assert "shapes or dtypes" in info.value.hint and "not supported" not in info.value.hint
    assert "[2, 5] X [8, 4]" in info.value.cause
    assert not fake_log.disabled and not logging.getLogger("torch").disabled


class Holder:
    def __init__(self, tensor):
        self.tensor = tensor


class ReturnsObject(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        y = self.proj(x)
        return {"loss": y.sum(), "extra": [y, Holder(y)]}


def test_unknown_output_type_names_the_output_and_hints_at_outputs(capfd):
    capfd.readouterr()
    with pytest.raises(TraceError) as info:
        trace(ReturnsObject(), (torch.empty(2, 4),))
    err = info.value
    assert "output['extra'][1] is a Holder holding tensors" in str(err)
    assert "register Holder with torch.utils._pytree" in err.hint and "return tensors" in err.hint
    assert "input" not in err.hint
    assert capfd.readouterr() == ("", "")


class Pair:
    def __init__(self, first, second):
        self.first, self.second = first, second


torch.utils._pytree.register_pytree_node(  # the old way: no key paths
    Pair, lambda p: ([p.first, p.second], None), lambda values, _: Pair(*values))


class ReturnsPair(ReturnsObject):
    def forward(self, x):
        y = self.proj(x)
        return Pair(y.sum(), y)


def test_registered_output_type_traces_and_rebuilds():
    model, x = ReturnsPair(), torch.randn(2, 4)
    traced = trace(model, {"x": x})
    out = traced.unflatten_outputs(traced.gm(*traced.bind(model, {"x": x})))
    assert isinstance(out, Pair)
    torch.testing.assert_close(out.second, model.proj(x))


def test_export_output_error_gets_the_output_hint():
    # torch.export's own words for an unregistered output type (e.g. a class first created
    # while tracing): the hint is about outputs, not inputs, though the text says "pytree".
    from autopar.tracer.trace import _diagnose

    err = RuntimeError("Found <class 'x.Y'> in output, which is not a known type. If this type holds "
                       "tensors, you need to register a pytree for it.")
    hint = _diagnose(err, [], "M").hint
    assert "forward returns an object" in hint and "non-tensor input" not in hint
    bad_input = RuntimeError("Unsupported input type <class 'x.Y'>: register a pytree")
    assert "non-tensor input" in _diagnose(bad_input, [], "M").hint


class Picky(nn.Module):
    def forward(self, x):
        if x.dim() != 3:
            raise ValueError("Picky wants a 3-d input")
        return x * 2


def test_error_raised_by_the_model_code_says_so():
    with pytest.raises(TraceError) as info:
        trace(Picky(), (torch.empty(2, 4),))
    err = info.value
    assert err.cause == "Picky wants a 3-d input"
    assert "model's own code raised" in err.hint and "not supported" not in err.hint
    assert 'raise ValueError("Picky wants a 3-d input")' in err.source


def test_failed_trace_in_a_fresh_process_says_only_the_trace_error():
    # As a user sees it: torch's log handlers write to the real stderr of a fresh process.
    import subprocess
    import sys

    code = ("import torch\nfrom autopar.tracer import TraceError, trace\n"
            "try:\n    trace(torch.nn.Linear(8, 4), (torch.empty(2, 5),))\n"
            "except TraceError as err:\n    print(err)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stderr == "", out.stderr[-2000:]
    assert out.stdout.startswith("cannot trace Linear: RuntimeError") and "hint:" in out.stdout


def test_a_forward_that_writes_a_parameter_is_a_clear_trace_error():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16, 8, max_norm=1.0)  # renormalises its rows in forward

        def forward(self, ids):
            return self.emb(ids).sum()

    with pytest.raises(TraceError) as info:
        trace(Net(), (torch.randint(0, 16, (4, 5)),))
    err = info.value
    assert "writes parameter 'emb.weight' in place" in str(err)
    assert err.op == "aten.embedding_renorm_.default" and err.module_path == "emb" and "max_norm" in err.hint


class SplitByCounts(nn.Module):
    """JetMoE's experts: per-expert token counts read with ``.tolist()`` size a ``split``."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(8, 4)
        self.experts = nn.Parameter(torch.randn(4, 8, 8))

    def forward(self, x):
        expert = self.router(x).argmax(-1, keepdim=True)
        counts = torch.zeros(x.shape[0], 4).scatter(1, expert, 1).long().sum(0).tolist()
        parts = x[expert.flatten().sort().indices].split(counts, dim=0)
        return sum(nn.functional.linear(parts[i], self.experts[i]).sum() for i in range(4))


def test_value_read_as_number_is_named_at_profiling():
    from autopar.tracer import profile

    traced = trace(SplitByCounts(), (torch.randn(6, 8),))  # export lets the unbacked sizes through
    with pytest.raises(TraceError) as info:
        profile(traced)
    assert info.value.op in ("aten.item.default", "aten._local_scalar_dense.default")
    assert ".tolist()" in info.value.hint and "shapes only" in info.value.hint


class BooleanMaskIndex(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, keep):
        return self.proj(x[keep]).square().mean()  # rows chosen by a boolean mask: a data-dependent shape


def test_boolean_mask_indexing_is_named_as_a_data_dependent_shape_at_profiling():
    from autopar.tracer import profile

    traced = trace(BooleanMaskIndex(), (torch.randn(6, 8), torch.tensor([True, False] * 3)))
    with pytest.raises(TraceError) as info:
        profile(traced)
    assert info.value.op == "aten.index.Tensor"
    assert "boolean-mask indexing x[mask]" in info.value.hint and "torch.where" in info.value.hint


class MaskOnlyEagerly(nn.Module):
    """Switch Transformers' encoder: the default attention mask is built only when not compiling,
    so under torch.export the model indexes ``None``; run eagerly, it works."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, attention_mask=None):
        if attention_mask is None and not torch.compiler.is_compiling():
            attention_mask = torch.ones(x.shape[:2])
        return (self.proj(x) * attention_mask[:, :, None]).sum()


def test_error_only_under_export_says_so_and_what_to_pass():
    model, x = MaskOnlyEagerly(), torch.randn(2, 4, 8)
    model(x)  # eagerly it runs
    with pytest.raises(TraceError) as info:
        trace(model, (x,))
    assert "only under torch.export" in info.value.hint and "attention_mask" in info.value.hint
    assert "attention_mask[:, :, None]" in info.value.source
    traced = trace(model, {"x": x, "attention_mask": torch.ones(2, 4)})  # the hint's way out
    assert traced.loss_node is not None
    # a model that fails eagerly too keeps the hint that says so
    with pytest.raises(TraceError) as info:
        trace(nn.Linear(8, 4), (torch.empty(2, 5),))
    assert "fails the same way when run eagerly" in info.value.hint


class ClampsInNoGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        with torch.no_grad():  # export keeps the region as a wrap_with_set_grad_enabled sub-graph
            self.proj.weight.clamp_(-0.1, 0.1)
        return self.proj(x).sum()


def test_a_parameter_written_inside_no_grad_is_named():
    # It planned, and a plan sharding the weight clamped a temporary: the parameters after the
    # first step differed from one device.
    with pytest.raises(TraceError, match="writes parameter 'proj.weight' in place") as info:
        trace(ClampsInNoGrad(), (torch.randn(4, 8),))
    assert info.value.op == "aten.clamp_.default" and "outside forward" in info.value.hint


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x)
        h.register_hook(lambda grad: grad * 0.5)
        return h


class HookedOuter(nn.Module):
    def __init__(self, backward_hook: bool = False):
        super().__init__()
        self.inner = Inner() if not backward_hook else nn.Linear(8, 8)
        if backward_hook:
            self.inner.register_full_backward_hook(lambda module, grad_in, grad_out: None)

    def forward(self, x):
        return self.inner(x).sum()


@pytest.mark.parametrize("backward_hook", [False, True])
def test_a_gradient_hook_registered_in_forward_is_named(backward_hook):
    # It traced without the hook: every gradient before it silently lacked the hook's change.
    said = r"module 'inner' \(Linear\) has a backward hook" if backward_hook else \
        r"registers a gradient hook on a tensor \(Tensor.register_hook\)"
    with pytest.raises(TraceError, match=said) as info:
        trace(HookedOuter(backward_hook), (torch.randn(4, 8),))
    assert info.value.module_path == "inner"
    assert torch.Tensor.register_hook.__name__ == "register_hook"  # restored
