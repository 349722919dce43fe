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
"""

from __future__ import annotations

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
    ``[max(min_elems, largest parameter), max_elems]`` in multiples of ``step``."""
    if step < 1 or min_elems < 1 or max_elems < min_elems:
        raise ValueError(f"chunk search range must satisfy 1 <= min <= max and step >= 1, got "
                         f"min={min_elems}, max={max_elems}, step={step}")
    if not sizes:
        return min_elems, 0
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

    def __post_init__(self) -> None:
        self.names = {s.name: s for s in self.slots}

    @property
    def payload_bytes(self) -> int:
        return self.capacity * torch.empty((), dtype=self.dtype).element_size()

    @property
    def optim_bytes(self) -> int:
        """fp32 master + two moments (the placement policies' estimate; ``state_bytes`` is exact)."""
        return 3 * self.capacity * 4

    def state_bytes(self, home: str, optim: str) -> int:
        """Optimizer-tier bytes with the payload on ``home`` and the state on ``optim``: two fp32
        moments, the fp32 master unless it is the payload itself, the landing buffer when the
        tiers differ."""
        n = self.capacity * 4
        return n * (2 + (0 if self.master_is_payload(home, optim) else 1) + (0 if home == optim else 1))

    def master_is_payload(self, home: str, optim: str) -> bool:
        return home == optim and self.dtype == torch.float32

    @property
    def grad_bytes(self) -> int:
        return self.payload_bytes

    @property
    def resident(self) -> bool:
        return self.device_buf is not None and self.device_buf.untyped_storage().nbytes() > 0

    def view(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        s = self.names[name]
        return buf[s.offset:s.offset + s.numel].view(s.shape)
