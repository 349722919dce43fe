"""Autograd-aware collectives that execute layout conversions on real process groups.

One ``torch.autograd.Function`` per ``ReshardStep`` kind (see ``autopar.layout.conversion`` for the
table), each acting on one mesh axis of a ``ProcessMesh``:

===============  =================================  ==========================================
kind             forward                            backward (gradient in the value's layout)
===============  =================================  ==========================================
all_gather       all-gather S(d) -> R               keep this coordinate's chunk (local split)
split            keep this coordinate's chunk       all-gather
all_to_all       all_to_all_single S(i) -> S(j)     all_to_all_single S(j) -> S(i)
all_reduce       all-reduce P -> R                  identity
reduce_scatter   reduce-scatter P -> S(d)           all-gather
to_partial       value on coordinate 0, else zeros  identity
===============  =================================  ==========================================

A segmented shard ``S(d/k)`` (coordinate ``r`` holds ``[seg0_r | ... | seg(k-1)_r]``): its
all-gather receives the pieces coordinate-major (``[r][segment][c]``) and reorders them
segment-major (``_segment_major``); its split keeps this coordinate's piece of each segment.

The backward column follows the gradient-layout invariant (docs/architecture.md): a gradient
arrives in the same layout as its forward value, except that the gradient of a ``P`` value is
replicated. Under that invariant the gradient of a replicated value is the same on every rank,
so the backward of an all-gather is a local split, not a reduce-scatter.

Local pieces are indexed by mesh coordinate: for a dim sharded by several axes, the lower axis
index is the major digit (``TensorSpec.local_slices``). ``distribute`` places a ``P`` value on
coordinate 0 of every partial axis and zeros elsewhere, the same convention as ``to_partial``.

Every collective this module issues, forward or backward, is counted by kind while a
``count_collectives()`` context is open (``runtime.counting``; tests assert e.g. "S0->S1 is
one all-to-all").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from autopar.runtime.counting import COLLECTIVE_KINDS, count_collectives, record
from autopar.runtime.process_mesh import ProcessMesh
from autopar.layout.conversion import ReshardStep, replicate_steps
from autopar.layout.conversion import apply_step as reshard_apply_step
from autopar.layout.placement import TensorSpec
from autopar.strategies.fused import take_local
from autopar.runtime.dist_ops import all_gather_single, blocking, reduce_scatter_single

__all__ = [
    "COLLECTIVE_KINDS",
    "count_collectives",
    "next_spec",
    "apply_step",
    "apply_steps",
    "convert",
    "distribute",
    "gather_full",
    "replicate_steps",
]

# --------------------------------------------------------------------------- one mesh axis
@dataclass(frozen=True, slots=True)
class _Axis:
    """What a collective needs about one mesh axis of this rank's ``ProcessMesh``."""

    index: int
    size: int
    coordinate: int
    group: dist.ProcessGroup

    @classmethod
    def of(cls, pmesh: ProcessMesh, axis: int) -> "_Axis":
        return cls(axis, pmesh.axis_size(axis), pmesh.axis_coordinate(axis), pmesh.group(axis))

    def __str__(self) -> str:
        return f"axis{self.index}(size={self.size}, coord={self.coordinate})"


def _check_divisible(x: torch.Tensor, dim: int, ax: _Axis, what: str) -> None:
    if not 0 <= dim < x.dim():
        raise ValueError(f"{what} on {ax}: dim {dim} out of range for local shape {tuple(x.shape)}")
    if x.shape[dim] % ax.size != 0:
        raise ValueError(
            f"{what} on {ax}: dim {dim} of local shape {tuple(x.shape)} has size {x.shape[dim]}, "
            f"not divisible by the axis size {ax.size}"
        )


def _local_chunk(x: torch.Tensor, dim: int, ax: _Axis, segments: int = 1) -> torch.Tensor:
    _check_divisible(x, dim, ax, "split")
    if segments > 1:
        if x.shape[dim] % (segments * ax.size):
            raise ValueError(f"split on {ax}: dim {dim} of local shape {tuple(x.shape)} does not divide into "
                             f"{segments} segments of {ax.size} pieces")
        # (..., k, n, c, ...): keep piece ``coordinate`` of every segment.
        parts = x.unflatten(dim, (segments, ax.size, -1)).select(dim + 1, ax.coordinate)
        return parts.flatten(dim, dim + 1).clone(memory_format=torch.contiguous_format)
    size = x.shape[dim] // ax.size
    # A fresh contiguous tensor: later collectives need contiguity, and no view of x escapes.
    return x.narrow(dim, ax.coordinate * size, size).clone(memory_format=torch.contiguous_format)


def _segment_major(x: torch.Tensor, dim: int, n: int, segments: int) -> torch.Tensor:
    """Reorder ``dim`` from coordinate-major ``[n][segments][c]`` to ``[segments][n][c]``."""
    return x.unflatten(dim, (n, segments, -1)).transpose(dim, dim + 1).flatten(dim, dim + 2).contiguous()


def _all_gather(x: torch.Tensor, dim: int, ax: _Axis, segments: int = 1) -> torch.Tensor:
    if not 0 <= dim < x.dim():
        raise ValueError(f"all-gather on {ax}: dim {dim} out of range for shape {tuple(x.shape)}")
    front, out = gather_buffers(x, dim, ax.size)
    blocking(all_gather_single, out, front, group=ax.group)
    return gathered(out, dim, ax.size, segments)


def gather_buffers(x: torch.Tensor, dim: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(send, receive) of an all-gather of ``x``'s ``dim`` over ``size`` ranks: all_gather_single
    concatenates along dim 0, so ``dim`` is moved there (``gathered`` moves it back)."""
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] * size, *front.shape[1:]))
    record("all_gather", out.numel() * out.element_size())
    return front, out


def gathered(out: torch.Tensor, dim: int, size: int, segments: int = 1) -> torch.Tensor:
    """A filled receive buffer of ``gather_buffers`` in the layout the gather yields."""
    if segments > 1:
        return _segment_major(out, 0, size, segments).movedim(0, dim).contiguous()
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, ax: _Axis) -> torch.Tensor:
    _check_divisible(x, dim, ax, "reduce-scatter")
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // ax.size, *front.shape[1:]))
    record("reduce_scatter", front.numel() * front.element_size())
    blocking(reduce_scatter_single, out, front, group=ax.group)
    return out.movedim(0, dim).contiguous()


def _all_reduce(x: torch.Tensor, ax: _Axis) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)  # never reduce autograd's input in place
    record("all_reduce", out.numel() * out.element_size())
    blocking(dist.all_reduce, out, group=ax.group)
    return out


def _all_to_all(x: torch.Tensor, src_dim: int, dst_dim: int, ax: _Axis) -> torch.Tensor:
    """S(src_dim) -> S(dst_dim): chunk k of ``dst_dim`` goes to coordinate k; the pieces that
    arrive are this coordinate's ``dst_dim`` chunk of every peer's ``src_dim`` shard, joined in
    coordinate order."""
    if src_dim == dst_dim or not 0 <= src_dim < x.dim():
        raise ValueError(
            f"all-to-all on {ax}: bad dims S{src_dim}->S{dst_dim} for local shape {tuple(x.shape)}"
        )
    _check_divisible(x, dst_dim, ax, "all-to-all")
    # (size, *chunk shape); stack keeps a channels-last input's memory format: force contiguous
    send = torch.stack(x.chunk(ax.size, dim=dst_dim)).contiguous()
    recv = torch.empty_like(send, memory_format=torch.contiguous_format)
    record("all_to_all", send.numel() * send.element_size() * ax.size)  # the full size, as priced
    blocking(dist.all_to_all_single, recv, send, group=ax.group)
    return torch.cat(recv.unbind(0), dim=src_dim)


def _zeros_off_origin(x: torch.Tensor, ax: _Axis) -> torch.Tensor:
    if ax.coordinate == 0:
        return x.clone(memory_format=torch.contiguous_format)
    return torch.zeros_like(x, memory_format=torch.contiguous_format)


# ---------------------------------------------------------------- autograd functions, one per kind
class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim: int, ax: _Axis, segments: int = 1):
        ctx.dim, ctx.ax, ctx.segments = dim, ax, segments
        return _all_gather(x, dim, ax, segments)

    @staticmethod
    def backward(ctx, grad):
        return _local_chunk(grad, ctx.dim, ctx.ax, ctx.segments), None, None, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim: int, ax: _Axis, segments: int = 1):
        ctx.dim, ctx.ax, ctx.segments = dim, ax, segments
        return _local_chunk(x, dim, ax, segments)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.ax, ctx.segments), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src_dim: int, dst_dim: int, ax: _Axis):
        ctx.src_dim, ctx.dst_dim, ctx.ax = src_dim, dst_dim, ax
        return _all_to_all(x, src_dim, dst_dim, ax)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.dst_dim, ctx.src_dim, ctx.ax), None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ax: _Axis):
        return _all_reduce(x, ax)

    @staticmethod
    def backward(ctx, grad):
        # P's gradient is replicated: each summand's gradient is the full gradient.
        return grad, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim: int, ax: _Axis):
        ctx.dim, ctx.ax = dim, ax
        return _reduce_scatter(x, dim, ax)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.ax), None, None


class _ToPartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ax: _Axis):
        return _zeros_off_origin(x, ax)

    @staticmethod
    def backward(ctx, grad):
        # The P output's gradient is replicated, which is exactly the R input's gradient layout.
        return grad, None


# ------------------------------------------------------------------------------ spec tracking
def next_spec(spec: TensorSpec | str, step: ReshardStep) -> TensorSpec:
    """The layout after ``step``; ``ValueError`` if the step does not apply to ``spec``.

    The planner's own rule (``reshard.apply_step``): the placement on the step's axis must
    match and only the minor-most axis sharding a dim may be added or removed."""
    return reshard_apply_step(TensorSpec.parse(spec), step)


# ------------------------------------------------------------------------------- execution
def apply_step(local: torch.Tensor, step: ReshardStep, pmesh: ProcessMesh) -> torch.Tensor:
    """Execute one step on this rank's local piece (every rank of the axis group must call)."""
    ax = _Axis.of(pmesh, step.axis)
    if step.kind == "all_gather":
        return _AllGather.apply(local, step.src_dim, ax, step.segments)
    if step.kind == "split":
        return _Split.apply(local, step.dst_dim, ax, step.segments)
    if step.kind == "all_to_all":
        return _AllToAll.apply(local, step.src_dim, step.dst_dim, ax)
    if step.kind == "all_reduce":
        return _AllReduce.apply(local, ax)
    if step.kind == "reduce_scatter":
        return _ReduceScatter.apply(local, step.dst_dim, ax)
    if step.kind == "to_partial":
        return _ToPartial.apply(local, ax)
    raise ValueError(f"unknown reshard step kind {step.kind!r} in {step}")


def _final_spec(src: TensorSpec, steps: Sequence[ReshardStep], pmesh: ProcessMesh | None) -> TensorSpec:
    """Check every step against the layout it acts on; return the layout after the last."""
    if pmesh is not None and src.num_axes != pmesh.ndim:
        raise ValueError(f"spec {src} has {src.num_axes} placements for the {pmesh.ndim}-D "
                         f"process mesh {pmesh.shape}")
    spec = src
    for step in steps:
        spec = next_spec(spec, step)
    return spec


def apply_steps(
    local: torch.Tensor,
    steps: Sequence[ReshardStep],
    pmesh: ProcessMesh,
    *,
    src: TensorSpec | str | None = None,
) -> torch.Tensor:
    """Execute ``steps`` in order. With ``src``, every step is first checked against the layout
    it acts on, so a malformed plan fails with ``ValueError`` before any collective is issued."""
    if src is not None:
        _final_spec(TensorSpec.parse(src), steps, pmesh)
    for step in steps:
        local = apply_step(local, step, pmesh)
    return local


def convert(local: torch.Tensor, conversion, pmesh: ProcessMesh) -> torch.Tensor:
    """Run a planned ``Conversion`` (``autopar.layout.conversion``): ``src`` layout in, ``dst`` out.

    The steps are checked to lead from ``src`` to ``dst`` before any collective is issued."""
    src, dst = TensorSpec.parse(conversion.src), TensorSpec.parse(conversion.dst)
    end = _final_spec(src, conversion.steps, None)
    if end != dst:
        raise ValueError(f"conversion {src} -> {dst}: its steps "
                         f"{[str(s) for s in conversion.steps]} end in {end}")
    if src.num_axes != pmesh.ndim:
        raise ValueError(f"conversion {src} -> {dst} is for a {src.num_axes}-D mesh, the "
                         f"process mesh is {pmesh.shape}")
    for step in conversion.steps:
        local = apply_step(local, step, pmesh)
    return local


# ------------------------------------------------------------------- whole tensors <-> pieces
def distribute(global_tensor: torch.Tensor, spec: TensorSpec | str, pmesh: ProcessMesh) -> torch.Tensor:
    """This rank's local piece of ``global_tensor`` under ``spec``.

    Shards are sliced by mesh coordinate. On partial axes the rank whose coordinate is 0 on
    *every* partial axis holds the value and the others hold zeros, so the pieces sum to it.
    """
    spec = TensorSpec.parse(spec)
    piece = take_local(global_tensor, spec, pmesh.shape, pmesh.coordinate)
    if any(pmesh.coordinate[a] != 0 for a in spec.partial_axes()):
        return torch.zeros_like(piece)
    return piece


def gather_full(local: torch.Tensor, spec: TensorSpec | str, pmesh: ProcessMesh) -> torch.Tensor:
    """The global tensor from every rank's ``local`` piece under ``spec`` (a collective:
    every rank must call). Differentiable like any other conversion to ``R``."""
    return apply_steps(local, replicate_steps(spec), pmesh, src=spec)
