"""``TorchDDPPlugin`` and ``TorchFSDPPlugin``: the product notes' fixed data-parallel plugins on torch's own engines.

``TorchDDPPlugin`` wraps the model in ``torch.nn.parallel.DistributedDataParallel``;
``TorchFSDPPlugin`` shards it with FSDP2 (``torch.distributed.fsdp.fully_shard``) over a 1-D
``DeviceMesh`` of the world (CPU under gloo, CUDA under NCCL). No plan is solved: the Booster
takes a per-plugin path (``plugin.boost``) and gets back a :class:`TorchParallelModule`, which
satisfies the ``ParallelModule`` protocol the rest of the booster is typed against (optimizer,
gradient clipping through the one ``clip_grad_norm``, full state for ``save_model``/``load_model``).
Its ``plan`` is ``None``: a fixed torch engine has no ``Plan``.

Each documented constructor argument (the product notes' Booster API reference: positional
order and defaults as there) is honoured, mapped to its torch equivalent (said in the
class docstring), logged once as ignored when it has no meaning here, or refused with
``NotImplementedError`` when it would change training and FSDP2 cannot do it.
"""

from __future__ import annotations

import contextlib
import logging
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from autopar.booster.optimizer import BoostedOptimizer, rebuild_optimizer, repoint_scheduler
from autopar.runtime.parallel_module import clip_grad_norm

__all__ = ["TorchDDPPlugin", "TorchFSDPPlugin", "TorchParallelModule", "Autocast", "per_rank_batch_norms"]

log = logging.getLogger(__name__)


def _device_type() -> str:
    return "cuda" if dist.is_initialized() and dist.get_backend() == "nccl" else "cpu"


def _require_dist(plugin: str) -> None:
    if not dist.is_initialized():
        raise RuntimeError(f"{plugin} needs torch.distributed.init_process_group first (every rank boosts)")


class TorchParallelModule(nn.Module):
    """The boosted model of a torch plugin: ``engine`` (the DDP wrapper, or the FSDP2-sharded
    model itself) called as the model was, plus the ``ParallelModule`` surface over ``model``'s
    original names. ``plan`` is None (no planned layouts); ZeRO hooks are empty."""

    plan = None

    def __init__(self, engine: nn.Module, *, model: nn.Module, mesh: Any, autocast: torch.dtype | None = None) -> None:
        super().__init__()
        self.engine = engine
        self.autocast = autocast  # the Booster's mixed_precision: forward under torch.autocast
        # ``model`` is ``engine`` for FSDP2 (sharded in place) and DDP's ``.module``: held
        # outside the module tree so it is not registered twice.
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_mesh", mesh)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.autocast is None:
            return self.engine(*args, **kwargs)
        with torch.autocast(_device_type(), dtype=self.autocast):
            return self.engine(*args, **kwargs)

    @property
    def device_mesh(self) -> Any:
        return self._mesh

    @property
    def model(self) -> nn.Module:
        """The user's model (sharded in place under FSDP2)."""
        return self._model

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation without the data-parallel reduction (DDP's ``no_sync``; FSDP2's
        ``set_requires_gradient_sync(False)``): the backward after leaving it reduces the sum."""
        if isinstance(self.engine, nn.parallel.DistributedDataParallel):
            with self.engine.no_sync():
                yield
            return
        self.engine.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.engine.set_requires_gradient_sync(True)

    # ---------------------------------------------------------------- optimizer and clipping
    def parameters_by_fqn(self) -> dict[str, nn.Parameter]:
        return dict(self._model.named_parameters(remove_duplicate=False))

    def optimizer(self, optimizer_class: type, /, params: Iterable | None = None, **kwargs: Any) -> Any:
        return optimizer_class(list(self._model.parameters()) if params is None else params, **kwargs)

    def zero_parameters(self) -> list:
        return []  # the engine shards (FSDP2) or replicates (DDP); no autopar ZeRO pieces

    def attach_zero(self, optimizer: Any) -> None:
        raise ValueError("a torch plugin's module has no autopar ZeRO pieces")

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        parameters: Iterable[torch.Tensor] | None = None) -> torch.Tensor:
        # DDP's gradients are all-reduced, so equal on every rank; FSDP2's are DTensor shards,
        # whose norm ``clip_grad_norm`` reduces over the mesh. One implementation serves both.
        params = list(self._model.parameters() if parameters is None else parameters)
        return clip_grad_norm(params, max_norm, norm_type, device=_device(params))

    # ------------------------------------------------------------------------ full state
    def _groups(self) -> list[tuple[tuple[str, ...], torch.Tensor]]:
        """(every state-dict name of one tensor, the tensor): tied weights grouped, persistent
        buffers included."""
        by_id: dict[int, tuple[list[str], torch.Tensor]] = {}
        for name, value in self._model.state_dict(keep_vars=True).items():
            by_id.setdefault(id(value), ([], value))[0].append(name)
        return [(tuple(names), value) for names, value in by_id.values()]

    def full_state_entries(self) -> list[tuple[tuple[str, ...], torch.Size, torch.dtype]]:
        return [(names, value.shape, value.dtype) for names, value in self._groups()]

    def full_state_items(self) -> Iterator[tuple[tuple[str, ...], torch.Tensor]]:
        for names, value in self._groups():
            yield names, _full(value)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {name: value for names, value in self.full_state_items() for name in names}

    def full_gradients(self) -> dict[str, torch.Tensor | None]:
        return {name: None if p.grad is None else _full(p.grad)
                for name, p in self._model.named_parameters(remove_duplicate=False)}

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> None:
        known: set[str] = set()
        missing = []
        for names, target in self._groups():
            known.update(names)
            # A tied weight is complete under any of its names (HF writes it once).
            value = next((state_dict[n] for n in names if n in state_dict), None)
            if value is None:
                missing.append(names[0])
                continue
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(f"{names[0]}: checkpoint shape {list(value.shape)}, model {list(target.shape)}")
            if isinstance(target, DTensor):
                piece = distribute_tensor(value.to(target.dtype), target.device_mesh, target.placements)
                target.to_local().copy_(piece.to_local())
            else:
                target.copy_(value)
        unexpected = sorted(set(state_dict) - known)
        if strict and (missing or unexpected):
            raise ValueError(f"load_model(strict=True): missing {missing}, unexpected {unexpected}")


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor().detach() if isinstance(value, DTensor) else value.detach().clone()


def _device(params: list[torch.Tensor]) -> torch.device | str:
    return params[0].device if params else _device_type()


class _TorchPlugin:
    """What the Booster asks of a torch plugin: ``boost`` and ``prepare_dataloader``."""

    name = ""
    # The fields code asking any plugin for its precision and clipping reads (AutoParallelPlugin
    # has them): torch plugins compute in the model's dtype (FSDP2's mixed precision is its own
    # policy, inside the engine), own no loss scaler and clip only when asked
    # (``optimizer.clip_grad_by_norm``).
    precision = "fp32"
    max_norm = 0.0

    def wrap(self, model: nn.Module) -> TorchParallelModule:
        raise NotImplementedError

    def boost(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, criterion: Callable | None,
              dataloader: Any, lr_scheduler: Any, *, autocast: torch.dtype | None = None,
              loss_scale: Any = None) -> tuple:
        """``Booster.boost`` for this plugin: the model wrapped by the engine, the optimizer rebuilt
        over the engine's parameters (FSDP2 replaces them with DTensors; param groups and
        hyper-parameters kept by name, state not carried) in a ``BoostedOptimizer``, the
        scheduler re-pointed at it; ``dataloader`` as it is. ``autocast`` (the Booster's
        ``mixed_precision``): forward and ``criterion`` run under ``torch.autocast`` of that
        dtype; ``loss_scale`` (an ``FP16TorchMixedPrecision``, fp16 only) gives the optimizer a
        loss scaler of its settings."""
        _require_dist(type(self).__name__)
        _per_rank_statistics_notice(type(self).__name__, model)
        # Names before wrapping: FSDP2 swaps the Parameter objects the optimizer holds.
        before = list(model.named_parameters(remove_duplicate=False))
        module = self.wrap(model)
        module.autocast = autocast
        boosted = None
        if optimizer is not None:
            named = types.SimpleNamespace(named_parameters=lambda remove_duplicate=False: before)
            rebuilt = rebuild_optimizer(optimizer, named, module.parameters_by_fqn())
            scaler = None
            if loss_scale is not None:
                from autopar.runtime.amp import GradScaler

                scaler = GradScaler(_device_type(), **loss_scale.scaler_kwargs())
            boosted = BoostedOptimizer(rebuilt, module, scaler=scaler)
            if lr_scheduler is not None:
                repoint_scheduler(lr_scheduler, optimizer, rebuilt)
        if autocast is not None and criterion is not None:
            criterion = Autocast(criterion, autocast)
        return module, boosted, criterion, dataloader, lr_scheduler

    def prepare_dataloader(self, dataset: Any, batch_size: int, shuffle: bool = False, seed: int = 1024,
                           drop_last: bool = False, **kwargs: Any) -> Any:
        """A ``DataLoader`` whose rank ``r`` of ``W`` loads samples ``r::W`` of the (seeded)
        order in batches of ``batch_size`` -- the notes' per-data-parallel-rank batch, as torch's
        ``DistributedSampler`` gives it (``loader.sampler.set_epoch(e)`` reshuffles)."""
        from torch.utils.data import DataLoader, DistributedSampler

        sampler = DistributedSampler(dataset, num_replicas=dist.get_world_size(), rank=dist.get_rank(),
                                     shuffle=shuffle, seed=seed, drop_last=drop_last)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **kwargs)

    def prepare_train_dataloader(self, dataset: Any, batch_size: int, shuffle: bool = False, seed: int = 1024,
                                 drop_last: bool = False, **kwargs: Any) -> Any:
        """``prepare_dataloader`` under the name the notes' TorchFSDPPlugin example calls."""
        return self.prepare_dataloader(dataset, batch_size, shuffle, seed, drop_last, **kwargs)


def per_rank_batch_norms(model: nn.Module) -> list[str]:
    """The module paths of ``model``'s training-mode batch norms that torch's engines run on each
    rank's samples alone (every ``_BatchNorm`` but ``SyncBatchNorm``)."""
    return [name or type(m).__name__ for name, m in model.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm)
            and m.training]


def _per_rank_statistics_notice(plugin: str, model: nn.Module) -> None:
    """Say once, on rank 0, that torch's engines normalise each rank's share of the batch.

    DDP and FSDP2 run a training-mode ``BatchNorm`` on the rank's samples only, so its batch
    statistics (and running statistics) are not those of one device on the global batch:
    the training differs, as it does under torch itself. That is the engines' documented
    behaviour and the notes' plugins keep it; what a user comparing with one device needs is to
    know it, with the ways to the same training on autopar's plans (``AutoParallelPlugin(
    batch_norm_stats="per_rank")``: these statistics, exactly) or to one device's."""
    found = per_rank_batch_norms(model)
    if not found or (dist.is_initialized() and dist.get_rank() != 0):
        return
    shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    log.warning("%s: %s normalise each rank's share of the batch (torch's per-rank batch statistics), so "
                "training differs from one device on the global batch; AutoParallelPlugin keeps global "
                "statistics (and on CUDA torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) before boost does "
                "too), while AutoParallelPlugin(batch_norm_stats='per_rank') trains with these per-rank "
                "statistics on autopar's plans", plugin, shown)


@dataclass(frozen=True, slots=True)
class Autocast:
    """A criterion run under ``torch.autocast`` of ``dtype`` (torch AMP computes the loss there
    too: autocast keeps losses such as cross entropy in fp32)."""

    criterion: Callable
    dtype: torch.dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(_device_type(), dtype=self.dtype):
            return self.criterion(*args, **kwargs)


class TorchDDPPlugin(_TorchPlugin):
    """The notes' ``TorchDDPPlugin``: data parallelism with ``DistributedDataParallel``.

    Every argument is passed to ``DistributedDataParallel`` under the same name (positional order
    and defaults as the notes): ``broadcast_buffers`` (rank 0's buffers at each forward),
    ``bucket_cap_mb``, ``find_unused_parameters``, ``check_reduction`` (torch accepts it and
    ignores it, deprecated there), ``gradient_as_bucket_view``, ``static_graph``. The model is
    moved to the rank's device (CUDA under NCCL, else CPU) and DDP broadcasts rank 0's state at
    wrap time, so every rank starts equal.
    """

    name = "ddp"

    def __init__(self, broadcast_buffers: bool = True, bucket_cap_mb: int = 25, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False) -> None:
        for key, value in (("broadcast_buffers", broadcast_buffers), ("find_unused_parameters", find_unused_parameters),
                           ("check_reduction", check_reduction), ("gradient_as_bucket_view", gradient_as_bucket_view),
                           ("static_graph", static_graph)):
            if not isinstance(value, bool):
                raise ValueError(f"{key} must be a bool, got {value!r}")
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}")
        if check_reduction:
            log.info("TorchDDPPlugin: check_reduction is ignored (torch's DistributedDataParallel deprecated it "
                     "and no longer checks anything)")
        self.ddp_kwargs = {"broadcast_buffers": broadcast_buffers, "bucket_cap_mb": bucket_cap_mb,
                           "find_unused_parameters": find_unused_parameters, "check_reduction": check_reduction,
                           "gradient_as_bucket_view": gradient_as_bucket_view, "static_graph": static_graph}

    def __repr__(self) -> str:
        return f"TorchDDPPlugin({', '.join(f'{k}={v!r}' for k, v in self.ddp_kwargs.items())})"

    def wrap(self, model: nn.Module) -> TorchParallelModule:
        from torch.distributed.device_mesh import init_device_mesh

        device_type = _device_type()
        device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
        model = model.to(device)
        kwargs = dict(self.ddp_kwargs)
        if kwargs["broadcast_buffers"]:
            # DDP's default syncs buffers each forward; torch 2.13 deprecates saying so explicitly
            # (its replacement, ``forward_sync_buffers``, is absent from older torch).
            del kwargs["broadcast_buffers"]
        ddp = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device_type == "cuda" else None, **kwargs)
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
        return TorchParallelModule(ddp, model=model, mesh=mesh)


class TorchFSDPPlugin(_TorchPlugin):
    """The notes' ``TorchFSDPPlugin`` (FSDP1's arguments) on FSDP2's ``fully_shard``.

    Arguments, positional order and defaults as the notes:

    - ``process_group``: the group to shard over (``DeviceMesh.from_group``); None: the world.
    - ``sharding_strategy``: ``FULL_SHARD`` (and None) -> ``reshard_after_forward=True``;
      ``SHARD_GRAD_OP`` -> ``reshard_after_forward=False`` (parameters stay gathered between
      forward and backward). ``NO_SHARD`` and the hybrid strategies raise ``NotImplementedError``
      (FSDP2 expresses them only with a 2-D mesh this plugin does not build; use
      ``TorchDDPPlugin`` for no sharding).
    - ``cpu_offload``: ``CPUOffload(offload_params=True)`` -> ``CPUOffloadPolicy()`` (parameters,
      gradients and the optimizer step on the host); ``offload_params=False`` -> no offload.
    - ``auto_wrap_policy``: FSDP1's ``policy(module=, recurse=False, nonwrapped_numel=)`` is asked
      of every sub-module, children first; each it accepts gets its own ``fully_shard`` (its own
      all-gather unit, as an FSDP1 wrap); the root always gets one. A policy object that is not
      callable (``CustomPolicy``) names its modules through FSDP1's ``_run_policy``; per-module
      FSDP1 arguments it returns raise ``NotImplementedError`` (they would be dropped).
    - ``backward_prefetch``: logged as ignored: FSDP2 always prefetches the next all-gather in
      backward (what ``BACKWARD_PRE`` asks); the order of communication, not the result.
    - ``mixed_precision``: ``MixedPrecision(param_dtype, reduce_dtype, cast_forward_inputs)`` ->
      ``MixedPrecisionPolicy(param_dtype, reduce_dtype, cast_forward_inputs=...)``; a
      ``buffer_dtype`` or ``keep_low_precision_grads=True`` raises ``NotImplementedError``
      (FSDP2 keeps buffers and gradients in their own dtypes, so the result would differ).
    - ``ignored_modules``: their parameters are ``fully_shard``'s ``ignored_params`` (neither
      sharded nor reduced, as in FSDP1).
    - ``param_init_fn``: called with the model when it has parameters or buffers on ``meta``,
      before sharding (FSDP1 calls it per wrapped module; one call over the root initialises
      the same tensors).
    - ``sync_module_states``: rank 0's parameters and buffers are broadcast before sharding.
    """

    name = "fsdp"

    def __init__(self, process_group: Any = None, sharding_strategy: Any = None, cpu_offload: Any = None,
                 auto_wrap_policy: Callable | None = None, backward_prefetch: Any = None,
                 mixed_precision: Any = None, ignored_modules: Iterable[nn.Module] | None = None,
                 param_init_fn: Callable[[nn.Module], None] | None = None, sync_module_states: bool = False) -> None:
        from torch.distributed.fsdp import (BackwardPrefetch, CPUOffload, CPUOffloadPolicy, MixedPrecision,
                                            MixedPrecisionPolicy, OffloadPolicy, ShardingStrategy)

        if sharding_strategy is not None and not isinstance(sharding_strategy, ShardingStrategy):
            raise ValueError(f"sharding_strategy must be a torch.distributed.fsdp.ShardingStrategy, got "
                             f"{sharding_strategy!r}")
        if sharding_strategy in (None, ShardingStrategy.FULL_SHARD):
            reshard = True
        elif sharding_strategy is ShardingStrategy.SHARD_GRAD_OP:
            reshard = False
        else:
            raise NotImplementedError(f"TorchFSDPPlugin: sharding_strategy={sharding_strategy.name} is not built on "
                                      f"FSDP2 here (use TorchDDPPlugin for NO_SHARD)")
        if cpu_offload is not None and not isinstance(cpu_offload, CPUOffload):
            raise ValueError(f"cpu_offload must be a torch.distributed.fsdp.CPUOffload, got {cpu_offload!r}")
        # Pinned host memory only helps (and only exists) with a CUDA device to copy to.
        offload = (CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
                   if cpu_offload is not None and cpu_offload.offload_params else OffloadPolicy())
        if backward_prefetch is not None:
            if not isinstance(backward_prefetch, BackwardPrefetch):
                raise ValueError(f"backward_prefetch must be a BackwardPrefetch, got {backward_prefetch!r}")
            log.info("TorchFSDPPlugin: backward_prefetch=%s is ignored (FSDP2 always prefetches the next "
                     "all-gather in backward; it changes communication order, not results)", backward_prefetch.name)
        if mixed_precision is None:
            mp = MixedPrecisionPolicy()
        elif not isinstance(mixed_precision, MixedPrecision):
            raise ValueError(f"mixed_precision must be a torch.distributed.fsdp.MixedPrecision, got "
                             f"{mixed_precision!r}")
        else:
            if mixed_precision.buffer_dtype is not None:
                raise NotImplementedError("TorchFSDPPlugin: mixed_precision.buffer_dtype (FSDP2 does not cast buffers)")
            if mixed_precision.keep_low_precision_grads:
                raise NotImplementedError("TorchFSDPPlugin: mixed_precision.keep_low_precision_grads (FSDP2 "
                                          "gives gradients in the parameters' dtype)")
            mp = MixedPrecisionPolicy(param_dtype=mixed_precision.param_dtype,
                                      reduce_dtype=mixed_precision.reduce_dtype,
                                      cast_forward_inputs=mixed_precision.cast_forward_inputs
                                      or mixed_precision.cast_root_forward_inputs)
        for key, fn in (("auto_wrap_policy", auto_wrap_policy), ("param_init_fn", param_init_fn)):
            if fn is not None and not callable(fn) and not (key == "auto_wrap_policy" and _policy_object(fn)):
                raise ValueError(f"{key} must be callable, got {fn!r}")
        if not isinstance(sync_module_states, bool):
            raise ValueError(f"sync_module_states must be a bool, got {sync_module_states!r}")
        self.process_group = process_group
        self.sharding_strategy = sharding_strategy
        self.cpu_offload = cpu_offload
        self.auto_wrap_policy = auto_wrap_policy
        self.backward_prefetch = backward_prefetch
        self.mixed_precision = mixed_precision
        self.ignored_modules = None if ignored_modules is None else list(ignored_modules)
        self.param_init_fn = param_init_fn
        self.sync_module_states = sync_module_states
        self.fsdp_kwargs = {"reshard_after_forward": reshard, "mp_policy": mp, "offload_policy": offload}

    def __repr__(self) -> str:
        return (f"TorchFSDPPlugin(sharding_strategy={self.sharding_strategy}, cpu_offload={self.cpu_offload}, "
                f"mixed_precision={self.mixed_precision}, sync_module_states={self.sync_module_states})")

    def _mesh(self) -> Any:
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        if self.process_group is not None:
            return DeviceMesh.from_group(self.process_group, _device_type())
        return init_device_mesh(_device_type(), (dist.get_world_size(),))

    def wrap(self, model: nn.Module) -> TorchParallelModule:
        from torch.distributed.fsdp import fully_shard

        mesh = self._mesh()
        if self.param_init_fn is not None and any(t.is_meta for t in (*model.parameters(), *model.buffers())):
            self.param_init_fn(model)
        if _device_type() == "cuda" and not isinstance(self.fsdp_kwargs["offload_policy"], _cpu_offload_policy()):
            model = model.to(torch.device("cuda", torch.cuda.current_device()))
        if self.sync_module_states:
            group = mesh.get_group()
            src = dist.get_global_rank(group, 0)
            with torch.no_grad():
                for t in (*model.parameters(), *model.buffers()):
                    dist.broadcast(t.data, src=src, group=group)
        ignored = set()
        for m in self.ignored_modules or ():
            ignored.update(m.parameters())
        kwargs = {**self.fsdp_kwargs, "mesh": mesh, "ignored_params": ignored or None}
        policy = self.auto_wrap_policy
        if policy is not None and not callable(policy):  # an FSDP1 ``_Policy`` object
            targets = policy._run_policy(model, set(self.ignored_modules or ()), {})
            extra = {type(m).__name__: kw for m, kw in targets.items() if kw}
            if extra:
                raise NotImplementedError(f"TorchFSDPPlugin: auto_wrap_policy's per-module FSDP1 arguments {extra}")
            chosen = {id(m) for m in targets}
            policy = lambda module, recurse, nonwrapped_numel: id(module) in chosen  # noqa: E731
        if policy is not None:
            done: set[int] = set(map(id, ignored))
            for sub in _children_first(model):
                if sub is model:
                    continue
                numel = sum(p.numel() for p in sub.parameters() if id(p) not in done)
                if numel and policy(module=sub, recurse=False, nonwrapped_numel=numel):
                    fully_shard(sub, **kwargs)
                    done.update(id(p) for p in sub.parameters())
        fully_shard(model, **kwargs)
        return TorchParallelModule(model, model=model, mesh=mesh)


def _policy_object(policy: Any) -> bool:
    from torch.distributed.fsdp.wrap import _Policy

    return isinstance(policy, _Policy)


def _cpu_offload_policy() -> type:
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy


def _children_first(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from _children_first(child)
    yield module
