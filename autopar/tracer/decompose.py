"""Decompose chosen ops of a traced graph into the ATen ops PyTorch implements them with.

``decompose_graph(gm, decompose_if)`` replaces every ``call_function`` node whose ATen overload
satisfies ``decompose_if`` by the ops of its decomposition, in place, and repeats on the new
nodes until nothing changes (a few rounds: decompositions nest). The predicate comes from the
caller -- the planner passes "has no sharding rule but a decomposition" -- so the tracer does not
need to know about rules (layers import downward only).

Where a decomposition comes from: the op's CompositeImplicitAutograd kernel (what eager autograd
runs anyway: ``group_norm``, ``instance_norm``, ``bilinear``, ``type_as`` ...), else PyTorch's
decomposition table (``torch._decomp``: ``glu``, ``native_group_norm``, ``mse_loss`` ...). The
pieces are captured with ``make_fx`` on the node's own fake values, so every new node carries
``meta["val"]``, and inherits the module path and stack of the node it replaces; the pieces
run under autograd at training time like any other op, so gradients are PyTorch's own.

A decomposition that cannot be captured (data-dependent, creates tensor constants, or fails)
leaves the node as it was: the planner then reports it as it would have.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autopar.tracer.meta_keys import DECOMPOSED_KEY, MODULE_KEY

__all__ = ["decompose_graph", "DECOMPOSED_KEY"]

_MAX_ROUNDS = 6
_COPIED_META = (MODULE_KEY, "nn_module_stack", "stack_trace", "source_fn_stack", "seq_nr")


def decompose_graph(gm: fx.GraphModule, decompose_if: Callable[[Any], bool]) -> dict[str, tuple[str, ...]]:
    """Decompose the nodes whose target satisfies ``decompose_if``; returns, per decomposed op
    name, the distinct op names it became (for coverage reports). ``gm`` is changed in place."""
    record: dict[str, set[str]] = {}
    for _ in range(_MAX_ROUNDS):
        changed = False
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
                continue
            if not decompose_if(node.target):
                continue
            pieces = _decompose_node(gm.graph, node)
            if pieces is None:
                continue
            origin = node.meta.get(DECOMPOSED_KEY) or str(node.target)
            record.setdefault(origin, set()).update(pieces)
            changed = True
        if not changed:
            break
    if record:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return {op: tuple(sorted(ops)) for op, ops in record.items()}


def _decomposition(target: torch._ops.OpOverload) -> Callable | None:
    from torch._decomp import decomposition_table

    if torch._C._dispatch_has_kernel_for_dispatch_key(target.name(), "CompositeImplicitAutograd"):
        return target.decompose
    return decomposition_table.get(target)


def _decompose_node(graph: fx.Graph, node: fx.Node) -> set[str] | None:
    fn = _decomposition(node.target)
    if fn is None:
        return None
    if isinstance(node.meta.get("val"), (list, tuple)) and any(
            u.op != "call_function" or u.target is not operator.getitem for u in node.users):
        return None  # a consumer takes the whole tuple: keep the op whole
    sub = _capture(fn, node)
    if sub is None:
        return None
    return _inline(graph, node, sub)


def _capture(fn: Callable, node: fx.Node) -> fx.GraphModule | None:
    """``fn(*node.args, **node.kwargs)`` as a graph of ATen ops over the node's fake inputs."""
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx

    flat, spec = pytree.tree_flatten((node.args, node.kwargs))
    positions = [i for i, a in enumerate(flat) if isinstance(a, fx.Node)]
    values = [flat[i].meta.get("val") for i in positions]
    if not all(isinstance(v, torch.Tensor) for v in values):
        return None  # a SymInt or non-tensor node argument: keep the op whole

    def body(*tensors):
        filled = list(flat)
        for i, t in zip(positions, tensors):
            filled[i] = t
        args, kwargs = pytree.tree_unflatten(filled, spec)
        return fn(*args, **kwargs)

    fake_mode = detect_fake_mode(values)
    try:
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            # functionalize: decompositions may write in place (``sigmoid_``), the graph may not
            sub = make_fx(torch.func.functionalize(body, remove="mutations"), tracing_mode="real")(*values)
    except Exception:  # noqa: BLE001 - an uncapturable decomposition keeps the op whole
        return None
    if not all(_trainable_piece(n) for n in sub.graph.nodes if n.op == "call_function"):
        return None
    if any(n.op == "get_attr" for n in sub.graph.nodes):
        return None  # it creates tensor constants: they would not be graph inputs
    if any(n.op == "call_function" and n.target is node.target for n in sub.graph.nodes):
        return None  # it calls itself: no progress
    out = next(n for n in sub.graph.nodes if n.op == "output")
    if not all(isinstance(a, fx.Node) for a in pytree.tree_leaves(out.args[0])):
        return None  # an output that is not a tensor node (a Python number): keep the op whole
    _keep_contiguous(sub, node)
    return sub


def _keep_contiguous(sub: fx.GraphModule, node: fx.Node) -> None:
    """An output that the op returns contiguous is contiguous in its decomposition too.

    A decomposition may return another layout than the op's kernel: ``repeat``'s expands and
    clones, and the clone keeps the permuted strides of its input (WavLM's relative position
    bias, ``embedding(...).permute(2, 0, 1).unsqueeze(0).repeat(...)``), where the kernel returns
    a contiguous tensor. The graph's next ``view`` was traced against the kernel's layout and
    fails on the decomposition's, at profiling and on every rank. A contiguous copy restores
    what the traced graph assumed (``clone`` has an identity rule)."""
    out = next(n for n in sub.graph.nodes if n.op == "output")
    pieces, spec = pytree.tree_flatten(out.args[0])
    wanted = pytree.tree_leaves(node.meta.get("val"))
    if len(wanted) != len(pieces):
        return
    changed = False
    for i, (piece, want) in enumerate(zip(pieces, wanted)):
        got = piece.meta.get("val")
        if not (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)):
            continue
        if want.is_contiguous() and not got.is_contiguous():
            with sub.graph.inserting_before(out):
                copy = sub.graph.call_function(torch.ops.aten.clone.default, (piece,),
                                               {"memory_format": torch.contiguous_format})
            copy.meta["val"] = got.clone(memory_format=torch.contiguous_format)
            pieces[i], changed = copy, True
    if changed:
        out.args = (pytree.tree_unflatten(pieces, spec),)
        sub.graph.lint()
        sub.recompile()


def _trainable_piece(node: fx.Node) -> bool:
    """An ATen op that autograd can differentiate and that writes nothing (``prims`` ops of
    reference decompositions have no autograd formula; a functionalized graph has no writes)."""
    if node.target is operator.getitem:
        return True
    target = node.target
    return (isinstance(target, torch._ops.OpOverload) and target.namespace == "aten"
            and not target._schema.is_mutable)


def _inline(graph: fx.Graph, node: fx.Node, sub: fx.GraphModule) -> set[str]:
    inputs = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, fx.Node)]
    env: dict[fx.Node, Any] = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    for ph, arg in zip(placeholders, inputs):
        env[ph] = arg
    origin = node.meta.get(DECOMPOSED_KEY) or str(node.target)
    ops: set[str] = set()
    result: Any = None
    with graph.inserting_before(node):
        for sn in sub.graph.nodes:
            if sn.op == "placeholder":
                continue
            if sn.op == "output":
                result = pytree.tree_map(lambda a: env[a] if isinstance(a, fx.Node) else a, sn.args[0])
                continue
            new = graph.node_copy(sn, lambda a: env[a])
            for key in _COPIED_META:
                if key in node.meta:
                    new.meta[key] = node.meta[key]
            new.meta[DECOMPOSED_KEY] = origin
            env[sn] = new
            if new.op == "call_function":
                ops.add(str(new.target) if isinstance(new.target, torch._ops.OpOverload)
                        else getattr(new.target, "__name__", str(new.target)))
    _replace_uses(graph, node, result)
    return ops


def _replace_uses(graph: fx.Graph, node: fx.Node, result: Any) -> None:
    """Point the users of ``node`` (or of its ``getitem`` elements) at the decomposition."""
    if isinstance(result, (list, tuple)):  # every user is a getitem (checked before capture)
        for user in list(node.users):
            user.replace_all_uses_with(result[user.args[1]])
            graph.erase_node(user)
    else:
        node.replace_all_uses_with(result)
    graph.erase_node(node)
