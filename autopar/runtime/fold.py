"""Values the emitted graph computes from nothing a step passes in, computed once when it is built.

A traced transformer builds its attention mask from ``arange``s of the (static) sequence and
batch sizes every step: some forty small ops (GPT-2's causal mask, position ids, the
packed-sequence check) whose result depends on no input, parameter or buffer.
``fold_constants(gm)`` evaluates every such node once, on this rank, and replaces those that a
step still reads by a ``get_attr`` of the value (``self._autopar_folded.<name>``: a plain
attribute, in no state dict and not among the module's buffers); the nodes that computed them
are erased.

A node folds when all of its inputs fold and it is a deterministic op without side effect: an
ATen op not tagged ``nondeterministic_seeded`` that writes none of its arguments, a ``getitem``
of one, or a custom kernel of such an op that reads no tensor (``arange_shard``: this rank's
rows of a batch index). A gradient all-reduce (identity forward) of such a value folds with it:
no gradient reaches a constant, so no rank issues its collective. Placeholders (inputs,
parameters, buffers), lifted constants (``get_attr``), other collectives (every rank keeps
issuing the same ones), random draws and recompute regions never fold. A folded value larger
than ``FOLD_MAX_BYTES`` is left computed each step (memory held for the whole step is not worth
a few microseconds): what it reads then stays folded instead.

An attention call whose folded mask is, value for value, the causal one then runs with
``is_causal=True`` and no mask, as the eager model does -- and, under grouped-query attention,
on the key/value heads themselves (``enable_gqa=True``) instead of ``repeat_kv``'s copies, as
the eager model does without a mask: ``_causal_attention`` applies
``tracer.attention_form.folded_args``, the one rewrite the profile prices too, here and inside
recompute regions' bodies.
"""

from __future__ import annotations

import operator
import warnings
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from autopar.runtime.nodes import GradAllReduce, KernelCall
from autopar.runtime.passes import TRACED_NAME_KEY
from autopar.tracer.attention_form import FOLD_MAX_BYTES, attention_args, folded_args, pure_op

__all__ = ["FOLD_MAX_BYTES", "fold_constants", "traced_ndim"]

HOLDER = "_autopar_folded"
aten = torch.ops.aten


def fold_constants(gm: fx.GraphModule, *, ndim_of: Callable[[fx.Node], int | None] | None = None
                   ) -> dict[str, torch.Tensor]:
    """Fold ``gm``'s input-independent nodes in place (module docstring); returns the kept
    values by attribute name. ``ndim_of(node)``: the rank of a node's value where known (the
    traced graph's), which the grouped-attention rewrite checks; without it that rewrite is off."""
    graph = gm.graph
    foldable: set[fx.Node] = set()
    for node in graph.nodes:
        if _deterministic(node, gm) and all(dep in foldable for dep in node.all_input_nodes):
            foldable.add(node)
    if not foldable:
        return {}
    env: dict[fx.Node, Any] = {}
    with torch.no_grad():
        for node in graph.nodes:
            if node in foldable:
                env[node] = _run(node, env, gm)
    while True:  # the values a step still reads; the too large ones are computed each step instead
        kept = [n for n in foldable if any(u not in foldable for u in n.users)]
        # A graph output is handed to the caller, who may write it: never a kept constant.
        large = {n for n in kept if _nbytes(env[n]) > FOLD_MAX_BYTES or not _storable(env[n])
                 or any(u.op == "output" for u in n.users)}
        if not large:
            break
        foldable -= _descendants(large)
    holder = gm.get_submodule(HOLDER) if hasattr(gm, HOLDER) else None
    if kept and holder is None:
        holder = nn.Module()
        gm.add_submodule(HOLDER, holder)
    values = {}
    for node in kept:
        name = node.name
        # A plain attribute, not a buffer: no state dict entry, not one of the module's buffers.
        object.__setattr__(holder, name, env[node])
        values[name] = env[node]
        with graph.inserting_before(node), warnings.catch_warnings():
            # fx warns of a get_attr that is no parameter, buffer or module: a plain attribute, as meant.
            warnings.filterwarnings("ignore", message="Attempted to insert a get_attr Node")
            attr = graph.get_attr(f"{HOLDER}.{name}")
        node.replace_all_uses_with(attr, delete_user_cb=lambda user: user not in foldable)
    for node in reversed(list(graph.nodes)):
        if node in foldable and not node.users:
            graph.erase_node(node)
    _regions_causal(gm, values, ndim_of)
    for name in _causal_attention(graph, values, ndim_of):
        delattr(holder, name)
        del values[name]
    graph.lint()
    gm.recompile()
    return values


def traced_ndim(traced, node: fx.Node) -> int | None:
    """The rank of the traced value an emitted node computes (a local piece has the same), if
    known: ``fold_constants``'s ``ndim_of`` for a graph emitted from ``traced``."""
    name = node.meta.get(TRACED_NAME_KEY)
    try:
        val = traced.node(name).meta.get("val") if name else None
    except KeyError:
        return None
    return val.dim() if isinstance(val, torch.Tensor) else None


def _folded_name(mask: Any) -> str | None:
    """The kept value's name when ``mask`` reads a folded value, else None."""
    if isinstance(mask, fx.Node) and mask.op == "get_attr" and mask.target.startswith(f"{HOLDER}."):
        return mask.target.split(".", 1)[1]
    return None


def _regions_causal(gm: fx.GraphModule, values: dict[str, torch.Tensor],
                    ndim_of: Callable[[fx.Node], int | None] | None) -> None:
    """``_causal_attention`` inside recompute regions (``runtime.recompute``: a sub-graph ``body``
    called with the outer values, the folded mask among them): the recomputed attention runs in
    the same form as the rest -- the form the profile prices it in (``tracer.attention_form``)."""
    for node in gm.graph.nodes:
        body = getattr(gm.get_submodule(node.target), "body", None) if node.op == "call_module" else None
        if not isinstance(body, fx.GraphModule):
            continue
        inner = [n for n in body.graph.nodes if n.op == "placeholder"]
        folded = {p: _folded_name(a) for p, a in zip(inner, node.args)}
        _causal_attention(body.graph, values, ndim_of, folded={p: n for p, n in folded.items() if n})
        body.graph.lint()
        body.recompile()


def _causal_attention(graph: fx.Graph, values: dict[str, torch.Tensor],
                      ndim_of: Callable[[fx.Node], int | None] | None,
                      folded: dict[fx.Node, str] | None = None) -> list[str]:
    """Attention whose folded mask is exactly the causal one runs causal, without the mask, and
    grouped on the key/value heads where it repeats them: ``tracer.attention_form.folded_args``,
    the rewrite the profile prices. ``folded``: a region body's placeholders that receive a
    folded value (by name); its masks are never erased. Returns the masks no longer read."""
    dropped = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.scaled_dot_product_attention.default:
            continue
        args = attention_args(node)
        mask = args.get("attn_mask")
        name = folded.get(mask) if folded is not None else _folded_name(mask)
        form = folded_args(args, values[name], ndim_of) if name is not None else None
        if form is None:
            continue
        node.args, node.kwargs = (), form[0]
        for n in form[1]:  # reshape, expand, unsqueeze: erased once nothing reads them
            if not n.users:
                graph.erase_node(n)
        if folded is None and not mask.users:
            graph.erase_node(mask)
            dropped.append(name)
    return dropped


def _deterministic(node: fx.Node, gm: fx.GraphModule) -> bool:
    if node.op == "call_function":
        return node.target is operator.getitem or pure_op(node.target)
    if node.op == "call_module":
        # A kernel reading no tensor (``arange_shard``): its value depends on this rank's
        # coordinate only. Collectives never fold: ranks must keep issuing the same ones -- but
        # a gradient all-reduce is the identity forward, and reading only folded values (a float
        # mask the emitter guards as it would any replicated value a sharded op reads) it gets
        # no gradient, so it issues none on any rank.
        module = gm.get_submodule(node.target)
        if isinstance(module, GradAllReduce):
            return True  # folds when its input does (``fold_constants``)
        return isinstance(module, KernelCall) and not node.all_input_nodes and pure_op(module.ctx.info.target)
    return False


def _run(node: fx.Node, env: dict[fx.Node, Any], gm: fx.GraphModule) -> Any:
    args = pytree.tree_map_only(fx.Node, env.__getitem__, node.args)
    kwargs = pytree.tree_map_only(fx.Node, env.__getitem__, node.kwargs)
    if node.op == "call_module":
        return gm.get_submodule(node.target)(*args, **kwargs)
    return node.target(*args, **kwargs)


def _storable(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not value.requires_grad


def _nbytes(value: Any) -> int:
    if not isinstance(value, torch.Tensor):
        return 0
    return value.untyped_storage().nbytes()


def _descendants(nodes: set[fx.Node]) -> set[fx.Node]:
    out, stack = set(nodes), list(nodes)
    while stack:
        for user in stack.pop().users:
            if user not in out:
                out.add(user)
                stack.append(user)
    return out
