"""Row distances: ``cosine_similarity`` and ``pairwise_distance``; all-pairs ``_cdist_forward`` (below).

Both broadcast ``x1`` and ``x2`` to a shape ``B`` and reduce one dim ``k`` of it (``dim`` for the
cosine, the last dim for the distance) to one value per row. Single-axis options:

- split a dim ``d != k`` of ``B`` (a row dim): inputs that have it at full size are split, those
  that broadcast it are replicated (partial gradient); the output is split on the dim ``d``
  becomes (the same, or one less after ``k`` when the cosine drops ``k``). Same op on local shards.
- split the reduced dim ``k`` (both inputs full size there): the row sums come from all-reduces,
  everything after them is computed identically on every rank, so the output is replicated and
  the all-reduces' identity backward is exact (each rank's summand receives the full gradient):
  - kernel ``cosine_similarity``: ``dot = AR(sum x1 x2)``, ``n_i = sqrt(AR(sum x_i^2))`` ->
    ``dot / (c(n1) c(n2))`` where ``c`` clamps at ``eps`` in value only, as ATen does (its norms are
    clamped in place under no_grad, so the gradient flows through the unclamped norm);
  - kernel ``pairwise_distance`` (finite ``p >= 1``): ``AR(sum |x1 - x2 + eps|^p) ^ (1/p)``.
  A zero norm gets a zero gradient, as in ATen's norm backward (not ``inf * 0``).
  ``p`` < 1 (no norm) and ``p = inf`` (a max, whose gradient goes to the global arg-max) are not
  split on ``k``.
No ``Partial`` pass-through: neither op is linear.
"""

from __future__ import annotations

import math

import torch

from autopar.layout.cost import collective_seconds
from autopar.layout.placement import Replicate, Shard
from autopar.strategies.kernel_context import KernelContext
from autopar.strategies.registry import AxisOption, OpInfo, Sample, register, register_kernel
from autopar.strategies._loss_elementwise import broadcast_split
from autopar.strategies.samples import rand

aten = torch.ops.aten
R = Replicate()


def _shape(info: OpInfo) -> tuple[int, ...]:
    return tuple(torch.broadcast_shapes(info.input("x1").shape, info.input("x2").shape))


def _reduced_dim(info: OpInfo) -> int:
    ndim = len(_shape(info))
    if info.target is aten.cosine_similarity.default:
        return info.arg("dim") % max(ndim, 1)
    return ndim - 1  # pairwise_distance: the innermost dim of the broadcast shape


def _keeps_dim(info: OpInfo) -> bool:
    return info.target is aten.pairwise_distance.default and bool(info.arg("keepdim"))


def _splits_reduced_dim(info: OpInfo) -> bool:
    shape, k = _shape(info), _reduced_dim(info)
    for name in ("x1", "x2"):
        meta = info.input(name)
        j = k - (len(shape) - meta.ndim)
        if j < 0 or meta.shape[j] != shape[k]:
            return False  # a broadcast feature dim: every rank would need the whole row
    if info.target is aten.pairwise_distance.default:
        p = info.arg("p")
        return math.isfinite(p) and p >= 1
    return True


def _distance_rule(info: OpInfo) -> list[AxisOption]:
    shape, k = _shape(info), _reduced_dim(info)
    keep = _keeps_dim(info)
    options = []
    for d in range(len(shape)):
        if d == k or shape[d] == 1:
            continue
        out_d = d if keep or d < k else d - 1
        options.append(info.option(Shard(out_d), **broadcast_split(info, ("x1", "x2"), shape, d)))
    if _splits_reduced_dim(info):
        kernel = "cosine_similarity" if info.target is aten.cosine_similarity.default else "pairwise_distance"
        ins = broadcast_split(info, ("x1", "x2"), shape, k)
        options.append(info.option(R, kernel=kernel, grad_partial=(), **ins))
    return options


# ---------------------------------------------------------------------------------- kernels
def _feature_axes(ctx: KernelContext) -> tuple[int, ...]:
    shape, k = _shape(ctx.info), _reduced_dim(ctx.info)
    x1 = ctx.info.input("x1")
    return ctx.spec("x1").shard_axes(k - (len(shape) - x1.ndim))


def _row_sum_comm(num_sums: int):
    def cost(info: OpInfo, input_specs, output_specs, mesh) -> tuple[float, float]:
        # ``num_sums`` all-reduces of one value per row (the local output's size); their
        # backward is the identity (the results are replicated).
        x1 = info.input("x1")
        k = _reduced_dim(info)
        axes = input_specs[0].shard_axes(k - (len(_shape(info)) - x1.ndim))
        out = info.output
        rows = math.prod(output_specs[0].local_shape(out.shape, mesh.shape)) * out.itemsize
        return num_sums * collective_seconds("all_reduce", rows, mesh, axes), 0.0

    return cost


def _root0(s: torch.Tensor, p: float) -> torch.Tensor:
    """``s ** (1/p)`` with a zero gradient where ``s == 0`` (ATen's norm backward masks a zero norm)."""
    pos = s > 0
    safe = torch.where(pos, s, torch.ones_like(s))
    root = safe.sqrt() if p == 2 else safe.pow(1.0 / p)
    return torch.where(pos, root, torch.zeros_like(s))


@register_kernel("cosine_similarity", comm_cost=_row_sum_comm(3))
def cosine_similarity(ctx: KernelContext, x1, x2, dim=1, eps=1e-8):
    axes = _feature_axes(ctx)
    k = _reduced_dim(ctx.info)
    x1, x2 = torch.broadcast_tensors(x1, x2)
    dot = ctx.comm.all_reduce((x1 * x2).sum(k), axes)
    norms = []
    for x in (x1, x2):
        n = _root0(ctx.comm.all_reduce((x * x).sum(k), axes), 2)
        norms.append(n + (n.clamp_min(eps) - n).detach())  # clamped value, unclamped gradient
    return dot / (norms[0] * norms[1])


@register_kernel("pairwise_distance", comm_cost=_row_sum_comm(1))
def pairwise_distance(ctx: KernelContext, x1, x2, p=2.0, eps=1e-6, keepdim=False):
    axes = _feature_axes(ctx)
    diff = x1 - x2 + eps
    powered = diff * diff if p == 2 else diff.abs().pow(p)
    out = _root0(ctx.comm.all_reduce(powered.sum(-1, keepdim=True), axes), p)
    return out if keepdim else out.squeeze(-1)


# ---------------------------------------------------------------------------------- samples
def _cosine_samples() -> list[Sample]:
    x1, x2 = rand(8, 8), rand(8, 8)
    x1[1] = 0.0  # a zero row: clamped norm, zero norm gradient
    x2[2] = 1e-10  # a tiny row: its norm is clamped at eps
    return [
        Sample((x1, x2), label="rows"),
        Sample((rand(4, 8, 4), rand(4, 8, 4), 1, 1e-8), label="3d-dim1"),
        Sample((rand(8, 4), rand(4)), {"dim": -1}, label="broadcast-x2"),
        Sample((rand(8), rand(8), 0), label="vectors"),
    ]


def _pairwise_samples() -> list[Sample]:
    x1, x2 = rand(8, 8), rand(8, 8)
    x1[3], x2[3] = 0.0, 1e-6  # x1 - x2 + eps == 0 exactly: a zero distance
    return [
        Sample((x1, x2), label="p2"),
        Sample((rand(8, 8), rand(8, 8), 1.0, 1e-6, True), label="p1-keepdim"),
        Sample((rand(4, 4, 8), rand(4, 4, 8), 3.0), label="3d-p3"),
        Sample((rand(8, 8), rand(8, 8), 1.5), label="p1.5"),
        Sample((rand(8, 8), rand(1, 8), math.inf), label="inf-broadcast"),
        Sample((rand(8, 8), rand(8, 8), 0.5), label="p0.5"),
    ]


register(aten.cosine_similarity.default, samples=_cosine_samples)(_distance_rule)
register(aten.pairwise_distance.default, samples=_pairwise_samples)(_distance_rule)


# ---------------------------------------------------------------------------------- cdist
# ``_cdist_forward(x1 (*, P, M), x2 (*, R, M), p)`` -> (*, P, R): the distance of every row of x1 to
# every row of x2 (``torch.cdist`` below 25 rows, or with p != 2). A batch dim splits both inputs
# and the output; the rows of x1 split the output's rows (x2 replicated: partial gradient), the
# rows of x2 its columns. The feature dim M is not split (a p-norm of the differences is not a
# sum of per-shard norms). Same op on local shards.
def _cdist_rule(info: OpInfo) -> list[AxisOption]:
    x1, x2 = info.input("x1"), info.input("x2")
    options = [info.option(Shard(x1.ndim - 2), x1=Shard(x1.ndim - 2)),
               info.option(Shard(x1.ndim - 1), x2=Shard(x2.ndim - 2))]
    if x1.ndim == x2.ndim and x1.shape[:-2] == x2.shape[:-2]:  # batch dims of equal size (no broadcast)
        options += [info.option(Shard(d), x1=Shard(d), x2=Shard(d)) for d in range(x1.ndim - 2)]
    return options


def _cdist_samples() -> list[Sample]:
    return [Sample((rand(8, 4), rand(4, 4), 2.0, None), label="p2"),
            Sample((rand(4, 8, 4), rand(4, 4, 4), 1.0, None), label="batched-p1"),
            Sample((rand(8, 4), rand(8, 4), 3.0, None), label="p3")]


register(aten._cdist_forward.default, samples=_cdist_samples)(_cdist_rule)
