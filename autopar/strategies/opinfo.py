"""PyTorch's OpInfo samples as numerical-check samples for autopar's sharding rules.

``torch.testing._internal.common_methods_invocations.op_db`` describes ~700 torch functions,
each with a generator of sample calls. DTensor checks its own op coverage on them; autopar does
the same: every sample that reaches an ATen overload with a rule (``rule_for``: native, generic
or DTensor-derived) becomes an autopar ``Sample`` for that overload, and
``tests/strategies/test_opinfo.py`` runs every candidate strategy of the rule on it, forward and
backward (``check.py``). Derived rules have no samples of their own, so this is their check.

Which overload does a sample call?
---------------------------------
A sample calls a *Python* function (``torch.add``, ``F.cross_entropy``, ``Tensor.__rsub__``);
the planner sees the ATen overloads that ``torch.export`` keeps. A name lookup
(``aten.<name>``) would guess the overload (``sum`` is ``sum.default`` or ``sum.dim_IntList``
depending on the arguments) and miss renamed ones (``F.cross_entropy`` ->
``cross_entropy_loss``); a ``TorchDispatchMode`` sees the ops after autograd, where composite ops
(``linear``, ``layer_norm``) are already decomposed. So each sample is traced with autopar's own
tracer (``autopar.tracer.trace``, export non-strict on fake tensors) as a tiny module that makes
the call: the graph's ``call_function`` nodes are exactly what the planner would plan. The graph
is then run on the sample's real tensors (an ``fx.Interpreter``) to record each node's concrete
arguments, and every node whose overload has a rule yields one ``Sample`` with those arguments
(a sample whose function is a Python composite of several ops checks each ruled piece).

Export's fixed cost (~40 ms) dominates on such small calls, so the samples are traced in
batches of a few dozen calls per module (a batch that fails is bisected down to the culprit),
and names prune first: an OpInfo is traced only if an ATen packet
named like it (``aten_name``, ``name``, its last dotted part, ``name`` with dots as underscores,
its aliases) has an overload with a rule, or if no packet is named like it at all (its function
may reach any op: ``float`` -> ``_to_copy``, ``__rsub__`` -> ``rsub``). An OpInfo whose namesake
packet exists but has no rule is assumed to trace to that packet and is not traced.

Nothing here imports ``torch.testing._internal`` at import time: it needs ``expecttest``, a
test-only dependency, and takes seconds to import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autopar.strategies.registry import OpInfo, RuleEntry, Sample, bind, call_op

__all__ = ["OpInfoSample", "Collection", "op_db", "rule_lookup", "candidate_opinfos",
           "samples_of", "traced_batches", "collect", "preference", "quirk", "info_of", "describe"]

# A sample whose tensors together hold more elements than this is not used: every candidate
# strategy runs the op once per simulated rank, and OpInfo's small sizes (5, 10) already cover
# the indexing; big ones only cost time.
MAX_NUMEL = 1024


@dataclass(frozen=True)
class OpInfoSample:
    """One autopar ``Sample`` for ``target``, taken from sample ``index`` of OpInfo ``source``."""

    target: Any
    sample: Sample
    source: str  # OpInfo name, with ".variant" when it has one
    index: int
    direct: bool  # the node read only the sample's own tensors (not an intermediate value)
    quirk: str = ""  # "random": cannot be compared whatever the strategy (``quirk``)

    @property
    def even(self) -> bool:
        """Some tensor argument has a dim of even size: a 2-way split may exist."""
        return any(s % 2 == 0 and s >= 2 for t in _tensors(self.sample) for s in t.shape)


@dataclass
class Collection:
    """What ``collect`` found: samples per overload, plus the bookkeeping a report needs."""

    samples: dict[Any, list[OpInfoSample]] = field(default_factory=dict)
    traced: int = 0  # OpInfo samples traced
    mapped_opinfos: set[str] = field(default_factory=set)  # OpInfos that reached a ruled op
    trace_failures: dict[str, str] = field(default_factory=dict)  # OpInfo -> first error (untraced)

    def add(self, item: OpInfoSample) -> None:
        self.samples.setdefault(item.target, []).append(item)
        self.mapped_opinfos.add(item.source)


@contextlib.contextmanager
def _no_test_fn_lookup() -> Iterator[None]:
    """OpInfo's sample iterator looks for a running ``unittest.TestCase`` with ``inspect.stack()``
    to seed its samples by the test's name; outside unittest it finds none and uses its fixed seed.
    The stack walk resolves a module per frame and took two thirds of the test suite's collection
    time, so it is answered directly with that same ``None`` (the samples are unchanged)."""
    from torch.testing._internal import common_utils
    from torch.testing._internal.opinfo import core
    modules = (common_utils, core)  # core imported the function by name
    lookups = [m.extract_test_fn for m in modules]
    for m in modules:
        m.extract_test_fn = _no_test_fn
    try:
        yield
    finally:
        for m, lookup in zip(modules, lookups):
            m.extract_test_fn = lookup


def _no_test_fn() -> None:
    return None


# ------------------------------------------------------------------------------ lazy imports
def op_db() -> list:
    """PyTorch's OpInfo database (imported on first use: it is slow and needs ``expecttest``)."""
    try:
        from torch.testing._internal.common_methods_invocations import op_db as db
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            f"PyTorch's OpInfo database cannot be imported ({exc}); it needs the test-only "
            f"package 'expecttest' (pip install expecttest)") from exc
    return db


def rule_lookup() -> Callable[[Any], RuleEntry | None]:
    """``rule_for`` (native, generic, DTensor-derived) where it exists, else native rules only."""
    from autopar import strategies

    return getattr(strategies, "rule_for", None) or strategies.get_rule


# --------------------------------------------------------------------------------- pruning
def full_name(opinfo: Any) -> str:
    return f"{opinfo.name}.{opinfo.variant_test_name}" if opinfo.variant_test_name else opinfo.name


def _namesake_packets(opinfo: Any) -> list[Any]:
    names = [opinfo.aten_name, opinfo.name, opinfo.name.rsplit(".", 1)[-1], opinfo.name.replace(".", "_")]
    names += [a.name for a in getattr(opinfo, "aliases", ())]
    packets = []
    for name in names:
        packet = getattr(torch.ops.aten, name, None) if name else None
        if isinstance(packet, torch._ops.OpOverloadPacket) and packet not in packets:
            packets.append(packet)
    return packets


def candidate_opinfos(db: Iterable[Any], lookup: Callable[[Any], Any]) -> list[Any]:
    """The OpInfos worth tracing (see the module docstring): float64 on CPU, and a namesake
    packet with a ruled overload or no namesake packet at all."""
    out = []
    for opinfo in db:
        if torch.float64 not in opinfo.supported_dtypes("cpu"):
            continue
        packets = _namesake_packets(opinfo)
        if not packets or any(lookup(getattr(p, o)) is not None for p in packets for o in p.overloads()):
            out.append(opinfo)
    return out


# ------------------------------------------------------------------------------- conversion
class _Call(torch.nn.Module):
    """``fn(input, *args, **kwargs)`` of one OpInfo sample, its tensors as positional inputs."""

    def __init__(self, fn: Callable, structure: Any, constants: list) -> None:
        super().__init__()
        self.fn, self.structure, self.constants = fn, structure, constants

    def forward(self, *tensors: torch.Tensor) -> Any:
        it = iter(tensors)
        leaves = [next(it) if c is _TENSOR else c for c in self.constants]
        inp, args, kwargs = pytree.tree_unflatten(leaves, self.structure)
        return self.fn(inp, *args, **kwargs)


_TENSOR = object()


def _sample_numel(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() for t in tensors)


class _Recorder(fx.Interpreter):
    """Runs a traced graph on the sample's tensors, recording each op node's concrete arguments
    (copies) and which of its float arguments require a gradient there."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.calls: list[tuple[fx.Node, tuple, dict, tuple[str, ...]]] = []

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            # Copies: a later in-place op must not change what this op was called with.
            copy = lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
            self.calls.append((n, pytree.tree_map(copy, args), pytree.tree_map(copy, kwargs),
                               _no_grad_slots(n.target, args, kwargs)))
        return super().run_node(n)


def _no_grad_slots(target: Any, args: tuple, kwargs: dict) -> tuple[str, ...]:
    """The float tensor arguments that take no gradient in the sample's own call: the OpInfo
    marks what is differentiable (``requires_grad``), and an op may refuse a gradient for the
    others (batch norm's running statistics, a loss's class weight)."""
    names = []
    for name, value in bind(target, args, kwargs).items():
        items = value if isinstance(value, (list, tuple)) else (value,)
        floats = [v for v in items if isinstance(v, torch.Tensor) and v.is_floating_point()]
        if floats and not any(v.requires_grad for v in floats):
            names.append(name)
    return tuple(names)


@dataclass(frozen=True)
class _Pending:
    """One OpInfo sample waiting to be traced."""

    opinfo: Any
    index: int  # position in the OpInfo's sample generator
    sample_input: Any  # torch's ``SampleInput``


class _Calls(torch.nn.Module):
    """One ``_Call`` per sample, as submodules ``calls.<k>``: a node's module path names its
    sample."""

    def __init__(self, pending: list[_Pending]) -> None:
        super().__init__()
        calls, self.tensors = [], []
        for p in pending:
            s = p.sample_input
            leaves, structure = pytree.tree_flatten((s.input, s.args, s.kwargs))
            self.tensors += [v for v in leaves if isinstance(v, torch.Tensor)]
            calls.append(_Call(p.opinfo.op, structure, [_TENSOR if isinstance(v, torch.Tensor) else v
                                                        for v in leaves]))
        self.calls = torch.nn.ModuleList(calls)
        self.arity = [c.constants.count(_TENSOR) for c in calls]

    def forward(self, *tensors: torch.Tensor) -> list:
        outs, start = [], 0
        for call, n in zip(self.calls, self.arity):
            outs.append(call(*tensors[start:start + n]))
            start += n
        return outs


def samples_of(pending: list[_Pending], lookup: Callable[[Any], Any]) -> list[OpInfoSample]:
    """The autopar samples of some OpInfo samples: one per traced op node with a rule.

    The calls are traced together, as one module (export's fixed cost dominates on such small
    calls: one export for many samples is many times faster than one each).
    Raises what the tracer raises when a call cannot be traced.
    """
    from autopar.tracer import trace

    module = _Calls(pending)
    traced = trace(module, tuple(module.tensors), name="opinfo_samples")
    recorder = _Recorder(traced.gm)
    with torch.enable_grad():  # the sample's own requires_grad flags say what is differentiable
        recorder.run(*traced.bind(module, {f"args[{i}]": t for i, t in enumerate(module.tensors)}))
    out = []
    for node, args, kwargs, no_grad in recorder.calls:
        if lookup(node.target) is None:
            continue
        p = pending[_call_index(traced.module_path(node))]
        direct = all(a.op == "placeholder" for a in node.all_input_nodes)
        source = full_name(p.opinfo)
        label = f"opinfo {source}[{p.index}]" + ("" if direct else f" node {node.name}")
        out.append(OpInfoSample(node.target, Sample(tuple(args), dict(kwargs), label, no_grad),
                                source, p.index, direct))
    return out


def _traced_or_bisected(pending: list[_Pending], lookup: Callable[[Any], Any],
                        failures: dict[str, str]) -> list[OpInfoSample]:
    """``samples_of`` on the batch; when some call spoils it, on each half, down to single
    samples (whose errors are recorded in ``failures`` by OpInfo)."""
    try:
        return samples_of(pending, lookup)
    except Exception as exc:  # noqa: BLE001 - an untraceable call: find it, keep the rest
        if len(pending) == 1:
            failures.setdefault(full_name(pending[0].opinfo), f"{type(exc).__name__}: {exc}".splitlines()[0])
            return []
    half = len(pending) // 2
    return (_traced_or_bisected(pending[:half], lookup, failures)
            + _traced_or_bisected(pending[half:], lookup, failures))


def _call_index(module_path: str) -> int:
    """``calls.3`` (or a submodule of it) -> 3."""
    parts = module_path.split(".")
    if len(parts) < 2 or parts[0] != "calls" or not parts[1].isdigit():
        raise ValueError(f"traced node outside any sample call (module path {module_path!r})")
    return int(parts[1])


def _first_samples(opinfo: Any, limit: int, failures: dict[str, str],
                   window: int = 24) -> Iterator[tuple[int, Any]]:
    """Up to ``limit`` small float64 samples among the first ``window`` of ``opinfo``, those
    with the most even dims first (OpInfo starts with 0-d and 1-d samples; a reduction over a
    (2,) vector leaves nothing to split, a (3, 2, 1, 2) input leaves a dim to split)."""
    picked = []
    try:
        with _no_test_fn_lookup():
            samples = opinfo.sample_inputs("cpu", torch.float64, requires_grad=opinfo.supports_autograd)
        for i, s in enumerate(samples):
            if i >= window:
                break
            tensors = [v for v in pytree.tree_leaves((s.input, s.args, s.kwargs)) if isinstance(v, torch.Tensor)]
            if not tensors or _sample_numel(tensors) > MAX_NUMEL:
                continue
            even = sum(d % 2 == 0 and d >= 2 for t in tensors for d in t.shape)
            picked.append((-even, i, s))
    except Exception as exc:  # noqa: BLE001 - a generator that fails on CPU/float64: recorded
        failures.setdefault(full_name(opinfo), f"sample_inputs: {type(exc).__name__}: {exc}".splitlines()[0])
    picked.sort(key=operator.itemgetter(0, 1))
    for _, i, s in picked[:limit]:
        yield i, s


def traced_batches(batches: list[list[Any]]) -> list[tuple[list[OpInfoSample], dict[str, str]]]:
    """Per batch of OpInfo samples (``collect``'s pending calls): its autopar samples and the
    OpInfos it could not trace (name -> first error)."""
    lookup = rule_lookup()
    out = []
    for pending in batches:
        failures: dict[str, str] = {}
        out.append((_traced_or_bisected(pending, lookup, failures), failures))
    return out


def collect(*, per_opinfo: int = 3, per_op: int = 3, batch: int = 24, seed: int = 0,
            opinfos: Iterable[Any] | None = None, bucket: Callable[[OpInfoSample], Any] | None = None,
            prefer: Callable[[OpInfoSample], Any] | None = None,
            trace_batches: Callable[[list[list[Any]]], list] | None = None) -> Collection:
    """OpInfo samples for every ruled overload they reach.

    ``per_opinfo``: samples traced per OpInfo; ``batch``: samples traced in one export;
    ``per_op``: samples kept per bucket, where ``bucket(item)`` (default: the overload) groups
    them (the test keys expected failures by overload, OpInfo or quirk: each such group gets
    its own samples); the best ones by ``prefer(item) -> (class, tiebreak)`` (default
    ``preference``) are kept, from different OpInfos where the best class allows. Samples with a
    ``quirk`` are kept only for ops that have no other sample. ``trace_batches``: what traces
    the batches (default ``traced_batches``; a caller may spread them over processes).
    """
    lookup = rule_lookup()
    db = candidate_opinfos(op_db() if opinfos is None else opinfos, lookup)
    found = Collection()
    everything: list[OpInfoSample] = []
    # OpInfo fills its tensors from the global generator: a fixed seed makes the sweep
    # reproducible (same values, same failures) without touching the caller's random state.
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        pending = [_Pending(opinfo, i, s) for opinfo in db
                   for i, s in _first_samples(opinfo, per_opinfo, found.trace_failures)]
        found.traced = len(pending)
        batches = [pending[start:start + batch] for start in range(0, len(pending), batch)]
        for items, failures in (trace_batches or traced_batches)(batches):
            everything += items
            for name, error in failures.items():
                found.trace_failures.setdefault(name, error)
        everything = [dataclasses.replace(item, quirk=_quirk_or_blank(item)) for item in everything]
    prefer = prefer or preference
    bucket = bucket or (lambda item: item.target)
    checkable = {item.target for item in everything if not item.quirk}
    by_bucket: dict[Any, list[OpInfoSample]] = {}
    for item in everything:
        if item.quirk and item.target in checkable:
            continue  # other samples check this op; this one cannot be compared anyway
        by_bucket.setdefault(bucket(item), []).append(item)
    for items in by_bucket.values():
        for item in _diverse(items, prefer, per_op):
            found.add(item)
    return found


def _diverse(items: list[OpInfoSample], prefer: Callable[[OpInfoSample], Any], n: int) -> list[OpInfoSample]:
    """The ``n`` best items by ``prefer(item) = (class, tiebreak)``; within the best class, one
    per OpInfo first (``float``, ``half`` and ``double`` all reach ``to.dtype``: a bug may show
    on one only)."""
    ranked = sorted(items, key=prefer)  # stable: op_db's order within equal keys
    best = prefer(ranked[0])[0]
    picked, sources = [], set()
    for item in ranked:
        if prefer(item)[0] == best and item.source not in sources:
            picked.append(item)
            sources.add(item.source)
    picked += [item for item in ranked if all(item is not p for p in picked)]
    return sorted(picked[:n], key=prefer)


def preference(item: OpInfoSample) -> tuple:
    """``(class, tiebreak)``: samples without a ``quirk`` first, then those that call the op on
    the sample's own tensors, then those with an even dim (so a 2-way split may exist)."""
    return (item.quirk != "",), (not item.direct, not item.even)


def quirk(target: Any, sample: Sample) -> str:
    """Why a sample cannot be compared exactly whatever the strategy, or "".

    "random": the op draws from the global generator and its result depends on the seed
    (dropout, ``bernoulli``, ``normal_``): the reference and each simulated rank draw their own
    numbers. (NaN outputs compare equal where the unsharded op has NaN: ``check.py``.)
    """
    bound = bind(target, sample.args, sample.kwargs)
    gen = torch.default_generator  # what random ops draw from (torch.manual_seed is 1 ms a call)
    state = gen.get_state()
    try:
        with torch.no_grad():
            runs = [_listed(call_op(target, _cloned(bound)))]
            # An op that leaves the generator alone is deterministic: one call says it all.
            if not torch.equal(gen.get_state(), state):
                for seed in range(1, 4):  # several seeds: a bernoulli with p near 0 or 1 can agree twice
                    gen.manual_seed(seed)
                    runs.append(_listed(call_op(target, _cloned(bound))))
    finally:
        gen.set_state(state)
    if not all(_same(a, b) for run in runs[1:] for a, b in zip(runs[0], run)):
        return "random"
    return ""


def _quirk_or_blank(item: OpInfoSample) -> str:
    try:
        return quirk(item.target, item.sample)
    except Exception:  # noqa: BLE001 - the op fails on its own arguments: its test says how
        return ""


def info_of(item: OpInfoSample) -> OpInfo:
    """What the rule sees of ``item`` (metadata from one forward call, no gradient)."""
    bound = _cloned(bind(item.target, item.sample.args, item.sample.kwargs))
    with torch.no_grad():
        out = call_op(item.target, bound)
    return OpInfo.from_values(item.target, item.sample.args, item.sample.kwargs, out)


def _cloned(bound: dict[str, Any]) -> dict[str, Any]:
    # In-place ops (``normal_``) must not change the sample itself.
    return pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, bound)


def _listed(out: Any) -> list[Any]:
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _same(a: Any, b: Any) -> bool:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return True
    return a.shape == b.shape and bool(torch.equal(a, b) or (a.is_floating_point() and
                                                          torch.allclose(a, b, equal_nan=True)))


def _tensors(sample: Sample) -> list[torch.Tensor]:
    return [v for v in pytree.tree_leaves((sample.args, sample.kwargs)) if isinstance(v, torch.Tensor)]


def describe(found: Collection) -> str:
    """One paragraph for a report: how much of op_db reached ruled ops."""
    n = sum(len(v) for v in found.samples.values())
    return (f"{len(found.mapped_opinfos)} OpInfos reached {len(found.samples)} ruled overloads "
            f"({n} samples kept, {found.traced} traced, {len(found.trace_failures)} OpInfos untraceable)")

