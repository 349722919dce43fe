"""``AutoParallelPlugin``: how the :class:`~autopar.booster.Booster` parallelises, in one checked record.

The plugin carries the ``autoparallelize`` options (mesh, memory budget, precision, activation
checkpointing, solver), the optimizer-side options (``max_norm`` gradient clipping, the fp16
loss-scaler settings, ``zero_stage``) and makes the data loader (``prepare_dataloader``). Every
argument is checked when the plugin is made, on every rank alike, so a bad value fails before
any collective.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from autopar.layout.mesh import MeshSpec, is_profile_path, parse_mesh_shape
from autopar.planner.options import ZERO_STAGES, check_choice, check_count, check_number, check_option

if TYPE_CHECKING:
    from torch.utils.data import DataLoader, Dataset

__all__ = ["AutoParallelPlugin", "ZERO_STAGES", "PP_STYLES", "PLANNING_NAMES", "plan_on_rank0"]

# The product notes' pipeline styles -> autopar's schedules (``autopar.plans.PIPELINE_SCHEDULES``).
PP_STYLES = {"auto": "auto", "gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved-1f1b",
             "interleaved-1f1b": "interleaved-1f1b", "zbv": "zero-bubble", "zero-bubble": "zero-bubble"}


# The plugin's planning fields -> the ``PlanOptions`` field each one is (``autopar.planner.options``),
# checked there under the plugin's name; None (where the plugin allows it) means the planner's default.
PLANNING_NAMES = {"memory_budget": "memory_budget", "precision": "precision", "zero_stage": "zero_stage",
                  "checkpoint": "checkpoint", "reduce_dtype": "reduce_dtype", "solver": "solver",
                  "time_limit": "time_limit", "allow_replicate_fallback": "allow_replicate_fallback",
                  "optimizer_multiplier": "optimizer_multiplier", "pp_size": "pipeline",
                  "num_microbatches": "microbatches", "pp_style": "schedule", "offload": "offload",
                  "sequence_parallel": "sequence_parallel", "sp_size": "sp_size", "ep_size": "ep_size",
                  "batch_norm_stats": "batch_norm_stats"}
_NONE_IS_DEFAULT = ("memory_budget", "reduce_dtype", "time_limit", "pp_size", "num_microbatches", "ep_size",
                    "sp_size")


@dataclass(frozen=True, slots=True, kw_only=True)
class AutoParallelPlugin:
    """The Booster's parallel training options.

    Args:
        mesh: ``None`` (a 1-D mesh over the world size), a shape (``(2, 2)`` or ``"2x2"``; the
            device's cost preset), a ``MeshSpec``, or the path of a machine profile from
            ``autopar calibrate`` (its mesh, priced as measured). Its size must be the world size.
            Or a list of them, e.g. ``["4.json", "2x2.json"]`` (the profiles of every shape the
            world allows): rank 0 plans on each, pipelines over axis 0 included where ``pp_size``
            asks, and every rank trains the plan estimated fastest
            (``autopar.planner.orchestrate.plan_candidates``; ``module.plan.solver["meshes"]``
            lists each candidate's estimate). Not with ``plan`` or ``refine``.
        memory_budget: bytes per device (an int or ``"16GiB"``); ``None`` = the device capacity.
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` compute with fp32 master weights and
            optimizer state. ``"fp16"`` makes the boosted optimizer own an ``autopar.GradScaler``
            (``booster.backward`` scales the loss, ``step()`` unscales before clipping and skips
            the step on every rank when any rank's gradients overflowed).
        zero_stage: ``"auto"``, 0, 1 or 2. ZeRO-1/2 shard the optimizer state (and the
            gradients) of each parameter over the mesh axes its layout replicates it on
            (``autopar.runtime.zero``; ZeRO-3 is one of the plan's layouts). ``"auto"``: the
            planner picks the stage per parameter, pricing memory and communication with the
            layouts (stage 0 wherever the budget does not need more); with a pipeline, 0 in
            its stages (they run no ZeRO; under ``pp_size="auto"`` the plan without a pipeline
            keeps the solver's choice).
        max_norm: clip gradients to this global L2 norm in ``optimizer.step()``; 0 = no clipping.
        checkpoint: activation recompute planning (``autopar.plan``'s ``checkpoint``).
        reduce_dtype: what gradients are summed in (``None`` = fp32).
        solver, time_limit: the ILP backend and its seconds per solve (``None``: the default).
        optimizer_multiplier: optimizer state bytes per parameter byte the planner prices (2: AdamW).
        seed: initialisation seed for a model on ``meta``.
        allow_replicate_fallback: replicate ops without a sharding rule instead of failing.
        plan: a ``Plan`` (or the path of its JSON, e.g. from ``autopar plan``) to apply instead
            of solving; ``memory_budget``, ``checkpoint`` and ``solver`` then do not matter.
        device: the torch device of the local shards (``None``: CPU under gloo,
            ``cuda:LOCAL_RANK`` under NCCL).
        initial_scale, growth_factor, backoff_factor, growth_interval: the fp16 loss scaler's
            settings (``torch.amp.GradScaler``'s ``init_scale`` and the rest); ignored otherwise.
        min_scale, max_scale, hysteresis: the scaler's bounds and Colossal-AI's hysteresis
            (``autopar.runtime.amp.GradScaler``); ``None``, ``None``, 1: torch's rule.
        norm_type: the norm ``max_norm`` clips by (2.0: L2; ``inf``: the max norm).
        pp_size: pipeline parallelism over mesh axis 0: ``None`` or 1 (none), N (that axis's
            size) or ``"auto"`` (the planner compares none with one over axis 0); the stage cuts
            and each stage's sharding are planned together (``autopar.plan``'s ``pipeline``).
            ``None`` is the default here, not ``autopar.plan``'s ``"auto"``: a pipelined module
            trains through ``Booster.execute_pipeline`` (the schedule runs forward and backward
            together), not the notes' ``model(...)`` / ``booster.backward`` loop, so a plugin
            that picked a pipeline on its own would break that loop; ``"auto"`` opts in.
        num_microbatches: micro-batches per step with a pipeline (``None``: the planner picks).
        pp_style: ``"auto"`` (the fastest), ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` or
            ``"zbv"`` (zero-bubble; the long names ``"interleaved-1f1b"``/``"zero-bubble"`` too).
        num_model_chunks: model chunks (virtual stages) per pipeline rank: 1 for gpipe/1f1b, 2
            for the interleaved styles (what the planner plans them with); ``None``: as the style.
        placement_policy: ``None`` (no chunk runtime), Gemini's ``"static"`` / ``"auto"``, or
            ``"planned"`` (the tiers the planner chose: ``Plan.offload`` of ``plan``, or of the
            plan solved with ``offload``, executed as it is; the policy when either offloads).
            With any of them the boosted module's parameters go into chunks placed on the device
            or the host tier (``autopar.runtime.gemini``), and the optimizer (Adam/AdamW) steps
            host chunks on the host. Activation recompute is planned as without them (recomputed
            regions re-fetch their chunks); the plan's ZeRO-1/2 stages run in the chunks
            (optimizer state, and under ZeRO-2 the gradient, sharded over the data-parallel axes;
            ZeRO-Offload when the state is on the host). ``zero_stage="auto"`` is the solver's
            choice with ``"planned"`` and stage 0 with ``"static"`` / ``"auto"`` (which manage
            memory by their own rule; 1 or 2 there are the stage for every parameter). ``"auto"``
            places chunks after a warm-up step, within ``memory_budget`` (required unless the
            device is CUDA, whose total memory is then the budget); ``"static"`` bounds the
            device tier by ``memory_budget`` when given.
        offload: ``"none"``, ``"auto"`` or an ``OffloadPolicy`` (``autopar.offload``): the planner
            decides what lives on the host tier, within ``memory_budget`` (``autopar.plan``'s ``offload``).
        shard_param_frac, offload_optim_frac, offload_param_frac, pin_memory: Gemini's static
            knobs, same meanings: the offload record ``autopar.offload.StaticOffload`` and the chunk
            runtime's ``StaticPolicy`` built from it (``autopar.runtime.gemini.policies``). ``shard_param_frac``
            (``"static"`` only): the leading fraction of chunks sharded ZeRO-3 style over the mesh
            axes the plan replicates their parameters on; their gradients are chunk shards, not
            ``.grad``: the fp16 scaler unscales and checks them and ``max_norm`` clipping counts
            them (the chunk optimizer's ``sharded_grads``; their squared norms all-reduced).
        ep_size: expert parallelism pinned to this degree (``autopar.planner.pins``): each MoE
            experts op splits its experts over mesh axes of this total size, tokens dispatched by
            all-to-all; 1: experts never split; ``None``: the planner decides.
        chunk_search_range: ``(min, max, step)`` elements the chunk size is searched over for
            the least padding (``None``: 1024 to 64 Mi elements in steps of 1024); static and
            auto policies (planned tiers chunk as the plan streams: ``ChunkManager``).
        sequence_parallel: ``"auto"`` (the solver's choice), ``"off"`` (no attention split on the
            sequence), ``"ring"``, ``"all_to_all"`` or ``"split_gather"``: pinned over ``sp_size``
            devices (``autopar.plan``'s ``sequence_parallel``, ``autopar.planner.pins``; what
            ``HybridParallelPlugin``'s ``enable_sequence_parallelism`` modes plan).
        sp_size: the devices a pinned ``sequence_parallel`` splits over (the innermost mesh axes
            multiplying to it; ``None``: the last axis of size > 1).
        batch_norm_stats: ``"global"`` (a training batch norm normalises with the whole batch's
            statistics on every plan) or ``"per_rank"`` (torch DDP's: each of world-size equal
            contiguous chunks of the batch by its own statistics, no collective for them; the same
            on every plan: ``autopar.tracer.batch_stats``).
        refine: ``False``, ``True`` or an ``autopar.refine.RefineOptions``: the boosted module times
            its first training steps, refits the profile and re-plans once, rebuilding itself and
            the boosted optimizer in place when the new plan is predicted faster
            (``autoparallelize``'s ``refine``); the loader then gives whole global batches.
    """

    mesh: MeshSpec | Sequence[int] | str | None = None
    memory_budget: int | float | str | None = None
    precision: str = "fp32"
    zero_stage: int | str = "auto"
    max_norm: float = 0.0
    checkpoint: str = "auto"
    reduce_dtype: str | None = None
    solver: str = "auto"
    time_limit: float | None = None
    optimizer_multiplier: float = 2.0
    seed: int = 0
    allow_replicate_fallback: bool = False
    plan: Any = None
    device: Any = None
    initial_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    min_scale: float | None = None
    max_scale: float | None = None
    hysteresis: int = 1
    norm_type: float = 2.0
    pp_size: int | str | None = None
    num_microbatches: int | None = None
    pp_style: str = "auto"
    num_model_chunks: int | None = None
    placement_policy: str | None = None
    shard_param_frac: float = 0.0
    offload_optim_frac: float = 0.0
    offload_param_frac: float = 0.0
    pin_memory: bool = False
    chunk_search_range: tuple[int, int, int] | None = None
    offload: Any = "none"
    sequence_parallel: str = "auto"
    sp_size: int | None = None
    ep_size: int | None = None
    batch_norm_stats: str = "global"
    refine: Any = False

    def __post_init__(self) -> None:
        if _is_candidate_list(self.mesh):
            object.__setattr__(self, "mesh", tuple(_one_mesh(m) for m in self.mesh))
            self._check_candidates()
        elif self.mesh is not None:
            object.__setattr__(self, "mesh", _one_mesh(self.mesh))
        for name, option in PLANNING_NAMES.items():  # the planner's own checks, under the plugin's names
            value = getattr(self, name)
            if option == "schedule" or (value is None and name in _NONE_IS_DEFAULT):
                continue  # pp_style is the plugin's vocabulary (PP_STYLES), checked with the pipeline knobs
            object.__setattr__(self, name, check_option(option, value, name=name))
        check_number(self.max_norm, name="max_norm", low=0, what="a finite number >= 0 (0 = no clipping)")
        from autopar.api import RefineOptions

        object.__setattr__(self, "refine", RefineOptions.coerce(self.refine) or False)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.plan is not None:
            from autopar.plans import Plan

            if not isinstance(self.plan, (Plan, str, os.PathLike)):
                raise ValueError(f"plan must be None, a Plan or the path of a plan's JSON, got {self.plan!r}")
            if not isinstance(self.plan, Plan) and not os.path.isfile(self.plan):
                raise ValueError(f"plan file {os.fspath(self.plan)!r} does not exist")
        if self.device is not None:
            import torch

            try:
                torch.device(self.device)
            except (RuntimeError, TypeError):
                raise ValueError(f"device must be None or a torch device such as 'cpu' or 'cuda:0', "
                                 f"got {self.device!r}") from None
        check_number(self.initial_scale, name="initial_scale", low=0, low_open=True, what="> 0")
        check_number(self.growth_factor, name="growth_factor", low=1, low_open=True, what="> 1")
        check_number(self.backoff_factor, name="backoff_factor", low=0, high=1, low_open=True, high_open=True,
                     what="in (0, 1)")
        check_count(self.growth_interval, name="growth_interval")
        self._check_scaler_bounds()
        self._check_pipeline()
        self._check_gemini()

    @property
    def candidates(self) -> tuple | None:
        """The candidate meshes of a ``mesh`` list (MeshSpecs and shapes), or None."""
        return self.mesh if isinstance(self.mesh, tuple) and self.mesh and not isinstance(self.mesh[0], int) else None

    def _check_candidates(self) -> None:
        meshes = self.candidates
        if not meshes:
            raise ValueError("mesh=[]: give at least one candidate mesh (a shape, a MeshSpec or a profile JSON)")
        sizes = {(m.num_devices if isinstance(m, MeshSpec) else _product(m)) for m in meshes}
        if len(sizes) > 1:
            raise ValueError(f"mesh={list(self.mesh)!r}: the candidate meshes have different device counts "
                             f"{sorted(sizes)}; each must be the world size")
        if self.plan is not None:
            raise ValueError("mesh= with several candidate meshes plans; plan= brings its own mesh: give one of them")
        if self.refine:
            raise ValueError("refine=True re-plans on the chosen plan's mesh only; with several candidate meshes give "
                             "mesh= one of them (or leave refine off)")

    def _check_scaler_bounds(self) -> None:
        for name in ("min_scale", "max_scale"):
            if getattr(self, name) is not None:
                check_number(getattr(self, name), name=name, low=0, low_open=True, what="None or > 0")
        if self.min_scale is not None and self.max_scale is not None and self.min_scale > self.max_scale:
            raise ValueError(f"min_scale={self.min_scale!r} must not exceed max_scale={self.max_scale!r}")
        check_count(self.hysteresis, name="hysteresis")
        if self.norm_type != float("inf"):
            check_number(self.norm_type, name="norm_type", low=0, low_open=True, what="> 0 (inf: the max norm)")

    def _check_gemini(self) -> None:
        from autopar.offload import check_offload

        # The knobs are checked even without a policy: a typo must not pass silently.
        self._static_policy()
        if self.chunk_search_range is not None:
            rng = tuple(self.chunk_search_range) if isinstance(self.chunk_search_range, (tuple, list)) else ()
            if len(rng) != 3:
                raise ValueError(f"chunk_search_range must be (min, max, step) elements, got "
                                 f"{self.chunk_search_range!r}")
            object.__setattr__(self, "chunk_search_range", rng)
            self.gemini_chunk_range()  # the runtime's ChunkRange checks the three numbers
        check_offload(self.offload, plan_given=self.plan is not None)  # as autoparallelize checks it
        plans_offload = self._plans_offload()
        if plans_offload:
            if self.placement_policy not in (None, "planned"):
                raise ValueError(f"placement_policy={self.placement_policy!r} places chunks by its own rule; the "
                                 f"plan's offload decisions (offload={self.offload!r} or plan.offload) are executed "
                                 f"by placement_policy='planned' (or None)")
            object.__setattr__(self, "placement_policy", "planned")
        if self.placement_policy is None:
            if self.offload_optim_frac or self.offload_param_frac or self.chunk_search_range is not None:
                raise ValueError("offload_optim_frac, offload_param_frac and chunk_search_range go with "
                                 "placement_policy='static' or 'auto'")
            if self.shard_param_frac:
                raise ValueError(f"shard_param_frac={self.shard_param_frac!r} goes with placement_policy='static'")
            return
        if self.shard_param_frac and self.placement_policy != "static":
            raise ValueError(f"shard_param_frac={self.shard_param_frac!r} goes with placement_policy='static', "
                             f"got placement_policy={self.placement_policy!r}")
        if self.placement_policy not in ("static", "auto", "planned"):
            raise ValueError(f"placement_policy must be None, 'static', 'auto' or 'planned', "
                             f"got {self.placement_policy!r}")
        if self.placement_policy == "planned" and not plans_offload:
            raise ValueError("placement_policy='planned' executes a plan's offload decisions: give plan= (a Plan "
                             "made by autopar.plan(..., offload=...) that offloads) or offload='auto'")
        if self.placement_policy == "planned" and (self.chunk_search_range is not None or self.offload_optim_frac
                                                   or self.offload_param_frac):
            raise ValueError("placement_policy='planned' takes the plan's tiers and chunking: chunk_search_range, "
                             "offload_optim_frac and offload_param_frac go with 'static' or 'auto'")
        if self.pipeline is not None:
            raise ValueError(f"placement_policy={self.placement_policy!r} does not run under a pipeline "
                             f"(pp_size={self.pp_size!r})")

    def _plans_offload(self) -> bool:
        """Does the run execute planned offload decisions (``offload``, or a given plan that offloads)?"""
        if self.offload != "none":
            return True
        if self.plan is None:
            return False
        from autopar.plans import Plan

        plan = self.plan if isinstance(self.plan, Plan) else Plan.load(os.fspath(self.plan))
        return any(tuple(t) != ("device", "device") for t in plan.offload.values())

    def gemini_policy(self, device, plan=None):
        """The chunk runtime's policy for ``device`` (``None`` without ``placement_policy``);
        ``plan``: the boosted module's, for ``"planned"``."""
        import torch

        from autopar.runtime.gemini.policies import AutoPolicy, policy_from_plan

        if self.placement_policy is None:
            return None
        budget = self.memory_budget
        if self.placement_policy == "planned":
            if plan is None or not getattr(plan, "offload", None):
                raise ValueError("placement_policy='planned': the plan has no offload decisions (make it with "
                                 "autopar.plan(..., offload='auto' or OffloadPolicy(...)))")
            return policy_from_plan(plan, pin_memory=self.pin_memory)
        if self.placement_policy == "auto":
            if budget is None:
                if torch.device(device).type != "cuda":
                    raise ValueError("placement_policy='auto' needs memory_budget off CUDA (no device "
                                     "capacity to read)")
                budget = torch.cuda.get_device_properties(torch.device(device)).total_memory
            return AutoPolicy(device_budget=int(budget), pin_memory=self.pin_memory)
        return self._static_policy(device_budget=None if budget is None else int(budget))

    def _static_policy(self, device_budget: int | None = None):
        """``placement_policy="static"``: Gemini's knobs as the chunk runtime's ``StaticPolicy``, the
        offload record (``autopar.offload.StaticOffload``) with the runtime's knobs, checked there."""
        from autopar.runtime.gemini.policies import StaticPolicy

        return StaticPolicy(shard_param_frac=self.shard_param_frac, offload_optim_frac=self.offload_optim_frac,
                            offload_param_frac=self.offload_param_frac, pin_memory=self.pin_memory,
                            device_budget=device_budget)

    def wrap_gemini(self, module, optimizer_class: type, groups: list, kwargs: dict):
        """``module``'s parameters into chunks (``autopar.runtime.gemini.wrap``) and the chunk
        optimizer over ``groups`` (the booster's rebuilt param groups)."""
        from autopar.runtime.gemini import wrap

        if getattr(module, "gemini", None) is not None:  # autoparallelize placed the plan's tiers already
            return module.gemini.optimizer(optimizer_class, kwargs, param_groups=groups)
        if self.placement_policy == "planned":
            raise ValueError("placement_policy='planned': the boosted plan offloads nothing (Plan.offload keeps "
                             "every parameter on the device)")
        device = next(iter(module.parameters())).device
        _, optimizer = wrap(module, optimizer_class, kwargs, policy=self.gemini_policy(device, module.plan),
                            chunk_range=self.gemini_chunk_range(), param_groups=groups)
        return optimizer

    def gemini_chunk_range(self):
        from autopar.runtime.gemini.manager import ChunkRange

        if self.chunk_search_range is None:
            return ChunkRange()
        low, high, step = self.chunk_search_range
        return ChunkRange(min_elems=low, max_elems=high, step=step)

    def _check_pipeline(self) -> None:
        check_choice(self.pp_style, tuple(PP_STYLES), name="pp_style")
        if self.num_model_chunks is not None:
            from autopar.planner.pipeline.schedule import SCHEDULE_VIRTUAL_STAGES

            schedule = PP_STYLES[self.pp_style]
            if schedule == "auto":
                raise ValueError(f"num_model_chunks={self.num_model_chunks!r} goes with a pp_style (gpipe/1f1b: 1 "
                                 f"chunk per rank, interleaved/zbv: 2); pp_style='auto' picks both together")
            chunks = SCHEDULE_VIRTUAL_STAGES[schedule]
            if self.num_model_chunks != chunks:
                raise ValueError(f"num_model_chunks={self.num_model_chunks!r} with pp_style={self.pp_style!r}: "
                                 f"autopar plans this style with {chunks} model chunk(s) per rank")
        if self.pipeline is None and (self.num_microbatches is not None or self.pp_style != "auto"
                                      or self.num_model_chunks is not None):
            raise ValueError(f"num_microbatches, pp_style and num_model_chunks go with a pipeline (pp_size > 1 or "
                             f"'auto'), got pp_size={self.pp_size!r}")

    @property
    def pipeline(self) -> int | str | None:
        """``autopar.plan``'s ``pipeline`` for ``pp_size`` (1 means none)."""
        return None if self.pp_size in (None, 1) else self.pp_size

    def schedule(self) -> str:
        """``autopar.plan``'s ``schedule`` for ``pp_style``."""
        return PP_STYLES[self.pp_style]

    # ------------------------------------------------------------------------------ model
    def family_plan(self, model: Any, meta_inputs: tuple | dict) -> Any:
        """A fixed configuration's plan of ``model`` (a restricted plan of the planner, e.g.
        ``LowLevelZeroPlugin``'s ZeRO family); with several candidate meshes, the fastest of their
        plans (``plan_candidates``), solved on rank 0 and broadcast; else None: ``autoparallelize``
        plans (or applies ``plan``)."""
        if self.candidates is None:
            return None
        from autopar.runtime.build import runtime_device

        device = runtime_device(self.device)
        return plan_on_rank0(lambda: self._plan_candidates(model, meta_inputs, device), device=device,
                             what=f"AutoParallelPlugin: planning on the candidate meshes "
                                  f"{[tuple(m.shape) if isinstance(m, MeshSpec) else m for m in self.candidates]}")

    def _plan_candidates(self, model: Any, meta_inputs: tuple | dict, device) -> Any:
        import torch.distributed as dist

        from autopar.offload import runtime_options
        from autopar.planner.options import PlanOptions
        from autopar.planner.orchestrate import plan_candidates
        from autopar.runtime.build import mesh_preset

        world = dist.get_world_size() if dist.is_initialized() else None
        options = PlanOptions(preset=mesh_preset(device))
        kwargs = self.autoparallelize_kwargs()
        names = set(options.__dataclass_fields__)
        # As ``autoparallelize`` reads its overrides: None is "not given" but for pipeline (None: none).
        given = runtime_options({k: v for k, v in kwargs.items() if k in names and (v is not None or k == "pipeline")},
                                plan_given=False)
        options = options.override(given, caller="AutoParallelPlugin")
        meshes = [options.mesh(m) for m in self.candidates]
        wrong = [tuple(m.shape) for m in meshes if world is not None and m.num_devices != world]
        if wrong:
            raise ValueError(f"mesh: the candidate meshes {wrong} do not have the world's {world} devices")
        return plan_candidates(model, meta_inputs, meshes=meshes, options=options).best

    def autoparallelize_kwargs(self) -> dict[str, Any]:
        """The ``autopar.autoparallelize`` keyword arguments this plugin stands for."""
        # Candidate meshes are planned by family_plan: the plan it gives brings its own mesh.
        return dict(mesh=None if self.candidates is not None else self.mesh, memory_budget=self.memory_budget,
                    solver=self.solver, time_limit=self.time_limit, device=self.device, seed=self.seed,
                    optimizer_multiplier=self.optimizer_multiplier,
                    allow_replicate_fallback=self.allow_replicate_fallback,
                    checkpoint=self.checkpoint, ep_size=self.ep_size, sp_size=self.sp_size,
                    batch_norm_stats=self.batch_norm_stats,
                    precision=self.precision, reduce_dtype=self.reduce_dtype, plan=self.plan,
                    **({"refine": self.refine} if self.refine else {}),
                    **({} if self.offload == "none" else {"offload": self.offload}),
                    **({} if self.sequence_parallel == "auto" else {"sequence_parallel": self.sequence_parallel}),
                    # Pipelined stages and Gemini's own policies run without ZeRO: "auto" means 0 there
                    # (under pp_size="auto" the planner keeps it for the candidate without a pipeline).
                    zero_stage=None if self.plan is not None else
                    0 if (self.pipeline not in (None, "auto") or self.placement_policy in ("static", "auto"))
                    and self.zero_stage == "auto" else self.zero_stage,
                    # pp_size None means none here (autoparallelize's default is "auto"): see pp_size.
                    **({"pipeline": 1} if self.pipeline is None else
                       {"pipeline": self.pipeline, "schedule": self.schedule(),
                        "microbatches": "auto" if self.num_microbatches is None else self.num_microbatches}))

    # ------------------------------------------------------------------------------- data
    def prepare_dataloader(self, dataset: Dataset, batch_size: int, shuffle: bool = False, seed: int = 1024,
                           drop_last: bool = False, pin_memory: bool = False, num_workers: int = 0,
                           **kwargs: Any) -> DataLoader:
        """A torch ``DataLoader`` over a map-style ``dataset``: ``batch_size`` samples per
        DATA-PARALLEL rank per step (the product notes' meaning), in global batches that come in
        the same order on every rank (shuffled with ``seed`` + the epoch when ``shuffle``;
        ``loader.batch_sampler.set_epoch(e)`` reshuffles). ``drop_last`` drops a short last
        global batch; ``pin_memory``, ``num_workers`` and other keyword arguments (``collate_fn``,
        ...) go to ``DataLoader``; ``sampler``/``batch_sampler`` are this method's to choose.

        The rule for the global batch: ``batch_size x data_parallel_size()``, where the
        data-parallel size is the world size divided by the pipeline stage count (``pp_size``
        when an int; ``"auto"`` or none counts 1). Why not a plan's own data-parallel axes: the
        plan is made from the first global batch's shapes, so the global batch must be fixed
        before it exists; every rank inside a stage is one the planner may split the batch over,
        and a plan that splits it over the whole mesh gives each rank exactly ``batch_size``.
        Rank 0 prints the global batch once. Scale the learning rate for the global batch.

        What each rank loads, once ``booster.boost`` has seen the plan: when the plan splits
        every tensor input along its first (batch) dim by the same mesh axes and nothing else,
        each rank loads only its own slice of every global batch, and the model is built to take
        those pieces (``local_inputs=True``); otherwise (no input split, an input split along
        another dim or not at all while others are, inputs split differently) every rank loads
        the whole global batch, and the model takes it whole. Before ``boost`` every rank loads
        whole global batches. (The planner often leaves inputs replicated, since splitting a
        replicated input costs nothing; the per-rank path then does not apply.) The plan is made for
        one batch shape: use ``drop_last=True`` unless the global batch divides the dataset.
        """
        from autopar.booster.dataloader import make_dataloader

        dp = self.data_parallel_size()
        loader = make_dataloader(dataset, batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last,
                                 data_parallel=dp, pin_memory=pin_memory, num_workers=num_workers, **kwargs)
        if _rank() == 0:  # once, so a changed effective batch (and LR schedule) is never silent
            print(f"[autopar] prepare_dataloader: batch_size={batch_size} per data-parallel rank x {dp} "
                  f"data-parallel ranks = global batch of {batch_size * dp} samples per step", flush=True)
        return loader

    def data_parallel_size(self) -> int:
        """The data-parallel degree ``prepare_dataloader`` multiplies ``batch_size`` by: the
        world size (the mesh's device count before ``torch.distributed`` starts) over an int
        ``pp_size``."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            world = dist.get_world_size()
        elif self.mesh is not None:
            mesh = self.mesh if self.candidates is None else self.candidates[0]  # all of one world size
            world = mesh.num_devices if isinstance(mesh, MeshSpec) else _product(mesh)
        else:
            world = 1
        stages = self.pp_size if isinstance(self.pp_size, int) and self.pp_size > 1 else 1
        if world % stages:
            raise ValueError(f"pp_size={stages} does not divide the world size {world}")
        return world // stages


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _product(shape: Sequence[int]) -> int:
    n = 1
    for k in shape:
        n *= int(k)
    return n


def _is_candidate_list(mesh: Any) -> bool:
    """A list of meshes (``mesh=["4.json", "2x2.json"]``), not one shape such as ``(2, 2)``."""
    return isinstance(mesh, (list, tuple)) and not all(isinstance(k, int) and not isinstance(k, bool) for k in mesh)


def _one_mesh(mesh: Any) -> MeshSpec | tuple[int, ...]:
    """One mesh argument checked: a profile JSON's ``MeshSpec``, a ``MeshSpec``, or a shape."""
    if isinstance(mesh, (str, os.PathLike)) and is_profile_path(mesh):
        return MeshSpec.from_profile(mesh)  # a calibrated machine
    if isinstance(mesh, MeshSpec):
        return mesh
    try:
        return parse_mesh_shape(mesh)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"mesh must be None, a shape such as (2, 2) or '2x2', a MeshSpec, a profile JSON or a list "
                         f"of them, got {mesh!r} ({exc})") from None


def plan_on_rank0(solve: Callable[[], Any], *, device, what: str):
    """``solve()``'s ``Plan`` solved on rank 0 and broadcast to every rank; its error raises on
    every rank as a ``ValueError`` starting with ``what`` (no rank waits alone)."""
    import torch.distributed as dist

    from autopar.plans import Plan

    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            payload[0] = ("ok", solve().to_json())
        except Exception as exc:  # noqa: BLE001 -- re-raised on every rank below
            payload[0] = (type(exc).__name__, str(exc))
    if device.type == "cuda" and dist.get_backend() == "nccl":
        dist.broadcast_object_list(payload, src=0, device=device)
    else:
        dist.broadcast_object_list(payload, src=0)
    status, text = payload[0]
    if status != "ok":
        raise ValueError(f"{what} failed on rank 0: {status}: {text}")
    return Plan.from_json(text)
