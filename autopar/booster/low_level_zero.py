"""``LowLevelZeroPlugin``: Colossal-AI's ZeRO-1/2 data parallelism as a restricted autopar plan.

The plugin is an :class:`AutoParallelPlugin` whose plan is the planner's own ``zero1`` / ``zero2``
baseline family (``autopar.planner.baselines``: every mesh axis data parallel, every trainable
parameter at ZeRO stage ``stage``), solved by rank 0 on the boosted model with the same costs as
the auto plan and broadcast; autopar's runtime executes it. A fixed configuration and the auto
plan are thus the same kind of object (``Plan``): ``booster.boost(...)[0].plan``.
"""

from __future__ import annotations

import logging
from typing import Any

from autopar.booster.plugin import AutoParallelPlugin, plan_on_rank0

__all__ = ["LowLevelZeroPlugin", "LOW_LEVEL_ZERO_PARAMETERS", "OwnArguments", "plan_on_rank0", "family_plan_on_rank0"]

log = logging.getLogger(__name__)

# Colossal-AI's documented signature, in order, with its defaults.
LOW_LEVEL_ZERO_PARAMETERS: dict[str, Any] = {
    "stage": 1, "precision": "fp16", "initial_scale": 2.0**32, "min_scale": 1, "growth_factor": 2,
    "backoff_factor": 0.5, "growth_interval": 1000, "hysteresis": 2, "max_scale": 2.0**32, "max_norm": 0.0,
    "norm_type": 2.0, "reduce_bucket_size_in_m": 12, "communication_dtype": None, "overlap_communication": True,
    "cpu_offload": False, "master_weights": True, "verbose": False,
}
_DTYPE_NAMES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


class OwnArguments:
    """For an ``AutoParallelPlugin`` subclass with the notes' constructor, whose own arguments
    (``stage``, ``tp_size`` ...) live outside the dataclass slots: copies and pickles keep them
    (the slotted dataclass's state is its fields only)."""

    def __getstate__(self) -> tuple:
        return super().__getstate__(), dict(self.__dict__)  # type: ignore[misc]

    def __setstate__(self, state: tuple) -> None:
        super().__setstate__(state[0])  # type: ignore[misc]
        self.__dict__.update(state[1])


class LowLevelZeroPlugin(OwnArguments, AutoParallelPlugin):
    """ZeRO-1/2 data parallelism (Colossal-AI's ``LowLevelZeroPlugin`` signature).

    Args:
        stage: 1 (optimizer state sharded over the data-parallel ranks) or 2 (and gradients).
        precision: ``"fp16"`` (loss-scaled), ``"bf16"`` or ``"fp32"`` compute; fp32 master weights.
        initial_scale, growth_factor, backoff_factor, growth_interval, min_scale, max_scale,
            hysteresis: the fp16 loss scaler's (``autopar.runtime.amp.GradScaler``, Colossal-AI's
            rule: the scale backs off at the ``hysteresis``-th overflow since it last grew).
        max_norm, norm_type: clip gradients to this global norm (0: no clipping).
        reduce_bucket_size_in_m, overlap_communication, verbose: no meaning here (the runtime's
            collectives follow the plan); a non-default value logs one line.
        communication_dtype: ``None``, ``torch.float32``/``bfloat16``/``float16`` (or their names):
            the dtype gradients are reduced in (``reduce_dtype``).
        cpu_offload: ZeRO-Offload: the plan puts every parameter's optimizer state on the host
            (``OffloadPolicy(offload_optim_frac=1.0)``, ``Plan.offload``), where the chunk runtime
            steps it (``placement_policy="planned"``).
        master_weights: True only (fp32 masters); False raises ``NotImplementedError``.
    """

    def __init__(self, stage: int = 1, precision: str = "fp16", initial_scale: float = 2.0**32,
                 min_scale: float = 1, growth_factor: float = 2, backoff_factor: float = 0.5,
                 growth_interval: int = 1000, hysteresis: int = 2, max_scale: float = 2.0**32,
                 max_norm: float = 0.0, norm_type: float = 2.0, reduce_bucket_size_in_m: int = 12,
                 communication_dtype: Any = None, overlap_communication: bool = True, cpu_offload: bool = False,
                 master_weights: bool = True, verbose: bool = False) -> None:
        if isinstance(stage, bool) or stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2 (ZeRO-1/2; ZeRO-3 is GeminiPlugin / TorchFSDPPlugin), "
                             f"got {stage!r}")
        if master_weights is not True:
            raise NotImplementedError(f"LowLevelZeroPlugin: master_weights={master_weights!r} not supported by "
                                      f"autopar (masters are fp32)")
        ignored = [f"{name}={value!r}" for name, value, default in (
            ("reduce_bucket_size_in_m", reduce_bucket_size_in_m, 12),
            ("overlap_communication", overlap_communication, True), ("verbose", verbose, False))
            if value != default]
        if ignored:
            log.info("LowLevelZeroPlugin: %s have no meaning in autopar (the plan's collectives run as "
                     "planned); ignored", ", ".join(ignored))
        reduce_dtype = None
        if communication_dtype is not None:
            name = str(communication_dtype).removeprefix("torch.")
            reduce_dtype = _DTYPE_NAMES.get(name, name)
        from autopar.offload import OffloadPolicy

        # ZeRO-Offload: every parameter's optimizer state (and fp32 master) on the host, stepped there
        # (the plan's offload tiers, executed by the chunk runtime: placement_policy "planned").
        offload = OffloadPolicy(offload_optim_frac=1.0) if cpu_offload else "none"
        super().__init__(precision=precision, zero_stage=stage, max_norm=max_norm, reduce_dtype=reduce_dtype,
                         offload=offload, initial_scale=initial_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval, min_scale=min_scale,
                         max_scale=max_scale, hysteresis=hysteresis, norm_type=norm_type)
        object.__setattr__(self, "stage", stage)
        object.__setattr__(self, "cpu_offload", cpu_offload)

    def __repr__(self) -> str:
        return f"LowLevelZeroPlugin(stage={self.stage}, precision={self.precision!r})"

    @property
    def family(self) -> str:
        """The planner's baseline family this plugin's plan is (``autopar.planner.baselines``)."""
        return f"zero{self.stage}"

    def family_plan(self, model: Any, meta_inputs: tuple | dict):
        """The ``zero1``/``zero2`` family's plan of ``model`` on a 1-D mesh over the world: rank 0
        solves the restricted problem and broadcasts it (its error raises on every rank)."""
        return family_plan_on_rank0(self, model, meta_inputs, self.family, name="LowLevelZeroPlugin")


def family_plan_on_rank0(plugin: AutoParallelPlugin, model: Any, meta_inputs: tuple | dict, family: str, *,
                         name: str):
    """Baseline ``family``'s plan of ``model`` (``planner.orchestrate.plan_family``) on a 1-D mesh
    over the world, with ``plugin``'s precision, solver and offload options, solved on rank 0 and
    broadcast (``plan_on_rank0``); its error raises on every rank (named ``name``)."""
    from autopar.runtime.build import runtime_device

    device = runtime_device(plugin.device)
    return plan_on_rank0(lambda: _solve_family(plugin, model, meta_inputs, family, device), device=device,
                         what=f"{name}: planning the {family} family")


def _solve_family(plugin: AutoParallelPlugin, model: Any, meta_inputs: tuple | dict, family: str, device):
    import torch.distributed as dist

    from autopar.layout.mesh import MeshSpec
    from autopar.planner.options import PlanOptions
    from autopar.planner.orchestrate import plan_family
    from autopar.runtime.build import mesh_preset

    preset = mesh_preset(device)
    options = PlanOptions(precision=plugin.precision, zero_stage="auto", reduce_dtype=plugin.reduce_dtype or "fp32",
                          checkpoint="none", optimizer_multiplier=plugin.optimizer_multiplier, preset=preset,
                          solver=plugin.solver, offload=plugin.offload,
                          **({} if plugin.time_limit is None else {"time_limit": plugin.time_limit}))
    mesh = MeshSpec.coerce((dist.get_world_size(),), preset=preset)
    return plan_family(model, meta_inputs, family, mesh=mesh, options=options)
