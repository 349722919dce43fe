"""Table-wise embedding tables at run time: a table whole on ONE device of its axes (``Plan.tables``).

The plan lays such a table out ``Shard(0)`` on its table-wise axes (the balanced share the planner
priced) and names the owner's coordinate there (``TableOwner``); what each rank holds is:

- the owner: the table as if those axes were replicated (``held_spec``: whole along them, split
  along the others as the layout says);
- its peers on those axes: nothing -- a zero-row local tensor, so no gradient and no optimizer
  state either.

The parameter is a DTensor with the plan's placements (``Shard(0)`` on the owned axes) over these
uneven locals: elementwise optimizer steps run on the locals as they are, and a norm sums the
locals' squares over the mesh, so clipping counts each table once. What assumes even shards is
done here instead: the lookup's row range (``kernel_owners``: the kernel's ``KernelContext.owners``),
slicing a full tensor into this rank's piece (``cut``: initialisation, loading a checkpoint) and
gathering the full table (``gather``: checkpoints, ``full_state_dict``, gradients; a broadcast
from the owner over each owned axis).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autopar.layout.placement import Replicate, TensorSpec
from autopar.plans import Plan, TableOwner
from autopar.runtime.process_mesh import ProcessMesh

__all__ = ["check_tables", "owners_of", "held_spec", "holds", "cut", "gather", "local_shape", "to_table_dtensor",
           "kernel_owners"]


_BAGS = (torch.ops.aten._embedding_bag.default, torch.ops.aten._embedding_bag_forward_only.default)


def check_tables(plan: Plan, traced) -> None:
    """ValueError / NotImplementedError unless each of ``plan``'s table-wise tables is what the
    runtime can hold whole on one device: a parameter read only by lookups, in its stored layout
    (no conversion of the owned table), without ZeRO or offload."""
    for t in plan.tables:
        try:
            stored = plan.node(t.param)
        except KeyError:
            raise ValueError(f"Plan.tables names {t.fqn!r} (placeholder {t.param!r}), which the plan does not place")
        _check(TensorSpec.parse(stored.output_specs[0]), t)
        if stored.zero_stage or plan.offload:
            raise NotImplementedError(f"table-wise table {t.fqn!r} under ZeRO or offload is not run; re-plan (the "
                                      f"planner leaves such tables evenly split)")
        for user in traced.node(t.param).users:
            read = plan.node(user.name).input_specs[0] if user.target in _BAGS else None
            if read != stored.output_specs[0]:
                raise ValueError(f"table-wise table {t.fqn!r} is stored {stored.output_specs[0]} but node "
                                 f"{user.name!r} reads it {read or 'as another op'}: an owned table is read only "
                                 f"by lookups, in its stored layout")


def owners_of(plan: Plan) -> dict[str, TableOwner]:
    """Parameter placeholder name -> its ``TableOwner``, for the plan's table-wise tables."""
    return {t.param: t for t in plan.tables}


def held_spec(spec: TensorSpec, owner: TableOwner) -> TensorSpec:
    """The layout the owner holds the table in: ``spec`` whole along the owned axes."""
    for axis in owner.axes:
        spec = spec.with_placement(axis, Replicate())
    return spec


def holds(owner: TableOwner, coordinate: Sequence[int]) -> bool:
    return all(coordinate[a] == c for a, c in zip(owner.axes, owner.owner))


def _check(spec: TensorSpec, owner: TableOwner) -> None:
    for axis in owner.axes:
        if spec.shard_axes(0) and axis in spec.shard_axes(0):
            continue
        raise ValueError(f"table {owner.fqn!r} is owned on mesh axis {axis}, but its layout {spec} does not split "
                         f"its rows there: the plan's Plan.tables does not match its layouts")


def cut(full: torch.Tensor, spec: TensorSpec, owner: TableOwner, pmesh: ProcessMesh) -> torch.Tensor:
    """This rank's piece of the full table ``full`` (a fresh contiguous tensor; zero rows on a peer)."""
    _check(spec, owner)
    piece = full.detach()[held_spec(spec, owner).local_slices(tuple(full.shape), pmesh.shape, pmesh.coordinate)]
    if not holds(owner, pmesh.coordinate):
        piece = piece[:0]
    return piece.clone(memory_format=torch.contiguous_format)


@torch.no_grad()
def gather(local: torch.Tensor, spec: TensorSpec, owner: TableOwner, pmesh: ProcessMesh,
           global_shape: Sequence[int]) -> torch.Tensor:
    """The full table on every rank (a collective: every rank must call): the owner's devices
    gather their pieces along the other axes, then each owned axis broadcasts from the owner."""
    from autopar.runtime.collectives import gather_full

    coord = tuple(pmesh.coordinate)
    if holds(owner, coord):
        value = gather_full(local, held_spec(spec, owner), pmesh).contiguous()
    else:  # every peer along the other axes is a peer too: nothing to gather before the broadcast
        value = local.new_empty(tuple(global_shape))
    for k, axis in enumerate(owner.axes):
        # Those whose coordinates on the axes still to come match the owner's take part; the
        # others are whole groups of this axis that wait for a later axis.
        if all(coord[a] == c for a, c in zip(owner.axes[k + 1:], owner.owner[k + 1:])) and pmesh.axis_size(axis) > 1:
            group = pmesh.group(axis)
            src = dist.get_global_rank(group, owner.owner[k])
            dist.broadcast(value, src=src, group=group)
    return value


def local_shape(spec: TensorSpec, owner: TableOwner, global_shape: Sequence[int], pmesh: ProcessMesh
                ) -> tuple[int, ...]:
    """This rank's local shape of the table: the owner's whole along the owned axes, zero rows elsewhere."""
    shape = list(held_spec(spec, owner).local_shape(tuple(global_shape), pmesh.shape))
    if not holds(owner, pmesh.coordinate):
        shape[0] = 0
    return tuple(shape)


def to_table_dtensor(local: torch.Tensor, spec: TensorSpec, owner: TableOwner, pmesh: ProcessMesh,
                     global_shape: Sequence[int]) -> DTensor:
    """``local`` (the owner's whole table, or a peer's zero rows) as a DTensor with the plan's
    placements, sharing its storage."""
    from autopar.runtime.dtensors import _contiguous_stride, dtensor_placements

    want = local_shape(spec, owner, global_shape, pmesh)
    if tuple(local.shape) != want:
        raise ValueError(f"table {owner.fqn!r}: local shape {tuple(local.shape)} on this rank, expected {tuple(want)} "
                         f"({'owner' if holds(owner, pmesh.coordinate) else 'a peer of the owner'})")
    return DTensor.from_local(local.detach(), pmesh.device_mesh, dtensor_placements(spec), run_check=False,
                              shape=torch.Size(global_shape), stride=_contiguous_stride(global_shape))


def kernel_owners(weight: str, owners: Mapping[str, TableOwner]) -> tuple[tuple[int, int, int], ...]:
    """``KernelContext.owners`` of a lookup whose table (input slot 0) is placeholder ``weight``."""
    owner = owners.get(weight)
    if owner is None:
        return ()
    return tuple((0, axis, c) for axis, c in zip(owner.axes, owner.owner))
