"""Elementwise losses with a ``reduction`` (at::Reduction: 0 none, 1 mean, 2 sum), and the ops
that come with them in traced loss graphs (``broadcast_tensors``, ``log_sigmoid``).

Losses here: ``l1_loss``, ``mse_loss``, ``smooth_l1_loss``, ``huber_loss``,
``binary_cross_entropy`` (+ class ``weight``), ``binary_cross_entropy_with_logits`` (+ ``weight``,
``pos_weight``), ``kl_div``, ``poisson_nll_loss``. Each computes one loss value per element of the
broadcast shape ``B`` of its tensor inputs, then reduces. Single-axis options, for every dim ``d``
of ``B`` (a tensor that has ``d`` at full size is split on it; one that lacks it or broadcasts
it with size 1 is replicated and, if differentiable, gets a partial gradient):

- ``none``: the per-element loss is split on ``d`` like its inputs (``Shard(d)``);
- ``sum``:  each rank sums its elements: ``Partial`` output, the same op on local shards;
- ``mean``: ``Partial`` output via kernel ``loss_mean``: the local mean divided by the number of
  shards of the element space (the product of the output's ``Partial`` axes). Splits are even,
  so every rank holds ``numel(B) / shards`` elements and the summands add up to the global mean
  exactly (a plain local mean would make the sum ``shards`` times too big).

No ``Partial`` pass-through: none of these losses is linear in an input (``kl_div`` is affine in
``self`` -- ``target * (log target - self)`` -- so a pending sum would add the constant term once
per rank).

The helpers ``reduced_option`` and ``elementwise_loss_rule`` are shared with the margin and
per-row losses (``_loss_margin.py``): ``reduced_option`` turns "the inputs are split so that
the per-sample losses split on output dim ``d``" into the right option for the op's reduction.

``broadcast_tensors`` (the nn losses call it first): every output has the broadcast shape; split a
dim of it (inputs follow as above, every output ``Shard(d)``), or pass pending sums through (the
op is a view per input: ``P`` in -> ``P`` out for that input, the others replicated).
``log_sigmoid`` (used by ``MultiLabelSoftMarginLoss``; not tagged pointwise in ATen): split any dim.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from autopar.layout.placement import Partial, Placement, Replicate, Shard
from autopar.strategies.kernel_context import KernelContext
from autopar.strategies.registry import AxisOption, OpInfo, Sample, call_op, register, register_kernel
from autopar.strategies.samples import rand

aten = torch.ops.aten
R, P = Replicate(), Partial()
NONE, MEAN, SUM = 0, 1, 2  # at::Reduction

__all__ = ["NONE", "MEAN", "SUM", "reduced_option", "elementwise_loss_rule", "broadcast_split"]


# ------------------------------------------------------------------------------- helpers
def reduced_option(info: OpInfo, out_dim: int, *, no_grad: Sequence[str] = (),
                   **inputs: Placement) -> AxisOption:
    """An option whose inputs split the per-sample losses along output dim ``out_dim``.

    ``none`` -> output ``Shard(out_dim)``; ``sum`` -> ``Partial`` (plain op); ``mean`` ->
    ``Partial`` via ``loss_mean``. ``no_grad`` names inputs the op is not differentiable in
    (a class weight, a ``pos_weight``): they take no partial gradient.
    """
    # Replicated float inputs read by a split computation get a partial gradient (Megatron's f).
    grad_partial = [s.arg for s in info.slots
                    if s.meta is not None and s.meta.is_float and s.arg not in no_grad
                    and isinstance(inputs.get(s.arg, R), Replicate)]
    reduction = info.arg("reduction")
    if reduction == NONE:
        return info.option(Shard(out_dim), grad_partial=grad_partial, **inputs)
    kernel = "loss_mean" if reduction == MEAN else None
    return info.option(P, kernel=kernel, grad_partial=grad_partial, **inputs)


def broadcast_split(info: OpInfo, names: Sequence[str], shape: Sequence[int], d: int) -> dict[str, Placement]:
    """Placements of the tensors ``names`` when broadcast dim ``d`` of ``shape`` is split: the
    tensors that have it at full size are split, the others (missing or size 1) replicated."""
    out = {}
    for name in names:
        meta = info.input(name)
        if meta is None:
            continue
        j = d - (len(shape) - meta.ndim)
        out[name] = Shard(j) if j >= 0 and meta.shape[j] == shape[d] else R
    return out


def _tensor_names(info: OpInfo) -> list[str]:
    return [s.arg for s in info.slots if s.meta is not None]


def elementwise_loss_rule(no_grad: Sequence[str] = ()) -> Callable[[OpInfo], list[AxisOption]]:
    """The rule of a loss computed per element of its inputs' broadcast shape, then reduced."""

    def rule(info: OpInfo) -> list[AxisOption]:
        names = _tensor_names(info)
        shape = torch.broadcast_shapes(*(info.input(n).shape for n in names))
        return [reduced_option(info, d, no_grad=no_grad, **broadcast_split(info, names, shape, d))
                for d in range(len(shape)) if shape[d] > 1]

    rule.__name__ = "elementwise_loss"
    rule.__module__ = __name__
    return rule


def _no_comm(info, input_specs, output_specs, mesh) -> tuple[float, float]:
    return 0.0, 0.0


@register_kernel("loss_mean", comm_cost=_no_comm)
def loss_mean(ctx: KernelContext, **args):
    """The local mean as a summand of the global mean (no communication).

    The output is ``Partial`` exactly over the axes that split the elements being averaged; each
    such axis divides their number evenly, so ``local mean / shards = local sum / global count``.
    """
    shards = 1
    for axis in ctx.output_specs[0].partial_axes():
        shards *= ctx.mesh_shape[axis]
    return call_op(ctx.info.target, args) / shards


# ------------------------------------------------------------------------- broadcast_tensors
def _broadcast_tensors_samples() -> list[Sample]:
    return [
        Sample(([rand(4, 8), rand(4, 8)],), label="same"),
        Sample(([rand(4, 1, 8), rand(4, 8), rand(1)],), label="broadcast"),
    ]


@register(aten.broadcast_tensors.default, samples=_broadcast_tensors_samples)
def _broadcast_tensors(info: OpInfo) -> list[AxisOption]:
    metas = [s.meta for s in info.slots]
    shape = torch.broadcast_shapes(*(m.shape for m in metas))
    options = []
    for d in range(len(shape)):
        ins = []
        for m in metas:
            j = d - (len(shape) - m.ndim)
            ins.append(Shard(j) if j >= 0 and m.shape[j] == shape[d] else R)
        options.append(info.option([Shard(d)] * len(metas), tensors=ins))
    # Each output is a view of its own input: a pending sum stays pending, the others untouched.
    for k in range(len(metas)):
        ins = [P if i == k else R for i in range(len(metas))]
        options.append(info.option(ins, tensors=ins, work_split=False, grad_partial=()))
    if len(metas) > 1:
        options.append(info.option([P] * len(metas), tensors=[P] * len(metas), work_split=False))
    return options


@register(aten.log_sigmoid.default, samples=lambda: [Sample((rand(4, 8),), label="2d")])
def _log_sigmoid(info: OpInfo) -> list[AxisOption]:
    return [info.option(Shard(d), self=Shard(d)) for d in range(info.input("self").ndim)]


# ------------------------------------------------------------------------------- samples
def _prob(*shape: int) -> torch.Tensor:
    return torch.sigmoid(rand(*shape))  # strictly inside (0, 1)


def _pair_samples(make_self: Callable[..., torch.Tensor] = rand, make_target: Callable[..., torch.Tensor] = rand,
                  **extra) -> Callable[[], list[Sample]]:
    """(self, target) of shape (8, 4) under each reduction, plus a 3-d ``mean``.

    No broadcast ``target`` here: ATen's own backward of ``mse_loss``/``smooth_l1_loss``/
    ``huber_loss`` gets the gradient of a broadcast target wrong under ``mean`` (torch 2.13), and
    the nn modules call ``broadcast_tensors`` first anyway. The weights of the BCE losses cover
    broadcasting inputs."""

    def samples() -> list[Sample]:
        out = [Sample((make_self(8, 4), make_target(8, 4)), dict(extra, reduction=r), f"2d-{name}")
               for r, name in ((NONE, "none"), (MEAN, "mean"), (SUM, "sum"))]
        out.append(Sample((make_self(4, 8, 4), make_target(4, 8, 4)), dict(extra, reduction=MEAN), "3d-mean"))
        return out

    return samples


def _bce_samples() -> list[Sample]:
    return [
        Sample((_prob(8, 4), _prob(8, 4)), {"reduction": MEAN}, "mean"),
        Sample((_prob(8, 4), _prob(8, 4), rand(8, 4, positive=True), SUM), label="sum-weight", no_grad=("weight",)),
        Sample((_prob(4, 8), _prob(4, 8), rand(8, positive=True), MEAN), label="mean-bcast-weight",
               no_grad=("weight",)),
        Sample((_prob(4, 8), _prob(4, 8), rand(1, 8, positive=True), NONE), label="none-bcast-weight",
               no_grad=("weight",)),
    ]


def _bce_logits_samples() -> list[Sample]:
    return [
        Sample((rand(8, 4), _prob(8, 4)), {"reduction": MEAN}, "mean"),
        Sample((rand(4, 8), _prob(4, 8), rand(8, positive=True), rand(8, positive=True), MEAN),
               label="mean-weight-pos_weight", no_grad=("weight", "pos_weight")),
        Sample((rand(4, 8), _prob(4, 8), None, rand(8, positive=True), SUM), label="sum-pos_weight",
               no_grad=("pos_weight",)),
        Sample((rand(4, 8), _prob(4, 8), rand(4, 1, positive=True), None, NONE), label="none-row-weight",
               no_grad=("weight",)),
    ]


def _kl_samples() -> list[Sample]:
    log_p = lambda *s: torch.log_softmax(rand(*s), -1)  # noqa: E731
    return (_pair_samples(log_p, _prob)()
            + [Sample((log_p(8, 4), log_p(8, 4)), {"reduction": MEAN, "log_target": True}, "log_target-mean")])


def _poisson_samples() -> list[Sample]:
    counts = lambda *s: rand(*s, positive=True) * 2  # noqa: E731  (some > 1: Stirling term)
    return [
        Sample((rand(8, 4), counts(8, 4), True, False, 1e-8, MEAN), label="log_input-mean"),
        Sample((rand(8, 4, positive=True), counts(8, 4), False, True, 1e-8, SUM), label="full-sum"),
        Sample((rand(4, 8), counts(4, 8), True, True, 1e-8, NONE), label="full-none"),
    ]


# ---------------------------------------------------------------------------------- table
# op -> (samples, non-differentiable inputs); registered in one loop through one rule.
_TABLE: dict = {
    aten.l1_loss.default: (_pair_samples(), ()),
    aten.mse_loss.default: (_pair_samples(), ()),
    aten.smooth_l1_loss.default: (_pair_samples(beta=0.5), ()),
    aten.huber_loss.default: (_pair_samples(delta=0.7), ()),
    aten.binary_cross_entropy.default: (_bce_samples, ("weight",)),
    aten.binary_cross_entropy_with_logits.default: (_bce_logits_samples, ("weight", "pos_weight")),
    aten.kl_div.default: (_kl_samples, ()),
    aten.poisson_nll_loss.default: (_poisson_samples, ()),
}

for _op, (_samples, _no_grad) in _TABLE.items():
    register(_op, samples=_samples)(elementwise_loss_rule(_no_grad))
