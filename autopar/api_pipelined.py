"""``plan_pipelined``: the pipeline-parallel planning entry point behind ``autopar.plan`` and
``autoparallelize`` (``pipeline=``): one micro-batch trace per micro-batch count, the stage search
per schedule, and under ``pipeline="auto"`` the plain plan to compare with."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

from autopar.layout.mesh import MeshSpec
from autopar.planner.options import PlanOptions
from autopar.plans import Plan

if TYPE_CHECKING:
    from autopar.stages import Progress
    from autopar.planner.pipeline.costs import StageCosts
    from autopar.tracer.graph import TracedGraph

__all__ = ["PipelinedResult", "plan_pipelined"]


@dataclass(frozen=True, slots=True)
class PipelinedResult:
    """A pipelined plan (or, under ``pipeline="auto"``, possibly a plain one), the graph it was
    made for (the MICRO-batch trace when pipelined) and every candidate tried, as lines."""

    plan: Plan
    traced: TracedGraph
    candidates: tuple[str, ...]


def plan_pipelined(model: Any, meta_inputs: tuple | dict, *, mesh: MeshSpec | Sequence[int] | str,
                   options: PlanOptions, progress: Progress, plan_traced: Callable) -> PipelinedResult:
    """Plan ``model`` with pipeline parallelism over mesh axis 0 (``options.pipeline``: N, the
    size of that axis, or ``"auto"``): for each micro-batch count (``options.microbatches``) the
    micro-batch graph is traced once and ``autopar.planner.pipeline_search.search_stages`` cuts
    it into stages, each sharded on the sub-mesh, for each schedule (``options.schedule``); the
    fastest feasible candidate wins (``plan_traced``: ``autopar.api.plan_traced``, passed in so this
    module does not import the api). ``"auto"`` also plans without a pipeline (the full batch on
    the whole mesh) and keeps the faster of the two. ``ValueError`` when nothing fits."""
    from autopar.planner.pipeline.bounds import config_floors, in_bound_order
    from autopar.planner.pipeline.costs import stage_costs
    from autopar.planner.pipeline.schedule import check_pipeline_zero, schedules_for
    from autopar.planner.pipeline.search import search_stages
    from autopar.planner.pipeline.geometry import PIPELINE_CASTS, batch_size, micro_inputs, microbatch_counts
    from autopar.strategies import needs_decomposition
    from autopar.tracer import profile as profile_graph
    from autopar.tracer import trace

    spec = options.mesh(mesh)
    stages = spec.shape[0]
    if options.pipeline != "auto" and options.pipeline != stages:
        raise ValueError(f"pipeline={options.pipeline!r} runs over mesh axis 0, which has size {stages} in mesh "
                         f"{spec.shape}: give a mesh whose first axis has size {options.pipeline}")
    if options.checkpoint not in ("auto", "none"):
        raise ValueError(f"pipelined plans decide activation recompute per stage (whole blocks): give "
                         f"checkpoint='auto' (or 'none' for no recompute), got checkpoint={options.checkpoint!r}")
    check_pipeline_zero(options.zero_stage)
    schedules = schedules_for(options.schedule)
    # Every micro-batch count's graph traced and its step floor found first (one small solve per
    # block class), then the counts searched lowest floor first, each bounded by the best step so
    # far: a count whose floor cannot beat it is not searched (``pipeline_bounds``).
    staged: dict[int, tuple[Any, StageCosts]] = {}
    floors: dict[int, float] = {}
    for m in microbatch_counts(batch_size(meta_inputs), num_stages=stages, asked=options.microbatches):
        with progress.stage("trace", f"micro-batch graph, {m} micro-batches"):
            traced = trace(model, micro_inputs(meta_inputs, m), decompose_if=needs_decomposition,
                           precision=options.precision, param_casts=PIPELINE_CASTS)
        with progress.stage("profile"):
            prof = profile_graph(traced)
        with progress.stage("pipeline floors", f"{m} micro-batches"):
            costs = stage_costs(traced, prof, mesh=spec, options=options)
            floors[m] = min(config_floors(costs, schedules=schedules, num_stages=stages, num_microbatches=m,
                                          window="auto").values())
        staged[m] = (traced, costs)
    lines: list[str] = []
    found: dict[int, Any] = {}

    def search(m: int, incumbent: float):
        traced, costs = staged[m]
        with progress.stage("pipeline stages", f"{stages} stages, {m} micro-batches"):
            found[m] = search_stages(traced, None, mesh=spec, options=options, num_stages=stages, num_microbatches=m,
                                     schedules=schedules, costs=costs, window="auto",
                                     bound=None if incumbent == math.inf else incumbent)
        return found[m]

    def skipped(m: int, floor: float, incumbent: float):
        lines.append(f"pipeline {stages}: {m} micro-batches: not searched: its floor {floor * 1e3:.3f} ms/step does "
                     f"not beat {incumbent * 1e3:.3f}")

    in_bound_order(floors, search, step_of=lambda f: None if f.plan is None else f.plan.estimate.step_s,
                   skipped=skipped)
    best: tuple[Plan, Any] | None = None
    for m, result in sorted(found.items()):
        lines += [f"pipeline {stages}: {c}" for c in result.candidates]
        if result.plan is not None and (best is None or result.plan.estimate.step_s < best[0].estimate.step_s):
            best = (result.plan, staged[m][0])
    if options.pipeline == "auto":
        with progress.stage("trace", "full batch, no pipeline"):
            traced = trace(model, meta_inputs, decompose_if=needs_decomposition, precision=options.precision)
        with progress.stage("profile"):
            prof = profile_graph(traced)
        try:
            flat = plan_traced(traced, prof, mesh=spec, options=replace(options, pipeline=None, baselines=False),
                               progress=progress).plan
            lines.append(f"no pipeline: {flat.estimate.step_s * 1e3:.3f} ms/step")
            if best is None or flat.estimate.step_s <= best[0].estimate.step_s:
                best = (flat, traced)
        except ValueError as exc:  # no plan without a pipeline fits the budget
            lines.append(f"no pipeline: {str(exc).splitlines()[0]}")
    if best is None:
        raise ValueError(f"no pipelined plan of {stages} stages fits on mesh {spec.shape}: " + "; ".join(lines))
    plan, traced = best
    if plan.pipeline is not None:
        plan = replace(plan, timings={**plan.timings, **progress.timings},
                       solver={**plan.solver, "pipeline": {**plan.solver["pipeline"], "candidates": lines}})
    return PipelinedResult(plan, traced, tuple(lines))
