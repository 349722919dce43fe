"""``PlanOptions``: what a plan is solved under, apart from the model and the mesh.

One record carries these options through ``autopar.plan``, ``autoparallelize``, the CLI and the
benchmarks, checked once when it is made. Plain data without torch or numpy, so the CLI can
check its flags before anything heavy is imported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.layout.mesh import PRESETS, MeshSpec, parse_bytes
from autopar.offload import OffloadPolicy, check_offload
from autopar.plans import PIPELINE_SCHEDULES, PRECISIONS

__all__ = ["PlanOptions", "OffloadPolicy", "SOLVERS", "CHECKPOINT_MODES", "ZERO_STAGES", "precision_name"]

SOLVERS = ("auto", "highs", "cbc")  # ILP backends (autopar.solver.ilp); auto prefers HiGHS
CHECKPOINT_MODES = ("auto", "none", "ilp", "rotor", "both")  # see autopar.planner.checkpointing
ZERO_STAGES = (0, 1, 2)  # over each parameter's replicated axes (autopar.runtime.zero)


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """``memory_budget``: bytes per device (an int, or a size such as ``"16GiB"``, stored as
    bytes); None = the mesh's device capacity. ``solver``: ILP backend. ``time_limit``: seconds per
    ILP solve. ``preset``: the device preset (``autopar.layout.mesh.PRESETS``) a mesh given as a
    shape gets. ``baselines``: also solve the baseline families. ``optimizer_multiplier``: optimizer
    state bytes per parameter byte. ``allow_replicate_fallback``: replicate ops without a sharding
    rule instead of failing. ``checkpoint``: activation recompute planning mode. ``precision``: what
    ops compute in (``"fp32"``, ``"bf16"``, ``"fp16"``; parameters and optimizer state stay fp32).
    ``reduce_dtype``: what gradients are summed in (default fp32). ``zero_stage``: shard each
    trainable parameter's optimizer state (1), and its gradient (2), over the mesh axes its layout
    replicates it on; 0: none; ``"auto"``: the solver picks per parameter, pricing each stage's
    memory and communication with the layouts (the plan needs ``model.optimizer`` then).
    ``pipeline``: None (no pipeline), N (pipeline parallelism over mesh axis 0, which must have
    size N) or ``"auto"`` (the faster of no pipeline and a pipeline over axis 0);
    ``microbatches``: micro-batches per step (``"auto"``: a few divisors of the batch that are
    multiples of the stage count); ``schedule``: ``"auto"`` or one of ``PIPELINE_SCHEDULES``
    (``autopar.planner.pipeline_search``). ``offload``: ``"none"`` (default), ``"auto"`` (the
    solver places each trainable parameter and its optimizer state on the device or the mesh's
    host tier, priced by host-link and CPU optimizer time) or an ``OffloadPolicy`` (Gemini's static
    fractions); see ``autopar.planner.offload_pricing``."""

    memory_budget: int | None = None
    solver: str = "auto"
    time_limit: float = 60.0
    preset: str = "cpu"
    baselines: bool = False
    optimizer_multiplier: float = 2.0
    allow_replicate_fallback: bool = False
    checkpoint: str = "auto"
    precision: str = "fp32"
    reduce_dtype: str = "fp32"
    zero_stage: int | str = 0
    pipeline: int | str | None = None
    microbatches: int | str = "auto"
    schedule: str = "auto"
    offload: str | OffloadPolicy = "none"

    def __post_init__(self) -> None:
        if self.memory_budget is not None:
            object.__setattr__(self, "memory_budget", parse_bytes(self.memory_budget))
        if self.solver not in SOLVERS:
            raise ValueError(f"unknown solver {self.solver!r}; expected one of {SOLVERS}")
        if not _is_number(self.time_limit) or not self.time_limit > 0:
            raise ValueError(f"time_limit must be positive seconds, got {self.time_limit!r}")
        if self.preset not in PRESETS:
            raise ValueError(f"unknown device preset {self.preset!r}; known: {sorted(PRESETS)}")
        if not _is_number(self.optimizer_multiplier) or not 0 <= self.optimizer_multiplier < math.inf:
            raise ValueError(f"optimizer_multiplier must be a finite number >= 0, got {self.optimizer_multiplier!r}")
        if self.checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"checkpoint must be one of {CHECKPOINT_MODES}, got {self.checkpoint!r}")
        if self.zero_stage not in (*ZERO_STAGES, "auto") or isinstance(self.zero_stage, bool):
            raise ValueError(f"zero_stage must be one of {ZERO_STAGES} or 'auto', got {self.zero_stage!r}")
        object.__setattr__(self, "precision", precision_name(self.precision, what="precision"))
        _check_pipeline(self.pipeline, self.microbatches, self.schedule)
        object.__setattr__(self, "reduce_dtype", precision_name(self.reduce_dtype, what="reduce_dtype"))
        check_offload(self.offload)
        if self.offload != "none" and self.pipeline is not None:
            raise ValueError(f"offload={self.offload!r} is not planned with a pipeline yet (pipeline={self.pipeline!r})")

    def mesh(self, mesh: MeshSpec | tuple[int, ...] | str) -> MeshSpec:
        """``mesh`` as a MeshSpec: a shape gets this record's ``preset``."""
        return MeshSpec.coerce(mesh, preset=self.preset)

    def budget_bytes(self, mesh: MeshSpec) -> int:
        """The per-device budget on ``mesh``: ``memory_budget``, else the device capacity."""
        return mesh.mem_capacity if self.memory_budget is None else self.memory_budget

    def __str__(self) -> str:
        budget = "device capacity" if self.memory_budget is None else f"{self.memory_budget / 2**30:.2f} GiB"
        return (f"budget {budget}, solver {self.solver} ({self.time_limit:g}s), preset {self.preset}, "
                f"checkpoint {self.checkpoint}" + (", baselines" if self.baselines else "")
                + (f", {self.precision} compute (gradients summed in {self.reduce_dtype})"
                   if self.precision != "fp32" else "")
                + (f", ZeRO-{self.zero_stage}" if self.zero_stage else "")
                + (", replicate fallback" if self.allow_replicate_fallback else "")
                + (f", pipeline {self.pipeline} ({self.microbatches} micro-batches, schedule {self.schedule})"
                   if self.pipeline is not None else "")
                + (f", offload {self.offload}" if self.offload != "none" else ""))


_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float": "fp32"}


def precision_name(value, *, what: str = "precision") -> str:
    """``"bf16"``, ``"bfloat16"`` or ``torch.bfloat16`` -> ``"bf16"`` (one of ``PRECISIONS``)."""
    name = str(value).removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name not in PRECISIONS:
        raise ValueError(f"{what} must be one of {PRECISIONS} (or the torch dtype), got {value!r}")
    return name


def _check_pipeline(pipeline, microbatches, schedule) -> None:
    def positive(n) -> bool:
        return isinstance(n, int) and not isinstance(n, bool) and n >= 1

    if pipeline is not None and pipeline != "auto" and not positive(pipeline):
        raise ValueError(f"pipeline must be None, 'auto' or a positive int (the size of mesh axis 0), got {pipeline!r}")
    if microbatches != "auto" and not positive(microbatches):
        raise ValueError(f"microbatches must be 'auto' or a positive int, got {microbatches!r}")
    if schedule != "auto" and schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"schedule must be 'auto' or one of {PIPELINE_SCHEDULES}, got {schedule!r}")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
