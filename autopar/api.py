"""The public entry points: ``plan`` (offline, no process group) and ``autoparallelize`` (every rank).

``plan(model, meta_inputs, *, mesh, ...)`` traces the model on fake tensors, profiles it,
enumerates sharding strategies per node, builds the plain-data problem, solves the ILP under the
per-device memory budget and returns a :class:`~autopar.plans.Plan`. With ``baselines=True`` it
also solves data parallel, ZeRO-3, Megatron TP and DP x TP in the same cost model.
``plan_model`` and ``plan_traced`` (from an existing trace and profile: one trace serves many
meshes and budgets) take a :class:`PlanOptions` and return a :class:`PlanResult`: the plan and
the intermediate traced graph, profile, built problem and recompute plan (for reports).

``autoparallelize`` is called on EVERY rank after ``torch.distributed.init_process_group``.
Ranks agree or all fail, never leaving one rank alone in a collective: every rank checks its
arguments, loads the plan file if any and traces the model itself, then one
``all_gather_object`` compares what can differ between ranks (graph hash with the input shapes,
mesh, world size, versions, plan content, per-rank options) and any error so far; a difference
or an error raises the same ``ValueError`` on every rank. Then rank 0 solves from its trace and
broadcasts the plan's JSON (``broadcast_object_list``), or its error, which every rank raises.
``autopar.runtime.build.build_module`` emits the module from the plan on every rank, and a
second small gather makes a build failure on one rank fail every rank.

Torch is imported inside the functions only, so ``import autopar`` stays cheap.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

from autopar.layout.mesh import MeshSpec, resolve_preset
from autopar.planner.options import OffloadPolicy, PlanOptions, precision_name
from autopar.offload import runtime_options
from autopar.planner.offload_fit import fit_device_room, with_offload
from autopar.agreement import _agree, _all_gather, _check_plan_options, _fingerprint, _raise_failures, _ranks, _status, world_cluster  # noqa: F401
from autopar.api_pipelined import PipelinedResult
from autopar.plans import BaselineResult, Plan
from autopar.stages import Progress

if TYPE_CHECKING:
    import torch
    from torch import nn

    from autopar.planner.checkpointing import RecomputePlan
    from autopar.planner.records import BuiltProblem
    from autopar.runtime.module import AutoParallelModule
    from autopar.runtime.pipeline import PipelineModule
    from autopar.tracer.graph import TracedGraph
    from autopar.tracer.profile import ModelProfile

__all__ = ["plan", "plan_model", "plan_traced", "plan_pipelined", "autoparallelize", "PlanOptions", "PlanResult",
           "PipelinedResult", "Progress"]


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


# ---------------------------------------------------------------------------------- planning
def plan(
    model: Any,
    meta_inputs: tuple | dict,
    *,
    mesh: MeshSpec | Sequence[int] | str,
    memory_budget: int | float | str | None = None,
    solver: str = "auto",
    time_limit: float = 60.0,
    preset: str | None = None,
    baselines: bool = False,
    optimizer_multiplier: float = 2.0,
    allow_replicate_fallback: bool = False,
    verbose: bool = False,
    progress: Progress | None = None,
    checkpoint: str = "auto",
    precision: str = "fp32",
    reduce_dtype: str = "fp32",
    zero_stage: int | str = 0,
    device: str | None = None,
    cache: bool = True,
    nodes: int | None = None,
    devices_per_node: int | None = None,
    pipeline: int | str | None = None,
    microbatches: int | str = "auto",
    schedule: str = "auto",
    offload: str | OffloadPolicy = "none",
) -> Plan:
    """Plan ``model`` on ``mesh`` offline. ``mesh``: a MeshSpec, or a shape (``(2, 4)``/``"2x4"``)
    with the ``preset`` device preset's costs (default ``"cpu"``; ``device`` is its deprecated old
    name), or ``"auto"``: the fastest arrangement of ``nodes`` x ``devices_per_node`` devices
    as a 1-3 axis mesh (``plan_mesh_auto``; not cached). ``memory_budget``: bytes or ``"16GiB"``; None = the device capacity from the MeshSpec.
    ``checkpoint``: activation recompute planning, ``"auto"`` (the faster of the joint ILP +
    Rotor refinement and Rotor alone; nothing when the budget cannot bind), ``"ilp"``,
    ``"rotor"``, ``"both"`` or ``"none"`` (see ``autopar.planner.checkpointing``). ``precision``:
    ``"fp32"``, ``"bf16"`` or ``"fp16"`` compute with fp32 master weights, priced as it runs
    (``autopar.tracer.precision``); ``reduce_dtype``: what gradients are summed in. ``zero_stage``:
    1/2 shard optimizer state (and gradients) over each parameter's replicated axes. The other
    options: see :class:`PlanOptions`. ``plan_model`` returns the intermediate results too.
    ``cache``: serve the plan from the on-disk plan cache when this model, inputs, mesh and options
    were planned before (no trace, no solve), and store it otherwise; ``AUTOPAR_CACHE=0`` switches
    the cache off everywhere (``autopar.planner.cache``). ``pipeline``: None, N (pipeline
    parallelism over mesh axis 0 of size N, stages and sharding planned together:
    ``plan_pipelined``) or ``"auto"`` (the faster of no pipeline and one over axis 0), with
    ``microbatches`` (``"auto"`` or M) and ``schedule`` (``"auto"``, ``"gpipe"``, ``"1f1b"``,
    ``"interleaved-1f1b"``, ``"zero-bubble"``); pipelined plans are not cached. ``offload``:
    ``"none"``, ``"auto"`` or an ``OffloadPolicy`` (parameters / optimizer state on the mesh's host
    tier, ``autopar.planner.offload_pricing``; ``Plan.offload`` records where each one lives)."""
    options = PlanOptions(memory_budget=memory_budget, solver=solver, time_limit=time_limit,
                          preset=resolve_preset(preset, device), baselines=baselines,
                          optimizer_multiplier=optimizer_multiplier,
                          allow_replicate_fallback=allow_replicate_fallback, checkpoint=checkpoint,
                          precision=precision, reduce_dtype=reduce_dtype, zero_stage=zero_stage,
                          pipeline=pipeline, microbatches=microbatches, schedule=schedule, offload=offload)
    progress = progress or Progress(verbose)
    if options.pipeline is not None:
        if isinstance(mesh, str) and mesh == "auto":
            raise ValueError("pipeline= plans over the given mesh's first axis; mesh='auto' is not supported with it")
        return plan_pipelined(model, meta_inputs, mesh=mesh, options=options, progress=progress).plan
    if isinstance(mesh, str) and mesh == "auto":
        return plan_mesh_auto(model, meta_inputs, nodes=nodes, devices_per_node=devices_per_node, options=options,
                              progress=progress).best.plan
    if nodes is not None or devices_per_node is not None:
        raise ValueError(f"nodes= and devices_per_node= go with mesh='auto', got mesh={mesh!r}")
    spec = options.mesh(mesh)  # a bad mesh fails before anything else
    key = _cache_key(model, meta_inputs, mesh=spec, options=options, cache=cache)
    if key is not None:
        from autopar.planner import cache as plan_cache

        hit = plan_cache.lookup(key, mesh=spec, options=options)
        if hit is not None:
            _note_hit(progress, hit[1])
            return hit[0]
    return _plan_and_store(model, meta_inputs, mesh=spec, options=options, progress=progress, key=key).plan


def plan_model(model: Any, meta_inputs: tuple | dict, *, mesh: MeshSpec | Sequence[int] | str,
               options: PlanOptions = PlanOptions(), progress: Progress | None = None,
               cache: bool = True) -> PlanResult:
    """Trace and profile ``model``, then ``plan_traced``. ``cache``: store the plan in the plan
    cache (where ``plan`` and ``autoparallelize`` find it); a ``PlanResult`` carries the problem
    and solution behind the plan, which the cache does not keep, so this always solves."""
    mesh = options.mesh(mesh)  # a bad mesh fails before the trace
    key = _cache_key(model, meta_inputs, mesh=mesh, options=options, cache=cache)
    return _plan_and_store(model, meta_inputs, mesh=mesh, options=options, progress=progress, key=key)


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
    from autopar.strategies import needs_decomposition
    from autopar.tracer import profile as profile_graph
    from autopar.tracer import trace

    if nodes is None or devices_per_node is None:
        raise ValueError(f"mesh='auto' needs nodes= and devices_per_node=, got nodes={nodes!r}, "
                         f"devices_per_node={devices_per_node!r}")
    if options.preset not in PRESETS:
        raise ValueError(f"mesh='auto' needs a device preset ({', '.join(sorted(PRESETS))}), got {options.preset!r}")
    start = time.perf_counter()
    progress = progress or Progress()
    with progress.stage("trace"):
        traced = trace(model, meta_inputs, decompose_if=needs_decomposition, precision=options.precision)
    with progress.stage("profile"):
        prof = profile_graph(traced)
    return _search_traced(traced, prof, cluster=(nodes, devices_per_node), options=options, progress=progress,
                          start=start, time_budget=time_budget, restrict=restrict)


def _search_traced(traced: TracedGraph, prof: ModelProfile, *, cluster: tuple[int, int], options: PlanOptions,
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
    from autopar.planner.assemble import applicable_baselines

    best = found.best
    spec = best.plan.mesh
    results = tuple(_baseline(name, traced, best.built, options=options, progress=progress)
                    for name in applicable_baselines(spec.ndim, zero=options.zero_stage == "auto"))
    best = replace(best, plan=replace(best.plan, baselines=results))
    return replace(found, best=best)


def _plan_and_store(model, meta_inputs, *, mesh: MeshSpec, options: PlanOptions, progress: Progress | None,
                    key: str | None) -> PlanResult:
    from autopar.strategies import needs_decomposition
    from autopar.tracer import profile as profile_graph
    from autopar.tracer import trace

    progress = progress or Progress()
    with progress.stage("trace"):
        traced = trace(model, meta_inputs, decompose_if=needs_decomposition, precision=options.precision)
    with progress.stage("profile"):
        prof = profile_graph(traced)
    result = plan_traced(traced, prof, mesh=mesh, options=options, progress=progress)
    if key is not None:
        from autopar.planner import cache as plan_cache

        plan_cache.store(key, result.plan)
    return result


def plan_pipelined(model: Any, meta_inputs: tuple | dict, *, mesh: MeshSpec | Sequence[int] | str,
                   options: PlanOptions, progress: Progress | None = None) -> PipelinedResult:
    """Plan ``model`` with pipeline parallelism over mesh axis 0 (``autopar.api_pipelined``)."""
    from autopar.api_pipelined import plan_pipelined as search

    return search(model, meta_inputs, mesh=mesh, options=options, progress=progress or Progress(),
                  plan_traced=plan_traced)


def _cache_key(model, meta_inputs, *, mesh: MeshSpec, options: PlanOptions, cache: bool) -> str | None:
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


def _note_hit(progress: Progress, path) -> None:
    if progress.verbose:
        progress.sink(f"[autopar {time.perf_counter() - progress._start:6.1f}s] plan cache hit {path}")


def plan_traced(traced: TracedGraph, profile: ModelProfile, *, mesh: MeshSpec | Sequence[int] | str,
                options: PlanOptions = PlanOptions(), progress: Progress | None = None,
                fixed: Callable | None = None) -> PlanResult:
    """The plan of an existing trace and profile (one trace serves many meshes); ``fixed``: ``build_problem``'s."""
    from autopar.planner.assemble import applicable_baselines, assemble_plan
    from autopar.planner.builder import build_problem
    from autopar.planner.checkpointing import plan_recompute

    mesh = options.mesh(mesh)
    if traced.precision != options.precision:
        raise ValueError(f"{traced.model_name} was traced for {traced.precision} compute but the options ask for "
                         f"{options.precision}: trace with precision={options.precision!r}")
    progress = progress or Progress()
    with progress.stage("strategies", f"{sum(1 for _ in traced.compute_nodes())} ops on mesh {mesh}"):
        built = build_problem(traced, profile, mesh, budget_bytes=options.budget_bytes(mesh),
                              options=options, fixed=fixed)
    replan = lambda b: plan_recompute(traced, profile, b, mode=options.checkpoint, solver=options.solver,  # noqa: E731
                                      time_limit=options.time_limit, progress=progress,
                                      solve_plain=lambda p: _solve(p, options=options, progress=progress, stage="solve"))
    from autopar.solver.driver import remembering

    with remembering():  # one scope for the re-solves (offload's refits): each one's plans are incumbents of the next
        rc = fit_device_room(traced, built, replan(built), options=options, replan=replan, progress=progress)
    results = ()
    if options.baselines:
        results = tuple(_baseline(name, traced, built, options=options, progress=progress)
                        for name in applicable_baselines(mesh.ndim, zero=options.zero_stage == "auto"))
    assembled = assemble_plan(
        traced, built, choice=rc.choice, evaluation=rc.evaluation, solution=rc.solution,
        timings=progress.timings, baselines=results, recompute=rc.regions,
        checkpoint={"mode": options.checkpoint, "method": rc.method, "units": list(rc.units),
                    "activation_bytes": rc.activation_bytes, **rc.info},
        reduce_dtype=options.reduce_dtype)
    if options.offload != "none":
        assembled = with_offload(assembled, traced, built, rc.choice, options=options)
    return PlanResult(assembled, traced, profile, built, rc)


def _solve(problem, *, options: PlanOptions, progress: Progress, stage: str):
    from autopar.solver.driver import solve

    with progress.stage(stage, f"{problem.num_nodes} decisions, {problem.num_edges} edges"):
        return solve(problem, solver=options.solver, time_limit=options.time_limit)


def _baseline(name: str, traced, built, *, options: PlanOptions, progress: Progress) -> BaselineResult:
    from autopar.planner.assemble import baseline_problem, estimate_of
    from autopar.planner.checkpointing import estimate
    from autopar.solver.driver import SolveTimeout

    try:
        with progress.stage(f"baseline {name}"):
            problem = baseline_problem(name, traced, built)
        solution = _solve(problem, options=options, progress=progress, stage=f"baseline {name} solve")
    except (ValueError, SolveTimeout) as exc:  # the family cannot fit the budget (or has no legal layout), or
        return BaselineResult(name, False, None, str(exc).splitlines()[0])  # no plan of it was found in time
    evaluation = estimate(built, problem, solution.choice, (), built.segment_inputs)
    return BaselineResult(name, True, estimate_of(evaluation))


# ---------------------------------------------------------------------------------- runtime
def autoparallelize(
    model: nn.Module,
    meta_inputs: tuple | dict,
    *,
    mesh: MeshSpec | Sequence[int] | str | None = None,
    memory_budget: int | float | str | None = None,
    plan: Plan | str | os.PathLike | None = None,
    solver: str = "auto",
    time_limit: float | None = None,
    device: str | torch.device | None = None,
    seed: int = 0,
    init_weights: bool = True,
    local_inputs: bool = False,
    allow_replicate_fallback: bool = False,
    checkpoint: str = "auto",
    precision: str | None = None,
    reduce_dtype: str | None = None,
    zero_stage: int | str | None = None,
    cache: bool = True,
    nodes: int | None = None,
    devices_per_node: int | None = None,
    pipeline: int | str | None = None,
    microbatches: int | str = "auto",
    schedule: str = "auto",
    offload: str | OffloadPolicy = "none",
    verify: bool | tuple | dict = False,
) -> AutoParallelModule | PipelineModule:
    """Shard ``model`` over the current process group; see the module docstring.

    ``mesh``: None = 1-D over the world size; a shape gets the ``cpu`` preset on CPU (an H100 or
    A100 preset on CUDA); or a ``MeshSpec``; or ``"auto"``: rank 0 plans every 1-3 axis mesh of
    the world's ``nodes`` x ``devices_per_node`` devices (``plan_mesh_auto``) and every rank
    builds on the fastest; either count may be left out when the other or the launcher's
    ``LOCAL_WORLD_SIZE`` (torchrun's devices per node) gives it, else one node of world-size
    devices. ``plan``: a ``Plan`` or a path to its JSON, applied
    without solving. ``device``: the torch device where the local shards live (default: see
    ``autopar.runtime.build.runtime_device``). ``time_limit``: None = ``PlanOptions``' default.
    ``seed``: initialisation seed for a model on ``meta`` (``init_weights=False``: zeros, to be
    filled with ``load_full_state_dict``). ``local_inputs``: ``forward`` receives each rank's
    piece of every input under the plan's input layouts instead of the full batch.
    ``checkpoint``: activation recompute planning (``plan``); a loaded plan's recompute regions
    are applied as they are. ``precision``: ``"fp32"`` (default), ``"bf16"`` or ``"fp16"`` compute;
    parameters and optimizer state stay fp32, gradients are summed in ``reduce_dtype`` (default
    fp32); a loaded plan brings its own (``ValueError`` when they disagree). fp16 wants loss
    scaling: ``autopar.GradScaler``. ``zero_stage``: 0 (default), 1 or 2 -- shard optimizer state
    (and gradients) over each parameter's replicated axes -- or ``"auto"`` (the solver picks per
    parameter); build the optimizer with
    ``model.optimizer(torch.optim.AdamW, lr=...)`` (``autopar.runtime.zero``). ``cache``: rank 0
    serves the plan from the plan cache (``autopar.planner.cache``) when its structural key and
    this trace's graph hash match an entry, and stores what it solves; the other ranks get the
    plan by broadcast either way.

    ``pipeline``: None, N or ``"auto"`` with ``microbatches`` and ``schedule`` (see ``plan``):
    rank 0 plans the stages (``plan_pipelined``), every rank traces the micro-batch graph and
    builds its stages with ``autopar.runtime.pipeline.build_pipeline``; the result is then a
    ``PipelineModule`` (``pm.step(**full_batch)`` runs forward and backward under the schedule).
    ``offload``: ``"auto"`` or an ``OffloadPolicy`` (see ``plan``; ZeRO and recompute planned jointly): a plan that
    offloads (planned or given) runs in the chunk runtime (``module.gemini``, ``autopar.runtime.gemini``);
    ``module.optimizer(torch.optim.AdamW, ...)`` or the booster steps host chunks on the host.
    ``verify``: after building, run one forward and backward under the plan and under the
    all-replicated plan and compare the loss and every gradient (``autopar.runtime.verify``;
    ``PlanVerificationError`` names the first diverging node); ``True`` checks on ``meta_inputs``
    when they hold values, else on inputs made up from their shapes (``autopar.runtime.verify.verify_inputs``); or pass
    the inputs to check on. Costs one extra step; the module is left as it was.

    Ranks agree or all fail: before anyone plans, the ranks compare (one ``all_gather_object``)
    their traced graph, input shapes, mesh, world size, versions, plan file and per-rank options,
    and an error on any rank up to then; after building, whether every rank built. Any
    difference or failure raises the same ``ValueError`` on every rank. ``memory_budget``,
    ``solver``, ``time_limit``, ``checkpoint`` and ``allow_replicate_fallback`` are rank 0's.
    """
    import torch.distributed as dist

    from autopar.runtime.build import build_module, check_plan, runtime_device
    from autopar.runtime.gemini import attach_planned

    if not dist.is_initialized():
        raise ValueError("autoparallelize needs torch.distributed.init_process_group() first")
    dev = runtime_device(device)
    progress = Progress()
    try:
        prep: _Prepared | Exception = _prepare(
            model, meta_inputs, mesh=mesh, plan=plan, device=dev, progress=progress,
            cluster=(nodes, devices_per_node),
            options={"memory_budget": memory_budget, "solver": solver, "checkpoint": checkpoint,
                     "allow_replicate_fallback": allow_replicate_fallback, "precision": precision,
                     "reduce_dtype": reduce_dtype, "zero_stage": zero_stage, "pipeline": pipeline,
                     "microbatches": microbatches, "schedule": schedule, "offload": offload,
                     **({} if time_limit is None else {"time_limit": time_limit})},
            per_rank={"seed": seed, "init_weights": init_weights, "local_inputs": local_inputs})
    except Exception as exc:  # noqa: BLE001 -- every rank learns of it in _agree
        prep = exc
    _agree(prep, device=dev)
    assert isinstance(prep, _Prepared)  # _agree raised otherwise
    chosen = prep.plan if prep.plan is not None else _solve_on_rank0(
        prep.traced, mesh=prep.spec, options=prep.options, progress=progress, device=dev,
        cache_of=(model, meta_inputs) if cache else None, auto=prep.auto, source=(model, meta_inputs))
    if chosen.pipeline is not None:
        if verify is not False:
            raise NotImplementedError("verify=: pipelined plans are not verified yet; verify the plan without "
                                      "pipeline= or leave verify off")
        return _build_pipelined(model, meta_inputs, chosen, spec=prep.spec, device=dev, seed=seed,
                                init_weights=init_weights, local_inputs=local_inputs)
    # Every rank has the same trace, mesh and plan now, so this check fails everywhere or nowhere.
    check_plan(chosen, graph_hash=prep.traced.graph_hash, world_size=dist.get_world_size(), mesh=prep.spec)
    try:
        built: AutoParallelModule | Exception = build_module(
            model, prep.traced, chosen, device=dev, seed=seed, init_weights=init_weights, local_inputs=local_inputs)
        attach_planned(built, chosen)  # parameters / optimizer state on Plan.offload's tiers, if any
    except Exception as exc:  # noqa: BLE001 -- every rank learns of it below
        built = exc
    _raise_failures(_all_gather(_status(built), device=dev), built, when="while building the module")
    assert not isinstance(built, Exception)
    if verify is not False:
        from autopar.runtime.verify import verify_module, verify_inputs

        verify_module(built, verify_inputs(prep.traced, meta_inputs if verify is True else verify, seed=seed))
    return built


def _build_pipelined(model, meta_inputs, plan: Plan, *, spec: MeshSpec | None, device, seed: int, init_weights: bool,
                     local_inputs: bool) -> PipelineModule:
    """Every rank traces the plan's MICRO-batch graph and builds its stages (``build_pipeline``);
    a failure on any rank fails every rank."""
    import torch.distributed as dist

    from autopar.planner.pipeline.geometry import PIPELINE_CASTS, micro_inputs
    from autopar.runtime.pipeline import build_pipeline
    from autopar.strategies import needs_decomposition
    from autopar.tracer import trace

    try:
        if local_inputs:
            raise ValueError("local_inputs=True does not apply to a pipelined plan (its step takes the full batch)")
        if plan.mesh.num_devices != dist.get_world_size() or (spec is not None and tuple(spec.shape) != plan.mesh.shape):
            raise ValueError(f"the pipelined plan is for mesh {plan.mesh.shape}; this launch has "
                             f"{dist.get_world_size()} ranks" + (f" and mesh {spec.shape}" if spec is not None else ""))
        micro = trace(model, micro_inputs(meta_inputs, plan.pipeline.num_microbatches),
                      decompose_if=needs_decomposition, precision=plan.precision, param_casts=PIPELINE_CASTS)
        built: Any = build_pipeline(model, micro, plan, device=device, seed=seed, init_weights=init_weights)
    except Exception as exc:  # noqa: BLE001 -- every rank learns of it below
        built = exc
    _raise_failures(_all_gather(_status(built), device=device), built, when="while building the pipeline")
    return built


@dataclass(frozen=True, slots=True)
class _Prepared:
    """One rank's inputs to planning and building, and what it must share with every other rank."""

    traced: TracedGraph  # this rank's own trace
    spec: MeshSpec | None  # the mesh asked for (None: the plan's)
    options: PlanOptions | None  # rank 0 plans with these (None: a plan was given)
    plan: Plan | None  # the given plan
    fingerprint: tuple[tuple[str, str, str], ...]  # (what, compared key, shown) per check
    auto: tuple[int, int] | None = None  # mesh="auto": (nodes, devices per node) to search over


def _prepare(model, meta_inputs, *, mesh, plan, device, progress: Progress, options: dict,
             per_rank: dict, cluster: tuple[int | None, int | None] = (None, None)) -> _Prepared:
    """Everything a rank does alone before the ranks compare: check the arguments, load the plan,
    trace. Raises on bad input (``autoparallelize`` hands the error to ``_agree``)."""
    import torch.distributed as dist

    from autopar.runtime.build import mesh_preset
    from autopar.strategies import needs_decomposition
    from autopar.tracer import trace

    world = dist.get_world_size()
    preset = mesh_preset(device)
    auto = None
    if isinstance(mesh, str) and mesh == "auto":
        if plan is not None:
            raise ValueError("mesh='auto' searches for a plan; a given plan brings its own mesh: leave one out")
        auto, mesh = world_cluster(world, *cluster), None
    elif cluster != (None, None):
        raise ValueError(f"nodes= and devices_per_node= go with mesh='auto', got mesh={mesh!r}")
    spec = None if mesh is None else MeshSpec.coerce(mesh, preset=preset)
    if spec is not None and spec.num_devices != world:
        raise ValueError(f"mesh {spec.shape} has {spec.num_devices} devices but the process group has {world} ranks")
    options = runtime_options(options, plan_given=plan is not None)  # offload: checked, ZeRO 0 unless given
    asked = {k: options[k] for k in ("precision", "reduce_dtype", "zero_stage")}
    plan_options, source = None, "solved by rank 0"
    if plan is None:
        plan_options = PlanOptions(**{**options, "precision": options["precision"] or "fp32",
                                      "reduce_dtype": options["reduce_dtype"] or "fp32",
                                      "zero_stage": 0 if options["zero_stage"] is None else options["zero_stage"]},
                                   preset=preset)
        if auto is None:
            spec = spec or MeshSpec.coerce((world,), preset=preset)
    else:
        source = "a Plan object" if isinstance(plan, Plan) else os.fspath(plan)
        plan = plan if isinstance(plan, Plan) else Plan.load(os.fspath(plan))
        _check_plan_options(plan, **asked)
    with progress.stage("trace"):
        traced = trace(model, meta_inputs, decompose_if=needs_decomposition,
                       precision=plan.precision if plan_options is None else plan_options.precision)
    fingerprint = _fingerprint(traced, meta_inputs, world=world, spec=spec, plan=plan, source=source,
                               device=device, options={**asked, **per_rank}, auto=auto)
    return _Prepared(traced, spec, plan_options, plan, fingerprint, auto)


def _solve_on_rank0(traced: TracedGraph, *, mesh: MeshSpec | None, options: PlanOptions, progress: Progress,
                    device, cache_of: tuple | None = None, auto: tuple[int, int] | None = None,
                    source: tuple | None = None) -> Plan:
    """Rank 0 solves from its trace (the same as every rank's: ``_agree`` compared them); every
    rank gets the plan, or rank 0's error as the same message, by broadcast. ``cache_of``: the
    (model, meta inputs) to key the plan cache with; rank 0 alone reads and fills it. ``auto``:
    (nodes, devices per node) to search the mesh over (``mesh`` is then None; not cached)."""
    import torch.distributed as dist

    error = None
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            if options.pipeline is not None:  # traces the micro-batch graphs itself: needs the model
                if auto is not None or source is None:
                    raise ValueError("pipeline= needs a given mesh (not mesh='auto') whose first axis is the pipeline")
                plan = plan_pipelined(*source, mesh=mesh, options=options, progress=progress).plan
            elif auto is not None:
                plan = _search_on_rank0(traced, cluster=auto, options=options, progress=progress)
            else:
                plan = _plan_on_rank0(traced, mesh=mesh, options=options, progress=progress, cache_of=cache_of)
            payload[0] = ("ok", plan.to_json())
        except Exception as exc:  # noqa: BLE001 -- re-raised on every rank below
            payload[0], error = (type(exc).__name__, str(exc)), exc
    if device.type == "cuda" and dist.get_backend() == "nccl":
        dist.broadcast_object_list(payload, src=0, device=device)
    else:
        dist.broadcast_object_list(payload, src=0)
    status, text = payload[0]
    if error is not None:
        raise error
    if status == "ValueError":  # bad input (e.g. no plan fits the budget): the same error everywhere
        raise ValueError(text)
    if status != "ok":
        raise ValueError(f"planning failed on rank 0: {status}: {text}")
    return Plan.from_json(text)


def _search_on_rank0(traced: TracedGraph, *, cluster: tuple[int, int], options: PlanOptions,
                     progress: Progress) -> Plan:
    """mesh="auto" under ``autoparallelize``: the fastest mesh's plan from this trace."""
    from autopar.tracer import profile as profile_graph

    start = time.perf_counter()
    with progress.stage("profile"):
        prof = profile_graph(traced)
    found = _search_traced(traced, prof, cluster=cluster, options=options, progress=progress, start=start)
    return found.best.plan


def _plan_on_rank0(traced: TracedGraph, *, mesh: MeshSpec, options: PlanOptions, progress: Progress,
                   cache_of: tuple | None) -> Plan:
    """The cached plan when its key and graph hash match this trace, else a solve (stored)."""
    from autopar.planner import cache as plan_cache
    from autopar.tracer import profile as profile_graph

    key = None if cache_of is None else _cache_key(*cache_of, mesh=mesh, options=options, cache=True)
    if key is not None:
        hit = plan_cache.lookup(key, mesh=mesh, options=options, graph_hash=traced.graph_hash)
        if hit is not None:
            _note_hit(progress, hit[1])
            return hit[0]
    with progress.stage("profile"):
        prof = profile_graph(traced)
    plan = plan_traced(traced, prof, mesh=mesh, options=options, progress=progress).plan
    if key is not None:
        plan_cache.store(key, plan)
    return plan
