"""Reductions and scans: sum, mean, amax, amin, cumsum, diff, softmax, log_softmax.

Single-axis options:

- split a dim that is not reduced: the input is sharded on it, the output on the dim it becomes
  (``keepdim`` keeps the numbering, otherwise reduced dims before it drop out);
- split a REDUCED dim of ``sum``: each rank sums its chunk, the output is ``Partial``;
- split a reduced dim of ``mean``: the output is ``Partial`` too, but each rank's summand must be
  ``local_sum / global_count`` -- the plain local mean divides by the local count, which makes
  the sum over ranks ``n`` times too big. The ``partial_mean`` kernel divides the local mean by
  the number of shards of the reduced dims (no communication);
- pass a pending sum through the linear ones: ``sum``, ``mean``, ``cumsum``, ``diff`` (``P -> P``).

``amax``/``amin`` over a split dim would need a max all-reduce and a tie-aware backward (the
gradient goes to the arg-max positions of the *global* maximum): not offered, only their other
dims are split. A scan (``cumsum``) or difference (``diff``) along a split dim needs the
neighbouring ranks' values: not offered. Softmax is not linear and normalises along ``dim``:
only the other dims are split.
"""

from __future__ import annotations

from typing import Sequence

import torch

from autopar.layout.placement import Partial, Replicate, Shard
from autopar.strategies.kernel_context import KernelContext
from autopar.strategies.registry import AxisOption, OpInfo, Sample, call_op, register, register_kernel
from autopar.strategies.samples import ints, rand, randbool

aten = torch.ops.aten
R, P = Replicate(), Partial()


def _reduced_dims(info: OpInfo) -> list[int]:
    ndim = info.input("self").ndim
    dims = info.bound.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(ndim))  # no dims (or an empty list): a full reduction
    dims = [dims] if isinstance(dims, int) else dims
    return sorted({d % ndim for d in dims}) if ndim else []


def reduction_options(info: OpInfo, *, reduced_split: str | None, linear: bool) -> list[AxisOption]:
    """``reduced_split``: None (do not split reduced dims), "plain" (sum) or a kernel name."""
    ndim = info.input("self").ndim
    reduced = _reduced_dims(info)
    keepdim = bool(info.bound.get("keepdim", False))
    options = []
    for d in range(ndim):
        if d not in reduced:
            out_d = d if keepdim else d - sum(r < d for r in reduced)
            options.append(info.option(Shard(out_d), self=Shard(d)))
        elif reduced_split is not None:
            kernel = None if reduced_split == "plain" else reduced_split
            options.append(info.option(P, self=Shard(d), kernel=kernel))
    if linear:
        options.append(info.option(P, work_split=False, self=P))
    return options


def _no_comm(info, input_specs, output_specs, mesh) -> tuple[float, float]:
    return 0.0, 0.0


@register_kernel("partial_mean", comm_cost=_no_comm)
def partial_mean(ctx: KernelContext, self, **args):
    """The local mean as a summand of the global mean: divided by the reduced dims' shard count."""
    out = call_op(ctx.info.target, {"self": self, **args})
    spec = ctx.spec("self")
    num_shards = 1
    for d in _reduced_dims(ctx.info):
        num_shards *= spec.num_shards(d, ctx.mesh_shape)
    return out / num_shards


# -------------------------------------------------------------------------------- samples
def _dim_samples() -> list[Sample]:
    return [
        Sample((rand(4, 8, 4), [1]), label="middle"),
        Sample((rand(4, 8, 4), [0, 2], True), label="two-keepdim"),
        Sample((rand(4, 8), [-1], True), label="last-keepdim"),
    ]


def _full_samples() -> list[Sample]:
    return [Sample((rand(4, 8),))]


# ------------------------------------------------------------------------------------ rules
def _sum_rule(info: OpInfo) -> list[AxisOption]:
    return reduction_options(info, reduced_split="plain", linear=True)


def _mean_rule(info: OpInfo) -> list[AxisOption]:
    return reduction_options(info, reduced_split="partial_mean", linear=True)


def _extremum_rule(info: OpInfo) -> list[AxisOption]:
    return reduction_options(info, reduced_split=None, linear=False)


register(aten.sum.dim_IntList,
         samples=lambda: _dim_samples() + [Sample((randbool(4, 8), [1]), label="bool")])(_sum_rule)
register(aten.sum.default, samples=_full_samples)(_sum_rule)
register(aten.mean.dim, samples=_dim_samples)(_mean_rule)
register(aten.mean.default, samples=_full_samples)(_mean_rule)
register(aten.amax.default, samples=_dim_samples)(_extremum_rule)
register(aten.amin.default, samples=_dim_samples)(_extremum_rule)


def _along_dim(info: OpInfo, *, linear: bool, tensors: Sequence[str] = ("self",)) -> list[AxisOption]:
    """Split every dim except ``dim``; the named same-shaped inputs follow ``self``."""
    ndim = info.input("self").ndim
    dim = info.arg("dim") % ndim if ndim else 0
    present = [t for t in tensors if info.input(t) is not None]
    options = [info.option(Shard(d), **{t: Shard(d) for t in present}) for d in range(ndim) if d != dim]
    if linear:
        options.append(info.option(P, work_split=False, **{t: P for t in present}))
    return options


@register(aten.cumsum.default, samples=lambda: [Sample((rand(4, 8), 1)), Sample((randbool(4, 8), -1), label="bool")])
def _cumsum(info: OpInfo) -> list[AxisOption]:
    return _along_dim(info, linear=True)


@register(aten.diff.default, samples=lambda: [
    Sample((rand(4, 8), 1, 0), label="dim-0"),
    Sample((rand(4, 8), 1, -1, rand(4, 1), rand(4, 2)), label="prepend-append"),
    Sample((ints(10, 4, 16), 1, -1, ints(10, 4, 1)), label="int-prepend"),
])
def _diff(info: OpInfo) -> list[AxisOption]:
    return _along_dim(info, linear=True, tensors=("self", "prepend", "append"))


def _softmax_rule(info: OpInfo) -> list[AxisOption]:
    return _along_dim(info, linear=False)


register(aten._softmax.default, samples=lambda: [Sample((rand(4, 8, 4), -1, False))])(_softmax_rule)
register(aten._log_softmax.default, samples=lambda: [Sample((rand(4, 8, 4), 1, False))])(_softmax_rule)
register(aten.softmax.int, samples=lambda: [Sample((rand(4, 8), 1)), Sample((rand(4, 8), 0))])(_softmax_rule)
register(aten.log_softmax.int, samples=lambda: [Sample((rand(4, 8), -1))])(_softmax_rule)
