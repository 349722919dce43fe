"""Problem builder: traced graph + profile + mesh -> the solver's plain-data ``Problem``.

Decisions (``Problem`` nodes), in graph order:

- every **parameter** and **buffer** placeholder: its layout, one option per valid spec of ``R``, ``S(dim)``
  and a fused projection's ``S(dim/k)`` (``strategies.fused``) per mesh axis; ``param_bytes`` = local bytes x
  (1 parameter + 1 gradient + ``optimizer_multiplier`` state) for the whole step (gradients arrive in the
  parameter's layout: the gradient-layout invariant). Tied weights: one decision. Those a reader needs whole are
  gathered on the edge: that is ZeRO-3/FSDP, priced by the same conversion planner.
- every **user input**: its layout (the full input is on every rank; slicing it is free).
- every **op** with a sharding rule: one option per ``Strategy``. Its activation (what autograd
  saves for its backward, from the profile) scales with the strategy's local/global bytes and is
  live from the op's forward to its backward on a timeline ``fwd i -> i``, ``bwd i -> 2N-1-i``.

Recompute segments: every op inside a repeated block gets ``Node.segment``, a contiguous run of ops of one
module, and ``BuiltProblem.segment_inputs`` lists what each segment (and block) keeps when recomputed.
Values that need no decision resolve to their producer: ``getitem`` on a multi-output op reads
the producer's output element ``k``; ops without tensor output (metadata asserts) are skipped.
The graph **output** is one more (single-option) decision: the model returns full values, so
each returned tensor pays its conversion to replicated on the edge into it (a scalar loss's sum,
left in flight by the runtime, its bytes' time only: ``executed.pending_output_refund``).
The result (``autopar.planner.records``) is built once, then frozen: one ``Decision`` per
``Problem`` node (its kind, its ``Choice`` per option, the ``InputSlot`` each input slot reads).
Overlap (``autopar.solver.overlap``): a parameter's gradient sum, read directly in its own layout, is
asynchronous (an edge's ``async_costs``: ``executed.async_edge`` says which and why); all else is
synchronous. An op option's ``overlap_s`` is its backward compute, what such sums hide under.

Edges carry, for every (producer option, consumer strategy) pair, the forward + backward seconds
of the cheapest conversion from the producer's output spec to the spec the consumer's strategy
requires (``autopar.layout.conversion.plan_conversion``; each distinct spec pair is planned once),
and a parameter -> reader edge the bytes of the copy the reader gathers and saves, held from its
forward to its backward (``Edge.mem``: ``saved_bytes.gathered_copies``, ``saved_slots``).
"""

from __future__ import annotations

import itertools
import math
import operator
from types import MappingProxyType
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.fx as fx

from autopar.layout.conversion import conversion_seconds
from autopar.layout.mesh import MeshSpec
from autopar.layout.placement import R, Shard, TensorSpec
from autopar.planner.block_stamps import BlockStamps, Template
from autopar.layout.buckets import bucket_cap_bytes
from autopar.planner.executed import (ReaderChain, bucket_edges, last_bucket_params, pending_output_refund, sync_key,
                                      zero2_capable, zero2_edge)
from autopar.planner.records import BuiltProblem, Choice, ChosenConversion, Decision, InputSlot
from autopar.planner.saved_bytes import SELF, activation_bytes, edge_copies, global_bytes
from autopar.planner.segments import (node_vals, op_segments, saved_by, segment_inputs, storage_base,
                                      without_stateful_segments)
from autopar.planner.offload_pricing import offload_option, offload_tiers
from autopar.planner.options import PlanOptions
from autopar.planner.zero_pricing import zero2_priced_rs, zero_cost, zero_gather_cap
from autopar.plans import NodeKind
from autopar.layout.blocks import block_of
from autopar.solver.problem import Edge, Node, Problem, StrategyOption
from autopar.planner.pins import pins_of
from autopar.strategies import FixedAxis, Strategy, input_nodes, strategies_for
from autopar.strategies.fused import fused_segments, placeholder_segments
from autopar.strategies.grad_sums import comm_seconds, grad_sync_seconds, without_gradients
from autopar.tracer.graph import PLACEHOLDER_KEY, TracedGraph, values_needing_grad
from autopar.tracer.heap import frozen_heap
from autopar.tracer.precision import compute_dtype
from autopar.tracer.profile import ModelProfile

__all__ = ["BuiltProblem", "Choice", "ChosenConversion", "Decision", "InputSlot", "build_problem", "layout_specs"]

# Values held at rest the whole step (their bytes are param_bytes, not activations).
_AT_REST = (NodeKind.PARAMETER, NodeKind.BUFFER)


def layout_specs(shape: tuple[int, ...], mesh_shape: tuple[int, ...], segments: tuple = ()) -> list[TensorSpec]:
    """Every valid spec from ``R``/``S(dim)`` per axis, ``S(dim/k)`` for ``k`` in ``segments`` (no ``P``: at rest)."""
    per_axis = [R] + [Shard(d, k) for k in (1, *segments) for d in range(len(shape))]
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
                  budget_bytes: int | None, options: PlanOptions = PlanOptions(),
                  fixed: Callable[[fx.Node], FixedAxis | None] | None = None,
                  bucket_cap: int | None = None, segmented: bool = False) -> BuiltProblem:
    """``fixed``: op node -> the placements its strategies keep on one axis (mesh_search's 3-axis plans).
    ``bucket_cap``: bytes per gradient bucket the runtime will use (None: ``layout.buckets``'s; 0: none).
    ``segmented``: offer fused projections' parameters ``S(d/k)`` (the restricted Megatron-style plans); off,
    every parameter is a plain DTensor layout, which ``torch.distributed.checkpoint`` saves from
    ``model.state_dict()`` (it cannot describe a ``_StridedShard`` piece)."""
    with frozen_heap():  # the graph and profile are only read: full GC passes skip them
        return _Builder(traced, prof, mesh, budget_bytes=budget_bytes, options=options, fixed=fixed,
                        bucket_cap=bucket_cap, segmented=segmented).build()


class _Builder:
    """One build. ``build`` walks the graph once, filling the per-decision state below in graph
    order, then freezes it into a ``BuiltProblem``."""

    def __init__(self, traced: TracedGraph, prof: ModelProfile, mesh: MeshSpec, *,
                 budget_bytes: int | None, options: PlanOptions,
                 fixed: Callable[[fx.Node], FixedAxis | None] | None = None, stamp_blocks: bool = True,
                 bucket_cap: int | None = None, segmented: bool = False) -> None:
        self.traced, self.prof, self.mesh, self.fixed, self.segmented = traced, prof, mesh, fixed, segmented
        self.bucket_cap = bucket_cap_bytes() if bucket_cap is None else bucket_cap
        self.exposed = last_bucket_params(traced, cap=self.bucket_cap)  # their sums: synchronous
        self.budget, self.opts, self.gather_cap = budget_bytes, options, zero_gather_cap(traced.params)
        ops = [n for n in traced.compute_nodes() if _has_tensor_output(n) and n.target is not operator.getitem]
        self.num_ops = len(ops)
        self.op_index = {n.name: i for i, n in enumerate(ops)}  # op decision -> its timeline slot
        self.segment_of_op = op_segments((n.name, traced.module_path(n)) for n in ops)
        self.saver = saved_by(prof)  # storage id -> the node whose activation counts it
        self.needs_grad = values_needing_grad(traced)
        # Filled in graph order by ``build``:
        self.nodes: list[Node] = []
        self.decisions: dict[str, Decision] = {}
        self.chain = ReaderChain(self.decisions)  # fed as ops are added, in graph order
        self.sources: dict[str, tuple[str, int]] = {}  # value -> (decision, output index)
        self.values: dict[str, tuple[InputSlot | None, ...]] = {}  # decision -> its tensor outputs
        self.edges: dict[tuple[str, str], np.ndarray] = {}  # (producer, consumer) -> seconds per option pair
        self.edge_async: dict[tuple[str, str], np.ndarray] = {}  # of those, asynchronous seconds (overlap)
        self.fallbacks: list[str] = []
        # Caches: identical repeated blocks share strategies, choices and edge matrices.
        self._strategy_cache: dict[str, list[Strategy]] = {}
        self._choice_cache: dict[int, tuple[Choice, ...]] = {}  # id(strategy list) -> its choices
        self._layout_choices: dict[tuple[str, int], Choice] = {}  # one shared Choice per (layout, ZeRO stage)
        self._edge_cache: dict[Any, np.ndarray] = {}
        self._conv_cache: dict[Any, dict[str, float]] = {}  # (source layout, shape, itemsize) -> target -> s
        self._option_cache: dict[tuple, tuple[StrategyOption, ...]] = {}  # op options by relative key
        self._placeholder_cache: dict[tuple, tuple[tuple, tuple]] = {}  # (options, choices) by layout key
        self._base_cache: dict[str, str] = {}  # value -> the node owning its storage
        self._token_cache: dict[str, tuple] = {}  # value -> (shape, dtype) in op signatures
        self.offload_tiers = offload_tiers(traced, mesh, options)  # None: offload="none"
        self.pin = pins_of(traced, options, mesh)  # the degrees the user pinned (ParallelismOptions)
        # Repeated blocks: ops after block 2 are stamped from its records (``block_stamps``).
        self._stamps = BlockStamps(traced, self.needs_grad, self._storage_base) if stamp_blocks else None
        self._edge_log: list | None = None  # a template op's edges, in the order they are added
        self.num_stamped = 0

    def build(self) -> BuiltProblem:
        for node in self.traced.nodes:
            if node.op == "placeholder":
                self._placeholder(node)
            elif node.op == "call_function" and node.target is operator.getitem:
                src, _ = self.sources.get(node.args[0].name, (None, None))
                if src is not None:
                    self.sources[node.name] = (src, node.args[1])
            elif node.name in self.op_index:
                self._op(node)
            elif node.op == "output":
                self._output(node)
        problem = Problem(
            nodes=tuple(self.nodes),
            edges=self._edge_records(),
            budget_bytes=self.budget,
            timeline_length=max(2 * self.num_ops, 1),
            mesh_shape=tuple(self.mesh.shape),
            # "restriction": the unrestricted family (baseline families' problems name theirs)
            meta={"model": self.traced.model_name, "graph_hash": self.traced.graph_hash, "restriction": "autopar"},
            comm_overlap=self.mesh.comm_overlap,
        )
        problem = without_stateful_segments(problem, self.traced)
        fine = {n.name: n.segment for n in problem.nodes if n.segment is not None}
        blocks = {name: block_of(seg) for name, seg in fine.items()}
        kept = MappingProxyType({**segment_inputs(self.traced, self.prof, self.decisions, self.mesh.shape, fine,
                                                  base_of=self._storage_base),
                                 **segment_inputs(self.traced, self.prof, self.decisions, self.mesh.shape, blocks,
                                                  base_of=self._storage_base)})
        return BuiltProblem(problem=problem, decisions=MappingProxyType(self.decisions), mesh=self.mesh,
                            sources=MappingProxyType(self.sources), fallbacks=tuple(self.fallbacks),
                            segment_inputs=kept, bucket_cap=self.bucket_cap, gather_cap=self.gather_cap,
                            exposed=self.exposed)

    def _edge_records(self) -> tuple[Edge, ...]:
        """The ``Problem``'s edges. Repeated blocks share cost matrices (``_edge_cache``): each
        distinct matrix is converted and validated once, its repeats reuse the checked costs."""
        made: dict[tuple, Edge] = {}
        out = []
        for (src, dst), matrix in self.edges.items():
            asy = self.edge_async.get((src, dst))
            mem, live = self._copies(src, dst)
            template = made.get((id(matrix), id(asy), id(mem)))
            if template is None:
                edge = made[(id(matrix), id(asy), id(mem))] = Edge(
                    src, dst, tuple(map(tuple, matrix.tolist())), None if asy is None else asy.tolist(),
                    None if mem is None else mem.tolist(), None if mem is None else live)
            else:
                edge = template.moved(src, dst, live)
            out.append(edge)
        return tuple(out)

    def _copies(self, src: str, dst: str) -> tuple[np.ndarray | None, tuple[int, int] | None]:
        """A parameter -> op edge's gathered copies the op saves (``Edge.mem``), held from its forward
        to its backward."""
        if self.decisions[src].kind != NodeKind.PARAMETER or self.decisions[dst].kind != NodeKind.OP:
            return None, None
        i = self.op_index[dst]
        return edge_copies(self.decisions[src], self.decisions[dst], self.traced.node(dst), self.needs_grad,
                           tuple(self.mesh.shape), self._edge_cache), (i, 2 * self.num_ops - 1 - i)

    # ----------------------------------------------------------------------------- decisions
    def _placeholder(self, node: fx.Node) -> None:
        ph = node.meta.get(PLACEHOLDER_KEY)
        val = node.meta.get("val")
        if ph is None or not isinstance(val, torch.Tensor):
            return  # a non-tensor constant: nothing to lay out
        shape, itemsize = tuple(val.shape), val.dtype.itemsize
        # A lifted tensor constant is a buffer kept replicated.
        kind = NodeKind.BUFFER if ph.kind == NodeKind.CONSTANT else NodeKind(ph.kind)
        # Options and choices depend on the layout key only: each block's weights share them.
        segments = placeholder_segments(node) if kind == NodeKind.PARAMETER and self.segmented else ()  # fused
        key = (ph.kind, shape, itemsize, ph.requires_grad and bool(shape), segments)
        tiers = ("device",)
        if self.offload_tiers is not None and key[3]:  # trainable: offload tiers
            tiers = self.offload_tiers.get(node.name, ("device", "o", "po"))
            key = (*key, tiers)
        cached = self._placeholder_cache.get(key)
        if cached is None:
            cached = self._placeholder_cache[key] = self._layout_options(
                ph.kind, kind, shape, itemsize, trainable=key[3], tiers=tiers, segments=key[4])
        opts, choices = cached
        live = (0, max(2 * self.num_ops - 1, 0)) if kind == NodeKind.INPUT else None
        self._add(Decision(node.name, kind, choices, module=ph.fqn), opts, live=live,
                  block=block_of(ph.fqn), signature=f"{kind}{shape}{val.dtype}", vals=(val,))

    def _layout_options(self, ph_kind: str, kind: NodeKind, shape: tuple[int, ...], itemsize: int, *,
                        trainable: bool, tiers: tuple[str, ...] = ("device",), segments: tuple[int, ...] = (),
                        ) -> tuple[tuple[StrategyOption, ...], tuple[Choice, ...]]:
        """A placeholder's options and choices: one per layout (and ZeRO stage, parameters)."""
        if ph_kind == NodeKind.CONSTANT:
            specs = [TensorSpec.replicated(self.mesh.ndim)]
        else:
            specs = layout_specs(shape, self.mesh.shape, segments)  # S(d/k): a fused projection's weight
        opts, choices = [], []
        for spec in specs:
            local = math.prod(spec.local_shape(shape, self.mesh.shape)) * itemsize
            if kind == NodeKind.INPUT:
                opts.append(StrategyOption(str(spec), compute_s=0.0, act_bytes=int(local)))
            elif kind == NodeKind.PARAMETER:
                self._parameter_options(spec, local, spec_shape=shape, trainable=trainable, opts=opts,
                                        choices=choices, tiers=tiers, itemsize=itemsize)
                continue
            else:
                opts.append(StrategyOption(str(spec), compute_s=0.0, param_bytes=int(local)))
            choices.append(self._layout_choices.setdefault((str(spec), 0), Choice(str(spec), (spec,))))
        return tuple(opts), tuple(choices)

    def _parameter_options(self, spec: TensorSpec, local: int, *, spec_shape: tuple[int, ...], trainable: bool,
                           opts: list, choices: list, tiers: tuple[str, ...] = ("device",), itemsize: int = 4) -> None:
        """One option per ZeRO stage the options allow for ``spec`` (``"auto"``: 0, 1 and 2,
        named ``"RR"``, ``"RR z1"``, ``"RR z2"``; a stage with no replicated axis to shard over
        is stage 0 and is not repeated), in each offload tier of ``tiers`` (``offload_pricing``:
        ``"RR off:o"``, ``"RR z1 off:o"``; ``"RR off:po"`` once, at stage 0)."""
        wanted = (0, 1, 2) if self.opts.zero_stage == "auto" else (self.opts.zero_stage,)
        seen = set()
        for want in wanted:
            per_byte, comm_s, stage, step_s = zero_cost(spec, self.mesh, local, stage=want, ndim=len(spec_shape),
                                                        optimizer_multiplier=self.opts.optimizer_multiplier,
                                                        gather_cap=self.gather_cap, trainable=trainable)
            if stage in seen:
                continue
            seen.add(stage)
            name = str(spec) if stage == 0 or len(wanted) == 1 else f"{spec} z{stage}"
            if "device" in tiers:
                opts.append(StrategyOption(name, compute_s=step_s, comm_s=comm_s,
                                           param_bytes=int(round(local * per_byte))))
                choices.append(self._layout_choices.setdefault((name, stage), Choice(name, (spec,), zero_stage=stage)))
            if "o" in tiers and trainable:
                self._offload_option(spec, local, "o", name, stage, comm_s, spec_shape, itemsize, opts, choices)
        if "po" in tiers and trainable:
            self._offload_option(spec, local, "po", str(spec), 0, 0.0, spec_shape, itemsize, opts, choices)

    def _offload_option(self, spec: TensorSpec, local: int, tier: str, base: str, stage: int, comm_s: float,
                        spec_shape: tuple[int, ...], itemsize: int, opts: list, choices: list) -> None:
        opt = offload_option(spec, local, tier, base, mesh=self.mesh, stage=stage, comm_s=comm_s,
                             ndim=len(spec_shape), itemsize=itemsize, options=self.opts)
        opts.append(opt)
        choices.append(self._layout_choices.setdefault((opt.name, stage), Choice(opt.name, (spec,), zero_stage=stage)))

    def _op(self, node: fx.Node) -> None:
        shared = None
        if self._stamps is not None and node.name in self._stamps.template_of:
            shared = self._stamped(node)
            if shared is True:
                return
        signature = self._signature(node)
        slots = input_nodes(node)
        strategies = self._strategies(node, signature, slots)
        path = self.traced.module_path(node)
        if not strategies:
            raise ValueError(f"no sharding strategy for node {node.name!r} (op {node.target}, module "
                             f"{path or '<top level>'}) on mesh {self.mesh.shape}")
        i = self.op_index[node.name]
        parts = self._saved_parts(node)
        live = (i, 2 * self.num_ops - 1 - i) if parts else None
        activations = tuple(self._kind(src.name) not in _AT_REST for src in slots)
        inputs = tuple(self._value_of(src) for src in slots)
        # A value an earlier op reads too: its gradient sum is priced on the edge from that
        # reader, where their layouts differ (``planner.executed.ReaderChain``).
        if shared is None:  # (a stamp that failed its last check asked the chain already)
            shared = {slot: prev for slot, v in enumerate(inputs)
                      if (prev := self.chain.previous(node.name, slot, v)) is not None}
        zero2 = tuple(slot for slot in self._zero2_slots(inputs) if slot not in shared)
        # The options are a function of the strategy list (so of the signature), which slots
        # are activations, the saved parts relative to this node, and the ZeRO-2 / shared
        # slots: repeated blocks compute them once.
        rel_parts = self._relative_parts(node, slots, parts)
        # Slots whose gradient sum a bucket takes (``executed.async_edge``): a parameter's, read directly.
        bucketed = tuple(slot for slot, v in enumerate(inputs)
                         if slot not in shared and v is not None and self._kind(v.producer) == NodeKind.PARAMETER)
        key = (id(strategies), activations, rel_parts, zero2, tuple(shared), bucketed)
        opts = self._option_cache.get(key)
        if opts is None:
            opts = self._option_cache[key] = self._op_options(node, strategies, slots, activations, rel_parts,
                                                              zero2, tuple(shared), bucketed)
        decision = Decision(node.name, NodeKind.OP, self._choices_of(strategies), inputs, module=path,
                            op=str(node.target), bucketed=bucketed)
        self._add(decision, opts, live=live, block=block_of(path), signature=signature,
                  vals=node_vals(node), segment=self.segment_of_op[node.name])
        template = self._stamps is not None and node.name in self._stamps.is_template
        if template:
            self._edge_log = []
        self._edges_into(decision, shared=tuple(shared))
        for slot, (reader, reader_slot) in shared.items():
            self._add_edge(reader, decision.name, self._shared_sync_edge(self.decisions[reader].choices, reader_slot,
                                                                          decision.choices, slot))
        if template:
            self._stamps.keep(node.name, Template(
                decision, self.nodes[-1], self.values[node.name], tuple(parts), tuple(shared.items()),
                tuple(self._edge_log), fallback=bool(self.fallbacks) and self.fallbacks[-1] == node.name))
            self._edge_log = None

    def _stamped(self, node: fx.Node) -> bool | dict | None:
        """``node``'s records stamped from its block-2 template (``BlockStamps.stamp``)."""
        if self._pinned(node) != self._pinned(self._stamps.template_node(node.name)):
            return None
        done = self._stamps.stamp(self, node)
        self.num_stamped += done is True
        return done

    def _op_options(self, node: fx.Node, strategies: list[Strategy], slots: list[fx.Node],
                    activations: tuple[bool, ...], rel_parts: tuple, zero2: tuple[int, ...],
                    shared: tuple[int, ...], bucketed: tuple[int, ...]) -> tuple[StrategyOption, ...]:
        full_bytes = global_bytes(node, slots, activations)
        opts: list[StrategyOption] = []
        taken: set[str] = set()
        for s in strategies:
            act = activation_bytes(node, s, slots, activations, full_bytes, rel_parts) if rel_parts else 0
            # A ZeRO-2-capable parameter's gradient sum: the cheaper of reduce-scatter and all-reduce
            # here, the rest on the edge (``zero2_extra_s``); a shared slot's on its edge. Summed afresh,
            # not subtracted from comm_s (that left a tiny negative: grad_sums.comm_seconds). A bucketed
            # slot's sum as a bucket member; a converted read's whole latency on its edge (``bucket_edges``).
            rs = tuple(slot for slot in zero2 if zero2_priced_rs(s, slot, self.mesh, bucket_cap=self.bucket_cap))
            comm_s = comm_seconds(s, self.mesh, skip=shared, reduce_scatter=rs, bucketed=bucketed,
                                    bucket_cap=self.bucket_cap)
            name = _unique(s.name, taken)
            taken.add(name)
            # Backward compute: the op's whole compute less its forward part (clamped: both are
            # rooflines of one op, so the difference is its backward term up to rounding).
            opts.append(StrategyOption(name, compute_s=s.compute_s, comm_s=comm_s, act_bytes=act,
                                       forward_s=s.forward_compute_s + s.forward_comm_s,
                                       overlap_s=max(s.compute_s - s.forward_compute_s, 0.0)))
        return tuple(opts)

    def _relative_parts(self, node: fx.Node, slots: list[fx.Node],
                        parts: list[tuple[str, int]]) -> tuple[tuple[Any, int], ...]:
        """``parts`` with each producer named relative to ``node``: ``SELF`` for the node's own
        storages, else the input slots (in order) whose value lives in that storage, the ones
        ``saved_bytes.activation_bytes`` may scale it by (none: the op's blended fraction)."""
        if not parts:
            return ()
        bases = []
        for src in slots:
            val = src.meta.get("val")
            usable = isinstance(val, torch.Tensor) and val.numel() * val.dtype.itemsize > 0
            bases.append(self._storage_base(src) if usable else None)
        return tuple((SELF if producer == node.name else tuple(k for k, b in enumerate(bases) if b == producer),
                      nbytes) for producer, nbytes in parts)

    def _storage_base(self, src: fx.Node) -> str:
        base = self._base_cache.get(src.name)
        if base is None:
            base = self._base_cache[src.name] = storage_base(src).name
        return base

    def _output(self, node: fx.Node) -> None:
        """The model returns full values: every tensor output is converted to replicated."""
        flat = [a for a in self.traced.flat_outputs if isinstance(a, fx.Node)]
        full = TensorSpec.replicated(self.mesh.ndim)
        choice = Choice("R", (), inputs=tuple(full for _ in flat))
        decision = Decision(node.name, NodeKind.OUTPUT, (choice,), tuple(self._value_of(src) for src in flat))
        self._add(decision, [StrategyOption("R", compute_s=0.0)], live=None, block=None, signature="output",
                  vals=())
        self._edges_into(decision)
        for value in filter(None, decision.inputs):  # a scalar loss's sum is left in flight
            refund = pending_output_refund(self.decisions[value.producer].choices, value, self.mesh)
            if refund is not None:
                self.edges[value.producer, node.name] = self.edges[value.producer, node.name] - refund

    def _add(self, decision: Decision, opts: list[StrategyOption], *, live, block, signature: str,
             vals: Sequence[Any], segment: str | None = None) -> None:
        name = decision.name
        self.nodes.append(Node(name, tuple(opts), live=live, block=block, signature=signature, segment=segment))
        self.decisions[name] = decision
        self.sources[name] = (name, 0)
        self.values[name] = tuple(InputSlot(name, k, tuple(v.shape), v.dtype.itemsize)
                                  if isinstance(v, torch.Tensor) else None for k, v in enumerate(vals))

    def _kind(self, name: str) -> NodeKind | None:
        decision = self.decisions.get(name)
        return decision.kind if decision is not None else None

    def _value_of(self, src_node: fx.Node) -> InputSlot | None:
        """The laid-out tensor a graph value is (None: a SymInt or a non-tensor constant)."""
        src, idx = self.sources.get(src_node.name, (None, None))
        if src is None:
            return None
        outputs = self.values[src]
        return outputs[idx] if idx < len(outputs) else None

    def _saved_parts(self, node: fx.Node) -> list[tuple[str, int]]:
        """(producer, bytes) of the storages this node's activation accounts for: those whose
        last saver it is (``saved_by``); a profile without parts: its first-saver total."""
        prof = self.prof[node.name]
        if not prof.saved_parts:
            return [("", prof.saved_bytes)] if prof.saved_bytes else []
        return [(producer, nbytes) for sid, producer, nbytes in prof.saved_parts
                if self.saver.get(sid) == node.name]

    def _choices_of(self, strategies: list[Strategy]) -> tuple[Choice, ...]:
        """One Choice tuple per cached strategy list, so identical nodes share choice objects
        and their edges hit ``_edge_cache``."""
        cached = self._choice_cache.get(id(strategies))
        if cached is None:
            cached = self._choice_cache[id(strategies)] = tuple(Choice(s.name, s.output_specs, s) for s in strategies)
        return cached

    def _pinned(self, node: fx.Node) -> tuple:
        """(``fixed``'s axis, the user's ``Pin``) of ``node``: alike nodes pinned alike share a list."""
        return (None if self.fixed is None else self.fixed(node), None if self.pin is None else self.pin.key(node))

    def _strategies(self, node: fx.Node, key: str, slots: list[fx.Node]) -> list[Strategy]:
        fixed, pin = pinned = self._pinned(node)
        key = key if pinned == (None, None) else (key, pinned)
        cached = self._strategy_cache.get(key)
        if cached is None:
            prof = self.prof[node.name]
            cached = strategies_for(node, self.mesh, flops=(prof.fwd_flops, prof.bwd_flops),
                                    allow_replicate_fallback=self.opts.allow_replicate_fallback,
                                    reduce_itemsize=compute_dtype(self.opts.reduce_dtype).itemsize, fixed=fixed)
            cached = cached if pin is None else self.pin.keep(node, cached)
            self._strategy_cache[key] = cached
        if cached and cached[0].is_fallback:
            self.fallbacks.append(node.name)
        no_grad = tuple(i for i, src in enumerate(slots) if src.name not in self.needs_grad)
        if not no_grad:
            return cached
        # A value no trainable parameter feeds (rotary tables, masks) gets no gradient: its
        # partial-gradient all-reduce never runs, so it is not priced. (The same list when no
        # strategy has one: repeated nodes keep sharing one list, so one set of options.)
        resolved = self._strategy_cache.get((key, no_grad))
        if resolved is None:
            resolved = self._strategy_cache[(key, no_grad)] = (
                [without_gradients(s, no_grad, self.mesh) for s in cached]
                if any(s.grad_partial_axes[i] for s in cached for i in no_grad) else cached)
        return resolved

    def _signature(self, node: fx.Node) -> str:
        tokens = self._token_cache  # a value's token is read by each of its consumers: made once

        def token(a: Any) -> Any:
            if isinstance(a, fx.Node):
                tok = tokens.get(a.name)
                if tok is None:
                    v = a.meta.get("val")
                    tok = tokens[a.name] = ((tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor)
                                            else ("node", type(v).__name__))
                return tok
            if isinstance(a, (list, tuple)):
                return tuple(token(x) for x in a)
            return repr(a)

        outs = tuple((tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else None
                     for v in node_vals(node))
        kwargs = tuple(sorted((k, token(v)) for k, v in node.kwargs.items()))
        return repr((str(node.target), token(node.args), kwargs, outs, fused_segments(node)))

    # ---------------------------------------------------------------------------------- edges
    def _edges_into(self, dst: Decision, *, shared: tuple[int, ...] = ()) -> None:
        """One edge per producer feeding ``dst``; a producer read by several slots: summed. A
        ``shared`` slot (a later reader of its value: ``ReaderChain``) is summed with its previous
        reader's gradient, so a ZeRO-2 parameter's sum extra (``zero2_edge``) is not charged again."""
        for slot, value in enumerate(dst.inputs):
            if value is None:
                continue
            src = self.decisions[value.producer].choices
            miss = asy = None
            if slot in dst.bucketed:  # cached as the cost matrices: repeated blocks share them
                key = ("async", tuple(map(id, src)), value.index, tuple(map(id, dst.choices)), slot)
                if key not in self._edge_cache:
                    self._edge_cache[key] = bucket_edges(src, value, dst.choices, slot, self.mesh,
                                                         zero2=zero2_capable(self.decisions[value.producer]),
                                                         bucket_cap=self.bucket_cap)
                miss, asy = self._edge_cache[key]
                asy = None if value.producer in self.exposed else asy  # the last bucket hides nothing
            matrix = self._edge_matrix(src, value, dst.choices, slot, zero2=slot not in shared)
            self._add_edge(value.producer, dst.name, matrix if miss is None else matrix + miss, asy)

    def _add_edge(self, src: str, dst: str, matrix: np.ndarray, asy: np.ndarray | None = None) -> None:
        if self._edge_log is not None:
            self._edge_log.append((src, matrix, asy))
        key = (src, dst)
        self.edges[key] = self.edges[key] + matrix if key in self.edges else matrix
        if asy is not None:
            self.edge_async[key] = self.edge_async[key] + asy if key in self.edge_async else asy

    def _shared_sync_edge(self, src_choices: tuple[Choice, ...], src_slot: int, dst_choices: tuple[Choice, ...],
                          slot: int) -> np.ndarray:
        """The reader's gradient sum of input ``slot``, unless its previous reader (``src``,
        reading the same value in ``src_slot``) sums the same layout over the same axes."""
        key = ("sync", tuple(map(id, src_choices)), src_slot, tuple(map(id, dst_choices)), slot)
        matrix = self._edge_cache.get(key)
        if matrix is None:
            matrix = np.zeros((len(src_choices), len(dst_choices)))
            for j, dst in enumerate(dst_choices):
                cost = grad_sync_seconds(dst.strategy, slot, self.mesh) if dst.strategy is not None else 0.0
                if cost:
                    mine = sync_key(dst, slot)
                    for i, src in enumerate(src_choices):
                        matrix[i, j] = 0.0 if src.strategy is not None and sync_key(src, src_slot) == mine else cost
            self._edge_cache[key] = matrix
        return matrix

    def _edge_matrix(self, src_choices: tuple[Choice, ...], value: InputSlot, dst_choices: tuple[Choice, ...],
                     slot: int, *, zero2: bool = True) -> np.ndarray:
        # Keyed by the choice objects themselves: identical repeated blocks share them.
        key = (tuple(map(id, src_choices)), value.index, tuple(map(id, dst_choices)), slot, value.shape,
               value.itemsize, zero2)
        matrix = self._edge_cache.get(key)
        if matrix is None:
            # Options share few distinct specs: cost each distinct pair once, expand by index.
            src_keys, src_specs = _distinct([c.output_specs[value.index] for c in src_choices])
            dst_keys, dst_specs = _distinct([c.input_specs[slot] for c in dst_choices])
            unique = np.array([self._conversion_row(a, dst_specs, value) for a in src_specs])
            matrix = unique[np.ix_(src_keys, dst_keys)]
            if zero2 and any(c.zero_stage == 2 for c in src_choices):
                matrix = matrix + zero2_edge(src_choices, value, dst_choices, slot, self.mesh,
                                             bucket_cap=self.bucket_cap)
            self._edge_cache[key] = matrix
        return matrix

    def _zero2_slots(self, inputs: Sequence[InputSlot | None]) -> list[int]:
        """Input slots that read a parameter with a ZeRO-2 option."""
        return [slot for slot, v in enumerate(inputs) if v is not None and zero2_capable(self.decisions[v.producer])]

    def _conversion_row(self, a: TensorSpec | None, dsts: list[TensorSpec | None], value: InputSlot) -> list[float]:
        """Forward + backward seconds of converting ``value`` from ``a`` to each of ``dsts``
        (``plan_conversion``'s totals); each (layout, shape, dtype) source is searched once."""
        if a is None:
            return [0.0] * len(dsts)
        known = self._conv_cache.setdefault((str(a), value.shape, value.itemsize), {})
        missing = [b for b in dsts if b is not None and b != a and str(b) not in known]
        if missing:
            costs = conversion_seconds(a, missing, value.shape, value.itemsize, self.mesh)
            known.update(zip(map(str, missing), costs))
        return [0.0 if b is None or b == a else known[str(b)] for b in dsts]


def _distinct(specs: list[TensorSpec | None]) -> tuple[list[int], list[TensorSpec | None]]:
    """(index of each spec among the distinct ones, the distinct specs in first-seen order)."""
    seen: dict[str, int] = {}
    distinct, index = [], []
    for spec in specs:
        index.append(k := seen.setdefault("-" if spec is None else str(spec), len(distinct)))
        if k == len(distinct):
            distinct.append(spec)
    return index, distinct


# ----------------------------------------------------------------------------------- helpers
def _has_tensor_output(node: fx.Node) -> bool:
    return any(isinstance(v, torch.Tensor) for v in node_vals(node))


def _unique(name: str, taken: set[str]) -> str:
    if name not in taken:
        return name
    return next(f"{name} #{k}" for k in itertools.count(2) if f"{name} #{k}" not in taken)
