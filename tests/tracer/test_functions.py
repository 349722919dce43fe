"""Custom autograd.Functions: one op each, trained with the Function's own backward, never inlined."""

import pytest
import torch
from torch import nn

from autopar.tracer import TraceError, profile, trace
from autopar.tracer.function_graphs import pointwise_graphs
from autopar.tracer.functions import function_call, function_draws, function_seed, refused_function

_MAX_SQRT_GRADIENT = 1000.0


class ReverseGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.scale * grad, None


class StraightThroughRound(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class SqrtBoundDerivative(torch.autograd.Function):
    """RecurrentGemma's: a square root whose gradient is clipped near 0."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.sqrt(x)

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        return grad_output / torch.sqrt(torch.clip(4.0 * x, min=1 / (_MAX_SQRT_GRADIENT**2)))


class CumulativeMix(torch.autograd.Function):
    """Mixes along the last dim (not elementwise), with a backward that is not its derivative."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x.cumsum(-1) * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return 0.5 * (grad * w).flip(-1).cumsum(-1).flip(-1), (grad * x).sum(0)


class Functions(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, scale):
        h = self.proj(x)
        out = ReverseGradient.apply(h, 0.5) + StraightThroughRound.apply(3 * h)
        out = out + SqrtBoundDerivative.apply(h * h * scale)  # 0 where scale is 0: right at the clip
        return CumulativeMix.apply(out, self.proj.bias).pow(2).sum()


def _grads(model, loss):
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_traced_gradients_are_the_functions_own_including_at_the_clipping_edge():
    torch.manual_seed(0)
    model = Functions()
    x = torch.randn(4, 8)
    scale = torch.rand(4, 8)
    scale[0] = 0.0  # sqrt(0): the clipped gradient, where the derivative is infinite
    scale[1] = 1e-9  # inside the clip: 1/sqrt(4x) would be far larger
    inputs = {"x": x, "scale": scale}
    traced = trace(model, inputs)
    ops = traced.op_counts()
    assert ops["autopar.autograd_function.default"] == 4
    assert "aten.sqrt.default" not in ops and "aten.cumsum.default" not in ops  # not inlined
    (loss,) = traced.gm(*traced.bind(model, inputs))
    got = _grads(model, loss)
    want_loss = model(**inputs)
    want = _grads(model, want_loss)
    torch.testing.assert_close(loss, want_loss)
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)
    assert got["proj.weight"].isfinite().all()


def test_elementwise_is_decided_from_structure():
    model, inputs = Functions(), {"x": torch.randn(4, 8), "scale": torch.rand(4, 8)}
    traced = trace(model, inputs)
    keys = {function_call(n.args[0]).cls: n.args[0] for n in traced.nodes
            if n.target is torch.ops.autopar.autograd_function.default}
    assert pointwise_graphs(keys[ReverseGradient]) is not None  # view_as(x) is an alias
    assert pointwise_graphs(keys[StraightThroughRound]) is not None
    assert pointwise_graphs(keys[SqrtBoundDerivative]) is not None
    assert pointwise_graphs(keys[CumulativeMix]) is None  # cumsum, and a reduction in its backward
    assert pointwise_graphs(keys[SqrtBoundDerivative]).size_free == (0, 1)


class ReadsItsSize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x / x.shape[-1]

    @staticmethod
    def backward(ctx, grad):
        return grad * 3.0


def test_a_shard_computes_what_the_whole_tensor_computes():
    """The elementwise graphs bake the global size in: on a quarter of the columns they divide by 8."""
    x = torch.randn(4, 8)

    class Model(nn.Module):
        def forward(self, x):
            return ReadsItsSize.apply(x)

    traced = trace(Model(), {"x": x})
    (node,) = [n for n in traced.nodes if n.target is torch.ops.autopar.autograd_function.default]
    graphs = pointwise_graphs(node.args[0])
    assert graphs.size_free == (0,)  # it reads the size of dim 1: shards there run the graphs, not apply
    (local,) = graphs.forward(x[:, :2])
    torch.testing.assert_close(local, x[:, :2] / 8)
    (grad,) = graphs.backward(x[:, :2], torch.ones(4, 2))
    torch.testing.assert_close(grad, torch.full((4, 2), 3.0))


class Noisy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x + torch.randn_like(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class NoisyGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad + torch.rand_like(grad)


class InPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.mul_(2)

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad


class TakesAModule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, module):
        return module(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Applies(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn, self.proj = fn, nn.Linear(4, 4)

    def forward(self, x):
        h = self.proj(x)
        return (self.fn.apply(h, nn.Identity()) if self.fn is TakesAModule else self.fn.apply(h)).sum()


@pytest.mark.parametrize("fn,what", [(InPlace, r"InPlace writes its inputs in place"),
                                     (TakesAModule, r"TakesAModule: argument leaf 1 is a Identity")])
def test_what_cannot_be_one_op_is_refused_naming_the_class(fn, what):
    with pytest.raises(TraceError, match=what) as info:
        trace(Applies(fn), {"x": torch.randn(2, 4)})
    assert refused_function(info.value)  # a FunctionRefused (NotImplementedError) underneath
    assert "one op with its own backward" in str(info.value)


class MaskDropout(torch.autograd.Function):
    """Dropout drawing its keep-mask in forward and reusing the saved mask in backward (SEW-D's
    ``XDropout``): a recompute drawing another mask would give a gradient of another mask."""

    @staticmethod
    def forward(ctx, x, p):
        keep = torch.rand_like(x) >= p
        ctx.save_for_backward(keep)
        ctx.scale = 1 / (1 - p)
        return x * keep * ctx.scale

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return grad * keep * ctx.scale, None


class Drops(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 8))

    def forward(self, x):
        return MaskDropout.apply(self.w * x, 0.5).sum()


def test_functions_that_draw_are_noted_and_others_not():
    for fn, draws in ((Noisy, True), (NoisyGradient, True), (MaskDropout, True), (StraightThroughRound, False)):
        traced = trace(Drops() if fn is MaskDropout else Applies(fn), {"x": torch.randn(2 if fn is not MaskDropout
                                                                                        else 4, 8 if fn is
                                                                                        MaskDropout else 4)})
        (node,) = [n for n in traced.nodes if n.target is torch.ops.autopar.autograd_function.default]
        assert function_draws(node.args[0]) is draws, fn


def test_the_backward_recompute_draws_the_forwards_numbers():
    """Run by hand (no seed given): each call draws a fresh mask from torch's generator, and its
    backward's recompute redraws that mask; with ``function_seed`` the mask is the eager Function's
    under that seed, and torch's own stream is left as it was."""
    torch.manual_seed(0)
    model, x = Drops(), torch.randn(4, 8)
    traced = trace(model, {"x": x})
    masks = []
    for _ in range(2):
        (loss,) = traced.gm(*traced.bind(model, {"x": x}))
        keep = _grads(model, loss)["w"] / (2 * x)  # d/dw sum(w x keep 2) = 2 x keep
        assert set(keep.unique().tolist()) <= {0.0, 1.0}
        torch.testing.assert_close(loss, (model.w * x * keep * 2).sum().detach())  # the forward's mask
        masks.append(keep)
    assert not torch.equal(masks[0], masks[1])
    before = torch.get_rng_state()
    with function_seed(1234):
        (loss,) = traced.gm(*traced.bind(model, {"x": x}))
    got = _grads(model, loss)["w"]
    assert torch.equal(torch.get_rng_state(), before)
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        want = _grads(model, MaskDropout.apply(model.w * x, 0.5).sum())["w"]
    torch.testing.assert_close(got, want)


class Outputs(torch.autograd.Function):
    """Returns an input unchanged, a None and a constant: the op clones the alias, the rest is put back."""

    @staticmethod
    def forward(ctx, x, y):
        return x, None, 3, x * y

    @staticmethod
    def backward(ctx, g_x, _none, _three, g_prod):
        return g_x + g_prod, -g_prod


def test_aliases_nones_and_constants_in_the_outputs():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x):
            h = self.proj(x)
            same, none, three, prod = Outputs.apply(h, x)
            assert none is None and three == 3
            return (same * prod).sum() * three

    model, x = Model(), torch.randn(2, 4)
    traced = trace(model, {"x": x})
    (loss,) = traced.gm(*traced.bind(model, {"x": x}))
    got = _grads(model, loss)
    want = _grads(model, model(x))
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return x + StraightThroughRound.apply(self.proj(x))


class Stack(nn.Module):
    def __init__(self, depth):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).sum()


def test_repeated_blocks_share_one_key_and_expand():
    model, x = Stack(6), torch.randn(4, 8)
    traced = trace(model, {"x": x})
    keys = {n.args[0] for n in traced.nodes if n.target is torch.ops.autopar.autograd_function.default}
    assert len(keys) == 1 and traced.op_counts()["autopar.autograd_function.default"] == 6
    (loss,) = traced.gm(*traced.bind(model, {"x": x}))
    got = _grads(model, loss)
    want = _grads(model, model(x))
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)


class Project(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad @ w.t(), x.t() @ grad


def test_flops_of_the_forward_and_of_the_recomputing_backward():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(16, 32))

        def forward(self, x):
            return Project.apply(x, self.w).sum()

    traced = trace(Model(), {"x": torch.randn(8, 16)})
    (node,) = [p for p in profile(traced).nodes if p.op == "autopar.autograd_function.default"]
    mm = 2 * 8 * 16 * 32
    assert node.fwd_flops == mm
    assert node.bwd_flops == 3 * mm  # the recompute, and the two products of the backward


def test_bf16_precision_runs_the_function_in_bf16():
    model, x = Functions(), {"x": torch.randn(4, 8), "scale": torch.rand(4, 8)}
    traced = trace(model, x, precision="bf16")
    for node in traced.nodes:
        if node.target is torch.ops.autopar.autograd_function.default:
            assert {v.meta["val"].dtype for v in node.args[1]} == {torch.bfloat16}
    (loss,) = traced.gm(*traced.bind(model, x))
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_a_fresh_process_computes_the_same_keys():
    """Ranks trace for themselves: the key (class, source line, digest of constants, structure,
    shapes and dtypes) may not depend on the process (ids, hash seeds)."""
    import os
    import subprocess
    import sys

    def keys_here():
        traced = trace(Functions(), {"x": torch.zeros(4, 8), "scale": torch.zeros(4, 8)})
        return sorted(n.args[0] for n in traced.nodes if n.target is torch.ops.autopar.autograd_function.default)

    code = ("import torch; from tests.tracer.test_functions import Functions; from autopar.tracer import trace; "
            "t = trace(Functions(), {'x': torch.zeros(4, 8), 'scale': torch.zeros(4, 8)}); "
            "print(sorted(n.args[0] for n in t.nodes if n.target is torch.ops.autopar.autograd_function.default))")
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                         check=True).stdout.strip().splitlines()[-1]
    assert out == repr(keys_here())
