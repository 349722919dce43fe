"""Rules derived by mechanism, for ops that have no native rule.

``rule_for(target)`` answers in this order (op coverage is a mechanism, docs/architecture.md):

1. **native**: a rule registered in one of the family files (``register``);
2. **generic**, from the op's tags and schema:
   - every op tagged ``torch.Tag.pointwise`` with one tensor output gets the broadcasting
     pointwise rule (``_pointwise.broadcast_options``): split any output dim, inputs follow where
     they have it at full size. No ``Partial`` pass-through: a generic op is not known to be
     linear;
   - a reduction by schema: one tensor input ``self``, a ``dim`` argument and a ``keepdim`` flag,
     every output of the reduced shape (``var``, ``std``, ``var_mean``, ``prod``, ``logsumexp``,
     ``any``, ``norm`` ...): split any dim that is not reduced. Reduced dims are not split (the
     reduction is not known to be a sum);
3. **decomposed** (not a rule: the tracer's ``decompose_if`` replaces the node by the ops of its
   decomposition before planning; see ``needs_decomposition``);
4. **DTensor-derived**: torch's own single-mesh-dim sharding strategies
   (``torch.distributed.tensor``'s ``op_single_dim_strategy_funcs``: the part of DTensor's
   propagation written, like autopar's rules, for one mesh axis and needing no device mesh).
   Each candidate ``[outputs..., inputs...]`` becomes an ``AxisOption``: ``Shard(d)`` and the
   sharding placeholder -> ``Shard(d)``, ``Replicate`` -> ``R``, a sum ``Partial`` -> ``P``;
   candidates with other reductions (max, avg) or strided shards are dropped. DTensor runs
   some of these ops with arguments rewritten to local sizes, or with its own gradient
   handling, so a derived candidate is only *offered* once it has passed the numeric check
   (``check.py``) on the node's own shapes and arguments with random data, on a mesh axis of
   size 2 (cached per signature). Inputs above ``_ADMISSION_NUMEL`` elements are too large to
   check while planning: such a node gets only the replicated strategy (correct, not fast).

Derived rules carry no samples of their own: ``tests/strategies/test_opinfo.py`` checks them on
PyTorch's OpInfo samples.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from autopar.layout.placement import Partial, Replicate, Shard
from autopar.strategies.combine import build_strategies, freeze, normalise_option
from autopar.strategies.registry import AxisOption, OpInfo, RuleEntry, TensorMeta, get_rule

__all__ = ["rule_for", "rule_source", "needs_decomposition", "has_decomposition", "SOURCES"]

R, P = Replicate(), Partial()

# How an op is covered, best first (``autopar coverage`` prints these words).
SOURCES = ("native", "generic", "decomposed", "dtensor", "fallback", "missing")


# Ops of other libraries, by qualified name -> (rule, samples) in a family file. Looked up by
# name so that autopar imports none of them; the op exists once its library registered it.
FOREIGN_RULES: dict[str, tuple[str, str, str]] = {
    "transformers::grouped_mm_fallback": ("_moe", "grouped_mm_rule", "grouped_mm_samples"),
}


def rule_for(target: Any) -> RuleEntry | None:
    """The rule that plans ``target``: native, else generic, else DTensor-derived, else None."""
    entry = get_rule(target)
    if entry is not None:
        return entry
    return _foreign(target) or _derived(target)


@functools.cache
def _foreign(target: Any) -> RuleEntry | None:
    name = getattr(target, "_schema", None) and target._schema.name
    if name not in FOREIGN_RULES:
        return None
    import importlib

    module, rule, samples = FOREIGN_RULES[name]
    family = importlib.import_module(f"{__package__}.{module}")
    return RuleEntry(target, getattr(family, rule), getattr(family, samples), module, has_flops=True,
                     combine_check=None)


def rule_source(target: Any) -> str:
    """'native', 'generic', 'dtensor' or '' (no rule) for ``target``."""
    if get_rule(target) is not None or _foreign(target) is not None:
        return "native"
    entry = _derived(target)
    return "" if entry is None else entry.family


def needs_decomposition(target: Any) -> bool:
    """Whether the tracer should decompose ``target``: no native or generic rule, and PyTorch
    has a decomposition for it (DTensor-derived candidates come after decomposition)."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if get_rule(target) is not None or _foreign(target) is not None or _generic(target) is not None:
        return False
    return has_decomposition(target)


def has_decomposition(target: torch._ops.OpOverload) -> bool:
    from torch._decomp import decomposition_table

    return target in decomposition_table or _is_composite_implicit(target)


def _is_composite_implicit(target: torch._ops.OpOverload) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(target.name(), "CompositeImplicitAutograd")


@functools.cache
def _derived(target: Any) -> RuleEntry | None:
    if not isinstance(target, torch._ops.OpOverload):
        return None
    return _generic(target) or _dtensor(target)


def _no_samples() -> list:
    return []


def _entry(target: Any, rule, family: str) -> RuleEntry:
    return RuleEntry(target, rule, _no_samples, family, has_flops=False, combine_check=None)


# ------------------------------------------------------------------------------- generic
def _returns(target: torch._ops.OpOverload) -> list[str]:
    return [str(r.type) for r in target._schema.returns]


def _tensor_args(target: torch._ops.OpOverload) -> list[str]:
    return [a.name for a in target._schema.arguments if "Tensor" in str(a.type)]


@functools.cache
def _generic(target: Any) -> RuleEntry | None:
    if not isinstance(target, torch._ops.OpOverload):
        return None
    returns = _returns(target)
    if torch.Tag.pointwise in target.tags and returns == ["Tensor"]:
        return _entry(target, _pointwise_rule, "generic")
    names = {a.name: str(a.type) for a in target._schema.arguments}
    if (_tensor_args(target) == ["self"] and "keepdim" in names and "dim" in names
            and "int" in names["dim"] and returns and all(r == "Tensor" for r in returns)):
        return _entry(target, _reduction_rule, "generic")
    return None


def _pointwise_rule(info: OpInfo) -> list[AxisOption]:
    from autopar.strategies._pointwise import broadcast_options

    if info.multi_output or info.outputs[0] is None:
        return []
    return broadcast_options(info)


def _reduction_rule(info: OpInfo) -> list[AxisOption]:
    from autopar.strategies._reduction import reduction_options

    self = info.input("self")
    if self is None or any(m is None for m in info.outputs):
        return []
    options = reduction_options(info, reduced_split=None, linear=False)
    if info.multi_output:  # every output has the reduced shape: they split alike
        options = [AxisOption(o.inputs, o.outputs * len(info.outputs), o.grad_partial, o.work_split, o.kernel)
                   for o in options]
    return options


# ------------------------------------------------------------------------------- DTensor
def _single_dim_strategies() -> dict:
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher.sharding_propagator.op_single_dim_strategy_funcs


def _dtensor(target: torch._ops.OpOverload) -> RuleEntry | None:
    try:
        table = _single_dim_strategies()
    except Exception:  # noqa: BLE001 - a torch build without distributed: no derived rules
        return None
    if target not in table:
        return None
    return _entry(target, _dtensor_rule, "dtensor")


def _dtensor_meta(meta: TensorMeta) -> Any:
    from torch.distributed.tensor._dtensor_spec import TensorMeta as DTensorMeta

    shape = torch.Size(meta.shape)
    stride, acc = [], 1
    for size in reversed(meta.shape):
        stride.append(acc)
        acc *= max(size, 1)
    return DTensorMeta(shape, tuple(reversed(stride)), meta.dtype)


def _to_dtensor(value: Any) -> Any:
    if isinstance(value, TensorMeta):
        return _dtensor_meta(value)
    if isinstance(value, list):
        return [_to_dtensor(v) for v in value]
    return value


def _dtensor_schema(info: OpInfo) -> tuple[tuple, dict]:
    args, kwargs = [], {}
    for a in info.target._schema.arguments:
        value = _to_dtensor(info.bound.get(a.name))
        if a.kwarg_only:
            kwargs[a.name] = value
        else:
            args.append(value)
    return tuple(args), kwargs


def _placement(p: Any) -> Any:
    """autopar's placement for one DTensor placement, or ``False`` when it has none."""
    from torch.distributed.tensor import Partial as DPartial
    from torch.distributed.tensor import Replicate as DReplicate
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder

    if p is None:
        return None
    if isinstance(p, _ShardingPlaceholder) or type(p) is DShard:
        return Shard(p.dim)
    if isinstance(p, DReplicate):
        return R
    if isinstance(p, DPartial) and p.reduce_op == "sum":
        return P
    return False


def _dtensor_rule(info: OpInfo) -> list[AxisOption]:
    func = _single_dim_strategies()[info.target].func
    args, kwargs = _dtensor_schema(info)
    try:
        candidates = func(info.target, args, kwargs)
    except Exception:  # noqa: BLE001 - DTensor has no strategy for these arguments
        return []
    num_out = len(info.outputs)
    tensor_slots = [i for i, s in enumerate(info.slots) if s.meta is not None]
    options = []
    for cand in candidates:
        if len(cand) != num_out + len(tensor_slots):
            continue
        placements = [_placement(p) for p in cand]
        if any(p is False for p in placements):
            continue
        outs = tuple(None if m is None else p for m, p in zip(info.outputs, placements[:num_out]))
        if any(m is not None and p is None for m, p in zip(info.outputs, outs)):
            continue
        ins: list[Any] = [None] * len(info.slots)
        for i, p in zip(tensor_slots, placements[num_out:]):
            ins[i] = p if p is not None else R
        # A pending sum passed through is the full-size work on every rank.
        split = None if not any(isinstance(p, Partial) for p in ins) else False
        options.append(AxisOption(tuple(ins), outs, None, split, None))
    return _admitted(info, options)


_ADMISSION_NUMEL = 1 << 21
_ADMITTED: dict[Any, tuple[bool, ...]] = {}


def _admitted(info: OpInfo, options: list[AxisOption]) -> list[AxisOption]:
    """The options that pass the numeric check on this node's own shapes (see module doc)."""

    if not options:
        return []
    key = (info.target, tuple(freeze(v) for v in info.bound.items()), tuple(options))
    if key not in _ADMITTED:
        _ADMITTED[key] = tuple(_passes(info, o) for o in options)
    return [o for o, ok in zip(options, _ADMITTED[key]) if ok]


def _passes(info: OpInfo, option: AxisOption) -> bool:
    from autopar.strategies.check import StrategyMismatch, check_strategy, reference
    from autopar.layout.mesh import MeshSpec

    if sum(s.meta.numel for s in info.slots if s.meta is not None) > _ADMISSION_NUMEL:
        return False
    sample = _random_sample(info)
    try:
        ref = reference(info.target, sample)
        mesh = MeshSpec.preset("cpu", (2,))
        entry = _entry(info.target, lambda _: [option], "dtensor")
        strategies = build_strategies(ref[0], mesh, entry, [[normalise_option(ref[0], option)]], (0.0, 0.0),
                                      fallback=False)
        if not strategies:
            return False  # uneven on an axis of 2: cannot be checked here
        check_strategy(info.target, sample, strategies[0], (2,), ref=ref)
    except (StrategyMismatch, RuntimeError, ValueError, TypeError, IndexError):
        return False
    return True


def _random_sample(info: OpInfo):
    """Concrete arguments like ``info.bound``: float64 noise for float tensors, zeros else."""
    from autopar.strategies.registry import Sample

    gen = torch.Generator().manual_seed(0)

    def make(v: Any) -> Any:
        if isinstance(v, TensorMeta):
            if v.is_float:
                return torch.randn(v.shape, dtype=torch.float64, generator=gen)
            return torch.zeros(v.shape, dtype=v.dtype)
        if isinstance(v, list):
            return [make(x) for x in v]
        return v

    args, kwargs = [], {}
    for a in info.target._schema.arguments:
        (kwargs.__setitem__(a.name, make(info.bound.get(a.name))) if a.kwarg_only
         else args.append(make(info.bound.get(a.name))))
    # Tensors the op writes in place (running statistics) take no gradient.
    written = tuple(a.name for a in info.target._schema.arguments
                    if a.alias_info is not None and a.alias_info.is_write)
    return Sample(tuple(args), kwargs, "admission", no_grad=written)
