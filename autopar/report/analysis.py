"""Per-node figures behind the inspect report, derived from a solved plan.

``Plan`` keeps the chosen strategy per node; the report also needs what those choices imply:

- **communication** per collective kind and mesh axis, as the runtime issues it: the backward
  all-reduce of every partial input gradient and the custom kernels' collectives (inside ops),
  every layout conversion on a graph edge, re-planned with ``plan_conversion`` and split into
  its steps' forward and backward collectives exactly as ``autopar.layout.conversion.step_seconds``
  prices them, ZeRO's all-gather after the step and ZeRO-2's gradient reduce-scatters; a
  conversion or gradient sum several consumers share counted once (``planner.executed``), so
  the totals equal the plan's ``comm_s`` and ``reshard_s``; the gradient sums issued
  asynchronously in buckets (source ``bucket``, or ``zero`` for ZeRO-2's reduce-scatters) carry
  their share of the plan's hidden seconds (``Estimate.hidden_s``: the hidden part of the
  asynchronous seconds is one pool, ``autopar.solver.overlap``, so each asynchronous collective
  hides the same fraction of its asynchronous part);
- the **memory timeline**: per-device bytes at every point of the forward/backward order, with
  the plan's recompute (the evaluation behind ``Plan.estimate``);
- **per-layer rows**: decisions grouped by owning module, repeated blocks collapsed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autopar.planner.executed import grad_syncs, pending_output_seconds, unique_conversions
from autopar.planner.zero_pricing import zero_gather_seconds
from autopar.planner.records import BuiltProblem
from autopar.plans import NodeKind
from autopar.planner.checkpointing import RecomputePlan
from autopar.layout.blocks import block_of
from autopar.layout.cost import collective_seconds, copy_seconds
from autopar.layout.mesh import MeshSpec
from autopar.layout.conversion import apply_step
from autopar.layout.placement import zero_split

if TYPE_CHECKING:  # the report reads the plan's evaluation; it never runs the solver
    from autopar.solver.timeline import Evaluation

__all__ = ["CommRow", "Timeline", "LayerRow", "comm_breakdown", "memory_timeline", "layer_rows",
           "axis_label"]

LOCAL = "local"  # collectives that move no bytes over a link (split, zeroing copy)


@dataclass
class CommRow:
    """All collectives of one kind over one mesh axis group, over one training step."""

    kind: str  # all_reduce | all_gather | reduce_scatter | all_to_all | split | to_partial | kernel:<name>
    axes: str  # "ax1(4)", "ax0(2)+ax1(4)", or "-" when a kernel does not say
    source: str  # "in-op", "bucket", "reshard", "recompute", "zero" or "pending" (the loss's sum in flight)
    count: int = 0
    payload_bytes: int = 0  # full tensor bytes per collective, summed (0 when unknown)
    seconds: float = 0.0
    hidden_s: float = 0.0  # of ``seconds``, hidden under compute (asynchronous collectives only)

    @property
    def exposed_s(self) -> float:
        return max(self.seconds - self.hidden_s, 0.0)


@dataclass(frozen=True, slots=True)
class Timeline:
    """Per-device bytes over the step: the plan's ``Evaluation`` (parameters held throughout,
    ``activations[t]`` live at point t, recompute included) placed on the forward/backward order."""

    evaluation: Evaluation
    forward_points: int  # points 0..forward_points-1 are the forward pass, the rest backward
    budget: int | None
    copies: int = 0  # of the peak: parameter copies readers gathered and keep for backward (``Edge.mem``)

    def __str__(self) -> str:
        return (f"peak {self.evaluation.peak_bytes}B at t={self.evaluation.peak_time} of "
                f"{len(self.evaluation.activations)} points, budget {self.budget}")


@dataclass
class LayerRow:
    """One module pattern (``transformer.h.*.mlp.c_fc``) whose instances chose alike."""

    module: str
    block: str | None  # the collapsed block pattern (``transformer.h.*``) or None
    count: int  # instances collapsed into this row
    instances: list[str]  # block instance names (``transformer.h.0`` ...), empty at top level
    ops: int  # op decisions per instance
    params: str  # "weight S1R, bias R"
    strategy: str  # strategy of the instance's most expensive op
    main_op: str
    output: str  # output spec of the module's last op
    compute_s: float = 0.0  # over all instances
    comm_s: float = 0.0  # in-op + resharding into the module's ops, over all instances
    act_bytes: int = 0  # saved activation bytes per device, per instance
    signature: tuple = field(default=(), repr=False)


def axis_label(mesh: MeshSpec, axes: tuple[int, ...]) -> str:
    return "+".join(f"{mesh.axis_names[a]}({mesh.shape[a]})" for a in axes) if axes else "-"


def _picked(built: BuiltProblem, choice: dict[str, str]) -> dict[str, int]:
    return {n.name: n.option_index(choice[n.name]) for n in built.problem.nodes}


# --------------------------------------------------------------------------- communication
def _add(rows: dict, kind: str, axes: str, source: str, payload: float, seconds: float, hidden: float = 0.0) -> None:
    if seconds <= 0.0 and payload <= 0:
        return
    row = rows.setdefault((kind, axes, source), CommRow(kind, axes, source))
    row.count += 1
    row.payload_bytes += int(payload)
    row.seconds += seconds
    row.hidden_s += hidden


def _step_parts(step, spec, shape, itemsize, mesh) -> list[tuple[str, float, float]]:
    """(kind, payload bytes, seconds) of the forward and backward parts of one reshard step.

    Mirrors ``reshard.step_seconds``: payload is the full size the cost model charges."""
    local = math.prod(spec.local_shape(shape, mesh.shape)) * itemsize
    n, axis, kind = mesh.shape[step.axis], step.axis, step.kind

    def coll(k: str, nbytes: float) -> tuple[str, float, float]:
        return k, nbytes, collective_seconds(k, nbytes, mesh, axis)

    if kind == "all_gather":
        return [coll("all_gather", local * n), coll("split", local * n)]
    if kind == "split":
        return [coll("split", local), coll("all_gather", local)]
    if kind == "all_to_all":
        return [coll("all_to_all", local * n), coll("all_to_all", local * n)]
    if kind == "all_reduce":
        return [coll("all_reduce", local)]
    if kind == "reduce_scatter":
        return [coll("reduce_scatter", local), coll("all_gather", local)]
    return [("to_partial", local, copy_seconds(local, mesh) if n > 1 else 0.0)]


def _kernels(rows: dict, built: BuiltProblem, pick: dict[str, int], mesh: MeshSpec) -> None:
    """Custom kernels' own collectives: the op's in-op seconds beyond its gradient sums."""
    for name, decision in built.decisions.items():
        s = decision.choices[pick[name]].strategy
        if decision.kind != NodeKind.OP or s is None or s.kernel is None:
            continue
        # The kernel's own terms, read directly: comm_s less the gradient sums is float noise where they are all.
        rest = s.forward_comm_s + s.kernel_bwd_comm_s
        if rest > 0:  # kernels report seconds only; their collectives' sizes are internal
            _add(rows, f"kernel:{s.kernel}", "-", "in-op", 0, rest)


def _grad_syncs(rows: dict, built: BuiltProblem, choice: dict[str, str], mesh: MeshSpec,
                hidden_share: float) -> None:
    """Partial input gradients summed in backward, once per (value, layout, axes); a bucketed
    one hides ``hidden_share`` of its asynchronous part (``GradSync.async_seconds``)."""
    for sync in grad_syncs(built, choice)[0]:
        source = "zero" if sync.kind == "reduce_scatter" else "bucket" if sync.bucketed else "in-op"
        _add(rows, sync.kind, axis_label(mesh, sync.axes), source, sync.strategy.grad_sync_bytes[sync.slot],
             sync.seconds(mesh), sync.async_seconds(mesh) * hidden_share)


def _zero(rows: dict, built: BuiltProblem, pick: dict[str, int], mesh: MeshSpec) -> None:
    """ZeRO's all-gather of every stage 1/2 parameter after the step (one row per parameter,
    over the axes ``zero_split`` shards it on), priced as the option was
    (``zero_pricing.zero_gather_seconds``: its share of a bucket)."""
    shapes = {v.producer: v for d in built.decisions.values() for v in d.inputs if v is not None}
    for name, decision in built.decisions.items():
        chosen = decision.choices[pick[name]]
        value = shapes.get(name)
        if decision.kind != NodeKind.PARAMETER or not chosen.zero_stage or value is None:
            continue
        spec = chosen.output_specs[0]
        _, axes = zero_split(spec, len(value.shape), mesh.shape)
        local = value.local_bytes(spec, mesh.shape)
        _add(rows, "all_gather", axis_label(mesh, axes), "zero", local,
             zero_gather_seconds(local, mesh, axes, cap=built.gather_cap))


def _resharding(rows: dict, built: BuiltProblem, choice: dict[str, str], mesh: MeshSpec,
                recomputed: frozenset[str]) -> None:
    """Conversions, forward and backward; a conversion into a recomputed op runs its forward
    again in backward (source "recompute")."""
    for cc in unique_conversions(built, choice)[0]:
        value = built.decisions[cc.consumer].inputs[cc.slot]
        spec = cc.conversion.src
        out = built.decisions[cc.consumer].kind == NodeKind.OUTPUT  # the loss's sum, left in flight:
        if out and (pending := pending_output_seconds(spec, value, mesh)) is not None:  # ``executed``
            _add(rows, "all_reduce", axis_label(mesh, cc.conversion.sum_axes), "pending", value.itemsize, pending)
            continue
        for step in cc.conversion.steps:
            parts = _step_parts(step, spec, value.shape, value.itemsize, mesh)
            if cc.consumer in recomputed:
                parts.append((*parts[0][:2], parts[0][2], "recompute"))
            for k, payload, sec, *source in parts:
                _add(rows, k, axis_label(mesh, (step.axis,)), source[0] if source else "reshard", payload, sec)
            spec = apply_step(spec, step)


def comm_breakdown(built: BuiltProblem, choice: dict[str, str], mesh: MeshSpec, *,
                   recomputed: frozenset[str] = frozenset(), hidden_share: float = 0.0) -> list[CommRow]:
    """Communication of one training step, per (kind, axes, source), most expensive first, as
    the runtime issues it (``planner.executed``: a shared conversion or gradient sum once).
    ``source``: "in-op" (strategies' own), "bucket" (parameters' gradient sums, all-reduced
    asynchronously in buckets), "reshard" (conversions on edges), "pending" (a scalar loss's sum
    left in flight: its bytes' time, ``executed.pending_output_seconds``), "recompute" (the forward of
    conversions into the ``recomputed`` ops, again) or "zero" (ZeRO's gather after the step and
    ZeRO-2's gradient reduce-scatters). ``hidden_share``: the fraction of every asynchronous
    collective hidden under compute (the plan's ``hidden_s / async_s``)."""
    if not 0.0 <= hidden_share <= 1.0:
        raise ValueError(f"hidden_share must be in [0, 1], got {hidden_share!r}")
    pick = _picked(built, choice)
    rows: dict[tuple, CommRow] = {}
    _zero(rows, built, pick, mesh)
    _grad_syncs(rows, built, choice, mesh, hidden_share)
    _kernels(rows, built, pick, mesh)
    _resharding(rows, built, choice, mesh, recomputed)
    return sorted(rows.values(), key=lambda r: -r.seconds)


# ---------------------------------------------------------------------------- memory timeline
def memory_timeline(recompute: RecomputePlan) -> Timeline:
    """The memory timeline of the plan ``recompute`` describes: its evaluation (the one
    ``Problem.evaluate``, with its recompute units), so the chart's peak is ``Plan.estimate``'s."""
    problem = recompute.problem
    return Timeline(recompute.evaluation, problem.timeline_length // 2, problem.budget_bytes, recompute.copies_at_peak)


# ----------------------------------------------------------------------------- layer rows
def _owner(plan_node) -> str:
    if plan_node.kind == "output":
        return "<graph output>"
    if plan_node.kind == "op":
        return plan_node.module
    # Parameters and buffers: the FQN's module; user inputs belong to the top level.
    return plan_node.module.rsplit(".", 1)[0] if "." in plan_node.module else ""


def _pattern(path: str) -> tuple[str, str | None, str | None]:
    """``transformer.h.3.attn`` -> (``transformer.h.*.attn``, ``transformer.h.*``, ``transformer.h.3``)."""
    block = block_of(path)
    if block is None:
        return path, None, None
    prefix = block.rsplit(".", 1)[0] + ".*"
    return prefix + path[len(block):], prefix, block


def _edge_seconds(built: BuiltProblem, pick: dict[str, int]) -> dict[str, float]:
    into: dict[str, float] = {}
    for e in built.problem.edges:
        into[e.dst] = into.get(e.dst, 0.0) + e.costs[pick[e.src]][pick[e.dst]]
    return into


def layer_rows(plan, built: BuiltProblem, choice: dict[str, str]) -> list[LayerRow]:
    """Decisions grouped by module; instances of a repeated block that chose alike share a row.

    Rows come in graph order of their first op, the rows of one collapsed block kept together."""
    pick = _picked(built, choice)
    into = _edge_seconds(built, pick)
    groups: dict[tuple[str, str | None], list[Any]] = {}  # (pattern, instance) -> decisions
    first_op: dict[tuple[str, str | None], int] = {}  # -> graph position of its first op
    first_any: dict[tuple[str, str | None], int] = {}
    blocks: dict[str, str | None] = {}
    for pos, n in enumerate(plan.nodes):
        if n.kind == "input":
            continue
        pattern, block, instance = _pattern(_owner(n))
        groups.setdefault((pattern, instance), []).append(n)
        blocks[pattern] = block
        first_any.setdefault((pattern, instance), pos)
        if n.kind == "op":
            first_op.setdefault((pattern, instance), pos)
    rows: dict[tuple, LayerRow] = {}
    order: dict[tuple, int] = {}
    for key, nodes in groups.items():
        pattern, instance = key
        sig = tuple((n.kind, n.module.rsplit(".", 1)[-1] if n.kind != "op" else n.op, n.strategy) for n in nodes)
        row = rows.get((pattern, sig))
        if row is None:
            row = rows[(pattern, sig)] = _new_row(pattern, blocks[pattern], nodes, built, pick, sig)
            order[(pattern, sig)] = first_op.get(key, first_any[key])
        row.count += 1
        if instance is not None:
            row.instances.append(instance)
        for n in nodes:
            o = built.problem.node(n.name).options[pick[n.name]]
            row.compute_s += o.compute_s
            row.comm_s += o.comm_s + into.get(n.name, 0.0)
    block_start: dict[str, int] = {}
    for k, row in rows.items():
        if row.block is not None:
            block_start[row.block] = min(block_start.get(row.block, order[k]), order[k])
    ranked = sorted(rows, key=lambda k: (block_start.get(rows[k].block, order[k]), order[k]))
    return [rows[k] for k in ranked]


def _new_row(pattern, block, nodes, built, pick, sig) -> LayerRow:
    ops = [n for n in nodes if n.kind == "op"]
    params = ", ".join(f"{n.module.rsplit('.', 1)[-1]} {n.strategy}" for n in nodes
                       if n.kind in ("parameter", "buffer"))
    cost = {n.name: built.problem.node(n.name).options[pick[n.name]] for n in nodes}
    main = max(ops, key=lambda n: cost[n.name].compute_s, default=None)
    return LayerRow(
        module=pattern or "<top level>", block=block, count=0, instances=[], ops=len(ops), params=params,
        strategy=main.strategy if main else "", main_op=_short_op(main.op) if main else "",
        output=(ops[-1].output_specs[0] or "") if ops and ops[-1].output_specs else "",
        act_bytes=sum(cost[n.name].act_bytes for n in nodes), signature=sig,
    )


def _short_op(op: str) -> str:
    """``aten.addmm.default`` -> ``addmm``."""
    parts = op.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == "aten" else op
