"""Axis options -> whole-mesh ``Strategy`` records: normalisation of a rule's per-axis options,
the product over mesh axes with validity checks, and the cost of each combination (compute
roofline, gradient all-reduces, kernel communication) from the op's FLOPs.

Shared by the mesh expansion (``autopar.strategies.expand``) and the admission check of
DTensor-derived candidates (``autopar.strategies.derived``), which builds one strategy from one
option to check it numerically before offering it.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Sequence

import torch

from autopar.layout.cost import collective_seconds, compute_seconds
from autopar.layout.mesh import MeshSpec
from autopar.layout.placement import Partial, Replicate, Shard, TensorSpec
from autopar.strategies.registry import (
    AxisOption, OpInfo, RuleEntry, Strategy, TensorMeta, call_op, get_kernel, strategy_name,
)
from autopar.tracer.profile import _is_view

__all__ = ["replicate_option", "normalise_option", "fits_axis", "build_strategies", "estimate_flops", "freeze",
           "op_class"]

R = Replicate()


def replicate_option(info: OpInfo) -> AxisOption:
    ins = tuple(None if s.meta is None else R for s in info.slots)
    outs = tuple(None if m is None else R for m in info.outputs)
    return AxisOption(ins, outs, tuple(False for _ in ins), False, None)


def normalise_option(info: OpInfo, opt: AxisOption) -> AxisOption:
    if len(opt.inputs) != len(info.slots) or len(opt.outputs) != len(info.outputs):
        raise ValueError(
            f"rule for {info.where()} returned {len(opt.inputs)} input / {len(opt.outputs)} output "
            f"placements for {len(info.slots)} input slots / {len(info.outputs)} outputs"
        )
    for s, p in zip(info.slots, opt.inputs):
        if (s.meta is None) != (p is None):
            raise ValueError(f"rule for {info.where()}: slot {s.arg} needs a placement iff it is a tensor")
    active = not opt.is_replicate()
    # Gradients flow only if some output is differentiable (comparisons have none).
    differentiable = any(m is not None and m.is_float for m in info.outputs)
    work = active if opt.work_split is None else opt.work_split
    if opt.grad_partial is None:
        # A replicated input read by a computation split over this axis only contributes to the
        # local piece of the output, so its local gradient is a partial sum (Megatron's "f").
        gp = tuple(
            active and differentiable and s.meta is not None and s.meta.is_float and isinstance(p, Replicate)
            for s, p in zip(info.slots, opt.inputs)
        )
    else:
        gp = tuple(g and differentiable and s.meta is not None and s.meta.is_float
                   for g, s in zip(opt.grad_partial, info.slots))
    return AxisOption(opt.inputs, opt.outputs, gp, work, opt.kernel)


def fits_axis(info: OpInfo, opt: AxisOption, size: int) -> bool:
    metas = [s.meta for s in info.slots] + list(info.outputs)
    for meta, p in zip(metas, opt.inputs + opt.outputs):
        if isinstance(p, Shard) and (meta is None or p.dim >= meta.ndim or meta.shape[p.dim] % (size * p.segments)):
            return False
        if isinstance(p, Partial) and meta is not None and not meta.is_float:
            return False  # an integer tensor cannot be a pending sum
    return True


# ------------------------------------------------------------------------------- expansion
def build_strategies(info: OpInfo, mesh: MeshSpec, entry: RuleEntry | None, per_axis: Sequence[Sequence[AxisOption]],
           flops: tuple[float, float], *, fallback: bool, reduce_itemsize: int | None = None) -> list[Strategy]:
    out, seen = [], set()
    # A kernel the whole call runs whatever the layout (random draws: the all-replicated strategy
    # and a size-1 mesh too must not fall back to the plain op and torch's generator).
    whole = entry.kernel_for(info) if entry is not None and entry.kernel_for is not None else None
    for combo in itertools.product(*per_axis):
        kernels = {o.kernel for o in combo} - {None}
        if len(kernels) > 1:
            continue
        in_specs = _specs([o.inputs for o in combo], [s.meta for s in info.slots])
        out_specs = _specs([o.outputs for o in combo], list(info.outputs))
        if in_specs is None or out_specs is None:
            continue
        if not all(_valid(m, s, mesh.shape) for m, s in zip([x.meta for x in info.slots], in_specs)):
            continue
        if not all(_valid(m, s, mesh.shape) for m, s in zip(info.outputs, out_specs)):
            continue
        if entry is not None and entry.combine_check is not None and not entry.combine_check(info, combo):
            continue
        key = (in_specs, out_specs)
        if key in seen:
            continue
        seen.add(key)
        out.append(_strategy(info, mesh, combo, in_specs, out_specs, next(iter(kernels), whole), flops, fallback,
                             reduce_itemsize))
    return out


def _specs(per_axis: list[tuple], metas: list[TensorMeta | None]) -> tuple[TensorSpec | None, ...] | None:
    specs = []
    for i, meta in enumerate(metas):
        placements = tuple(axis[i] for axis in per_axis)
        specs.append(None if meta is None or placements[0] is None else TensorSpec(placements))
    return tuple(specs)


def _valid(meta: TensorMeta | None, spec: TensorSpec | None, mesh_shape: tuple[int, ...]) -> bool:
    return meta is None or spec is None or spec.is_valid(meta.shape, mesh_shape)


def _widening(meta: TensorMeta | None, reduce_itemsize: int | None) -> float:
    """How much bigger a partial gradient is on the wire than the input: a bf16 gradient
    summed in fp32 moves 4 bytes per element (``runtime.kernels.grad_all_reduce``)."""
    if meta is None or reduce_itemsize is None or reduce_itemsize <= meta.itemsize:
        return 1.0
    return reduce_itemsize / meta.itemsize


def _strategy(info: OpInfo, mesh: MeshSpec, combo: tuple[AxisOption, ...], in_specs, out_specs,
              kernel: str | None, flops: tuple[float, float], fallback: bool,
              reduce_itemsize: int | None = None) -> Strategy:
    work_axes = tuple(a for a, o in enumerate(combo) if o.work_split)
    gp_axes = tuple(tuple(a for a, o in enumerate(combo) if o.grad_partial[i]) for i in range(len(info.slots)))
    in_bytes = tuple(
        0 if s.meta is None else s.meta.local_nbytes(spec, mesh.shape) for s, spec in zip(info.slots, in_specs)
    )
    out_bytes = sum(m.local_nbytes(s, mesh.shape) for m, s in zip(info.outputs, out_specs) if m is not None)
    div = math.prod(mesh.shape[a] for a in work_axes)
    share = get_kernel(kernel).work_share if kernel is not None else None
    share = share(info, in_specs, mesh.shape) if share is not None else None
    if share is not None:  # the kernel's own share over its axes, the even split over the others
        div = math.prod(mesh.shape[a] for a in work_axes if a not in share[0]) / share[1]
    # A view moves no byte (its forward is a new tensor header; the tracer's profile counts it so),
    # nor does its backward where that is a view of the gradient too: it costs the kernel floor
    # (dispatch). Priced as a copy, GPT-2's 48 views of 4 MiB activations cost a quarter of its step.
    moved = 0 if _is_view(info.target) else sum(in_bytes) + out_bytes
    moved_bwd = _backward_bytes(info, in_bytes, out_bytes)
    differentiable = any(s.meta is not None and s.meta.is_float for s in info.slots) and any(
        m is not None and m.is_float for m in info.outputs
    )
    itemsize = _compute_itemsize(info)
    kind = {"itemsize": itemsize, "op_class": op_class(info.target), "dtype": _compute_dtype(info, itemsize),
            "op": _op_name(info.target)}
    fwd_c = compute_seconds(flops[0] / div, moved, mesh, **kind)
    # Backward reads the output gradient and the saved inputs and writes the input gradients.
    bwd_c = compute_seconds(flops[1] / div, moved_bwd, mesh, backward=True, **kind) if differentiable else 0.0
    wire = tuple(int(in_bytes[i] * _widening(info.slots[i].meta, reduce_itemsize)) if axes else 0
                 for i, axes in enumerate(gp_axes))
    # The terms are added in ``grad_sums.comm_seconds``'s order, which recomputes comm_s without some.
    grads = sum(collective_seconds("all_reduce", wire[i], mesh, axes) for i, axes in enumerate(gp_axes) if axes)
    fwd_comm = kb = 0.0
    if kernel is not None:
        fwd_comm, kb = get_kernel(kernel).comm_cost(info, in_specs, out_specs, mesh)
    output_spec = out_specs if info.multi_output else out_specs[0]
    return Strategy(
        name=strategy_name(in_specs, out_specs, info.multi_output),
        input_specs=in_specs,
        output_spec=output_spec,
        grad_partial_axes=gp_axes,
        compute_s=fwd_c + bwd_c,
        comm_s=fwd_comm + (grads + kb),
        forward_compute_s=fwd_c,
        forward_comm_s=fwd_comm,
        output_bytes=out_bytes,
        input_bytes=in_bytes,
        kernel=kernel,
        work_split_axes=work_axes,
        is_fallback=fallback,
        grad_sync_bytes=wire,
        kernel_bwd_comm_s=kb,
    )


def _compute_itemsize(info: OpInfo) -> int:
    """Bytes per float the op computes in, for ``compute_seconds``: the widest of its floating
    outputs, or of its floating inputs when no output is floating (comparisons); 4 when none is.

    Outputs decide because they show the precision the kernel ran at: a bf16 matmul writes bf16,
    while an op that reads bf16 and writes fp32 (a cast up, a loss computed in fp32) ran in fp32.
    The widest decides so that only an op entirely in bf16/fp16 gets the half-precision peak.
    """
    floats = [m for m in info.outputs if m is not None and m.is_float]
    if not floats:
        floats = [s.meta for s in info.slots if s.meta is not None and s.meta.is_float]
    return max((m.itemsize for m in floats), default=4)


_MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addbmm", "_addmm_activation", "einsum",
                      "bilinear"})


# Views whose backward is a view of the output gradient as well (a split's is a concatenation, an
# expand's a sum, a slice's or select's a scatter into zeros: those move bytes).
_VIEW_BACKWARDS = frozenset({"view", "reshape", "_reshape_alias", "transpose", "t", "permute", "unsqueeze",
                             "squeeze", "alias", "detach", "flatten", "unflatten", "view_as", "movedim"})


# Elementwise sums whose gradient reaches each summand of the output's shape as it is: autograd
# hands the output gradient on without a kernel (``AddBackward0``). Only a summand broadcast to
# the output (its gradient is a sum over the broadcast dims), a scaled one (``alpha``) and sub's
# subtrahend (a negation) cost a pass over the gradient. Priced as a pass over the output and two
# more, GPT-2's 20 residual and mask sums cost 18 ms of backward that no kernel ran.
_PASS_THROUGH_BACKWARDS = frozenset({"add", "sub"})
# A single tensor scaled by a number: the backward is the gradient scaled once (one read, one write).
_SCALING_BACKWARDS = frozenset({"mul", "div", "neg"})


def _backward_bytes(info: OpInfo, in_bytes: tuple[int, ...], out_bytes: int) -> int:
    """Bytes the op's backward moves on one device: by default its gradient kernels read the output
    gradient and the saved inputs and write the input gradients, twice the forward's traffic;
    nothing for a view whose backward is a view; per summand for a sum (``_PASS_THROUGH_BACKWARDS``)
    and one scaling pass for a scaled tensor (``_SCALING_BACKWARDS``)."""
    name = _op_name(info.target)
    if name in _VIEW_BACKWARDS:
        return 0
    floats = [i for i, s in enumerate(info.slots) if s.meta is not None and s.meta.is_float]
    out = info.outputs[0] if len(info.outputs) == 1 else None
    if name in _PASS_THROUGH_BACKWARDS and out is not None:
        scaled = name == "sub" or info.bound.get("alpha", 1) != 1

        def handed_on(i: int) -> bool:  # the output gradient is this summand's gradient as it is
            meta = info.slots[i].meta
            return meta.shape == out.shape and meta.dtype == out.dtype and not (scaled and info.slots[i].arg == "other")

        return sum(out_bytes + in_bytes[i] for i in floats if not handed_on(i))
    if name in _SCALING_BACKWARDS and len(floats) == 1 and out is not None:
        return out_bytes + in_bytes[floats[0]]
    return 2 * (sum(in_bytes) + out_bytes)


def _op_name(target: Any) -> str:
    return getattr(getattr(target, "overloadpacket", None), "__name__", "")


def op_class(target: Any) -> str:
    """The cost model's op class of an ATen op (``autopar.layout.machine.OP_CLASSES``): what a
    calibrated mesh measured its speed as. Matrix products (``mm``/``bmm``/``linear`` ...) are
    ``matmul``; scaled dot-product attention ``attention``; convolutions (transposed too)
    ``conv``; batch norm ``batch_norm``; other normalisations and softmax ``norm`` (a reduction
    and a rescale per row: memory-bound); max and average pools ``pool``; ops tagged pointwise ``elementwise``; the
    rest (gathers, reductions ...) ``other``, priced by the roofline."""
    name = _op_name(target)
    if name in _MATMULS:
        return "matmul"
    if "scaled_dot_product" in name:
        return "attention"
    if name.startswith(("conv", "_conv")):
        return "conv"
    if "pool" in name:
        return "pool"
    if "batch_norm" in name:
        return "batch_norm"
    if "norm" in name or "softmax" in name:
        return "norm"
    if torch.Tag.pointwise in getattr(target, "tags", ()):
        return "elementwise"
    return "other"


def _compute_dtype(info: OpInfo, itemsize: int) -> str:
    """The dtype name the op's measured rate is looked up at: fp16 where an ``itemsize`` of 2
    comes from fp16 tensors, else as ``layout.machine.dtype_name``."""
    if itemsize != 2:
        return "fp32"
    metas = [m for m in info.outputs if m is not None] + [s.meta for s in info.slots if s.meta is not None]
    return "fp16" if any(m.dtype == torch.float16 for m in metas) else "bf16"


# ------------------------------------------------------------------------------------ FLOPs
def estimate_flops(info: OpInfo) -> tuple[float, float]:
    """(forward, backward) FLOPs of the whole op, counted on fake tensors (cached per signature)."""
    key = (info.target, tuple(freeze(v) for v in info.bound.items()))
    return _estimate_cached(key, info)


def freeze(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    if isinstance(value, (int, float, bool, str, type(None), TensorMeta, torch.dtype)):
        return value
    return repr(value)


_FLOPS_CACHE: dict[Any, tuple[float, float]] = {}


def _estimate_cached(key: Any, info: OpInfo) -> tuple[float, float]:
    if key not in _FLOPS_CACHE:
        _FLOPS_CACHE[key] = _count_flops(info)
    return _FLOPS_CACHE[key]


def _count_flops(info: OpInfo) -> tuple[float, float]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    with FakeTensorMode():
        leaves: list[torch.Tensor] = []

        def make(v: Any) -> Any:
            if isinstance(v, TensorMeta):
                t = torch.zeros(v.shape, dtype=v.dtype)
                if v.is_float:
                    t.requires_grad_(True)
                    leaves.append(t)
                return t
            if isinstance(v, list):
                return [make(x) for x in v]
            return v

        bound = {k: make(v) for k, v in info.bound.items()}
        try:
            with FlopCounterMode(display=False) as fwd:
                out = call_op(info.target, bound)
            outs = [o for o in (out if isinstance(out, (list, tuple)) else (out,))
                    if isinstance(o, torch.Tensor) and o.requires_grad]
            bwd_flops = 0
            if outs and leaves:
                with FlopCounterMode(display=False) as bwd:
                    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
                bwd_flops = bwd.get_total_flops()
        except Exception as exc:
            raise RuntimeError(f"cannot count FLOPs of {info.where()}: {exc}") from exc
    return float(fwd.get_total_flops()), float(bwd_flops)
