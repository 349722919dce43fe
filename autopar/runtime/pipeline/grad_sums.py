"""A pipeline stage's data-parallel gradient sums, once per step, in buckets.

``build._defer_gradient_sync`` takes a stage's per-micro-batch gradient all-reduces out of its
graph; the step then sums each parameter's accumulated gradient once, after the last
micro-batch. One collective per parameter paid one latency each (a GPT-2 block's 12 tensors,
~2.4 ms apiece on 2 gloo ranks: 60 ms of a 290 ms step), so the gradients are summed as the flat
plans' are (``runtime.bucketing``): flattened into buckets of the gradient buckets' cap
(``layout.buckets``) per (mesh axes, dtype), every bucket's all-reduce in flight at once, one
axis after another where a stage's sub-mesh cannot form a group spanning several
(``ProcessMesh.group_over``). The planner prices them the same way
(``planner.pipeline.costs.StageCosts``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist

from autopar.layout.buckets import bucket_cap_bytes, split_buckets
from autopar.runtime.dist_ops import wait
from autopar.runtime.process_mesh import ProcessMesh

__all__ = ["DeferredSums"]


@dataclass(frozen=True)
class _Bucket:
    axes: tuple[int, ...]
    names: tuple[str, ...]


class DeferredSums:
    """The deferred sums of ``deferred`` (parameter -> mesh axes) over ``pmesh``, bucketed by
    ``cap_bytes`` (None: ``layout.buckets.bucket_cap_bytes()``; 0: one collective per
    parameter). ``run(leaves)`` sums the gradients of ``leaves`` (name -> local tensor) in place."""

    def __init__(self, deferred: Mapping[str, tuple[int, ...]], leaves: Mapping[str, torch.Tensor], *,
                 pmesh: ProcessMesh, cap_bytes: int | None = None) -> None:
        cap = bucket_cap_bytes() if cap_bytes is None else cap_bytes
        groups: dict[tuple, list[str]] = {}
        # Backward order (the last stage's parameters' gradients are complete first): the
        # graph order reversed, as the flat plans' buckets.
        for name in reversed(list(deferred)):
            axes = tuple(a for a in deferred[name] if pmesh.axis_size(a) > 1)
            if axes:
                groups.setdefault((axes, leaves[name].dtype), []).append(name)
        self.pmesh = pmesh
        self.buckets: list[_Bucket] = []
        for (axes, _), names in groups.items():
            sizes = [leaves[n].numel() * leaves[n].element_size() for n in names]
            for members in split_buckets(sizes, cap=cap, first_cap=0) if cap else [[i] for i in range(len(names))]:
                self.buckets.append(_Bucket(axes, tuple(names[i] for i in members)))

    @torch.no_grad()
    def run(self, leaves: Mapping[str, torch.Tensor]) -> None:
        """Sum every bucket's gradients over its axes, all buckets in flight per axis. A gradient
        that is None is left out (every rank of the stage runs the same graph: all skip it)."""
        pending = []
        for bucket in self.buckets:
            grads = [leaves[n].grad for n in bucket.names if leaves[n].grad is not None]
            if grads:
                # One contiguous gradient is summed in place; anything else through a flat copy
                # (``reshape`` of a non-contiguous one would copy, and the sum would be lost).
                alone = len(grads) == 1 and grads[0].is_contiguous()
                flat = grads[0].view(-1) if alone else torch.cat([g.reshape(-1) for g in grads])
                pending.append((bucket, None if alone else grads, flat))
        chains = [self._groups(b) for b, _, _ in pending]
        for step in range(max(map(len, chains), default=0)):
            works = [dist.all_reduce(flat, group=chain[step], async_op=True)
                     for chain, (_, _, flat) in zip(chains, pending) if step < len(chain)]
            for work in works:
                wait(work)
        for _, grads, flat in pending:
            if grads is not None:
                for g, piece in zip(grads, torch.split(flat, [g.numel() for g in grads])):
                    g.copy_(piece.view_as(g))

    def _groups(self, bucket: _Bucket) -> list:
        """The process groups ``bucket`` is summed over, one after another."""
        return self.pmesh.groups_over(bucket.axes)
