"""The public entry points: ``plan`` (offline, no process group) and ``autoparallelize`` (every rank).

Both take the planning options as keywords, the fields of :class:`PlanOptions` (declared once in
``autopar.planner.options``, applied to ``options`` -- default ``PlanOptions()`` -- with
``dataclasses.replace``). The planning itself lives in ``autopar.planner.orchestrate``
(``plan_model``, ``plan_traced``, ``plan_mesh_auto``, ``plan_pipelined``, re-exported here); what
``autoparallelize`` does on each rank in ``autopar.parallelize``; what the ranks must agree on in
``autopar.agreement``. Torch is imported inside the functions only, so ``import autopar`` stays cheap.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Sequence

from autopar.agreement import _agree, _all_gather, _raise_failures, _ranks, _status, world_cluster
from autopar.layout.mesh import MeshSpec, resolve_preset
from autopar.planner.orchestrate import (PipelinedResult, PlanResult, cache_key, cached_plan, plan_and_store,
                                         plan_auto, plan_auto_cached, plan_mesh_auto, plan_model, plan_pipelined,
                                         plan_traced, trace_for_planning)
from autopar.planner.options import OffloadPolicy, PlanOptions
from autopar.plans import Plan
from autopar.refine import RefineOptions
from autopar.stages import Progress

if TYPE_CHECKING:
    import os

    from torch import nn

    from autopar.runtime.module import AutoParallelModule
    from autopar.runtime.pipeline import PipelineModule

__all__ = ["plan", "plan_model", "plan_traced", "plan_pipelined", "plan_auto", "plan_mesh_auto", "autoparallelize",
           "PlanOptions", "PlanResult", "PipelinedResult", "Progress", "OffloadPolicy", "RefineOptions",
           "trace_for_planning", "world_cluster", "_ranks"]


def plan(model: Any, meta_inputs: tuple | dict, *, mesh: MeshSpec | Sequence[int] | str,
         options: PlanOptions | None = None, verbose: bool = False, progress: Progress | None = None,
         cache: bool = True, nodes: int | None = None, devices_per_node: int | None = None,
         device: str | None = None, **overrides: Any) -> Plan:
    """Plan ``model`` on ``mesh`` offline. ``mesh``: a MeshSpec, or a shape (``(2, 4)``/``"2x4"``)
    with the ``preset`` device preset's costs (default ``"cpu"``; ``device`` is its deprecated old
    name), or ``"auto"``: the fastest arrangement of ``nodes`` x ``devices_per_node`` devices
    as a 1-3 axis mesh (``plan_mesh_auto``; not cached).

    ``**overrides``: any :class:`PlanOptions` field, applied to ``options``: ``memory_budget``
    (bytes or ``"16GiB"``; None = the device capacity), ``solver``, ``time_limit``, ``preset`` (a
    name, or the path of a machine profile from ``autopar calibrate``, measured on ``mesh``'s shape),
    ``baselines`` (also solve data parallel, ZeRO-3, Megatron TP and DP x TP in the same cost
    model), ``optimizer_multiplier``, ``allow_replicate_fallback``, ``checkpoint`` (activation
    recompute planning: ``"auto"``, ``"ilp"``, ``"rotor"``, ``"both"``, ``"none"``; see
    ``autopar.planner.checkpointing``), ``precision``/``reduce_dtype`` (``"fp32"``, ``"bf16"``,
    ``"fp16"`` compute with fp32 master weights, priced as it runs; what gradients are summed in),
    ``zero_stage`` (1/2 shard optimizer state (and gradients) over each parameter's replicated
    axes; ``"auto"``: per parameter), ``pipeline`` (``"auto"``, the default: the plan without a
    pipeline and, where the model has repeated blocks and mesh axis 0 more than one device,
    pipelines over axis 0 whose step floor can beat it, the faster kept (``plan_auto``; under
    ``mesh="auto"`` none); N: pipeline parallelism over mesh axis 0 of size N, stages and sharding
    planned together (``plan_pipelined``); 1 or None: no pipeline) with ``microbatches`` and
    ``schedule`` (pipelined plans are not cached), ``offload`` (``"none"``, ``"auto"`` or an
    ``OffloadPolicy``: parameters / optimizer state on the mesh's host tier; ``Plan.offload``
    records where each one lives).

    ``cache``: serve the plan from the on-disk plan cache when this model, inputs, mesh and options
    were planned before (no trace, no solve), and store it otherwise; ``AUTOPAR_CACHE=0`` switches
    the cache off everywhere (``autopar.planner.cache``). ``plan_model`` returns the intermediate
    results too."""
    if device is not None or "preset" in overrides:
        overrides["preset"] = resolve_preset(overrides.get("preset"), device)
    options = (options or PlanOptions()).override(overrides, caller="plan")
    progress = progress or Progress(verbose)
    searched = isinstance(mesh, str) and mesh == "auto"
    if isinstance(options.pipeline, int):
        if searched:
            raise ValueError("pipeline= plans over the given mesh's first axis; mesh='auto' is not supported with it")
        return plan_pipelined(model, meta_inputs, mesh=mesh, options=options, progress=progress).plan
    if searched:  # the mesh search plans without pipelines (pipeline="auto" is a candidate on a given mesh)
        return plan_mesh_auto(model, meta_inputs, nodes=nodes, devices_per_node=devices_per_node, options=options,
                              progress=progress).best.plan
    if nodes is not None or devices_per_node is not None:
        raise ValueError(f"nodes= and devices_per_node= go with mesh='auto', got mesh={mesh!r}")
    spec = options.mesh(mesh)  # a bad mesh fails before anything else
    key = cache_key(model, meta_inputs, mesh=spec, options=options, cache=cache)
    if options.pipeline == "auto" and spec.shape[0] > 1:  # the default: pipelines over axis 0 are candidates
        return plan_auto_cached(model, meta_inputs, mesh=spec, options=options, progress=progress, key=key)
    hit = cached_plan(key, mesh=spec, options=options, progress=progress)
    if hit is not None:
        return hit
    return plan_and_store(model, meta_inputs, mesh=spec, options=options, progress=progress, key=key).plan


def autoparallelize(model: nn.Module, meta_inputs: tuple | dict, *, mesh: MeshSpec | Sequence[int] | str | None = None,
                    plan: Plan | str | os.PathLike | None = None, options: PlanOptions | None = None,
                    device: Any = None, seed: int = 0, init_weights: bool = True, local_inputs: bool = False,
                    cache: bool = True, nodes: int | None = None, devices_per_node: int | None = None,
                    verify: bool | tuple | dict = False, refine: bool | RefineOptions = False,
                    **overrides: Any) -> AutoParallelModule | PipelineModule:
    """Shard ``model`` over the current process group (call it on EVERY rank after
    ``torch.distributed.init_process_group``).

    ``mesh``: None = 1-D over the world size; a shape gets the ``cpu`` preset on CPU (an H100 or
    A100 preset on CUDA); or a ``MeshSpec``; or ``"auto"``: rank 0 plans every 1-3 axis mesh of
    the world's ``nodes`` x ``devices_per_node`` devices (``plan_mesh_auto``) and every rank
    builds on the fastest; either count may be left out when the other or the launcher's
    ``LOCAL_WORLD_SIZE`` (torchrun's devices per node) gives it, else one node of world-size
    devices. ``plan``: a ``Plan`` or a path to its JSON, applied without solving. ``device``: the
    torch device where the local shards live (default: see ``autopar.runtime.build.runtime_device``).
    ``seed``: initialisation seed for a model on ``meta`` (``init_weights=False``: zeros, to be
    filled with ``load_full_state_dict``). ``local_inputs``: ``forward`` receives each rank's
    piece of every input under the plan's input layouts instead of the full batch.

    ``**overrides``: the :class:`PlanOptions` fields as for ``plan`` (``preset``: default the
    device's; the path of a machine profile from ``autopar calibrate`` prices this machine as measured);
    None means not given. ``checkpoint``: a loaded plan's recompute regions are applied as they
    are. ``precision``/``reduce_dtype``: default fp32; a loaded plan brings its own
    (``ValueError`` when they disagree); fp16 wants loss scaling: ``autopar.GradScaler``.
    ``zero_stage``: 0 (default), 1, 2 or ``"auto"``; build the optimizer with
    ``model.optimizer(torch.optim.AdamW, lr=...)`` (``autopar.runtime.zero``). ``pipeline``: rank 0
    plans the stages (``plan_pipelined``), every rank traces the micro-batch graph and builds its
    stages (``autopar.runtime.pipeline.build_pipeline``): a ``PipelineModule``
    (``pm.step(**full_batch)`` runs forward and backward under the schedule) -- also when the
    default ``"auto"`` finds a pipeline faster (check ``module.plan.pipeline``, or pass
    ``pipeline=1`` for a module called as ``module(...)`` always); ``None`` here means no pipeline
    (not "not given"), as ``1``; with ``verify`` on, ``"auto"`` plans without one. ``offload``: a plan
    that offloads (planned or given) runs in the chunk runtime (``module.gemini``,
    ``autopar.runtime.gemini``). ``cache``: rank 0 serves the plan from the plan cache when its
    structural key and this trace's graph hash match an entry, and stores what it solves.
    ``verify``: after building, run one forward and backward under the plan and under the
    all-replicated plan and compare the loss and every gradient (``autopar.runtime.verify``;
    ``PlanVerificationError`` names the first diverging node); ``True`` checks on ``meta_inputs``
    when they hold values, else on inputs made up from their shapes
    (``autopar.runtime.verify.verify_inputs``); or pass the inputs to check on.
    ``refine``: ``True`` or an ``autopar.refine.RefineOptions``: the module times its first
    training steps with torch's profiler, refits the mesh's profile to them and re-plans once,
    adopting the new plan on every rank (training state carried over exactly) when it is predicted
    more than 5% faster (``autopar.refine``); build the optimizer with ``module.optimizer(...)``.

    Ranks agree or all fail: before anyone plans, the ranks compare (one ``all_gather_object``)
    their traced graph, input shapes, mesh, world size, versions, plan file and per-rank options,
    and an error on any rank up to then; after building, whether every rank built. Any
    difference or failure raises the same ``ValueError`` on every rank. Rank 0 plans (its
    ``memory_budget``, ``solver``, ``time_limit``, ``checkpoint`` and ``allow_replicate_fallback``
    count) and broadcasts the plan's JSON, or its error, which every rank raises.
    """
    import torch.distributed as dist

    from autopar.parallelize import Prepared, build_pipelined, prepare, solve_on_rank0
    from autopar.refine import attach_refiner
    from autopar.runtime.build import build_module, check_plan, runtime_device
    from autopar.runtime.gemini import attach_planned

    if not dist.is_initialized():
        raise ValueError("autoparallelize needs torch.distributed.init_process_group() first")
    dev = runtime_device(device)
    progress = Progress()
    refining = RefineOptions.coerce(refine)
    if refining is not None and (plan is not None or local_inputs):
        raise ValueError("refine=True re-plans the model: it needs the planning options, not a given plan=, and "
                         "full-batch inputs (local_inputs=False: a new plan may lay the inputs out differently)")
    try:
        prep: Prepared | Exception = prepare(
            model, meta_inputs, mesh=mesh, plan=plan, device=dev, progress=progress, options=options,
            overrides=overrides, cluster=(nodes, devices_per_node),
            per_rank={"seed": seed, "init_weights": init_weights, "local_inputs": local_inputs})
    except Exception as exc:  # noqa: BLE001 -- every rank learns of it in _agree
        prep = exc
    _agree(prep, device=dev)
    assert isinstance(prep, Prepared)  # _agree raised otherwise
    options = prep.options
    if (verify is not False or refining is not None) and options is not None and options.pipeline == "auto":
        # verify and refine run unpipelined plans only: no pipeline candidates
        options = replace(options, pipeline=None)
    chosen = prep.plan if prep.plan is not None else solve_on_rank0(
        prep.traced, mesh=prep.spec, options=options, progress=progress, device=dev,
        cache_of=(model, meta_inputs) if cache else None, auto=prep.auto, source=(model, meta_inputs))
    if refining is not None:
        from autopar.planner.refit import check_refinable

        check_refinable(chosen)  # the same plan on every rank: fails everywhere or nowhere
    if chosen.pipeline is not None:
        if verify is not False:
            raise NotImplementedError("verify=: pipelined plans are not verified yet; verify the plan without "
                                      "pipeline= or leave verify off")
        return build_pipelined(model, meta_inputs, chosen, spec=prep.spec, device=dev, seed=seed,
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
        from autopar.runtime.verify import verify_inputs, verify_module

        verify_module(built, verify_inputs(prep.traced, meta_inputs if verify is True else verify, seed=seed))
    if refining is not None:
        attach_refiner(built, refining, model=model, traced=prep.traced, options=prep.options, device=dev, seed=seed)
    return built
