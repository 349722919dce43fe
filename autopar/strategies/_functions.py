"""A user's custom autograd.Function (``autopar::autograd_function``, ``autopar.tracer.functions``).

``autograd_function(key, tensors: Tensor[]) -> Tensor[]`` runs the Function's forward and trains
with its own backward. Options along one mesh axis besides replication (always correct: every
rank runs the whole Function):

- **elementwise, sharded alike**: when the call is *structurally* elementwise -- its forward and
  its backward, traced on fake tensors, are pointwise ops only and every tensor has the output's
  shape or is 0-d (``autopar.tracer.function_graphs``) -- every non-scalar input and every output
  ``Shard(d)``, the 0-d inputs replicated. Along a dim whose size the Function does not read
  (``PointwiseGraphs.size_free``) the plain op -- ``apply`` on the shards -- runs (and a pipeline
  may split the batch there); along another, the kernel runs the traced graphs on the shards, so
  a size the Function reads from its input is the global one, as on one device.

Never ``Partial``: a Function's output is not known to be linear in anything.

A Function that draws random numbers (``tracer.functions.function_draws``: SEW-D's ``XDropout``)
is replicated only, and EVERY strategy (``register(kernel_for=...)``, a size-1 mesh too) runs the
``autograd_function_seeded`` kernel: the op on a torch generator seeded with the key of autopar's
current draw and the node (``strategies/rng.py``: the seed, the module call's step, the node's
name), the same on every rank, so each replica draws what mesh ``(1,)`` draws, a recomputed
region (``runtime.recompute.redrawing``) draws it again, and the op's backward reseeds it for its
recompute. Not sharded: torch's generator draws by position in the tensor it fills, so a shard
would draw the whole tensor's first numbers, not its own.
"""

from __future__ import annotations

import torch

from autopar.layout.placement import Replicate, Shard
from autopar.strategies import rng
from autopar.strategies.kernel_context import KernelContext
from autopar.strategies.registry import AxisOption, OpInfo, Sample, register, register_kernel
from autopar.tracer.function_graphs import PointwiseGraphs, pointwise_graphs
from autopar.tracer.functions import (autograd_function, function_call, function_draws, function_seed,
                                      register_call, unaliased)

__all__ = ["function_rule", "function_samples", "function_kernel"]

R = Replicate()
KERNEL = "autograd_function_pointwise"
SEEDED = "autograd_function_seeded"


def function_rule(info: OpInfo) -> list[AxisOption]:
    metas = [slot.meta for slot in info.slots]
    if any(m is None for m in metas) or any(o is None for o in info.outputs) or function_draws(info.arg("key")):
        return []  # a Function that draws: replicated (module docstring)
    graphs = pointwise_graphs(info.arg("key"), tuple(m.dtype for m in metas))
    if graphs is None or any(o.shape != graphs.shape for o in info.outputs):
        return []
    return [info.option([Shard(d)] * len(info.outputs), kernel=None if d in graphs.size_free else KERNEL,
                        tensors=[Shard(d) if m.ndim else R for m in metas])
            for d in range(len(graphs.shape))]


class _Pointwise(torch.autograd.Function):
    """The traced forward and backward graphs of an elementwise Function, on local shards."""

    @staticmethod
    def forward(ctx, graphs: PointwiseGraphs, *xs):
        ctx.graphs = graphs
        ctx.save_for_backward(*xs)
        return tuple(unaliased(list(graphs.forward(*xs)), list(xs)))

    @staticmethod
    def backward(ctx, *grads):
        graphs, xs = ctx.graphs, ctx.saved_tensors
        got = graphs.backward(*xs, *(grads[i] for i in graphs.grad_outputs))
        out: list = [None] * len(xs)
        for i, g in zip(graphs.grad_inputs, got, strict=True):
            out[i] = g
        return (None, *out)


@register_kernel(KERNEL, comm_cost=lambda *_: (0.0, 0.0))
def autograd_function_pointwise(ctx: KernelContext, key: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    graphs = pointwise_graphs(key, tuple(t.dtype for t in tensors))
    if graphs is None:  # planned at other dtypes than it runs at: the decision does not carry over
        raise NotImplementedError(f"autograd.Function {function_call(key).name} ({ctx.info.where()}) was planned "
                                  f"sharded as elementwise, but at dtypes {[t.dtype for t in tensors]} it is not")
    return list(_Pointwise.apply(graphs, *tensors))


def function_kernel(info: OpInfo) -> str | None:
    """``kernel_for``: the seeded kernel for a Function that draws, else the strategy's own."""
    return SEEDED if function_draws(info.arg("key")) else None


@register_kernel(SEEDED, comm_cost=lambda *_: (0.0, 0.0))
def autograd_function_seeded(ctx: KernelContext, key: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The op on whole tensors, its draws seeded by autopar's draw and this node (module docstring)."""
    with function_seed(rng.current().key(ctx.info.node_name)):
        return autograd_function(key, tensors)


# ---- samples: registered test Functions ---------------------------------------------------------
class _SampleClip(torch.autograd.Function):
    """Elementwise, two outputs, a 0-d scale: ``(x * s + y.round(), sqrt(|x| + 1) * y)`` with a
    straight-through gradient for the rounding and a clipped one for the square root."""

    @staticmethod
    def forward(ctx, x, y, s):
        ctx.save_for_backward(x, y, s)
        return x * s + torch.round(y), torch.sqrt(x.abs() + 1) * y

    @staticmethod
    def backward(ctx, g_first, g_second):
        x, y, s = ctx.saved_tensors
        root = torch.sqrt(x.abs() + 1)
        g_x = g_first * s + g_second * y * torch.sign(x) / (2 * root.clamp(min=1.5))
        return g_x, g_first + g_second * root, None


class _SampleReverse(torch.autograd.Function):
    """Gradient reversal (identity forward, negated gradient)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.scale * grad, None


class _SampleMeanScale(torch.autograd.Function):
    """Reads its last dim's size (``x / n``): split there, the kernel's traced graphs run."""

    @staticmethod
    def forward(ctx, x):
        return x * 2 / x.shape[-1]

    @staticmethod
    def backward(ctx, grad):
        return grad / 3


def function_samples() -> list[Sample]:
    from autopar.strategies.samples import rand

    torch.manual_seed(0)
    x, y, s = rand(8, 4), rand(8, 4) * 3, rand()
    clip, clip_tensors = register_call(_SampleClip, (x, y, s), {})
    reverse, reverse_tensors = register_call(_SampleReverse, (x, 0.5), {})
    mean, mean_tensors = register_call(_SampleMeanScale, (x,), {})
    return [Sample((clip.key, clip_tensors), label="two outputs, a 0-d scale"),
            Sample((reverse.key, reverse_tensors), label="gradient reversal"),
            Sample((mean.key, mean_tensors), label="reads its size")]


register(torch.ops.autopar.autograd_function.default, samples=function_samples, has_flops=True,
         kernel_for=function_kernel)(function_rule)
