"""Losses over a class dim: cross-entropy (class-index or probability targets) and NLL.

Cross-entropy, ``self`` (N, C, d1..dk) or (N, C), ``target`` (N, d1..dk) of class ids; the "sample" dims are
``self``'s dims other than the class dim 1. Single-axis options:

- split a sample dim (``target`` follows):
  - ``reduction="none"``: same op on local shards, per-sample output split likewise;
  - ``reduction="sum"``: same op on local shards, ``Partial`` output (a sum of local sums);
  - ``reduction="mean"``: ``Partial`` output via kernel ``cross_entropy``: the local SUM divided
    by the GLOBAL denominator (number of targets != ``ignore_index``, or the sum of their class
    weights), which is all-reduced over the split axes -- a mean of local means would be wrong
    as soon as ranks hold different numbers of ignored targets;
- split the class dim (no class ``weight``): kernel ``cross_entropy``: the log-sum-exp from
  max/sum all-reduces, the target logit picked by the rank that owns it and all-reduced, the
  label-smoothing term from an all-reduced logit sum; the output is replicated over the class
  axes (with ``Partial``/split over any sample axes, as above).

Probability (float) targets (``target`` shaped like ``self``): split a sample dim of both; the
loss is per sample and ``mean`` divides by the number of samples whatever the class weights, so
the generic ``reduced_option`` applies (``none`` split, ``sum`` ``Partial``, ``mean`` ``Partial``
via ``loss_mean``). Their class dim is not split.

Negative log-likelihood (``nll_loss_nd``, ``nll_loss``, ``nll_loss2d``): ``self`` holds
log-probabilities (N, C, d1..dk), (N, C) or (C,); the loss of a sample is ``-weight[t] * self[t]``
(0 for ``ignore_index``). Single-axis options:

- split a sample dim: as for cross-entropy (``none`` split, ``sum`` ``Partial``, ``mean``
  ``Partial`` via kernel ``nll_loss``: local sum / all-reduced global denominator);
- split the class dim: kernel ``nll_loss``: each rank picks the target entries it owns (the others
  contribute 0), so the per-sample loss is a sum over class shards: ``Partial`` output under
  every reduction (``mean`` divides by the global denominator, which needs the class weight of
  every target: the class ``weight`` stays replicated). No communication over the class axes;
- pass a pending sum through (``P`` -> ``P``): the loss is linear in ``self`` and the ``mean``
  denominator depends only on ``target`` and ``weight``.
"""

from __future__ import annotations

import math

import torch

from autopar.layout.cost import collective_seconds
from autopar.layout.placement import Partial, Replicate, Shard
from autopar.strategies.kernel_context import KernelContext
from autopar.strategies._loss_elementwise import reduced_option
from autopar.strategies.registry import AxisOption, EarlySum, OpInfo, Sample, register, register_kernel
from autopar.strategies.samples import ints, rand

aten = torch.ops.aten
R, P = Replicate(), Partial()
_NONE, _MEAN, _SUM = 0, 1, 2  # at::Reduction


def _ce_comm(info: OpInfo, input_specs, output_specs, mesh) -> tuple[float, float]:
    x, spec = info.input("self"), input_specs[0]
    class_axes = spec.shard_axes(1)
    sample_axes = tuple(a for a, p in enumerate(spec.placements) if isinstance(p, Shard) and p.dim != 1)
    local = spec.local_shape(x.shape, mesh.shape)
    per_sample = math.prod(local) // local[1] * x.itemsize
    fwd = 0.0
    if class_axes:
        num = 4 if info.arg("label_smoothing") else 3  # max, sum-exp, target logit (+ logit sum)
        fwd += num * collective_seconds("all_reduce", per_sample, mesh, class_axes)
    if sample_axes and info.arg("reduction") == _MEAN:
        # The denominator: the same one scalar all-reduce, which the runtime issues at the start of
        # forward (``EarlySum``); still priced as waited on, the cost model having no forward stream,
        # but not as a blocking one: issued before forward's ops, it is done when they read it.
        fwd += collective_seconds("all_reduce", x.itemsize, mesh, sample_axes, blocking=False)
    return fwd, 0.0  # the all-reduces' backward is the identity


def _mean_axes(ctx: KernelContext, args: dict) -> tuple[int, ...]:
    """``EarlySum.axes`` of a loss kernel: a ``mean`` sums its denominator over the sample axes."""
    if args.get("reduction", _MEAN) != _MEAN:
        return ()
    return _sample_axes(ctx.spec("self"), _class_dim(ctx.info.input("self").ndim))


def _denominator_summand(ctx: KernelContext, target, weight=None, ignore_index=-100):
    """This rank's part of the ``mean`` denominator (``EarlySum.summand``)."""
    return _denominator(target, target != ignore_index, weight, ctx.info.input("self").dtype)


def _global_denominator(ctx: KernelContext, early, target, weight, ignore_index, axes):
    """The ``mean`` denominator over all ranks: the runtime's early sum (issued when the target
    existed, :class:`EarlySum`), else this rank's summand all-reduced here."""
    if early is not None:
        return early
    return ctx.comm.all_reduce(_denominator_summand(ctx, target, weight, ignore_index), axes)


# The denominator reads only the target and the class weight: the runtime sums it early.
_EARLY_DENOMINATOR = EarlySum(reads=("target", "weight", "ignore_index"), axes=_mean_axes,
                              summand=_denominator_summand)


@register_kernel("cross_entropy", comm_cost=_ce_comm, early=_EARLY_DENOMINATOR)
def cross_entropy(ctx: KernelContext, self, target, weight=None, reduction=_MEAN, ignore_index=-100,
                  label_smoothing=0.0, early=None):
    spec = ctx.spec("self")
    class_axes = spec.shard_axes(1)
    sample_axes = tuple(a for a, p in enumerate(spec.placements) if isinstance(p, Shard) and p.dim != 1)
    valid = target != ignore_index
    if class_axes:
        loss = _class_parallel_loss(ctx, self, target, valid, class_axes, ignore_index, label_smoothing)
        if reduction == _NONE:
            return loss
        total = loss.sum()
    else:
        total = aten.cross_entropy_loss.default(self, target, weight, _SUM, ignore_index, label_smoothing)
        if reduction != _MEAN:
            return total
    if reduction == _SUM:
        return total
    return total / _global_denominator(ctx, early, target, weight, ignore_index, sample_axes)


def _denominator(target, valid, weight, dtype):
    """The ``mean`` denominator of this rank's targets: their number, or their class weights' sum."""
    if weight is None:
        return valid.sum().to(dtype)
    return (weight[target.masked_fill(~valid, 0)] * valid).sum().detach()


def _class_parallel_loss(ctx: KernelContext, x, target, valid, class_axes, ignore_index, label_smoothing):
    comm = ctx.comm
    lo, hi = ctx.local_range("self", 1)
    num_classes = ctx.info.input("self").shape[1]
    # Max for stability only: constant for autograd, the softmax gradient is exact without it.
    m = comm.all_reduce(x.detach().amax(1, keepdim=True), class_axes, "max")
    sum_exp = comm.all_reduce((x - m).exp().sum(1, keepdim=True), class_axes)
    lse = (m + sum_exp.log()).squeeze(1)
    mine = valid & (target >= lo) & (target < hi)
    local_t = (target - lo).masked_fill(~mine, 0)
    picked = x.gather(1, local_t.unsqueeze(1)).squeeze(1) * mine
    loss = lse - comm.all_reduce(picked, class_axes)
    if label_smoothing:
        logit_sum = comm.all_reduce(x.sum(1), class_axes)
        loss = (1 - label_smoothing) * loss + label_smoothing * (lse - logit_sum / num_classes)
    return torch.where(valid, loss, torch.zeros_like(loss))


def _ce_samples() -> list[Sample]:
    t = ints(16, 8)
    t[1] = -100
    t[6] = -100  # ignored targets on different ranks: the denominators differ per rank
    t3 = ints(16, 4, 4)
    t3[0, 1] = 5
    t3[0, 2] = 5
    return [
        Sample((rand(8, 16), t), label="mean-ignore"),
        Sample((rand(8, 16), t, None, _SUM), label="sum"),
        Sample((rand(8, 16), t, None, _NONE), label="none"),
        Sample((rand(8, 16), t, None, _MEAN, -100, 0.1), label="mean-smoothing"),
        Sample((rand(8, 16), t, rand(16, positive=True), _MEAN, -100, 0.1), label="mean-weight",
               no_grad=("weight",)),
        Sample((rand(4, 16, 4), t3, None, _MEAN, 5), label="kdim-ignore5"),
        Sample((rand(8, 16), torch.softmax(rand(8, 16), 1)), label="probs-mean"),
        Sample((rand(4, 6, 8), torch.softmax(rand(4, 6, 8), 1), rand(6, positive=True), _MEAN, -100, 0.2),
               label="probs-kdim-weight-smoothing", no_grad=("weight",)),
        Sample((rand(8, 16), torch.softmax(rand(8, 16), 1), None, _SUM), label="probs-sum"),
        Sample((rand(8, 16), torch.softmax(rand(8, 16), 1), None, _NONE), label="probs-none"),
    ]


@register(aten.cross_entropy_loss.default, samples=_ce_samples)
def _cross_entropy(info: OpInfo) -> list[AxisOption]:
    x, target = info.input("self"), info.input("target")
    if x.ndim < 2:
        return []
    if target.is_float:  # probabilities: per-sample losses averaged over the sample count
        return [reduced_option(info, d if d == 0 else d - 1, no_grad=("weight",), self=Shard(d), target=Shard(d))
                for d in [0, *range(2, x.ndim)]]
    reduction = info.arg("reduction")
    options = []
    for d in [0, *range(2, x.ndim)]:
        t_dim = d if d == 0 else d - 1
        if reduction == _NONE:
            options.append(info.option(Shard(t_dim), self=Shard(d), target=Shard(t_dim), grad_partial=()))
        else:
            kernel = "cross_entropy" if reduction == _MEAN else None
            options.append(info.option(P, self=Shard(d), target=Shard(t_dim), kernel=kernel, grad_partial=()))
    # The class weight takes no gradient (nll_loss is not differentiable in it): grad_partial=().
    if info.input("weight") is None:
        options.append(info.option(R, self=Shard(1), kernel="cross_entropy"))
    return options


# ------------------------------------------------------------------------------------- NLL
def _class_dim(ndim: int) -> int:
    return 1 if ndim >= 2 else 0  # (C,) has no sample dim


def _sample_axes(spec, class_dim: int) -> tuple[int, ...]:
    return tuple(a for a, p in enumerate(spec.placements) if isinstance(p, Shard) and p.dim != class_dim)


def _nll_comm(info: OpInfo, input_specs, output_specs, mesh) -> tuple[float, float]:
    x = info.input("self")
    axes = _sample_axes(input_specs[0], _class_dim(x.ndim))
    if axes and info.arg("reduction") == _MEAN:
        return collective_seconds("all_reduce", x.itemsize, mesh, axes, blocking=False), 0.0  # the early denominator
    return 0.0, 0.0


@register_kernel("nll_loss", comm_cost=_nll_comm, early=_EARLY_DENOMINATOR)
def nll_loss(ctx: KernelContext, self, target, weight=None, reduction=_MEAN, ignore_index=-100, early=None):
    cd = _class_dim(self.ndim)
    spec = ctx.spec("self")
    valid = target != ignore_index
    if spec.shard_axes(cd):
        lo, hi = ctx.local_range("self", cd)
        mine = valid & (target >= lo) & (target < hi)
        picked = self.gather(cd, (target - lo).masked_fill(~mine, 0).unsqueeze(cd)).squeeze(cd) * mine
        if weight is not None:
            picked = picked * weight[target.masked_fill(~valid, 0)]
        if reduction == _NONE:
            return -picked
        total = -picked.sum()
    else:
        total = ctx.info.target(self, target, weight, _SUM, ignore_index)
    if reduction == _SUM:
        return total
    return total / _global_denominator(ctx, early, target, weight, ignore_index, _sample_axes(spec, cd))


def _nll_samples(kind: str):
    def samples() -> list[Sample]:
        x = torch.log_softmax(rand(8, 16), 1)
        t = ints(16, 8)
        t[2] = -100  # ignored targets on some ranks only: per-rank denominators differ
        w = rand(16, positive=True)
        x4 = torch.log_softmax(rand(4, 8, 4, 4), 1)
        t4 = ints(8, 4, 4, 4)
        t4[1, 0] = 3
        out = []
        if kind != "2d":
            out += [
                Sample((x, t), label="mean-ignore"),
                Sample((x, t, w, _MEAN), label="mean-weight", no_grad=("weight",)),
                Sample((x, t, w, _SUM), label="sum-weight", no_grad=("weight",)),
                Sample((x, t, None, _NONE), label="none"),
            ]
        if kind != "1d":
            out += [
                Sample((x4, t4, w[:8], _MEAN, 3), label="4d-mean-weight-ignore3", no_grad=("weight",)),
                Sample((x4, t4, None, _NONE, 3), label="4d-none"),
            ]
        if kind == "nd":
            out += [
                Sample((torch.log_softmax(rand(16), 0), torch.tensor(5)), label="unbatched-mean"),
                Sample((torch.log_softmax(rand(4, 8, 8), 1), ints(8, 4, 8), None, _SUM), label="3d-sum"),
            ]
        return out

    return samples


def _nll_rule(info: OpInfo) -> list[AxisOption]:
    x = info.input("self")
    cd = _class_dim(x.ndim)
    reduction = info.arg("reduction")
    # The class weight takes no gradient (nll_loss is not differentiable in it): grad_partial=().
    options = []
    for d in (range(x.ndim) if x.ndim >= 2 else ()):
        if d == cd:
            continue
        t_dim = d if d == 0 else d - 1
        if reduction == _NONE:
            options.append(info.option(Shard(t_dim), self=Shard(d), target=Shard(t_dim), grad_partial=()))
        else:
            kernel = "nll_loss" if reduction == _MEAN else None
            options.append(info.option(P, self=Shard(d), target=Shard(t_dim), kernel=kernel, grad_partial=()))
    options.append(info.option(P, self=Shard(cd), kernel="nll_loss", grad_partial=()))
    options.append(info.option(P, self=P, work_split=False, grad_partial=()))
    return options


register(aten.nll_loss_nd.default, samples=_nll_samples("nd"))(_nll_rule)
register(aten.nll_loss.default, samples=_nll_samples("1d"))(_nll_rule)
register(aten.nll_loss2d.default, samples=_nll_samples("2d"))(_nll_rule)
