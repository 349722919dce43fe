"""torch.distributed backing for custom local kernels, and the Megatron "f" gradient all-reduce.

Custom kernels (``autopar.strategies.register_kernel``) talk to other ranks only through the
``autopar.strategies.kernel_context.Comm`` protocol. :class:`DistComm` implements it on the per-axis
process groups of a :class:`~autopar.runtime.process_mesh.ProcessMesh`, with exactly the
semantics of the numerical check's thread simulator (``autopar.strategies.check.SimComm``):

- ``all_reduce(t, axes, "sum")`` is differentiable and its backward is the identity (the result
  is replicated, so its gradient arrives replicated: the gradient-layout invariant);
- ``all_reduce(t, axes, "max")`` is not differentiable (the result never requires grad);
- a reduction over several axes reduces over the ranks that differ in those coordinates only,
  done as one all-reduce per axis (sums and maxima compose over axes);
- ``shift(t, axis)`` is one ring step: a send to the next coordinate and a receive from the
  previous one on the axis's group, not differentiable.

:func:`grad_all_reduce` is the "f" of a strategy whose input has ``grad_partial_axes``: the
identity forward, and a sum all-reduce of the input's local gradient over those axes backward.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from autopar.runtime.counting import record
from autopar.runtime.dist_ops import blocking, issue, wait, waiting
from autopar.runtime.process_mesh import ProcessMesh

__all__ = ["DistComm", "grad_all_reduce", "all_reduce_axes", "all_to_all_rows"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def _axes_tuple(axes: int | Sequence[int]) -> tuple[int, ...]:
    return (axes,) if isinstance(axes, int) else tuple(sorted(axes))


def all_reduce_axes(tensor: torch.Tensor, axes: Sequence[int], pmesh: ProcessMesh,
                    op: str = "sum") -> torch.Tensor:
    """A fresh tensor: ``tensor`` reduced over the mesh ``axes`` (no autograd)."""
    if op not in _OPS:
        raise ValueError(f"unsupported reduction {op!r}; expected 'sum' or 'max'")
    out = tensor.detach().clone(memory_format=torch.contiguous_format)
    with waiting():  # blocking: a max is called outside any autograd function the profiler names
        for axis in axes:
            if pmesh.axis_size(axis) > 1:
                record("all_reduce", out.numel() * out.element_size())
                blocking(dist.all_reduce, out, op=_OPS[op], group=pmesh.group(axis))
    return out


class _SumAllReduce(torch.autograd.Function):
    """Sum over axes; backward identity (the simulator's ``_AllReduceSum``)."""

    @staticmethod
    def forward(ctx, tensor, axes, pmesh):
        return all_reduce_axes(tensor, axes, pmesh, "sum")

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GradAllReduce(torch.autograd.Function):
    """Identity forward; the local (partial) gradient is summed over ``axes`` backward."""

    @staticmethod
    def forward(ctx, tensor, axes, pmesh, reduce_dtype):
        ctx.axes, ctx.pmesh, ctx.reduce_dtype = axes, pmesh, reduce_dtype
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        wide = ctx.reduce_dtype
        if wide is None or wide.itemsize <= grad.dtype.itemsize:
            return all_reduce_axes(grad, ctx.axes, ctx.pmesh, "sum"), None, None, None
        # Sum in the wide dtype, round once: a bf16 sum over many ranks loses digits at every hop.
        return all_reduce_axes(grad.to(wide), ctx.axes, ctx.pmesh, "sum").to(grad.dtype), None, None, None


def grad_all_reduce(tensor: torch.Tensor, axes: Sequence[int], pmesh: ProcessMesh, *,
                    reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Megatron's "f": ``tensor`` unchanged, its gradient all-reduced over ``axes``, summed in
    ``reduce_dtype`` when that is wider than the gradient (a bf16 gradient summed in fp32)."""
    axes = _axes_tuple(axes)
    if not axes or not tensor.is_floating_point() or not (tensor.requires_grad and torch.is_grad_enabled()):
        return tensor  # no gradient will come back (Qwen2's rotary cos/sin): no autograd node to make
    return _GradAllReduce.apply(tensor, axes, pmesh, reduce_dtype)


def all_to_all_rows(tensor: torch.Tensor, axis: int, pmesh: ProcessMesh, send_counts: Sequence[int],
                    recv_counts: Sequence[int]) -> torch.Tensor:
    """A fresh tensor: ``tensor``'s row blocks exchanged over ``axis`` (``Comm.all_to_all``; no autograd)."""
    rows = tensor.detach().contiguous()
    out = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
    if pmesh.axis_size(axis) == 1:
        return out.copy_(rows)
    record("all_to_all", rows.numel() * rows.element_size())
    blocking(dist.all_to_all_single, out, rows, output_split_sizes=list(recv_counts),
             input_split_sizes=list(send_counts), group=pmesh.group(axis))
    return out


class _AllToAll(torch.autograd.Function):
    """Row blocks exchanged over one axis; backward: the reverse exchange (counts swapped)."""

    @staticmethod
    def forward(ctx, tensor, axis, pmesh, send_counts, recv_counts):
        ctx.axis, ctx.pmesh, ctx.counts = axis, pmesh, (send_counts, recv_counts)
        return all_to_all_rows(tensor, axis, pmesh, send_counts, recv_counts)

    @staticmethod
    def backward(ctx, grad):
        send_counts, recv_counts = ctx.counts
        return all_to_all_rows(grad, ctx.axis, ctx.pmesh, recv_counts, send_counts), None, None, None, None


class _Scatter(torch.autograd.Function):
    """``Comm.scatter`` on the axis's process group; backward gathers onto ``src``."""

    @staticmethod
    def forward(ctx, tensor, axis, pmesh, src):
        group = pmesh.group(axis)
        ctx.group, ctx.src, ctx.mine = group, dist.get_global_rank(group, src), pmesh.axis_coordinate(axis) == src
        chunks = list(tensor.detach().contiguous().chunk(pmesh.axis_size(axis)))
        out = torch.empty_like(chunks[0], memory_format=torch.contiguous_format)
        record("all_to_all", tensor.numel() * tensor.element_size())  # one table's share of the all-to-all
        dist.scatter(out, [c.contiguous() for c in chunks] if ctx.mine else None, src=ctx.src, group=group)
        ctx.n = len(chunks)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        pieces = [torch.empty_like(grad) for _ in range(ctx.n)] if ctx.mine else None
        record("all_to_all", grad.numel() * grad.element_size() * ctx.n)
        dist.gather(grad, pieces, dst=ctx.src, group=ctx.group)
        full = torch.cat(pieces) if ctx.mine else grad.new_zeros((grad.shape[0] * ctx.n, *grad.shape[1:]))
        return full, None, None, None


class DistComm:
    """``Comm`` for one real rank, on the process groups of ``pmesh``."""

    def __init__(self, pmesh: ProcessMesh) -> None:
        self.pmesh = pmesh

    # Each kernel node has its own DistComm; those of one ProcessMesh are one communicator, so a
    # kernel may coalesce its collectives with other nodes' (the per-rank batch norms' statistics).
    def __eq__(self, other: object) -> bool:
        return isinstance(other, DistComm) and other.pmesh is self.pmesh

    def __hash__(self) -> int:
        return id(self.pmesh)

    def all_reduce(self, tensor: torch.Tensor, axes: int | Sequence[int], op: str = "sum") -> torch.Tensor:
        axes = _axes_tuple(axes)
        if not axes:
            return tensor
        if op == "sum":
            return _SumAllReduce.apply(tensor, axes, self.pmesh)
        return all_reduce_axes(tensor, axes, self.pmesh, op)

    def all_reduce_async(self, tensor: torch.Tensor, axes: int | Sequence[int]) -> Callable[[], torch.Tensor]:
        axes = tuple(a for a in _axes_tuple(axes) if self.pmesh.axis_size(a) > 1)
        out = tensor.detach().clone(memory_format=torch.contiguous_format)
        if not axes:
            return lambda: out
        # One collective on the group spanning the axes where the mesh forms one, all of it in
        # flight from the call: a chain would leave every axis but the first to the wait, blocking
        # (on a (2, 2) mesh of 4 gloo ranks on 2 cores that one held the end of backward 1-19 ms).
        first, *rest = self.pmesh.groups_over(axes)
        record("all_reduce", out.numel() * out.element_size())
        work = issue(dist.all_reduce, out, group=first)

        def result() -> torch.Tensor:
            wait(work)
            # no spanning group (a pipeline stage's sub-mesh): the other axes' chain, after the first
            return all_reduce_axes(out, axes[1:], self.pmesh) if rest else out
        return result

    def shift(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        n = self.pmesh.axis_size(axis)
        if n == 1:
            return tensor
        group, coord = self.pmesh.group(axis), self.pmesh.axis_coordinate(axis)
        send = tensor.detach().contiguous()
        received = torch.empty_like(send)
        record("send_recv", send.numel() * send.element_size())
        ops = [dist.P2POp(dist.isend, send, dist.get_global_rank(group, (coord + 1) % n), group=group),
               dist.P2POp(dist.irecv, received, dist.get_global_rank(group, (coord - 1) % n), group=group)]
        for work in dist.batch_isend_irecv(ops):
            wait(work)
        return received

    def all_to_all(self, tensor: torch.Tensor, axis: int, send_counts: Sequence[int],
                   recv_counts: Sequence[int]) -> torch.Tensor:
        return _AllToAll.apply(tensor, axis, self.pmesh, tuple(send_counts), tuple(recv_counts))

    def exchange_counts(self, counts: Sequence[int], axis: int) -> list[int]:
        send = torch.tensor(list(counts), dtype=torch.int64)
        return all_to_all_rows(send, axis, self.pmesh, [1] * len(counts), [1] * len(counts)).tolist()

    def scatter(self, tensor: torch.Tensor, axis: int, src: int) -> torch.Tensor:
        if self.pmesh.axis_size(axis) == 1:
            return tensor
        return _Scatter.apply(tensor, axis, self.pmesh, src)

    def coordinate(self, axis: int) -> int:
        return self.pmesh.axis_coordinate(axis)

    def size(self, axis: int) -> int:
        return self.pmesh.axis_size(axis)
