"""The planning options, declared once: grouped, frozen records with one help line per field.

``SolverOptions``, ``MemoryOptions``, ``PrecisionOptions`` and ``PipelineOptions`` each declare
one concern; ``PlanOptions`` is all of them in one flat record (``options.solver``,
``options.zero_stage``), what the planner reads. Every field carries its help line, its checker
and, where the entry points spell it differently, its other names in ``field(metadata=...)``:
``autopar.plan`` and ``autoparallelize`` take the fields as keywords (applied to a record with
``dataclasses.replace``), the CLI generates its flags and help from them
(``autopar.cli.flags``), and ``AutoParallelPlugin`` validates its planning fields with
``check_option`` under its own names. A value is checked in one place, ``check_option``, and the
message names the option as the caller spelled it and echoes the value.

Plain data without torch or numpy, so the CLI can check its flags before anything heavy is imported.
"""

import math
import os
import types
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Literal, Union, get_args, get_origin

from autopar.layout.mesh import PRESETS, MeshSpec, is_profile_path, parse_bytes
from autopar.offload import OffloadPolicy, check_offload

__all__ = ["PlanOptions", "SolverOptions", "MemoryOptions", "PrecisionOptions", "PipelineOptions", "ParallelismOptions",
           "OffloadPolicy", "SOLVERS", "SEQUENCE_MODES", "CHECKPOINT_MODES", "ZERO_STAGES", "PRECISION_NAMES",
           "SCHEDULES", "BATCH_NORM_STATS", "OPTION_GROUPS", "check_option", "check_choice", "check_number",
           "check_count", "choices_of",
           "precision_name"]

Solver = Literal["auto", "highs", "cbc"]  # ILP backends (autopar.solver.ilp); auto prefers HiGHS
CheckpointMode = Literal["auto", "none", "ilp", "rotor", "both"]  # see autopar.planner.checkpointing
Precision = Literal["fp32", "bf16", "fp16"]  # autopar.plans.PRECISIONS
ZeroStage = Literal[0, 1, 2, "auto"]  # over each parameter's replicated axes (autopar.runtime.zero)
Schedule = Literal["auto", "gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"]  # "auto" + plans.PIPELINE_SCHEDULES
SequenceMode = Literal["auto", "off", "ring", "all_to_all", "split_gather"]  # see autopar.planner.sequence
BatchNormStats = Literal["global", "per_rank"]  # per_rank: autopar.tracer.batch_stats

SOLVERS = get_args(Solver)
CHECKPOINT_MODES = get_args(CheckpointMode)
PRECISION_NAMES = get_args(Precision)
ZERO_STAGES = get_args(ZeroStage)
SCHEDULES = get_args(Schedule)
SEQUENCE_MODES = get_args(SequenceMode)
BATCH_NORM_STATS = get_args(BatchNormStats)


# ------------------------------------------------------------------------------- checkers
def check_choice(value, choices: tuple, *, name: str):
    """``value`` when it is one of ``choices`` (``True`` is not ``1``: the type must match too)."""
    if not any(value == c and type(value) is type(c) for c in choices):
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def check_number(value, *, name: str, low: float = -math.inf, high: float = math.inf, low_open: bool = False,
                 high_open: bool = False, what: str = ""):
    """``value`` when it is a finite int or float (not a bool) within ``low``..``high`` (open ends:
    ``low_open``/``high_open``); ``what`` words the bound in the message (default: the interval)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and (value < low or value > high or (low_open and value == low) or (high_open and value == high)):
        ok = False
    if not ok:
        bounds = what or f"a finite number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"{name} must be {bounds}, got {value!r}")
    return value


def check_count(value, *, name: str, words: tuple = (), low: int = 1):
    """``value`` when it is an int >= ``low`` (not a bool) or one of ``words`` (e.g. ``"auto"``, None)."""
    if any(value is w or (isinstance(w, str) and value == w) for w in words):
        return value
    if type(value) is not int or value < low:
        said = " or ".join([*(repr(w) for w in words), f"an int >= {low}" if low != 1 else "a positive int"])
        raise ValueError(f"{name} must be {said}, got {value!r}")
    return value


def precision_name(value, *, what: str = "precision") -> str:
    """``"bf16"``, ``"bfloat16"`` or ``torch.bfloat16`` -> ``"bf16"`` (one of ``PRECISION_NAMES``)."""
    name = str(value).removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name not in PRECISION_NAMES:
        raise ValueError(f"{what} must be one of {PRECISION_NAMES} (or the torch dtype), got {value!r}")
    return name


_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float": "fp32"}


def _budget(value, name: str):
    return None if value is None else parse_bytes(value)  # parse_bytes echoes a bad size


def _solver(value, name: str):
    if value not in SOLVERS:  # the backend is named in the message, as pulp users expect
        raise ValueError(f"unknown {name} {value!r}; expected one of {SOLVERS}")
    return value


def _preset(value, name: str):
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str) and is_profile_path(value):
        if not os.path.isfile(value):  # its shape is checked with the mesh (MeshSpec.from_profile)
            raise ValueError(f"{name}: mesh profile {value!r} not found (make one with: autopar calibrate --mesh ... "
                             f"--out {value})")
        return value
    if value not in PRESETS:
        raise ValueError(f"unknown device {name} {value!r}; known: {sorted(PRESETS)}, or the path of a machine "
                         f"profile JSON (autopar calibrate)")
    return value


def _positive_seconds(value, name: str):
    return check_number(value, name=name, low=0, low_open=True, what="positive seconds")


def _multiplier(value, name: str):
    return check_number(value, name=name, low=0, what="a finite number >= 0")


def _flag(value, name: str):
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def _zero_stage(value, name: str):
    return check_choice(value, ZERO_STAGES, name=name)


def _pipeline(value, name: str):
    try:
        value = check_count(value, name=name, words=(None, "auto"))
    except ValueError:  # the message says what the int means
        raise ValueError(f"{name} must be 'auto', 1 or None (no pipeline) or an int > 1 (the size of mesh axis 0), "
                         f"got {value!r}") from None
    return None if value == 1 else value  # one stage is no pipeline: one spelling of "off" in the record


def _microbatches(value, name: str):
    return check_count(value, name=name, words=("auto",))


def _offload(value, name: str):
    return check_offload(value)


def option(default: Any, help: str, *, check: Callable[[Any, str], Any] | None = None,
           flags: tuple[str, ...] = (), training: bool = True) -> Any:
    """A record field with its help line and checker. ``check(value, name)`` returns the value
    (normalised) or raises ``ValueError`` naming ``name``; None: the field's ``Literal`` type is the
    check. ``flags``: older CLI names kept as aliases of the generated flag. ``training``: False
    for the planning-only options that ``autoparallelize`` and the plugin take from elsewhere."""
    return field(default=default, metadata={"help": help, "check": check, "flags": flags, "training": training})


def choices_of(annotation) -> tuple:
    """The values a ``Literal`` annotation (or a union holding one) allows; () for none."""
    if get_origin(annotation) is Literal:
        return get_args(annotation)
    if get_origin(annotation) in (Union, types.UnionType):
        return tuple(v for arg in get_args(annotation) for v in choices_of(arg))
    return ()


def _field(name: str):
    for f in fields(PlanOptions):
        if f.name == name:
            return f
    raise TypeError(f"no planning option {name!r}; the options are {', '.join(f.name for f in fields(PlanOptions))}")


def check_option(option_name: str, value, *, name: str | None = None):
    """The one validation of a planning option: ``value`` checked (and normalised) as field
    ``option_name`` of ``PlanOptions``; the ``ValueError`` names ``name`` (how the caller spelled
    it: ``pp_size``, ``--time-limit``; default the field's name) and echoes the value."""
    return _check_field(_field(option_name), value, name or option_name)


def _check_field(f, value, name: str):
    check = f.metadata["check"]
    return check(value, name) if check is not None else check_choice(value, choices_of(f.type), name=name)


class _Checked:
    """Checks every field of the record it is mixed into with ``check_option``, once, when made."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            checked = _check_field(f, value, f.name)
            if checked is not value:
                object.__setattr__(self, f.name, checked)
        self._check_together()

    def _check_together(self) -> None:
        """Rules across fields (none for a single group)."""


# ----------------------------------------------------------------------------------- groups
@dataclass(frozen=True, kw_only=True)
class SolverOptions(_Checked):
    """How the plan is searched for."""

    solver: Solver = option("auto", "ILP backend (auto: HiGHS when installed)", check=_solver)
    time_limit: float = option(60.0, "seconds per ILP solve; with mesh auto, for the whole search",
                               check=_positive_seconds)
    preset: str = option("cpu", "the device preset (autopar.layout.mesh.PRESETS) a mesh given as a shape gets, or a "
                                "machine profile JSON (autopar calibrate) measured on that shape",
                         check=_preset, flags=("--device",), training=False)
    baselines: bool = option(False, "also solve the baseline families (data parallel, ZeRO-3, Megatron TP, DP x TP)",
                             check=_flag, training=False)
    allow_replicate_fallback: bool = option(False, "replicate ops without a sharding rule instead of failing",
                                            check=_flag, flags=("--allow-fallback",))


@dataclass(frozen=True, kw_only=True)
class MemoryOptions(_Checked):
    """What must fit in each device's memory, and the means to make it fit."""

    memory_budget: int | str | None = option(None, "bytes per device, e.g. 40GiB (default: the device capacity)",
                                             check=_budget, flags=("--memory",))
    optimizer_multiplier: float = option(2.0, "optimizer state bytes per parameter byte (2: AdamW in fp32)",
                                         check=_multiplier)
    checkpoint: CheckpointMode = option("auto", "activation recompute planning (auto: the faster of the joint "
                                                "ILP with Rotor refinement and Rotor alone)")
    zero_stage: ZeroStage = option(0, "shard optimizer state (1) and gradients (2) over each parameter's "
                                      "replicated axes; auto: the solver picks per parameter", check=_zero_stage)
    offload: Literal["none", "auto"] | OffloadPolicy = option(
        "none", "parameters / optimizer state on the host tier: none, auto (planned per parameter) or an "
                "OffloadPolicy (CLI: static:OPTIM_FRAC,PARAM_FRAC, Gemini's fractions)", check=_offload)


@dataclass(frozen=True, kw_only=True)
class PrecisionOptions(_Checked):
    """What runs in which dtype (parameters and optimizer state stay fp32)."""

    precision: Precision = option("fp32", "what ops compute in (bf16/fp16 with fp32 master weights)",
                                  check=lambda v, n: precision_name(v, what=n))
    reduce_dtype: Precision = option("fp32", "what gradients are summed in",
                                     check=lambda v, n: precision_name(v, what=n))


@dataclass(frozen=True, kw_only=True)
class PipelineOptions(_Checked):
    """Pipeline parallelism over mesh axis 0 (autopar.planner.pipeline.search)."""

    pipeline: int | Literal["auto"] | None = option(
        "auto", "auto: also plan pipelines over mesh axis 0 where the model has repeated blocks and one can beat "
                "the plan without (autopar.planner.orchestrate.plan_auto); N: a pipeline over axis 0 (its size N); "
                "1 (or None): no pipeline", check=_pipeline)
    microbatches: int | Literal["auto"] = option("auto", "micro-batches per step with a pipeline (auto: a few "
                                                         "divisors of the batch)", check=_microbatches)
    schedule: Schedule = option("auto", "the pipeline schedule (auto: the fastest)")


def _degree(value, name: str):
    return check_count(value, name=name, words=(None,))


@dataclass(frozen=True, kw_only=True)
class ParallelismOptions(_Checked):
    """Degrees of parallelism the user pins instead of the planner choosing them: sequence-split
    attention (``autopar.planner.sequence``) and expert parallelism, both strategy filters
    (``autopar.planner.pins``); and what data parallelism means for a training batch norm
    (``batch_norm_stats``: a rewrite of the trace, ``autopar.tracer.batch_stats``)."""

    sequence_parallel: SequenceMode = option(
        "auto", "ring: attention split on the sequence (key/value blocks passed around); all_to_all (Ulysses): "
                "heads split inside, sequence-split inputs; split_gather (Megatron SP): norms sequence-split; "
                "off: no attention split on the sequence; auto: the solver's choice")
    sp_size: int | None = option(
        None, "the devices a pinned sequence_parallel mode splits over: the innermost mesh axes whose sizes "
              "multiply to it (default: the last mesh axis of size > 1)", check=_degree)
    ep_size: int | None = option(
        None, "expert parallelism: every MoE experts op splits its experts over mesh axes of this total size, "
              "tokens sent to them by all-to-all; 1: experts never split (default: the planner decides)",
        check=_degree)
    batch_norm_stats: BatchNormStats = option(
        "global", "training batch norms: global (the whole batch's statistics on every plan) or per_rank (torch "
                  "DDP's: each of world-size equal contiguous chunks of the batch by its own statistics, no "
                  "collective; the same on every plan, autopar.tracer.batch_stats)")


OPTION_GROUPS = (SolverOptions, MemoryOptions, PrecisionOptions, PipelineOptions, ParallelismOptions)


@dataclass(frozen=True, kw_only=True)
class PlanOptions(ParallelismOptions, PipelineOptions, PrecisionOptions, MemoryOptions, SolverOptions):
    """Every planning option in one flat record (the groups' fields; see each group's help lines)."""

    def _check_together(self) -> None:
        # A pipeline asked for by its size must be planned as asked; "auto" only plans pipelines
        # where the other options allow one (autopar.planner.pipeline.candidates.blocker).
        if self.offload != "none" and isinstance(self.pipeline, int):
            raise ValueError(f"offload={self.offload!r} is not planned with a pipeline yet "
                             f"(pipeline={self.pipeline!r})")
        if self.sequence_parallel != "auto" and isinstance(self.pipeline, int):
            raise ValueError(f"sequence_parallel={self.sequence_parallel!r} is not pinned in pipeline stages yet "
                             f"(pipeline={self.pipeline!r})")
        if self.batch_norm_stats != "global" and isinstance(self.pipeline, int):
            raise ValueError(f"batch_norm_stats={self.batch_norm_stats!r} is not planned with a pipeline "
                             f"(pipeline={self.pipeline!r}): a micro-batch would cut the per-rank chunks")
        if self.sp_size is not None and self.sequence_parallel in ("auto", "off"):
            raise ValueError(f"sp_size={self.sp_size} pins the degree of a sequence_parallel mode ('ring', "
                             f"'all_to_all' or 'split_gather'), not of sequence_parallel={self.sequence_parallel!r}")

    def override(self, overrides: dict[str, Any], *, caller: str) -> "PlanOptions":
        """This record with ``overrides`` (option name -> value) applied by ``dataclasses.replace``;
        a name that is no option is the ``TypeError`` Python gives an unknown keyword of ``caller``."""
        names = {f.name for f in fields(self)}
        for key in overrides:
            if key not in names:
                raise TypeError(f"{caller}() got an unexpected keyword argument {key!r}")
        return replace(self, **overrides) if overrides else self

    def batch_norm_chunks(self, devices: int) -> int | None:
        """The chunks a training batch norm's batch is cut into on a world of ``devices``
        (``batch_norm_stats="per_rank"``: one per rank, ``autopar.tracer.batch_stats``); None: global."""
        return devices if self.batch_norm_stats == "per_rank" else None

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
                   if isinstance(self.pipeline, int) else "")
                + (f", offload {self.offload}" if self.offload != "none" else "")
                + (f", sequence parallel {self.sequence_parallel}" if self.sequence_parallel != "auto" else "")
                + (f" over {self.sp_size} devices" if self.sp_size is not None else "")
                + (f", {self.batch_norm_stats} batch statistics" if self.batch_norm_stats != "global" else ""))
