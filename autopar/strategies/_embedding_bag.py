"""Pooled embedding lookup (``nn.EmbeddingBag``): ``aten._embedding_bag`` (and its twin
``_embedding_bag_forward_only``, what a table that takes no gradient is looked up with).

``_embedding_bag(weight (V, D), indices (N,), offsets (B,) or (B+1,), scale_grad_by_freq, mode,
sparse, per_sample_weights (N,)?, include_last_offset, padding_idx)`` pools the rows of each bag
``indices[offsets[b]:offsets[b+1]]`` (sum, mean or max; ``padding_idx`` entries are skipped and not
counted) and returns ``(output (B, D), offset2bag, bag_size, max_indices)``. The last three are the
op's bookkeeping for its own backward; a traced model never reads them, but the numerical check
compares them, so every option reproduces them exactly (replicated, or sharded like ``output``).

TorchRec's four table placements, in autopar's vocabulary (one placement per mesh axis):

- **data-parallel** -- table ``R``, each rank pools its slice of the bags: output ``Shard(0)``;
  the table's gradient is partial (all-reduced in backward, derived centrally). Kernel
  ``embedding_bag_sharded`` (the bags arrive as flat ``indices`` + global ``offsets``, so a rank
  cannot find its bags in a shard of ``indices``: ``indices``/``offsets`` are read replicated -- the
  conversion from a batch-sharded input is an all-gather of integer ids, priced on the edge).
- **row-wise** -- table ``Shard(0)``: each rank pools only the ids in its row range, so the sum over
  the axis is the full pooled sum: output ``Partial`` (reduced, or reduce-scattered to the batch,
  by the consumer's edge). ``mean`` divides the local sum by the bag's *global* count (computed
  from the replicated ids). ``max`` is a partial max: the ranks all-reduce the local maxima (max)
  inside the kernel, and only the rank holding the winning row keeps its value, the others write 0,
  so the output is still a ``Partial`` sum and the gradient reaches only the winning row. Exact ties
  between rows on different ranks go to the lowest row (the unsharded op takes the first in bag
  order; the forward value is the same, only which tied row gets the gradient may differ).
- **column-wise** -- table ``Shard(1)``: the plain op on local columns, output ``Shard(1)``.
- **table-wise** -- the whole table on ONE device of an axis, nothing on its peers (TorchRec's
  table-wise). Every placement here is even over an axis, so the rule states it as the layouts
  it is read and priced in: table ``Shard(0)`` (each device holds ``V*D/n`` *on average*: the
  balanced share once the planner spreads the tables over the axis), ids replicated (the ids'
  all-gather, on the edge), output ``Shard(0)`` (the pooled outputs go back to batch-sharded,
  priced as the all-to-all of ``B*D`` bytes forward and backward). The kernel pools *every* bag
  over the rows this rank holds, then hands each rank its bags. What runs is TorchRec's table-wise
  where the table is owned -- ``planner/table_partition.py`` records the owner in ``Plan.tables``,
  the runtime gives it every row and its peers none (``runtime/table_wise.py``,
  ``KernelContext.owners``) -- and the owner's bags are scattered from it (``Comm.scatter``;
  backward gathers their gradients onto it). With an even row split (the numeric check; a table
  the planner could not give an owner) the same lookup is exact as a reduce-scatter, run as a sum
  all-reduce of the pooled bags (more bytes than priced; such tables are listed in the plan). Over
  several axes the table-wise ones must be minor to any other axis splitting the batch (the
  owner's bags are then one block). On an ``(hosts, gpus)`` mesh, table-wise over hosts and
  row-wise over gpus (table ``S0S0``, output ``S0 P``) is TorchRec's table-row-wise; table ``R x
  S(0)`` is row-wise inside every host, replicated across hosts.

Every option also reads ``per_sample_weights`` replicated; its gradient is partial wherever the
work is split (derived centrally). ``scale_grad_by_freq`` scales gradients by id frequencies
over the whole id list -- and the CPU kernel's scaling depends on more than each row's own count
(an id seen three times may come back unscaled), so only a rank that runs the op on every id
reproduces it: only column-wise is offered then. ``sparse=True`` (sparse gradients) gets the
replicated strategy only.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from autopar.layout.cost import collective_seconds
from autopar.layout.placement import Partial, Replicate, Shard
from autopar.strategies.kernel_context import KernelContext
from autopar.strategies.registry import AxisOption, OpInfo, Sample, register, register_kernel
from autopar.strategies.samples import ints, rand

aten = torch.ops.aten
R, P = Replicate(), Partial()
SUM, MEAN, MAX = 0, 1, 2
KERNEL = "embedding_bag_sharded"


def table_wise_axes(input_specs, output_specs, mesh_shape) -> tuple[int, ...]:
    """The axes (of size > 1) on which a lookup is table-wise: the table split by rows and the
    pooled output by bags (row-wise leaves a partial output, data-parallel a whole table)."""
    weight, out = input_specs[0], output_specs[0]
    return tuple(a for a, n in enumerate(mesh_shape)
                 if n > 1 and weight.placements[a] == Shard(0) and out.placements[a] == Shard(0))


def _kernel_comm(info: OpInfo, input_specs, output_specs, mesh) -> tuple[float, float]:
    """Row-wise ``max``: one all-reduce (max) of the local maxima and one of the winners' row keys
    (int64), over the axes splitting the rows. Table-wise: the pooled outputs' all-to-all to the
    batch over those axes, forward and (their gradient) backward. Sums and means communicate
    nothing else here: a row-wise partial output is reduced by the consumer's edge."""
    out = info.outputs[0]
    tw = table_wise_axes(input_specs, output_specs, mesh.shape)
    before = output_specs[0]
    for axis in tw:
        before = before.with_placement(axis, R)
    pooled = math.prod(before.local_shape(out.shape, mesh.shape)) * out.itemsize
    exchange = collective_seconds("all_to_all", pooled, mesh, tw) if tw else 0.0
    axes = input_specs[info.slot_index("weight")].shard_axes(0)
    if info.arg("mode") != MAX or not axes:
        return exchange, exchange
    local = pooled // out.itemsize
    return exchange + collective_seconds("all_reduce", local * (out.itemsize + 8), mesh, axes), exchange


@register_kernel(KERNEL, comm_cost=_kernel_comm)
def embedding_bag_sharded(ctx: KernelContext, weight, indices, offsets, scale_grad_by_freq=False, mode=SUM,
                          sparse=False, per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    """One rank's pooled lookups: its bags (the output's dim-0 slice, every bag on a table-wise
    axis) over its rows (``weight``'s dim-0 slice: ``ctx.local_range``, which knows an owned
    table; its columns come with the local ``weight``). ``indices``/``offsets`` are global."""
    num_rows = ctx.info.input("weight").shape[0]
    lo, hi = ctx.local_range("weight", 0)
    row_axes = ctx.axes_sharding("weight", 0)
    out_meta = ctx.info.outputs[0]
    tw = table_wise_axes(ctx.input_specs, ctx.output_specs, ctx.mesh_shape)
    pooled_spec = ctx.output_specs[0]
    for axis in tw:  # pool every bag on a table-wise axis; the exchange below hands them out
        pooled_spec = pooled_spec.with_placement(axis, R)
    bags = pooled_spec.local_slices(out_meta.shape, ctx.mesh_shape, ctx.coords())[0]
    b0, b1 = bags.start, bags.stop
    # bounds[b]:bounds[b+1] is bag b (the last bag runs to the end unless include_last_offset says).
    bounds = offsets if include_last_offset else torch.cat([offsets, offsets.new_full((1,), indices.shape[0])])
    first, last = int(bounds[b0]), int(bounds[b1])
    ids = indices[first:last]
    starts, ends = bounds[b0:b1] - first, bounds[b0 + 1:b1 + 1] - first
    counted = ids != padding_idx if padding_idx >= 0 else torch.ones_like(ids, dtype=torch.bool)
    keep = counted & (ids >= lo) & (ids < hi)
    # The kept ids of bag b are kept[starts[b]:ends[b]]: new offsets from the running count.
    running = F.pad(keep.cumsum(0), (1, 0))
    psw = None if per_sample_weights is None else per_sample_weights[first:last][keep]
    # Padding entries are dropped above, so the local call has no padding index; a mean is a sum
    # divided by the bag's global count (another rank may hold some of its rows).
    op = ctx.info.target  # _embedding_bag, or its forward-only twin for a frozen table
    out, _, _, local_max_rows = op(
        weight, ids[keep] - lo, running[starts], scale_grad_by_freq, SUM if mode == MEAN else mode, sparse, psw,
        False, -1)
    max_indices = None
    if mode == MEAN:
        total = F.pad(counted.cumsum(0), (1, 0))
        out = out / (total[ends] - total[starts]).clamp(min=1).unsqueeze(1).to(out.dtype)
    elif mode == MAX:
        out, max_indices = _partial_max(ctx, out, local_max_rows + lo, (running[ends] - running[starts]) > 0,
                                        row_axes, num_rows)
    if tw:
        mine = ctx.output_specs[0].local_slices(out_meta.shape, ctx.mesh_shape, ctx.coords())[0]
        keep_bags = slice(mine.start - b0, mine.stop - b0)
        owners = {axis: owner for slot, axis, owner in ctx.owners if slot == 0}
        if set(owners) == set(tw):
            out = _scatter_from_owner(ctx, out, tw, owners)
        else:
            out = _ScatterBags.apply(out, ctx.comm, tw, keep_bags)
        max_indices = None if max_indices is None else max_indices[keep_bags]
    offset2bag, bag_size, aux_max = _bookkeeping(op, weight, indices, offsets, mode, per_sample_weights,
                                                 include_last_offset, padding_idx)
    return out, offset2bag, bag_size, aux_max if max_indices is None else max_indices


def _scatter_from_owner(ctx: KernelContext, pooled, axes: tuple[int, ...], owners: dict[int, int]):
    """An owned table: the owner's pooled bags are the whole sum, so each table-wise axis in turn
    scatters them from the owner's coordinate (mixed radix: the lowest axis is the major digit),
    among the ranks that hold them by then (those at the owner's coordinates on the later axes)."""
    coords = ctx.coords()
    for k, axis in enumerate(axes):
        if all(coords[a] == owners[a] for a in axes[k + 1:]):
            pooled = ctx.comm.scatter(pooled, axis, owners[axis])
        else:  # not holding them yet: the right size, no value (a later axis's scatter overwrites it)
            pooled = pooled[:pooled.shape[0] // ctx.mesh_shape[axis]]
    return pooled


class _ScatterBags(torch.autograd.Function):
    """Every bag's pooled summand on each rank of ``axes`` -> this rank's bags of the sum (a
    reduce-scatter over dim 0); backward: each rank's bags' gradient back to every rank (an
    all-gather). Both as sum all-reduces through ``Comm`` (exact: the others' bags add zeros)."""

    @staticmethod
    def forward(ctx, pooled, comm, axes, keep):
        ctx.comm, ctx.axes, ctx.keep, ctx.shape = comm, axes, keep, pooled.shape
        with torch.no_grad():
            return comm.all_reduce(pooled.detach(), axes)[keep].clone()

    @staticmethod
    def backward(ctx, grad):
        with torch.no_grad():
            full = grad.new_zeros(ctx.shape)
            full[ctx.keep] = grad
            return ctx.comm.all_reduce(full, ctx.axes), None, None, None


def _partial_max(ctx: KernelContext, out, rows, has_local, row_axes, num_rows):
    """The local maxima -> this rank's summand of the global maximum, and the winners' rows."""
    has_local = has_local.unsqueeze(1).expand_as(out)
    if not row_axes:
        # The unsharded op reports row 0 for a bag with nothing to pool.
        return out, torch.where(has_local, rows, torch.zeros_like(rows))
    local = out.detach().masked_fill(~has_local, float("-inf"))
    best = ctx.comm.all_reduce(local, row_axes, "max")
    candidate = has_local & (local == best)
    # One int all-reduce both breaks exact ties (the lowest row wins) and tells every rank the row.
    key = torch.where(candidate, num_rows - rows, torch.full_like(rows, -1))
    best_key = ctx.comm.all_reduce(key, row_axes, "max")
    won = candidate & (key == best_key)
    winner_rows = torch.where(best_key >= 0, num_rows - best_key, torch.zeros_like(best_key))
    return out.masked_fill(~won, 0.0), winner_rows


def _bookkeeping(op, weight, indices, offsets, mode, per_sample_weights, include_last_offset, padding_idx):
    """``offset2bag``, ``bag_size`` and ``max_indices`` of the unsharded call, exactly: they depend
    on the ids only through "is it the padding index", so the op runs on a 2-row table with ids
    0 (counted) / 1 (padding) -- no rows of the real table are touched."""
    with torch.no_grad():
        marker = (indices == padding_idx).long() if padding_idx >= 0 else torch.zeros_like(indices)
        psw = None if per_sample_weights is None else per_sample_weights.detach()
        _, offset2bag, bag_size, max_indices = op(
            weight.new_zeros(2, 1), marker, offsets, False, mode, False, psw, include_last_offset,
            1 if padding_idx >= 0 else -1)
    return offset2bag, bag_size, max_indices


def _embedding_bag(info: OpInfo) -> list[AxisOption]:
    if info.arg("sparse"):
        return []  # a sparse gradient is summed by no collective here: replicate
    is_max = info.arg("mode") == MAX
    # Output placements: (output, offset2bag, bag_size, max_indices); the max mode's max_indices
    # (B, D) is laid out like the output (replicated where the output is a partial sum: the kernel
    # all-reduces the winners' rows), the other modes' bookkeeping is replicated.
    column_wise = info.option((Shard(1), R, R, Shard(1) if is_max else R), weight=Shard(1))
    if info.arg("scale_grad_by_freq"):
        return [column_wise]
    return [
        column_wise,
        info.option((P, R, R, R), weight=Shard(0), kernel=KERNEL),  # row-wise
        info.option((Shard(0), R, R, Shard(0) if is_max else R), kernel=KERNEL),  # data-parallel
        info.option((Shard(0), R, R, Shard(0) if is_max else R), weight=Shard(0), kernel=KERNEL),  # table-wise
    ]


def _samples() -> list[Sample]:
    # 4 bags of 16 ids over a 16 x 8 table: bag 1 is empty, bag 3 holds the padding index twice.
    ids = ints(16, 16)
    ids[12], ids[14] = 3, 3
    offsets = torch.tensor([0, 5, 5, 11])
    last = torch.tensor([0, 5, 5, 11, 16])
    psw = rand(16)
    return [
        Sample((rand(16, 8), ids, offsets), label="sum"),
        Sample((rand(16, 8), ids, offsets, False, MEAN), label="mean"),
        Sample((rand(16, 8), ids, offsets, False, MAX), label="max"),
        Sample((rand(16, 8), ids, offsets, False, SUM, False, psw), label="per-sample-weights"),
        Sample((rand(16, 8), ids, last, False, MEAN, False, None, True, 3), label="mean-last-offset-padding"),
        Sample((rand(16, 8), ids, offsets, False, MAX, False, None, False, 3), label="max-padding"),
        Sample((rand(16, 8), ids, last, False, SUM, False, psw, True, 3), label="psw-last-offset-padding"),
        Sample((rand(16, 8), ids, offsets, True, SUM), label="scale-grad-by-freq"),
        Sample((_tied_rows(), torch.tensor([1, 13, 5, 2, 1, 13, 7, 8]), torch.tensor([0, 2, 4, 6]), False, MAX),
               label="max-tie-across-ranks"),
    ]


def _tied_rows() -> torch.Tensor:
    """Rows 1 and 13 equal (different ranks on any row split): a partial max must count the tie
    once, and bags 0 and 2 list row 1 first, so the lowest row is also the unsharded op's pick."""
    weight = rand(16, 8)
    weight[13] = weight[1]
    return weight


def _frozen_samples() -> list[Sample]:
    # A table that takes no gradient (frozen) is looked up with _embedding_bag_forward_only.
    return [dataclasses.replace(s, no_grad=("weight", "per_sample_weights")) for s in _samples()]


def _table_wise_minor(info: OpInfo, combo) -> bool:
    """Table-wise axes come after every other axis splitting the batch: the bags a table-wise
    group pools are then one block of the output (the mixed-radix order of ``local_slices``)."""
    def batch_split(o) -> bool:
        return o.outputs[0] == Shard(0)
    table_wise = [a for a, o in enumerate(combo) if batch_split(o) and o.inputs[0] == Shard(0)]
    others = [a for a, o in enumerate(combo) if batch_split(o) and o.inputs[0] != Shard(0)]
    return not table_wise or not others or max(others) < min(table_wise)


register(aten._embedding_bag.default, samples=_samples, combine_check=_table_wise_minor)(_embedding_bag)
register(aten._embedding_bag_forward_only.default, samples=_frozen_samples,
         combine_check=_table_wise_minor)(_embedding_bag)
