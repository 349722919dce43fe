"""Which parameters' partial gradients the bucketer sums, and which a sharded chunk reduce-scatters.

The emitted graph sends a parameter whose gradient is partial (data parallelism) through the
gradient bucketer (``self.grad_bucket(w, axes=..., slot=k)``), which all-reduces it into
``.grad``. A sharded chunk wants the partial gradient itself, to reduce-scatter it into its shard
(``grads``). ``GradSync.install`` turns every bucket node into ``gemini_grad_sync(w, key=...,
slot=k, axes=...)``, which decides at each forward: the parameter's chunk is sharded -> an
identity whose backward hands the partial gradient to the chunk (a ZeRO-2 chunk's too: the
plan's ZeRO-2 slots, which the bucketer would reduce-scatter into pieces, come here) (``grads.arrive`` with its
partial axes); otherwise -> the bucketer, as before. The bucketer is rebuilt with only the
slots of unsharded chunks (``rebuild``, after every change of which chunks are sharded), so its
buckets complete and overlap backward as they did, and no zeros are all-reduced for slots that
no longer come.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.runtime.bucketing import GradBucketer
from autopar.runtime.gemini.hooks import _manager

__all__ = ["GradSync", "gemini_grad_sync"]


class _Partial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, key: int, name: str, axes: tuple[int, ...]) -> torch.Tensor:
        ctx.key, ctx.name, ctx.axes = key, name, axes
        ctx.set_materialize_grads(False)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        if grad is not None:
            _manager(ctx.key).grads.arrive(ctx.name, grad, ctx.axes)
        return None, None, None, None


def gemini_grad_sync(x: torch.Tensor, *, key: int, slot: int, axes: tuple[int, ...]) -> torch.Tensor:
    sync = _manager(key).gradsync
    name = sync.slots[slot].name
    if sync.manager.chunk_of[name].scatters:
        if not (torch.is_grad_enabled() and x.requires_grad):
            return x
        pmesh = sync.manager.pmesh
        return _Partial.apply(x, key, name, tuple(a for a in axes if pmesh.axis_size(a) > 1))
    return sync.bucketer(x, axes=axes, slot=sync.slot_map[slot])


class GradSync:
    """The bucket nodes of ``graph_module`` re-routed per chunk (module docstring)."""

    def __init__(self, manager, graph_module: fx.GraphModule) -> None:
        self.manager = manager
        self.graph_module = graph_module
        self.attr = next((name for name, m in graph_module.named_modules() if isinstance(m, GradBucketer)), None)
        self.original = None if self.attr is None else graph_module.get_submodule(self.attr)
        self.slots = [] if self.original is None else list(self.original.slots)
        self.bucketer = self.original
        self.slot_map: dict[int, int] = {}

    def install(self, key: int) -> int:
        """Bucket nodes -> ``gemini_grad_sync`` nodes; returns how many."""
        if self.original is None:
            return 0
        graph = self.graph_module.graph
        done = 0
        for node in list(graph.nodes):
            if node.op == "call_module" and node.target == self.attr:
                with graph.inserting_before(node):
                    new = graph.call_function(gemini_grad_sync, node.args,
                                              {"key": key, "slot": node.kwargs["slot"], "axes": node.kwargs["axes"]})
                node.replace_all_uses_with(new)
                graph.erase_node(node)
                done += 1
        graph.lint()
        self.graph_module.recompile()
        self.rebuild()
        return done

    def rebuild(self) -> None:
        """A bucketer over the slots of unsharded chunks only, delivering into the gradient chunks."""
        if self.original is None:
            return
        sharded = {s.name for c in self.manager.chunks if c.scatters for s in c.slots}
        new = GradBucketer(self.original.pmesh, self.original.cap_bytes, self.original.first_cap_bytes)
        self.slot_map = {k: new.add_slot(s.name, s.axes, s.shape, s.dtype) for k, s in enumerate(self.slots)
                         if s.name not in sharded}
        new.deliver_to(self.manager.grads.target)
        parent, _, leaf = self.attr.rpartition(".")
        setattr(self.graph_module.get_submodule(parent) if parent else self.graph_module, leaf, new)
        self.bucketer = new
