"""Chunks: parameters (each rank's LOCAL shards) packed into flat buffers, and the chunk-size search.

A chunk holds a run of parameters in plan order, each at an element offset of one flat buffer of
``capacity`` elements (the rest is padding). Like Gemini's ``search_chunk_configuration``, the
chunk size is searched over a range for the least padding: every candidate size (a multiple of
``step`` elements, at least the largest parameter) packs the parameters greedily in order, and
the size that wastes the fewest elements wins (ties: the smaller, so more chunks can move
independently).

Per chunk (``Chunk``):
- the parameter payload in the parameters' dtype: ``device_buf`` on the device tier, and for a
  chunk whose home is the host tier, ``host_buf`` (pinned on CUDA) that holds it at rest;
  ``device_buf``'s storage is then resized to 0 when the chunk is not resident, and back when it
  is fetched -- the same storage object, so tensors autograd saved from it read valid data again
  once the chunk is back (the trick Gemini and FSDP use);
- the fp32 master copy and the two AdamW moments on the optimizer tier (``optim_tier``); the
  master IS the payload buffer when both are fp32 on one tier (no second copy), and a chunk
  whose two tiers differ keeps an fp32 gradient landing buffer (``landing``) on the optimizer
  tier, where ``step`` copies the gradients to update them;
- ``grad``: the gradient chunk (the parameters' dtype) on the payload's tier, allocated when the
  first of its gradients arrives in backward (``grads``); the parameters' ``.grad`` are views of it;
- a state: ``COMPUTE`` (an op is using it: never evicted), ``HOLD`` (resident, evictable),
  ``FREE`` (not resident on the device tier).

Sharded chunks (``sharded``, static policy's ``shard_param_frac``; ZeRO-3 style): the chunk's
parameters are replicated by the plan over ``dp_axes`` (the mesh axes of size > 1 on which every
one of its parameters is ``Replicate``: the same set the bucketer sums their partial gradients
over, or a subset of it). Each rank of that group keeps ONE shard of ``shard_elems`` elements
(``capacity`` padded to a multiple of ``num_shards``): the payload at rest (``shard_buf``, on the
home tier), the fp32 master, the moments, the landing buffer and the gradient are all shard-sized.
``device_buf`` is then the gathered working copy of ``work_elems`` elements on the device,
resident only between fetch (an all-gather) and eviction, like a host-home chunk's device copy
(``streamed``). Shard ``shard_index`` nests the axes in mesh order: over ``dp_axes[0]`` the
buffer is cut in ``sizes[0]`` blocks, each block over ``dp_axes[1]`` and so on.

ZeRO chunks (``zero`` 1 or 2: the plan's per-parameter ZeRO stage, planned policy): the payload
stays whole on its home tier (every op reads it as usual), but the fp32 master, the moments and
the landing buffer are this rank's shard over ``dp_axes`` (``state_elems``), and under stage 2
the gradient at rest is too (``grad_elems``; reduce-scattered into it like a sharded chunk's).
The optimizer updates this rank's shard of the master and the payload is all-gathered from the
updated shards after the step (ZeRO-Offload when the optimizer tier is the host).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = ["COMPUTE", "HOLD", "FREE", "DEVICE", "HOST", "Slot", "Chunk", "search_chunk_size", "pack"]

COMPUTE, HOLD, FREE = "compute", "hold", "free"
DEVICE, HOST = "device", "host"


@dataclass(frozen=True, slots=True)
class Slot:
    """One parameter inside a chunk."""

    name: str  # placeholder name of the parameter in the traced graph
    offset: int  # first element within the chunk
    numel: int
    shape: tuple[int, ...]


def pack(sizes: list[int], capacity: int) -> list[list[int]]:
    """Greedy in-order packing of parameters of ``sizes`` elements into chunks of ``capacity``
    elements: indices per chunk. A parameter never straddles two chunks."""
    if sizes and max(sizes) > capacity:
        raise ValueError(f"chunk capacity {capacity} elements is below the largest parameter ({max(sizes)})")
    chunks: list[list[int]] = []
    used = capacity
    for i, n in enumerate(sizes):
        if used + n > capacity:
            chunks.append([])
            used = 0
        chunks[-1].append(i)
        used += n
    return chunks


def search_chunk_size(sizes: list[int], *, min_elems: int, max_elems: int, step: int) -> tuple[int, int]:
    """(chunk capacity in elements, padding elements) with the least padding over the range
    ``[max(min_elems, largest parameter), max_elems]`` in multiples of ``step``. Parameters that
    all fit under ``min_elems`` together go into one chunk of their total size (Gemini's rule: a
    minimum larger than the model is not padding to allocate)."""
    if step < 1 or min_elems < 1 or max_elems < min_elems:
        raise ValueError(f"chunk search range must satisfy 1 <= min <= max and step >= 1, got "
                         f"min={min_elems}, max={max_elems}, step={step}")
    if not sizes:
        return min_elems, 0
    if sum(sizes) <= min_elems:
        return sum(sizes), 0
    largest = max(sizes)
    start = max(min_elems, largest)
    start = -(-start // step) * step
    best: tuple[int, int] | None = None
    capacity = start
    while capacity <= max(max_elems, start):
        waste = len(pack(sizes, capacity)) * capacity - sum(sizes)
        if best is None or waste < best[1]:
            best = (capacity, waste)
        capacity += step
    assert best is not None
    return best


@dataclass(eq=False)
class Chunk:
    index: int
    slots: list[Slot]
    capacity: int  # elements
    dtype: torch.dtype
    home: str = DEVICE  # where the parameter payload lives at rest
    optim_tier: str = DEVICE  # where the fp32 master and optimizer state live
    state: str = FREE
    device_buf: torch.Tensor | None = None
    host_buf: torch.Tensor | None = None
    master: torch.Tensor | None = None
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None
    grad: torch.Tensor | None = None  # the gradient chunk, on the payload's home tier
    landing: torch.Tensor | None = None  # fp32 gradients on the optimizer tier when it is not home
    pins: int = 0  # ops currently using it (COMPUTE while > 0)
    group: tuple | None = None  # planned (payload tier, optimizer tier), if the planner chose
    synced_version: int = -1  # the payload's ``_version`` when the master last matched it
    names: dict[str, Slot] = field(default_factory=dict)
    dp_axes: tuple[int, ...] = ()  # mesh axes (size > 1) replicating every parameter of the chunk
    dp_sizes: tuple[int, ...] = ()
    dp_coords: tuple[int, ...] = ()  # this rank's coordinate on each of them
    sharded: bool = False
    shard_buf: torch.Tensor | None = None  # a sharded chunk's payload shard at rest, on ``home``
    acc: dict = field(default_factory=dict)  # sharded: partial axes -> full local gradient in backward
    grad_names: set = field(default_factory=set)  # sharded: parameters whose gradient is in ``grad``
    zero: int = 0  # ZeRO stage of an unsharded chunk's optimizer state (1, 2) over ``dp_axes``; 0: none

    def __post_init__(self) -> None:
        self.names = {s.name: s for s in self.slots}

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def num_shards(self) -> int:
        return math.prod(self.dp_sizes)

    @property
    def shard_index(self) -> int:
        index = 0
        for coord, size in zip(self.dp_coords, self.dp_sizes):
            index = index * size + coord
        return index

    @property
    def shard_elems(self) -> int:
        return -(-self.capacity // self.num_shards)

    @property
    def elems(self) -> int:
        """Elements of the payload at rest and of each optimizer-side buffer."""
        return self.shard_elems if self.sharded else self.capacity

    @property
    def state_elems(self) -> int:
        """Elements of the fp32 master, each moment and the landing buffer."""
        return self.shard_elems if self.sharded or self.zero else self.capacity

    @property
    def grad_elems(self) -> int:
        """Elements of the gradient chunk at rest."""
        return self.shard_elems if self.scatters else self.capacity

    @property
    def scatters(self) -> bool:
        """Is the gradient reduce-scattered into a shard (sharded, or ZeRO-2)?"""
        return self.sharded or self.zero == 2

    @property
    def padded_elems(self) -> int:
        """Elements of a whole buffer cut into ``num_shards`` equal shards (gathers, scatters)."""
        return self.shard_elems * self.num_shards

    @property
    def padded_bytes(self) -> int:
        return self.padded_elems * self.itemsize

    @property
    def work_elems(self) -> int:
        """Elements of the device working copy (``device_buf``)."""
        return self.padded_elems if self.sharded else self.capacity

    @property
    def streamed(self) -> bool:
        """Is ``device_buf`` a copy fetched on use and evicted (host home, or a sharded chunk)?"""
        return self.home == "host" or self.sharded

    @property
    def payload_bytes(self) -> int:
        """Bytes of the payload at rest (a shard of it when sharded)."""
        return self.elems * self.itemsize

    @property
    def full_bytes(self) -> int:
        """Bytes of the whole payload (what the policies' fractions count)."""
        return self.capacity * self.itemsize

    @property
    def work_bytes(self) -> int:
        return self.work_elems * self.itemsize

    @property
    def optim_bytes(self) -> int:
        """fp32 master + two moments (the placement policies' estimate; ``state_bytes`` is exact)."""
        return 3 * self.state_elems * 4

    def state_bytes(self, home: str, optim: str) -> int:
        """Optimizer-tier bytes with the payload on ``home`` and the state on ``optim``: two fp32
        moments, the fp32 master unless it is the payload itself, the landing buffer when the
        tiers differ."""
        n = self.state_elems * 4
        return n * (2 + (0 if self.master_is_payload(home, optim) else 1) + (0 if home == optim else 1))

    def master_is_payload(self, home: str, optim: str) -> bool:
        return home == optim and self.dtype == torch.float32 and not self.zero

    @property
    def grad_bytes(self) -> int:
        """The gradient chunk at rest (shard-sized when sharded or ZeRO-2)."""
        return self.grad_elems * self.itemsize

    @property
    def resident(self) -> bool:
        return self.device_buf is not None and self.device_buf.untyped_storage().nbytes() > 0

    def view(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        """Parameter ``name`` within a whole-chunk buffer (the working copy, an unsharded chunk's)."""
        s = self.names[name]
        return buf[s.offset:s.offset + s.numel].view(s.shape)

    def piece(self, name: str) -> tuple[int, int, int, int]:
        """(start, stop) of parameter ``name``'s elements this rank keeps, within the chunk's
        ``state_elems``-sized buffers (master, moments; payload and gradient when they are shards
        too), and (start, stop) of the same elements within the flattened parameter; empty ranges
        when the shard holds none of it."""
        s = self.names[name]
        if not (self.sharded or self.zero):
            return s.offset, s.offset + s.numel, 0, s.numel
        base = self.shard_index * self.shard_elems
        lo, hi = max(s.offset, base), min(s.offset + s.numel, base + self.shard_elems)
        hi = max(lo, hi)
        return lo - base, hi - base, lo - s.offset, hi - s.offset
