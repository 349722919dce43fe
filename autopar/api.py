"""The public entry points: ``plan`` (offline, no process group) and ``autoparallelize`` (every rank).

``plan(model, meta_inputs, *, mesh, ...)`` traces the model on fake tensors, profiles it,
enumerates sharding strategies per node, builds the plain-data problem, solves the ILP under the
per-device memory budget and returns a :class:`~autopar.plans.Plan`. With ``baselines=True`` it
also solves data parallel, ZeRO-3, Megatron TP and DP x TP in the same cost model.
``plan_model`` and ``plan_traced`` (from an existing trace and profile: one trace serves many
meshes and budgets) take a :class:`PlanOptions` and return a :class:`PlanResult`: the plan and
the intermediate traced graph, profile, built problem and recompute plan (for reports).

``autoparallelize`` is called on EVERY rank after ``torch.distributed.init_process_group``. How
ranks agree on the plan: rank 0 solves and broadcasts the plan's JSON (``broadcast_object_list``);
a solver failure on rank 0 is broadcast too, so every rank raises the same error instead of
hanging. Every rank traces the model itself (tracing is deterministic; the plan's graph hash is
checked against each rank's own trace), and ``autopar.runtime.build.build_module`` emits the
module from the plan.

Torch is imported inside the functions only, so ``import autopar`` stays cheap.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from autopar.layout.mesh import MeshSpec, resolve_preset
from autopar.planner.options import PlanOptions, precision_name
from autopar.plans import BaselineResult, Plan

if TYPE_CHECKING:
    import torch
    from torch import nn

    from autopar.planner.checkpointing import RecomputePlan
    from autopar.planner.records import BuiltProblem
    from autopar.runtime.module import AutoParallelModule
    from autopar.tracer.graph import TracedGraph
    from autopar.tracer.profile import ModelProfile

__all__ = ["plan", "plan_model", "plan_traced", "autoparallelize", "PlanOptions", "PlanResult", "Progress"]


class Progress:
    """Stage lines with elapsed time (``verbose``), or silence; the seconds per stage either way.
    ``sink`` receives each line: ``"<prefix> <stage> ..."`` when a stage starts, ``"<prefix>
    <stage> done in <s>s"`` when it ends (the CLI's ``StageSink`` redraws the former in place)."""

    def __init__(self, verbose: bool = False, sink: Callable[[str], None] | None = None) -> None:
        self.verbose = verbose
        self.sink = sink or (lambda line: print(line, file=sys.stderr, flush=True))
        self.timings: dict[str, float] = {}
        self._start = time.perf_counter()

    @contextmanager
    def stage(self, name: str, detail: str = ""):
        if self.verbose:
            self.sink(f"[autopar {time.perf_counter() - self._start:6.1f}s] {name}{' ' + detail if detail else ''} ...")
        t0 = time.perf_counter()
        yield
        self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - t0
        if self.verbose:
            self.sink(f"[autopar {time.perf_counter() - self._start:6.1f}s] {name} done in {self.timings[name]:.2f}s")


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
) -> Plan:
    """Plan ``model`` on ``mesh`` offline. ``mesh``: a MeshSpec, or a shape (``(2, 4)``/``"2x4"``)
    with the ``preset`` device preset's costs (default ``"cpu"``; ``device`` is its deprecated old
    name). ``memory_budget``: bytes or ``"16GiB"``; None = the device capacity from the MeshSpec.
    ``checkpoint``: activation recompute planning, ``"auto"`` (the faster of the joint ILP +
    Rotor refinement and Rotor alone; nothing when the budget cannot bind), ``"ilp"``,
    ``"rotor"``, ``"both"`` or ``"none"`` (see ``autopar.planner.checkpointing``). ``precision``:
    ``"fp32"``, ``"bf16"`` or ``"fp16"`` compute with fp32 master weights, priced as it runs
    (``autopar.tracer.precision``); ``reduce_dtype``: what gradients are summed in. ``zero_stage``:
    1/2 shard optimizer state (and gradients) over each parameter's replicated axes. The other
    options: see :class:`PlanOptions`. ``plan_model`` returns the intermediate results too."""
    options = PlanOptions(memory_budget=memory_budget, solver=solver, time_limit=time_limit,
                          preset=resolve_preset(preset, device), baselines=baselines,
                          optimizer_multiplier=optimizer_multiplier,
                          allow_replicate_fallback=allow_replicate_fallback, checkpoint=checkpoint,
                          precision=precision, reduce_dtype=reduce_dtype, zero_stage=zero_stage)
    return plan_model(model, meta_inputs, mesh=mesh, options=options, progress=progress or Progress(verbose)).plan


def plan_model(model: Any, meta_inputs: tuple | dict, *, mesh: MeshSpec | Sequence[int] | str,
               options: PlanOptions = PlanOptions(), progress: Progress | None = None) -> PlanResult:
    """Trace and profile ``model``, then ``plan_traced``."""
    from autopar.strategies import needs_decomposition
    from autopar.tracer import profile as profile_graph
    from autopar.tracer import trace

    mesh = options.mesh(mesh)  # a bad mesh fails before the trace
    progress = progress or Progress()
    with progress.stage("trace"):
        traced = trace(model, meta_inputs, decompose_if=needs_decomposition, precision=options.precision)
    with progress.stage("profile"):
        prof = profile_graph(traced)
    return plan_traced(traced, prof, mesh=mesh, options=options, progress=progress)


def plan_traced(traced: TracedGraph, profile: ModelProfile, *, mesh: MeshSpec | Sequence[int] | str,
                options: PlanOptions = PlanOptions(), progress: Progress | None = None) -> PlanResult:
    """The plan of an existing trace and profile (one trace serves many meshes and budgets)."""
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
                              options=options)
    rc = plan_recompute(traced, profile, built, mode=options.checkpoint, solver=options.solver,
                        time_limit=options.time_limit,
                        solve_plain=lambda p: _solve(p, options=options, progress=progress, stage="solve"))
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
    return PlanResult(assembled, traced, profile, built, rc)


def _solve(problem, *, options: PlanOptions, progress: Progress, stage: str):
    from autopar.solver.pipeline import solve

    with progress.stage(stage, f"{problem.num_nodes} decisions, {problem.num_edges} edges"):
        return solve(problem, solver=options.solver, time_limit=options.time_limit)


def _baseline(name: str, traced, built, *, options: PlanOptions, progress: Progress) -> BaselineResult:
    from autopar.planner.assemble import baseline_problem, estimate_of
    from autopar.planner.checkpointing import estimate

    try:
        with progress.stage(f"baseline {name}"):
            problem = baseline_problem(name, traced, built)
        solution = _solve(problem, options=options, progress=progress, stage=f"baseline {name} solve")
    except ValueError as exc:  # the family cannot fit the budget (or has no legal layout)
        return BaselineResult(name, False, None, str(exc).splitlines()[0])
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
) -> AutoParallelModule:
    """Shard ``model`` over the current process group; see the module docstring.

    ``mesh``: None = 1-D over the world size; a shape gets the ``cpu`` preset on CPU (an H100 or
    A100 preset on CUDA); or a ``MeshSpec``. ``plan``: a ``Plan`` or a path to its JSON, applied
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
    ``model.optimizer(torch.optim.AdamW, lr=...)`` (``autopar.runtime.zero``).
    """
    import torch.distributed as dist

    from autopar.runtime.build import build_module, check_plan, mesh_preset, runtime_device
    from autopar.strategies import needs_decomposition
    from autopar.tracer import trace

    if not dist.is_initialized():
        raise ValueError("autoparallelize needs torch.distributed.init_process_group() first")
    world = dist.get_world_size()
    dev = runtime_device(device)
    preset = mesh_preset(dev)
    spec = None if mesh is None else MeshSpec.coerce(mesh, preset=preset)
    if spec is not None and spec.num_devices != world:
        raise ValueError(f"mesh {spec.shape} has {spec.num_devices} devices but the process group has {world} ranks")
    if plan is None:
        # Every rank checks the options (the same error everywhere, before any collective).
        options = PlanOptions(memory_budget=memory_budget, solver=solver, preset=preset,
                              allow_replicate_fallback=allow_replicate_fallback, checkpoint=checkpoint,
                              precision=precision or "fp32", reduce_dtype=reduce_dtype or "fp32",
                              zero_stage=0 if zero_stage is None else zero_stage,
                              **({} if time_limit is None else {"time_limit": time_limit}))
        spec = spec or MeshSpec.coerce((world,), preset=preset)
        plan, traced = _solve_on_rank0(model, meta_inputs, mesh=spec, options=options)
    else:
        plan = plan if isinstance(plan, Plan) else Plan.load(os.fspath(plan))
        for what, asked, planned in (("precision", precision, plan.precision),
                                     ("reduce_dtype", reduce_dtype, plan.reduce_dtype)):
            if asked is not None and precision_name(asked, what=what) != planned:
                raise ValueError(f"{what}={asked!r} but the plan was made for {planned}; "
                                 f"plan again or leave {what} out")
        planned_zero = max((n.zero_stage for n in plan.nodes), default=0)
        if zero_stage not in (None, "auto") and zero_stage != planned_zero:
            raise ValueError(f"zero_stage={zero_stage!r} but the plan was made with ZeRO stage {planned_zero}; "
                             f"plan again or leave zero_stage out")
        traced = None
    traced = traced or trace(model, meta_inputs, decompose_if=needs_decomposition, precision=plan.precision)
    check_plan(plan, graph_hash=traced.graph_hash, world_size=world, mesh=spec)
    return build_module(model, traced, plan, device=dev, seed=seed, init_weights=init_weights,
                        local_inputs=local_inputs)


def _solve_on_rank0(model, meta_inputs, *, mesh: MeshSpec, options: PlanOptions):
    """Rank 0 solves; every rank gets the plan (or rank 0's error) by broadcast. Also returns
    rank 0's trace (None elsewhere)."""
    import torch.distributed as dist

    traced, error = None, None
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            result = plan_model(model, meta_inputs, mesh=mesh, options=options)
            payload[0] = ("ok", result.plan.to_json())
            traced = result.traced
        except Exception as exc:  # noqa: BLE001 -- re-raised on every rank below
            payload[0], error = ("error", f"{type(exc).__name__}: {exc}"), exc
    dist.broadcast_object_list(payload, src=0)
    status, text = payload[0]
    if error is not None:
        raise error
    if status != "ok":
        raise ValueError(f"planning failed on rank 0: {text}")
    return Plan.from_json(text), traced
