"""The collectives of sharded chunks: all-gather a payload, reduce-scatter a gradient.

A sharded chunk's shard ``k`` (``Chunk.shard_index``) nests its ``dp_axes`` in mesh order: the
padded buffer is cut in ``sizes[0]`` blocks over the first axis, each of those in ``sizes[1]``
over the second, and so on. So gathering runs the axes innermost first (the last axis assembles
this rank's first-axis block, the first axis the whole buffer) and reduce-scattering outermost
first, one collective per axis on that axis's process group (``ProcessMesh.group``): a process
group per axis is all the mesh has, and every rank of a chunk's data-parallel group issues the
same collectives in the same order (the callers guarantee it: same chunks, same access order).

Gradient contributions come partial over some of the ``dp_axes`` (the bucketer's axes: the
parameter was read whole but computed on a batch shard) or complete (every device computed
the whole gradient, or it was already all-reduced in the graph). Over a partial axis the block is
reduce-scattered; over an axis the gradient is complete on, the rank just keeps its own block.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from autopar.runtime.dist_ops import all_gather_single, blocking, reduce_scatter_single

__all__ = ["gather_into", "scatter_sum", "check_same_chunks"]


def gather_into(out: torch.Tensor, shard: torch.Tensor, chunk, pmesh) -> None:
    """All of ``chunk``'s shards, ``shard`` being this rank's, into ``out`` (``work_elems``)."""
    block = shard
    for depth in reversed(range(len(chunk.dp_axes))):
        axis, size = chunk.dp_axes[depth], chunk.dp_sizes[depth]
        dest = out if depth == 0 else torch.empty(block.numel() * size, dtype=block.dtype, device=block.device)
        blocking(all_gather_single, dest, block.contiguous(), group=pmesh.group(axis))
        block = dest
    if not chunk.dp_axes:
        out.copy_(shard)


def scatter_sum(full: torch.Tensor, partial_axes: tuple[int, ...], chunk, pmesh) -> torch.Tensor:
    """This rank's shard of ``full`` (a whole local gradient buffer, ``work_elems``) summed over
    ``partial_axes`` (a subset of ``chunk.dp_axes``)."""
    if not set(partial_axes) <= set(chunk.dp_axes):
        raise RuntimeError(f"gemini: a gradient of chunk {chunk.index} is partial over mesh axes {partial_axes}, "
                           f"outside the axes its parameters are replicated on {chunk.dp_axes}")
    block = full
    for axis, size, coord in zip(chunk.dp_axes, chunk.dp_sizes, chunk.dp_coords):
        n = block.numel() // size
        if axis in partial_axes:
            dest = torch.empty(n, dtype=block.dtype, device=block.device)
            blocking(reduce_scatter_single, dest, block, group=pmesh.group(axis))
            block = dest
        else:
            block = block[coord * n:(coord + 1) * n]
    return block


def check_same_chunks(chunks) -> None:
    """Every rank must lay out the same chunks (sizes, sharding, axes): sharded chunks gather and
    scatter on use, and which uses fetch depends on the byte counts; a difference (a plan that
    splits a dimension unevenly) would leave collectives unmatched."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = [(c.capacity, str(c.dtype), c.dp_axes, c.sharded, c.home, c.optim_tier) for c in chunks]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    for rank, theirs in enumerate(every):
        if theirs != mine:
            diff = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            raise ValueError(f"gemini: shard_param_frac needs the same chunks on every rank; rank {rank} differs "
                             f"from rank {dist.get_rank()} at chunk {diff} ({len(theirs)} vs {len(mine)} chunks): "
                             f"a plan that shards a dimension unevenly gives ranks different local sizes")
