"""Remove in-place writes to activations: every op of the traced graph becomes a pure function.

Why: the planner gives each value one layout and the runtime converts a value to the layout its
consumer reads. An in-place write through a view (``k = x.new_empty(...); k[..., :8] = a`` is
``empty``, ``slice``, ``copy_``) changes the storage of the BASE value; once a conversion sits
anywhere on the alias chain (the slice read in another layout, or ``copy_``'s target converted),
the write lands in a converted copy and the base -- read later by attention -- keeps its old
(uninitialised) contents: silently wrong values and gradients (DeepSeek-V3's attention under a
tight budget). Recompute regions are hit the same way: a region that writes into a value made
outside it writes twice. With no mutation left, any layout and any recompute region are exact.

``functionalize_activations(gm)`` rewrites, in graph order, every op that writes an activation
(``copy_``, ``index_put_``, ``scatter_``, ``div_``, ``relu_`` ...; parameters and buffers -- batch
norm's running statistics -- keep their writes, which the runtime applies to their shards):

* the written value is resolved to its BASE (the first producer that is not a view) and the
  chain of view ops from the base to it (``slice``, ``select``, ``view``, ``transpose`` ...);
* the chain is replayed on the base's current version, the write becomes its out-of-place op
  (``copy_`` -> ``copy``, ``index_put_`` -> ``index_put``), and the result is scattered back up
  the chain (``slice_scatter``, ``select_scatter``, or the inverse view): the base's new version;
* every later read of the base or of any alias of it (a view taken before the write, or the
  write's own result) reads the same chain replayed on the version current at that read.

An uninitialised base written through views (``empty``, ``empty_like``, ``new_empty``) becomes
its zero-filled twin, so every value of the graph is deterministic (and comparable in
``verify``). A write through a view this pass cannot invert (``expand``, ``as_strided``)
raises ``TraceError`` naming the node: refusing beats a silently wrong plan.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx as fx

from autopar.tracer.errors import TraceError
from autopar.tracer.meta_keys import MODULE_KEY

__all__ = ["functionalize_activations"]

aten = torch.ops.aten
_COPIED_META = (MODULE_KEY, "nn_module_stack", "stack_trace", "source_fn_stack", "seq_nr")
# Uninitialised factories and the zero-filled op that replaces each (same arguments).
_ZEROED = {aten.empty.memory_format: aten.zeros.default, aten.empty_like.default: aten.zeros_like.default,
           aten.new_empty.default: aten.new_zeros.default}


# Views that only regroup the same elements in the same order: the inverse is a reshape back.
_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.view_as.default,
             aten.reshape_as.default, aten.flatten.using_ints, aten.unflatten.int, aten.squeeze.dim, aten.squeeze.dims,
             aten.squeeze.default, aten.unsqueeze.default, aten.alias.default, aten.detach.default)


def _written_slot(node: fx.Node) -> int | None:
    """The positional index of the argument ``node`` writes in place, or None."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    for k, a in enumerate(node.target._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            return k if not a.kwarg_only else None
    return None


# Conversions whose schema says "may alias": they do only when nothing changes.
_CONVERSIONS = (aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.to.other)


def _converts(node: fx.Node) -> bool:
    """A conversion that made a new tensor: another dtype, device or layout, or ``copy=True``
    (Informer's ``cumsum(dtype=float32).to(float64)``, then written in place: the write stays in
    the copy)."""
    src, out = node.args[0].meta.get("val"), node.meta.get("val")
    if not (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor)):
        return True  # unknown: not a view, as torch's own functionalization would not assume one
    names = [a.name for a in node.target._schema.arguments]
    at = names.index("copy")
    copy = node.args[at] if len(node.args) > at else node.kwargs.get("copy", False)
    return (src.dtype != out.dtype or src.device != out.device or src.stride() != out.stride()
            or bool(copy))


def _is_view(node: fx.Node) -> bool:
    """An op whose output aliases its first input (a view), or a getitem of a view list."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        src = node.args[0]
        return isinstance(src, fx.Node) and _is_view(src)
    if not isinstance(node.target, torch._ops.OpOverload) or _written_slot(node) is not None:
        return False
    if node.target in _CONVERSIONS and _converts(node):
        return False
    schema = node.target._schema
    args, rets = schema.arguments, schema.returns
    return bool(args and rets and args[0].alias_info is not None and rets[0].alias_info is not None)


class _Rewriter:
    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm, self.graph = gm, gm.graph
        self.version: dict[fx.Node, fx.Node] = {}  # written base -> its current value
        self.replays: dict[tuple[fx.Node, fx.Node], fx.Node] = {}  # (alias, base version) -> replay
        self.writers: list[fx.Node] = []

    # ------------------------------------------------------------------ aliases
    def resolve(self, value: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
        """(base, view chain from the base to ``value``); a writer stands for what it writes."""
        chain: list[fx.Node] = []
        while True:
            slot = _written_slot(value)
            if slot is not None:
                value = value.args[slot]
            elif _is_view(value):
                chain.append(value)
                value = value.args[0].args[0] if value.target is operator.getitem else value.args[0]
            else:
                return value, chain[::-1]

    def current(self, alias: fx.Node, before: fx.Node) -> fx.Node:
        """``alias`` as it reads at ``before``: its chain replayed on its base's current version."""
        base, chain = self.resolve(alias)
        version = self.version.get(base)
        if version is None:
            return alias if _written_slot(alias) is None else self.current(alias.args[_written_slot(alias)], before)
        key = (alias, version)
        if key not in self.replays:
            value = version
            for view in chain:
                value = self._replay(view, value, before)
            self.replays[key] = value
        return self.replays[key]

    def _replay(self, view: fx.Node, source: fx.Node, before: fx.Node) -> fx.Node:
        if view.target is operator.getitem:  # an element of a view list (split, chunk, unbind)
            whole = self._emit(view.args[0].target, (source, *view.args[0].args[1:]), view.args[0].kwargs,
                               before, view.args[0])
            return self._emit(operator.getitem, (whole, view.args[1]), {}, before, view)
        return self._emit(view.target, (source, *view.args[1:]), view.kwargs, before, view)

    # ------------------------------------------------------------------ writes
    def write(self, writer: fx.Node) -> None:
        slot = _written_slot(writer)
        base, chain = self.resolve(writer.args[slot])
        if base.op == "placeholder":
            return  # a parameter or buffer: the runtime writes its shard (batch-norm statistics)
        functional = _functional_op(writer)
        if functional is None and writer.target != aten.copy_.default:
            if chain:
                raise _cannot(writer, "it writes through a view and has no out-of-place twin")
            # A write straight into the value it returns (``bernoulli_`` on a fresh buffer): every
            # later reader reads the write's own result, so it stays, as the runtime runs it.
            return
        if base.op == "call_function" and base.target in _ZEROED and base not in self.version:
            base = self._zeroed(base)
        views = [self.current(base, writer)]
        for view in chain:
            views.append(self._replay(view, views[-1], writer))
        args = [self._read(a, writer) for a in writer.args]
        args[slot] = views[-1]
        kwargs = {k: self._read(v, writer) for k, v in writer.kwargs.items()}
        if writer.target == aten.copy_.default:
            new = self._copied(views[-1], args[1], writer)
        else:
            new = self._emit(functional, tuple(args), kwargs, writer, writer)
        for view, parent in zip(reversed(chain), reversed(views[:-1])):
            new = self._scatter(view, parent, new, writer)
        self.version[base] = new
        self.writers.append(writer)

    def _copied(self, dst: fx.Node, src: fx.Node, writer: fx.Node) -> fx.Node:
        """What ``dst.copy_(src)`` leaves in ``dst``: ``src`` cast and broadcast to it (``aten.copy``
        itself has no derivative)."""
        want, have = dst.meta["val"], src.meta["val"]
        value = src
        if have.dtype != want.dtype:
            value = self._emit(aten.to.dtype, (value, want.dtype), {}, writer, writer)
        if tuple(have.shape) != tuple(want.shape):
            value = self._emit(aten.expand.default, (value, list(want.shape)), {}, writer, writer)
        return value

    def _zeroed(self, base: fx.Node) -> fx.Node:
        """An uninitialised base written through views: its zero-filled twin from now on."""
        with self.graph.inserting_after(base):
            zeros = self.graph.call_function(_ZEROED[base.target], base.args, dict(base.kwargs))
        _copy_meta(zeros, base)
        zeros.meta["val"] = base.meta.get("val")
        base.replace_all_uses_with(zeros, delete_user_cb=lambda u: u is not zeros)
        return zeros

    def _scatter(self, view: fx.Node, parent: fx.Node, value: fx.Node, before: fx.Node) -> fx.Node:
        """``parent`` with the part ``view`` selects replaced by ``value``."""
        target, args = view.target, view.args
        if target is operator.getitem:
            return self._scatter_piece(view, parent, value, before)
        if target == aten.slice.Tensor:
            dim, start, end, step = (list(args[1:]) + [0, None, None, 1][len(args) - 1:])[:4]
            return self._emit(aten.slice_scatter.default, (parent, value, dim, start, end, step), {}, before, view)
        if target == aten.select.int:
            return self._emit(aten.select_scatter.default, (parent, value, args[1], args[2]), {}, before, view)
        if target in _CONVERSIONS:  # one that aliases (``_is_view``): the same tensor
            return value
        if target in _RESHAPES:
            shape = list(parent.meta["val"].shape)
            return self._emit(aten.reshape.default, (value, shape), {}, before, view)
        if target == aten.transpose.int:
            return self._emit(aten.transpose.int, (value, args[1], args[2]), {}, before, view)
        if target == aten.t.default:
            return self._emit(aten.t.default, (value,), {}, before, view)
        if target == aten.permute.default:
            dims = list(args[1])
            inverse = [dims.index(d) for d in range(len(dims))]
            return self._emit(aten.permute.default, (value, inverse), {}, before, view)
        raise _cannot(before, f"it writes through view {view.name!r} ({target}), which cannot be inverted")

    def _scatter_piece(self, view: fx.Node, parent: fx.Node, value: fx.Node, before: fx.Node) -> fx.Node:
        """An element of ``split``/``chunk``/``split_with_sizes`` along one dim: a slice of it."""
        whole, k = view.args
        vals = whole.meta.get("val")
        if whole.target not in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default) \
                or not isinstance(vals, (list, tuple)):
            raise _cannot(before, f"it writes through {whole.name!r} ({whole.target}), which cannot be inverted")
        dim = whole.args[2] if len(whole.args) > 2 else whole.kwargs.get("dim", 0)
        dim = dim % vals[0].dim()
        start = sum(int(v.shape[dim]) for v in vals[:k])
        end = start + int(vals[k].shape[dim])
        return self._emit(aten.slice_scatter.default, (parent, value, dim, start, end, 1), {}, before, view)

    # ------------------------------------------------------------------ reads
    def _read(self, arg: Any, before: fx.Node) -> Any:
        if isinstance(arg, fx.Node):
            return self.current(arg, before)
        if isinstance(arg, (list, tuple)):
            return type(arg)(self._read(a, before) for a in arg)
        return arg

    def read(self, node: fx.Node) -> None:
        """Point ``node``'s inputs at the current version of whatever they alias."""
        new_args = self._read(node.args, node)
        new_kwargs = {k: self._read(v, node) for k, v in node.kwargs.items()}
        if new_args != node.args or new_kwargs != node.kwargs:
            node.args, node.kwargs = new_args, new_kwargs

    # ------------------------------------------------------------------ emission
    def _emit(self, target: Callable, args: tuple, kwargs: dict, before: fx.Node, origin: fx.Node) -> fx.Node:
        with self.graph.inserting_before(before):
            node = self.graph.call_function(target, args, kwargs)
        _copy_meta(node, origin)
        node.meta["val"] = _fake_value(target, args, kwargs)
        return node


def _copy_meta(new: fx.Node, origin: fx.Node) -> None:
    for key in _COPIED_META:
        if key in origin.meta:
            new.meta[key] = origin.meta[key]


def _fake_value(target: Callable, args: tuple, kwargs: dict) -> Any:
    from torch._guards import detect_fake_mode

    def val(a: Any) -> Any:
        return a.meta.get("val") if isinstance(a, fx.Node) else a

    args_v = torch.utils._pytree.tree_map(val, args)
    kwargs_v = torch.utils._pytree.tree_map(val, kwargs)
    mode = detect_fake_mode(torch.utils._pytree.tree_leaves((args_v, kwargs_v)))
    if mode is None:
        return target(*args_v, **kwargs_v)
    with mode:
        return target(*args_v, **kwargs_v)


def _functional_op(writer: fx.Node) -> Callable | None:
    """The out-of-place twin of an in-place op (``index_put_.default`` -> ``index_put.default``)."""
    packet = writer.target.overloadpacket.__name__
    name = packet[:-1] if packet.endswith("_") else None
    return getattr(getattr(aten, name, None), writer.target._overloadname, None) if name else None


def _cannot(node: fx.Node, why: str) -> Exception:
    return TraceError(f"cannot trace the in-place write {node.name!r} ({node.target}, module "
                      f"{node.meta.get(MODULE_KEY) or '<top level>'}): {why}",
                      hint="write the value out of place in the model (torch.cat, torch.where, index_put)")


def functionalize_activations(gm: fx.GraphModule) -> int:
    """Rewrite ``gm`` in place (see the module docstring); returns how many writes it removed."""
    # Most graphs write nothing in place: then nothing is rewritten, and tracking every read (a
    # 96-layer GPT-2's 1,900 of them: 0.05 s) is skipped.
    if not any(_written_slot(n) is not None and not _is_view(n) for n in gm.graph.nodes):
        return 0
    rewriter = _Rewriter(gm)
    for node in list(gm.graph.nodes):
        if node.op == "output":
            rewriter.read(node)
        elif node.op == "call_function" and not _is_view(node):
            if _written_slot(node) is not None:
                rewriter.write(node)
            else:
                rewriter.read(node)
    removed = rewriter.writers
    if removed:
        # One pass over the graph drops the views the writes went through, now unread, but for
        # those feeding a later write (kept alive by it): erasing each write, last first, frees
        # them, and they go with it (``_erase_with_dead_inputs``). The same graph as a full
        # ``eliminate_dead_code`` after each write, without a pass over the graph per write (a
        # MoE model writes in place in every block: 56 blocks, 56 passes of 0.2 s each).
        gm.graph.eliminate_dead_code()
        for writer in reversed(removed):  # last first: a view of an earlier write may feed a later one
            _drop_dead_users(gm.graph, writer)
            if writer.users:  # every read was redirected above: a user left is a bug here
                raise RuntimeError(f"functionalize: {writer.name} still has users {list(writer.users)}")
            _erase_with_dead_inputs(gm.graph, writer)
        gm.graph.lint()
        gm.recompile()
    return len(removed)


def _removable(node: fx.Node) -> bool:
    """What ``eliminate_dead_code`` removes: an unread op without side effects."""
    return not node.users and not node.is_impure()  # placeholders and the output are impure


def _drop_dead_users(graph: fx.Graph, node: fx.Node) -> None:
    """Erase the unread pure ops downstream of ``node`` (views of a write no one reads)."""
    for user in list(node.users):
        _drop_dead_users(graph, user)
        if _removable(user):
            _erase_with_dead_inputs(graph, user)


def _erase_with_dead_inputs(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node``, then every op it read that is thereby left unread and pure, transitively."""
    work = [node]
    while work:
        n = work.pop()
        inputs = n.all_input_nodes
        graph.erase_node(n)
        work.extend(i for i in dict.fromkeys(inputs) if _removable(i))
