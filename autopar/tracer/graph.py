"""TracedGraph: an ATen-level fx graph of one model's forward, with the metadata planning needs.

Contract (what later stages may rely on):
- ``gm`` is a ``torch.fx.GraphModule`` whose placeholders are, in order, the parameters, the
  buffers, lifted tensor constants and the flattened user inputs. Calling
  ``gm(*placeholder_values)`` returns the flat outputs; ``unflatten_outputs`` rebuilds the
  model's own output structure (tuple, dict or HF ``ModelOutput``).
- Every node has ``meta["val"]`` (a fake tensor or a tuple of them: global shape and dtype) and
  ``meta["autopar_module"]`` (the owning module's FQN, "" for the root module). Placeholders also
  carry ``meta["autopar_placeholder"]`` (a :class:`Placeholder`).
- A parameter shared by several modules (tied weights) is one placeholder; all its FQNs are in
  ``Placeholder.aliases`` (canonical name first, the order of ``named_parameters``).
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
from torch.fx.immutable_collections import immutable_dict, immutable_list
import torch.utils._pytree as pytree

from autopar.plans import NodeKind  # defined with Plan, torch-free: a plan names kinds without torch
from autopar.tracer.meta_keys import MODULE_KEY, PLACEHOLDER_KEY  # re-exported: the graph's users read them here

# Placeholder kinds: shorthands for the ``NodeKind`` members (one vocabulary with the planner).
PARAMETER = NodeKind.PARAMETER
BUFFER = NodeKind.BUFFER
CONSTANT = NodeKind.CONSTANT  # lifted tensor constant or a non-tensor user input
INPUT = NodeKind.INPUT


@dataclass(frozen=True, slots=True)
class Placeholder:
    """One graph input. ``fqn`` is the canonical parameter/buffer FQN or the user input path."""

    name: str
    kind: NodeKind  # PARAMETER, BUFFER, CONSTANT or INPUT
    fqn: str
    aliases: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    requires_grad: bool = False  # a trainable parameter (frozen ones and buffers: False)

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n

    def __str__(self) -> str:
        alias = f" (also {', '.join(self.aliases[1:])})" if len(self.aliases) > 1 else ""
        dtype = str(self.dtype).removeprefix("torch.") if self.dtype is not None else "-"
        return f"{self.kind} {self.fqn}{alias}: {dtype}{list(self.shape)} [{self.name}]"


def keyword_path(path: tuple) -> str:
    """'input_ids' / "x['a'][0]" for a pytree key path into a keyword-input dict."""
    head = getattr(path[0], "key", path[0])
    return str(head) + pytree.keystr(path[1:])


def tensor_vals(val: Any) -> list[torch.Tensor]:
    """The tensors inside a node's ``meta["val"]`` (which may be a tuple or list)."""
    if isinstance(val, torch.Tensor):  # the common cases first: pytree's walk costs per node
        return [val]
    if val is None:
        return []
    if type(val) in (tuple, list) and all(v is None or isinstance(v, torch.Tensor) for v in val):
        return [v for v in val if v is not None]
    return [v for v in pytree.tree_leaves(val) if isinstance(v, torch.Tensor)]


def values_needing_grad(traced: TracedGraph) -> set[str]:
    """Nodes whose value takes a gradient in backward: trainable parameters, inputs that require
    grad, and every floating value computed from one of them (the planner prices gradient sums
    only for these; the pipeline runtime marks only these received values requires_grad)."""
    out: set[fx.Node] = set()  # (nodes, not names: a set test per input instead of a name lookup)
    for node in traced.gm.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            ph = node.meta.get(PLACEHOLDER_KEY)
            if ph is not None and (ph.requires_grad or getattr(val, "requires_grad", False)):
                out.add(node)
        elif node.op == "call_function" and not out.isdisjoint(node.all_input_nodes):
            val = node.meta.get("val")
            vals = val if isinstance(val, (tuple, list)) else (val,)
            if any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in vals):
                out.add(node)
    return {node.name for node in out}


def op_name(node: fx.Node) -> str:
    """'aten.addmm.default' for ATen overloads, the function's name otherwise."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__name__", str(target))


def may_alias(node: fx.Node) -> bool:
    """May ``node``'s output alias one of its inputs? A ``call_function`` with a return that has
    alias info (a view), or without an ATen schema at all (unknown: conservatively yes)."""
    if node.op != "call_function":
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return True
    return any(r.alias_info is not None for r in schema.returns)


class TracedGraph:
    """The traced forward of a model; see the module docstring for the contract."""

    def __init__(
        self, gm: fx.GraphModule, *, placeholders: tuple[Placeholder, ...], in_spec: Any,
        out_spec: Any, constants: dict[str, Any], loss_name: str | None, model_name: str,
    ) -> None:
        self.gm = gm
        self.placeholders = placeholders
        self.in_spec = in_spec
        self.out_spec = out_spec
        self.constants = constants
        self.model_name = model_name
        self._loss_name = loss_name
        self._by_name = {node.name: node for node in gm.graph.nodes}
        # decomposed op -> the ops it became (``decompose``), for coverage reports
        self.decomposed: dict[str, tuple[str, ...]] = {}
        self._by_fqn = {alias: p for p in placeholders for alias in p.aliases}
        self.precision = "fp32"  # what the ops compute in (``autopar.tracer.precision``)
        # per-rank batch statistics: the chunks (world size) of ``autopar.tracer.batch_stats``; None: global
        self.batch_norm_chunks: int | None = None
        self._hash: tuple[int, str] | None = None  # (node count, graph_hash): rewrites reset it
        # ``tracer.depth.blocks_of``'s answer: unknown until asked (or set by the unrolled trace);
        # rewrites reset it
        self._blocks: tuple[Any, ...] | None = None

    # ---- nodes -----------------------------------------------------------------------------
    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    @property
    def nodes(self) -> list[fx.Node]:
        """All nodes in topological (execution) order."""
        return list(self.gm.graph.nodes)

    def node(self, name: str) -> fx.Node:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no node named {name!r} in the traced graph of {self.model_name}") from None

    def compute_nodes(self) -> Iterator[fx.Node]:
        """The call_function nodes (the ops), in order."""
        return (n for n in self.gm.graph.nodes if n.op == "call_function")

    @staticmethod
    def module_path(node: fx.Node) -> str:
        return node.meta.get(MODULE_KEY, "")

    def decompose(self, decompose_if: Callable[[Any], bool]) -> dict[str, tuple[str, ...]]:
        """Replace the ops that satisfy ``decompose_if`` by their decompositions, in place (see
        ``autopar.tracer.decompose``); returns and records what each decomposed op became."""
        from autopar.tracer.decompose import decompose_graph

        blocks = self._blocks
        with self.rewriting():
            record = decompose_graph(self.gm, decompose_if)
        if not record:  # nothing was replaced: the graph, its hash and its blocks are as they were
            self._blocks = blocks
        for op, pieces in record.items():
            self.decomposed[op] = tuple(sorted(set(self.decomposed.get(op, ())) | set(pieces)))
        return record

    def functionalize(self) -> int:
        """Remove in-place writes to activations (``autopar.tracer.functionalize``); returns how
        many were removed. The graph, its hash and its blocks change only when some were."""
        from autopar.tracer.functionalize import functionalize_activations

        blocks = self._blocks
        with self.rewriting():
            removed = functionalize_activations(self.gm)
        if not removed:
            self._blocks = blocks
        return removed

    @contextmanager
    def rewriting(self) -> Iterator[None]:
        """Around a pass that rewrites ``gm`` in place: node lookups and the loss follow it."""
        flat = self.flat_outputs
        loss_at = next((i for i, a in enumerate(flat) if isinstance(a, fx.Node) and a.name == self._loss_name), None)
        yield
        self._hash = None
        self._blocks = None
        self._by_name = {node.name: node for node in self.gm.graph.nodes}
        if loss_at is not None:  # the loss op itself may have been replaced
            self._loss_name = self.flat_outputs[loss_at].name

    # ---- placeholders ----------------------------------------------------------------------
    def placeholders_of(self, kind: NodeKind) -> tuple[Placeholder, ...]:
        return tuple(p for p in self.placeholders if p.kind == kind)

    @property
    def params(self) -> tuple[Placeholder, ...]:
        return self.placeholders_of(PARAMETER)

    @property
    def buffers(self) -> tuple[Placeholder, ...]:
        return self.placeholders_of(BUFFER)

    @property
    def inputs(self) -> tuple[Placeholder, ...]:
        return self.placeholders_of(INPUT)

    def by_fqn(self, fqn: str) -> Placeholder:
        """The placeholder of a parameter/buffer by any of its names (tied aliases included)."""
        try:
            return self._by_fqn[fqn]
        except KeyError:
            raise KeyError(f"{fqn!r} is not a parameter, buffer or input of {self.model_name}") from None

    def bind(self, model: torch.nn.Module, inputs: dict) -> list[Any]:
        """Real values for ``gm``'s placeholders, in order: the model's parameters and buffers
        (by FQN) and ``inputs`` (the keyword dict given to :func:`trace`; non-tensor values
        are taken from the dict too)."""
        state = {**dict(model.named_parameters(remove_duplicate=False)),
                 **dict(model.named_buffers(remove_duplicate=False))}
        leaves = {keyword_path(path): value for path, value in
                  pytree.tree_flatten_with_path(dict(inputs))[0]}
        values = []
        for p in self.placeholders:
            if p.kind in (PARAMETER, BUFFER):
                values.append(state[p.fqn])
            elif p.fqn in self.constants:
                values.append(self.constants[p.fqn])
            elif p.fqn in leaves:
                values.append(leaves[p.fqn])
            elif p.kind == CONSTANT:
                values.append(self.node(p.name).meta.get("val"))
            else:
                raise KeyError(f"input {p.fqn!r} of {self.model_name} is missing; "
                               f"given: {sorted(leaves)}")
        return values

    @property
    def num_params(self) -> int:
        """Parameter element count, each tied parameter counted once."""
        return sum(p.numel for p in self.params)

    # ---- outputs ---------------------------------------------------------------------------
    @property
    def output_node(self) -> fx.Node:
        return next(n for n in reversed(self.gm.graph.nodes) if n.op == "output")

    @property
    def flat_outputs(self) -> list[Any]:
        """The output node's flat arguments (nodes or constants such as None)."""
        return list(pytree.tree_leaves(self.output_node.args[0], is_leaf=lambda x: x is None))

    def unflatten_outputs(self, flat_values: list[Any]) -> Any:
        """Rebuild the model's output structure (tuple/dict/ModelOutput) from flat values."""
        return pytree.tree_unflatten(list(flat_values), self.out_spec)

    @property
    def loss_node(self) -> fx.Node | None:
        """The scalar floating-point output (the loss), or None when the model returns none."""
        return self._by_name[self._loss_name] if self._loss_name else None

    # ---- identity --------------------------------------------------------------------------
    @property
    def graph_hash(self) -> str:
        """Stable hex digest of ops, wiring, shapes and parameter names (for plan files). Computed
        once (a plan asks several times; a deep graph takes a while): in-place rewrites go through
        ``rewriting``, which forgets it, and a changed node count recomputes it."""
        size = len(self.gm.graph.nodes)
        if getattr(self, "_hash", None) is None or self._hash[0] != size:
            self._hash = (size, self._compute_hash())
        return self._hash[1]

    def _compute_hash(self) -> str:
        ops: dict[Any, str] = {}  # target -> op_name (a deep graph repeats a few targets)
        lines = []
        for node in self.gm.graph.nodes:
            args = _tokens((node.args, node.kwargs))
            vals = [(tuple(v.shape), str(v.dtype)) for v in tensor_vals(node.meta.get("val"))]
            fqn = node.meta[PLACEHOLDER_KEY].fqn if PLACEHOLDER_KEY in node.meta else ""
            try:
                op = ops.get(node.target)
                if op is None:
                    op = ops[node.target] = op_name(node)
            except TypeError:  # an unhashable target
                op = op_name(node)
            lines.append(repr((node.op, node.name, op, args, vals, fqn)))
        # one update of the joined lines: the same digest as one update per line
        return hashlib.sha256("".join(lines).encode()).hexdigest()[:16]

    def op_counts(self) -> Counter:
        return Counter(op_name(n) for n in self.compute_nodes())

    def __str__(self) -> str:
        return (f"TracedGraph({self.model_name}: {len(self._by_name)} nodes, "
                f"{sum(1 for _ in self.compute_nodes())} ops, {len(self.params)} parameters "
                f"({self.num_params:,} elements), loss={self._loss_name}, hash={self.graph_hash})")

    __repr__ = __str__


def lazy_graph_module(root: torch.nn.Module, graph: fx.Graph) -> fx.GraphModule:
    """``fx.GraphModule(root, graph)`` whose Python code is generated when first needed (a call,
    ``.code``, ``str``): planning never runs the traced module, and generating the code of a deep
    graph took longer than building it. torch's own lazy class; a plain module without it."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # not in this torch: generate the code now
        return fx.GraphModule(root, graph)
    return _LazyGraphModule(root, graph)


def map_args(arg: Any, fn: Callable[[Any], Any]) -> Any:
    """``pytree.tree_map(fn, arg)`` over fx node arguments, with the containers they are made of
    (tuples, lists, dicts and fx's immutable ones) mapped directly: pytree's generic walk was
    most of the time of hashing or comparing a deep graph."""
    kind = type(arg)
    if kind is tuple or kind is list or kind is immutable_list:
        return kind(map_args(a, fn) for a in arg)
    if kind is dict or kind is immutable_dict:
        return kind((k, map_args(v, fn)) for k, v in arg.items())
    if isinstance(arg, (tuple, list, dict)):  # a namedtuple, an OrderedDict ...: pytree's own rules
        return pytree.tree_map(fn, arg)
    return fn(arg)


_ATOMS = (int, float, bool, str, type(None))  # arguments that are their own token


def _tokens(arg: Any) -> Any:
    """The hash's view of node arguments (defined as ``pytree.tree_map(_arg_token, arg)``):
    ``map_args(arg, _arg_token)`` with its common leaves (nodes, plain numbers) tokenised inline,
    every node of a deep graph passes through here."""
    kind = type(arg)
    if kind is fx.Node:
        return f"%{arg.name}"
    if kind in _ATOMS:
        return arg
    if kind is tuple or kind is list or kind is immutable_list:
        return kind([_tokens(a) for a in arg])
    if kind is dict or kind is immutable_dict:
        return kind((k, _tokens(v)) for k, v in arg.items())
    return map_args(arg, _arg_token)


def _arg_token(arg: Any) -> Any:
    if isinstance(arg, fx.Node):
        return f"%{arg.name}"
    if isinstance(arg, torch.device):  # plans made on meta apply on cuda: device is not identity
        return "device"
    if isinstance(arg, (torch.dtype, torch.layout, torch.memory_format)):
        return str(arg)
    return arg
