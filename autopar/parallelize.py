"""What ``autoparallelize`` does on every rank, step by step: prepare, agree, plan on rank 0, build.

``prepare`` is everything a rank does alone before the ranks compare (check the arguments, load a
given plan, trace); ``agreement._agree`` compares the ranks; ``solve_on_rank0`` plans on rank 0
(through ``autopar.planner.orchestrate``) and broadcasts the plan or its error;
``build_pipelined`` builds a pipelined plan's stages on every rank. ``autopar.api.autoparallelize``
composes them.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from autopar.agreement import _all_gather, _check_plan_options, _fingerprint, _raise_failures, _status, world_cluster
from autopar.layout.mesh import MeshSpec
from autopar.offload import runtime_options
from autopar.planner.options import PlanOptions
from autopar.plans import Plan
from autopar.stages import Progress

if TYPE_CHECKING:
    from autopar.runtime.pipeline import PipelineModule
    from autopar.tracer.graph import TracedGraph

__all__ = ["Prepared", "prepare", "solve_on_rank0", "build_pipelined"]


@dataclass(frozen=True, slots=True)
class Prepared:
    """One rank's inputs to planning and building, and what it must share with every other rank."""

    traced: TracedGraph  # this rank's own trace
    spec: MeshSpec | None  # the mesh asked for (None: the plan's)
    options: PlanOptions | None  # rank 0 plans with these (None: a plan was given)
    plan: Plan | None  # the given plan
    fingerprint: tuple[tuple[str, str, str], ...]  # (what, compared key, shown) per check
    auto: tuple[int, int] | None = None  # mesh="auto": (nodes, devices per node) to search over


def prepare(model, meta_inputs, *, mesh, plan, device, progress: Progress, options: PlanOptions | None,
            overrides: dict, per_rank: dict, cluster: tuple[int | None, int | None] = (None, None)) -> Prepared:
    """Check the arguments, load the plan, trace. ``options``/``overrides``: the planning options
    as given (an override of None means "not given": the default, or a given plan's own).
    Raises on bad input (``autoparallelize`` hands the error to ``_agree``)."""
    import torch.distributed as dist

    from autopar.planner.orchestrate import trace_for_planning
    from autopar.runtime.build import mesh_preset

    world = dist.get_world_size()
    # The runtime device's preset, unless a preset (a machine profile: autopar calibrate) is given.
    preset = overrides.pop("preset", None) or mesh_preset(device)
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
    # None is "not given" but for pipeline, where it means none (as in PlanOptions; the default is "auto").
    given = {k: v for k, v in overrides.items() if v is not None or k == "pipeline"}
    given = runtime_options(given, plan_given=plan is not None)  # offload: checked, ZeRO 0 unless given
    # Checked whether or not a plan is given: a bad value fails the same way everywhere.
    checked = (options or PlanOptions()).override(given, caller="autoparallelize")
    asked = {k: given.get(k, None if options is None else getattr(options, k))
             for k in ("precision", "reduce_dtype", "zero_stage")}
    plan_options, source = None, "solved by rank 0"
    if plan is None:
        plan_options = replace(checked, preset=preset)
        if auto is None:
            spec = spec or MeshSpec.coerce((world,), preset=preset)
    else:
        source = "a Plan object" if isinstance(plan, Plan) else os.fspath(plan)
        plan = plan if isinstance(plan, Plan) else Plan.load(os.fspath(plan))
        _check_plan_options(plan, **asked)
    with progress.stage("trace"):
        # Per-rank batch statistics are one chunk per rank of this world, a given plan's too (its graph
        # hash, checked at build, refuses a plan made with other statistics).
        traced = trace_for_planning(model, meta_inputs,
                                    precision=plan.precision if plan_options is None else plan_options.precision,
                                    batch_norm_chunks=checked.batch_norm_chunks(world))
    fingerprint = _fingerprint(traced, meta_inputs, world=world, spec=spec, plan=plan, source=source,
                               device=device, options={**asked, **per_rank}, auto=auto)
    return Prepared(traced, spec, plan_options, plan, fingerprint, auto)


def solve_on_rank0(traced: TracedGraph, *, mesh: MeshSpec | None, options: PlanOptions, progress: Progress,
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
            payload[0] = ("ok", _plan_on_rank0(traced, mesh=mesh, options=options, progress=progress,
                                               cache_of=cache_of, auto=auto, source=source).to_json())
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


def _plan_on_rank0(traced: TracedGraph, *, mesh: MeshSpec | None, options: PlanOptions, progress: Progress,
                   cache_of: tuple | None, auto: tuple[int, int] | None, source: tuple | None) -> Plan:
    """A pipelined plan (traced per micro-batch count: needs the model), the fastest mesh's plan
    (``auto``) or the plan on ``mesh`` (pipelines over its axis 0 candidates under
    ``pipeline="auto"``: ``plan_auto``), cached under ``cache_of``'s key."""
    from autopar.planner import orchestrate
    from autopar.tracer import profile as profile_graph

    if isinstance(options.pipeline, int):
        if auto is not None or source is None:
            raise ValueError("pipeline= needs a given mesh (not mesh='auto') whose first axis is the pipeline")
        return orchestrate.plan_pipelined(*source, mesh=mesh, options=options, progress=progress).plan
    if auto is not None:  # the mesh search plans without pipelines
        start = time.perf_counter()
        with progress.stage("profile"):
            prof = profile_graph(traced)
        return orchestrate.search_traced(traced, prof, cluster=auto, options=options, progress=progress,
                                         start=start).best.plan
    key = None if cache_of is None else orchestrate.cache_key(*cache_of, mesh=mesh, options=options, cache=True)
    if options.pipeline == "auto" and mesh.shape[0] > 1 and source is not None:  # the default: pipelines are candidates
        return orchestrate.plan_auto_cached(*source, mesh=mesh, options=options, progress=progress, key=key,
                                            traced=traced)
    return orchestrate.plan_traced_cached(traced, mesh=mesh, options=options, progress=progress, key=key)


def build_pipelined(model, meta_inputs, plan: Plan, *, spec: MeshSpec | None, device, seed: int, init_weights: bool,
                    local_inputs: bool) -> PipelineModule:
    """Every rank traces the plan's MICRO-batch graph and builds its stages (``build_pipeline``);
    a failure on any rank fails every rank."""
    import torch.distributed as dist

    from autopar.planner.orchestrate import trace_for_planning
    from autopar.runtime.pipeline import build_pipeline

    try:
        if local_inputs:
            raise ValueError("local_inputs=True does not apply to a pipelined plan (its step takes the full batch)")
        world = dist.get_world_size()
        if plan.mesh.num_devices != world or (spec is not None and tuple(spec.shape) != plan.mesh.shape):
            raise ValueError(f"the pipelined plan is for mesh {plan.mesh.shape}; this launch has "
                             f"{world} ranks" + (f" and mesh {spec.shape}" if spec is not None else ""))
        micro = trace_for_planning(model, meta_inputs, precision=plan.precision,
                                   microbatches=plan.pipeline.num_microbatches)
        built: Any = build_pipeline(model, micro, plan, device=device, seed=seed, init_weights=init_weights)
    except Exception as exc:  # noqa: BLE001 -- every rank learns of it below
        built = exc
    _raise_failures(_all_gather(_status(built), device=device), built, when="while building the pipeline")
    return built
