"""Planning, start to finish: trace for planning, plan a traced graph, search meshes, plan pipelines.

``trace_for_planning`` is the one trace the planner plans on (unruled ops decomposed, the
precision's casts; per micro-batch for a pipeline). ``plan_traced`` turns a trace and its profile
into a ``PlanResult``: strategies -> problem -> recompute and offload planning -> baselines ->
``Plan``. ``plan_model`` traces first (and fills the plan cache), ``plan_mesh_auto`` plans every 1-3
axis mesh of a cluster from one trace, ``plan_pipelined`` searches stage cuts over mesh axis 0 per
micro-batch count and schedule. ``autopar.plan`` and ``autoparallelize`` (rank 0) call these. Torch
is imported inside the functions only, so importing the planner's options stays cheap.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

from autopar.layout.mesh import MeshSpec
from autopar.planner.offload_fit import fit_device_room, with_offload
from autopar.planner.options import PlanOptions
from autopar.plans import Plan
from autopar.stages import Progress
from autopar.tracer.errors import TraceError

if TYPE_CHECKING:
    from autopar.planner.checkpointing import RecomputePlan
    from autopar.planner.pipeline.costs import StageCosts
    from autopar.planner.records import BuiltProblem
    from autopar.tracer.graph import TracedGraph
    from autopar.tracer.profile import ModelProfile

__all__ = ["PlanResult", "PipelinedResult", "trace_for_planning", "plan_model", "plan_traced", "plan_mesh_auto",
           "search_traced", "plan_candidates", "plan_pipelined", "plan_auto", "plan_auto_cached", "cache_key",
           "cached_plan"]


@dataclass(frozen=True, slots=True)
class PlanResult:
    """A plan and what it was made from."""

    plan: Plan
    traced: TracedGraph
    profile: ModelProfile
    built: BuiltProblem  # the problem the plan solves
    recompute: RecomputePlan  # the chosen sharding and recompute, their evaluation and ILP solution

    def __str__(self) -> str:
        return (f"{self.plan.model} on {self.plan.mesh}: {self.built.problem.num_nodes} decisions, "
                f"recompute {self.recompute.method}, {self.plan.estimate}")


@dataclass(frozen=True, slots=True)
class PipelinedResult:
    """A pipelined plan (or, under ``pipeline="auto"``, possibly a plain one), the graph it was
    made for (the MICRO-batch trace when pipelined) and every candidate tried, as lines.
    ``flat``: the plan without a pipeline and what it was made from (``pipeline="auto"``; None
    when none fits or it was not planned)."""

    plan: Plan
    traced: TracedGraph
    candidates: tuple[str, ...]
    flat: PlanResult | None = None


# ------------------------------------------------------------------------------------ trace
def trace_for_planning(model: Any, meta_inputs: tuple | dict, *, precision: str,
                       microbatches: int | None = None, batch_norm_chunks: int | None = None) -> TracedGraph:
    """The graph the planner plans: ops without a sharding rule but with a decomposition
    decomposed, ``precision``'s casts inserted. ``microbatches``: the graph of one of that many
    micro-batches of ``meta_inputs``, with a cast per module (a pipeline stage owns its casts).
    ``batch_norm_chunks``: training batch norms normalise that many chunks of the batch each by
    its own statistics (``PlanOptions.batch_norm_chunks``, ``autopar.tracer.batch_stats``); a
    pipeline's micro-batch graph keeps them whole (``microbatch_hazard`` refuses them)."""
    from autopar.strategies import needs_decomposition
    from autopar.tracer import trace

    if microbatches is None:
        traced = trace(model, meta_inputs, decompose_if=needs_decomposition, precision=precision)
        if batch_norm_chunks is not None:
            from autopar.tracer.batch_stats import per_rank_batch_norms

            per_rank_batch_norms(traced, batch_norm_chunks)
        return traced
    from autopar.planner.pipeline.geometry import PIPELINE_CASTS, micro_inputs

    return trace(model, micro_inputs(meta_inputs, microbatches), decompose_if=needs_decomposition,
                 precision=precision, param_casts=PIPELINE_CASTS)


def _trace_and_profile(model, meta_inputs, *, precision: str, progress: Progress, microbatches: int | None = None,
                       detail: str = "", batch_norm_chunks: int | None = None) -> tuple[TracedGraph, ModelProfile]:
    from autopar.tracer import profile as profile_graph

    with progress.stage("trace", detail):
        traced = trace_for_planning(model, meta_inputs, precision=precision, microbatches=microbatches,
                                    batch_norm_chunks=batch_norm_chunks)
    with progress.stage("profile"):
        return traced, profile_graph(traced)


# ------------------------------------------------------------------------------ plan cache
def cache_key(model, meta_inputs, *, mesh: MeshSpec, options: PlanOptions, cache: bool) -> str | None:
    """The plan cache key, or None when the cache is off or the model cannot be keyed (a model
    that is not an ``nn.Module``, say: it is planned without the cache, with a warning)."""
    from autopar.planner import cache as plan_cache

    if not plan_cache.cache_enabled(cache):
        return None
    try:
        return plan_cache.structural_key(model, meta_inputs, mesh=mesh, options=options)
    except Exception as exc:  # noqa: BLE001 -- the cache must never stop planning
        import warnings

        warnings.warn(f"plan cache: cannot key this model ({type(exc).__name__}: {exc}); planning without the "
                      f"cache", stacklevel=3)
        return None


def cached_plan(key: str | None, *, mesh: MeshSpec, options: PlanOptions, progress: Progress,
                graph_hash: str | None = None) -> Plan | None:
    """The plan cache's plan for ``key`` (None: not there, stale, or no key), the hit shown as a progress line."""
    if key is None:
        return None
    from autopar.planner import cache as plan_cache

    hit = plan_cache.lookup(key, mesh=mesh, options=options, graph_hash=graph_hash)
    if hit is None:
        return None
    if progress.verbose:
        progress.sink(f"[autopar {time.perf_counter() - progress._start:6.1f}s] plan cache hit {hit[1]}")
    return hit[0]


def _store(key: str | None, plan: Plan) -> None:
    if key is not None:
        from autopar.planner import cache as plan_cache

        plan_cache.store(key, plan)


# ---------------------------------------------------------------------------------- planning
def plan_model(model: Any, meta_inputs: tuple | dict, *, mesh: MeshSpec | Sequence[int] | str,
               options: PlanOptions = PlanOptions(), progress: Progress | None = None,
               cache: bool = True) -> PlanResult:
    """Trace and profile ``model``, then ``plan_traced``. ``cache``: store the plan in the plan
    cache (where ``plan`` and ``autoparallelize`` find it); a ``PlanResult`` carries the problem
    and solution behind the plan, which the cache does not keep, so this always solves."""
    mesh = options.mesh(mesh)  # a bad mesh fails before the trace
    key = cache_key(model, meta_inputs, mesh=mesh, options=options, cache=cache)
    return plan_and_store(model, meta_inputs, mesh=mesh, options=options, progress=progress, key=key)


def plan_and_store(model, meta_inputs, *, mesh: MeshSpec, options: PlanOptions, progress: Progress | None,
                   key: str | None) -> PlanResult:
    """Trace, profile and ``plan_traced``; the plan is stored under ``key`` (None: not stored)."""
    progress = progress or Progress()
    traced, prof = _trace_and_profile(model, meta_inputs, precision=options.precision, progress=progress,
                                      batch_norm_chunks=options.batch_norm_chunks(mesh.num_devices))
    result = plan_traced(traced, prof, mesh=mesh, options=options, progress=progress)
    _store(key, result.plan)
    return result


def plan_traced_cached(traced: TracedGraph, *, mesh: MeshSpec, options: PlanOptions, progress: Progress,
                       key: str | None) -> Plan:
    """The cached plan when ``key`` and this trace's graph hash match an entry, else a solve (stored)."""
    from autopar.tracer import profile as profile_graph

    hit = cached_plan(key, mesh=mesh, options=options, progress=progress, graph_hash=traced.graph_hash)
    if hit is not None:
        return hit
    with progress.stage("profile"):
        prof = profile_graph(traced)
    plan = plan_traced(traced, prof, mesh=mesh, options=options, progress=progress).plan
    _store(key, plan)
    return plan


def plan_traced(traced: TracedGraph, profile: ModelProfile, *, mesh: MeshSpec | Sequence[int] | str,
                options: PlanOptions = PlanOptions(), progress: Progress | None = None,
                fixed: Callable | None = None, restrict: tuple[str, Callable] | None = None) -> PlanResult:
    """The plan of an existing trace and profile (one trace serves many meshes); ``fixed``: ``build_problem``'s.
    ``restrict``: (name, ``allowed(kind, fx_node, choice)``): the built problem kept to the options
    it allows (``assemble.restricted_built``; a fixed configuration such as
    ``baselines.expert_layouts``'), then planned as any other (recompute, offload)."""
    from autopar.planner.assemble import (applicable_baselines, assemble_plan, baseline_result, restricted_built,
                                          seed_data_parallel)
    from autopar.planner.builder import build_problem
    from autopar.planner.checkpointing import plan_recompute
    from autopar.planner.table_partition import TablePartition, fit_tables, with_tables
    from autopar.solver.driver import remembering

    mesh = options.mesh(mesh)
    if traced.precision != options.precision:
        raise ValueError(f"{traced.model_name} was traced for {traced.precision} compute but the options ask for "
                         f"{options.precision}: trace with precision={options.precision!r}")
    chunks = options.batch_norm_chunks(mesh.num_devices)
    if traced.batch_norm_chunks != chunks:
        raise ValueError(f"{traced.model_name} was traced with batch_norm_chunks={traced.batch_norm_chunks} but "
                         f"batch_norm_stats={options.batch_norm_stats!r} on {mesh.num_devices} devices needs "
                         f"{chunks}: trace with trace_for_planning(..., batch_norm_chunks={chunks})")
    progress = progress or Progress()
    with progress.stage("strategies", f"{sum(1 for _ in traced.compute_nodes())} ops on mesh {mesh}"):
        built = build_problem(traced, profile, mesh, budget_bytes=options.budget_bytes(mesh),
                              options=options, fixed=fixed, segmented=restrict is not None)
    if restrict is not None:
        built = restricted_built(built, traced, restrict[1], restrict[0])

    def replan(b):
        return plan_recompute(traced, profile, b, mode=options.checkpoint, solver=options.solver,
                              time_limit=options.time_limit, progress=progress,
                              solve_plain=lambda p: _solve(p, options=options, progress=progress, stage="solve"))

    with remembering():  # one scope for the re-solves (offload's refits): each one's plans are incumbents of the next
        seeded = seed_data_parallel(traced, built, options)  # a restricted ``built`` (a fixed configuration) refuses it
        rc = fit_device_room(traced, built, replan(built), options=options, replan=replan, progress=progress)
        # Table-wise tables go whole onto one device each; a re-plan if the fullest then overflows.
        # (The chunk runtime that runs an offloading plan keeps every table evenly split.)
        tables = TablePartition()
        if options.offload == "none":
            rc, tables = fit_tables(traced, built, rc, replan=replan, progress=progress)
    results = ()
    if options.baselines:
        results = tuple(baseline_result(n, traced, built, solve=_stage_solver(options, progress),
                                        progress=progress, solved=seeded if n == "data-parallel" else None)
                        for n in applicable_baselines(mesh.ndim, zero=options.zero_stage == "auto"))
    assembled = assemble_plan(
        traced, built, choice=rc.choice, evaluation=rc.evaluation, solution=rc.solution,
        timings=progress.timings, baselines=results, recompute=rc.regions,
        checkpoint={"mode": options.checkpoint, "method": rc.method, "units": list(rc.units),
                    "activation_bytes": rc.activation_bytes, **rc.info},
        reduce_dtype=options.reduce_dtype)
    assembled = with_tables(assembled, tables)
    if options.offload != "none":
        assembled = with_offload(assembled, traced, built, rc.choice, options=options)
    return PlanResult(assembled, traced, profile, built, rc)


def _stage_solver(options: PlanOptions, progress: Progress) -> Callable:
    """``solve(problem, stage)`` as ``_solve`` with these options: what ``baseline_result`` calls."""
    return lambda problem, stage: _solve(problem, options=options, progress=progress, stage=stage)


def _solve(problem, *, options: PlanOptions, progress: Progress, stage: str):
    from autopar.solver.driver import solve

    with progress.stage(stage, f"{problem.num_nodes} decisions, {problem.num_edges} edges"):
        return solve(problem, solver=options.solver, time_limit=options.time_limit)


# ------------------------------------------------------------------------------ mesh search
def plan_mesh_auto(model: Any, meta_inputs: tuple | dict, *, nodes: int | None, devices_per_node: int | None,
                   options: PlanOptions = PlanOptions(), progress: Progress | None = None,
                   time_budget: float | None = None, restrict: str = "auto"):
    """Plan ``model`` on every 1-3 axis arrangement of ``nodes`` x ``devices_per_node`` devices of the
    ``options.preset`` preset (``autopar.planner.mesh_search``), tracing and profiling once; returns
    the ``MeshSearch``: every candidate's row and the fastest one's ``PlanResult`` (``.best``).
    ``time_budget``: seconds for the whole call, trace and profile included (default
    ``options.time_limit``; each solve gets what is left, candidates not reached or predicted not to
    fit are reported as such); the cluster's own shape goes first, planned with the full
    ``options.time_limit``. ``restrict``: 3-axis meshes exactly or restricted (``search_meshes``).
    Baselines (``options.baselines``) are solved for the chosen mesh only."""
    from autopar.layout.mesh import PRESETS

    if nodes is None or devices_per_node is None:
        raise ValueError(f"mesh='auto' needs nodes= and devices_per_node=, got nodes={nodes!r}, "
                         f"devices_per_node={devices_per_node!r}")
    if options.preset not in PRESETS:
        raise ValueError(f"mesh='auto' needs a device preset ({', '.join(sorted(PRESETS))}), got {options.preset!r}")
    start = time.perf_counter()
    progress = progress or Progress()
    traced, prof = _trace_and_profile(model, meta_inputs, precision=options.precision, progress=progress,
                                      batch_norm_chunks=options.batch_norm_chunks(nodes * devices_per_node))
    return search_traced(traced, prof, cluster=(nodes, devices_per_node), options=options, progress=progress,
                         start=start, time_budget=time_budget, restrict=restrict)


def search_traced(traced: TracedGraph, prof: ModelProfile, *, cluster: tuple[int, int], options: PlanOptions,
                  progress: Progress, start: float, time_budget: float | None = None, restrict: str = "auto"):
    """``plan_mesh_auto`` from a trace and profile; ``start``: when the call began (its budget's origin)."""
    from autopar.planner.mesh_search import search_meshes

    each = replace(options, baselines=False)

    def plan_on(mesh: MeshSpec, left: float | None, fixed: Callable | None = None) -> PlanResult:
        limited = each if left is None else replace(each, time_limit=min(each.time_limit, left))
        with progress.stage(f"mesh {'x'.join(map(str, mesh.shape))}" + (f" ({fixed})" if fixed else "")):
            return plan_traced(traced, prof, mesh=mesh, options=limited, progress=Progress(), fixed=fixed)

    budget = options.time_limit if time_budget is None else time_budget
    found = search_meshes(plan_on, nodes=cluster[0], devices_per_node=cluster[1], device=options.preset,
                          time_budget=budget - (time.perf_counter() - start), restrict=restrict)
    if not options.baselines:
        return found
    from autopar.planner.assemble import applicable_baselines, baseline_result

    best = found.best
    spec = best.plan.mesh
    results = tuple(baseline_result(name, traced, best.built, solve=_stage_solver(options, progress), progress=progress)
                    for name in applicable_baselines(spec.ndim, zero=options.zero_stage == "auto"))
    best = replace(best, plan=replace(best.plan, baselines=results))
    return replace(found, best=best)


def plan_candidates(model: Any, meta_inputs: tuple | dict, *, meshes: Sequence[MeshSpec | Sequence[int] | str],
                    options: PlanOptions, progress: Progress | None = None):
    """Plan ``model`` on each of ``meshes`` -- the arrangements of one world a user calibrated
    (e.g. the machine profiles of (4,) and (2, 2) from ``autopar calibrate``), each priced by its
    own profile -- with the same options, and keep the plan estimated fastest
    (``mesh_search.search_given``; returns its ``MeshSearch`` of ``Plan``s). Per mesh: an int
    ``options.pipeline`` is ``plan_pipelined`` (a mesh whose axis 0 is not that size gets a row
    saying so), ``"auto"`` is ``plan_auto`` (pipelines over axis 0 are candidates there too),
    else ``plan_traced``; one full-batch trace serves them all. Why not ``mesh="auto"``: its
    candidates are priced by a preset's links, which on a shared or unusual machine (4 gloo
    ranks on 2 cores) rank a 1-D data-parallel mesh against a 2-D one wrongly; a profile per
    shape prices each as measured. Calibrated meshes are compared as one machine
    (``mesh_search.on_one_machine``: each its own links, the first profile's compute, overlap
    and idle speed-up). The chosen plan's ``solver["meshes"]`` lists every row."""
    from autopar.planner.mesh_search import on_one_machine, search_given

    progress = progress or Progress()
    specs = on_one_machine([options.mesh(m) for m in meshes])  # a bad mesh fails before the trace
    worlds = sorted({s.num_devices for s in specs})
    if options.batch_norm_stats == "per_rank" and len(worlds) > 1:
        raise ValueError(f"batch_norm_stats='per_rank' cuts the batch into one chunk per rank: the candidate "
                         f"meshes must have one world size, got {worlds} devices")
    traced, prof = _trace_and_profile(model, meta_inputs, precision=options.precision, progress=progress,
                                      batch_norm_chunks=options.batch_norm_chunks(worlds[0]))

    def plan_on(mesh: MeshSpec) -> Plan:
        with progress.stage(f"mesh {'x'.join(map(str, mesh.shape))}"):
            if isinstance(options.pipeline, int):
                return plan_pipelined(model, meta_inputs, mesh=mesh, options=options, progress=Progress()).plan
            if options.pipeline == "auto" and mesh.shape[0] > 1:
                return plan_auto(model, meta_inputs, mesh=mesh, options=options, progress=Progress(),
                                 traced=traced, profile=prof).plan
            return plan_traced(traced, prof, mesh=mesh, options=replace(options, pipeline=None),
                               progress=Progress()).plan

    found = search_given(plan_on, specs, estimate_of=lambda plan: plan.estimate)
    rows = [str(row) + ("  <- chosen" if row.shape == found.best_shape else "") for row in found.rows]
    return replace(found, best=replace(found.best, solver={**found.best.solver, "meshes": rows}))


# ---------------------------------------------------------------------------------- pipeline
def plan_pipelined(model: Any, meta_inputs: tuple | dict, *, mesh: MeshSpec | Sequence[int] | str,
                   options: PlanOptions, progress: Progress | None = None,
                   family: str | None = None) -> PipelinedResult:
    """Plan ``model`` with pipeline parallelism over mesh axis 0 (``options.pipeline``: N, the
    size of that axis, or ``"auto"``): for each micro-batch count (``options.microbatches``) the
    micro-batch graph is traced once and ``autopar.planner.pipeline.search.search_stages`` cuts
    it into stages, each sharded on the sub-mesh, for each schedule (``options.schedule``); the
    fastest feasible candidate wins. ``"auto"`` also plans without a pipeline (the full batch on
    the whole mesh) and keeps the faster of the two. ``family``: each stage planned within that
    family of ``autopar.planner.baselines`` on the stage sub-mesh (a fixed configuration:
    ``HybridParallelPlugin``; needs an int ``options.pipeline``). ``ValueError`` when nothing fits."""
    from autopar.planner.pipeline.schedule import check_pipeline_zero, schedules_for

    progress = progress or Progress()
    spec = options.mesh(mesh)
    stages = spec.shape[0]
    if family is not None and options.pipeline == "auto":
        raise ValueError(f"family={family!r} plans a fixed configuration: give pipeline={stages}, not 'auto'")
    if options.pipeline == "auto":  # what the other options rule out is no candidate there, not an error
        return plan_auto(model, meta_inputs, mesh=spec, options=options, progress=progress)
    if options.pipeline != stages:
        raise ValueError(f"pipeline={options.pipeline!r} runs over mesh axis 0, which has size {stages} in mesh "
                         f"{spec.shape}: give a mesh whose first axis has size {options.pipeline}")
    if options.checkpoint not in ("auto", "none"):
        raise ValueError(f"pipelined plans decide activation recompute per stage (whole blocks): give "
                         f"checkpoint='auto' (or 'none' for no recompute), got checkpoint={options.checkpoint!r}")
    check_pipeline_zero(options.zero_stage)
    _check_full_batch(model, meta_inputs, options=options, stages=stages)
    schedules = schedules_for(options.schedule)
    staged = _stage_floors(model, meta_inputs, spec=spec, options=options, progress=progress, schedules=schedules,
                           family=family)
    lines: list[str] = []
    best = _search_counts(staged, spec=spec, options=options, progress=progress, schedules=schedules, lines=lines)
    if best is None:
        raise ValueError(f"no pipelined plan of {stages} stages fits on mesh {spec.shape}: " + "; ".join(lines))
    return PipelinedResult(_with_candidates(best[0], lines, progress), best[1], tuple(lines))


def _with_candidates(plan: Plan, lines: list[str], progress: Progress) -> Plan:
    """A pipelined ``plan`` recording every candidate tried (``inspect`` shows them) and the call's
    stage timings; a plan without a pipeline as it is (``plan_traced``'s, as ``plan_model`` gives it)."""
    if plan.pipeline is None:
        return plan
    return replace(plan, timings={**plan.timings, **progress.timings},
                   solver={**plan.solver, "pipeline": {**plan.solver["pipeline"], "candidates": list(lines)}})


def plan_auto(model: Any, meta_inputs: tuple | dict, *, mesh: MeshSpec | Sequence[int] | str, options: PlanOptions,
              progress: Progress | None = None, traced: TracedGraph | None = None,
              profile: ModelProfile | None = None, key: str | None = None) -> PipelinedResult:
    """``pipeline="auto"`` (the default of ``autopar.plan`` and ``autoparallelize``): the plan
    without a pipeline (``plan_traced`` of the full-batch graph ``traced``, traced here when not
    given) and, where ``pipeline.candidates.blocker`` finds nothing against one, pipelines over
    mesh axis 0 -- each micro-batch count's search bounded by the best step so far, the plan
    without a pipeline's first, so a count whose step floor (``pipeline.bounds``: bubbles,
    point-to-point and actions' overhead as the search prices them) cannot beat it is not
    searched, nor traced when ``pipeline.candidates.work_floor`` (factor x (ops over all devices
    + actions' overhead)) says none can; ``zero_stage="auto"`` is 0 in their stages (no ZeRO there).
    The faster plan wins (ties: no pipeline), ``ValueError`` if neither fits; ``profile``/``key``: traced's/cache's."""
    from autopar.planner.pipeline.candidates import blocker, work_floor
    from autopar.planner.pipeline.geometry import batch_size, microbatch_counts
    from autopar.planner.pipeline.schedule import schedules_for
    from autopar.tracer import profile as profile_graph

    progress = progress or Progress()
    spec = options.mesh(mesh)
    stages = spec.shape[0]
    if traced is None:
        traced, prof = _trace_and_profile(model, meta_inputs, precision=options.precision, progress=progress,
                                          detail="full batch, no pipeline",
                                          batch_norm_chunks=options.batch_norm_chunks(spec.num_devices))
    elif (prof := profile) is None:
        with progress.stage("profile"):
            prof = profile_graph(traced)
    staged_options = replace(options, zero_stage=0) if options.zero_stage == "auto" else options
    why = blocker(traced, meta_inputs, mesh=spec, options=staged_options)
    lines = [] if why is None else [f"pipeline {stages}: not a candidate: {why}"]
    try:
        flat: PlanResult | None = plan_traced(traced, prof, mesh=spec, options=replace(options, pipeline=None),
                                              progress=progress)
    except ValueError as exc:  # no plan without a pipeline fits the budget: a pipeline may
        if why is not None:
            raise
        flat = None
        lines.append(f"no pipeline: {str(exc).splitlines()[0]}")

    def flat_wins() -> PipelinedResult:
        plan = _with_candidates(flat.plan, lines, progress)
        _store(key, plan)
        return PipelinedResult(plan, traced, tuple(lines), flat)

    if why is not None:
        return flat_wins()
    incumbent = math.inf
    schedules = schedules_for(options.schedule)
    counts = microbatch_counts(batch_size(meta_inputs), num_stages=stages, asked=options.microbatches)
    if flat is not None:
        incumbent = flat.plan.estimate.step_s
        lines.append(f"no pipeline: {incumbent * 1e3:.3f} ms/step")
        floors = {m: work_floor(flat.built, num_stages=stages, num_microbatches=(m,), schedules=schedules)
                  for m in counts}
        lines += [f"pipeline {stages}: {m} micro-batches: not traced: its work floor {f * 1e3:.3f} ms/step does not "
                  f"beat {incumbent * 1e3:.3f}" for m, f in floors.items() if f >= incumbent]
        counts = tuple(m for m in counts if floors[m] < incumbent)
        if not counts:
            return flat_wins()
    try:
        staged = _stage_floors(model, meta_inputs, spec=spec, options=staged_options, progress=progress,
                               schedules=schedules, counts=counts)
        best = _search_counts(staged, spec=spec, options=staged_options, progress=progress, schedules=schedules,
                              lines=lines, incumbent=incumbent)
    except (ValueError, TraceError) as exc:  # a pipeline this model cannot have (a cut the stages refuse, a
        if flat is None:                     # micro-batch graph that does not trace): a line, not the end of
            raise                            # the default plan -- unless nothing else fits
        best = None
        lines.append(f"pipeline {stages}: no plan: {str(exc).splitlines()[0]}")
    if best is not None and best[0].estimate.step_s < incumbent:
        return PipelinedResult(_with_candidates(best[0], lines, progress), best[1], tuple(lines), flat)
    if flat is None:
        raise ValueError(f"no plan fits on mesh {spec.shape}, with or without a pipeline of {stages} stages: "
                         + "; ".join(lines))
    return flat_wins()


def plan_auto_cached(model: Any, meta_inputs: tuple | dict, *, mesh: MeshSpec, options: PlanOptions,
                     progress: Progress, key: str | None, traced: TracedGraph | None = None) -> Plan:
    """``plan_auto``'s plan, served from and stored in the plan cache under ``key`` when it has no
    pipeline (a pipelined plan is made for the micro-batch graph, which a lookup by the full
    trace's hash cannot check: those are planned again, as ``pipeline=N`` plans are)."""
    hit = cached_plan(key, mesh=mesh, options=options, progress=progress,
                      graph_hash=None if traced is None else traced.graph_hash)
    if hit is not None:
        return hit
    return plan_auto(model, meta_inputs, mesh=mesh, options=options, progress=progress, traced=traced, key=key).plan


def _check_full_batch(model, meta_inputs, *, options: PlanOptions, stages: int) -> None:
    """Refuse a pipeline whose forward combines samples of the batch, followed on the full batch's
    graph where a micro-batch holds one sample (``strategies.batch_flow``: one sample has no batch
    to follow); the default plan's ``blocker`` does the same on the trace it has."""
    from autopar.planner.pipeline.geometry import batch_size, microbatch_counts
    from autopar.strategies.batch_flow import batch_mixing, one_sample_micro_batches

    counts = microbatch_counts(batch_size(meta_inputs), num_stages=stages, asked=options.microbatches)
    if not one_sample_micro_batches(meta_inputs, counts):
        return  # each micro-batch graph is followed in _stage_floors
    traced = trace_for_planning(model, meta_inputs, precision=options.precision)
    mixing = batch_mixing(traced, meta_inputs)
    if mixing is not None:
        raise _not_pipelined(traced, mixing)


def _not_pipelined(traced: TracedGraph, why: str) -> NotImplementedError:
    return NotImplementedError(f"{traced.model_name} cannot be pipelined: {why}; plan without a pipeline (pipeline=1)")


def _stage_floors(model, meta_inputs, *, spec: MeshSpec, options: PlanOptions, progress: Progress,
                  schedules, family: str | None = None,
                  counts: tuple[int, ...] | None = None) -> dict[int, tuple[TracedGraph, StageCosts, float]]:
    """Per micro-batch count (``counts``, default ``options.microbatches``'): its graph, stage
    costs and step floor (one small solve per block class), so that the counts can be searched
    lowest floor first (``autopar.planner.pipeline.bounds``)."""
    from autopar.planner.pipeline.bounds import config_floors
    from autopar.planner.pipeline.costs import stage_costs
    from autopar.planner.pipeline.candidates import without_loss
    from autopar.planner.pipeline.geometry import batch_size, microbatch_counts
    from autopar.strategies.batch_flow import pipeline_hazard

    stages = spec.shape[0]
    staged = {}
    if counts is None:
        counts = microbatch_counts(batch_size(meta_inputs), num_stages=stages, asked=options.microbatches)
    for m in counts:
        traced, prof = _trace_and_profile(model, meta_inputs, precision=options.precision, progress=progress,
                                          microbatches=m, detail=f"micro-batch graph, {m} micro-batches")
        hazard = pipeline_hazard(traced) or without_loss(traced)
        if hazard is not None:  # the runtime would refuse the plan: say so before searching stages
            raise _not_pipelined(traced, hazard)
        with progress.stage("pipeline floors", f"{m} micro-batches"):
            costs = stage_costs(traced, prof, mesh=spec, options=options, family=family)
            floor = min(config_floors(costs, schedules=schedules, num_stages=stages, num_microbatches=m,
                                      window="auto").values())
        staged[m] = (traced, costs, floor)
    return staged


def _search_counts(staged: dict, *, spec: MeshSpec, options: PlanOptions, progress: Progress, schedules,
                   lines: list[str], incumbent: float = math.inf) -> tuple[Plan, TracedGraph] | None:
    """The fastest pipelined plan over the micro-batch counts, each search bounded by the best
    step so far (at first ``incumbent``: another plan's step): a count whose floor cannot beat it
    is not searched. ``lines`` gets every candidate."""
    from autopar.planner.pipeline.bounds import in_bound_order
    from autopar.planner.pipeline.search import search_stages

    stages = spec.shape[0]
    found: dict[int, Any] = {}

    def search(m: int, incumbent: float):
        traced, costs, _ = staged[m]
        with progress.stage("pipeline stages", f"{stages} stages, {m} micro-batches"):
            found[m] = search_stages(traced, None, mesh=spec, options=options, num_stages=stages, num_microbatches=m,
                                     schedules=schedules, costs=costs, window="auto",
                                     bound=None if incumbent == math.inf else incumbent)
        return found[m]

    def skipped(m: int, floor: float, incumbent: float):
        lines.append(f"pipeline {stages}: {m} micro-batches: not searched: its floor {floor * 1e3:.3f} ms/step does "
                     f"not beat {incumbent * 1e3:.3f}")

    in_bound_order({m: floor for m, (_, _, floor) in staged.items()}, search,
                   step_of=lambda f: None if f.plan is None else f.plan.estimate.step_s, skipped=skipped,
                   incumbent=incumbent)
    best: tuple[Plan, Any] | None = None
    for m, result in sorted(found.items()):
        lines += [f"pipeline {stages}: {c}" for c in result.candidates]
        if result.plan is not None and (best is None or result.plan.estimate.step_s < best[0].estimate.step_s):
            best = (result.plan, staged[m][0])
    return best


def plan_family(model: Any, meta_inputs: tuple | dict, family: str, *, mesh: MeshSpec,
                options: PlanOptions) -> Plan:
    """The fastest plan of one ``family`` (``autopar.planner.baselines``: a baseline such as
    ``"zero1"``, or a fixed configuration's, ``"dp x megatron"``) for ``model`` on ``mesh``: the
    planner's own problem restricted to the family, solved and assembled (no recompute), with
    ``options.offload`` applied. What a fixed-configuration plugin (``LowLevelZeroPlugin``,
    ``HybridParallelPlugin``) runs: the same kind of ``Plan`` as the auto plan, inspectable alike."""
    from autopar.planner.assemble import assemble_plan, baseline_problem
    from autopar.planner.builder import build_problem
    from autopar.planner.checkpointing import estimate
    from autopar.solver.driver import solve
    from autopar.tracer import profile as profile_graph

    traced = trace_for_planning(model, meta_inputs, precision=options.precision,
                                batch_norm_chunks=options.batch_norm_chunks(mesh.num_devices))
    built = build_problem(traced, profile_graph(traced), mesh, budget_bytes=options.budget_bytes(mesh),
                          options=options, segmented=True)
    problem = baseline_problem(family, traced, built)
    solution = solve(problem, solver=options.solver, time_limit=options.time_limit)
    evaluation = estimate(built, problem, solution.choice, (), built.segment_inputs)
    plan = assemble_plan(traced, built, choice=solution.choice, evaluation=evaluation, solution=solution,
                         checkpoint={"mode": "none"}, reduce_dtype=options.reduce_dtype)
    if options.offload != "none":
        plan = with_offload(plan, traced, built, solution.choice, options=options)
    return plan

