"""Records and the registry of per-op sharding rules.

Vocabulary (see ``autopar/strategies/__init__.py`` for the how-to):

- ``TensorMeta``  -- global shape and dtype of one tensor (from ``node.meta["val"]``).
- ``OpInfo``      -- what a rule sees of one op call: the target, its arguments bound to schema
  names (tensors replaced by ``TensorMeta``), its tensor *input slots* and its outputs.
- ``AxisOption``  -- one way to run the op along ONE mesh axis: a placement per input slot and
  per output, which inputs get a partial gradient on that axis, whether the work is split, and
  the custom local kernel if "the same op on local shards" is not correct.
- ``Strategy``    -- one candidate for the whole mesh (built by ``expand.py``), with costs.

Input slots: the tensor arguments of the call in schema order, list arguments flattened (``cat``'s ``tensors``
gives one slot per element); ``Strategy.input_specs[i]`` belongs to ``input_nodes(node)[i]`` (the nodes in that order).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.fx

from autopar.layout.placement import Partial, Placement, Replicate, TensorSpec
from autopar.tracer.functions import function_draws
from autopar.tracer.meta_keys import MODULE_KEY, export_module_path

__all__ = [
    "TensorMeta", "InputSlot", "OpInfo", "AxisOption", "Strategy", "RuleEntry", "LocalKernel", "EarlySum",
    "NoRuleError", "register", "register_kernel", "get_rule", "get_kernel", "registered_targets",
    "input_nodes", "call_op", "Sample", "local_arguments", "needs_no_decision", "draws_random",
]

R = Replicate()
P = Partial()


class NoRuleError(LookupError):
    """No sharding rule is registered for an op; names the op, the node and its module path."""

    def __init__(self, target: Any, node_name: str = "?", module_path: str = "", *, random: bool = False) -> None:
        self.target, self.node_name, self.module_path = target, node_name, module_path
        where = module_path or "<top level>"
        if random:
            # No fallback for a random draw: replicated or not, each rank would draw from its own
            # torch generator, and the ranks would silently differ.
            hint = ("it draws random numbers, and only ops with a mesh-invariant rule may (autopar/strategies/"
                    "_random.py: each element a function of the seed and its global index); add one there, "
                    "or trace the model in eval mode / with that probability 0. The replicate fallback is "
                    "refused: each rank would draw its own numbers")
        else:
            hint = "add a rule in autopar/strategies/ or pass allow_replicate_fallback=True to replicate it"
        super().__init__(f"no sharding rule for op {target} (node {node_name!r}, module {where}); {hint}")


# ----------------------------------------------------------------------------------- metadata
@dataclass(frozen=True, slots=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, value: Any) -> "TensorMeta | None":
        if isinstance(value, torch.Tensor):
            return cls(tuple(int(s) for s in value.shape), value.dtype)
        return None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point or self.dtype.is_complex

    def local_nbytes(self, spec: TensorSpec | None, mesh_shape: Sequence[int]) -> int:
        if spec is None:
            return self.nbytes
        return math.prod(spec.local_shape(self.shape, mesh_shape)) * self.itemsize


@dataclass(frozen=True, slots=True)
class InputSlot:
    arg: str  # schema argument name
    index: int | None  # position inside a list argument, else None
    meta: TensorMeta | None  # None: the value is not a tensor (e.g. a SymInt node)


def _schema_args(target: Any) -> list[tuple[str, bool, bool, Any]]:
    """(name, kwarg_only, has_default, default) per schema argument; positional for non-ATen."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return []
    return [
        (a.name, a.kwarg_only, a.has_default_value(), a.default_value if a.has_default_value() else None)
        for a in schema.arguments
    ]


def bind(target: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Arguments by schema name, defaults filled in (``arg0, arg1 ...`` for non-ATen targets)."""
    spec = _schema_args(target)
    if not spec:
        out = {f"arg{i}": a for i, a in enumerate(args)}
        out.update(kwargs)
        return out
    out: dict[str, Any] = {}
    for i, (name, _kw_only, has_default, default) in enumerate(spec):
        if i < len(args):
            out[name] = args[i]
        elif name in kwargs:
            out[name] = kwargs[name]
        else:
            out[name] = default if has_default else None
    return out


def call_op(target: Any, bound: dict[str, Any]) -> Any:
    """Call ``target`` with arguments bound by ``bind`` (positional ones positionally)."""
    spec = _schema_args(target)
    if not spec:
        return target(*bound.values())
    args = [bound[name] for name, kw_only, _, _ in spec if not kw_only]
    kwargs = {name: bound[name] for name, kw_only, _, _ in spec if kw_only}
    return target(*args, **kwargs)


def _slots(bound: dict[str, Any], as_meta: Callable[[Any], tuple[bool, TensorMeta | None]]) -> tuple[InputSlot, ...]:
    slots = []
    for name, value in bound.items():
        if isinstance(value, (list, tuple)):
            for j, item in enumerate(value):
                is_input, meta = as_meta(item)
                if is_input:
                    slots.append(InputSlot(name, j, meta))
        else:
            is_input, meta = as_meta(value)
            if is_input:
                slots.append(InputSlot(name, None, meta))
    return tuple(slots)


def input_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The fx input nodes of ``node`` in slot order (``Strategy.input_specs`` order)."""
    bound = bind(node.target, node.args, node.kwargs)
    out = []
    for value in bound.values():
        items = value if isinstance(value, (list, tuple)) else (value,)
        out.extend(v for v in items if isinstance(v, torch.fx.Node))
    return out


@dataclass(frozen=True)
class OpInfo:
    """One op call as a rule sees it: global metadata only, no data."""

    target: Any
    bound: dict[str, Any]  # schema name -> value; tensors (and nodes) replaced by TensorMeta
    slots: tuple[InputSlot, ...]
    outputs: tuple[TensorMeta | None, ...]
    multi_output: bool
    node_name: str = "?"
    module_path: str = ""
    segments: tuple[int, ...] = ()  # the k whose S(d/k) the output may take (``expand.strategies_for``)

    # ------------------------------------------------------------------------ construction
    @classmethod
    def from_node(cls, node: torch.fx.Node) -> "OpInfo":
        def meta_of(v: Any) -> Any:
            if isinstance(v, torch.fx.Node):
                return TensorMeta.of(v.meta.get("val"))
            return v

        def as_meta(v: Any) -> tuple[bool, TensorMeta | None]:
            if isinstance(v, torch.fx.Node):
                return True, TensorMeta.of(v.meta.get("val"))
            return False, None

        raw = bind(node.target, node.args, node.kwargs)
        if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
            # ``getitem`` reads element ``k`` of a multi-output producer: its one input slot is
            # that element (the producer's ``output_specs[k]`` is the layout it arrives in).
            element = TensorMeta.of(node.meta.get("val"))
            raw = {"arg0": node.args[0], "arg1": node.args[1]}
            bound = {"arg0": element, "arg1": node.args[1]}
            slots = (InputSlot("arg0", None, element),)
            return cls(node.target, bound, slots, (element,), False, node.name, module_path_of(node))
        bound = {
            k: [meta_of(x) for x in v] if isinstance(v, (list, tuple)) else meta_of(v)
            for k, v in raw.items()
        }
        outputs, multi = _output_metas(node.meta.get("val"))
        return cls(node.target, bound, _slots(raw, as_meta), outputs, multi, node.name, module_path_of(node))

    @classmethod
    def from_values(cls, target: Any, args: Sequence[Any], kwargs: dict[str, Any], output: Any,
                    *, node_name: str = "sample", segments: tuple[int, ...] = ()) -> "OpInfo":
        """From concrete (or fake) tensors; used by the numerical check and cost estimates."""
        raw = bind(target, args, kwargs)

        def meta_of(v: Any) -> Any:
            return TensorMeta.of(v) if isinstance(v, torch.Tensor) else v

        def as_meta(v: Any) -> tuple[bool, TensorMeta | None]:
            return (True, TensorMeta.of(v)) if isinstance(v, torch.Tensor) else (False, None)

        bound = {
            k: [meta_of(x) for x in v] if isinstance(v, (list, tuple)) else meta_of(v)
            for k, v in raw.items()
        }
        outputs, multi = _output_metas(output)
        return cls(target, bound, _slots(raw, as_meta), outputs, multi, node_name, "", tuple(segments))

    # ----------------------------------------------------------------------------- queries
    def arg(self, name: str) -> Any:
        if name not in self.bound:
            raise KeyError(f"op {self.target} has no argument {name!r}; arguments: {list(self.bound)}")
        return self.bound[name]

    def input(self, name: str, index: int | None = None) -> TensorMeta | None:
        i = self.slot_index(name, index)
        return None if i is None else self.slots[i].meta

    def slot_index(self, name: str, index: int | None = None) -> int | None:
        for i, s in enumerate(self.slots):
            if s.arg == name and s.index == index:
                return i
        return None

    @property
    def output(self) -> TensorMeta:
        """The single tensor output (rules for single-output ops)."""
        if self.multi_output or self.outputs[0] is None:
            raise ValueError(f"op {self.target} (node {self.node_name}) has no single tensor output")
        return self.outputs[0]

    def where(self) -> str:
        return f"op {self.target}, node {self.node_name!r}, module {self.module_path or '<top level>'}"

    # ------------------------------------------------------------------------ option builder
    def option(this, output: Placement | Sequence[Placement | None], /, *, kernel: str | None = None,
               work_split: bool | None = None, grad_partial: Sequence[str] | None = None,
               **inputs: Placement | Sequence[Placement]) -> "AxisOption":
        """An ``AxisOption`` with input placements given by argument name (``self=Shard(0)``).

        Tensor slots not named are ``Replicate``; a list argument takes a list of placements.
        ``grad_partial`` names the inputs whose local gradient is partial on this axis; when
        omitted it is derived (see ``AxisOption``).
        """
        unknown = set(inputs) - {s.arg for s in this.slots}
        if unknown:
            raise ValueError(f"{this.where()}: no tensor input named {sorted(unknown)}")
        placements = []
        for s in this.slots:
            if s.meta is None:
                placements.append(None)
                continue
            p = inputs.get(s.arg, R)
            if s.index is not None and isinstance(p, (list, tuple)):
                p = p[s.index]
            placements.append(p)
        outs = tuple(output) if isinstance(output, (list, tuple)) else (output,)
        gp = None
        if grad_partial is not None:
            gp = tuple(s.arg in grad_partial for s in this.slots)
        return AxisOption(tuple(placements), outs, gp, work_split, kernel)


def _output_metas(val: Any) -> tuple[tuple[TensorMeta | None, ...], bool]:
    if isinstance(val, (list, tuple)):
        return tuple(TensorMeta.of(v) for v in val), True
    return (TensorMeta.of(val),), False


def module_path_of(node: torch.fx.Node) -> str:
    """Dotted path of the module that owns ``node`` ("" for the root module).

    The tracer's ``MODULE_KEY`` when set (every node of a ``TracedGraph`` has it); a graph
    straight from ``torch.export`` has only export's module stack: its innermost entry.
    """
    if MODULE_KEY in node.meta:
        return str(node.meta[MODULE_KEY])
    return export_module_path(node)


# ------------------------------------------------------------------------------ rule records
@dataclass(frozen=True, slots=True)
class AxisOption:
    """One way to run an op along one mesh axis.

    inputs:       one placement per input slot (None for non-tensor slots).
    outputs:      one placement per output (a 1-tuple for single-output ops).
    grad_partial: per input slot, whether its local gradient is partial on this axis (the
                  strategy all-reduces it in its backward: Megatron's "f"). None = derived: a
                  floating input that is Replicate on an axis where the option is not all-R.
    work_split:   whether the op's work is divided by the axis size. None = derived: any input
                  or output is not Replicate.
    kernel:       name of a registered ``LocalKernel``; None = the same op on local shards.
    """

    inputs: tuple[Placement | None, ...]
    outputs: tuple[Placement | None, ...]
    grad_partial: tuple[bool, ...] | None = None
    work_split: bool | None = None
    kernel: str | None = None

    def is_replicate(self) -> bool:
        return all(p is None or isinstance(p, Replicate) for p in self.inputs + self.outputs)


@dataclass(frozen=True, slots=True)
class Strategy:
    """One candidate way to run one node on the whole mesh, with per-device costs.

    name:              ``"S0R x RS1 -> S0S1"`` (input specs joined by " x ", then the output).
    input_specs:       one ``TensorSpec`` per input slot (None for non-tensor slots).
    output_spec:       a ``TensorSpec``, or a tuple of them for multi-output ops.
    grad_partial_axes: per input slot, mesh axes over which that input's local gradient is
                       partial; the op's backward all-reduces it (cost included in ``comm_s``).
    compute_s:         forward + backward roofline seconds of the local op on one device.
    comm_s:            forward + backward seconds of communication inside the op.
    forward_compute_s / forward_comm_s: the forward parts (what recompute costs).
    output_bytes:      per-device bytes of the (local) output(s).
    input_bytes:       per-device bytes of each input slot under its spec.
    grad_sync_bytes:   per input slot, bytes its partial gradient moves on the wire (the input's
                       local bytes, widened to the reduce dtype; 0 when not partial).
    kernel_bwd_comm_s: backward seconds of the custom kernel's own collectives: with
                       ``forward_comm_s`` and the gradient sums, the terms of ``comm_s``
                       (re-priced per planner decision by ``grad_sums.comm_seconds``).
    kernel:            custom local kernel name; None = the same ATen op on local shards.
    work_split_axes:   mesh axes over which the work is divided.
    is_fallback:       replicated because no rule exists (``allow_replicate_fallback=True``).
    """

    name: str
    input_specs: tuple[TensorSpec | None, ...]
    output_spec: TensorSpec | tuple[TensorSpec | None, ...]
    grad_partial_axes: tuple[tuple[int, ...], ...]
    compute_s: float
    comm_s: float
    forward_compute_s: float
    forward_comm_s: float
    output_bytes: int
    input_bytes: tuple[int, ...]
    kernel: str | None = None
    work_split_axes: tuple[int, ...] = ()
    is_fallback: bool = False
    grad_sync_bytes: tuple[int, ...] = ()
    kernel_bwd_comm_s: float = 0.0

    @property
    def output_specs(self) -> tuple[TensorSpec | None, ...]:
        """The output spec(s) as a tuple, whatever the op's arity."""
        return self.output_spec if isinstance(self.output_spec, tuple) else (self.output_spec,)


def strategy_name(input_specs: Sequence[TensorSpec | None], output_specs: Sequence[TensorSpec | None],
                  multi_output: bool) -> str:
    ins = " x ".join(str(s) if s is not None else "_" for s in input_specs) or "()"
    outs = [str(s) if s is not None else "_" for s in output_specs]
    out = f"({', '.join(outs)})" if multi_output else outs[0]
    return f"{ins} -> {out}"


# --------------------------------------------------------------------------------- samples
@dataclass(frozen=True)
class Sample:
    """Concrete arguments for the numerical check (float64 tensors; small, divisible by 4)."""

    args: tuple
    kwargs: dict = field(default_factory=dict)
    label: str = ""
    no_grad: tuple[str, ...] = ()  # float inputs that take no gradient (e.g. a loss's class weight)
    segments: tuple[int, ...] = ()  # the ``OpInfo.segments`` to check under (a fused projection's)


# -------------------------------------------------------------------------------- registry
RuleFn = Callable[[OpInfo], Iterable[AxisOption]]


@dataclass(frozen=True, slots=True)
class RuleEntry:
    target: Any
    rule: RuleFn
    samples: Callable[[], list[Sample]]
    family: str
    has_flops: bool  # count FLOPs with torch.utils.flop_counter (else the op is memory-bound)
    combine_check: Callable[[OpInfo, tuple[AxisOption, ...]], bool] | None
    # (info, bound, input_specs, output_specs, mesh_shape) -> bound with shape arguments rewritten
    # to local sizes: the rewrite the runtime applies to the plain op (view sizes, expand ...).
    local_args: Callable[..., dict[str, Any]] | None = None
    # The rule offers only the replicated strategy, by design (documented in its family).
    replicate_only: bool = False
    # info -> the kernel EVERY strategy of the call runs (the all-replicated one included), or
    # None for the plain op: random draws run the counter-based generator on one device too.
    kernel_for: Callable[[OpInfo], str | None] | None = None


@dataclass(frozen=True, slots=True)
class LocalKernel:
    """A local implementation for strategies whose semantics differ from the plain op.

    fn(ctx, **bound_args) -> output: runs on one rank; ``ctx`` is a ``KernelContext`` (the
    communication interface plus the strategy's specs); tensors in ``bound_args`` are local.
    comm_cost(info, input_specs, output_specs, mesh) -> (forward_s, backward_s).
    work_share(info, input_specs, mesh_shape) -> (axes, share) or None: the share of the op's
    FLOPs one rank computes over the work-split mesh ``axes``, where it is not ``1 / prod(sizes)``
    (a causal zig-zag ring computes fewer, not all, of the unmasked blocks); None: the even share.
    saved_bytes(info, strategy) -> int or None: the bytes per device the kernel saves for backward
    where they are not the profiled op's (``tracer.profile`` runs torch's kernel, which may keep
    other tensors: the CPU fused attention a float copy of a bool mask); None: the profile's.
    """

    name: str
    fn: Callable[..., Any]
    comm_cost: Callable[..., tuple[float, float]]
    work_share: Callable[..., tuple[tuple[int, ...], float] | None] | None = None
    saved_bytes: Callable[..., int | None] | None = None
    early: "EarlySum | None" = None


@dataclass(frozen=True, slots=True)
class EarlySum:
    """A sum over ranks that a kernel needs and that reads none of its differentiable inputs (a
    mean loss's denominator: how many targets are not ignored). The runtime computes this rank's
    summand as soon as the arguments it reads exist and all-reduces it asynchronously, so the
    ranks do not meet at the kernel; the kernel then receives the global sum as its keyword
    argument ``early`` (None: the kernel all-reduces ``summand`` itself through ``ctx.comm``, as
    the numerical check runs it -- the same summand and the same sum either way).

    reads: the kernel arguments ``summand`` takes.
    axes(ctx, args) -> the mesh axes to sum over, () when this call needs no such sum; ``args``
    are the kernel's bound arguments as the emitter holds them (tensors are graph nodes there:
    decide from the non-tensor arguments and ``ctx``'s specs).
    summand(ctx, **reads) -> this rank's part, a tensor that takes no gradient.
    """

    reads: tuple[str, ...]
    axes: Callable[..., tuple[int, ...]]
    summand: Callable[..., Any]


_RULES: dict[Any, RuleEntry] = {}
_KERNELS: dict[str, LocalKernel] = {}


def register(*targets: Any, samples: Callable[[], list[Sample]], has_flops: bool = False,
             combine_check: Callable[[OpInfo, tuple[AxisOption, ...]], bool] | None = None,
             local_args: Callable[..., dict[str, Any]] | None = None,
             replicate_only: bool = False,
             kernel_for: Callable[[OpInfo], str | None] | None = None) -> Callable[[RuleFn], RuleFn]:
    """Register a single-axis rule for one or more ATen overloads (decorator).

    ``samples`` returns concrete inputs for the numerical check (required: every rule is
    checked). ``combine_check(info, per_axis_options)`` may veto a multi-axis combination.
    ``local_args(info, bound, input_specs, output_specs, mesh_shape) -> bound`` rewrites shape
    arguments to local sizes for the plain local op (see ``local_arguments``).
    ``replicate_only=True`` declares a rule that offers only replication on purpose.
    ``kernel_for(info) -> name | None``: a local kernel every strategy of that call runs, the
    all-replicated one included (random draws: ``_random.py``); it is also the numeric check's
    reference. A call that ``draws_random`` is planned only when it names one.
    """
    if not targets:
        raise ValueError("register() needs at least one op overload")

    def deco(rule: RuleFn) -> RuleFn:
        for t in targets:
            if t in _RULES:
                raise ValueError(f"a sharding rule for {t} is already registered "
                                 f"(by {_RULES[t].family}.{_RULES[t].rule.__name__})")
            family = rule.__module__.rsplit(".", 1)[-1]
            _RULES[t] = RuleEntry(t, rule, samples, family, has_flops, combine_check, local_args, replicate_only,
                                  kernel_for)
        return rule

    return deco


def register_kernel(name: str, *, comm_cost: Callable[..., tuple[float, float]],
                    work_share: Callable[..., tuple[tuple[int, ...], float] | None] | None = None,
                    saved_bytes: Callable[..., int | None] | None = None,
                    early: EarlySum | None = None) -> Callable:
    """Register a custom local kernel under ``name`` (decorator); ``early``: see ``EarlySum``."""

    def deco(fn: Callable) -> Callable:
        if name in _KERNELS:
            raise ValueError(f"local kernel {name!r} is already registered")
        _KERNELS[name] = LocalKernel(name, fn, comm_cost, work_share, saved_bytes, early)
        return fn

    return deco


def get_rule(target: Any) -> RuleEntry | None:
    return _RULES.get(target)


def get_kernel(name: str) -> LocalKernel:
    if name not in _KERNELS:
        raise KeyError(f"unknown local kernel {name!r}; registered: {sorted(_KERNELS)}")
    return _KERNELS[name]


def registered_targets() -> list[Any]:
    return sorted(_RULES, key=str)


def local_arguments(target: Any, info: OpInfo, bound: dict[str, Any], input_specs: Sequence[TensorSpec | None],
                    output_specs: Sequence[TensorSpec | None], mesh_shape: Sequence[int]) -> dict[str, Any]:
    """``bound`` (one rank's arguments) with shape arguments rewritten to local sizes.

    Ops whose arguments carry global sizes (``view``'s ``size``, ``expand``, ``new_ones`` ...)
    register ``local_args``; the runtime applies the same rewrite when it emits the local op,
    and the numerical check applies it before running the plain op on the shards. Splits are
    even, so the rewritten arguments are the same on every rank.
    """
    entry = _RULES.get(target)
    if entry is None or entry.local_args is None:
        return bound
    return entry.local_args(info, dict(bound), tuple(input_specs), tuple(output_specs), tuple(mesh_shape))


def needs_no_decision(node: torch.fx.Node) -> bool:
    """Whether the planner may skip ``node``: its layout is fixed by its producer.

    - ``operator.getitem`` on a multi-output op: element ``k`` keeps the layout the producer
      emits for its output ``k`` (``strategies_for`` still answers, with identity strategies);
    - ops without a tensor output (``aten._assert_tensor_metadata``): nothing is laid out; the
      op runs on whatever shard arrives (its rule checks that the local op accepts shards).
    """
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    val = node.meta.get("val")
    values = val if isinstance(val, (list, tuple)) else (val,)
    return not any(isinstance(v, torch.Tensor) for v in values)


_FUNCTION = torch.ops.autopar.autograd_function.default  # a user autograd.Function (``tracer.functions``)


def draws_random(target: Any, bound: dict[str, Any]) -> bool:
    """Whether a call (arguments bound by schema name) draws random numbers: an op tagged
    ``nondeterministic_seeded`` (dropout, ``rand``, ``bernoulli``, ``rrelu``, attention and RNNs
    with a dropout argument) unless it is off: ``train``/``training`` False or a literal dropout
    probability of 0; a user autograd.Function whose forward or backward draws (``tracer.functions``)."""
    if target is _FUNCTION:
        return function_draws(bound["key"])
    if torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ()):
        return False
    if bound.get("train") is False or bound.get("training") is False:
        return False
    for name in ("p", "dropout_p", "dropout"):
        p = bound.get(name)
        if isinstance(p, (int, float)) and not isinstance(p, bool):
            return p != 0
    return True
