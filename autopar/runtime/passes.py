"""Emit the local graph one rank runs: traced global graph + plan -> local fx graph.

``emit_local_graph(traced, plan, pmesh, device=...)`` walks the traced graph once, in order,
and builds a NEW ``fx.Graph`` (the traced graph is left untouched) in which

- parameters and buffers are placeholders (meta ``STATE_KEY``) that receive this rank's local
  shard -- the module owns them as DTensors and passes their local tensors in, in placeholder
  order; lifted constants are ``get_attr`` nodes (the local shards are made by the caller; see
  :mod:`autopar.runtime.materialize`);
- user inputs are placeholders that receive the FULL global value on every rank (layout ``R``);
- every op runs on local shards under the strategy the plan chose: each input is first
  converted from the layout its producer emits to the layout the strategy reads, by one
  ``call_module`` node per reshard step (``self.all_gather(x, axis=1, src_dim=0)``). Conversion
  steps come from ``plan_conversion`` at build time; each distinct (value, target layout) is
  converted once and shared by all consumers;
- an input with ``grad_partial_axes`` goes through ``self.grad_all_reduce(x, axes=...)``
  (identity forward, all-reduce of its gradient backward: Megatron's "f"), once per
  (value, layout, axes); a parameter read in its own layout goes through
  ``self.grad_bucket(w, axes=..., slot=k)`` instead (bucketed: :mod:`autopar.runtime.bucketing`);
- shape arguments are rewritten to local sizes with the rule's ``local_args`` hook
  (``registry.local_arguments``) and ``device`` arguments point at this rank's device;
- a strategy with a custom kernel becomes a ``call_module`` on a :class:`KernelCall` backed by
  torch.distributed (:class:`autopar.runtime.kernels.DistComm`);
- ``getitem`` reads its producer's element (the producer's ``output_specs[k]``); ops without a
  tensor output (metadata asserts) run on whatever shard arrives when their rule accepts it;
- every output is converted to ``R`` (full values on every rank).

The result records each parameter/buffer's layout (``EmittedGraph.specs``) for the module.
"""

from __future__ import annotations

import copy
import operator
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autopar.plans import NodePlan, Plan
from autopar.runtime.bucketing import GradBucketer, bucket_cap_bytes
from autopar.runtime.early import EarlySumCall
from autopar.runtime.local_lookup import local_lookup_enabled, split_lookup
from autopar.runtime.nodes import Collective, GradAllReduce, KernelCall, kernel_context
from autopar.runtime.process_mesh import ProcessMesh
from autopar.runtime.table_wise import kernel_owners, owners_of
from autopar.runtime.table_wise import local_shape as table_local_shape
from autopar.layout.conversion import STEP_KINDS, plan_conversion
from autopar.layout.placement import TensorSpec
from autopar.strategies import OpInfo, Strategy, get_kernel, input_nodes, strategies_for
from autopar.strategies.expand import op_info
from autopar.strategies.fused import fused_segments
from autopar.strategies.registry import bind, local_arguments, needs_no_decision
from autopar.tracer.meta_keys import PARAM_CAST_KEY
from autopar.tracer.precision import compute_dtype
from autopar.tracer.graph import (BUFFER, INPUT, MODULE_KEY, PARAMETER, PLACEHOLDER_KEY, Placeholder,
                                  TracedGraph)

__all__ = ["EmittedGraph", "STATE_KEY", "TRACED_NAME_KEY", "emit_local_graph", "find_strategy"]

GRAD_ALL_REDUCE = "grad_all_reduce"
GRAD_BUCKET = "grad_bucket"
TRACED_NAME_KEY = "autopar_traced_name"  # emitted node meta: the traced node it comes from
STATE_KEY = "autopar_state"  # emitted placeholder meta: a parameter or buffer (not a user input)
_SUFFIX = re.compile(r" #\d+$")


@dataclass
class EmittedGraph:
    graph: fx.Graph
    modules: dict[str, torch.nn.Module]  # call_module / get_attr(module) targets -> module
    specs: dict[str, TensorSpec]  # parameter/buffer/constant placeholder name -> layout
    attr_of: dict[str, str]  # placeholder name -> attribute path (parameters, buffers: the FQN)
    num_conversions: int = 0
    kernels: list[str] = field(default_factory=list)


_STRATEGY_CACHE: dict[Any, list[Strategy]] = {}
_STRATEGY_CACHE_SIZE = 4096


def _signature(node: fx.Node) -> Any:
    """What a node's candidate strategies depend on: op, argument metadata, outputs."""
    def token(a: Any) -> Any:
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            return (tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else ("node", a.name)
        if isinstance(a, (list, tuple)):
            return tuple(token(x) for x in a)
        return repr(a)

    outs = tuple((tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else None
                 for v in _as_tuple(node.meta.get("val")))
    # A fused projection's way to its cut has S(d/k) options that a same-shaped op elsewhere lacks.
    return (str(node.target), token(node.args), tuple(sorted((k, token(v)) for k, v in node.kwargs.items())), outs,
            fused_segments(node))


def candidate_strategies(node: fx.Node, mesh, *, allow_replicate_fallback: bool) -> list[Strategy]:
    """``strategies_for`` without costs, cached by node signature (repeated blocks repeat)."""
    key = (_signature(node), mesh.shape, allow_replicate_fallback)
    hit = _STRATEGY_CACHE.get(key)
    if hit is None:
        hit = strategies_for(node, mesh, flops=(0.0, 0.0), allow_replicate_fallback=allow_replicate_fallback)
        if len(_STRATEGY_CACHE) >= _STRATEGY_CACHE_SIZE:
            _STRATEGY_CACHE.clear()
        _STRATEGY_CACHE[key] = hit
    return hit


def find_strategy(node: fx.Node, node_plan: NodePlan, plan: Plan) -> Strategy:
    """The ``Strategy`` a plan names for ``node`` (recomputed from the current rules)."""
    want = _SUFFIX.sub("", node_plan.strategy)
    candidates = candidate_strategies(node, plan.mesh, allow_replicate_fallback=node.name in plan.fallbacks)
    for s in candidates:
        if s.name == want:
            return s
    raise ValueError(
        f"the plan chose strategy {want!r} for node {node.name!r} (op {node.target}, module "
        f"{node.meta.get(MODULE_KEY) or '<top level>'}), which the current sharding rules do not "
        f"offer on mesh {plan.mesh.shape}; re-plan with this version of autopar"
    )


def emit_local_graph(traced: TracedGraph, plan: Plan, pmesh: ProcessMesh, *,
                     device: torch.device, local_inputs: bool = False, bucket_cap: int | None = None,
                     output_specs: dict[str, TensorSpec] | None = None,
                     pending_outputs: bool = False, early_sums: bool = False) -> EmittedGraph:
    """``local_inputs``: user inputs arrive as this rank's piece under the plan's input layout
    (instead of the full value). ``bucket_cap``: bytes per gradient bucket, None for
    ``bucket_cap_bytes()``; 0 emits in-graph ``grad_all_reduce`` nodes (plain autograd, which
    ``torch.autograd.grad`` and the pipeline's split backward need). ``output_specs``: traced
    value name -> the layout that output leaves in (default ``R``; a pipeline stage sends its
    boundary values in their producers' layouts). ``pending_outputs``: an output made replicated by
    one all-reduce (a data-parallel loss) is returned while that all-reduce is in flight, waited
    on at its first read (:mod:`autopar.runtime.pending`). ``early_sums``: a kernel's ``EarlySum``
    (a mean loss's denominator) is its own node, issued asynchronously and passed to the kernel
    (:mod:`autopar.runtime.early`; ``hoist_early_sums`` then moves it to the start of forward)."""
    return _Emitter(traced, plan, pmesh, torch.device(device), local_inputs, bucket_cap, output_specs,
                    pending_outputs=pending_outputs, early_sums=early_sums).run()


def _as_tuple(val: Any) -> tuple:
    return tuple(val) if isinstance(val, (tuple, list)) else (val,)


def _where(node: fx.Node) -> str:
    return f"node {node.name!r} (op {node.target}, module {node.meta.get(MODULE_KEY) or '<top level>'})"


class _Emitter:
    def __init__(self, traced: TracedGraph, plan: Plan, pmesh: ProcessMesh, device: torch.device,
                 local_inputs: bool, bucket_cap: int | None = None,
                 output_specs: dict[str, TensorSpec] | None = None, *, pending_outputs: bool = False,
                 early_sums: bool = False) -> None:
        self.output_specs = dict(output_specs or {})
        self.pending_outputs, self.early_sums = pending_outputs, early_sums  # see emit_local_graph
        self.traced, self.plan, self.pmesh, self.device = traced, plan, pmesh, device
        self.local_inputs = local_inputs
        self.mesh_shape = tuple(pmesh.shape)
        # Gradients are summed in this dtype (fp32 by default, also under bf16/fp16 compute).
        self.reduce_dtype = compute_dtype(plan.reduce_dtype)
        self.decisions = {n.name: n for n in plan.nodes}
        self.table_owners = owners_of(plan)
        self.graph = fx.Graph()
        self.modules: dict[str, torch.nn.Module] = {}
        self.specs: dict[str, TensorSpec] = {}
        self.attr_of: dict[str, str] = {}
        self.env: dict[str, Any] = {}  # traced node name -> new node (or a constant)
        self.layout: dict[str, Any] = {}  # traced node name -> spec (tuple of specs if multi-output)
        self.converted: dict[tuple, fx.Node] = {}
        self.num_conversions = 0
        self.kernels: list[str] = []
        taken = {name.split(".")[0] for p in traced.placeholders for name in p.aliases}
        self.comm_names = {}
        for kind in (*STEP_KINDS, GRAD_ALL_REDUCE):
            name = kind
            while name in taken:
                name = f"{name}_"
            self.comm_names[kind] = name
            self.modules[name] = GradAllReduce(pmesh, reduce_dtype=self.reduce_dtype) if kind == GRAD_ALL_REDUCE \
                else Collective(kind, pmesh)
        # Partial gradients of parameters are all-reduced in buckets (autopar.runtime.bucketing).
        cap = bucket_cap_bytes() if bucket_cap is None else bucket_cap
        self.bucketer = GradBucketer(pmesh, cap) if cap > 0 else None
        if self.bucketer is not None:
            name = GRAD_BUCKET
            while name in taken:
                name = f"{name}_"
            self.comm_names[GRAD_BUCKET] = name
            self.modules[name] = self.bucketer

    # ------------------------------------------------------------------------------- driver
    def run(self) -> EmittedGraph:
        for node in self.traced.graph.nodes:
            if node.op == "placeholder":
                self._placeholder(node)
            elif node.op == "get_attr":
                self._get_attr(node)
            elif node.op == "call_function":
                self._call(node)
            elif node.op == "output":
                self._output(node)
            else:
                raise NotImplementedError(f"the runtime cannot emit {node.op} {_where(node)}")
        used = {n.target for n in self.graph.nodes if n.op in ("call_module", "get_attr")}
        modules = {k: v for k, v in self.modules.items() if k in used}
        self.graph.lint()
        return EmittedGraph(self.graph, modules, self.specs, self.attr_of, self.num_conversions, self.kernels)

    def _copy_meta(self, new: fx.Node, old: fx.Node) -> fx.Node:
        new.meta[MODULE_KEY] = old.meta.get(MODULE_KEY, "")
        # fx renames a node whose name a conversion node already took ("split" -> "split_1"):
        # passes that look traced ops up by name (recompute regions) read this instead.
        new.meta[TRACED_NAME_KEY] = old.name
        return new

    # --------------------------------------------------------------------------- placeholders
    def _placeholder(self, node: fx.Node) -> None:
        ph: Placeholder = node.meta[PLACEHOLDER_KEY]
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            # A non-tensor constant input: inline its traced value.
            self.env[node.name] = self.traced.constants.get(ph.fqn, val)
            return
        decision = self.decisions.get(node.name)
        if ph.kind == INPUT:
            self.env[node.name] = self._copy_meta(self.graph.placeholder(node.name), node)
            spec = TensorSpec.replicated(len(self.mesh_shape))
            if self.local_inputs and decision is not None:
                spec = TensorSpec.parse(decision.output_specs[0])
            self.layout[node.name] = spec
            return
        if decision is None:
            raise ValueError(f"the plan has no layout for {ph.kind} {ph.fqn!r} (placeholder {node.name!r})")
        spec = TensorSpec.parse(decision.output_specs[0])
        self.specs[node.name] = spec
        if ph.kind in (PARAMETER, BUFFER):
            # The module owns it as a DTensor and passes its local tensor in (runtime/module.py).
            self.attr_of[node.name] = ph.fqn
            new = self.graph.placeholder(node.name)
            new.meta[STATE_KEY] = True
        else:
            self.attr_of[node.name] = f"_autopar_constants.{node.name}"
            new = self.graph.create_node("get_attr", self.attr_of[node.name], name=node.name)
        self.env[node.name] = self._copy_meta(new, node)
        self.layout[node.name] = spec

    def _get_attr(self, node: fx.Node) -> None:
        value = getattr(self.traced.gm, node.target)
        if not isinstance(value, torch.nn.Module):
            raise NotImplementedError(f"the runtime cannot emit a get_attr of a tensor {_where(node)}")
        self.modules[node.target] = self._on_device(value)  # e.g. the body of wrap_with_set_grad_enabled
        self.env[node.name] = self.graph.get_attr(node.target)

    def _on_device(self, module: torch.nn.Module) -> torch.nn.Module:
        """A sub-graph whose ``device`` arguments point at this rank's device (a copy)."""
        if not isinstance(module, fx.GraphModule):
            return module
        body = fx.GraphModule(module, copy.deepcopy(module.graph))
        for n in body.graph.nodes:
            n.args = pytree.tree_map(self._localise, n.args)
            n.kwargs = pytree.tree_map(self._localise, n.kwargs)
        body.recompile()
        return body

    # ---------------------------------------------------------------------------------- ops
    def _call(self, node: fx.Node) -> None:
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            src, k = node.args
            new = self.graph.create_node("call_function", operator.getitem, (self.env[src.name], k),
                                         name=node.name)
            self.env[node.name] = self._copy_meta(new, node)
            specs = self.layout.get(src.name)
            self.layout[node.name] = specs[k] if isinstance(specs, tuple) else specs
            return
        decision = self.decisions.get(node.name)
        if decision is not None:
            self._op(node, find_strategy(node, decision, self.plan))
        elif needs_no_decision(node):
            self._no_decision(node)
        else:
            raise ValueError(f"the plan has no strategy for {_where(node)}; was it made for this graph?")

    def _no_decision(self, node: fx.Node) -> None:
        """An op without tensor output: run it on the layouts that arrive when a strategy takes
        them, else on the first (replicated) strategy."""
        candidates = candidate_strategies(node, self.plan.mesh, allow_replicate_fallback=True)
        arriving = tuple(self.layout.get(src.name) for src in input_nodes(node))
        chosen = next((s for s in candidates if all(
            want is None or want == have for want, have in zip(s.input_specs, arriving))), candidates[0])
        self._op(node, chosen)

    def _op(self, node: fx.Node, strategy: Strategy) -> None:
        info = op_info(node)  # with a fused projection's segments: a slice's local bounds depend on them
        raw = bind(node.target, node.args, node.kwargs)
        slot = 0
        bound: dict[str, Any] = {}
        for name, value in raw.items():
            if isinstance(value, (list, tuple)):
                items = []
                for item in value:
                    if isinstance(item, fx.Node):
                        items.append(self._input(item, strategy, slot, node))
                        slot += 1
                    else:
                        items.append(self._localise(item))
                bound[name] = type(value)(items) if isinstance(value, tuple) else items
            elif isinstance(value, fx.Node):
                bound[name] = self._input(value, strategy, slot, node)
                slot += 1
            else:
                bound[name] = self._localise(value)
        if strategy.kernel is not None:
            new = self._kernel(node, info, strategy, bound)
        else:
            bound = local_arguments(node.target, info, bound, strategy.input_specs,
                                    strategy.output_specs, self.mesh_shape)
            args, kwargs = _split_bound(node.target, bound)
            new = self.graph.create_node("call_function", node.target, tuple(args), kwargs, name=node.name)
        self.env[node.name] = self._copy_meta(new, node)
        specs = strategy.output_specs
        self.layout[node.name] = specs if info.multi_output else specs[0]

    def _kernel(self, node: fx.Node, info: OpInfo, strategy: Strategy, bound: dict) -> fx.Node:
        kernel = get_kernel(strategy.kernel)
        name = self._unique(strategy.kernel)
        # A table-wise table whole on one device (Plan.tables): the kernel reads its rows from there.
        weight = input_nodes(node)[0].name if input_nodes(node) else ""
        ctx = kernel_context(info, strategy, self.pmesh, owners=kernel_owners(weight, self.table_owners))
        args, names = tuple(bound.values()), tuple(bound)
        axes = kernel.early.axes(ctx, bound) if self.early_sums and kernel.early is not None else ()
        axes = tuple(a for a in axes if self.pmesh.axis_size(a) > 1)
        if axes:  # the kernel's sum over ranks that its labels alone give: issued apart, early
            early = self._unique(f"{strategy.kernel}_early")
            self.modules[early] = EarlySumCall(kernel.name, kernel.early, ctx, axes, self.pmesh)
            reads = tuple(bound.get(r) for r in kernel.early.reads)
            args, names = (*args, self.graph.call_module(early, reads)), (*names, "early")
        self.modules[name] = KernelCall(kernel.name, kernel.fn, ctx, names)
        self.kernels.append(name)
        return self.graph.create_node("call_module", name, args, name=node.name)

    def _unique(self, base: str) -> str:
        name, k = base, 1
        taken = {n.split(".")[0] for n in self.attr_of.values()}
        while name in self.modules or name in taken:
            name, k = f"{base}_{k}", k + 1
        return name

    def _localise(self, value: Any) -> Any:
        """Non-tensor arguments: devices point at this rank's device."""
        if isinstance(value, torch.device):
            return self.device
        return value

    # -------------------------------------------------------------------------- conversions
    def _input(self, src: fx.Node, strategy: Strategy, slot: int, consumer: fx.Node) -> Any:
        value = self.env[src.name]
        want = strategy.input_specs[slot]
        if want is None or not isinstance(value, fx.Node):
            return value
        node = self._convert(src, want, consumer)
        axes = strategy.grad_partial_axes[slot]
        val = src.meta.get("val")
        if axes and isinstance(val, torch.Tensor) and val.dtype.is_floating_point:
            key = (src.name, want, tuple(axes), GRAD_ALL_REDUCE)
            param = self._bucketable_parameter(src, want) if node is self.env[src.name] else None
            if key not in self.converted and self.bucketer is not None and param is not None:
                # A bf16 cast of a parameter is bucketed as the parameter itself: its gradient
                # is summed in ``reduce_dtype`` and lands in the fp32 master's .grad.
                dtype = val.dtype if param is src else self.reduce_dtype
                owner = self.table_owners.get(param.name)  # a table-wise table: its owner's shape
                shape = (want.local_shape(tuple(val.shape), self.mesh_shape) if owner is None
                         else table_local_shape(want, owner, tuple(val.shape), self.pmesh))
                self.converted[key] = self._grad_bucket(param.name, node, axes, shape, dtype,
                                                        shard=self.decisions[param.name].zero_stage == 2)
            if key not in self.converted and node is self.env[src.name] and self._bucket_chain(src, want, axes):
                self.converted[key] = node  # its partial gradient flows to the parameter's bucket
            if key not in self.converted:
                self.converted[key] = self.graph.call_module(
                    self.comm_names[GRAD_ALL_REDUCE], (node,), {"axes": tuple(axes)})
            node = self.converted[key]
        return node

    def _bucket_chain(self, src: fx.Node, want: TensorSpec, axes) -> bool:
        """Bucket the parameter ``src`` is a linear function of, instead of all-reducing ``src``'s
        gradient in backward (a blocking collective): GPT-2's position embedding, looked up
        replicated and added to a batch-split activation. The gradient is linear along the chain,
        so summing the parameter's local gradients equals the parameter gradient of the summed
        activation gradient (exactly, when no two positions of the chain meet in one element, as
        for an embedding of distinct positions). Only a chain of single-use replicated values
        whose ops are linear in their first input and read no other floating input qualifies."""
        if self.bucketer is None:
            return False
        chain, node = [], src
        while node.op == "call_function":
            if (node.target not in _LINEAR_IN_FIRST | _SAME_DTYPE_CASTS or self.layout.get(node.name) != want
                    or len(_tensor_users(node)) != 1 or not _only_first_floating(node)):
                return False
            chain.append(node)
            node = input_nodes(node)[0]
        ph = node.meta.get(PLACEHOLDER_KEY)
        if (not chain or node.op != "placeholder" or ph is None or ph.kind != PARAMETER or not ph.requires_grad
                or self.layout.get(node.name) != want or _tensor_users(node) != [chain[-1]]):
            return False
        if self.decisions[node.name].zero_stage:
            # A ZeRO parameter's bucket reduces it as its pieces need (the runtime's zero/comm), which
            # this chain's partial sum has not been checked against: the blocking all-reduce stays.
            return False
        first, param = self.env[chain[-1].name], self.env[node.name]
        if param not in first.all_input_nodes:
            return False  # read through a conversion: not the parameter at rest
        with self.graph.inserting_before(first):
            bucket = self._grad_bucket(node.name, param, axes, want.local_shape(tuple(ph.shape), self.mesh_shape),
                                       ph.dtype, shard=self.decisions[node.name].zero_stage == 2)
        first.replace_input_with(param, bucket)
        return True

    def _grad_bucket(self, name: str, value: fx.Node, axes, shape, dtype, *, shard: bool = False) -> fx.Node:
        """A ``grad_bucket`` node of ``value`` for parameter ``name``'s new slot (its local
        ``shape`` and gradient ``dtype``, partial over ``axes``; ``shard``: ZeRO-2's)."""
        slot = self.bucketer.add_slot(name, axes, shape, dtype, shard=shard)
        return self.graph.call_module(self.comm_names[GRAD_BUCKET], (value,), {"axes": tuple(axes), "slot": slot})

    def _table_bucket(self, table: fx.Node, axes: tuple[int, ...]) -> fx.Node:
        """A ``grad_bucket`` node of ``table``'s placeholder (``split_lookup``'s partial gradient)."""
        ph = table.meta[PLACEHOLDER_KEY]
        return self._grad_bucket(table.name, self.env[table.name], axes,
                                 self.layout[table.name].local_shape(tuple(ph.shape), self.mesh_shape), ph.dtype)

    def _bucketable_parameter(self, src: fx.Node, want: TensorSpec) -> fx.Node | None:
        """The parameter placeholder whose gradient a bucket can take for ``src`` read as
        ``want``: ``src`` itself, or the parameter a mixed-precision cast ``src`` reads when the
        cast keeps its layout (so the reduced gradient fits the master's local shard)."""
        if src.op == "placeholder":
            return src if src.meta[PLACEHOLDER_KEY].kind == PARAMETER else None
        name = src.meta.get(PARAM_CAST_KEY)
        if name is None:
            return None
        param = self.traced.node(name)
        return param if self.layout.get(name) == want == self.layout.get(src.name) else None

    def _convert(self, src: fx.Node, want: TensorSpec, consumer: fx.Node) -> fx.Node:
        have = self.layout.get(src.name)
        node = self.env[src.name]
        if have is None or isinstance(have, tuple):
            raise ValueError(f"{_where(consumer)} reads {src.name!r}, whose layout is unknown")
        if have == want:
            return node
        key = (src.name, want)
        if key in self.converted:
            return self.converted[key]
        if self.bucketer is not None and local_lookup_enabled():
            local = split_lookup(self, src, want, consumer, self._table_bucket)
            if local is not None:
                self.converted[key] = local
                return local
        val = src.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise ValueError(f"{_where(consumer)}: input {src.name!r} is not a tensor but needs layout {want}")
        conv = plan_conversion(have, want, tuple(val.shape), val.dtype.itemsize, self.plan.mesh)
        for step in conv.steps:
            kwargs = {"axis": step.axis}
            if step.src_dim is not None:
                kwargs["src_dim"] = step.src_dim
            if step.dst_dim is not None:
                kwargs["dst_dim"] = step.dst_dim
            if step.segments != 1:
                kwargs["segments"] = step.segments
            node = self.graph.call_module(self.comm_names[step.kind], (node,), kwargs)
        self.num_conversions += 1
        self.converted[key] = node
        return node

    # ------------------------------------------------------------------------------- output
    def _output(self, node: fx.Node) -> None:
        replicated = TensorSpec.replicated(len(self.mesh_shape))

        def full(arg: Any) -> Any:
            if isinstance(arg, fx.Node):
                if self.layout.get(arg.name) is None:
                    return self.env[arg.name]
                if self.pending_outputs and arg.name not in self.output_specs:
                    pending = self._pending_reduce(arg, replicated)
                    if pending is not None:
                        return pending
                return self._convert(arg, self.output_specs.get(arg.name, replicated), node)
            return arg

        self.graph.output(pytree.tree_map(full, node.args[0], is_leaf=lambda x: isinstance(x, fx.Node)))

    def _pending_reduce(self, src: fx.Node, want: TensorSpec) -> fx.Node | None:
        """An output whose conversion to ``want`` is all-reduces only (a ``P`` loss, over one
        mesh axis or several): one all-reduce over them left in flight (``pending=True``),
        unless another consumer already converts it."""
        have, val = self.layout.get(src.name), src.meta.get("val")
        if (src.name, want) in self.converted or isinstance(have, tuple) or not isinstance(val, torch.Tensor):
            return None
        axes = plan_conversion(have, want, tuple(val.shape), val.dtype.itemsize, self.plan.mesh).sum_axes
        if axes is None:
            return None
        node = self.graph.call_module(self.comm_names["all_reduce"], (self.env[src.name],),
                                      {"axis": axes[0], "pending": True, **({"axes": axes} if len(axes) > 1 else {})})
        self.num_conversions += 1
        self.converted[(src.name, want)] = node
        return node


aten = torch.ops.aten
# Ops whose output is linear in their first input (their backward is a linear map of the
# gradient); ``_bucket_chain`` also requires every other input to be non-floating.
_LINEAR_IN_FIRST = frozenset({
    aten.embedding.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.alias.default, aten.expand.default, aten.clone.default,
    aten.contiguous.default, aten.permute.default, aten.transpose.int, aten.t.default, aten.slice.Tensor,
})
_SAME_DTYPE_CASTS = frozenset({aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default})


def _tensor_users(node: fx.Node) -> list[fx.Node]:
    """``node``'s consumers, without ops that produce no tensor (metadata asserts)."""
    return [u for u in node.users if not (u.op == "call_function" and needs_no_decision(u)
                                          and u.target is not operator.getitem)]


def _only_first_floating(node: fx.Node) -> bool:
    """Whether only ``node``'s first input is floating point (an embedding's indices are not),
    and a cast keeps the dtype (a rounding cast is not linear)."""
    ins = input_nodes(node)
    vals = [n.meta.get("val") for n in ins]
    if node.target is aten.embedding.default and bind(node.target, node.args, node.kwargs).get("sparse"):
        return False  # a sparse gradient has no bucket
    floating = [isinstance(v, torch.Tensor) and v.dtype.is_floating_point for v in vals]
    if not ins or not floating[0] or any(floating[1:]):
        return False
    out = node.meta.get("val")
    return node.target not in _SAME_DTYPE_CASTS or (isinstance(out, torch.Tensor) and out.dtype == vals[0].dtype)


def _split_bound(target: Any, bound: dict[str, Any]) -> tuple[list, dict]:
    """Positional and keyword arguments for ``target`` from schema-bound arguments; arguments
    equal to their schema default are left out (trailing positional ones), for readability."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return list(bound.values()), {}
    args, kwargs, pending = [], {}, []
    for a in schema.arguments:
        if a.name not in bound:
            continue
        value = bound[a.name]
        is_default = a.has_default_value() and _same(value, a.default_value)
        if a.kwarg_only:
            if not is_default:
                kwargs[a.name] = value
        elif is_default:
            pending.append(value)  # kept only if a later positional argument is not default
        else:
            args.extend(pending)
            pending = []
            args.append(value)
    return args, kwargs


def _same(value: Any, default: Any) -> bool:
    if isinstance(value, fx.Node) or isinstance(default, fx.Node):
        return False
    try:
        return type(value) is type(default) and bool(value == default)
    except Exception:  # noqa: BLE001 -- incomparable values are not defaults
        return False

