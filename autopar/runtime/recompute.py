"""Recompute regions of the emitted graph become ``torch.utils.checkpoint`` calls.

``apply_recompute(emitted, regions)`` rewrites the emitted local graph in place: for every
``RecomputeRegion`` of the plan (a contiguous run of traced ops), the emitted nodes from the
layout conversions feeding its first op to its last op (and the ``getitem``s right after it)
move into a sub-``GraphModule``, called through :class:`CheckpointRegion`:

    torch.utils.checkpoint.checkpoint(body, *inputs, use_reentrant=False, preserve_rng_state=True)

so backward re-runs the region's forward (collectives included: every rank recomputes the same
regions in the same order) instead of keeping what its ops saved; only the region's inputs are
held. Non-reentrant checkpointing keeps the autograd graph of the first forward, so backward
hooks on values inside a region (gradient all-reduce / bucketing nodes) still fire once.
Parameter gradient-synchronisation nodes (``grad_all_reduce``/``grad_bucket`` of a parameter)
are left outside regions: they read only parameters and are not worth recomputing.
"""

from __future__ import annotations

import operator
from typing import Any, Iterable

import torch
import torch.fx as fx
from torch.utils.checkpoint import checkpoint

from autopar.runtime.passes import STATE_KEY, TRACED_NAME_KEY
from autopar.strategies import rng

__all__ = ["CheckpointRegion", "apply_recompute", "redrawing"]


class CheckpointRegion(torch.nn.Module):
    """Runs ``body`` under non-reentrant activation checkpointing (RNG state preserved)."""

    def __init__(self, body: fx.GraphModule, name: str) -> None:
        super().__init__()
        self.body = body
        self.region = name

    def forward(self, *args: Any) -> tuple:
        if not torch.is_grad_enabled():
            return self.body(*args)
        return checkpoint(redrawing(self.body), *args, use_reentrant=False, preserve_rng_state=True)

    def extra_repr(self) -> str:
        return f"region={self.region!r}"


def redrawing(body: Any) -> Any:
    """``body`` run inside the draw current NOW (``strategies/rng.py``), whenever it is called:
    the recompute in backward redraws exactly the forward's masks. ``preserve_rng_state`` covers
    torch's generator only, and backward runs after the module call's draw has ended (in a
    pipeline, after other micro-batches' forwards)."""
    draw = rng.current()

    def run(*args: Any) -> Any:
        with rng.drawing(draw):
            return body(*args)

    return run


def _is_grad_sync(node: fx.Node, modules: dict) -> bool:
    """A gradient-synchronisation node of a parameter (it reads only parameters)."""
    from autopar.runtime.nodes import GradAllReduce

    if node.op != "call_module" or not all(a.meta.get(STATE_KEY) for a in node.all_input_nodes):
        return False
    mod = modules.get(node.target)
    return isinstance(mod, GradAllReduce) or type(mod).__name__ == "GradBucketer"


def apply_recompute(graph: fx.Graph, modules: dict[str, torch.nn.Module], regions: Iterable,
                    prefix: str = "recompute") -> list[str]:
    """Wrap each region (``.name``, ``.nodes``: traced op names) of ``graph`` into a
    ``CheckpointRegion`` added to ``modules``; returns the new module names."""
    names = []
    for k, region in enumerate(regions):
        nodes = list(graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        by_name = {n.meta.get(TRACED_NAME_KEY, n.name): n for n in nodes}  # emitted names may differ
        ops = [by_name[x] for x in region.nodes if x in by_name]
        if not ops:
            raise ValueError(f"recompute region {region.name!r}: none of its ops is in the emitted graph")
        lo, hi = min(pos[o] for o in ops), max(pos[o] for o in ops)
        while lo > 0 and nodes[lo - 1].op == "call_module" and not _is_grad_sync(nodes[lo - 1], modules) \
                and not isinstance(modules.get(nodes[lo - 1].target), CheckpointRegion):
            lo -= 1  # the conversions emitted for the first op
        inside = set(nodes[lo:hi + 1])
        while hi + 1 < len(nodes) and nodes[hi + 1].op == "call_function" and nodes[hi + 1].target is operator.getitem \
                and nodes[hi + 1].args[0] in inside:
            hi += 1
            inside.add(nodes[hi])
        members = [n for n in nodes[lo:hi + 1]
                   if n.op not in ("placeholder", "output") and not _is_grad_sync(n, modules)]
        member_set = set(members)
        inputs: list[fx.Node] = []
        for n in members:
            for a in n.all_input_nodes:
                if a not in member_set and a not in inputs:
                    inputs.append(a)
        outputs = [n for n in members if any(u not in member_set for u in n.users)]
        sub = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for a in inputs:
            env[a] = sub.placeholder(a.name)
        for n in members:
            env[n] = sub.node_copy(n, lambda a: env[a])
        sub.output(tuple(env[o] for o in outputs))
        root = {n.target: modules[n.target] for n in members if n.op in ("call_module", "get_attr")
                and n.target in modules}
        body = fx.GraphModule(root, sub, class_name="RecomputeRegion")
        name = f"{prefix}_{k}"
        while name in modules:
            name += "_"
        modules[name] = CheckpointRegion(body, region.name)
        last = members[-1]
        with graph.inserting_after(last):
            call = graph.call_module(name, tuple(inputs))
        with graph.inserting_after(call):
            outs = []
            for i, o in enumerate(outputs):
                g = graph.call_function(operator.getitem, (call, i))
                g.meta.update(o.meta)
                outs.append(g)
        for o, g in zip(outputs, outs):
            o.replace_all_uses_with(g, delete_user_cb=lambda user: user not in member_set)
        for n in reversed(members):
            graph.erase_node(n)
        names.append(name)
    graph.lint()
    return names
