"""Pinned degrees of parallelism (``ParallelismOptions``): strategy filters the builder applies.

A pin keeps, for the ops it concerns, only the strategies that have the asked degree; every other
decision stays the planner's. It is a filter on the op's strategy list (the same list for
identical ops, so repeated blocks stay alike), applied before the problem is built, so the ILP,
recompute, ZeRO and pipelines all see the restricted options.

- ``ep_size=N`` (N > 1): each MoE experts op (``autopar::moe_experts``) splits its experts over
  mesh axes whose sizes multiply to N, and its tokens over the same axes (the all-to-all
  dispatch: ``strategies/_experts.py``). ``ep_size=1``: the experts are never split.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.fx as fx

from autopar.layout.mesh import MeshSpec
from autopar.planner.options import PlanOptions
from autopar.strategies import Strategy

__all__ = ["Pin", "pins_of"]

Pin = Callable[[fx.Node, list[Strategy]], list[Strategy]]


def pins_of(options: PlanOptions, mesh: MeshSpec) -> Pin | None:
    """The strategy filter ``options`` asks for on ``mesh`` (None: nothing pinned)."""
    if options.ep_size is None:
        return None
    ep = options.ep_size
    if ep > 1 and not _has_axes_of_size(mesh.shape, ep):
        raise ValueError(f"ep_size={ep}: no mesh axes of mesh {mesh.shape} multiply to {ep}")
    experts_op = torch.ops.autopar.moe_experts.default

    def pin(node: fx.Node, strategies: list[Strategy]) -> list[Strategy]:
        if node.target is not experts_op:
            return strategies
        kept = [s for s in strategies if _expert_degree(s, mesh) == ep]
        if not kept:
            raise ValueError(f"ep_size={ep}: no strategy of the experts op {node.name!r} splits its experts "
                             f"{ep} ways on mesh {mesh.shape} (the expert count and the tokens must divide "
                             f"over those axes)")
        return kept

    return pin


def _expert_degree(strategy: Strategy, mesh: MeshSpec) -> int:
    """How many ways the strategy splits the experts with their tokens sent to them (1: not split;
    0: split over an axis where the tokens are not, which is no expert parallelism of degree N)."""
    hidden, gate_up = strategy.input_specs[0], strategy.input_specs[3]
    expert_axes = gate_up.shard_axes(0)
    if not set(expert_axes) <= set(hidden.shard_axes(0)):
        return 0
    return math.prod(mesh.shape[a] for a in expert_axes)


def _has_axes_of_size(shape: tuple[int, ...], size: int) -> bool:
    sizes = list(shape)
    return any(math.prod(sizes[i] for i in range(len(sizes)) if mask >> i & 1) == size
               for mask in range(1, 1 << len(sizes)))
