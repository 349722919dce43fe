"""A kernel's sum over ranks issued early: ``EarlySumCall`` and the pass that hoists it.

A mean loss divides by a denominator summed over the data-parallel ranks (the number of
targets not ignored: it differs per rank as soon as one rank holds more ignored labels). Summed
inside the loss kernel, that all-reduce is a meeting point at the end of forward: each rank
waits there for the slowest one, and for a round trip through the communication thread. The
denominator reads only the labels, which exist from the start of forward, so a kernel declares
it as an ``autopar.strategies.registry.EarlySum`` and the emitted graph computes it apart:

    early = self.cross_entropy_early(labels_local, None, -100)     # issued, not waited on
    ...                                                            # the whole forward
    loss = self.cross_entropy(logits, labels_local, None, 1, -100, 0.0, early)

``EarlySumCall`` computes this rank's summand and all-reduces it asynchronously, over several
mesh axes on the group spanning them (``ProcessMesh.groups_over``; where the mesh forms none, a
stage's sub-mesh, blocking on every axis but the last); the result is a
``runtime.pending.PendingTensor`` that the kernel's call waits for (``KernelCall``: the kernel
computes on the plain value). ``hoist_early_sums`` then moves each such node, and the
side-effect-free ops computing its inputs from the graph's inputs, to right after what they
read, so the all-reduce is in flight during the forward. The sum, its summand and its value
are the ones the kernel would compute itself (the same collective on the same buffer), only
waited on later.

The pass runs after recompute regions are cut (``build_module``), so it never moves a node out
of or into a checkpointed region: an input produced inside a region keeps its consumers after it.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from autopar.runtime.kernels import all_reduce_axes
from autopar.runtime.nodes import Collective
from autopar.runtime.pending import Inflight, all_reduce_pending
from autopar.runtime.process_mesh import ProcessMesh
from autopar.strategies.kernel_context import KernelContext
from autopar.strategies.registry import EarlySum

__all__ = ["EarlySumCall", "hoist_early_sums"]


class EarlySumCall(nn.Module):
    """One kernel call's ``EarlySum``: this rank's summand, summed over ``axes`` (see the module
    docstring); the result is waited on at its first read."""

    def __init__(self, kernel: str, early: EarlySum, ctx: KernelContext, axes: tuple[int, ...],
                 pmesh: ProcessMesh) -> None:
        super().__init__()
        self.kernel, self.early, self.ctx, self.axes, self.pmesh = kernel, early, ctx, tuple(axes), pmesh
        self.inflight = Inflight()

    def forward(self, *values: Any) -> torch.Tensor:
        part = self.early.summand(self.ctx, **dict(zip(self.early.reads, values)))
        if not isinstance(part, torch.Tensor):
            raise ValueError(f"the early sum of kernel {self.kernel!r} (node {self.ctx.info.node_name}) "
                             f"returned {type(part).__name__}, not a tensor")
        part = part.detach()
        wide = [a for a in self.axes if self.pmesh.axis_size(a) > 1]
        if len(wide) > 1 and len(groups := self.pmesh.groups_over(wide)) == 1:  # one group spans them
            return all_reduce_pending(part, groups[0], self.inflight)
        *first, last = self.axes
        if first:  # no group spans them (a stage's sub-mesh): all but the last axis block
            part = all_reduce_axes(part, first, self.pmesh)
        return all_reduce_pending(part, self.pmesh.group(last), self.inflight)

    def extra_repr(self) -> str:
        return f"{self.kernel} for node {self.ctx.info.node_name}, axes={self.axes}"


def hoist_early_sums(graph: fx.Graph, modules: dict[str, nn.Module]) -> int:
    """Move every ``EarlySumCall`` node, and the movable ops computing its inputs, to right after
    what they read (the graph's placeholders for a loss's labels). Returns how many nodes moved."""
    moved = 0
    for node in [n for n in graph.nodes if n.op == "call_module" and isinstance(modules.get(n.target), EarlySumCall)]:
        moved += _hoist(graph, node, modules)
    if moved:
        graph.lint()
    return moved


def _hoist(graph: fx.Graph, node: fx.Node, modules: dict[str, nn.Module]) -> int:
    ancestors: set[fx.Node] = set()
    stack = [node]
    while stack:
        for dep in stack.pop().all_input_nodes:
            if dep not in ancestors:
                ancestors.add(dep)
                stack.append(dep)
    moved = 0
    pos = {n: i for i, n in enumerate(graph.nodes)}
    for n in sorted(ancestors | {node}, key=pos.__getitem__):
        if n.op == "placeholder" or not (n is node or _movable(n, modules)):
            continue  # stays: whatever reads it stays after it (deps are placed first, below)
        deps = n.all_input_nodes
        if deps:
            anchor = max(deps, key=pos.__getitem__)
        else:  # reads nothing: right after the placeholders
            anchor = next((m.prev for m in graph.nodes if m.op != "placeholder"), None)
            if anchor is None or anchor.op == "root":
                continue
        if pos[anchor] + 1 < pos[n]:
            anchor.append(n)
            moved += 1
            pos = {m: i for i, m in enumerate(graph.nodes)}
    return moved


def _movable(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    """Whether ``node`` may run earlier than emitted: no side effect, no random draw, no
    communication (moving one collective would still keep every rank's order alike, but it is
    never needed to read the labels)."""
    if node.op == "get_attr":
        return True
    if node.op == "call_module":
        module = modules.get(node.target)
        return isinstance(module, Collective) and module.kind == "split"  # a local slice of a replicated value
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    if not isinstance(node.target, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded in node.target.tags:
        return False
    return not any(a.alias_info is not None and a.alias_info.is_write for a in node.target._schema.arguments)
