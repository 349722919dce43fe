"""What a chosen plan executes per step, as the runtime emits it (``runtime.passes``).

The emitted graph converts a value to a layout ONCE for all the consumers that read it there,
and sums a partial gradient ONCE per (value, layout, mesh axes): the consumers' gradients meet
in autograd before the all-reduce (or, for a ZeRO-2 parameter read in its own layout, the
reduce-scatter into its pieces). The ILP prices each consumer's conversion and gradient sum on
its own -- its costs are per option and per edge -- so it counts a shared conversion once per
consumer; a shared gradient sum it prices along each value's ``ReaderChain`` (exact when the
readers agree). ``Plan.estimate`` (``planner.checkpointing.estimate``) and the inspect report
count what runs: ``shared_savings`` is the difference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from autopar.layout.buckets import first_cap_bytes_default, split_buckets
from autopar.layout.conversion import plan_conversion
from autopar.layout.cost import collective_seconds
from autopar.layout.placement import TensorSpec
from autopar.plans import NodeKind
from autopar.planner.records import BuiltProblem, ChosenConversion, InputSlot
from autopar.planner.zero_pricing import zero2_extra_s
from autopar.strategies import Strategy
from autopar.strategies.grad_sums import grad_sync_seconds

__all__ = ["GradSync", "ReaderChain", "async_edge", "bucket_edges", "bucketed_async_s", "grad_syncs",
           "last_bucket_params", "pending_output_refund", "pending_output_seconds", "sync_key",
           "unique_conversions", "shared_savings", "zero2_capable", "zero2_edge"]


@dataclass(frozen=True, slots=True)
class GradSync:
    """The backward sum of one value's partial gradient, read as ``spec`` by ``consumer``'s
    ``slot`` (the first consumer; later ones share it): an all-reduce over ``axes``, or a
    reduce-scatter into the pieces of a ZeRO-2 parameter read in its own layout."""

    consumer: str
    slot: int
    value: InputSlot
    spec: TensorSpec
    axes: tuple[int, ...]
    strategy: Strategy
    kind: str  # all_reduce | reduce_scatter
    bucketed: bool = False  # issued asynchronously in a gradient bucket (``Decision.bucketed``)
    bucket_cap: int = 0  # that bucket's cap in bytes (``BuiltProblem.bucket_cap``; 0: no buckets)
    exposed: bool = False  # in the last bucket, issued as backward ends (``last_bucket_params``)

    def seconds(self, mesh) -> float:
        cap = self.bucket_cap * self.bucketed
        own = grad_sync_seconds(self.strategy, self.slot, mesh, self.kind, bucket_cap=cap)
        if self.kind == "reduce_scatter":  # or an all-reduce where cheaper (``runtime.zero.comm.ScatterPlan``)
            return min(own, grad_sync_seconds(self.strategy, self.slot, mesh, bucket_cap=cap))
        return own

    def async_seconds(self, mesh) -> float:
        """Of ``seconds``, what a gradient bucket issues asynchronously (0 when not bucketed)."""
        return bucketed_async_s(self.strategy, self.slot, mesh, self.kind,
                                bucket_cap=self.bucket_cap) if self.bucketed and not self.exposed else 0.0


def bucket_edges(src_choices, value: InputSlot, dst_choices, slot: int, mesh, *, zero2: bool,
                 bucket_cap: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(the extra, the asynchronous) seconds of the edge into ``slot`` (a bucketed slot:
    ``Decision.bucketed``, whose option priced its gradient sum as a member of a ``bucket_cap``
    bucket) per (producer option, reader option); None where all are 0.

    The runtime buckets the sum only where the reader takes the value in the producer's own
    layout (``runtime.passes``); a converted read is summed in-graph at one whole latency: the
    extra is that sum less the bucketed one (for a ZeRO-2-capable parameter, ``zero2`` -- the
    parameter's own edge charges it, ``zero2_edge`` -- None here). The asynchronous part is the
    bucketed sum (``bucketed_async_s``; a reduce-scatter for ``zero2``) on the own-layout pairs."""
    kind = "reduce_scatter" if zero2 else "all_reduce"
    extra = np.zeros((len(src_choices), len(dst_choices)))
    for j, dst in enumerate(dst_choices):
        s = dst.strategy
        if s is None or not s.grad_partial_axes[slot] or zero2:
            continue
        miss = grad_sync_seconds(s, slot, mesh) - grad_sync_seconds(s, slot, mesh, bucket_cap=bucket_cap)
        for i, src in enumerate(src_choices):
            if src.output_specs[value.index] != dst.input_specs[slot]:
                extra[i, j] = miss
    asy = async_edge(src_choices, value, dst_choices, slot, mesh, kind=kind, bucket_cap=bucket_cap)
    return (extra if extra.any() else None), asy


def zero2_edge(src_choices, value: InputSlot, dst_choices, slot: int, mesh, *, bucket_cap: int) -> np.ndarray:
    """What the runtime's gradient sum of a ZeRO-2-capable parameter costs beyond the consumer's
    priced one (``zero_pricing.zero2_extra_s``): a reduce-scatter straight into the pieces for a
    ZeRO-2 parameter read in its own layout, a bucketed all-reduce for another stage read so, an
    in-graph all-reduce for a converted read."""
    extra = np.zeros((len(src_choices), len(dst_choices)))
    for j, dst in enumerate(dst_choices):
        if dst.strategy is None:
            continue
        costs = {(rs, own): zero2_extra_s(dst.strategy, slot, mesh, reduce_scatter=rs, bucketed=own,
                                          bucket_cap=bucket_cap) for rs, own in ((False, False), (False, True),
                                                                                  (True, True))}
        for i, src in enumerate(src_choices):
            own = dst.input_specs[slot] == src.output_specs[value.index]
            extra[i, j] = costs[(own and src.zero_stage == 2, own)]
    return extra


def async_edge(src_choices, value: InputSlot, dst_choices, slot: int, mesh, *, kind: str,
               bucket_cap: int = 0) -> np.ndarray | None:
    """The asynchronous seconds of the edge into ``slot`` (a bucketed slot: ``Decision.bucketed``)
    per (producer option, reader option): the reader's gradient sum of that slot (``kind``,
    ``bucketed_async_s``) where it reads the value in the producer's own layout -- the runtime
    buckets only such a read (``runtime.passes``); a converted one is summed in-graph. None when
    all are 0.

    Counted synchronous although bucketed (an over-estimate of exposure): a parameter's later
    readers' sums (priced on the edge from the previous reader, ``ReaderChain``) and ZeRO-2's
    all-reduce extra (``zero2_edge``), and the sum of a mixed-precision cast of a
    parameter: the runtime buckets it only where parameter, cast and reader share one layout,
    a condition on three choices that a pairwise edge cannot state -- counted asynchronous on
    the cast -> reader edge, it was: the planner gathered fp32 masters before their casts to
    "hide" sums that then ran in-graph."""
    out = np.zeros((len(src_choices), len(dst_choices)))
    for j, dst in enumerate(dst_choices):
        s = dst.strategy
        if s is None or not s.grad_partial_axes[slot]:
            continue
        seconds = bucketed_async_s(s, slot, mesh, kind, bucket_cap=bucket_cap)
        for i, src in enumerate(src_choices):
            if src.output_specs[value.index] == dst.input_specs[slot]:
                out[i, j] = seconds
    return out if out.any() else None


def bucketed_async_s(strategy: Strategy, slot: int, mesh, kind: str = "all_reduce", *, bucket_cap: int = 0) -> float:
    """Seconds of input ``slot``'s gradient sum (``kind``, a member of a ``bucket_cap``-byte
    bucket) that a gradient bucket leaves in flight while backward goes on: the whole sum over
    one mesh axis, and an all-reduce's over several (``runtime.bucketing`` issues it as one
    collective on the group spanning them, ``ProcessMesh.group_over``; priced as the per-axis
    chain's seconds -- the profile fits links per axis -- and, on a pipeline stage's sub-mesh,
    which still chains, an under-estimate of what waits); a reduce-scatter over several, the
    first axis's collective only (``runtime.zero.comm.ScatterWork`` issues that one
    asynchronously and the others when backward has ended), never more than the whole sum."""
    total = grad_sync_seconds(strategy, slot, mesh, kind, bucket_cap=bucket_cap)
    axes = [a for a in strategy.grad_partial_axes[slot] if mesh.shape[a] > 1]
    if len(axes) <= 1 or kind == "all_reduce":
        return total
    return min(collective_seconds(kind, strategy.grad_sync_bytes[slot], mesh, axes[0], bucket_cap=bucket_cap), total)


def last_bucket_params(traced, *, cap: int) -> frozenset[str]:
    """The trainable parameters (placeholder names) whose gradients the runtime's LAST bucket
    sums when every parameter is bucketed (data parallelism): the first ones forward reads,
    whose gradients are ready only as backward ends -- that bucket is issued then and waited on
    at once, so no compute hides it whatever ``comm_overlap`` says. Cut as the runtime cuts
    (``layout.buckets.split_buckets``, in the order gradients become ready: reverse forward).
    Empty without buckets (``cap`` 0). For other plans an approximation: a sharded parameter
    leaves the buckets, and the runtime's last bucket then reaches further into the model."""
    if cap <= 0:
        return frozenset()
    trainable = {p.name: p for p in traced.params if p.requires_grad}
    first_read: dict[str, None] = {}  # insertion-ordered set: a list's membership test is O(params) a read
    for node in traced.compute_nodes():
        for arg in node.all_input_nodes:
            if arg.name in trainable:
                first_read.setdefault(arg.name)
    ready = list(first_read)[::-1]
    sizes = [trainable[n].numel * trainable[n].dtype.itemsize for n in ready]
    buckets = split_buckets(sizes, cap=cap, first_cap=first_cap_bytes_default())
    return frozenset(ready[k] for k in buckets[-1]) if buckets else frozenset()


def pending_output_seconds(spec: TensorSpec | None, value: InputSlot, mesh) -> float | None:
    """What the graph output ``value``, held as ``spec``, costs the step to make replicated when
    the runtime leaves that in flight, or None where it does not price so: a scalar output (the
    loss) whose conversion is all-reduces only becomes one all-reduce on the group of those axes
    (``runtime.passes._pending_reduce``), waited on where the value is first read -- after
    backward, which starts at once -- so its latency runs under backward and the step pays its
    bytes' time only (``t(bytes) - t(0)``, asynchronous), not a blocking conversion's price.
    Not other outputs: their readers (a loss computed outside the model) wait at once; nor a
    pipeline stage's loss, which its graph sums at once (``StageCosts`` prices it back)."""
    full = TensorSpec.replicated(len(mesh.shape))
    if value is None or spec is None or spec == full or math.prod(value.shape) != 1:
        return None
    axes = plan_conversion(spec, full, value.shape, value.itemsize, mesh).sum_axes
    if axes is None:
        return None
    return (collective_seconds("all_reduce", value.itemsize, mesh, axes, blocking=False)
            - collective_seconds("all_reduce", 0, mesh, axes, blocking=False))


def pending_output_refund(src_choices, value: InputSlot, mesh) -> np.ndarray | None:
    """Per producer option, what the graph output's edge from it over-prices (a column; None where
    nothing): the blocking conversion less ``pending_output_seconds``."""
    refund = np.zeros((len(src_choices), 1))
    full = TensorSpec.replicated(len(mesh.shape))
    for i, c in enumerate(src_choices):
        spec = None if value is None else c.output_specs[value.index]
        pending = pending_output_seconds(spec, value, mesh)
        if pending is not None:
            refund[i, 0] = max(plan_conversion(spec, full, value.shape, value.itemsize, mesh).total_s - pending, 0.0)
    return refund if refund.any() else None


def _zero2_layouts(built: BuiltProblem, choice: Mapping[str, str]) -> dict[str, TensorSpec]:
    out = {}
    for name, d in built.decisions.items():
        if d.kind == NodeKind.PARAMETER:
            c = built.choice_of(name, choice[name])
            if c.zero_stage == 2:
                out[name] = c.output_specs[0]
    return out


class ReaderChain:
    """Each value's readers in graph order, for the ILP's pricing of shared gradient sums.

    The ILP prices a reader's partial-gradient all-reduce on its option, except that a reader
    whose value an earlier op already reads (its *previous reader*) is priced on the edge from
    that reader instead, and only where their (layout, axes) differ: exact when the readers agree
    (the three projections of one normalised activation sum one gradient), an over-estimate for
    patterns such as X, Y, X. Call ``previous`` once per (consumer, slot), in graph order.

    A parameter with a ZeRO-2 option is chained too (its first reader's sum extra is priced
    against the parameter's own choice, ``zero2_edge``; a tied parameter's later readers share
    that sum). A second slot of the same reader (``x * x``) is priced per slot."""

    def __init__(self, decisions: Mapping[str, object]) -> None:
        self.decisions = decisions
        self._last: dict[tuple[str, int], tuple[str, int]] = {}

    def previous(self, consumer: str, slot: int, value: InputSlot | None) -> tuple[str, int] | None:
        if value is None:
            return None
        key = (value.producer, value.index)
        prev = self._last.get(key)
        if prev is not None and prev[0] == consumer:
            return None
        self._last[key] = (consumer, slot)
        return prev


def zero2_capable(decision) -> bool:
    """A parameter decision with a ZeRO-2 option."""
    return decision.kind == NodeKind.PARAMETER and any(c.zero_stage == 2 for c in decision.choices)


def sync_key(choice, slot: int) -> tuple:
    """What a gradient sum of input ``slot`` is shared by: the layout read and the axes."""
    return str(choice.input_specs[slot]), tuple(choice.strategy.grad_partial_axes[slot])


def grad_syncs(built: BuiltProblem, choice: Mapping[str, str]) -> tuple[list[GradSync], float]:
    """(the gradient sums the runtime issues, the seconds the ILP prices beyond them)."""
    zero2 = _zero2_layouts(built, choice)
    chain = ReaderChain(built.decisions)
    first: dict[tuple, GradSync] = {}
    # The extra is summed from the sums priced beyond the first of their key (and less any first
    # one left unpriced), not as (all priced) - (all issued): equal terms need not cancel there.
    extra = 0.0
    for name, d in built.decisions.items():
        if d.kind != NodeKind.OP:
            continue
        c = built.choice_of(name, choice[name])
        s = c.strategy
        for slot, value in enumerate(d.inputs):
            prev = chain.previous(name, slot, value)
            axes = s.grad_partial_axes[slot] if s is not None else ()
            if not axes or value is None:
                continue
            spec = c.input_specs[slot]
            kind = "reduce_scatter" if zero2.get(value.producer) == spec else "all_reduce"
            # bucketed: a parameter's (``Decision.bucketed``) read in its producer's layout
            own = built.choice_of(value.producer, choice[value.producer]).output_specs[value.index] == spec
            sync = GradSync(name, slot, value, spec, tuple(axes), s, kind, slot in d.bucketed and own, built.bucket_cap,
                            exposed=value.producer in built.exposed)
            priced = prev is None or sync_key(built.choice_of(prev[0], choice[prev[0]]), prev[1]) != sync_key(c, slot)
            key = (value.producer, value.index) + sync_key(c, slot)
            issued = key not in first
            if issued:
                first[key] = sync
            if priced != issued:
                extra += sync.seconds(built.mesh) if priced else -sync.seconds(built.mesh)
    return list(first.values()), extra


def unique_conversions(built: BuiltProblem,
                       choice: Mapping[str, str]) -> tuple[list[ChosenConversion], list[ChosenConversion]]:
    """(the conversions the runtime runs, the consumers' edges that reuse one of them)."""
    first: dict[tuple, ChosenConversion] = {}
    shared: list[ChosenConversion] = []
    for cc in built.conversions(choice):
        value = built.decisions[cc.consumer].inputs[cc.slot]
        key = (value.producer, value.index, str(cc.conversion.dst))
        if key in first:
            shared.append(cc)
        else:
            first[key] = cc
    return list(first.values()), shared


def shared_savings(built: BuiltProblem, choice: Mapping[str, str], *,
                   shared: list[ChosenConversion] | None = None) -> tuple[float, float]:
    """(in-op, resharding) seconds the ILP's per-consumer pricing counts beyond what runs.
    ``shared``: ``unique_conversions(built, choice)[1]`` when the caller has it already."""
    _, extra = grad_syncs(built, choice)
    convs = unique_conversions(built, choice)[1] if shared is None else shared
    return extra, sum(c.conversion.forward_s + c.conversion.backward_s for c in convs)
