"""Problem builder: traced graph + profile + mesh -> the solver's plain-data ``Problem``.

Decisions (``Problem`` nodes), in graph order:

- every **parameter** and **buffer** placeholder: its layout, one option per valid spec built from
  ``R`` and ``S(dim)`` on each mesh axis. A parameter option holds ``param_bytes`` = local bytes x
  (1 parameter + 1 gradient + ``optimizer_multiplier`` optimizer state) for the whole step
  (gradients arrive in the parameter's layout: DESIGN.md decision 8). Tied weights are one
  placeholder, so one decision. Sharded parameters that a consumer needs replicated are
  gathered on the edge: that is ZeRO-3/FSDP, priced by the same conversion planner.
- every **user input**: its layout (the full input is on every rank; slicing it is free).
- every **op** with a sharding rule: one option per ``Strategy``. Its activation (what autograd
  saves for its backward, from the profile) scales with the strategy's local/global bytes and is
  live from the op's forward to its backward on a timeline ``fwd i -> i``, ``bwd i -> 2N-1-i``.

Recompute segments: every op inside a repeated block gets ``Node.segment`` = its module path
(``"transformer.h.3.mlp.act"``; a contiguous run of ops), the unit the ILP may recompute
(``autopar.solver.recompute_ilp``), as can the whole block (``"transformer.h.3"``): the fine
segments let the cheap-to-recompute, memory-heavy parts (activation functions, attention) go
alone, the block keeps only its own input. The block's own ops (residual adds) form the segment
``"<block>.(self)"``. A
recomputed segment keeps only its inputs (what ``torch.utils.checkpoint`` holds):
``BuiltProblem.segment_inputs`` lists, per segment, the activation values it reads from outside
with their local bytes per producer option. An input whose storage is first saved for backward
by a node *outside* the segment is left out (that node holds it whatever the segment does), so a
storage is never counted twice.

Values that need no decision resolve to their producer: ``getitem`` on a multi-output op reads
the producer's output element ``k``; ops without tensor output (metadata asserts) are skipped.
The graph **output** is one more (single-option) decision: the model returns full values, so
each returned tensor pays its conversion to replicated on the edge into it.

Edges carry, for every (producer option, consumer strategy) pair, the forward + backward seconds
of the cheapest conversion from the producer's output spec to the spec the consumer's strategy
requires (``autopar.layout.conversion.plan_conversion``; each distinct spec pair is planned once).
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np
import torch
import torch.fx as fx

from autopar.layout.mesh import MeshSpec
from autopar.solver.blocks import block_of
from autopar.solver.problem import Edge, Node, Problem, StrategyOption
from autopar.layout.conversion import plan_conversion
from autopar.layout.placement import R, Shard, TensorSpec
from autopar.strategies import Strategy, strategies_for
from autopar.tracer.graph import BUFFER, CONSTANT, INPUT, PARAMETER, PLACEHOLDER_KEY, TracedGraph
from autopar.tracer.profile import ModelProfile

__all__ = ["BuildOptions", "BuiltProblem", "Choice", "ChosenConversion", "build_problem", "block_of", "layout_specs",
           "holder_of_producer", "saved_by", "segment_inputs"]

_AT_REST = ("parameter", "buffer")

# A restriction filters the candidate options of one decision (baseline plans): it receives the
# decision kind ("parameter", "buffer", "input", "op"), the fx node and the candidate, and
# returns whether the candidate is allowed.
Restriction = Callable[[str, fx.Node, "Choice"], bool]


@dataclass(frozen=True, slots=True)
class BuildOptions:
    optimizer_multiplier: float = 2.0  # optimizer state bytes per parameter byte (AdamW fp32: m, v)
    allow_replicate_fallback: bool = False
    restriction: Restriction | None = None
    restriction_name: str = "autopar"


@dataclass(frozen=True, slots=True)
class Choice:
    """One option of one decision, as the runtime needs it (the ``Problem`` has the costs)."""

    name: str
    output_specs: tuple[TensorSpec | None, ...]
    strategy: Strategy | None = None  # None for placeholders (a layout only) and the output
    inputs: tuple[TensorSpec | None, ...] = ()  # what the graph output requires of each value

    @property
    def input_specs(self) -> tuple[TensorSpec | None, ...]:
        return self.strategy.input_specs if self.strategy is not None else self.inputs


@dataclass
class BuiltProblem:
    problem: Problem
    choices: dict[str, list[Choice]]  # decision node name -> options, aligned with the Problem's
    kinds: dict[str, str]  # decision node name -> parameter | buffer | input | op
    sources: dict[str, tuple[str, int]] = field(default_factory=dict)  # value -> (decision, output idx)
    fallbacks: tuple[str, ...] = ()  # op nodes replicated without a rule (opt-in)
    # consumer decision -> {input slot: (producer decision, producer output index, shape, itemsize)}
    inputs: dict[str, dict[int, tuple[str, int, tuple[int, ...], int]]] = field(default_factory=dict)
    mesh: MeshSpec | None = None
    # segment -> inputs it keeps when recomputed (autopar.solver.timeline.SegmentInput)
    segment_inputs: dict[str, tuple] = field(default_factory=dict)

    def conversions(self, choice: dict[str, str]) -> list["ChosenConversion"]:
        """The layout conversions a full choice (decision name -> option name) executes."""
        out = []
        for dst, slots in self.inputs.items():
            dst_choice = self.choice_of(dst, choice[dst])
            for slot, (src, idx, shape, itemsize) in sorted(slots.items()):
                a = self.choice_of(src, choice[src]).output_specs[idx]
                b = dst_choice.input_specs[slot]
                if a is not None and b is not None and a != b:
                    out.append(ChosenConversion(dst, slot, src, plan_conversion(a, b, shape, itemsize, self.mesh)))
        return out

    def choice_of(self, name: str, option: str) -> Choice:
        return self.choices[name][self.problem.node(name).option_index(option)]


@dataclass(frozen=True, slots=True)
class ChosenConversion:
    consumer: str
    slot: int
    producer: str
    conversion: Any  # autopar.layout.conversion.Conversion

    def __str__(self) -> str:
        return f"{self.producer} -> {self.consumer}[{self.slot}]: {self.conversion}"


_BATCH_NORMS = ("aten.batch_norm.", "aten._native_batch_norm_legit", "aten.native_batch_norm.",
                "aten.cudnn_batch_norm.", "aten._batch_norm_impl_index.")


def mutates_state(node: fx.Node) -> bool:
    """Whether running ``node`` again would change model state: an in-place write into a
    parameter or buffer (BatchNorm's ``num_batches_tracked += 1``), or a training-mode batch norm
    that updates its running statistics. Such ops must never be recomputed in backward."""
    if node.op != "call_function":
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        for arg, value in zip(schema.arguments, node.args):
            written = arg.alias_info is not None and arg.alias_info.is_write
            if written and isinstance(value, fx.Node) and value.op == "placeholder":
                return True
    if str(node.target).startswith(_BATCH_NORMS):
        args = list(node.args) + [None] * 6
        running_mean = node.kwargs.get("running_mean", args[3])
        training = node.kwargs.get("training", args[5])
        return running_mean is not None and bool(training)
    return False


def layout_specs(shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> list[TensorSpec]:
    """Every valid spec of a tensor from ``R``/``S(dim)`` per axis (no ``P``: values at rest)."""
    per_axis = [R] + [Shard(d) for d in range(len(shape))]
    out = []
    for combo in itertools.product(per_axis, repeat=len(mesh_shape)):
        # A size-1 axis only replicates: sharding over it changes nothing but the name.
        if any(size == 1 and p != R for p, size in zip(combo, mesh_shape)):
            continue
        spec = TensorSpec(combo)
        if spec.is_valid(shape, mesh_shape):
            out.append(spec)
    return out


# --------------------------------------------------------------------------------- builder
def build_problem(traced: TracedGraph, prof: ModelProfile, mesh: MeshSpec, *,
                  budget_bytes: int | None, options: BuildOptions = BuildOptions()) -> BuiltProblem:
    return _Builder(traced, prof, mesh, budget_bytes, options).build()


class _Builder:
    def __init__(self, traced, prof, mesh, budget_bytes, options) -> None:
        self.traced, self.prof, self.mesh = traced, prof, mesh
        self.budget, self.opts = budget_bytes, options
        self.nodes: list[Node] = []
        self.choices: dict[str, list[Choice]] = {}
        self.kinds: dict[str, str] = {}
        self.sources: dict[str, tuple[str, int]] = {}
        self.meta: dict[str, list] = {}  # decision -> per-output TensorMeta-like (shape, itemsize)
        self.fallbacks: list[str] = []
        self.inputs: dict[str, dict[int, tuple]] = {}
        self._strategy_cache: dict[Any, list[Strategy]] = {}
        self._conv_cache: dict[Any, float] = {}
        self._choice_cache: dict[int, list[Choice]] = {}  # id(strategy list) -> its choices
        self._edge_cache: dict[Any, np.ndarray] = {}
        self._layout_choices: dict[str, Choice] = {}  # one shared Choice per placeholder layout

    def build(self) -> BuiltProblem:
        ops = [n for n in self.traced.compute_nodes() if _has_tensor_output(n) and n.target is not operator.getitem]
        self.num_ops = len(ops)
        self.op_index = {n.name: i for i, n in enumerate(ops)}
        edges: dict[tuple[str, str], np.ndarray] = {}
        for node in self.traced.nodes:
            if node.op == "placeholder":
                self._placeholder(node)
            elif node.op == "call_function" and node.target is operator.getitem:
                src, idx = self.sources.get(node.args[0].name, (None, None))
                if src is not None:
                    self.sources[node.name] = (src, node.args[1])
            elif node.name in self.op_index:
                self._op(node, edges)
            elif node.op == "output":
                self._output(node, edges)
        problem = Problem(
            nodes=tuple(self.nodes),
            edges=tuple(Edge(s, d, tuple(map(tuple, m.tolist()))) for (s, d), m in edges.items()),
            budget_bytes=self.budget,
            timeline_length=max(2 * self.num_ops, 1),
            mesh_shape=tuple(self.mesh.shape),
            meta={"model": self.traced.model_name, "graph_hash": self.traced.graph_hash,
                  "restriction": self.opts.restriction_name},
        )
        built = BuiltProblem(problem, self.choices, self.kinds, self.sources, tuple(self.fallbacks),
                            self.inputs, self.mesh)
        problem = built.problem = self._without_stateful_segments(problem)
        fine = {n.name: n.segment for n in problem.nodes if n.segment is not None}
        blocks = {name: block_of(seg) for name, seg in fine.items()}
        built.segment_inputs = {**segment_inputs(self.traced, self.prof, built, fine),
                                **segment_inputs(self.traced, self.prof, built, blocks)}
        return built

    def _without_stateful_segments(self, problem: Problem) -> Problem:
        """Blocks holding an op that mutates state (``mutates_state``) get no recompute segments:
        recomputing them would update running statistics twice."""
        tainted = {block_of(n.segment) for n in problem.nodes
                   if n.segment is not None and mutates_state(self.traced.node(n.name))}
        if not tainted:
            return problem
        nodes = tuple(replace(n, segment=None) if n.segment is not None and block_of(n.segment) in tainted
                      else n for n in problem.nodes)
        return replace(problem, nodes=nodes)

    # ----------------------------------------------------------------------------- decisions
    def _allowed(self, kind: str, node: fx.Node, choice: Choice) -> bool:
        return self.opts.restriction is None or self.opts.restriction(kind, node, choice)

    def _placeholder(self, node: fx.Node) -> None:
        ph = node.meta.get(PLACEHOLDER_KEY)
        val = node.meta.get("val")
        if ph is None or not isinstance(val, torch.Tensor):
            return  # a non-tensor constant: nothing to lay out
        shape, itemsize = tuple(val.shape), val.dtype.itemsize
        kind = {PARAMETER: "parameter", BUFFER: "buffer", INPUT: "input", CONSTANT: "buffer"}[ph.kind]
        specs = layout_specs(shape, self.mesh.shape) if kind != "buffer" or ph.kind != CONSTANT else [
            TensorSpec.replicated(self.mesh.ndim)]
        per_byte = 2.0 + self.opts.optimizer_multiplier if kind == "parameter" else 1.0
        opts, choices = [], []
        for spec in specs:
            choice = self._layout_choices.setdefault(str(spec), Choice(str(spec), (spec,)))
            if not self._allowed(kind, node, choice):
                continue
            local = math.prod(spec.local_shape(shape, self.mesh.shape)) * itemsize
            if kind == "input":
                opts.append(StrategyOption(str(spec), compute_s=0.0, act_bytes=int(local)))
            else:
                opts.append(StrategyOption(str(spec), compute_s=0.0, param_bytes=int(round(local * per_byte))))
            choices.append(choice)
        if not opts:
            raise ValueError(f"the {self.opts.restriction_name} restriction leaves no layout for "
                             f"{kind} {ph.fqn!r} of shape {shape} on mesh {self.mesh.shape}")
        live = (0, max(2 * self.num_ops - 1, 0)) if kind == "input" else None
        self._add(node.name, kind, opts, choices, live=live, block=block_of(ph.fqn),
                  signature=f"{kind}{shape}{val.dtype}", out_meta=[(shape, itemsize)])

    def _op(self, node: fx.Node, edges: dict) -> None:
        strategies = self._strategies(node)
        slots = _input_nodes(node)
        i = self.op_index[node.name]
        parts = self._saved_parts(node)
        live = (i, 2 * self.num_ops - 1 - i) if parts else None
        activations = [self.kinds.get(src.name) not in _AT_REST for src in slots]
        global_bytes = _global_bytes(node, slots, activations)
        opts, choices = [], []
        for s, choice in zip(strategies, self._choices_of(strategies)):
            if not self._allowed("op", node, choice):
                continue
            act = _activation_bytes(node, s, slots, activations, global_bytes, parts) if live else 0
            opts.append(StrategyOption(
                _unique(s.name, opts), compute_s=s.compute_s, comm_s=s.comm_s, act_bytes=act,
                forward_s=s.forward_compute_s + s.forward_comm_s))
            choices.append(choice)
        if not opts:
            raise ValueError(f"the {self.opts.restriction_name} restriction leaves no strategy for "
                             f"node {node.name!r} (op {node.target}, module "
                             f"{self.traced.module_path(node) or '<top level>'})")
        outs = [(tuple(v.shape), v.dtype.itemsize) if isinstance(v, torch.Tensor) else None
                for v in _as_tuple(node.meta.get("val"))]
        path = self.traced.module_path(node)
        self._add(node.name, "op", opts, choices, live=live, block=block_of(path),
                  signature=self._signature(node), out_meta=outs, module=path)
        for slot, src_node in enumerate(slots):
            self._edge(src_node, node.name, slot, edges)

    def _saved_parts(self, node: fx.Node) -> list[tuple[str, int]]:
        """(producer, bytes) of the storages this node's activation accounts for: those whose
        last saver it is (``saved_by``); a profile without parts: its first-saver total."""
        if not hasattr(self, "_saver"):
            self._saver = saved_by(self.prof)
        prof = self.prof[node.name]
        if not prof.saved_parts:
            return [("", prof.saved_bytes)] if prof.saved_bytes else []
        return [(producer, nbytes) for sid, producer, nbytes in prof.saved_parts
                if self._saver.get(sid) == node.name]

    def _output(self, node: fx.Node, edges: dict) -> None:
        """The model returns full values: every tensor output is converted to replicated."""
        flat = [a for a in self.traced.flat_outputs if isinstance(a, fx.Node)]
        full = TensorSpec.replicated(self.mesh.ndim)
        choice = Choice("R", (), inputs=tuple(full for _ in flat))
        self._add(node.name, "output", [StrategyOption("R", compute_s=0.0)], [choice], live=None,
                  block=None, signature="output", out_meta=[])
        for slot, src_node in enumerate(flat):
            self._edge(src_node, node.name, slot, edges)

    def _choices_of(self, strategies: list[Strategy]) -> list[Choice]:
        """One Choice list per cached strategy list, so identical nodes share choice objects
        and their edges hit ``_edge_cache``."""
        cached = self._choice_cache.get(id(strategies))
        if cached is None:
            cached = self._choice_cache[id(strategies)] = [Choice(s.name, s.output_specs, s) for s in strategies]
        return cached

    def _add(self, name, kind, opts, choices, *, live, block, signature, out_meta, module=None) -> None:
        if block is not None and module == block:
            module = f"{block}.(self)"  # the block's own ops (residual adds): not the block segment
        segment = self._segment(module if block is not None else None) if kind == "op" else None
        self.nodes.append(Node(name, tuple(opts), live=live, block=block, signature=signature, segment=segment))
        self.choices[name] = choices
        self.kinds[name] = kind
        self.sources[name] = (name, 0)
        self.meta[name] = out_meta

    def _segment(self, block: str | None) -> str | None:
        """The op's module inside a repeated block, as a contiguous run of ops: a module whose
        ops resume after other ops gets a fresh segment (``"<module>#2"``), so every segment is
        one contiguous range."""
        run = getattr(self, "_run", None)  # (module, segment) of the current run of ops
        if block is None:
            self._run = None
            return None
        if run is not None and run[0] == block:
            return run[1]
        seen = self.__dict__.setdefault("_segments_seen", {})
        k = seen[block] = seen.get(block, 0) + 1
        segment = block if k == 1 else f"{block}#{k}"
        self._run = (block, segment)
        return segment

    def _strategies(self, node: fx.Node) -> list[Strategy]:
        key = self._signature(node)
        cached = self._strategy_cache.get(key)
        if cached is None:
            prof = self.prof[node.name]
            cached = strategies_for(node, self.mesh, flops=(prof.fwd_flops, prof.bwd_flops),
                                    allow_replicate_fallback=self.opts.allow_replicate_fallback)
            self._strategy_cache[key] = cached
        if cached and cached[0].is_fallback:
            self.fallbacks.append(node.name)
        return cached

    def _signature(self, node: fx.Node) -> str:
        def token(a: Any) -> Any:
            if isinstance(a, fx.Node):
                v = a.meta.get("val")
                return (tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else ("node", type(v).__name__)
            if isinstance(a, (list, tuple)):
                return tuple(token(x) for x in a)
            return repr(a)

        outs = tuple((tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else None
                     for v in _as_tuple(node.meta.get("val")))
        return repr((str(node.target), token(node.args), tuple(sorted((k, token(v)) for k, v in node.kwargs.items())), outs))

    # ---------------------------------------------------------------------------------- edges
    def _edge(self, src_node: fx.Node, dst: str, slot: int, edges: dict) -> None:
        src, idx = self.sources.get(src_node.name, (None, None))
        if src is None:
            return  # a value with no layout decision (a SymInt or a non-tensor constant)
        out_meta = self.meta[src][idx] if idx < len(self.meta[src]) else None
        if out_meta is None:
            return
        self.inputs.setdefault(dst, {})[slot] = (src, idx, *out_meta)
        matrix = self._edge_matrix(self.choices[src], idx, self.choices[dst], slot, out_meta)
        key = (src, dst)
        edges[key] = edges[key] + matrix if key in edges else matrix  # consumed twice: summed

    def _edge_matrix(self, src_choices, idx, dst_choices, slot, out_meta) -> np.ndarray:
        # Keyed by the choice objects themselves: identical repeated blocks share them.
        key = (tuple(map(id, src_choices)), idx, tuple(map(id, dst_choices)), slot, out_meta)
        matrix = self._edge_cache.get(key)
        if matrix is None:
            shape, itemsize = out_meta
            # Options share few distinct specs: cost each distinct pair once, expand by index.
            src_keys, src_specs = _distinct([c.output_specs[idx] for c in src_choices])
            dst_keys, dst_specs = _distinct([c.input_specs[slot] for c in dst_choices])
            unique = np.array([[self._conversion_s(a, b, shape, itemsize) for b in dst_specs]
                               for a in src_specs])
            matrix = self._edge_cache[key] = unique[np.ix_(src_keys, dst_keys)]
        return matrix

    def _conversion_s(self, a: TensorSpec | None, b: TensorSpec | None, shape, itemsize) -> float:
        if a is None or b is None or a == b:
            return 0.0
        key = (str(a), str(b), shape, itemsize)
        cost = self._conv_cache.get(key)
        if cost is None:
            conv = plan_conversion(a, b, shape, itemsize, self.mesh)
            cost = self._conv_cache[key] = conv.forward_s + conv.backward_s
        return cost


def _distinct(specs: list[TensorSpec | None]) -> tuple[list[int], list[TensorSpec | None]]:
    """(index of each spec among the distinct ones, the distinct specs in first-seen order)."""
    seen: dict[str, int] = {}
    distinct, index = [], []
    for spec in specs:
        key = "-" if spec is None else str(spec)
        if key not in seen:
            seen[key] = len(distinct)
            distinct.append(spec)
        index.append(seen[key])
    return index, distinct


def saved_by(prof: ModelProfile) -> dict[int, str]:
    """Saved storage id -> the node whose activation counts it: its *last* saver in graph order.

    A storage several nodes save (attention's output, saved by the attention op and by the
    projection reading it) is held until the last of them has run its backward, and by any one
    of them that is not recomputed. Counting it at the last saver, and as a recompute region's
    kept input exactly when that saver is inside the region (``segment_inputs``), is right
    whichever of the savers are recomputed: a kept last saver holds it; a recomputed one's
    region keeps it as an input (a region that reads a storage from outside holds it)."""
    out: dict[int, str] = {}
    for p in prof.nodes:
        for sid, _, _ in p.saved_parts:
            out[sid] = p.name
    return out


def holder_of_producer(prof: ModelProfile) -> dict[str, str]:
    """Producer node -> the node counting the storages it made (``saved_by``); a profile without
    parts: the first node saving them."""
    out: dict[str, str] = {}
    last = saved_by(prof)
    for p in prof.nodes:
        for producer in p.saved_from:
            out.setdefault(producer, p.name)
        for sid, producer, _ in p.saved_parts:
            out[producer] = last[sid]
    return out


def segment_inputs(traced: TracedGraph, prof: ModelProfile, built: BuiltProblem,
                   segment_of: dict[str, str]) -> dict[str, tuple]:
    """Per segment (``segment_of``: op decision -> segment; each a contiguous run of ops), the
    activation values its ops read from outside it, with their local bytes per producer option
    (``autopar.solver.timeline.SegmentInput``). Left out: parameters, buffers and user inputs
    (held anyway), and values whose storage is counted by a node outside the segment
    (``saved_by``: that node, or its own region, holds it whatever the segment does). Non-float
    tensors count too: the checkpoint keeps every tensor input."""
    from autopar.solver.timeline import SegmentInput

    holder = holder_of_producer(prof)  # storage producer -> the node whose activation counts it
    out: dict[str, list] = {}
    seen: set[tuple[str, str, int]] = set()
    for dst, slots in built.inputs.items():
        seg = segment_of.get(dst)
        if seg is None:
            continue
        for slot, (src, idx, shape, itemsize) in sorted(slots.items()):
            if segment_of.get(src) == seg or built.kinds.get(src) in (*_AT_REST, "input"):
                continue
            if (seg, src, idx) in seen:
                continue
            seen.add((seg, src, idx))
            src_node = traced.node(src)
            val = _as_tuple(src_node.meta.get("val"))[idx] if src_node.meta.get("val") is not None else None
            if not isinstance(val, torch.Tensor):
                continue  # every tensor input is kept by the checkpoint (masks and indices too)
            saver = holder.get(_storage_base(src_node).name)
            if saver is not None and segment_of.get(saver) != seg:
                continue
            sizes = tuple(int(math.prod(c.output_specs[idx].local_shape(shape, built.mesh.shape)) * itemsize)
                          for c in built.choices[src])
            out.setdefault(seg, []).append(SegmentInput(src, sizes))
    return {k: tuple(v) for k, v in out.items()}


# ----------------------------------------------------------------------------------- helpers
def _as_tuple(val: Any) -> tuple:
    return tuple(val) if isinstance(val, (tuple, list)) else (val,)


def _has_tensor_output(node: fx.Node) -> bool:
    return any(isinstance(v, torch.Tensor) for v in _as_tuple(node.meta.get("val")))


def _input_nodes(node: fx.Node) -> list[fx.Node]:
    from autopar.strategies import input_nodes

    return input_nodes(node)


def _unique(name: str, opts: list[StrategyOption]) -> str:
    taken = {o.name for o in opts}
    if name not in taken:
        return name
    k = 2
    while f"{name} #{k}" in taken:
        k += 1
    return f"{name} #{k}"


def _storage_base(node: fx.Node) -> fx.Node:
    """The node whose output owns ``node``'s storage (through views and ``getitem``)."""
    from autopar.tracer.profile import _is_view

    while node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node) and (
            node.target is operator.getitem or _is_view(node.target)):
        node = node.args[0]
    return node


def _is_float(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.dtype.is_floating_point


def _global_bytes(node: fx.Node, slots: list[fx.Node], activations: list[bool]) -> int:
    """Float bytes of the node's activation inputs and outputs (parameters are counted apart)."""
    vals = [s.meta.get("val") for s, act in zip(slots, activations) if act]
    vals += list(_as_tuple(node.meta.get("val")))
    return sum(v.numel() * v.dtype.itemsize for v in vals if _is_float(v))


def _activation_bytes(node: fx.Node, s: Strategy, slots: list[fx.Node], activations: list[bool],
                      global_bytes: int, parts: list[tuple[str, int]]) -> int:
    """Local bytes of the saved storages ``parts`` ((producer, global bytes)) under strategy ``s``.

    Each storage scales by the local fraction of the tensor it is: one the op made itself (its
    outputs, internal temporaries such as attention's logsumexp) by the strategy's output
    fraction; one made upstream by the fraction of the input slot whose value lives in that
    storage (through views and ``getitem``), under the strategy's input spec (a column-parallel
    linear keeps its replicated input whole, a row-parallel one its sharded input). A storage
    matching neither (an upstream value reached another way) takes the op's blended fraction:
    local/global bytes of all its activation inputs and outputs."""
    blended = min(_local_bytes(s, slots, activations) / global_bytes, 1.0) if global_bytes else 1.0
    out_global = sum(v.numel() * v.dtype.itemsize for v in _as_tuple(node.meta.get("val"))
                     if isinstance(v, torch.Tensor))
    out_frac = min(s.output_bytes / out_global, 1.0) if out_global else blended
    slot_frac: dict[str, float] = {}
    for k, src in enumerate(slots):
        val = src.meta.get("val")
        if not isinstance(val, torch.Tensor) or k >= len(s.input_bytes):
            continue
        full = val.numel() * val.dtype.itemsize
        if full:
            slot_frac.setdefault(_storage_base(src).name, min(s.input_bytes[k] / full, 1.0))
    total = 0.0
    for producer, nbytes in parts:
        frac = out_frac if producer == node.name else slot_frac.get(producer, blended)
        total += nbytes * frac
    return int(round(total))


def _local_bytes(s: Strategy, slots: list[fx.Node], activations: list[bool]) -> int:
    """The same bytes per device under strategy ``s``: what its saved activations scale by."""
    total = sum(s.input_bytes[i] for i, src in enumerate(slots)
                if activations[i] and _is_float(src.meta.get("val")))
    return total + s.output_bytes
