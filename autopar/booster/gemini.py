"""``GeminiPlugin``: Colossal-AI's chunked ZeRO-3 with host offload, as a restricted autopar plan.

The plugin is an :class:`AutoParallelPlugin` whose plan is one of the planner's baseline
families (``autopar.planner.baselines``), solved by rank 0 on the boosted model with the same
costs as the auto plan and broadcast (``family_plan_on_rank0``): ``data-parallel`` (every mesh
axis data parallel, parameters replicated in the plan), whose parameters autopar's chunk runtime
(``autopar.runtime.gemini``) packs into chunks, shards over the data-parallel ranks -- the
leading ``shard_param_frac`` of them ZeRO-3 style, the rest ZeRO-2 (whole payload, sharded
optimizer state and gradient) -- places on the device or the host tier and steps. A fixed
configuration and the auto plan are thus the same kind of object (``Plan``):
``booster.boost(...)[0].plan``, printable by ``autopar inspect``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any

from autopar.booster.low_level_zero import family_plan_on_rank0
from autopar.booster.plugin import AutoParallelPlugin

__all__ = ["GeminiPlugin", "GEMINI_PARAMETERS"]

log = logging.getLogger(__name__)

# Colossal-AI's documented signature, in order, with its defaults.
GEMINI_PARAMETERS: dict[str, Any] = {
    "chunk_config_dict": None, "chunk_init_device": None, "placement_policy": "static",
    "enable_gradient_accumulation": False, "shard_param_frac": 1.0, "offload_optim_frac": 0.0,
    "offload_param_frac": 0.0, "warmup_non_model_data_ratio": 0.8, "steady_cuda_cap_ratio": 0.9,
    "precision": "fp16", "master_weights": True, "pin_memory": False, "force_outputs_fp32": False,
    "strict_ddp_mode": False, "search_range_m": 32, "hidden_dim": None, "min_chunk_size_m": 32, "memstats": None,
    "gpu_margin_mem_ratio": 0.0, "initial_scale": 65536, "min_scale": 1, "growth_factor": 2, "backoff_factor": 0.5,
    "growth_interval": 1000, "hysteresis": 2, "max_scale": 4294967296, "max_norm": 0.0, "norm_type": 2.0,
    "tp_size": 1, "extra_dp_size": 1, "enable_all_optimization": False, "enable_fused_normalization": False,
    "enable_flash_attention": False, "enable_sequence_parallelism": False, "enable_jit_fused": False,
    "enable_sequence_overlap": False, "verbose": False,
}
# Colossal-AI's old placement names, as its notes define them in static fractions.
_LEGACY = {"cuda": (1.0, 0.0, 0.0), "cpu": (1.0, 1.0, 1.0)}
_MI = 2**20
# Switches of CUDA kernels or of Shardformer's tensor-parallel layouts: the same math either way.
_KERNEL_SWITCHES = ("enable_all_optimization", "enable_fused_normalization", "enable_flash_attention",
                    "enable_jit_fused", "enable_sequence_parallelism", "enable_sequence_overlap")


class GeminiPlugin(AutoParallelPlugin):
    """Chunked ZeRO-3 with device/host placement (Colossal-AI's ``GeminiPlugin`` signature).

    Args:
        chunk_config_dict: ``None`` (searched), or ``{"chunk_size": n}`` (also keyed by the
            data-parallel size, ``{dp: {...}}``, as Colossal-AI writes it): chunks of ``n``
            elements (larger where one parameter is); ``"keep_gathered": True`` (unsharded
            chunks) is ``shard_param_frac=0``'s business and raises ``NotImplementedError``.
        chunk_init_device: no meaning here (chunks are built on their tier); logged, ignored.
        placement_policy: ``"static"`` (the fractions below) or ``"auto"`` (every chunk sharded;
            after a warm-up step the device keeps what fits in ``steady_cuda_cap_ratio`` of its
            memory, the rest lives on the host: ``autopar.runtime.gemini.AutoPolicy``). The old
            names ``"cuda"`` / ``"cpu"`` are the static fractions the notes equate them with.
        enable_gradient_accumulation: either value: gradients accumulate over backward passes
            until ``optimizer.zero_grad()`` (sharded chunks add each pass's reduce-scatter).
        shard_param_frac, offload_optim_frac, offload_param_frac: static placement's fractions
            (``AutoParallelPlugin``'s knobs, ``autopar.runtime.gemini.StaticPolicy``); ``"auto"``
            takes them at their defaults only. The chunks ``shard_param_frac`` leaves whole are
            ZeRO-2 (whole payload; fp32 master, moments and gradient sharded: the notes'
            "``shard_param_frac=0`` is equal to zero-2").
        warmup_non_model_data_ratio: no meaning here (the auto warm-up keeps every chunk on the
            host); logged when changed. ``steady_cuda_cap_ratio``: the auto policy's device budget
            is this fraction of the device's memory (a CPU device: of the host's).
        precision: ``"fp16"`` (loss-scaled), ``"bf16"`` or ``"fp32"`` compute; fp32 masters.
        master_weights: True only (fp32 masters in the chunks); False: ``NotImplementedError``.
        pin_memory: host chunks in pinned memory (CUDA).
        force_outputs_fp32: floating outputs of the boosted module cast to fp32.
        strict_ddp_mode: either value: the plan is data parallel only (no other parallelism).
        search_range_m, hidden_dim, min_chunk_size_m: the chunk size search: from
            ``min_chunk_size_m * 2**20`` elements to ``search_range_m * 2**20`` more, in steps of
            ``hidden_dim`` (1024 when None); a model under the minimum is one chunk of its size.
        memstats, gpu_margin_mem_ratio: no meaning here (the auto policy measures its own
            warm-up and gives optimizer state the device room that is left); logged when set.
        initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
            max_scale: the fp16 loss scaler's (``autopar.runtime.amp.GradScaler``, Colossal-AI's
            rule with hysteresis and bounds); the global overflow verdict covers chunk shards.
        max_norm, norm_type: clip by the global norm (0: no clipping) in ``optimizer.step()``,
            after unscaling, sharded chunks' gradient shards included.
        tp_size, extra_dp_size: 1 only; more raises ``NotImplementedError`` (the chunks shard
            over every data-parallel rank; no tensor-parallel or extra DDP group).
        enable_all_optimization, enable_fused_normalization, enable_flash_attention,
            enable_jit_fused, enable_sequence_parallelism, enable_sequence_overlap: CUDA kernel
            and Shardformer switches with no meaning for the traced ATen graph; logged, ignored.
        verbose: rank 0 prints the chunks (count, size, padding, sharded, tiers) once boosted.

    The chunks are made with the optimizer (``boost`` with one): a model boosted without an
    optimizer (inference) runs the plan's replicated parameters as they are.
    """

    def __init__(self, chunk_config_dict: dict | None = None, chunk_init_device: Any = None,
                 placement_policy: str = "static", enable_gradient_accumulation: bool = False,
                 shard_param_frac: float = 1.0, offload_optim_frac: float = 0.0, offload_param_frac: float = 0.0,
                 warmup_non_model_data_ratio: float = 0.8, steady_cuda_cap_ratio: float = 0.9,
                 precision: str = "fp16", master_weights: bool = True, pin_memory: bool = False,
                 force_outputs_fp32: bool = False, strict_ddp_mode: bool = False, search_range_m: int = 32,
                 hidden_dim: int | None = None, min_chunk_size_m: float = 32, memstats: Any = None,
                 gpu_margin_mem_ratio: float = 0.0, initial_scale: float = 65536, min_scale: float = 1,
                 growth_factor: float = 2, backoff_factor: float = 0.5, growth_interval: int = 1000,
                 hysteresis: int = 2, max_scale: float = 4294967296, max_norm: float = 0.0, norm_type: float = 2.0,
                 tp_size: int = 1, extra_dp_size: int = 1, enable_all_optimization: bool = False,
                 enable_fused_normalization: bool = False, enable_flash_attention: bool = False,
                 enable_sequence_parallelism: bool = False, enable_jit_fused: bool = False,
                 enable_sequence_overlap: bool = False, verbose: bool = False) -> None:
        arguments = locals()
        given = {name: arguments[name] for name in GEMINI_PARAMETERS}
        _check_flags(given)
        _refuse_unsupported(given)
        policy, fracs = _placement(placement_policy, shard_param_frac, offload_optim_frac, offload_param_frac)
        _check_ratios(given)
        chunk_range = _chunk_range(chunk_config_dict, search_range_m, hidden_dim, min_chunk_size_m)
        _log_ignored(given)
        super().__init__(precision=precision, max_norm=max_norm, norm_type=norm_type, initial_scale=initial_scale,
                         growth_factor=growth_factor, backoff_factor=backoff_factor, growth_interval=growth_interval,
                         min_scale=min_scale, max_scale=max_scale, hysteresis=hysteresis, placement_policy=policy,
                         shard_param_frac=fracs[0] if policy == "static" else 0.0, offload_optim_frac=fracs[1],
                         offload_param_frac=fracs[2], pin_memory=pin_memory, chunk_search_range=chunk_range)
        object.__setattr__(self, "gemini_settings", given)  # the arguments as given

    def __repr__(self) -> str:
        return (f"GeminiPlugin(placement_policy={self.placement_policy!r}, shard_param_frac={self.shard_param_frac}, "
                f"offload_optim_frac={self.offload_optim_frac}, offload_param_frac={self.offload_param_frac}, "
                f"precision={self.precision!r})")

    @property
    def family(self) -> str:
        """The planner's baseline family this plugin's plan is (``autopar.planner.baselines``)."""
        return "data-parallel"

    def family_plan(self, model: Any, meta_inputs: tuple | dict):
        """The family's plan of ``model`` on a 1-D mesh over the world (rank 0 solves, all get it)."""
        return family_plan_on_rank0(self, model, meta_inputs, self.family, name="GeminiPlugin")

    def gemini_policy(self, device, plan=None):
        """The chunk runtime's policy; ``"auto"``: sharded chunks within ``steady_cuda_cap_ratio``
        of the device's memory."""
        if self.placement_policy != "auto":  # Gemini's chunks are ZeRO-3 (sharded) or ZeRO-2 (the rest)
            return dataclasses.replace(super().gemini_policy(device, plan), unsharded_zero=2)
        from autopar.runtime.gemini.policies import AutoPolicy

        budget = math.floor(_device_memory(device) * self.gemini_settings["steady_cuda_cap_ratio"])
        return AutoPolicy(device_budget=max(budget, 1), pin_memory=self.pin_memory, sharded=True)

    def wrap_gemini(self, module, optimizer_class: type, groups: list, kwargs: dict):
        optimizer = super().wrap_gemini(module, optimizer_class, groups, kwargs)
        if self.gemini_settings["force_outputs_fp32"]:
            module.forward = _fp32_outputs(module.forward)
        if self.gemini_settings["verbose"] and _rank() == 0:
            print(f"[autopar] GeminiPlugin: {_describe(module.gemini.manager.chunks)}", flush=True)
        return optimizer


def _check_flags(given: dict) -> None:
    flags = ("enable_gradient_accumulation", "master_weights", "pin_memory", "force_outputs_fp32",
             "strict_ddp_mode", "verbose", *_KERNEL_SWITCHES)
    for name in flags:
        if not isinstance(given[name], bool):
            raise ValueError(f"{name} must be a bool, got {given[name]!r}")
    for name in ("tp_size", "extra_dp_size"):
        if isinstance(given[name], bool) or not isinstance(given[name], int) or given[name] < 1:
            raise ValueError(f"{name} must be an int >= 1, got {given[name]!r}")


def _refuse_unsupported(given: dict) -> None:
    """Arguments whose non-default value would change what trains (or where) if ignored."""
    if not given["master_weights"]:
        raise NotImplementedError("GeminiPlugin: master_weights=False is not supported by autopar (the chunks "
                                  "keep fp32 master weights)")
    for name in ("tp_size", "extra_dp_size"):
        if given[name] != 1:
            raise NotImplementedError(f"GeminiPlugin: {name}={given[name]!r} is not supported by autopar (its chunks "
                                      f"shard over every data-parallel rank; use AutoParallelPlugin for tensor "
                                      f"parallelism)")


def _placement(policy: Any, shard: Any, optim: Any, param: Any) -> tuple[str, tuple[float, float, float]]:
    from autopar.offload import fraction

    if policy not in ("static", "auto", *_LEGACY):
        raise ValueError(f"placement_policy must be 'static' or 'auto' (or the old 'cuda' / 'cpu'), got {policy!r}")
    fracs = tuple(fraction(v, n) for v, n in ((shard, "shard_param_frac"), (optim, "offload_optim_frac"),
                                               (param, "offload_param_frac")))
    defaults = (1.0, 0.0, 0.0)
    if policy in _LEGACY:
        if fracs != defaults:
            raise ValueError(f"placement_policy={policy!r} is the static fractions {_LEGACY[policy]} "
                             f"(shard, offload_optim, offload_param); got {fracs} too: use 'static' with them")
        return "static", _LEGACY[policy]
    if policy == "auto" and fracs != defaults:
        raise ValueError(f"shard_param_frac, offload_optim_frac and offload_param_frac are for "
                         f"placement_policy='static'; 'auto' places chunks by its warm-up, got {fracs}")
    return policy, fracs


def _check_ratios(given: dict) -> None:
    from autopar.planner.options import check_number

    check_number(given["warmup_non_model_data_ratio"], name="warmup_non_model_data_ratio", low=0, high=1)
    check_number(given["steady_cuda_cap_ratio"], name="steady_cuda_cap_ratio", low=0, high=1, low_open=True)
    check_number(given["gpu_margin_mem_ratio"], name="gpu_margin_mem_ratio", low=0, high=1)


def _chunk_range(config: Any, search_range_m: Any, hidden_dim: Any, min_chunk_size_m: Any) -> tuple[int, int, int]:
    """(min, max, step) elements of the chunk size search (``AutoParallelPlugin.chunk_search_range``)."""
    from autopar.planner.options import check_number

    check_number(search_range_m, name="search_range_m", low=0)
    check_number(min_chunk_size_m, name="min_chunk_size_m", low=0, low_open=True)
    if hidden_dim is not None and (isinstance(hidden_dim, bool) or not isinstance(hidden_dim, int) or hidden_dim < 1):
        raise ValueError(f"hidden_dim must be None or an int >= 1, got {hidden_dim!r}")
    if config is not None:
        size = _configured_chunk_size(config)
        return size, size, 1
    low = max(1, math.ceil(min_chunk_size_m * _MI))
    return low, low + math.floor(search_range_m * _MI), hidden_dim or 1024


def _configured_chunk_size(config: Any) -> int:
    if not isinstance(config, dict):
        raise ValueError(f"chunk_config_dict must be None or a dict such as {{'chunk_size': 1024}}, got {config!r}")
    inner = [v for v in config.values() if isinstance(v, dict)]
    if inner and len(inner) == len(config):  # {dp_size: {...}}: every entry alike here (one data-parallel world)
        if any(v != inner[0] for v in inner):
            raise NotImplementedError(f"chunk_config_dict with different entries per data-parallel size is not "
                                      f"supported by autopar, got {config!r}")
        config = inner[0]
    unknown = set(config) - {"chunk_size", "keep_gathered"}
    if unknown:
        raise NotImplementedError(f"chunk_config_dict keys {sorted(unknown)} are not supported by autopar "
                                  f"(it takes 'chunk_size')")
    if config.get("keep_gathered", False):
        raise NotImplementedError("chunk_config_dict keep_gathered=True is not supported by autopar: unsharded chunks "
                                  "are shard_param_frac's (the leading fraction of chunks is sharded)")
    size = config.get("chunk_size")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"chunk_config_dict['chunk_size'] must be an int >= 1 (elements), got {size!r}")
    return size


def _log_ignored(given: dict) -> None:
    if given["chunk_init_device"] is not None:
        import torch

        try:
            torch.device(given["chunk_init_device"])
        except (RuntimeError, TypeError):
            raise ValueError(f"chunk_init_device must be None or a torch device, got "
                             f"{given['chunk_init_device']!r}") from None
    ignored = [f"{name}={given[name]!r}" for name in ("chunk_init_device", "memstats", *_KERNEL_SWITCHES)
               if given[name] != GEMINI_PARAMETERS[name]]
    ignored += [f"{name}={given[name]!r}" for name in ("warmup_non_model_data_ratio", "gpu_margin_mem_ratio")
                if given[name] != GEMINI_PARAMETERS[name]]
    if ignored:
        log.info("GeminiPlugin: %s have no meaning in autopar (chunks are built on their tier, the traced ATen "
                 "graph runs no CUDA kernel switches, the auto policy measures its own warm-up); ignored",
                 ", ".join(ignored))


def _device_memory(device) -> int:
    """Bytes of memory of ``device``: a CUDA device's total, else the host's physical memory."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _fp32_outputs(forward):
    import functools

    import torch
    from torch.utils import _pytree as pytree

    def cast(x):
        return x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    @functools.wraps(forward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        if hasattr(out, "to_tuple") and hasattr(out, "keys"):  # a transformers ModelOutput: cast in place
            for key in list(out.keys()):
                out[key] = cast(out[key])
            return out
        return pytree.tree_map(cast, out)

    return wrapped


def _describe(chunks) -> str:
    sharded = sum(c.sharded for c in chunks)
    host = sum(c.home == "host" for c in chunks)
    host_optim = sum(c.optim_tier == "host" for c in chunks)
    sizes = sorted({c.capacity for c in chunks})
    return (f"{len(chunks)} chunks (capacity {sizes[:4]} elements), {sharded} sharded, {host} with their payload "
            f"and {host_optim} with their optimizer state on the host")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
