"""``HybridParallelPlugin``: Colossal-AI's TP x PP x DP plugin as a restricted autopar plan.

The world is a mesh of axes (pp, dp, tp) -- ``pp_size`` pipeline stages, ``tp_size`` tensor-
parallel ranks and the rest data parallel, axes of size 1 left out -- planned by autopar's own
planner restricted to a family of ``autopar.planner.baselines`` (``hybrid_layout``): on the tp
axis the ``megatron`` role (every trainable matrix stored and computed split: column/row-parallel
Linear layers, an embedding split by vocabulary or hidden dim, activations never split on the
batch dim, the cost model choosing among those), on the dp axis data parallelism or ZeRO-1/2
(``zero_stage``). With ``pp_size > 1`` the pipeline planner cuts the repeated blocks into
stages over axis 0 and plans each stage within that family on the (dp, tp) sub-mesh. Rank 0
solves and broadcasts; autopar's runtime executes the ``Plan`` (``booster.boost(...)[0].plan``),
which ``autopar inspect MODEL --mesh ... --family ... [--pipeline N]`` prints alike.

Sequence parallelism (``enable_sequence_parallelism=True``) takes the later releases' keywords,
``sp_size`` and ``sequence_parallelism_mode``, and pins the planner's ``sequence_parallel`` option
(``autopar.planner.pins``) inside the family: ``"split_gather"`` and ``"ring"`` on the tp axis
(sp == tp, no axis of its own), ``"all_to_all"`` and ``"ring_attn"`` on an ``sp`` axis appended
to the mesh (pp, dp, tp, sp), world = pp * dp * tp * sp (the product's axis order).

A fused projection whose output is cut into equal parts (GPT-2's ``c_attn``, q, k and v in one
Conv1D; Phi-3's ``qkv_proj`` and ``gate_up_proj``) is stored and computed split per part,
``S(d/k)`` (Megatron's and Colossal-AI's ``n_fused``; ``autopar.strategies.fused``), so the
attention runs head-parallel as with separate q/k/v projections. Where the layouts cannot follow
Megatron: KV heads fewer than ``tp_size`` are gathered, as Megatron replicates them; a fused
projection with unequal parts (GQA's q|k|v) is not split per part, so the attention after it runs
on whole q, k, v.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from autopar.booster.low_level_zero import OwnArguments, plan_on_rank0
from autopar.booster.plugin import AutoParallelPlugin
from autopar.planner.options import check_choice, check_count

__all__ = ["HybridParallelPlugin", "HYBRID_PARALLEL_PARAMETERS", "LATER_PARAMETERS", "SP_MODES"]

log = logging.getLogger(__name__)

_REQUIRED = inspect.Parameter.empty
# Colossal-AI's documented signature, in order, with its defaults (``_REQUIRED``: none).
HYBRID_PARALLEL_PARAMETERS: dict[str, Any] = {
    "tp_size": _REQUIRED, "pp_size": _REQUIRED, "precision": "fp16", "zero_stage": 0,
    "enable_all_optimization": False, "enable_fused_normalization": False, "enable_flash_attention": False,
    "enable_jit_fused": False, "enable_sequence_parallelism": False, "enable_sequence_overlap": False,
    "parallel_output": True, "num_microbatches": None, "microbatch_size": None, "initial_scale": 65536,
    "min_scale": 1, "growth_factor": 2, "backoff_factor": 0.5, "growth_interval": 1000, "hysteresis": 2,
    "max_scale": 4294967296, "max_norm": 0, "broadcast_buffers": True, "ddp_bucket_cap_mb": 25,
    "find_unused_parameters": False, "check_reduction": False, "gradient_as_bucket_view": False,
    "static_graph": False, "zero_bucket_size_in_m": 12, "cpu_offload": False, "communication_dtype": None,
    "overlap_communication": True, "custom_policy": None, "pp_style": "1f1b", "num_model_chunks": 1,
    "enable_metadata_cache": True,
}
# The later releases' sequence-parallel keywords, keyword-only after the notes' signature (whose
# positional order stays the notes'), with the product's defaults.
LATER_PARAMETERS: dict[str, Any] = {"sp_size": None, "sequence_parallelism_mode": None}
SP_MODES = ("split_gather", "ring", "all_to_all", "ring_attn")
# Mode -> the planner's sequence_parallel pin (``autopar.planner.pins``).
_SP_PINS = {"split_gather": "split_gather", "ring": "split_gather", "all_to_all": "all_to_all", "ring_attn": "ring"}
# Switches that pick kernels or engine internals: autopar's plan computes the same values without them.
_IGNORED = ("enable_all_optimization", "enable_fused_normalization", "enable_flash_attention", "enable_jit_fused",
            "broadcast_buffers", "ddp_bucket_cap_mb", "find_unused_parameters", "check_reduction",
            "gradient_as_bucket_view", "static_graph", "zero_bucket_size_in_m", "overlap_communication",
            "enable_metadata_cache")
# Loss-scaler bounds autopar's scaler (torch's) does not have: only their defaults are accepted.
_SCALER_BOUNDS = ("min_scale", "max_scale", "hysteresis")
_STYLES = ("1f1b", "interleaved", "zbv")
_DTYPE_NAMES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


class HybridParallelPlugin(OwnArguments, AutoParallelPlugin):
    """Tensor x pipeline x data parallelism (Colossal-AI's ``HybridParallelPlugin`` signature).

    Args:
        tp_size: Megatron tensor parallelism over this many ranks (the mesh's last axis).
        pp_size: pipeline stages (mesh axis 0); the data-parallel size is
            ``world / (tp_size * pp_size)`` (``prepare_dataloader``'s ``batch_size`` is per
            data-parallel rank). Both must divide the world size; ``pp_size`` (times
            ``num_model_chunks``) may not exceed the model's repeated blocks.
        precision: ``"fp16"`` (loss-scaled, pipelined stages included: the last stage scales each
            micro-batch's loss, the step skips on every rank when any overflowed), ``"bf16"`` or
            ``"fp32"`` compute, fp32 master weights.
        zero_stage: 0 (data parallel), 1 or 2 (ZeRO over the data-parallel ranks: optimizer
            state, and gradients). With a pipeline, 0 or 1 (the notes: ZeRO-2 does not compose).
        enable_all_optimization, enable_fused_normalization, enable_flash_attention, enable_jit_fused:
            kernel switches; the plan's ops compute the same values, so a True logs one line.
        enable_sequence_parallelism: sequence parallelism, ``sequence_parallelism_mode`` of the
            planner's restricted plan (below); needs ``pp_size=1`` (``NotImplementedError`` else:
            the pipeline planner does not pin it in its stages yet).
        enable_sequence_overlap: the product overlaps split_gather's all-gather with the column-
            parallel matmul; that is a kernel schedule, the values are the same, so True logs
            that it is ignored (autopar's runtime issues the plan's collectives where priced).
        sp_size (keyword-only, the later releases'): the sequence-parallel degree of
            ``"all_to_all"`` / ``"ring_attn"``: an ``sp`` mesh axis of this size, last (the data-
            parallel size is ``world / (pp_size * tp_size * sp_size)``); must be > 1 there. With
            ``"split_gather"`` / ``"ring"`` the degree is ``tp_size`` and another value logs that it
            is ignored (as the product warns). Without sequence parallelism only None or 1.
        sequence_parallelism_mode (keyword-only, the later releases'): ``None`` (the product's
            default, ``"all_to_all"``) or one of:

            - ``"split_gather"``: Megatron sequence parallelism on the tp axis (needs ``tp_size`` > 1):
              the normalization modules' values split on the sequence, the matmuls column/row-
              parallel; the solver places the all-gather before a column-parallel matmul and the
              reduce-scatter after a row-parallel one (``sequence_parallel="split_gather"``);
            - ``"ring"``: the product's name for the same layout with its all-gather and reduce-
              scatter done as ring exchanges overlapped with the matmul chunks: a communication
              schedule, the same values; planned as ``"split_gather"``;
            - ``"all_to_all"``: DeepSpeed-Ulysses on the sp axis: the attention's inputs sequence-
              split, its heads split inside, all-to-alls between (``sequence_parallel="all_to_all"``);
            - ``"ring_attn"``: ring attention (context parallelism) on the sp axis: query, key,
              value split on the sequence, key/value blocks passed around (``sequence_parallel="ring"``).
        parallel_output: accepted either way: the loss is computed inside the plan (vocabulary-
            parallel where the costs choose it) and the boosted model's outputs are full on every
            rank, as with ``parallel_output=False``.
        num_microbatches, microbatch_size: the pipeline's micro-batches per step, or their size
            (the global batch must divide by it; ignored when ``num_microbatches`` is given). Both
            None: the planner picks the count. Without a pipeline a value logs that it is ignored.
        initial_scale, growth_factor, backoff_factor, growth_interval: the fp16 loss scaler's.
        min_scale, max_scale, hysteresis: accepted at their defaults (autopar's scaler has no
            floor, ceiling or hysteresis); other values raise ``NotImplementedError``.
        max_norm: clip gradients to this global L2 norm (0: no clipping), over every stage and shard.
        broadcast_buffers, ddp_bucket_cap_mb, find_unused_parameters, check_reduction,
            gradient_as_bucket_view, static_graph: torch DDP's; the plan's own gradient sums run
            instead of DDP (buffers stay identical on every rank), so a non-default value logs one line.
        zero_bucket_size_in_m, overlap_communication, enable_metadata_cache: no meaning here (the
            plan's collectives and the planned stage shapes); a non-default value logs one line.
        cpu_offload: ZeRO-Offload (optimizer state on the host, as ``LowLevelZeroPlugin``): needs
            ``zero_stage`` 1/2; with ``tp_size`` or ``pp_size`` > 1 ``NotImplementedError``; with
            ZeRO-2, fp16 or ``max_norm`` is a ``ValueError`` (the offloaded gradient shards are not
            ``.grad``: neither the scaler nor clipping sees them).
        communication_dtype: ``None`` or ``torch.float32``/``bfloat16``/``float16``: the dtype
            gradients are reduced in (``reduce_dtype``).
        custom_policy: a Shardformer policy; anything but None raises ``NotImplementedError``.
        pp_style: ``"1f1b"``, ``"interleaved"`` (``num_model_chunks=2``) or ``"zbv"`` (zero bubble, 2
            chunks): the pipeline planner's and runtime's schedules of those names.
        num_model_chunks: model chunks per pipeline rank: 1 for 1f1b, 2 for interleaved/zbv.
    """

    def __init__(self, tp_size: int, pp_size: int, precision: str = "fp16", zero_stage: int = 0,
                 enable_all_optimization: bool = False, enable_fused_normalization: bool = False,
                 enable_flash_attention: bool = False, enable_jit_fused: bool = False,
                 enable_sequence_parallelism: bool = False, enable_sequence_overlap: bool = False,
                 parallel_output: bool = True, num_microbatches: int | None = None,
                 microbatch_size: int | None = None, initial_scale: float = 65536, min_scale: float = 1,
                 growth_factor: float = 2, backoff_factor: float = 0.5, growth_interval: int = 1000,
                 hysteresis: int = 2, max_scale: float = 4294967296, max_norm: float = 0,
                 broadcast_buffers: bool = True, ddp_bucket_cap_mb: int = 25, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 zero_bucket_size_in_m: int = 12, cpu_offload: bool = False, communication_dtype: Any = None,
                 overlap_communication: bool = True, custom_policy: Any = None, pp_style: str = "1f1b",
                 num_model_chunks: int = 1, enable_metadata_cache: bool = True, *, sp_size: int | None = None,
                 sequence_parallelism_mode: str | None = None) -> None:
        given = dict(locals())
        given.pop("self")
        given.pop("__class__", None)
        _check_sizes(given)
        sp_mode, sp_axis = _sequence_parallelism(given)
        _refuse_unsupported(given)
        _log_ignored(given)
        pipelined = pp_size > 1
        offload: Any = "none"
        if cpu_offload:
            from autopar.offload import OffloadPolicy

            offload = OffloadPolicy(offload_optim_frac=1.0)  # ZeRO-Offload, as LowLevelZeroPlugin
        reduce_dtype = None
        if communication_dtype is not None:
            name = str(communication_dtype).removeprefix("torch.")
            reduce_dtype = _DTYPE_NAMES.get(name, name)
            if reduce_dtype not in _DTYPE_NAMES.values():
                raise ValueError(f"communication_dtype must be None, torch.float32, torch.bfloat16 or torch.float16, "
                                 f"got {communication_dtype!r}")
        super().__init__(precision=precision, zero_stage=zero_stage, max_norm=max_norm, reduce_dtype=reduce_dtype,
                         offload=offload, initial_scale=initial_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         pp_size=pp_size if pipelined else None,
                         num_microbatches=num_microbatches if pipelined else None,
                         pp_style=pp_style if pipelined else "auto",
                         sequence_parallel=_SP_PINS[sp_mode] if sp_mode else "auto",
                         sp_size=(sp_axis if sp_axis > 1 else tp_size) if sp_mode else None)
        for name in ("tp_size", "microbatch_size", "parallel_output", "cpu_offload"):
            object.__setattr__(self, name, given[name])
        object.__setattr__(self, "sequence_parallelism_mode", sp_mode)
        object.__setattr__(self, "hybrid_sp_size", sp_axis)  # the sp axis (1: none)
        object.__setattr__(self, "hybrid_pp_size", pp_size)
        world = _world_size()
        if world is not None:  # a launched process group: the sizes must tile it (else at boost)
            self.layout(world)

    def __repr__(self) -> str:
        return (f"HybridParallelPlugin(tp_size={self.tp_size}, pp_size={self.hybrid_pp_size}, "
                + (f"sp_size={self.sp_size}, sequence_parallelism_mode={self.sequence_parallelism_mode!r}, "
                   if self.sequence_parallelism_mode else "")
                + f"zero_stage={self.zero_stage}, precision={self.precision!r})")

    def layout(self, world: int):
        """The mesh (pp, dp, tp) and family this plugin plans on ``world`` devices
        (``autopar.planner.baselines.hybrid_layout``); ``ValueError`` naming ``tp_size`` when the
        sizes do not divide ``world``."""
        from autopar.planner.baselines import hybrid_layout

        sp = self.hybrid_sp_size
        if world % (self.tp_size * self.hybrid_pp_size * sp):
            raise ValueError(f"tp_size={self.tp_size} (x pp_size={self.hybrid_pp_size}"
                             + (f" x sp_size={sp}" if sp > 1 else "") + f") does not divide the world size {world}")
        return hybrid_layout(world, tp_size=self.tp_size, pp_size=self.hybrid_pp_size,
                             zero_stage=self.zero_stage, experts=(self.ep_size or 1) > 1, sp_size=sp)

    def data_parallel_size(self) -> int:
        """``world / (tp_size * pp_size * sp_size)``: the ranks ``prepare_dataloader``'s
        ``batch_size`` is per (the sequence ranks read the same batch)."""
        world = _world_size() or 1
        return world // (self.tp_size * self.hybrid_pp_size * self.hybrid_sp_size) or 1

    # ------------------------------------------------------------------------------ plan
    def family_plan(self, model: Any, meta_inputs: tuple | dict):
        """The restricted plan of ``model``: every rank checks the sizes against the world and the
        model (before any collective), rank 0 solves, every rank receives the ``Plan``."""
        import torch.distributed as dist

        from autopar.runtime.build import runtime_device

        layout = self.layout(dist.get_world_size())
        microbatches = self._microbatches(model, meta_inputs) if layout.pipeline else None
        device = runtime_device(self.device)
        return plan_on_rank0(lambda: self._solve(model, meta_inputs, layout, microbatches, device), device=device,
                             what=f"HybridParallelPlugin: planning mesh {layout.shape} ({'x'.join(layout.axis_names)}),"
                                  f" family {layout.family!r}")

    def _microbatches(self, model: Any, meta_inputs: tuple | dict) -> int | str:
        """The micro-batch count (``"auto"``: the planner's), after checking the stage count
        against the model's repeated blocks."""
        from autopar.planner.pipeline.geometry import batch_size

        chunks = 1 if self.pp_style == "1f1b" else 2
        blocks = _repeated_blocks(model)
        if self.hybrid_pp_size * chunks > blocks:
            raise ValueError(f"pp_size={self.hybrid_pp_size}" + (f" x num_model_chunks={chunks}" if chunks > 1 else "")
                             + f" stages need as many repeated blocks; {type(model).__name__} has {blocks}")
        batch = batch_size(meta_inputs)
        if self.num_microbatches is not None:
            if batch % self.num_microbatches:
                raise ValueError(f"num_microbatches={self.num_microbatches} does not divide the global batch {batch}")
            return self.num_microbatches
        if self.microbatch_size is not None:
            if batch % self.microbatch_size:
                raise ValueError(f"microbatch_size={self.microbatch_size} does not divide the global batch {batch}")
            return batch // self.microbatch_size
        return "auto"

    def _solve(self, model: Any, meta_inputs: tuple | dict, layout, microbatches, device):
        from autopar.layout.mesh import MeshSpec
        from autopar.planner.options import PlanOptions
        from autopar.planner.orchestrate import plan_family, plan_pipelined
        from autopar.runtime.build import mesh_preset

        preset = mesh_preset(device)
        mesh = MeshSpec.preset(preset, layout.shape, axis_names=layout.axis_names)
        staged = layout.family.startswith("zero")  # a ZeRO family picks among the problem's stages
        options = PlanOptions(precision=self.precision, zero_stage="auto" if staged else 0,
                              reduce_dtype=self.reduce_dtype or "fp32", checkpoint="none",
                              optimizer_multiplier=self.optimizer_multiplier, preset=preset, solver=self.solver,
                              offload=self.offload, ep_size=self.ep_size,
                              sequence_parallel=self.sequence_parallel, sp_size=self.sp_size,
                              **({} if self.time_limit is None else {"time_limit": self.time_limit}))
        if layout.pipeline is None:
            return plan_family(model, meta_inputs, layout.family, mesh=mesh, options=options)
        from dataclasses import replace

        # The stages run ZeRO-1 when asked (every parameter at stage 1 over the stage's replicas).
        options = replace(options, zero_stage=1 if self.zero_stage == 1 else 0, pipeline=layout.pipeline,
                          microbatches=microbatches, schedule=self.schedule())
        return plan_pipelined(model, meta_inputs, mesh=mesh, options=options, family=layout.family).plan


def _check_sizes(given: dict[str, Any]) -> None:
    """The sizes and choices, each a ``ValueError`` naming the argument and its value."""
    for name in ("tp_size", "pp_size"):
        check_count(given[name], name=name)
    check_count(given["num_microbatches"], name="num_microbatches", words=(None,))
    check_count(given["microbatch_size"], name="microbatch_size", words=(None,))
    check_count(given["num_model_chunks"], name="num_model_chunks")
    check_choice(given["zero_stage"], (0, 1, 2), name="zero_stage")
    check_choice(given["pp_style"], _STYLES, name="pp_style")
    for name in ("parallel_output", "cpu_offload", "enable_sequence_parallelism", "enable_sequence_overlap",
                 *(n for n in _IGNORED if isinstance(HYBRID_PARALLEL_PARAMETERS[n], bool))):
        check_choice(given[name], (True, False), name=name)
    pipelined = given["pp_size"] > 1
    if pipelined and given["zero_stage"] == 2:
        raise ValueError("zero_stage=2 does not compose with a pipeline (pp_size="
                         f"{given['pp_size']}): gradients accumulate over the micro-batches before the data-parallel "
                         f"sum; use zero_stage=1 or 0")
    if given["cpu_offload"] and given["zero_stage"] == 0:
        raise ValueError("cpu_offload=True offloads ZeRO's optimizer state: give zero_stage=1 or 2")
    if given["cpu_offload"] and given["zero_stage"] == 2 and (given["precision"] == "fp16" or given["max_norm"]):
        # ZeRO-2 in host chunks keeps the gradients as chunk shards, which the scaler and clipping cannot see.
        raise ValueError(f"precision={given['precision']!r}, max_norm={given['max_norm']!r} with cpu_offload=True and "
                         f"zero_stage=2: fp16 loss scaling and clipping cannot see ZeRO-2's offloaded gradient shards; "
                         f"use precision='bf16'/'fp32' and max_norm=0, or zero_stage=1")
    chunks, style = given["num_model_chunks"], given["pp_style"]
    if pipelined and style == "1f1b" and chunks != 1:
        raise ValueError(f"num_model_chunks={chunks} with pp_style='1f1b': 1f1b runs one chunk per rank; use "
                         f"pp_style='interleaved' for 2")
    if pipelined and style != "1f1b" and chunks == 1:
        raise ValueError(f"pp_style={style!r} runs several model chunks per rank: give num_model_chunks=2, got 1")


def _sequence_parallelism(given: dict[str, Any]) -> tuple[str | None, int]:
    """(the sequence-parallel mode or None, the size of its own sp axis, 1 when none); a
    ``ValueError`` naming the argument and its value for a combination the product refuses too."""
    sp_size, mode = given["sp_size"], given["sequence_parallelism_mode"]
    check_count(sp_size, name="sp_size", words=(None,))
    if not given["enable_sequence_parallelism"]:
        if sp_size not in (None, 1) or mode is not None:
            raise ValueError(f"sp_size={sp_size!r}, sequence_parallelism_mode={mode!r} need "
                             f"enable_sequence_parallelism=True")
        return None, 1
    mode = check_choice("all_to_all" if mode is None else mode, SP_MODES, name="sequence_parallelism_mode")
    if mode in ("split_gather", "ring"):
        if given["tp_size"] == 1:
            raise ValueError(f"sequence_parallelism_mode={mode!r} splits the sequence over the tensor-parallel ranks: "
                             f"give tp_size > 1 (got tp_size=1), or use 'all_to_all' / 'ring_attn' with sp_size")
        if sp_size not in (None, 1, given["tp_size"]):
            log.info("HybridParallelPlugin: sp_size=%s is ignored with sequence_parallelism_mode=%r: the sequence "
                     "splits over the tp_size=%s tensor-parallel ranks", sp_size, mode, given["tp_size"])
        return mode, 1
    if sp_size in (None, 1):
        raise ValueError(f"sequence_parallelism_mode={mode!r} splits the sequence over an sp axis of sp_size ranks: "
                         f"give sp_size > 1 (got sp_size={sp_size!r})")
    return mode, sp_size


def _refuse_unsupported(given: dict[str, Any]) -> None:
    """Arguments whose effect autopar does not reproduce: ``NotImplementedError`` naming them."""
    refused = [f"{name}={given[name]!r}" for name in (*_SCALER_BOUNDS, "custom_policy")
               if given[name] != HYBRID_PARALLEL_PARAMETERS[name]]
    if given["enable_sequence_parallelism"] and given["pp_size"] > 1:
        refused.append(f"enable_sequence_parallelism=True with pp_size={given['pp_size']} (the pipeline planner does "
                       f"not pin sequence parallelism in its stages yet)")
    if given["pp_size"] > 1 and given["pp_style"] != "1f1b" and given["num_model_chunks"] > 2:
        refused.append(f"num_model_chunks={given['num_model_chunks']} (the pipeline planner plans 2 chunks per rank)")
    if given["cpu_offload"] and (given["tp_size"] > 1 or given["pp_size"] > 1):
        refused.append(f"cpu_offload=True with tp_size={given['tp_size']}, pp_size={given['pp_size']} "
                       f"(ZeRO-Offload runs data parallel only)")
    if refused:
        raise NotImplementedError(f"HybridParallelPlugin: {', '.join(refused)} not supported by autopar (its fp16 "
                                  f"scaler has no min/max scale or hysteresis; layouts come from its planner, not a "
                                  f"Shardformer policy)")


def _log_ignored(given: dict[str, Any]) -> None:
    ignored = [f"{name}={given[name]!r}" for name in _IGNORED if given[name] != HYBRID_PARALLEL_PARAMETERS[name]]
    if given["enable_sequence_overlap"]:
        ignored.append("enable_sequence_overlap=True (it overlaps split_gather's all-gather with the matmul: a "
                       "schedule, the same values)")
    if given["pp_size"] == 1:
        ignored += [f"{name}={given[name]!r}" for name in ("num_microbatches", "microbatch_size", "pp_style",
                                                           "num_model_chunks")
                    if given[name] != HYBRID_PARALLEL_PARAMETERS[name]]
    elif given["num_microbatches"] is not None and given["microbatch_size"] is not None:
        ignored.append(f"microbatch_size={given['microbatch_size']!r} (num_microbatches is given)")
    if ignored:
        log.info("HybridParallelPlugin: %s have no meaning in autopar (the plan's kernels and collectives run as "
                 "planned); ignored", ", ".join(ignored))


def _world_size() -> int | None:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else None


def _repeated_blocks(model: Any) -> int:
    """The most block indices under one module prefix (``transformer.h``: GPT-2's layers), as the
    pipeline planner counts its cut points, read from the module names on every rank."""
    from autopar.layout.blocks import split_block

    seen: dict[str, set[int]] = {}
    for name, _ in model.named_modules():
        found = split_block(name)
        if found is not None:
            seen.setdefault(found[0], set()).add(found[1])
    return max((len(v) for v in seen.values()), default=0)
