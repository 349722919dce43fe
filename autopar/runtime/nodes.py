"""The modules that emitted graphs call: collectives, the gradient all-reduce and kernels.

Every communication the runtime inserts is a ``call_module`` node on one of these, so that
``print(module.code)`` names it: ``self.all_gather(x, axis=1, dim=0)``,
``self.grad_all_reduce(w, axes=(0,))``, ``self.cross_entropy(...)``. They hold the
``ProcessMesh`` (no parameters, no state dict entries) and call the autograd-aware
collectives of :mod:`autopar.runtime.collectives` and :mod:`autopar.runtime.kernels`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from autopar.runtime.collectives import apply_step
from autopar.runtime.kernels import DistComm, grad_all_reduce
from autopar.runtime.pending import Inflight, PendingTensor, all_reduce_pending
from autopar.runtime.process_mesh import ProcessMesh
from autopar.layout.conversion import ReshardStep
from autopar.strategies.kernel_context import KernelContext

__all__ = ["Collective", "GradAllReduce", "KernelCall"]


class Collective(nn.Module):
    """One reshard step kind (``all_gather``, ``split``, ``all_to_all``, ``all_reduce``,
    ``reduce_scatter``, ``to_partial``) on one mesh axis per call. ``pending=True`` (an
    ``all_reduce`` of a graph output, over ``axes``: ``(axis,)`` or several): issued
    asynchronously, one collective on the group spanning them, the result a ``PendingTensor``
    waited on at its first read (:mod:`autopar.runtime.pending`); where no such group can be made
    (``ProcessMesh.group_over``), a chain of blocking all-reduces."""

    def __init__(self, kind: str, pmesh: ProcessMesh) -> None:
        super().__init__()
        self.kind, self.pmesh = kind, pmesh
        self.inflight = Inflight()

    def forward(self, x: torch.Tensor, *, axis: int, src_dim: int | None = None, dst_dim: int | None = None,
                segments: int = 1, pending: bool = False, axes: tuple[int, ...] = ()) -> torch.Tensor:
        if pending:
            if self.kind != "all_reduce":
                raise ValueError(f"only an all_reduce can be left pending, not {self.kind}")
            wide = [a for a in (axes or (axis,)) if self.pmesh.axis_size(a) > 1]
            if not wide:
                return x
            if len(groups := self.pmesh.groups_over(wide)) == 1:
                return all_reduce_pending(x, groups[0], self.inflight)
            for a in wide:  # no group spans them (a stage's sub-mesh): a chain, blocking
                x = apply_step(x, ReshardStep("all_reduce", a), self.pmesh)
            return x
        return apply_step(x, ReshardStep(self.kind, axis, src_dim, dst_dim, segments), self.pmesh)

    def extra_repr(self) -> str:
        return self.kind


class GradAllReduce(nn.Module):
    """Megatron's "f": identity forward, sum all-reduce of the gradient over ``axes``."""

    def __init__(self, pmesh: ProcessMesh, *, reduce_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.pmesh, self.reduce_dtype = pmesh, reduce_dtype

    def forward(self, x: torch.Tensor, *, axes: tuple[int, ...]) -> torch.Tensor:
        return grad_all_reduce(x, axes, self.pmesh, reduce_dtype=self.reduce_dtype)

    def extra_repr(self) -> str:
        return "" if self.reduce_dtype is None else f"reduce_dtype={self.reduce_dtype}"


class KernelCall(nn.Module):
    """A strategy's custom local kernel for one node, with a torch.distributed ``Comm``."""

    def __init__(self, name: str, fn: Callable[..., Any], ctx: KernelContext, arg_names: tuple[str, ...]) -> None:
        super().__init__()
        self.name, self.fn, self.ctx, self.arg_names = name, fn, ctx, arg_names

    def forward(self, *values: Any) -> Any:
        # An early sum (runtime/early.py) is waited for here, its reader: the kernel computes on a
        # plain tensor, so autograd saves no PendingTensor (saved-tensor hooks read storages).
        values = [v.resolved() if isinstance(v, PendingTensor) else v for v in values]
        # Positional: schema names such as ``self`` cannot be keyword arguments of a Module call.
        return self.fn(self.ctx, **dict(zip(self.arg_names, values)))

    def extra_repr(self) -> str:
        return f"{self.name} for node {self.ctx.info.node_name}"


def kernel_context(info, strategy, pmesh: ProcessMesh, *, owners: tuple = ()) -> KernelContext:
    return KernelContext(DistComm(pmesh), info, tuple(strategy.input_specs),
                         tuple(strategy.output_specs), tuple(pmesh.shape), owners=owners)
