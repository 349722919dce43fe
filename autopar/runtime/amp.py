"""Dynamic loss scaling for fp16 mixed precision whose overflow verdict is global.

:class:`GradScaler` is ``torch.amp.GradScaler`` with two changes, both in ``_unscale_grads_``
(the one place torch's scaler reads gradients, used by ``unscale_``, ``step`` and the
fused-optimizer path alike):

- It works on the LOCAL tensors of ``DTensor`` gradients (an ``AutoParallelModule``'s
  parameters are DTensors with Shard/Replicate placements): the inf/NaN check and the in-place
  unscale run on the local shards with torch's foreach kernel, one launch per (device, dtype),
  so neither DTensor dispatch nor a per-tensor collective happens. Plain tensors work as
  before; gradients that are ``None`` are skipped.
- One ``all_reduce(MAX)`` of the found-inf flag over ``process_group`` follows, and its result
  is written back into every per-device flag. An overflow in ONE rank's shard is therefore seen
  by every rank: ``step()`` skips the optimizer step everywhere and ``update()`` backs the scale
  off everywhere, so scales and parameters never diverge between ranks.

Gradients an optimizer keeps outside ``.grad`` are unscaled and checked too: an optimizer with
a ``sharded_grads()`` method (the chunk optimizer's sharded and ZeRO-2 chunks, whose gradient is
this rank's shard of a chunk) lists them there, and each rank checks its own shard -- the
global flag above is what makes the verdict the whole gradient's.

Colossal-AI's ``DynamicGradScaler`` rule is available through three more settings (their
defaults keep torch's rule exactly): ``hysteresis`` (an overflow backs the scale off only once
``hysteresis`` overflows have been seen since the last growth; every overflowed step is still
skipped), ``min_scale`` (backing off never goes below it) and ``max_scale`` (growing never goes
above it).

Every rank of ``process_group`` must call ``unscale_`` / ``step`` for each optimizer in the
same order (each call is one collective), also a rank whose gradients are all ``None``.
Parameters are expected to be fp32 master weights, as with torch's scaler: fp16 gradients are
refused by ``unscale_``.

Usage (``model`` an ``AutoParallelModule`` or any module; ``opt`` any ``torch.optim`` optimizer)::

    scaler = GradScaler("cpu", init_scale=2.0**16)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)      # skipped on every rank when any rank overflowed
    scaler.update()       # same new scale on every rank
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from torch.amp.grad_scaler import _refresh_per_optimizer_state

from autopar.runtime.dtensors import local_of

__all__ = ["GradScaler"]


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for DTensor (or plain) gradients with a global overflow check.

    Args:
        device: device type of the scale (``"cpu"`` or ``"cuda"``), as for torch's scaler.
        process_group: the group over which the found-inf flag is reduced; ``None`` means the
            default (world) group. Without an initialised default group and with
            ``process_group=None`` there is one process, and no collective is issued.
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as for
            ``torch.amp.GradScaler``.
        min_scale, max_scale: bounds of the scale when it backs off / grows (``None``: none).
        hysteresis: overflows (counted since the last growth) before the scale backs off; 1 is
            torch's rule (every overflow backs off).
    """

    def __init__(
        self,
        device: str = "cpu",
        *,
        process_group: dist.ProcessGroup | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        min_scale: float | None = None,
        max_scale: float | None = None,
        hysteresis: int = 1,
    ) -> None:
        # torch asserts on some of these only when enabled; bad input is bad input either way.
        if not isinstance(device, str):
            raise ValueError(f"device must be a device type string such as 'cpu' or 'cuda', got {device!r}")
        if not init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {init_scale!r}")
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1.0, got {growth_factor!r}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be an int >= 1, got {growth_interval!r}")
        for name, bound in (("min_scale", min_scale), ("max_scale", max_scale)):
            if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, float))
                                      or not bound > 0):
                raise ValueError(f"{name} must be None or a number > 0, got {bound!r}")
        if min_scale is not None and max_scale is not None and min_scale > max_scale:
            raise ValueError(f"min_scale={min_scale!r} must not exceed max_scale={max_scale!r}")
        if isinstance(hysteresis, bool) or not isinstance(hysteresis, int) or hysteresis < 1:
            raise ValueError(f"hysteresis must be an int >= 1, got {hysteresis!r}")
        self.min_scale, self.max_scale, self.hysteresis = min_scale, max_scale, hysteresis
        self._hysteresis_step = 0  # overflows since the last growth
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self.process_group = process_group

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        # Bucket local gradient tensors by (device, dtype): the foreach kernel takes one of each.
        buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    if not allow_fp16 and param.grad.dtype == torch.float16:
                        raise ValueError(
                            "Attempting to unscale FP16 gradients: keep fp32 master parameters "
                            f"(got a {param.grad.dtype} gradient of shape {list(param.grad.shape)})"
                        )
                    # The local tensor shares the DTensor gradient's storage, so unscaling it
                    # in place unscales the gradient itself.
                    local = local_of(param.grad)
                    if local.is_sparse:
                        if local is param.grad and local.dtype is torch.float16:
                            # Duplicate indices would be summed by the optimizer; overflow must
                            # be checked on the coalesced values (as torch's scaler does).
                            param.grad = param.grad.coalesce()
                            local = param.grad
                        local = local._values()
                    if local.numel() == 0:
                        continue  # an empty shard (uneven sharding): nothing to check
                    buckets[(local.device, local.dtype)].append(local)
            # Gradients kept outside .grad (chunk shards), this rank's share of them.
            outside = getattr(optimizer, "sharded_grads", None)
            for local in (outside() if outside is not None else ()):
                if not allow_fp16 and local.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients: keep fp32 master parameters "
                                     f"(got a {local.dtype} gradient shard of {local.numel()} elements)")
                if local.numel():
                    buckets[(local.device, local.dtype)].append(local)

            found_per_device: dict[torch.device, torch.Tensor] = {}
            inv_per_device: dict[torch.device, torch.Tensor] = {}
            for (device, _), grads in buckets.items():
                if device not in found_per_device:
                    found_per_device[device] = found_inf.to(device)
                    inv_per_device[device] = inv_scale.to(device)
                torch._amp_foreach_non_finite_check_and_unscale_(
                    grads, found_per_device[device], inv_per_device[device]
                )
            # A rank without gradients still takes part in the collective and reports a flag.
            if not found_per_device:
                found_per_device[found_inf.device] = found_inf
            self._reduce_found_inf(found_per_device)
        return found_per_device

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """torch's ``update``; with ``hysteresis`` > 1 or a scale bound, Colossal-AI's rule."""
        if not self._enabled or new_scale is not None or (
                self.hysteresis == 1 and self.min_scale is None and self.max_scale is None):
            super().update(new_scale)
            return
        scale, tracker = self._check_scale_growth_tracker("update")
        found = [f.to(scale.device) for state in self._per_optimizer_states.values()
                 for f in state["found_inf_per_device"].values()]
        if not found:
            raise RuntimeError("No inf checks were recorded prior to update.")
        # One host read per step: the hysteresis count is a Python int the rule branches on.
        if bool(torch.stack(found).sum().item()):
            tracker.zero_()
            self._hysteresis_step += 1
            if self._hysteresis_step >= self.hysteresis:
                scale.mul_(self._backoff_factor)
                if self.min_scale is not None:
                    scale.clamp_(min=self.min_scale)
        else:
            tracker.add_(1)
            if int(tracker.item()) >= self._growth_interval:
                tracker.zero_()
                self._hysteresis_step = 0
                scale.mul_(self._growth_factor)
                if self.max_scale is not None:
                    scale.clamp_(max=self.max_scale)
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if state:
            state["_hysteresis_step"] = self._hysteresis_step
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        self._hysteresis_step = int(state_dict.pop("_hysteresis_step", 0))
        super().load_state_dict(state_dict)

    def _reduce_found_inf(self, found_per_device: dict[torch.device, torch.Tensor]) -> None:
        """Replace every per-device flag by the maximum over all devices and all ranks."""
        if self.process_group is None and not (dist.is_available() and dist.is_initialized()):
            return  # one process: the local verdict is the global one
        device = self._collective_device()
        flags = [flag.reshape(()).to(device) for flag in found_per_device.values()]
        # One collective for all devices and dtypes: fold the flags locally first.
        verdict = torch.stack(flags).amax()
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=self.process_group)
        for flag in found_per_device.values():
            flag.copy_(verdict.reshape(flag.shape))

    def _collective_device(self) -> torch.device:
        """A device the group's backend can reduce on: the scale's if possible (no copy), else CPU."""
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        assert self._scale is not None, "the scale is created by scale() before any unscale"
        supported = {d.type for d in group._device_types}
        if self._scale.device.type in supported:
            return self._scale.device
        if "cpu" in supported:
            return torch.device("cpu")
        # e.g. an NCCL group with a CPU scale: reduce on this rank's current accelerator.
        kind = sorted(supported)[0]
        return torch.device(kind, getattr(torch, kind).current_device())

    def __getstate__(self) -> dict[str, Any]:
        # A process group belongs to this process and cannot be pickled; silently falling back
        # to the world group could reduce over the wrong ranks (a hang), so refuse instead.
        if self.process_group is not None:
            raise TypeError(
                f"cannot pickle or copy a GradScaler bound to process group {self.process_group!r}; "
                "set process_group=None first and restore it after loading"
            )
        return super().__getstate__()
