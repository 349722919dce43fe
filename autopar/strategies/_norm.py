"""Normalisation: layer_norm, rms_norm, batch_norm, group_norm, instance_norm.

Layer norm / RMS norm (over trailing dims): only the leading (non-normalised) dims are split:
every rank normalises whole rows, the replicated weight and bias get partial gradients
(all-reduced in backward, derived centrally). Splitting a normalised dim would need
sum/sum-of-squares all-reduces inside the op, which no rule here implements.

Batch norm (``batch_norm``; ``input`` (N, C, *); ``weight``, ``bias``, ``running_mean``,
``running_var`` per channel):

- channel split: exact with the plain op (statistics are per channel); the per-channel tensors
  are split alike, and each rank updates its slice of the running statistics in place;
- split of a non-channel dim (batch, spatial): with running statistics in eval mode the op is
  elementwise per channel, so the plain op is exact. When batch statistics are used (training,
  or no running statistics) the ``sync_batch_norm`` kernel computes the GLOBAL per-channel mean
  and variance in ONE collective (torch's ``SyncBatchNorm`` does the same: each rank's shard
  count, mean and squared deviations -- Welford's, no cancellation of a sum of squares -- are
  gathered and combined by Chan's parallel formula), normalises the local shard with them,
  updates the running statistics identically on every rank (unbiased variance over the global
  count), and in backward all-reduces the two per-channel sums that the input gradient needs
  (the second collective; both are synchronous: the next op needs their result). The weight and
  bias gradients are local partial sums, all-reduced through the derived ``grad_partial``.

Group norm (``group_norm``; statistics per (sample, group of C/G channels)):

- batch split: ``input`` S0 -> S0, exact with the plain op (weight and bias gradients partial);
- channel split when every channel is its own group (``num_groups == C``): ``input`` S1,
  ``weight``/``bias`` S0 -> S1, the local op with ``num_groups / shards`` (``local_args``).
  Other group counts would need the split on group boundaries, which depends on the mesh axis
  size a single-axis rule does not see; spatial splits would need all-reduced statistics.

Instance norm (``instance_norm``; statistics per (sample, channel) when ``use_input_stats``):

- channel split: exact with the plain op, per-channel tensors split alike (each rank updates
  its slice of the running statistics);
- batch split: the normalisation is per sample, so the plain op is exact -- except for the
  running statistics: with ``use_input_stats`` and tracked statistics ATen updates them with
  the per-instance statistics averaged over the batch. The ``instance_norm_running_stats``
  kernel normalises locally and all-reduces the per-channel sums of the local instances' mean
  and unbiased variance over the batch axes, so every rank applies the global-batch update;
- spatial splits only in eval mode (``use_input_stats=False``: the op is elementwise per
  channel with the running statistics); in training they would need all-reduced statistics.
Only the affine weight and bias have gradients; the running statistics are buffers.
"""

from __future__ import annotations

import math

import torch

from autopar.layout.cost import collective_seconds
from autopar.layout.placement import Shard
from autopar.strategies.kernel_context import KernelContext
from autopar.strategies.registry import AxisOption, OpInfo, Sample, register, register_kernel
from autopar.strategies.samples import rand

aten = torch.ops.aten
_AFFINE = ["weight", "bias"]
_STATS = ("running_mean", "running_var")


# ------------------------------------------------------------------------ layer / rms norm
def _leading_dim_options(info: OpInfo) -> list[AxisOption]:
    x = info.input("input")
    num_normalized = len(info.arg("normalized_shape"))
    return [info.option(Shard(d), input=Shard(d)) for d in range(x.ndim - num_normalized)]


def _layer_norm_samples() -> list[Sample]:
    return [
        Sample((rand(4, 4, 8), [8], rand(8), rand(8), 1e-5), label="affine"),
        Sample((rand(4, 4, 8), [4, 8]), label="2-dims-no-affine"),
    ]


def _rms_norm_samples() -> list[Sample]:
    return [Sample((rand(4, 4, 8), [8], rand(8), 1e-6), label="affine"),
            Sample((rand(4, 8), [8]), label="no-weight")]


register(aten.layer_norm.default, samples=_layer_norm_samples)(_leading_dim_options)
register(aten.rms_norm.default, samples=_rms_norm_samples)(_leading_dim_options)


# ------------------------------------------------------------------------------- helpers
def _per_channel_splits(info: OpInfo, names=_AFFINE + list(_STATS)) -> dict[str, Shard]:
    return {n: Shard(0) for n in names if info.input(n) is not None}


def _batch_axes(spec) -> tuple[int, ...]:
    """Mesh axes that split a non-channel dim of ``input`` (the statistics' reduction axes)."""
    return tuple(sorted(a for d in spec.sharded_dims() if d != 1 for a in spec.shard_axes(d)))


def _channel_bytes(info: OpInfo, input_specs, mesh) -> tuple[tuple[int, ...], int]:
    spec = input_specs[info.slot_index("input")]
    x = info.input("input")
    return _batch_axes(spec), spec.local_shape(x.shape, mesh.shape)[1] * x.itemsize


# ------------------------------------------------------------------------------- batch norm
def _per_channel(t: torch.Tensor, ndim: int) -> torch.Tensor:
    return t.view((1, -1) + (1,) * (ndim - 2))


def _group_index(comm, axes: tuple[int, ...]) -> tuple[int, int]:
    """(this rank's index among the ranks of ``axes``, their number): mixed radix, axes in order."""
    index, size = 0, 1
    for a in axes:
        index, size = index * comm.size(a) + comm.coordinate(a), size * comm.size(a)
    return index, size


def _global_moments(x: torch.Tensor, dims: list[int], comm, axes: tuple[int, ...],
                    count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and biased variance of ``x`` over every rank of ``axes``, in ONE
    collective, in at least float32 (ATen's batch norm keeps its statistics so). Each rank writes
    its shard's (count, mean, M2) -- ``var_mean``, one pass -- into its own row of a zero table
    that a sum all-reduce fills: an all-gather (adding zeros is exact, so every rank holds the
    same rows) through ``Comm``'s one reduction. The rows combine by Chan's formula
    ``M2 = sum M2_i + sum n_i (mean_i - mean)^2``, as torch's ``SyncBatchNorm`` combines its
    gathered statistics: never the cancelling ``E[x^2] - E[x]^2``."""
    dtype = torch.promote_types(x.dtype, torch.float32)  # a half-precision count is inexact past 2048
    local_var, local_mean = torch.var_mean(x.to(dtype), dims, correction=0)
    n = x.numel() // max(x.shape[1], 1)
    index, size = _group_index(comm, axes)
    table = torch.zeros(size, 3, x.shape[1], dtype=dtype, device=x.device)
    table[index, 0] = n
    table[index, 1] = local_mean
    table[index, 2] = local_var * n
    table = comm.all_reduce(table, axes)
    counts, means = table[:, 0], table[:, 1]
    mean = (counts * means).sum(0) / count
    var = (table[:, 2].sum(0) + (counts * (means - mean) ** 2).sum(0)) / count
    return mean, var


class _SyncBatchNorm(torch.autograd.Function):
    """Batch norm with statistics over every rank of ``axes``: two collectives, each of a few
    per-channel numbers, and ATen's fused CPU/GPU kernels for the elementwise work (the eval-mode
    batch norm normalises with the given statistics; its training backward's weight and bias
    sums, taken with the global mean and rstd, are the local sums the input gradient needs) --
    a hand-written chain of small ops cost 5-9x the native op's time per call on CPU."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm, axes, count, eps):  # noqa: D401
        dims = [d for d in range(x.ndim) if d != 1]
        mean, var = _global_moments(x, dims, comm, axes, count)
        # ATen's rule for the statistics' dtype: the affine parameters' where there are any
        # (all float32 beside a half-precision input, or the input's dtype), else float32.
        affine = next((t.dtype for t in (weight, bias) if t is not None), mean.dtype)
        y = torch.nn.functional.batch_norm(x, mean.to(affine), var.to(affine), weight, bias, training=False,
                                           eps=eps)
        rstd = torch.rsqrt(var + eps)
        ctx.save_for_backward(x, mean, rstd, weight)
        ctx.comm, ctx.axes, ctx.count, ctx.eps, ctx.affine = comm, axes, count, eps, affine
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y, mean.to(x.dtype), var.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y, _grad_mean, _grad_var):
        x, mean, rstd, weight = ctx.saved_tensors
        # One fused pass: this rank's sum(dy * xhat) and sum(dy) (xhat with the GLOBAL statistics),
        # which are also the weight's and bias's local partial gradients.
        _, sum_dyx, sum_dy = torch.ops.aten.native_batch_norm_backward(
            grad_y, x, weight, None, None, mean.to(ctx.affine), rstd.to(ctx.affine), True, ctx.eps, [False, True, True])
        sums = ctx.comm.all_reduce(torch.stack([sum_dy, sum_dyx]).to(mean.dtype), ctx.axes) / ctx.count
        # dx = k (dy - mean(dy) - xhat mean(dy xhat)), k = w rstd, xhat = (x - mean) rstd; the
        # centred x taken as is (not x k' - mean k': no cancellation far from zero mean).
        k = rstd if weight is None else rstd * weight.to(rstd.dtype)
        grad_x = (x.to(mean.dtype) - _per_channel(mean, x.ndim)) * _per_channel(-k * rstd * sums[1], x.ndim)
        grad_x.addcmul_(grad_y, _per_channel(k, x.ndim)).sub_(_per_channel(k * sums[0], x.ndim))
        # Local partial sums; the strategy all-reduces them (grad_partial of a replicated input).
        grad_w = sum_dyx.to(weight.dtype) if weight is not None else None
        grad_b = sum_dy.to(ctx.bias_dtype) if ctx.bias_dtype is not None else None
        grad_x = grad_x.to(x.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None


def _sync_bn_comm(info: OpInfo, input_specs, output_specs, mesh) -> tuple[float, float]:
    # Forward: the (count, mean, M2) table of every rank of the batch axes (``_global_moments``);
    # backward: the two per-channel sums.
    # Both in at least float32 (``_global_moments``).
    axes, channel_bytes = _channel_bytes(info, input_specs, mesh)
    channel_bytes *= max(1, 4 // info.input("input").itemsize)
    ranks = math.prod(mesh.shape[a] for a in axes)
    fwd = collective_seconds("all_reduce", 3 * ranks * channel_bytes, mesh, axes)
    return fwd, collective_seconds("all_reduce", 2 * channel_bytes, mesh, axes)


@register_kernel("sync_batch_norm", comm_cost=_sync_bn_comm)
def sync_batch_norm(ctx: KernelContext, input, weight, bias, running_mean, running_var, training, momentum, eps,
                    cudnn_enabled):
    x_meta = ctx.info.input("input")
    count = math.prod(s for d, s in enumerate(x_meta.shape) if d != 1)
    y, mean, var = _SyncBatchNorm.apply(input, weight, bias, ctx.comm, _batch_axes(ctx.spec("input")), count, eps)
    if running_mean is not None and training:
        # Every rank holds the same global statistics, so replicas stay identical.
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(momentum * mean.to(running_mean.dtype))
            unbiased = var * count / max(count - 1, 1)
            running_var.mul_(1 - momentum).add_(momentum * unbiased.to(running_var.dtype))
    return y


def _batch_norm_rule(info: OpInfo) -> list[AxisOption]:
    x = info.input("input")
    options = [info.option(Shard(1), input=Shard(1), **_per_channel_splits(info))]
    batch_stats = bool(info.arg("training")) or info.input("running_mean") is None
    kernel = "sync_batch_norm" if batch_stats else None
    options += [info.option(Shard(d), input=Shard(d), kernel=kernel, grad_partial=_AFFINE)
                for d in range(x.ndim) if d != 1]
    return options


def _stats() -> tuple[torch.Tensor, torch.Tensor]:
    return rand(8) * 0.1, rand(8, positive=True)


def _batch_norm_samples() -> list[Sample]:
    return [
        Sample((rand(4, 8, 2, 2), rand(8), rand(8), *_stats(), True, 0.1, 1e-5, False), label="train",
               no_grad=_STATS),
        Sample((rand(4, 8, 4), None, None, *_stats(), False, 0.1, 1e-5, False), label="eval-no-affine",
               no_grad=_STATS),
        Sample((rand(8, 8), rand(8), rand(8), None, None, True, 0.1, 1e-5, False), label="no-running-stats"),
    ]


register(aten.batch_norm.default, samples=_batch_norm_samples)(_batch_norm_rule)


# ------------------------------------------------------------------------------- group norm
def _group_norm_rule(info: OpInfo) -> list[AxisOption]:
    x = info.input("input")
    options = [info.option(Shard(0), input=Shard(0))]
    if x.ndim > 1 and info.arg("num_groups") == x.shape[1]:
        options.append(info.option(Shard(1), input=Shard(1), **_per_channel_splits(info, _AFFINE)))
    return options


def _local_num_groups(info: OpInfo, bound, input_specs, output_specs, mesh_shape):
    spec = input_specs[info.slot_index("input")]
    if spec is not None:
        bound["num_groups"] = info.arg("num_groups") // spec.num_shards(1, mesh_shape)
    return bound


register(aten.group_norm.default, local_args=_local_num_groups, samples=lambda: [
    Sample((rand(4, 8, 3, 2), 2, rand(8), rand(8), 1e-5), label="2-groups-affine"),
    Sample((rand(4, 8, 3), 8, rand(8), rand(8), 1e-5), label="group-per-channel"),
    Sample((rand(4, 4), 4), label="2-d-no-affine"),
])(_group_norm_rule)


# ---------------------------------------------------------------------------- instance norm
def _instance_stats_comm(info: OpInfo, input_specs, output_specs, mesh) -> tuple[float, float]:
    axes, channel_bytes = _channel_bytes(info, input_specs, mesh)
    return collective_seconds("all_reduce", 2 * channel_bytes, mesh, axes), 0.0


@register_kernel("instance_norm_running_stats", comm_cost=_instance_stats_comm)
def instance_norm_running_stats(ctx: KernelContext, input, weight, bias, running_mean, running_var,
                                use_input_stats, momentum, eps, cudnn_enabled):
    # The output depends on the local instances only: the plain op without running statistics.
    y = aten.instance_norm.default(input, weight, bias, None, None, True, momentum, eps, cudnn_enabled)
    with torch.no_grad():
        x = input.detach()
        dims = tuple(range(2, x.ndim))
        # ATen's update: running = (1 - m) running + m * (batch mean of per-instance mean / unbiased var).
        local_sums = torch.stack([x.mean(dims), x.var(dims, correction=1)]).sum(1)
        stats = ctx.comm.all_reduce(local_sums, _batch_axes(ctx.spec("input"))) / ctx.info.input("input").shape[0]
        running_mean.mul_(1 - momentum).add_(momentum * stats[0].to(running_mean.dtype))
        if running_var is not None:
            running_var.mul_(1 - momentum).add_(momentum * stats[1].to(running_var.dtype))
    return y


def _instance_norm_rule(info: OpInfo) -> list[AxisOption]:
    x = info.input("input")
    options = [info.option(Shard(1), input=Shard(1), **_per_channel_splits(info))]
    if not info.arg("use_input_stats"):
        # Eval with running statistics: elementwise per channel, any non-channel dim splits.
        return options + [info.option(Shard(d), input=Shard(d), grad_partial=_AFFINE)
                          for d in range(x.ndim) if d != 1]
    kernel = "instance_norm_running_stats" if info.input("running_mean") is not None else None
    options.append(info.option(Shard(0), input=Shard(0), kernel=kernel, grad_partial=_AFFINE))
    return options


def _instance_norm_samples() -> list[Sample]:
    return [
        Sample((rand(4, 8, 3), None, None, None, None, True, 0.1, 1e-5, False), label="plain"),
        Sample((rand(4, 8, 2, 3), rand(8), rand(8), None, None, True, 0.1, 1e-5, False), label="affine"),
        Sample((rand(4, 8, 3, 2), rand(8), rand(8), *_stats(), True, 0.1, 1e-5, False), label="train-running-stats",
               no_grad=_STATS),
        Sample((rand(4, 8, 4), None, None, *_stats(), False, 0.1, 1e-5, False), label="eval-running-stats",
               no_grad=_STATS),
    ]


register(aten.instance_norm.default, samples=_instance_norm_samples)(_instance_norm_rule)
