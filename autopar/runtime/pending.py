"""An output all-reduce left in flight: ``PendingTensor`` waits for it at the value's first read.

A data-parallel step returns the loss as a sum over ranks (the kernel's ``P`` output converted
to ``R`` at the graph's output). A blocking all-reduce there makes each rank wait at the end of
forward for the slowest one (and for a round trip through the communication thread, which on a
loaded host is a scheduling delay), before it may start backward -- a synchronisation point
DDP's step does not have. Nothing in backward needs the reduced value: the all-reduce's
backward is the identity, and autograd's implicit ``ones_like(loss)`` reads only its shape.

So ``build_module``'s graphs issue that all-reduce asynchronously
(``self.all_reduce(loss, axis=0, pending=True)``) and return a ``PendingTensor``: a tensor
subclass wrapping the buffer being reduced. Its first read (any op but the shape-only
``ones_like``/``zeros_like``/``empty_like``, or ``item``/``float``/printing/``numpy``/pickling) waits
for the all-reduce and computes on the reduced value, returning plain tensors; so
``loss.backward()`` starts at once, and ``float(loss)`` after the step finds the reduction done.
Every rank issued the collective at the same point of its step, so a rank that reads the loss
(``if rank == 0: print(loss)``) and one that does not stay in step. The values are exactly
those of the blocking all-reduce: the same collective on the same buffer, only waited on later.
The module waits for any reduction still unread before it issues the next one.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only

from autopar.runtime.counting import record
from autopar.runtime.dist_ops import issue, wait

__all__ = ["PendingTensor", "Inflight", "all_reduce_pending"]

_aten = torch.ops.aten
# Ops that read only a tensor's metadata: autograd's implicit gradient of a scalar loss.
_SHAPE_ONLY = frozenset({_aten.ones_like.default, _aten.zeros_like.default, _aten.empty_like.default})


class Inflight:
    """The asynchronous collectives of one module left to wait for: each is waited on once,
    at its value's first read or before the module issues the next one (``wait_all``)."""

    def __init__(self) -> None:
        self._works: list[Any] = []

    def add(self, work: Any) -> "_Handle":
        handle = _Handle(work)
        self._works.append(handle)
        return handle

    def wait_all(self) -> None:
        for handle in self._works:
            handle.wait()
        self._works.clear()


class _Handle:
    __slots__ = ("work",)

    def __init__(self, work: Any) -> None:
        self.work = work

    def wait(self) -> None:
        if self.work is not None:
            work, self.work = self.work, None
            wait(work)


class PendingTensor(torch.Tensor):
    """A tensor whose data an in-flight collective is still writing (module docstring)."""

    _elem: torch.Tensor
    _handle: _Handle
    __slots__ = ("_elem", "_handle")
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, elem: torch.Tensor, handle: _Handle) -> "PendingTensor":
        out = torch.Tensor._make_wrapper_subclass(
            cls, elem.size(), strides=elem.stride(), storage_offset=elem.storage_offset(), dtype=elem.dtype,
            layout=elem.layout, device=elem.device, requires_grad=False)
        out._elem, out._handle = elem, handle
        return out

    def resolved(self) -> torch.Tensor:
        """The reduced value (a plain tensor), after waiting for the collective."""
        self._handle.wait()
        return self._elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        read = (lambda t: t._elem) if func in _SHAPE_ONLY else PendingTensor.resolved
        return func(*tree_map_only(PendingTensor, read, args), **tree_map_only(PendingTensor, read, kwargs or {}))

    def __repr__(self, *, tensor_contents=None) -> str:  # noqa: ARG002 -- Tensor.__repr__'s signature
        return repr(self.resolved())

    def __format__(self, spec: str) -> str:
        return format(self.resolved(), spec) if self.dim() else format(self.resolved().item(), spec)

    def tolist(self):
        return self.resolved().tolist()

    def numpy(self, *, force: bool = False):
        return self.resolved().detach().numpy(force=force)

    def __reduce_ex__(self, protocol):
        return self.resolved().detach().clone().__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        return copy.deepcopy(self.resolved().detach(), memo)


class _PendingAllReduce(torch.autograd.Function):
    """Sum over one mesh axis, issued now and waited on at first read; backward identity (the
    gradient of a replicated sum reaches each summand whole, as ``collectives._AllReduce``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, inflight: Inflight) -> torch.Tensor:
        inflight.wait_all()  # the previous step's value, if nobody read it
        out = x.detach().clone(memory_format=torch.contiguous_format)  # never reduce autograd's input
        record("all_reduce", out.numel() * out.element_size())
        work = issue(dist.all_reduce, out, group=group)
        return PendingTensor(out, inflight.add(work))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


def all_reduce_pending(x: torch.Tensor, group, inflight: Inflight) -> torch.Tensor:
    """``x`` summed over ``group``'s ranks as a ``PendingTensor`` (see the module docstring)."""
    return _PendingAllReduce.apply(x, group, inflight)
