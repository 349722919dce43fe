"""Convolution, pooling and batch norm (channels at dim 1 of a batched input).

Convolution (``conv1d/2d/3d``; ``input`` (N, C_in, *spatial), ``weight`` (C_out, C_in/groups, *k)):

- batch split: ``input`` S0 -> output S0, weight and bias replicated (their gradients partial);
- output-channel split (``groups == 1``): ``weight`` S0, ``bias`` S0 -> output S1;
- input-channel split (``groups == 1``): ``input`` S1, ``weight`` S1 -> output ``P``, the bias
  ``P`` (it must be added once, not once per rank);
- pending sums: ``input`` P (weight R) or ``weight`` P (input R), bias P -> output P.
Spatial dims are never split (a window straddles shard edges: it would need halo exchange).
With ``groups > 1`` the channel splits would have to respect group boundaries, so only the
batch split and the pass-throughs are offered.

Pooling (``max_pool2d``, ``avg_pool2d``, ``adaptive_avg_pool2d``): every non-spatial dim (batch,
channels) is split; average pooling is linear, so ``P -> P``.

Batch norm (``batch_norm``; ``weight``, ``bias``, ``running_mean``, ``running_var`` per channel):

- channel split: exact with the plain op (statistics are per channel); the per-channel tensors
  are split alike, and each rank updates its slice of the running statistics in place;
- split of a non-channel dim (batch, spatial): with running statistics in eval mode the op is
  elementwise per channel, so the plain op is exact. When batch statistics are used (training,
  or no running statistics) the ``sync_batch_norm`` kernel computes the GLOBAL per-channel mean
  and variance (two all-reduces of per-channel sums: the mean, then the squared deviations --
  the two-pass form keeps float32 precision), normalises the local shard with them, updates the
  running statistics identically on every rank (unbiased variance over the global count), and in
  backward all-reduces the two per-channel sums that the input gradient needs. The weight and
  bias gradients are local partial sums, all-reduced through the derived ``grad_partial``.
"""

from __future__ import annotations

import math

import torch

from ..cost import collective_seconds
from ..spec import Partial, Replicate, Shard
from .comm import KernelContext
from .registry import AxisOption, OpInfo, Sample, register, register_kernel
from .samples import rand

aten = torch.ops.aten
R, P = Replicate(), Partial()


# ------------------------------------------------------------------------------ convolution
def _with_bias(info: OpInfo, placement, **inputs):
    if info.input("bias") is not None:
        inputs["bias"] = placement
    return inputs


def _conv_rule(info: OpInfo) -> list[AxisOption]:
    x, w = info.input("input"), info.input("weight")
    batched = x.ndim == w.ndim
    channel = 1 if batched else 0
    options = []
    if batched:
        options.append(info.option(Shard(0), input=Shard(0)))
    if info.arg("groups") == 1:
        options.append(info.option(Shard(channel), **_with_bias(info, Shard(0), weight=Shard(0))))
        options.append(info.option(P, **_with_bias(info, P, input=Shard(channel), weight=Shard(1))))
    options.append(info.option(P, work_split=False, **_with_bias(info, P, input=P)))
    options.append(info.option(P, work_split=False, **_with_bias(info, P, weight=P)))
    return options


def _conv2d_samples() -> list[Sample]:
    return [
        Sample((rand(4, 4, 6, 6), rand(8, 4, 3, 3), rand(8), [1, 1], [1, 1]), label="bias-pad"),
        Sample((rand(4, 8, 8, 8), rand(4, 8, 2, 2), None, [2, 2]), label="stride-no-bias"),
        Sample((rand(4, 8, 4, 4), rand(8, 2, 1, 1), None, [1, 1], [0, 0], [1, 1], 4), label="groups"),
        Sample((rand(4, 5, 5), rand(8, 4, 3, 3), rand(8)), label="unbatched"),
    ]


register(aten.conv2d.default, has_flops=True, samples=_conv2d_samples)(_conv_rule)
register(aten.conv1d.default, has_flops=True,
         samples=lambda: [Sample((rand(4, 4, 8), rand(8, 4, 3), rand(8), [1], [1]))])(_conv_rule)


# ---------------------------------------------------------------------------------- pooling
def _pool_rule(*, linear: bool, num_spatial: int = 2):
    def rule(info: OpInfo) -> list[AxisOption]:
        ndim = info.input("self").ndim
        options = [info.option(Shard(d), self=Shard(d)) for d in range(ndim - num_spatial)]
        if linear:
            options.append(info.option(P, work_split=False, self=P))
        return options

    rule.__name__ = "average_pool_rule" if linear else "max_pool_rule"
    rule.__module__ = __name__
    return rule


register(aten.max_pool2d.default, samples=lambda: [
    Sample((rand(4, 4, 8, 8), [3, 3], [2, 2], [1, 1]), label="resnet-stem"),
    Sample((rand(4, 8, 8), [2, 2]), label="unbatched"),
])(_pool_rule(linear=False))
register(aten.avg_pool2d.default, samples=lambda: [
    Sample((rand(4, 4, 8, 8), [3, 3], [2, 2], [1, 1]), label="pad"),
    Sample((rand(4, 4, 8, 8), [2, 2], [2, 2], [0, 0], True, False, 3), label="divisor"),
])(_pool_rule(linear=True))
register(aten.adaptive_avg_pool2d.default, samples=lambda: [
    Sample((rand(4, 8, 4, 4), [1, 1]), label="global"), Sample((rand(4, 4, 6, 6), [2, 3]), label="2x3"),
])(_pool_rule(linear=True))


# ------------------------------------------------------------------------------- batch norm
def _stat_axes(ctx: KernelContext) -> tuple[int, ...]:
    spec = ctx.spec("input")
    return tuple(sorted(a for d in spec.sharded_dims() if d != 1 for a in spec.shard_axes(d)))


def _per_channel(t: torch.Tensor, ndim: int) -> torch.Tensor:
    return t.view((1, -1) + (1,) * (ndim - 2))


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, comm, axes, count, eps):  # noqa: D401
        dims = [d for d in range(x.ndim) if d != 1]
        mean = comm.all_reduce(x.sum(dims), axes) / count
        centred = x - _per_channel(mean, x.ndim)
        var = comm.all_reduce((centred * centred).sum(dims), axes) / count
        rstd = torch.rsqrt(var + eps)
        xhat = centred * _per_channel(rstd, x.ndim)
        y = xhat
        if weight is not None:
            y = y * _per_channel(weight, x.ndim)
        if bias is not None:
            y = y + _per_channel(bias, x.ndim)
        ctx.save_for_backward(xhat, rstd, weight)
        ctx.comm, ctx.axes, ctx.count, ctx.has_bias = comm, axes, count, bias is not None
        return y, mean, var

    @staticmethod
    def backward(ctx, grad_y, _grad_mean, _grad_var):
        xhat, rstd, weight = ctx.saved_tensors
        dims = [d for d in range(xhat.ndim) if d != 1]
        grad_xhat = grad_y if weight is None else grad_y * _per_channel(weight, xhat.ndim)
        # The input gradient needs the GLOBAL per-channel means of grad_xhat and grad_xhat * xhat.
        sums = ctx.comm.all_reduce(torch.stack([grad_xhat.sum(dims), (grad_xhat * xhat).sum(dims)]), ctx.axes)
        mean_g, mean_gx = sums[0] / ctx.count, sums[1] / ctx.count
        grad_x = _per_channel(rstd, xhat.ndim) * (
            grad_xhat - _per_channel(mean_g, xhat.ndim) - xhat * _per_channel(mean_gx, xhat.ndim))
        # Local partial sums; the strategy all-reduces them (grad_partial of a replicated input).
        grad_w = (grad_y * xhat).sum(dims) if weight is not None else None
        grad_b = grad_y.sum(dims) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None, None, None, None


def _sync_bn_comm(info: OpInfo, input_specs, output_specs, mesh) -> tuple[float, float]:
    spec = input_specs[info.slot_index("input")]
    x = info.input("input")
    axes = tuple(sorted(a for d in spec.sharded_dims() if d != 1 for a in spec.shard_axes(d)))
    channel_bytes = spec.local_shape(x.shape, mesh.shape)[1] * x.itemsize
    fwd = 2 * collective_seconds("all_reduce", channel_bytes, mesh, axes)
    return fwd, collective_seconds("all_reduce", 2 * channel_bytes, mesh, axes)


@register_kernel("sync_batch_norm", comm_cost=_sync_bn_comm)
def sync_batch_norm(ctx: KernelContext, input, weight, bias, running_mean, running_var, training, momentum, eps,
                    cudnn_enabled):
    x_meta = ctx.info.input("input")
    count = math.prod(s for d, s in enumerate(x_meta.shape) if d != 1)
    y, mean, var = _SyncBatchNorm.apply(input, weight, bias, ctx.comm, _stat_axes(ctx), count, eps)
    if running_mean is not None and training:
        # Every rank holds the same global statistics, so replicas stay identical.
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(momentum * mean.to(running_mean.dtype))
            unbiased = var * count / max(count - 1, 1)
            running_var.mul_(1 - momentum).add_(momentum * unbiased.to(running_var.dtype))
    return y


def _batch_norm_rule(info: OpInfo) -> list[AxisOption]:
    x = info.input("input")
    per_channel = {n: Shard(0) for n in ("weight", "bias", "running_mean", "running_var") if info.input(n) is not None}
    options = [info.option(Shard(1), input=Shard(1), **per_channel)]
    batch_stats = bool(info.arg("training")) or info.input("running_mean") is None
    kernel = "sync_batch_norm" if batch_stats else None
    # Only the affine parameters have gradients; the running statistics are buffers.
    options += [info.option(Shard(d), input=Shard(d), kernel=kernel, grad_partial=["weight", "bias"])
                for d in range(x.ndim) if d != 1]
    return options


_NO_GRAD_STATS = ("running_mean", "running_var")


def _batch_norm_samples() -> list[Sample]:
    stats = lambda: (rand(8) * 0.1, rand(8, positive=True))  # noqa: E731
    return [
        Sample((rand(4, 8, 2, 2), rand(8), rand(8), *stats(), True, 0.1, 1e-5, False), label="train",
               no_grad=_NO_GRAD_STATS),
        Sample((rand(4, 8, 4), None, None, *stats(), False, 0.1, 1e-5, False), label="eval-no-affine",
               no_grad=_NO_GRAD_STATS),
        Sample((rand(8, 8), rand(8), rand(8), None, None, True, 0.1, 1e-5, False), label="no-running-stats"),
    ]


register(aten.batch_norm.default, samples=_batch_norm_samples)(_batch_norm_rule)
