"""profile(): per-node FLOPs, bytes and saved-for-backward bytes, computed without running kernels.

How: the traced graph is interpreted node by node on *fake* CPU tensors (no memory, no kernels)
with parameters requiring grad, then one backward runs from the loss, also on fake tensors.
- FLOPs come from ``torch.utils.flop_counter``'s registry, applied to every ATen op that
  reaches dispatch. Composite ops (``aten.linear``) are counted through what they decompose
  into (``addmm``), so torch's own formulas apply. Backward ops are attributed to the forward
  node whose autograd nodes produced them (a pre-hook on each autograd node marks it).
- Saved-for-backward bytes are observed with ``torch.autograd.graph.saved_tensors_hooks``: what
  autograd really saves, de-duplicated by storage, excluding parameters and buffers. Fake
  tensors are placed on ``cpu`` (not ``meta``) so attention takes the fused CPU kernel's
  autograd path, as a real run would, instead of the math fallback that saves the full
  attention matrix. Attention dropout is modelled as the fused GPU kernels do it (see
  ``_fused_attention_dropout``).
- Bytes read/written are the sizes of a node's tensor inputs and outputs; ops whose output
  aliases an input (views) move no bytes.
"""

from __future__ import annotations

import copy
import operator
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from autopar.tracer.attention_form import causal_attention
from autopar.tracer.depth import blocks_of, shallow_graph, stamp
from autopar.tracer import experts as _experts  # noqa: F401 -- registers the experts op's FLOP formulas first
from autopar.tracer.heap import frozen_heap
from autopar.tracer.graph import BUFFER, PARAMETER, PLACEHOLDER_KEY, TracedGraph, op_name, tensor_vals
from autopar.tracer.trace import TraceError

_aten = torch.ops.aten
# The fused CPU attention kernels have the same argument layout as the flash kernels whose
# formulas torch registers; count them with those formulas.
_FLOPS = dict(flop_registry)
_FLOPS[_aten._scaled_dot_product_flash_attention_for_cpu] = flop_registry[
    _aten._scaled_dot_product_flash_attention]
_FLOPS[_aten._scaled_dot_product_flash_attention_for_cpu_backward] = flop_registry[
    _aten._scaled_dot_product_flash_attention_backward]
_CPU = torch.device("cpu")


@dataclass(frozen=True, slots=True)
class NodeProfile:
    """Costs of one op node. ``saved_bytes`` counts storages this node's backward keeps that no
    earlier node already keeps; ``saved_from`` names the nodes that produced them.
    ``saved_parts``: every distinct storage this node's backward keeps, earlier savers' included,
    as ``(storage id, producer node, bytes)`` (ids are per profile): a storage several nodes keep
    is held as long as any of them (or a recompute region reading it) keeps it."""

    name: str
    op: str
    module: str
    fwd_flops: int
    bwd_flops: int
    bytes_read: int
    bytes_written: int
    bwd_bytes: int
    output_bytes: int
    saved_bytes: int
    saved_from: tuple[str, ...]
    saved_parts: tuple[tuple[int, str, int], ...] = ()

    def __str__(self) -> str:
        return (f"{self.name} [{self.op}] @ {self.module or '<root>'}: fwd {self.fwd_flops:.3g} "
                f"flop, bwd {self.bwd_flops:.3g} flop, read {self.bytes_read} B, write "
                f"{self.bytes_written} B, out {self.output_bytes} B, saved {self.saved_bytes} B")


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """Per-node profiles (op nodes, in graph order) and model totals."""

    nodes: tuple[NodeProfile, ...]
    fwd_flops: int
    bwd_flops: int
    param_bytes: int
    buffer_bytes: int
    input_bytes: int
    activation_bytes: int  # total saved for backward (the activations a training step keeps)
    seconds: float
    _by_name: dict = field(default_factory=dict, repr=False, compare=False)

    def __getitem__(self, name: str) -> NodeProfile:
        if not self._by_name:
            self._by_name.update((p.name, p) for p in self.nodes)
        return self._by_name[name]

    @property
    def total_flops(self) -> int:
        return self.fwd_flops + self.bwd_flops

    def __str__(self) -> str:
        return (f"ModelProfile({len(self.nodes)} ops: fwd {self.fwd_flops:.4g} flop, bwd "
                f"{self.bwd_flops:.4g} flop, params {self.param_bytes / 2**20:.1f} MiB, "
                f"activations {self.activation_bytes / 2**20:.1f} MiB, {self.seconds:.2f} s)")


class _Counter(TorchDispatchMode):
    """Adds each dispatched op's FLOPs (and, in backward, bytes) to the current node."""

    def __init__(self) -> None:
        super().__init__()
        self.current: str | None = None
        self.backward = False
        self.fwd_flops: dict[str, int] = {}
        self.bwd_flops: dict[str, int] = {}
        self.bwd_bytes: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.current is None:
            return out
        formula = _FLOPS.get(func.overloadpacket)
        if formula is not None:
            flops = formula(*args, **kwargs, out_val=out)
            table = self.bwd_flops if self.backward else self.fwd_flops
            table[self.current] = table.get(self.current, 0) + flops
        if self.backward and not _is_view(func):
            moved = _nbytes(args) + _nbytes(kwargs) + _nbytes(out)
            self.bwd_bytes[self.current] = self.bwd_bytes.get(self.current, 0) + moved
        return out


def profile(traced: TracedGraph, *, by_blocks: bool = True) -> ModelProfile:
    """Profile a traced graph; see the module docstring. Runs no kernels.

    ``by_blocks``: a graph of identical repeated blocks profiles a cut with three of them plus
    the last and stamps the rest (``autopar.tracer.depth``: the same profile, in a time that
    does not grow with depth); False, or a graph it does not recognise, runs every node."""
    start = time.perf_counter()
    with frozen_heap():  # the traced graph is only read: out of full GC passes
        structure = blocks_of(traced) if by_blocks else None
        if structure is not None:
            shallow = _profile_nodes(shallow_graph(traced, structure))
            nodes = stamp(traced, structure, tuple(shallow))
            if nodes is not None:
                return _totals(traced, nodes, time.perf_counter() - start)
        return _totals(traced, _profile_nodes(traced), time.perf_counter() - start)


def _profile_nodes(traced: TracedGraph) -> list[NodeProfile]:
    """Every op node's profile, by running the graph and its backward on fake tensors."""
    fake_mode = FakeTensorMode()
    counter = _Counter()
    env: dict[fx.Node, Any] = {}
    fixed: set = set()            # storages of parameters and buffers: not activations
    producer: dict = {}           # storage -> name of the node that first produced it
    saved_seen: set = set()
    saved: dict[str, list] = {}   # node -> [bytes, [producer names]]
    parts: dict[str, dict] = {}   # node -> {storage id: (storage id, producer, bytes)}
    storage_id: dict = {}         # storage -> id (saved storages, in first-saved order)
    grad_owner: dict = {}         # autograd node -> graph node name

    def pack(tensor: torch.Tensor):
        key = _storage_key(tensor)
        if key is not None and key not in fixed:
            sid = storage_id.setdefault(key, len(storage_id))
            parts.setdefault(counter.current, {}).setdefault(
                sid, (sid, producer.get(key, counter.current), tensor.untyped_storage().nbytes()))
        if key is not None and key not in fixed and key not in saved_seen:
            saved_seen.add(key)
            entry = saved.setdefault(counter.current, [0, []])
            entry[0] += tensor.untyped_storage().nbytes()
            entry[1].append(producer.get(key, counter.current))
        return tensor

    # Attention the runtime runs causal and grouped, without the traced mask (``attention_form``):
    # its masks evaluated here, on real tensors, before the fake mode.
    forms = causal_attention(traced.graph)
    with fake_mode, counter, torch.autograd.graph.saved_tensors_hooks(pack, _identity):
        for node in traced.graph.nodes:
            if node.op == "placeholder":
                env[node] = _placeholder_value(node, traced)
                for tensor in tensor_vals(env[node]):
                    producer.setdefault(_storage_key(tensor), node.name)
                if node.meta[PLACEHOLDER_KEY].kind in (PARAMETER, BUFFER):
                    fixed.update(_storage_key(t) for t in tensor_vals(env[node]))
            elif node.op == "get_attr":
                env[node] = _on_cpu(getattr(traced.gm, node.target))
            elif node.op == "call_function":
                env[node] = _run_node(node, env, counter, forms)
                for tensor in tensor_vals(env[node]):
                    producer.setdefault(_storage_key(tensor), node.name)
                _claim_grad_fns(env[node], node.name, grad_owner, counter)
        counter.current = None
        roots = _backward_roots(traced, env)
    with fake_mode, counter:
        counter.backward = True
        if roots:
            torch.autograd.backward([r for r, _ in roots], [g for _, g in roots])
    return _node_profiles(traced, counter, saved, parts)


# ---- interpretation ------------------------------------------------------------------------------
def _identity(tensor):
    return tensor


def _placeholder_value(node: fx.Node, traced: TracedGraph) -> Any:
    info = node.meta[PLACEHOLDER_KEY]
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return val
    tensor = torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype,
                                 device=_CPU)
    # Only trainable parameters require grad: a training step does not differentiate its inputs.
    if info.requires_grad and val.dtype.is_floating_point:
        tensor.requires_grad_(True)
    return tensor


def _to_cpu(value: Any) -> Any:
    return _CPU if isinstance(value, torch.device) else value


def _on_cpu(value: Any) -> Any:
    """A copy of a subgraph (higher-order op body) whose device arguments say cpu."""
    if not isinstance(value, fx.GraphModule):
        return value
    graph = copy.deepcopy(value.graph)  # node meta is copied shallowly: no tensor copies
    for node in graph.nodes:
        node.args, node.kwargs = pytree.tree_map(_to_cpu, (node.args, node.kwargs))
    module = fx.GraphModule(value, graph)
    for node in graph.nodes:
        if node.op == "get_attr":
            setattr(module, node.target, _on_cpu(getattr(value, node.target)))
    return module


def _run_node(node: fx.Node, env: dict, counter: _Counter, forms: dict | None = None) -> Any:
    # An attention the runtime runs folded takes the arguments it runs with (``attention_form``).
    node_args, node_kwargs = ((), forms[node.name]) if forms and node.name in forms else (node.args, node.kwargs)
    args, kwargs = pytree.tree_map(
        lambda a: env[a] if isinstance(a, fx.Node) else _to_cpu(a), (node_args, node_kwargs))
    if node.target is _aten.scaled_dot_product_attention.default:
        args, kwargs = _fused_attention_dropout(args, kwargs)
    counter.current = node.name
    try:
        return node.target(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - report which node failed, with its origin
        raise TraceError(f"profiling failed at node {node.name}", op=op_name(node),
                         module_path=node.meta.get("autopar_module", ""),
                         source=_stack_line(node), hint=_run_hint(node, err),
                         cause=str(err).strip().splitlines()[0] if str(err).strip() else "") from err


def _run_hint(node: fx.Node, err: Exception) -> str:
    """What to do about a node that cannot run on fake tensors. ``item`` / ``_local_scalar_dense``
    is a tensor's value read as a Python number (``.item()``, ``.tolist()``): export lets it through
    as an unbacked size (JetMoE's ``expert_size.tolist()`` sizing a ``split``), but a plan is made
    for shapes alone, and the value does not exist until the data does."""
    if node.target in (_aten._local_scalar_dense.default, _aten.item.default):
        return ("the forward reads a tensor's value as a Python number (.item() / .tolist()), "
                "here to size or select tensors by data: a plan is made from shapes only; keep "
                "the value a tensor (masks, torch.where, index_add over fixed shapes) or pass it "
                "as a constant")
    if isinstance(err, (DynamicOutputShapeException, DataDependentOutputException)):
        # export lets these through with an unbacked size; the values they need exist only with the data
        return ("the op's output shape or value depends on tensor values (boolean-mask indexing x[mask], "
                "nonzero, masked_select, unique, repeat_interleave by a tensor): a plan is made from shapes "
                "only; keep shapes fixed (torch.where, masked_fill, multiplying by the mask) or pass the "
                "selection as a constant")
    return "the op cannot run on fake tensors"


def _fused_attention_dropout(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Attention dropout as the fused GPU kernels do it: they keep the RNG state, not the mask.

    The CPU fused kernel has no dropout and would fall back to the math path, which saves the
    (batch, heads, seq, seq) probabilities: memory a GPU training step never holds. FLOPs are
    the same either way.
    """
    if len(args) > 4:
        return (*args[:4], 0.0, *args[5:]), kwargs
    if kwargs.get("dropout_p"):
        return args, {**kwargs, "dropout_p": 0.0}
    return args, kwargs


def _stack_line(node: fx.Node) -> str:
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    return trace[-2].strip() + " " + trace[-1].strip() if len(trace) >= 2 else ""


def _claim_grad_fns(value: Any, name: str, owner: dict, counter: _Counter) -> None:
    """Mark the autograd nodes this graph node created, so backward ops are attributed to it."""
    todo = [t.grad_fn for t in tensor_vals(value) if t.grad_fn is not None]
    while todo:
        fn = todo.pop()
        if fn is None or fn in owner or type(fn).__name__ == "AccumulateGrad":
            continue
        owner[fn] = name
        fn.register_prehook(_marker(counter, name))
        todo.extend(next_fn for next_fn, _ in fn.next_functions)


def _marker(counter: _Counter, name: str):
    def prehook(grad_outputs):
        counter.current = name
    return prehook


def _backward_roots(traced: TracedGraph, env: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tensor, grad) pairs to start backward from: the loss, else every differentiable output."""
    if traced.loss_node is not None:
        outputs = [env[traced.loss_node]]
    else:
        outputs = [env[n] for n in traced.flat_outputs if isinstance(n, fx.Node)]
    roots = [t for t in pytree.tree_leaves(outputs)
             if isinstance(t, torch.Tensor) and t.requires_grad]
    return [(t, torch.ones_like(t)) for t in roots]


# ---- bytes ---------------------------------------------------------------------------------------
def _storage_key(tensor: torch.Tensor):
    try:
        return StorageWeakRef(tensor.untyped_storage())
    except (NotImplementedError, RuntimeError):
        return None


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(value)
               if isinstance(t, torch.Tensor))


def _is_view(func) -> bool:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _node_bytes(node: fx.Node) -> tuple[int, int, int]:
    """(bytes read, bytes written, output bytes) of a forward node, from its global shapes."""
    out = sum(t.numel() * t.element_size() for t in tensor_vals(node.meta.get("val")))
    if node.target is operator.getitem or _is_view(node.target):
        return 0, 0, out
    inputs = {a.name: a for a in node.all_input_nodes}
    read = sum(t.numel() * t.element_size()
               for a in inputs.values() for t in tensor_vals(a.meta.get("val")))
    return read, out, out


def _node_profiles(traced: TracedGraph, counter: _Counter, saved: dict, parts: dict) -> list[NodeProfile]:
    profiles = []
    for node in traced.compute_nodes():
        read, written, out = _node_bytes(node)
        saved_bytes, saved_from = saved.get(node.name, (0, []))
        profiles.append(NodeProfile(
            name=node.name, op=op_name(node), module=traced.module_path(node),
            fwd_flops=int(counter.fwd_flops.get(node.name, 0)),
            bwd_flops=int(counter.bwd_flops.get(node.name, 0)),
            bytes_read=read, bytes_written=written,
            bwd_bytes=counter.bwd_bytes.get(node.name, 0), output_bytes=out,
            saved_bytes=saved_bytes, saved_from=tuple(dict.fromkeys(saved_from)),
            saved_parts=tuple(parts.get(node.name, {}).values()),
        ))
    return profiles


def _totals(traced: TracedGraph, profiles: list[NodeProfile], seconds: float) -> ModelProfile:
    size = {kind: sum(p.numel * (p.dtype.itemsize if p.dtype else 0)
                      for p in traced.placeholders_of(kind))
            for kind in (PARAMETER, BUFFER, "input")}
    return ModelProfile(
        nodes=tuple(profiles), fwd_flops=sum(p.fwd_flops for p in profiles),
        bwd_flops=sum(p.bwd_flops for p in profiles), param_bytes=size[PARAMETER],
        buffer_bytes=size[BUFFER], input_bytes=size["input"],
        activation_bytes=sum(p.saved_bytes for p in profiles), seconds=seconds,
    )
