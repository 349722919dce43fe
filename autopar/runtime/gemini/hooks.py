"""Where the chunk manager meets the emitted graph: forward access spans and backward unpacking.

``instrument(module, manager)`` rewrites the module's graph: each parameter of a chunk is read
through ``gemini_use`` (fetch + pin, returns the device-tier view) placed before its first
reader, and ``gemini_release`` (unpin) placed after the last node that reads it or any alias of
it (view ops, and -- conservatively -- every call that is not a plain ATen op, such as the
gradient-bucket identity or a collective). ``gemini_use``'s backward hands the parameter's
gradient to the manager's gradient chunks (``grads``). ``forward_hooks`` returns the saved-tensor hooks the
module's forward runs under (``manager`` module docstring).

Recompute regions (``runtime.recompute``: a ``CheckpointRegion`` call whose body re-runs in
backward) are read like any op: the parameters they take are fetched and pinned around the call.
torch's checkpoint saves a region's inputs -- views of the chunks' device buffers -- under the
module's saved-tensor hooks, so re-running the region in backward first unpacks them, which
fetches the chunks pinned at the call (``SavedHooks``); but the body's own saved tensors are
torch's (its hooks are innermost), and the chunks they view must stay on the device until the
region's backward is done with them, not until the next group switch. ``gate_regions`` puts a
``gemini_regather`` after each body input that may view a chunked parameter: in the first
forward an identity; when the body re-runs inside backward it pins the streamed chunk the input
views (the same storage: the view reads valid data again), and its backward -- which runs once
every op of the region that read the input has had its backward -- unpins it. Pins still held
at the end of backward (an input whose gradient never flows) are dropped then. A region call
aliases its inputs only if its body returns a view of one (``_region_aliases``), so a
parameter's forward span ends with the region call, not with the last reader of its outputs.
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.fx as fx

from autopar.tracer.graph import may_alias

__all__ = ["instrument", "gate_regions", "gemini_use", "gemini_release", "gemini_regather", "SavedHooks"]

_MANAGERS: dict[int, "weakref.ReferenceType"] = {}
_KEYS = itertools.count()


def register(manager) -> int:
    key = next(_KEYS)
    _MANAGERS[key] = weakref.ref(manager)
    return key


def _manager(key: int):
    manager = _MANAGERS[key]()
    assert manager is not None, "gemini: the chunk manager of this module was garbage-collected"
    return manager


class _Use(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, key: int, name: str) -> torch.Tensor:
        ctx.key, ctx.name = key, name
        ctx.set_materialize_grads(False)
        manager = _manager(key)
        chunk = manager.chunk_of[name]
        manager.access(chunk)
        return chunk.view(chunk.device_buf, name).view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        # The parameter's whole local gradient of this pass goes into its gradient chunk (none
        # comes here when the bucketer takes it); nothing flows on to ``.grad`` by autograd.
        grads = _manager(ctx.key).grads
        if grad is not None:
            grads.arrive(ctx.name, grad)
        grads.done(ctx.name)  # called even without a gradient: every contribution is in now
        return None, None, None


def gemini_use(x: torch.Tensor, *, key: int, name: str) -> torch.Tensor:
    return _Use.apply(x, key, name)


def gemini_release(*_after, key: int, name: str) -> None:
    manager = _manager(key)
    manager.release(manager.chunk_of[name])


class _Regather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, key: int, names: tuple[str, ...], gate: int) -> torch.Tensor:
        ctx.key, ctx.gate = key, gate
        ctx.set_materialize_grads(False)
        if torch._C._current_graph_task_id() != -1:  # the region's body re-runs inside backward
            _manager(key).recompute_access(gate, x, names)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        # Every reader of the input inside the region has had its backward: unpin what the
        # recomputation fetched for them.
        _manager(ctx.key).recompute_release(ctx.gate)
        return grad, None, None, None


def gemini_regather(x: torch.Tensor, *, key: int, names: tuple[str, ...], gate: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        return x
    if not (torch.is_grad_enabled() and x.requires_grad):  # no backward: nothing would unpin it
        if torch._C._current_graph_task_id() != -1:
            _manager(key).recompute_access(gate, x, names)  # dropped at the end of backward
        return x
    return _Regather.apply(x, key, names, gate)


def _aliases(node: fx.Node, graph_module: fx.GraphModule | None = None) -> bool:
    """May ``node``'s output alias its inputs? (views; any non-ATen call, conservatively --
    but a recompute region only if its body returns a view of an input)"""
    if node.op == "call_module":
        module = None if graph_module is None else graph_module.get_submodule(node.target)
        return _region_aliases(module.body) if _is_region(module) else True
    return may_alias(node)


def _is_region(module) -> bool:
    from autopar.runtime.recompute import CheckpointRegion

    return isinstance(module, CheckpointRegion)


def _region_aliases(body: fx.GraphModule) -> bool:
    """Does a recompute region's body return (a view of) one of its inputs?"""
    frontier = [n for n in body.graph.nodes if n.op == "placeholder"]
    seen = set(frontier)
    while frontier:
        for u in frontier.pop().users:
            if u.op == "output":
                return True
            if u not in seen and _aliases(u, body):
                seen.add(u)
                frontier.append(u)
    return False


def instrument(graph_module: fx.GraphModule, names: set[str], key: int) -> int:
    """Wrap the readers of parameter placeholders ``names`` in use/release, and gate the inputs
    of recompute regions that may view them (``gate_regions``); returns how many parameters."""
    graph = graph_module.graph
    position = {n: i for i, n in enumerate(graph.nodes)}
    done = 0
    spans: dict[fx.Node, set[str]] = {}  # node -> the parameters it may be a view of
    for ph in [n for n in graph.nodes if n.op == "placeholder" and n.name in names]:
        users = sorted(ph.users, key=position.__getitem__)
        if not users:
            continue
        with graph.inserting_before(users[0]):
            use = graph.call_function(gemini_use, (ph,), {"key": key, "name": ph.name})
        ph.replace_all_uses_with(use, delete_user_cb=lambda u: u is not use)
        # The span: every reader of the value or of anything that may alias it.
        last, frontier, seen = users[0], [use], {use}
        while frontier:
            node = frontier.pop()
            for u in node.users:
                if u.op == "output":
                    raise ValueError(f"gemini: parameter {ph.name!r} (or a view of it) is a graph output; "
                                     f"its chunk could not be released")
                if position.get(u, -1) > position[last]:
                    last = u
                if u not in seen and _aliases(u, graph_module):
                    seen.add(u)
                    frontier.append(u)
        for node in seen:
            spans.setdefault(node, set()).add(ph.name)
        with graph.inserting_after(last):
            graph.call_function(gemini_release, (last,), {"key": key, "name": ph.name})
        done += 1
    graph.lint()
    graph_module.recompile()
    gate_regions(graph_module, spans, key)
    return done


def gate_regions(graph_module: fx.GraphModule, spans: dict[fx.Node, set[str]], key: int) -> int:
    """In every recompute region called by ``graph_module``, a ``gemini_regather`` after each
    body input that may view a chunked parameter (``spans``: node -> those parameters'
    names); returns how many."""
    done = 0
    for node in list(graph_module.graph.nodes):
        if node.op != "call_module" or not _is_region(graph_module.get_submodule(node.target)):
            continue
        body = graph_module.get_submodule(node.target).body
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        for arg, ph in zip(node.args, placeholders):
            names = tuple(sorted(spans.get(arg, ()))) if isinstance(arg, fx.Node) else ()
            if not names:
                continue
            with body.graph.inserting_after(placeholders[-1]):
                gate = body.graph.call_function(gemini_regather, (ph,),
                                                {"key": key, "names": names, "gate": next(_KEYS)})
            ph.replace_all_uses_with(gate, delete_user_cb=lambda u: u is not gate)
            done += 1
        body.graph.lint()
        body.recompile()
    return done


class _Saved:
    __slots__ = ("tensor", "group")

    def __init__(self, tensor: torch.Tensor, group: frozenset) -> None:
        self.tensor, self.group = tensor, group


class SavedHooks:
    """pack/unpack for ``torch.autograd.graph.saved_tensors_hooks`` over ``manager``'s chunks."""

    def __init__(self, manager) -> None:
        self.manager = manager
        self._queued = False

    def _chunk_at(self, ptr: int):
        for c in self.manager.chunks:
            if c.streamed and c.resident and c.device_buf.untyped_storage().data_ptr() == ptr:
                return c
        return None

    def pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        chunk = self._chunk_at(storage.data_ptr())
        if chunk is None:
            self.manager.saved[storage.data_ptr()] = storage.nbytes()
            return t
        group = frozenset(c.index for c in self.manager.chunks if c.pins > 0) | {chunk.index}
        return _Saved(t, group)

    def unpack(self, obj):
        if not isinstance(obj, _Saved):
            return obj
        manager = self.manager
        if obj.group != manager.backward_group:
            self._switch(obj.group)
        return obj.tensor

    def _switch(self, group: frozenset) -> None:
        """The saved tensors of one backward node were all packed during one forward op, so
        under one group: the previous group is done with when another one is unpacked."""
        manager = self.manager
        old = manager.backward_group
        for i in sorted(old - group):
            manager.release(manager.chunks[i])
        for i in sorted(group - old):
            manager.access(manager.chunks[i])
        manager.backward_group = group
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _release_group(self) -> None:
        manager = self.manager
        for i in manager.backward_group:
            manager.release(manager.chunks[i])
        manager.backward_group = frozenset()

    def _end_backward(self) -> None:
        self._queued = False
        self._release_group()
