"""In-place pointwise ops, metadata asserts and the ``wrap_with_set_grad_enabled`` region.

In-place ops (``add_``, ``mul_``, ``relu_`` ...; ResNet's residual ``add_`` and its
``num_batches_tracked += 1``): sharded like their out-of-place versions. The output aliases
``self``, whose shape is the output's, so ``self`` always carries the output's placement; the
broadcast ``other`` follows the pointwise family's rules. At run time the op mutates the local
shard (an activation or a buffer shard), which is what the global op does to that slice.

``_assert_tensor_metadata`` (emitted by export next to dtype casts) has no output: any layout of
its input is fine, so it is split on every dim (and takes ``P``). Its ``size`` argument, when
given, is rewritten to the local shape; a ``stride`` cannot be localised, so with one only
replication is offered. The planner may skip it (``registry.needs_no_decision``); the runtime
keeps it on the local shard.

``wrap_with_set_grad_enabled(enable, body, *args)`` is a higher-order op whose ``body`` is a
sub-graph run with gradients switched off (Llama's rotary cos/sin tables). The body is opaque to
the rule, so it is replicated on purpose (``replicate_only``): every input is read whole and every
output is whole, which is exact for any body. No gradient flows through it, so replication costs
no communication in backward; its inputs and outputs are small tables built from buffers.

``wrap_with_autocast(device_type, dtype, enabled, cache_enabled, body, *args)`` is a
``torch.autocast`` region inside forward (``with torch.autocast("cuda", torch.bfloat16): ...``).
Its body is opaque too and replicated the same way -- exact for any body, and gradients do flow
through it: a replicated op's input gradients are whole on every rank, nothing to reduce. Its ops
are not split (``precision="bf16"`` is the planned way to compute in 2 bytes).
"""

from __future__ import annotations

import torch
import torch.fx

from autopar.layout.placement import Partial, Replicate, Shard
from autopar.strategies._pointwise import pointwise_rule
from autopar.strategies.registry import AxisOption, OpInfo, Sample, TensorMeta, register
from autopar.strategies.samples import rand

aten = torch.ops.aten
R, P = Replicate(), Partial()


# --------------------------------------------------------------------------- in-place ops
def _all_tensors_partial(info: OpInfo) -> list[AxisOption]:
    """``add_``/``sub_``: a sum of pending sums when both operands are tensors."""
    if not isinstance(info.arg("other"), TensorMeta):
        return []  # a Python scalar would be added on every rank
    return [info.option(P, work_split=False, self=P, other=P)]


def _self_partial(info: OpInfo) -> list[AxisOption]:
    """``mul_``/``div_``: linear in ``self`` with the other operand replicated."""
    return [info.option(P, work_split=False, self=P)]


def _binary_samples() -> list[Sample]:
    return [Sample((rand(4, 8), rand(4, 8)), label="same"), Sample((rand(4, 8), rand(8)), label="broadcast"),
            Sample((rand(4, 8), 2.0), label="scalar")]


_INPLACE = {
    aten.add_.Tensor: (_binary_samples, _all_tensors_partial),
    aten.sub_.Tensor: (_binary_samples, _all_tensors_partial),
    aten.mul_.Tensor: (_binary_samples, _self_partial),
    aten.div_.Tensor: (lambda: [Sample((rand(4, 8), rand(8, positive=True)))], _self_partial),
    aten.relu_.default: (lambda: [Sample((rand(4, 8),))], None),
}
for _op, (_samples, _partial) in _INPLACE.items():
    register(_op, samples=_samples)(pointwise_rule(_partial))


# ------------------------------------------------------------------------ metadata assert
def _assert_local_size(info: OpInfo, bound, input_specs, output_specs, mesh_shape):
    if bound.get("size") is not None:
        bound["size"] = list(input_specs[0].local_shape(info.input("a").shape, mesh_shape))
    return bound


@register(aten._assert_tensor_metadata.default, local_args=_assert_local_size, samples=lambda: [
    Sample((rand(4, 8),), {"dtype": torch.float64, "device": torch.device("cpu"), "layout": torch.strided}),
    Sample((rand(4, 8), [4, 8]), label="size"),
])
def _assert_tensor_metadata(info: OpInfo) -> list[AxisOption]:
    a = info.input("a")
    if info.arg("stride") is not None:
        return []
    options = [info.option(None, a=Shard(d)) for d in range(a.ndim)]
    return options + [info.option(None, work_split=False, a=P)]


# ----------------------------------------------------------------- grad-disabled regions
def _rotary_body(positions, inv_freq):
    freqs = positions.unsqueeze(-1).to(inv_freq.dtype) * inv_freq
    table = torch.cat([freqs, freqs], dim=-1)
    return table.cos(), table.sin()


def _wrap_samples() -> list[Sample]:
    body = torch.fx.symbolic_trace(_rotary_body)
    return [Sample((False, body, torch.arange(16).view(1, 16), rand(8)), label="rotary")]


@register(torch.ops.higher_order.wrap_with_set_grad_enabled, replicate_only=True, samples=_wrap_samples)
def _wrap_with_set_grad_enabled(info: OpInfo) -> list[AxisOption]:
    return []  # an opaque body: replicated (the all-replicate option is added centrally)


def _autocast_body(x, weight):
    return torch.nn.functional.linear(x, weight).relu()


def _autocast_samples() -> list[Sample]:
    body = torch.fx.symbolic_trace(_autocast_body)
    return [Sample(("cpu", torch.bfloat16, True, False, body, rand(8, 4), rand(4, 4)), label="linear-relu")]


@register(torch.ops.higher_order.wrap_with_autocast, replicate_only=True, samples=_autocast_samples)
def _wrap_with_autocast(info: OpInfo) -> list[AxisOption]:
    return []  # an opaque body: replicated (the all-replicate option is added centrally)
