"""The ranks agree on what they draw: a module whose graph draws random numbers is built only when
every rank holds the same autopar seed and step (``autopar/strategies/rng.py``).

Mesh-invariant draws make every rank draw the numbers of its own elements, but only from the seed
and step the rank holds: a script that seeds each rank differently (``torch.manual_seed(rank)``
for its data order, before autopar's seed was first read) would have replicas of one value draw
different masks -- silently. So the build all-gathers (seed, step) and, on any difference, every
rank raises (ranks agree or all fail; docs/architecture.md).
"""

from __future__ import annotations

import torch.distributed as dist

from autopar.strategies import rng

__all__ = ["check_ranks_draw_alike"]


def check_ranks_draw_alike(graph) -> None:
    """Raise ``ValueError`` on every rank unless all ranks hold the same (seed, step); a no-op for
    a graph that draws nothing or a single process."""
    if not rng.graph_draws(graph) or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = rng.state()
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, mine)
    if any(s != mine for s in seen):
        table = ", ".join(f"rank {r}: seed {s[0]} step {s[1]}" for r, s in enumerate(seen))
        raise ValueError(f"the ranks would draw different random numbers ({table}): call "
                         f"autopar.manual_seed(seed) with the same seed on every rank before building")
