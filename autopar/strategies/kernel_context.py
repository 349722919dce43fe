"""The communication interface seen by custom local kernels (no torch.distributed here).

A custom kernel (``register_kernel``) runs on one rank with its local shards and may talk to the
other ranks of a mesh axis group only through ``Comm``:

- ``all_reduce(t, axes, op="sum")`` -- reduce ``t`` over the ranks that differ only in the
  coordinates of ``axes`` (an int or a tuple of mesh axes). ``op="sum"`` is differentiable and
  its backward is the identity: under the gradient layout invariant the result is replicated,
  so its gradient arrives replicated and each rank keeps it for its own summand. ``op="max"``
  is not differentiable (the result never requires grad; kernels use it on detached values).
- ``all_reduce_async(t, axes)`` -- the sum of ``all_reduce`` issued without waiting, no autograd:
  returns ``wait()``, which gives the reduced tensor. For a value needed later than where it is
  computed (the per-rank batch norm's running statistics, applied in its backward).
- ``shift(t, axis)`` -- every rank of an ``axis`` group sends ``t`` to the next coordinate (the
  last to the first) and returns what the previous one sent: one step of a ring (ring attention).
  Not differentiable: kernels call it inside their own ``autograd.Function``.
- ``all_to_all(t, axis, send_counts, recv_counts)`` -- rows ``t[sum(send_counts[:j]):...]`` go
  to rank ``j`` of ``axis``'s group, and the result stacks the rows received from each rank in
  rank order (``recv_counts[j]`` from rank ``j``). Differentiable: its backward is the reverse
  exchange (counts swapped). ``exchange_counts(counts, axis)`` tells each rank how many rows it
  will receive: ``result[j]`` is rank ``j``'s ``counts[me]`` (plain ints, no autograd).
- ``scatter(t, axis, src)`` -- the rank at coordinate ``src`` of ``axis`` splits its ``t`` along
  dim 0 into ``size(axis)`` equal chunks and each rank of the axis gets its own (the others'
  ``t`` only gives the shape). Differentiable: backward gathers the chunks' gradients onto
  ``src``; the others' input gradient is zeros.
- ``coordinate(axis)`` -- this rank's index along ``axis``.
- ``size(axis)``       -- the number of ranks along ``axis``.

The runtime backs this with torch.distributed process groups; the numerical check
(``autopar.strategies.check``) backs it with threads in one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from autopar.layout.placement import Replicate, TensorSpec
from autopar.strategies.registry import OpInfo

__all__ = ["Comm", "KernelContext"]


class Comm(Protocol):
    def all_reduce(self, tensor: torch.Tensor, axes: int | Sequence[int], op: str = "sum") -> torch.Tensor: ...

    def all_reduce_async(self, tensor: torch.Tensor, axes: int | Sequence[int]) -> Callable[[], torch.Tensor]: ...

    def shift(self, tensor: torch.Tensor, axis: int) -> torch.Tensor: ...

    def all_to_all(self, tensor: torch.Tensor, axis: int, send_counts: Sequence[int],
                   recv_counts: Sequence[int]) -> torch.Tensor: ...

    def exchange_counts(self, counts: Sequence[int], axis: int) -> list[int]: ...

    def scatter(self, tensor: torch.Tensor, axis: int, src: int) -> torch.Tensor: ...

    def coordinate(self, axis: int) -> int: ...

    def size(self, axis: int) -> int: ...


@dataclass(frozen=True)
class KernelContext:
    """What a custom kernel knows: the comm interface, the op's global metadata, the specs."""

    comm: Comm
    info: OpInfo
    input_specs: tuple[TensorSpec | None, ...]
    output_specs: tuple[TensorSpec | None, ...]
    mesh_shape: tuple[int, ...]
    # (input slot, mesh axis, owner coordinate): on that axis the slot's dim-0 split is not even
    # but whole on the owner and empty on its peers (a table-wise table, ``Plan.tables``).
    owners: tuple[tuple[int, int, int], ...] = ()

    def coords(self) -> tuple[int, ...]:
        return tuple(self.comm.coordinate(a) for a in range(len(self.mesh_shape)))

    def spec(self, name: str, index: int | None = None) -> TensorSpec:
        i = self.info.slot_index(name, index)
        if i is None or self.input_specs[i] is None:
            raise ValueError(f"{self.info.where()}: no tensor input {name!r}")
        return self.input_specs[i]

    def local_range(self, name: str, dim: int) -> tuple[int, int]:
        """[start, stop) of this rank's piece of input ``name`` along ``dim`` (global indices)."""
        meta = self.info.input(name)
        spec, coords = self.spec(name), self.coords()
        owned = [(axis, owner) for slot, axis, owner in self.owners
                 if dim == 0 and slot == self.info.slot_index(name)]
        for axis, _ in owned:
            spec = spec.with_placement(axis, Replicate())
        sl = spec.local_slices(meta.shape, self.mesh_shape, coords)[dim]
        if any(coords[axis] != owner for axis, owner in owned):
            return sl.start, sl.start  # a peer of the owner holds none of it
        return sl.start, sl.stop

    def axes_sharding(self, name: str, dim: int) -> tuple[int, ...]:
        return self.spec(name).shard_axes(dim)
