"""The micro-batch rule: which inputs a pipeline cuts into micro-batches, shared by planner and runtime.

The planner traces ONE micro-batch (``micro_batch``: the graph every stage is planned on) and the
runtime runs ``num`` of them per step (``split_micro_batches``, and the chunk specs it gives
torch's schedule). Both must cut the same inputs, or the graph run is not the graph planned: an
input cut at run time but traced whole (or the reverse) has another shape than its placeholder.
So there is one rule, here:

- the batch is dim 0 of the first tensor input that has a dim, in the inputs' pytree order (the
  positional tuple's order, or the keyword dict's);
- an input is *batch-major* when it is a tensor with a dim whose dim 0 is that batch; it is cut
  along dim 0 into ``num`` equal micro-batches;
- every other input -- a scalar tensor, a ``(seq,)`` positions tensor, a mask all samples share,
  a non-tensor -- goes WHOLE into every micro-batch (traced whole, run whole).

A tensor whose dim 0 happens to equal the batch is batch-major by this rule whatever it means;
the runtime checks every input against the traced shapes, so a disagreement is an error, never a
silent mis-split.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["batch_size", "is_batch_major", "micro_batch", "split_micro_batches"]


def batch_size(inputs: Any) -> int:
    """Dim 0 of the first tensor input that has a dim (the batch every batch-major input shares)."""
    for leaf in pytree.tree_leaves(inputs):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise ValueError("pipelining splits the batch along dim 0, but the inputs hold no tensor with a batch dim")


def is_batch_major(value: Any, batch: int) -> bool:
    """Whether ``value`` is cut into micro-batches (a tensor whose dim 0 is the batch)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and int(value.shape[0]) == batch


def _checked_batch(inputs: Any, num: int) -> int:
    batch = batch_size(inputs)
    if batch % num:
        raise ValueError(f"microbatches={num} does not divide the batch of {batch}")
    return batch


def micro_batch(inputs: Any, num: int) -> Any:
    """``inputs`` with every batch-major tensor cut to one micro-batch (its first rows), the rest
    whole: what the planner traces."""
    batch = _checked_batch(inputs, num)
    micro = batch // num
    return pytree.tree_map(lambda x: x[:micro] if is_batch_major(x, batch) else x, inputs)


def split_micro_batches(inputs: Any, num: int) -> list[Any]:
    """``inputs`` as ``num`` micro-batches of the same structure: each batch-major tensor cut along
    dim 0 into equal pieces (views), everything else the same object in every micro-batch."""
    batch = _checked_batch(inputs, num)
    leaves, spec = pytree.tree_flatten(inputs)
    pieces = [x.chunk(num) if is_batch_major(x, batch) else None for x in leaves]
    return [pytree.tree_unflatten([p[i] if p is not None else x for x, p in zip(leaves, pieces)], spec)
            for i in range(num)]
