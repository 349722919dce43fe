"""Factory ops and dtype casts (random draws, dropout included: ``_random.py``).

Factories (``arange``, ``ones``, ``zeros``, ``full``, ``new_*``, ``*_like``, ``scalar_tensor``)
read no tensor data, so their output can be laid out any way for free:

- ``ones``/``zeros``/``full``/``new_ones``/``new_zeros``/``new_full``: replicated, or split on any
  dim; the runtime passes the LOCAL shape as ``size`` (``local_args``). ``new_*`` reads only the
  dtype and device of ``self``, so ``self`` may arrive in any layout (no conversion is forced)
  and gets no gradient;
- ``arange``: replicated, or split with the ``arange_shard`` kernel, which emits this rank's run
  of the sequence (``start + step * [lo, hi)``, the rank's global index range);
- ``*_like``: the output takes the input's split dims; a ``Partial`` input gives a replicated
  output (the shape is the same on every rank, the values are not read);
- ``scalar_tensor``: a 0-d value, replicated only.
``empty``/``new_empty``/``empty_like`` are not registered: their values are undefined, so no
numerical check can hold them to anything.

Casts (``to.*``, ``_to_copy``): elementwise, so every dim maps to itself; a pending sum passes
through float-to-float casts (integer pending sums are pruned centrally).
"""

from __future__ import annotations

import torch

from autopar.layout.placement import Partial, Replicate, Shard
from autopar.strategies.kernel_context import KernelContext
from autopar.strategies.registry import AxisOption, OpInfo, Sample, register, register_kernel
from autopar.strategies.samples import ints, rand

aten = torch.ops.aten
R, P = Replicate(), Partial()


def _no_comm(info, input_specs, output_specs, mesh) -> tuple[float, float]:
    return 0.0, 0.0


def _local_size(info: OpInfo, bound, input_specs, output_specs, mesh_shape):
    bound["size"] = list(output_specs[0].local_shape(info.output.shape, mesh_shape))
    return bound


def _output_splits(info: OpInfo, **inputs) -> list[AxisOption]:
    return [info.option(Shard(d), grad_partial=[], **inputs) for d in range(info.output.ndim)]


# ----------------------------------------------------------------------------------- arange
@register_kernel("arange_shard", comm_cost=_no_comm)
def arange_shard(ctx: KernelContext, end, start=0, step=1, **options):
    """This rank's piece of ``arange``: global positions [lo, hi) of the split output dim 0."""
    sl = ctx.output_specs[0].local_slices(ctx.info.output.shape, ctx.mesh_shape, ctx.coords())[0]
    out = aten.arange.start_step(start + sl.start * step, start + sl.stop * step, step, **options)
    # Float steps may round one element more into the local range; the length is exact.
    return out[: sl.stop - sl.start]


def _arange_rule(info: OpInfo) -> list[AxisOption]:
    return [info.option(Shard(0), kernel="arange_shard")]


register(aten.arange.default, samples=lambda: [Sample((16,)), Sample((8.0,), {"dtype": torch.float64})])(_arange_rule)
register(aten.arange.start, samples=lambda: [Sample((2, 18))])(_arange_rule)
register(aten.arange.start_step, samples=lambda: [
    Sample((1, 33, 2)), Sample((0.0, 4.0, 0.25), {"dtype": torch.float64}, "float-step"),
])(_arange_rule)


# ------------------------------------------------------------------------------- filled
def _filled_rule(info: OpInfo) -> list[AxisOption]:
    return _output_splits(info)


_F64 = {"dtype": torch.float64}
register(aten.ones.default, samples=lambda: [Sample(([4, 8],), _F64)], local_args=_local_size)(_filled_rule)
register(aten.zeros.default, samples=lambda: [Sample(([4, 8],), _F64)], local_args=_local_size)(_filled_rule)
# Uninitialised memory (what ``new_empty`` becomes): the numeric check compares shapes only.
register(aten.empty.memory_format, samples=lambda: [Sample(([4, 8],), _F64)], local_args=_local_size)(_filled_rule)
register(aten.full.default, samples=lambda: [Sample(([4, 8], 2.5), _F64)], local_args=_local_size)(_filled_rule)


def _new_filled_rule(info: OpInfo) -> list[AxisOption]:
    """Any output split, whatever layout ``self`` (read for dtype and device only) arrives in."""
    src = info.input("self")
    in_placements = [R] + [Shard(d) for d in range(src.ndim)] + ([P] if src.is_float else [])
    out_placements = [R] + [Shard(d) for d in range(info.output.ndim)]
    return [info.option(o, self=i, grad_partial=[], work_split=not isinstance(o, Replicate))
            for i in in_placements for o in out_placements]


def _new_samples(*extra) -> callable:
    return lambda: [Sample((rand(4, 8), [8, 4], *extra), label="float"),
                    Sample((ints(10, 4, 8), [], *extra), {"dtype": torch.bool}, "0-d-bool")]


register(aten.new_ones.default, samples=_new_samples(), local_args=_local_size)(_new_filled_rule)
register(aten.new_zeros.default, samples=_new_samples(), local_args=_local_size)(_new_filled_rule)
register(aten.new_full.default, samples=_new_samples(3.0), local_args=_local_size)(_new_filled_rule)


def _like_rule(info: OpInfo) -> list[AxisOption]:
    options = [info.option(Shard(d), self=Shard(d), grad_partial=[]) for d in range(info.input("self").ndim)]
    return options + [info.option(R, self=P, grad_partial=[], work_split=False)]


register(aten.ones_like.default, samples=lambda: [Sample((rand(4, 8),))])(_like_rule)
register(aten.zeros_like.default, samples=lambda: [Sample((rand(4, 8),))])(_like_rule)
register(aten.full_like.default, samples=lambda: [Sample((rand(4, 8), 2.0))])(_like_rule)
# Uninitialised memory: the numeric check compares shapes only (check.UNINITIALIZED).
register(aten.empty_like.default, samples=lambda: [Sample((rand(4, 8),))])(_like_rule)


@register(aten.scalar_tensor.default, replicate_only=True, samples=lambda: [Sample((2.5,), _F64)])
def _scalar_tensor(info: OpInfo) -> list[AxisOption]:
    return []  # a 0-d value has no dim to split


# ------------------------------------------------------------------------------- casts
def _widening(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether casting ``src`` to ``dst`` is exact, so that the cast of a pending sum's summands
    adds up to the cast of the sum (a narrowing cast rounds every summand on its own)."""
    return dst.is_floating_point and torch.promote_types(src, dst) == dst


def _elementwise_rule(*, partial: bool):
    def rule(info: OpInfo) -> list[AxisOption]:
        name = info.slots[0].arg  # "self" for casts, "input" for dropout
        options = [info.option(Shard(d), **{name: Shard(d)}) for d in range(info.slots[0].meta.ndim)]
        if partial and _widening(info.slots[0].meta.dtype, info.output.dtype):
            options.append(info.option(P, work_split=False, **{name: P}))
        return options

    rule.__name__ = "cast_rule" if partial else "elementwise_rule"
    rule.__module__ = __name__
    return rule


_CPU = torch.device("cpu")


def _cast_samples(**kwargs) -> callable:
    return lambda: [Sample((rand(4, 8),), dict(kwargs, dtype=torch.float64), "same-dtype"),
                    Sample((ints(10, 4, 8),), dict(kwargs, dtype=torch.float64), "int-to-float"),
                    Sample((rand(4, 8) * 10,), dict(kwargs, dtype=torch.int64), "float-to-int"),
                    Sample((rand(4, 8) * 10,), dict(kwargs, dtype=torch.bfloat16), "narrowing")]


register(aten.to.dtype, samples=lambda: [Sample((rand(4, 8), torch.float64)),
                                         Sample((rand(4, 8) * 10, torch.int32), label="to-int"),
                                         Sample((rand(4, 8) * 10, torch.float16), label="narrowing")])(
    _elementwise_rule(partial=True))
register(aten.to.dtype_layout, samples=_cast_samples(layout=torch.strided, device=_CPU))(
    _elementwise_rule(partial=True))
register(aten._to_copy.default, samples=_cast_samples())(_elementwise_rule(partial=True))
register(aten.to.device, samples=lambda: [Sample((rand(4, 8), _CPU, torch.float64))])(_elementwise_rule(partial=True))
