"""Mixed precision as a graph pass: the traced fp32 forward rewritten to compute in bf16/fp16.

The policy is what ``model.to(bf16)`` computes, with fp32 master weights:

- every fp32 parameter gets ONE cast node (``aten._to_copy(w, dtype=low)``) just before its first
  use; all its uses read the cast (pipelines: one per reading module, ``param_casts``). The
  planner lays the cast out like any op, so a sharded weight is cast on its shard *before* a
  gather and collectives move 2-byte data. Its backward hands an fp32 gradient to the master
  weight. Float inputs are cast the same way;
- casts that were no-ops in the fp32 trace stand for an explicit upcast (``x.to(torch.float32)``
  before RMSNorm's variance: kept, the region computes in fp32) when they now meet a 2-byte
  value, and for "back to the model's dtype" (``h.to(input_dtype)``: now the compute dtype) when
  they meet a value computed inside such a region; ``_assert_tensor_metadata`` goes;
- ops in ``FP32_OPS`` (losses, log-softmax) compute in fp32: their 2-byte inputs are cast up
  (their outputs stay fp32, e.g. the loss); ops in ``MIXED_OPS`` (batch norm) take a 2-byte
  input with fp32 weights and running statistics, so their weights are not cast;
- any other op that meets both 2-byte and fp32 floating tensors (an fp32 buffer, an fp32 mask or
  ``arange``) gets its fp32 ones cast down, *saturating* (a mask of ``finfo(float32).min`` must
  not turn into ``-inf``). In-place ops are left to
  type promotion (casting ``self`` would write into a copy). Buffers stay fp32 (rotary
  frequencies, running statistics).

Every node's ``meta["val"]`` is recomputed on fake tensors as the pass walks the graph, so the
profile and the planner see the dtypes that will run: activation and transient bytes at the
compute dtype, collectives at the dtype they move.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autopar.tracer.graph import INPUT, PARAMETER, TracedGraph
from autopar.tracer.meta_keys import MODULE_KEY, PARAM_CAST_KEY, PLACEHOLDER_KEY

__all__ = ["PRECISIONS", "FP32_OPS", "compute_dtype", "apply_precision"]

aten = torch.ops.aten

PRECISIONS: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Op packets that compute in fp32 whatever the precision (autocast's fp32 list, the parts of it
# that reach a training graph): losses and log-softmax, for the loss's accuracy.
FP32_OPS = frozenset(getattr(aten, name) for name in (
    "cross_entropy_loss", "nll_loss", "nll_loss_forward", "nll_loss2d", "nll_loss2d_forward",
    "nll_loss_nd", "log_softmax", "_log_softmax", "mse_loss", "l1_loss", "smooth_l1_loss",
    "huber_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div",
    "soft_margin_loss", "margin_ranking_loss", "hinge_embedding_loss", "poisson_nll_loss",
    "cosine_embedding_loss", "multilabel_margin_loss", "multi_margin_loss", "triplet_margin_loss",
    "ctc_loss",
) if hasattr(aten, name))

# Op packets whose kernels take a 2-byte input with fp32 weights and statistics (CPU and cuDNN
# batch norm): the input stays low, everything else is fp32 -- the weights stay the masters
# (no cast) and the running statistics are updated in fp32.
MIXED_OPS = frozenset(getattr(aten, name) for name in (
    "batch_norm", "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
    "_native_batch_norm_legit_no_training", "_batch_norm_with_update", "_batch_norm_with_update_functional",
    "_batch_norm_no_update",
) if hasattr(aten, name))

# Explicit casts of the traced model: ``to(x, dtype)`` keeps its input when nothing changes.
_TO_OPS = frozenset((aten.to.dtype, aten.to.dtype_layout))
_COPY_CASTS = frozenset((aten._to_copy.default,))


def compute_dtype(precision: str) -> torch.dtype:
    """``"fp32" | "bf16" | "fp16"`` -> the torch dtype ops compute in."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    return PRECISIONS[precision]


def apply_precision(traced: TracedGraph, precision: str, *, param_casts: str = "shared") -> TracedGraph:
    """Rewrite ``traced`` (in place) to compute in ``precision``; ``"fp32"`` leaves it as it is.
    ``param_casts``: ``"shared"``, one cast per parameter read by all its users; ``"per_module"``,
    one per module reading it (a tied weight read by the embedding and the LM head gets two: a
    pipeline then casts it on each stage that holds the weight instead of sending the first
    stage's bf16 copy through every stage per micro-batch)."""
    if param_casts not in ("shared", "per_module"):
        raise ValueError(f"param_casts must be 'shared' or 'per_module', got {param_casts!r}")
    low = compute_dtype(precision)
    if low == torch.float32 or traced.precision == precision:
        return traced
    if traced.precision != "fp32":
        raise ValueError(f"{traced.model_name} is already rewritten for {traced.precision}; trace it again "
                         f"for {precision}")
    gm = traced.gm
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = next((v.fake_mode for v in pytree.tree_leaves(vals) if hasattr(v, "fake_mode")), None)
    if fake_mode is None:
        raise ValueError(f"{traced.model_name}: the traced graph has no fake values to re-type")
    with traced.rewriting():
        rewriter = _Rewriter(gm, low, fake_mode, per_module=param_casts == "per_module")
        rewriter.cast_placeholders()
        rewriter.run()
        gm.graph.lint()
        gm.recompile()
    traced.precision = precision
    return traced


class _Rewriter:
    def __init__(self, gm: fx.GraphModule, low: torch.dtype, fake_mode, *, per_module: bool = False) -> None:
        self.gm, self.graph, self.low, self.fake_mode = gm, gm.graph, low, fake_mode
        self.per_module = per_module
        self.param_casts: set[fx.Node] = set()
        self.upcast: set[fx.Node] = set()  # fp32 values computed from an explicit upcast of a 2-byte one
        # Each node's dtype in the fp32 trace (a cast this pass adds: its source's).
        self.traced_dtype: dict[fx.Node, torch.dtype] = {
            n: n.meta["val"].dtype for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)}

    # ------------------------------------------------------------------------- placeholders
    def cast_placeholders(self) -> None:
        """One cast per fp32 parameter and float input, before its first user."""
        order = {n: i for i, n in enumerate(self.graph.nodes)}
        for node in list(self.graph.nodes):
            if node.op != "placeholder" or not node.users:
                continue
            ph = node.meta.get(PLACEHOLDER_KEY)
            val = node.meta.get("val")
            if ph is None or ph.kind not in (PARAMETER, INPUT) or not _is_fp32(val) or _weight_of_mixed_ops(node):
                continue
            users = sorted((u for u in node.users if u.op != "output"), key=order.__getitem__)
            if not users:
                continue  # returned as it is: nothing computes with it
            groups: dict[str, list[fx.Node]] = {}
            for user in users:  # one group, or one per reading module (``per_module``)
                key = user.meta.get(MODULE_KEY, "") if self.per_module and ph.kind == PARAMETER else ""
                groups.setdefault(key, []).append(user)
            for group in groups.values():
                first = group[0]
                with self.graph.inserting_before(first):
                    cast = self.graph.call_function(aten._to_copy.default, (node,), {"dtype": self.low})
                members = set(group)
                node.replace_all_uses_with(cast, delete_user_cb=members.__contains__)
                self.traced_dtype[cast] = torch.float32
                module = ph.fqn.rpartition(".")[0] if ph.kind == PARAMETER else first.meta.get(MODULE_KEY, "")
                cast.meta[MODULE_KEY] = module
                if ph.kind == PARAMETER:
                    cast.meta[PARAM_CAST_KEY] = node.name
                    self.param_casts.add(cast)
                # Placed before ``first`` but after the placeholders: order is recomputed lazily.
                order[cast] = order[first] - 0.5

    # ---------------------------------------------------------------------------- the walk
    def run(self) -> None:
        for node in list(self.graph.nodes):
            if node.op != "call_function":
                continue
            if node.target is aten._assert_tensor_metadata.default:
                self.graph.erase_node(node)  # asserts the fp32 dtype of the trace
                continue
            if self._retype_noop_cast(node):
                continue
            self._harmonise(node)
            node.meta["val"] = self._fake_value(node)
            val = node.meta["val"]
            if _is_fp32(val) and any(a in self.upcast for a in _node_args(node)):
                self.upcast.add(node)  # computed from an explicit upcast: still the fp32 region

    def _retype_noop_cast(self, node: fx.Node) -> bool:
        """A cast that changed nothing in the fp32 trace: ``x.to(torch.float32)`` (an explicit
        upcast for accuracy: RMSNorm's variance, rotary tables) and ``x.to(self.dtype)`` (the
        model's dtype) look alike there. Told apart by what they meet now: a 2-byte input means
        an upcast (kept: the region computes in fp32); an input computed inside such a region
        means the way back (cast to the compute dtype); an fp32 buffer's stays as it is."""
        if node.target not in _TO_OPS | _COPY_CASTS or node in self.param_casts:
            return False
        src = node.args[0] if node.args else None
        before, after = self.traced_dtype.get(src), self.traced_dtype.get(node)
        if before is None or before != after or not after.is_floating_point:
            return False
        now = src.meta["val"].dtype
        if now.itemsize == 2:
            self.upcast.add(node)
        elif src in self.upcast:
            _set_dtype(node, self.low)
        node.meta["val"] = self._fake_value(node)
        return True

    def _harmonise(self, node: fx.Node) -> None:
        if node.target is operator.getitem or not isinstance(node.target, torch._ops.OpOverload):
            return
        if node.target._schema.is_mutable or node.target in _COPY_CASTS:
            return  # in place: type promotion writes into self's dtype
        inputs = [a for a in _node_args(node) if _is_float(a.meta.get("val"))]
        packet = node.target.overloadpacket
        if packet in MIXED_OPS or packet in FP32_OPS:
            # batch norm keeps its 2-byte input (the first argument); the rest compute in fp32
            keep = inputs[0] if packet in MIXED_OPS and inputs and inputs[0] is node.args[0] else None
            for a in inputs:
                if a is not keep and a.meta["val"].dtype.itemsize == 2:
                    node.replace_input_with(a, self._cast(a, torch.float32, before=node, saturate=False))
            return
        has_low = any(a.meta["val"].dtype == self.low for a in inputs)
        for a in inputs:
            val = a.meta["val"]
            if has_low and val.dtype == torch.float32 and val.dim() > 0:
                node.replace_input_with(a, self._cast(a, self.low, before=node, saturate=True))

    # ------------------------------------------------------------------------------ helpers
    def _cast(self, src: fx.Node, dtype: torch.dtype, *, before: fx.Node, saturate: bool) -> fx.Node:
        """``src`` cast to ``dtype``; ``saturate``: what overflows becomes the dtype's largest
        finite value (clamped after the cast, in 2 bytes: NaN stays NaN, and autograd keeps a
        2-byte tensor for the clamp's mask, not the fp32 one)."""
        module = before.meta.get(MODULE_KEY, "")
        with self.graph.inserting_before(before):
            out = cast = self.graph.call_function(aten._to_copy.default, (src,), {"dtype": dtype})
            if saturate:
                info = torch.finfo(dtype)
                out = self.graph.call_function(aten.clamp.default, (cast, info.min, info.max))
        for node in dict.fromkeys((cast, out)):  # in order: the clamp reads the cast
            self.traced_dtype[node] = self.traced_dtype.get(src, dtype)
            node.meta[MODULE_KEY] = module
            node.meta["val"] = self._fake_value(node)
        return out

    def _fake_value(self, node: fx.Node) -> Any:
        def value(a: Any) -> Any:
            if not isinstance(a, fx.Node):
                return a
            if a.op == "get_attr":
                return getattr(self.gm, a.target)
            return a.meta["val"]

        args = pytree.tree_map(value, node.args, is_leaf=lambda x: isinstance(x, fx.Node))
        kwargs = pytree.tree_map(value, node.kwargs, is_leaf=lambda x: isinstance(x, fx.Node))
        with self.fake_mode:
            return node.target(*args, **kwargs)


def _set_dtype(node: fx.Node, dtype: torch.dtype) -> None:
    """Point a ``to``/``_to_copy`` node at ``dtype`` (positional in ``to.dtype``)."""
    if node.target is aten.to.dtype and len(node.args) > 1:
        node.args = (node.args[0], dtype, *node.args[2:])
    else:
        node.kwargs = {**node.kwargs, "dtype": dtype}


def _weight_of_mixed_ops(node: fx.Node) -> bool:
    """Only ``MIXED_OPS`` read ``node``, none as its input tensor (a batch norm weight)."""
    return all(isinstance(u.target, torch._ops.OpOverload) and u.target.overloadpacket in MIXED_OPS
               and (not u.args or u.args[0] is not node) for u in node.users)


def _node_args(node: fx.Node) -> list[fx.Node]:
    seen: list[fx.Node] = []
    for a in pytree.tree_leaves((node.args, node.kwargs), is_leaf=lambda x: isinstance(x, fx.Node)):
        if isinstance(a, fx.Node) and a not in seen:
            seen.append(a)
    return seen


def _is_float(val: Any) -> bool:
    return isinstance(val, torch.Tensor) and val.dtype.is_floating_point


def _is_fp32(val: Any) -> bool:
    return isinstance(val, torch.Tensor) and val.dtype == torch.float32
