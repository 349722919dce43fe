"""``ParallelModule``: what every module the runtime returns offers, and gradient clipping for all of them.

``build_module`` returns an ``AutoParallelModule`` (one SPMD graph over the whole mesh) and
``build_pipeline`` a ``PipelineModule`` (this rank's stages of a pipeline). Their training
surface is the same protocol, so the Booster, checkpointing and ZeRO work against it and never
ask which kind they hold (where the plan matters, they read ``module.plan``):

- an optimizer over the module's parameters (ZeRO pieces in place of the parameters the plan
  shards): ``optimizer``; and the hooks ``autopar.runtime.zero.ZeroOptimizer`` builds on:
  ``zero_parameters`` (what to split) and ``attach_zero`` (where the pieces' gradients come from);
- gradient clipping by the global norm over every rank of the module: ``clip_grad_norm_``;
- full state on every rank (``full_state_dict``, ``full_gradients``, the streaming pair
  ``full_state_entries`` / ``full_state_items``), loading it back (``load_full_state_dict``),
  and parameters by original name (``parameters_by_fqn``, for rebuilding a user's optimizer).

:func:`clip_grad_norm` is the one clipping implementation: the modules' ``clip_grad_norm_`` and
the Booster's optimizer all call it.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.layout.placement import TensorSpec
from autopar.plans import Plan
from autopar.runtime.dtensors import local_of

__all__ = ["ParallelModule", "clip_grad_norm"]


@runtime_checkable
class ParallelModule(Protocol):
    """A module the runtime built from a plan (``AutoParallelModule``, ``PipelineModule``)."""

    plan: Plan

    @property
    def device_mesh(self) -> Any:
        """The torch ``DeviceMesh`` the module's DTensors live on (a pipeline: the full mesh)."""

    def parameters_by_fqn(self) -> dict[str, nn.Parameter]:
        """Original FQN (every tied alias) -> this rank's DTensor parameter."""

    def optimizer(self, optimizer_class: type, /, params: Iterable | None = None, **kwargs: Any) -> Any:
        """``optimizer_class`` over the parameters (``params``: None for all, or some of them or
        param-group dicts), ZeRO parameters replaced by this device's pieces."""

    def zero_parameters(self) -> list[tuple[str, nn.Parameter, int, TensorSpec]]:
        """(placeholder name, DTensor parameter, ZeRO stage, layout) of every parameter held, in plan order."""

    def attach_zero(self, optimizer: Any) -> None:
        """Called by the ZeRO optimizer once built: the module delivers its pieces' gradients."""

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        parameters: Iterable[torch.Tensor] | None = None) -> torch.Tensor:
        """Clip the gradients of ``parameters`` (default: all the module's) to the global norm
        ``max_norm`` over every rank; returns the norm before clipping. Every rank must call."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Original state-dict names -> full tensors, on every rank (a collective)."""

    def full_gradients(self) -> dict[str, torch.Tensor | None]:
        """Parameter FQN -> full gradient or None, on every rank (a collective)."""

    def full_state_entries(self) -> list[tuple[tuple[str, ...], torch.Size, torch.dtype]]:
        """(state-dict names, full shape, dtype) per tensor, tied weights once. No collective."""

    def full_state_items(self) -> Iterator[tuple[tuple[str, ...], torch.Tensor]]:
        """Each tensor gathered whole, one at a time, in ``full_state_entries`` order."""

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> None:
        """Slice full tensors into what this rank holds. No collective."""


def _total_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The ``norm_type`` norm of ``grads``, DTensors counted globally. DTensor and plain gradients
    can meet (FSDP2's ``ignored_params`` stay plain tensors) and torch's norm refuses the mix, so
    each kind is normed apart and the two combined."""
    parts = []
    for kind in ([g for g in grads if isinstance(g, DTensor)], [g for g in grads if not isinstance(g, DTensor)]):
        if kind:
            norm = torch.nn.utils.get_total_norm(kind, norm_type)
            parts.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if len(parts) == 1:
        return parts[0]
    stacked = torch.stack([p.to(parts[0].device) for p in parts])
    return stacked.max() if norm_type == float("inf") else torch.linalg.vector_norm(stacked, norm_type)


@torch.no_grad()
def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0, *,
                   counted: Iterable[torch.Tensor] | None = None, group: Any = None,
                   device: torch.device | str | None = None,
                   shards: Iterable[torch.Tensor] | None = None) -> torch.Tensor:
    """Clip the gradients of ``parameters`` in place to the global ``norm_type`` norm ``max_norm``
    and return the norm before clipping as a plain tensor, equal on every rank. Every rank must
    call. ``torch.nn.utils.clip_grad_norm_``'s formula: each gradient times ``min(1, max_norm /
    (norm + 1e-6))``.

    The norm is over the gradients of ``counted`` (default: ``parameters``). A DTensor gradient
    counts with its global value (torch's norm of DTensors reduces over their mesh), which is all
    one SPMD module needs. ``group``: a process group whose ranks hold DIFFERENT parameters (a
    pipeline's stages): the per-rank norms are combined over it in float64, so ``counted`` must
    hold each parameter on exactly one of those ranks (a tied weight's copies: one); ``device``
    is where a rank with nothing counted makes its zero norm for that collective.

    ``shards``: gradients kept outside ``.grad`` as plain local tensors of which every element is
    held by exactly one rank of the default group (the chunk optimizer's sharded chunks:
    ``GeminiOptimizer.sharded_grads``). Their ``norm_type`` powers are summed locally and
    all-reduced (max for the inf norm) in float64, combined with the norm of the rest, and they
    are scaled in place by the same coefficient. Given (even empty), it is one collective every
    rank must join.
    """
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"norm_type must be positive, got {norm_type}")
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in (params if counted is None else counted) if p.grad is not None]
    if grads:
        norm = _total_norm(grads, norm_type)
    else:
        norm = torch.zeros((), device=device)
    shards = None if shards is None else list(shards)  # read twice: its norm, then its scaling
    if shards is not None:
        norm = _with_shards(norm, shards, norm_type)
    if group is not None:
        norm = norm.to(torch.float64)
        if norm_type == float("inf"):
            dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        else:
            norm = norm ** norm_type
            dist.all_reduce(norm, group=group)
            norm = norm ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for local in [local_of(p.grad) for p in params] + list(shards or ()):
        local.mul_(coef.to(local.device))
    # Combined over a group or with shards, the norm was summed in float64 (parts of very
    # different sizes); it is returned as the float32 a single module's norm is.
    return norm if group is None and shards is None else norm.to(torch.float32)


def _with_shards(norm: torch.Tensor, shards: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """``norm`` (of the gradients every rank sees globally) combined with the ``norm_type`` norm
    of ``shards`` over every rank: the shards' powers summed here, all-reduced, then added to
    ``norm``'s power (the global norm of disjoint pieces), in float64."""
    inf = norm_type == float("inf")
    part = torch.zeros((), dtype=torch.float64, device=norm.device)
    for shard in shards:
        value = shard.detach().to(norm.device, torch.float64)
        part = torch.maximum(part, value.abs().max()) if inf else part + value.abs().pow(norm_type).sum()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(part, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
    whole = norm.to(torch.float64)
    return torch.maximum(whole, part) if inf else (whole.pow(norm_type) + part).pow(1.0 / norm_type)
