"""Shared plumbing of the layer-wise optimizers: where a parameter is sharded, and batched sums.

A layer-wise optimizer needs statistics of the FULL parameter (a norm, row or column means)
while it holds only a DTensor's local block. Every such statistic here is a sum, so each rank
computes its local partial sum and the partial sums are added over the process groups of the
mesh dims that shard the dims being reduced. Mesh dims on which the tensor is replicated need
nothing: every replica holds the same block and computes the same partial sum.

:class:`SumReducer` batches: an optimizer step adds all its partial sums of one phase, then
one ``run`` concatenates them per (mesh, mesh dims, dtype, device) and issues one
``all_reduce`` per mesh dim of each such bucket -- a constant number of collectives per phase,
independent of how many parameters there are. A statistic reduced over two mesh dims is
all-reduced over one and then the other (sums are associative; no flattened group needed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["Layout", "layout_of", "local", "SumReducer", "local_range", "local_index", "check_float", "state_like",
           "elementwise_state", "closure_loss", "grads_of", "check_betas"]


@dataclass(frozen=True)
class Layout:
    """How one tensor is laid out: ``mesh`` (None for a plain tensor) and, per tensor dim, the
    mesh dims that shard it, in mesh-dim order (DTensor's default left-to-right order)."""

    mesh: Any  # torch DeviceMesh or None
    dim_shards: tuple[tuple[int, ...], ...]
    mesh_sizes: tuple[int, ...] = ()
    # per tensor dim, DTensor's ``_StridedShard`` split factor (a fused projection's ``S(d/k)``:
    # each of k segments split), else 1; () for none
    dim_factors: tuple[int, ...] = ()

    @property
    def is_sharded(self) -> bool:
        return any(self.dim_shards)

    def over(self, *tensor_dims: int) -> tuple[int, ...]:
        """The mesh dims sharding any of ``tensor_dims`` (negative dims count from the end)."""
        n = len(self.dim_shards)
        return tuple(sorted({m for d in tensor_dims for m in self.dim_shards[d % n]}))

    def all(self) -> tuple[int, ...]:
        return self.over(*range(len(self.dim_shards)))


def layout_of(t: Tensor) -> Layout:
    """The :class:`Layout` of a plain tensor or a DTensor with ``Shard``/``Replicate`` placements.

    A ``_StridedShard`` of a dim that no other mesh dim shards (a fused projection's ``S(d/k)``:
    each of k segments split) is a partition of the elements like a ``Shard``: sums over it are
    the same collectives; ``local_index`` gives its positions. Raises ValueError for placements
    the optimizers cannot reduce over (``Partial``: the local values are not a block of the
    parameter) and for a strided dim sharded by several mesh dims."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(t, DTensor):
        return Layout(None, tuple(() for _ in range(t.dim())))
    dims: list[list[int]] = [[] for _ in range(t.dim())]
    factors = [1] * t.dim()
    for mesh_dim, placement in enumerate(t.placements):
        if type(placement) is Shard or type(placement) is _StridedShard:
            d = placement.dim % max(t.dim(), 1)
            dims[d].append(mesh_dim)
            factors[d] = max(factors[d], getattr(placement, "split_factor", 1))
        elif not isinstance(placement, Replicate):
            raise ValueError(f"layer-wise optimizers need Shard or Replicate placements, got {placement!r} "
                             f"in {tuple(t.placements)} (redistribute the parameter first)")
    for d, f in enumerate(factors):
        if f > 1 and len(dims[d]) > 1:
            raise ValueError(f"layer-wise optimizers: dim {d} of {tuple(t.placements)} is strided and sharded by "
                             f"mesh dims {dims[d]}; redistribute the parameter first")
    return Layout(t.device_mesh, tuple(tuple(d) for d in dims), tuple(t.device_mesh.shape), tuple(factors))


def local(t: Tensor) -> Tensor:
    """The local block of a DTensor (sharing its storage: in-place updates reach the DTensor);
    a plain tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def local_range(layout: Layout, size: int, tensor_dim: int) -> tuple[int, int]:
    """[start, stop) of this rank's block along ``tensor_dim`` (global length ``size``).

    DTensor's ``Shard`` splits like ``torch.chunk`` (chunks of ceil(n/k), trailing ones short or
    empty), mesh dims in order, each splitting the previous one's block."""
    start, length = 0, size
    if layout.mesh is None:
        return 0, size
    for mesh_dim in layout.dim_shards[tensor_dim]:
        k = layout.mesh_sizes[mesh_dim]
        coord = layout.mesh.get_local_rank(mesh_dim)
        chunk = -(-length // k) if length else 0
        lo = min(coord * chunk, length)
        hi = min(lo + chunk, length)
        start, length = start + lo, hi - lo
    return start, start + length


def local_index(layout: Layout, size: int, tensor_dim: int) -> slice | Tensor:
    """This rank's positions along ``tensor_dim`` (global length ``size``): ``local_range`` as a
    slice, or for a strided dim (``S(d/k)``) the index of its piece of every segment."""
    factor = layout.dim_factors[tensor_dim] if layout.dim_factors else 1
    if factor == 1:
        return slice(*local_range(layout, size, tensor_dim))
    (mesh_dim,) = layout.dim_shards[tensor_dim]
    n, coord = layout.mesh_sizes[mesh_dim], layout.mesh.get_local_rank(mesh_dim)
    segment = size // factor
    piece = segment // n
    return torch.cat([torch.arange(s * segment + coord * piece, s * segment + (coord + 1) * piece)
                      for s in range(factor)])


def _local_length(layout: Layout, size: int, tensor_dim: int) -> int:
    index = local_index(layout, size, tensor_dim)
    return index.stop - index.start if isinstance(index, slice) else len(index)


def state_like(value: Tensor, param: Tensor, *, shape, dims: tuple[int | None, ...]) -> Tensor:
    """``value``, this rank's block of an optimizer state whose FULL-parameter shape is
    ``shape``, as a DTensor on ``param``'s mesh; ``value`` itself when ``param`` is plain.

    ``dims[d]`` is the state dim that parameter dim ``d`` becomes, or None where the state
    reduced it away (or to size 1). A mesh dim sharding a kept dim shards the state's dim the
    same way (same length, same mesh dims in the same order: the same block); one sharding a
    reduced dim becomes Replicate, because the statistic is summed over those shards and so is
    the same on each. The DTensor owns ``value``'s storage: the optimizer goes on computing on
    ``local(state)``, and ``torch.distributed.checkpoint`` sees a tensor it can reshard."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(param, DTensor):
        return value
    assert len(dims) == param.dim(), (dims, tuple(param.shape))
    placements = []
    for pl in param.placements:
        kept = dims[pl.dim % param.dim()] if type(pl) in (Shard, _StridedShard) else None
        if kept is None:
            placements.append(Replicate())
        else:  # a strided dim's state is strided alike (the same pieces)
            placements.append(_StridedShard(kept, split_factor=pl.split_factor) if type(pl) is _StridedShard
                              else Shard(kept))
    shape = torch.Size(shape)
    out = DTensor.from_local(value.contiguous(), param.device_mesh, placements, run_check=False,
                             shape=shape, stride=torch.empty(shape, device="meta").stride())
    # the block DTensor assigns this rank must be the one the optimizer computed
    want = tuple(_local_length(layout_of(out), n, d) for d, n in enumerate(shape))
    assert tuple(value.shape) == want, (tuple(value.shape), want, tuple(shape), placements)
    return out


def elementwise_state(value: Tensor, param: Tensor) -> Tensor:
    """A state shaped and sharded like ``param`` (``value``: the local block)."""
    return state_like(value, param, shape=param.shape, dims=tuple(range(param.dim())))


class SumReducer:
    """Collects local partial sums and sums each over the groups of its mesh dims, batched.

    ``add`` returns an index; ``run`` returns the summed tensors in the order they were added
    (the same shapes). Every rank of a group must add the same sequence of statistics; that
    holds because all ranks step the same parameters in the same order and a statistic's shape
    depends only on the mesh coordinates that are fixed inside the groups it is summed over.
    """

    def __init__(self) -> None:
        self._items: list[tuple[tuple | None, Tensor]] = []

    def add(self, partial: Tensor, layout: Layout, mesh_dims: tuple[int, ...]) -> int:
        key = None
        if layout.mesh is not None and mesh_dims:
            key = (layout.mesh, tuple(sorted(mesh_dims)), partial.dtype, partial.device)
        self._items.append((key, partial))
        return len(self._items) - 1

    def run(self) -> list[Tensor]:
        out = [t for _, t in self._items]
        buckets: dict[tuple, list[int]] = {}
        for i, (key, _) in enumerate(self._items):
            if key is not None:
                buckets.setdefault(key, []).append(i)
        for (mesh, mesh_dims, _, _), idxs in buckets.items():
            flat = torch.cat([out[i].reshape(-1) for i in idxs])
            if flat.numel() == 0:  # every rank of the group sees the same sizes: all skip
                continue
            for mesh_dim in mesh_dims:
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=mesh.get_group(mesh_dim))
            offset = 0
            for i in idxs:
                n = out[i].numel()
                out[i] = flat[offset:offset + n].view(out[i].shape)
                offset += n
        self._items = []
        return out


def check_float(name: str, value: Any, *, low: float | None = None, high: float | None = None,
                low_open: bool = False, high_open: bool = False) -> float:
    """``value`` as a float within [low, high] (open ends when asked), else ValueError echoing it."""
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number or a 1-element tensor, got shape {tuple(value.shape)}")
        value = value.item()
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    bad = v != v  # NaN
    if low is not None:
        bad |= v <= low if low_open else v < low
    if high is not None:
        bad |= v >= high if high_open else v > high
    if bad:
        lo = "" if low is None else ("(" if low_open else "[") + f"{low}"
        hi = "" if high is None else f"{high}" + (")" if high_open else "]")
        raise ValueError(f"{name} must be in {lo or '(-inf'}, {hi or 'inf)'}, got {value!r}")
    return v


def closure_loss(closure) -> Any:
    """``closure()`` with gradients enabled (``Optimizer.step``'s contract), or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def grads_of(group: dict, name: str, *, reject_complex: bool = False, upcast: bool = False):
    """``(p, layout, local p, local gradient)`` for each parameter of ``group`` with a gradient;
    the gradient negated under ``maximize`` and, with ``upcast``, a 2-byte one in fp32."""
    for p in group["params"]:
        if p.grad is None:
            continue
        if reject_complex and torch.is_complex(p):
            raise RuntimeError(f"{name} does not support complex parameters")
        if p.grad.is_sparse:
            raise RuntimeError(f"{name} does not support sparse gradients")
        g = local(p.grad)
        if upcast and g.dtype in (torch.float16, torch.bfloat16):
            g = g.float()
        if group["maximize"]:
            g = -g
        yield p, layout_of(p), local(p), g


def check_betas(betas) -> tuple[float, float]:
    """Adam's ``(beta1, beta2)``, each in [0, 1), as a tuple."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair, got {betas!r}")
    for i, b in enumerate(betas):
        check_float(f"betas[{i}]", b, low=0.0, high=1.0, high_open=True)
    return tuple(betas)
