"""``Plan``: the chosen parallelisation of one model on one mesh, as plain versioned data.

A plan records, per decision (parameter, buffer, user input, op), the chosen strategy name and
its specs in the compact string form (``"S0R"``), together with the mesh, the budget, the cost
model version and the traced graph's hash. ``autoparallelize(..., plan=path)`` applies a saved
plan without solving; a plan whose graph hash, mesh or world size does not match is refused.

No torch import: a plan can be read, diffed and printed anywhere.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from autopar.layout.mesh import MeshSpec
from autopar.layout.placement import Shard, TensorSpec

__all__ = ["PLAN_VERSION", "READABLE_PLAN_VERSIONS", "PRECISIONS", "COST_MODEL_VERSION", "NodeKind", "NodePlan",
           "TableOwner", "Estimate", "BaselineResult", "RecomputeRegion", "StagePlan", "PipelinePlan",
           "PIPELINE_SCHEDULES", "Plan", "stage_mesh_of"]

PLAN_VERSION = 2  # 2: ``Plan.tables`` (table-wise embedding tables); version 1 files load with none
READABLE_PLAN_VERSIONS = (1, 2)
PRECISIONS = ("fp32", "bf16", "fp16")  # what ops compute in (torch dtypes: autopar.tracer.precision)
# 2: compute at the op dtype's peak (fp32 vs bf16/fp16); 3: asynchronous communication hidden
# under compute (``MeshSpec.comm_overlap``, ``Estimate.hidden_s``)
COST_MODEL_VERSION = "roofline-ring-3"
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")


class NodeKind(str, enum.Enum):
    """What a graph node is, one vocabulary for the tracer's placeholders, the planner's decisions
    and ``NodePlan.kind``. Members are their plain-string values (JSON, comparisons, printing).

    A decision is a parameter, buffer or user input placeholder (its layout), an op (its
    strategy) or the graph output. ``CONSTANT`` is a placeholder kind only (a lifted tensor
    constant or a non-tensor user input): the planner lays a tensor constant out as a buffer."""

    PARAMETER = "parameter"
    BUFFER = "buffer"
    INPUT = "input"
    OP = "op"
    OUTPUT = "output"
    CONSTANT = "constant"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class NodePlan:
    """The choice for one decision node."""

    name: str  # fx node name in the traced graph
    kind: NodeKind  # parameter | buffer | input | op | output
    strategy: str  # option name, e.g. "S0R x RS1 -> S0S1" or a layout "S0R"
    input_specs: tuple[str | None, ...]  # per input slot (ops only)
    output_specs: tuple[str | None, ...]  # per output
    op: str = ""  # ATen overload for ops
    module: str = ""  # owning module path (ops) or FQN (parameters, buffers, inputs)
    # Parameters: ZeRO stage over the layout's replicated mesh axes (0: none; 1: optimizer state
    # sharded; 2: gradients too). See ``autopar.runtime.zero``.
    zero_stage: int = 0

    def __str__(self) -> str:
        where = f" @ {self.module}" if self.module else ""
        zero = f" +ZeRO-{self.zero_stage}" if self.zero_stage else ""
        return f"{self.name} [{self.op or self.kind}]{where}: {self.strategy}{zero}"


@dataclass(frozen=True, slots=True)
class Estimate:
    """Cost-model estimate of one training step on one device."""

    step_s: float
    compute_s: float
    comm_s: float  # communication inside ops (e.g. row-parallel all-reduce, gradient sync)
    reshard_s: float  # layout conversions between ops
    param_bytes: int  # parameters + gradients + optimizer state per device
    peak_bytes: int  # per-device peak over the step
    # Host<->device transfer seconds of offloaded parameters and optimizer state (part of comm_s;
    # the CPU optimizer step too: both are on the parameters' options, Plan.offload_info apart).
    host_link_s: float = 0.0
    # Overlap (``MeshSpec.comm_overlap``): the part of comm_s issued asynchronously (gradient
    # buckets) and the part of that hidden under compute, which step_s leaves out. Plans written
    # before overlap was modelled read as 0 and 0.
    async_s: float = 0.0
    hidden_s: float = 0.0

    @property
    def exposed_s(self) -> float:
        """Communication the step waits for: all of it less what hides under compute."""
        return max(self.communication_s - self.hidden_s, 0.0)

    @property
    def communication_s(self) -> float:
        return self.comm_s + self.reshard_s

    def __str__(self) -> str:
        host = f", host link {self.host_link_s * 1e3:.3f} ms" if self.host_link_s else ""
        hidden = f", {self.hidden_s * 1e3:.3f} ms of it hidden under compute" if self.hidden_s else ""
        return (f"{self.step_s * 1e3:.3f} ms/step (compute {self.compute_s * 1e3:.3f} ms, "
                f"communication {self.communication_s * 1e3:.3f} ms{hidden}{host}), peak "
                f"{self.peak_bytes / 2**30:.2f} GiB/device")


@dataclass(frozen=True, slots=True)
class BaselineResult:
    """A hand-written-style plan solved in the same cost model (restricted strategy set)."""

    name: str
    feasible: bool
    estimate: Estimate | None  # None when no plan of this family fits the budget
    note: str = ""

    def __str__(self) -> str:
        return f"{self.name}: {self.estimate}" if self.feasible else f"{self.name}: {self.note}"


@dataclass(frozen=True, slots=True)
class RecomputeRegion:
    """Ops recomputed in backward as one ``torch.utils.checkpoint`` region.

    name:  the segment or chain stages it comes from (e.g. ``"transformer.h.0"``).
    nodes: the traced op names it spans, in graph order (a contiguous run of the graph's ops).
    """

    name: str
    nodes: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.name} ({len(self.nodes)} ops: {self.nodes[0]} .. {self.nodes[-1]})"


@dataclass(frozen=True, slots=True)
class StagePlan:
    """One (virtual) pipeline stage.

    index:  the stage's place in the pipeline order, 0 .. num_stages * virtual_stages - 1;
    rank:   its position on the pipeline mesh axis (interleaved schedules: ``index % num_stages``);
    layers: the repeated blocks it holds, ``[start, stop)`` (``autopar.layout.blocks``);
    nodes:  the traced node names it runs, graph order: its ops (and ``getitem``/``get_attr``
            nodes), the parameters/buffers they read, and the user inputs they read. A tied
            parameter read by two stages is listed in both.
    """

    index: int
    rank: int
    layers: tuple[int, int]
    nodes: tuple[str, ...]

    def __str__(self) -> str:
        return (f"stage {self.index} on pipeline rank {self.rank}: blocks {self.layers[0]}..{self.layers[1] - 1}, "
                f"{len(self.nodes)} nodes")


@dataclass(frozen=True, slots=True)
class PipelinePlan:
    """Pipeline parallelism over mesh axis ``axis`` (the first): ``num_stages`` ranks on that
    axis, each holding ``virtual_stages`` stages; every stage runs on the sub-mesh without the
    pipeline axis with the plan's per-node strategies, one micro-batch (``batch /
    num_microbatches``, the traced graph's batch) at a time, under ``schedule``."""

    num_stages: int
    num_microbatches: int
    schedule: str
    virtual_stages: int
    stages: tuple[StagePlan, ...]
    axis: int = 0

    def __post_init__(self) -> None:
        if self.schedule not in PIPELINE_SCHEDULES:
            raise ValueError(f"pipeline schedule {self.schedule!r} is not one of {PIPELINE_SCHEDULES}")
        for what, n in (("num_stages", self.num_stages), ("num_microbatches", self.num_microbatches),
                        ("virtual_stages", self.virtual_stages)):
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"pipeline {what} must be a positive int, got {n!r}")
        if self.axis != 0:
            raise ValueError(f"the pipeline axis must be mesh axis 0, got {self.axis}")
        if len(self.stages) != self.num_stages * self.virtual_stages:
            raise ValueError(f"a pipeline of {self.num_stages} ranks x {self.virtual_stages} virtual stages needs "
                             f"{self.num_stages * self.virtual_stages} stages, the plan lists {len(self.stages)}")
        if [s.index for s in self.stages] != list(range(len(self.stages))):
            raise ValueError(f"pipeline stages must be listed in order 0..{len(self.stages) - 1}, got "
                             f"{[s.index for s in self.stages]}")

    def __str__(self) -> str:
        virtual = f" x {self.virtual_stages} virtual" if self.virtual_stages > 1 else ""
        return (f"pipeline {self.num_stages} stages{virtual} on mesh axis {self.axis}, "
                f"{self.num_microbatches} micro-batches, {self.schedule}")

    def to_dict(self) -> dict[str, Any]:
        return {"num_stages": self.num_stages, "num_microbatches": self.num_microbatches,
                "schedule": self.schedule, "virtual_stages": self.virtual_stages, "axis": self.axis,
                "stages": [{"index": s.index, "rank": s.rank, "layers": list(s.layers), "nodes": list(s.nodes)}
                           for s in self.stages]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PipelinePlan":
        stages = tuple(StagePlan(int(s["index"]), int(s["rank"]), (int(s["layers"][0]), int(s["layers"][1])),
                                 tuple(s["nodes"])) for s in data["stages"])
        return cls(num_stages=data["num_stages"], num_microbatches=data["num_microbatches"],
                   schedule=data["schedule"], virtual_stages=data["virtual_stages"], stages=stages,
                   axis=data.get("axis", 0))


@dataclass(frozen=True)
class TableOwner:
    """A table-wise embedding table: parameter placeholder ``param`` (FQN ``fqn``) is held whole by
    the device at coordinate ``owner[i]`` of mesh axis ``axes[i]`` and not at all by its peers
    there (its layout, ``Shard(0)`` on those axes, is the balanced share the planner priced);
    ``autopar.planner.table_partition`` chooses the owners, ``autopar.runtime.table_wise`` runs it."""

    param: str
    fqn: str
    axes: tuple[int, ...]
    owner: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes", tuple(int(a) for a in self.axes))
        object.__setattr__(self, "owner", tuple(int(c) for c in self.owner))
        if len(self.axes) != len(self.owner) or not self.axes:
            raise ValueError(f"table {self.fqn!r}: one owner coordinate per table-wise axis, got axes "
                             f"{self.axes} and owner {self.owner}")

    def __str__(self) -> str:
        where = ", ".join(f"axis {a} device {c}" for a, c in zip(self.axes, self.owner))
        return f"{self.fqn} on {where}"


@dataclass(frozen=True)
class Plan:
    model: str
    graph_hash: str
    mesh: MeshSpec
    budget_bytes: int | None
    nodes: tuple[NodePlan, ...]
    estimate: Estimate
    solver: dict[str, Any]  # status, backend, objective, lp_bound, gap, timings, sizes
    timings: dict[str, float] = field(default_factory=dict)  # trace/profile/build/solve seconds
    baselines: tuple[BaselineResult, ...] = ()
    fallbacks: tuple[str, ...] = ()  # op nodes replicated without a rule (explicit opt-in)
    # Activation recompute: the regions, and how they were chosen (mode, method, estimates,
    # activation_bytes = bytes saved for backward per device when the forward ends).
    recompute: tuple[RecomputeRegion, ...] = ()
    checkpoint: dict[str, Any] = field(default_factory=dict)
    # Mixed precision: the dtype ops compute in (the traced graph's) and gradients are summed in.
    precision: str = "fp32"
    reduce_dtype: str = "fp32"
    # Pipeline parallelism over mesh axis 0: with it, ``nodes`` hold layouts over the stage
    # sub-mesh (``stage_mesh()``: the mesh without the pipeline axis) and the traced graph (and
    # ``graph_hash``) is the MICRO-batch graph.
    pipeline: PipelinePlan | None = None
    # Offload (autopar.planner.offload_fit): trainable parameter FQN -> (parameter tier,
    # optimizer-state tier), each "device" or "host" (empty: planned with offload="none"); and the
    # policy, host bytes per device, host-link and CPU optimizer seconds, unpriced stream buffer.
    offload: dict[str, tuple[str, str]] = field(default_factory=dict)
    offload_info: dict[str, Any] = field(default_factory=dict)
    # Table-wise embedding tables and their owners (``TableOwner``); the partition's figures
    # (per-device table bytes, the peak with the real owners) in ``solver["tables"]``.
    tables: tuple[TableOwner, ...] = ()
    cost_model_version: str = COST_MODEL_VERSION
    version: int = PLAN_VERSION

    # ----------------------------------------------------------------------------- queries
    def node(self, name: str) -> NodePlan:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"plan for {self.model} has no node {name!r}")

    def by_kind(self, kind: NodeKind | str) -> tuple[NodePlan, ...]:
        return tuple(n for n in self.nodes if n.kind == kind)

    def placements(self) -> dict[str, tuple[str, ...]]:
        """Parameter and buffer FQN -> its layout as DTensor placements, one per mesh axis
        (``"Shard(0)"``, ``"Replicate()"``, a fused projection's ``"_StridedShard(1, split_factor=3)"``),
        for users who shard by hand; a dim sharded by several axes lists them in DTensor's default
        order (the lower mesh axis is the major piece).
        ``autopar.runtime.dtensors.dtensor_placements`` gives the torch objects."""
        out = {}
        for n in self.nodes:
            if n.kind in (NodeKind.PARAMETER, NodeKind.BUFFER):
                spec = TensorSpec.parse(n.output_specs[0])
                out[n.module] = tuple(_dtensor_name(p) for p in spec.placements)
        return out

    def stage_mesh(self) -> MeshSpec:
        """The mesh every node's layout is over: ``mesh`` without the pipeline axis (a 1-D
        mesh of N pipeline stages leaves a one-device mesh, shape ``(1,)``); ``mesh`` itself
        without a pipeline."""
        if self.pipeline is None:
            return self.mesh
        return stage_mesh_of(self.mesh, self.pipeline.axis)

    def best_baseline(self) -> BaselineResult | None:
        feasible = [b for b in self.baselines if b.feasible]
        return min(feasible, key=lambda b: b.estimate.step_s) if feasible else None

    def summary(self) -> str:
        budget = "none" if self.budget_bytes is None else f"{self.budget_bytes / 2**30:.2f} GiB"
        lines = [
            f"plan for {self.model} on mesh {self.mesh} (budget {budget}"
            + (f", {self.precision} compute, gradients summed in {self.reduce_dtype})" if self.precision != "fp32"
               else ")"),
            f"  estimate: {self.estimate}",
            f"  solver: {self.solver.get('backend')} {self.solver.get('status')}, objective "
            f"{self.solver.get('objective', 0.0) * 1e3:.3f} ms, LP bound "
            f"{_ms_or_unknown(self.solver.get('lp_bound', 0.0))}, gap {_pct_or_unknown(self.solver.get('gap', 0.0))}",
        ]
        if self.timings:
            lines.append("  timings: " + ", ".join(f"{k} {v:.2f}s" for k, v in self.timings.items()))
        for b in self.baselines:
            lines.append(f"  baseline {b}")
        best = self.best_baseline()
        if best is not None:
            lines.append(f"  speed-up over best baseline ({best.name}): "
                         f"{best.estimate.step_s / self.estimate.step_s:.2f}x")
        zero = [n for n in self.nodes if n.zero_stage]
        if zero:
            stages = sorted({n.zero_stage for n in zero})
            lines.append(f"  ZeRO: stage {'/'.join(map(str, stages))} for {len(zero)} of "
                         f"{len(self.by_kind(NodeKind.PARAMETER))} parameters")
        if self.offload:
            lines.extend(self._offload_lines())
        if self.recompute:
            lines.append(f"  recompute ({self.checkpoint.get('method', '?')}): "
                         + ", ".join(r.name for r in self.recompute))
        if self.pipeline is not None:
            lines.append(f"  {self.pipeline}; each stage on mesh {self.stage_mesh().shape}")
            # The stage search (autopar.planner.pipeline.search) records per-stage figures.
            figures = self.solver.get("pipeline", {}).get("stages", ())
            if len(figures) == len(self.pipeline.stages):
                # ms/micro includes p2p and the schedule actions' overhead ("actions"; 0 in plans
                # written before it was priced).
                lines.append(f"    {'stage':>5} {'rank':>4} {'blocks':>9} {'nodes':>6} {'ms/micro':>9} {'p2p ms':>7} "
                             f"{'actions':>7} {'sync ms':>8} {'in flight':>9} {'peak GiB':>9}")
                for st, f in zip(self.pipeline.stages, figures):
                    blocks = f"{st.layers[0]}..{st.layers[1] - 1}"
                    lines.append(f"    {st.index:>5} {st.rank:>4} {blocks:>9} {len(st.nodes):>6} "
                                 f"{f['time_s'] * 1e3:>9.3f} {f['p2p_s'] * 1e3:>7.3f} "
                                 f"{f.get('overhead_s', 0.0) * 1e3:>7.3f} {f['sync_s'] * 1e3:>8.3f} "
                                 f"{f['in_flight']:>9} {f['peak_bytes'] / 2**30:>9.3f}")
            else:
                for st in self.pipeline.stages:
                    lines.append(f"    {st}")
        if self.tables:
            lines.append(f"  table-wise: {len(self.tables)} tables, each whole on one device: "
                         + "; ".join(map(str, self.tables)))
        if self.fallbacks:
            lines.append(f"  replicated without a rule (fallback): {', '.join(self.fallbacks)}")
        return "\n".join(lines)

    def _offload_lines(self) -> list[str]:
        info = self.offload_info
        tiers = list(self.offload.values())
        lines = [f"  offload ({info.get('policy', '?')}): {tiers.count(('host', 'host'))} parameters and their "
                 f"optimizer state on the host, {tiers.count(('device', 'host'))} more optimizer states, "
                 f"of {len(tiers)}; "
                 f"host {_gb(info.get('host_bytes', 0))} of {_gb(info.get('host_capacity') or 0)}/device, "
                 f"host link {info.get('host_link_s', 0.0) * 1e3:.3f} ms + CPU optimizer "
                 f"{info.get('cpu_optimizer_s', 0.0) * 1e3:.3f} ms per step (not overlapped)"]
        if info.get("stream_buffer_bytes"):
            lines.append(f"    streamed parameters also need ~{_gb(info['stream_buffer_bytes'])} of device "
                         f"buffer, outside the planned peak")
        return lines

    # -------------------------------------------------------------------------------- JSON
    def to_json(self) -> str:
        data = {
            "version": self.version, "cost_model_version": self.cost_model_version,
            "model": self.model, "graph_hash": self.graph_hash,
            "mesh": json.loads(self.mesh.to_json()), "budget_bytes": self.budget_bytes,
            "estimate": asdict(self.estimate), "solver": self.solver, "timings": self.timings,
            "baselines": [asdict(b) for b in self.baselines], "fallbacks": list(self.fallbacks),
            "nodes": [asdict(n) for n in self.nodes],
            "recompute": [asdict(r) for r in self.recompute], "checkpoint": self.checkpoint,
            "precision": self.precision, "reduce_dtype": self.reduce_dtype,
        }
        if self.pipeline is not None:
            data["pipeline"] = self.pipeline.to_dict()
        if self.tables:
            data["tables"] = [asdict(t) for t in self.tables]
        if self.offload:
            data["offload"] = {k: list(v) for k, v in self.offload.items()}
            data["offload_info"] = self.offload_info
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        data = json.loads(text)
        if data.get("version") not in READABLE_PLAN_VERSIONS:
            raise ValueError(f"plan file version {data.get('version')!r} is not supported "
                             f"(this autopar reads version {PLAN_VERSION})")
        for key in ("precision", "reduce_dtype"):
            if data.get(key, "fp32") not in PRECISIONS:
                raise ValueError(f"plan {key} {data[key]!r} is not one of {PRECISIONS}")
        try:
            return cls(
                model=data["model"], graph_hash=data["graph_hash"],
                mesh=MeshSpec.from_json(json.dumps(data["mesh"])), budget_bytes=data["budget_bytes"],
                nodes=tuple(NodePlan(**{**n, "kind": NodeKind(n["kind"]),
                                        "input_specs": tuple(n["input_specs"]),
                                        "output_specs": tuple(n["output_specs"])}) for n in data["nodes"]),
                estimate=Estimate(**data["estimate"]), solver=data["solver"], timings=data["timings"],
                baselines=tuple(
                    BaselineResult(b["name"], b["feasible"],
                                   Estimate(**b["estimate"]) if b["estimate"] else None, b["note"])
                    for b in data["baselines"]),
                fallbacks=tuple(data["fallbacks"]),
                recompute=tuple(RecomputeRegion(r["name"], tuple(r["nodes"])) for r in data.get("recompute", ())),
                checkpoint=data.get("checkpoint", {}), precision=data.get("precision", "fp32"),
                reduce_dtype=data.get("reduce_dtype", "fp32"),
                pipeline=PipelinePlan.from_dict(data["pipeline"]) if data.get("pipeline") else None,
                offload={k: tuple(v) for k, v in data.get("offload", {}).items()},
                offload_info=data.get("offload_info", {}),
                tables=tuple(TableOwner(**t) for t in data.get("tables", ())),
                cost_model_version=data["cost_model_version"],
                version=PLAN_VERSION,
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed plan JSON: {exc}") from None

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str) -> "Plan":
        with open(path) as f:
            return cls.from_json(f.read())


def _ms_or_unknown(seconds: float | None) -> str:
    """A solver bound in ms; None: the bound is unknown (a known plan answered a timed-out solve)."""
    return "unknown" if seconds is None else f"{seconds * 1e3:.3f} ms"


def _pct_or_unknown(share: float | None) -> str:
    return "unknown" if share is None else f"{share:.2%}"


def _gb(nbytes: float) -> str:
    """Decimal GB, or MB below 1 GB (tiny models' offload figures)."""
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.2f} MB"


def stage_mesh_of(mesh: MeshSpec, axis: int = 0) -> MeshSpec:
    """``mesh`` without pipeline axis ``axis`` (its links, names and device kept); a 1-D mesh
    leaves a one-device mesh ``(1,)`` (a stage on one device; its axis costs nothing)."""
    if mesh.ndim == 1:
        return replace(mesh, shape=(1,), axis_names=(f"{mesh.axis_names[0]}_stage",))
    return mesh.select_axes([i for i in range(mesh.ndim) if i != axis])


def _dtensor_name(p) -> str:
    if not isinstance(p, Shard):
        return "Replicate()"
    return f"Shard({p.dim})" if p.segments == 1 else f"_StridedShard({p.dim}, split_factor={p.segments})"
