"""The form attention runs in once the runtime has folded its constant mask (``runtime.fold``).

A traced transformer builds its causal mask from ``arange``s every step and reads it in
``scaled_dot_product_attention``; under grouped-query attention it also repeats the key/value
heads (``repeat_kv``: ``x.unsqueeze(2).expand(...).reshape(...)``, a copy). The runtime folds that
mask and, where it is exactly the causal one, runs the attention with ``is_causal=True``, no mask
and -- grouped -- on the key/value heads themselves (``enable_gqa=True``), as the eager model
does. The profile (``tracer.profile``) prices the attention's saved bytes in that same form, or
the planner would count a mask copy and repeated key/value heads that no step holds.

One rewrite serves both: ``folded_args`` (an attention's arguments and its mask's value -> the
arguments it runs with: causal, no mask, grouped where key and value are ``repeated_kv``), which
``runtime.fold`` applies to the graph it emits and the profile, through ``causal_attention`` (the
attention nodes whose mask is input-independent -- ``pure_op`` all the way up -- evaluated once
on real tensors), to the traced graph it prices.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

__all__ = ["FOLD_MAX_BYTES", "attention_args", "causal_attention", "folded_args", "input_independent",
           "is_causal_mask", "pure_op", "repeated_kv"]

# A folded value larger than this is computed each step instead (``runtime.fold``): its mask is
# then read as traced.
FOLD_MAX_BYTES = 4 * 2**20
SDPA = torch.ops.aten.scaled_dot_product_attention.default


def pure_op(target: Any) -> bool:
    """An ATen op that draws no random numbers and writes none of its arguments."""
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded in target.tags:
        return False
    return not any(a.alias_info is not None and a.alias_info.is_write for a in target._schema.arguments)


def input_independent(graph: fx.Graph) -> set[fx.Node]:
    """The traced nodes ``runtime.fold`` may fold: pure ops (and ``getitem``s of them) reading
    only such nodes -- no placeholder (input, parameter, buffer, lifted constant), no attribute."""
    out: set[fx.Node] = set()
    for n in graph.nodes:
        if (n.op == "call_function" and (n.target is operator.getitem or pure_op(n.target))
                and all(dep in out for dep in n.all_input_nodes)):
            out.add(n)
    return out


def is_causal_mask(mask: torch.Tensor) -> bool:
    """Whether ``mask`` (boolean, or additive 0 / -inf) keeps exactly ``j <= i`` in every slice.
    Its last two sizes are then the attention's (query, key) lengths: a mask that broadcasts over
    either (size 1) is never taken for causal."""
    if mask.dim() < 2 or min(mask.shape[-2:]) < 2:
        return False
    rows, cols = mask.shape[-2:]
    keep = torch.ones(rows, cols, dtype=torch.bool, device=mask.device).tril()
    if mask.dtype == torch.bool:
        return bool((mask == keep).all())
    if not mask.dtype.is_floating_point:
        return False
    return bool(((mask == 0) == keep).all() and (mask[..., ~keep] == float("-inf")).all())


def repeated_kv(node: Any, ndim_of: Callable[[fx.Node], int | None]) -> tuple[fx.Node, int, list[fx.Node]] | None:
    """(x, group size, the nodes) when ``node`` is ``x.unsqueeze(2).expand(b, kv, g, s, d)
    .reshape(b, kv * g, s, d)`` of a 4-D ``x``, else None."""
    if not (isinstance(node, fx.Node) and node.target in (torch.ops.aten.reshape.default, torch.ops.aten.view.default)):
        return None
    expand = node.args[0]
    if not (isinstance(expand, fx.Node) and expand.target is torch.ops.aten.expand.default and len(expand.users) == 1):
        return None
    unsqueeze = expand.args[0]
    if not (isinstance(unsqueeze, fx.Node) and unsqueeze.target is torch.ops.aten.unsqueeze.default
            and unsqueeze.args[1] == 2 and len(unsqueeze.users) == 1):
        return None
    x, sizes, shape = unsqueeze.args[0], list(expand.args[1]), list(node.args[1])
    if not (isinstance(x, fx.Node) and ndim_of(x) == 4 and len(sizes) == 5
            and all(isinstance(v, int) for v in sizes + shape)
            and shape == [sizes[0], sizes[1] * sizes[2], sizes[3], sizes[4]]):
        return None
    return x, sizes[2], [node, expand, unsqueeze]


def attention_args(node: fx.Node) -> dict[str, Any]:
    """An attention node's arguments by schema name."""
    return {a.name: v for a, v in zip(node.target._schema.arguments, node.args)} | dict(node.kwargs)


def folded_args(args: dict[str, Any], mask: Any, ndim_of: Callable[[fx.Node], int | None] | None
                ) -> tuple[dict[str, Any], list[fx.Node]] | None:
    """The arguments an attention with arguments ``args`` (by schema name, ``attention_args``)
    runs with once its mask folds to the value ``mask``, and the ``repeat_kv`` nodes it no longer
    reads; None when it keeps its mask (not exactly causal, or already ``is_causal``).

    Causal: ``is_causal=True`` and no mask -- the same values (torch's ``is_causal`` IS that mask,
    top-left aligned), and the CPU and flash kernels skip the masked blocks instead of reading a
    mask, as the eager model runs (transformers passes ``is_causal`` unless traced). Grouped
    (``ndim_of`` given: the traced ranks the pattern checks): ``key`` and ``value`` that are both
    ``repeated_kv`` with one group size become its input with ``enable_gqa=True`` -- no repeated
    copies, and their gradients summed over the group inside the kernel instead of by the
    expand's backward (the same terms; dk/dv within rounding), as the eager model does without
    a mask (transformers' ``use_gqa_in_sdpa``)."""
    if args.get("is_causal", False) or not isinstance(mask, torch.Tensor) or not is_causal_mask(mask):
        return None
    out = dict(args, attn_mask=None, is_causal=True)
    if ndim_of is None or args.get("enable_gqa", False):
        return out, []
    sources = [repeated_kv(args.get(k), ndim_of) for k in ("key", "value")]
    if None in sources or sources[0][1] != sources[1][1]:
        return out, []
    out.update(key=sources[0][0], value=sources[1][0], enable_gqa=True)
    return out, [n for _, _, chain in sources for n in chain]


def causal_attention(graph: fx.Graph) -> dict[str, dict[str, Any]]:
    """Attention node name -> the arguments (``folded_args``, graph nodes) it runs with, for every
    attention of the traced ``graph`` whose mask the runtime folds: a mask computed by pure ops
    from no placeholder, attribute or module (``runtime.fold`` folds those), at most
    ``FOLD_MAX_BYTES``, evaluated here once on real CPU tensors."""
    out: dict[str, dict[str, Any]] = {}
    values: dict[fx.Node, Any] = {}
    free = input_independent(graph)
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not SDPA:
            continue
        args = attention_args(node)
        mask = args.get("attn_mask")
        if args.get("is_causal", False) or not isinstance(mask, fx.Node):
            continue
        form = folded_args(args, _constant(mask, values, free), _traced_ndim)
        if form is not None:
            out[node.name] = form[0]
    return out


def _traced_ndim(node: fx.Node) -> int | None:
    val = node.meta.get("val")
    return val.dim() if isinstance(val, torch.Tensor) else None


def _constant(mask: fx.Node, values: dict[fx.Node, Any], free: set[fx.Node]) -> Any:
    """``mask``'s value when the runtime folds it (in ``free``: input-independent; small enough),
    else None."""
    if mask not in free:  # some ancestor cannot fold: the mask is read as traced
        return None
    seen, stack = set(), [mask]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    order = [n for n in mask.graph.nodes if n in seen and n not in values]
    with torch.no_grad():
        for n in order:
            args, kwargs = pytree.tree_map_only(fx.Node, values.__getitem__, (n.args, n.kwargs))
            args, kwargs = pytree.tree_map(_on_cpu, (args, kwargs))
            values[n] = n.target(*args, **kwargs)
    value = values[mask]
    fits = isinstance(value, torch.Tensor) and value.untyped_storage().nbytes() <= FOLD_MAX_BYTES
    return value if fits else None


def _on_cpu(value: Any) -> Any:
    return torch.device("cpu") if isinstance(value, torch.device) else value
