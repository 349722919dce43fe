"""``count_collectives()``: the torch.distributed collectives this process issues, counted.

Every collective the runtime issues goes through ``record(kind, nbytes)`` just before it is
started: layout conversions (``runtime.collectives``), the in-graph gradient all-reduce and the
kernels' reductions (``runtime.kernels``), gradient buckets (``runtime.bucketing``) and ZeRO's
batched gathers and reduce-scatters (``runtime.zero.comm``). Tests compare what a step issued
with what the plan priced; a collective on a mesh axis of size 1 is not issued and not counted.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Iterator

__all__ = ["COLLECTIVE_KINDS", "CollectiveCounts", "count_collectives", "record"]

# send_recv: one ring step of a kernel (``Comm.shift``: a send and a receive of the same bytes).
COLLECTIVE_KINDS = ("all_gather", "all_to_all", "all_reduce", "reduce_scatter", "send_recv")


class CollectiveCounts(Counter):
    """Collectives issued, by kind; ``bytes[kind]``: the bytes of the tensors they were given
    (an all-gather's and a reduce-scatter's full output / input, an all-reduce's tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: Counter = Counter()


_active: list[CollectiveCounts] = []


@contextmanager
def count_collectives() -> Iterator[CollectiveCounts]:
    """Count the collectives this process issues inside the block; nested blocks all see each."""
    counts = CollectiveCounts()
    _active.append(counts)
    try:
        yield counts
    finally:
        # By identity: two counters with equal counts compare equal, so list.remove could drop
        # the wrong one.
        del _active[next(i for i, c in enumerate(_active) if c is counts)]


def record(kind: str, nbytes: int = 0) -> None:
    assert kind in COLLECTIVE_KINDS, kind
    for counts in _active:
        counts[kind] += 1
        counts.bytes[kind] += int(nbytes)
