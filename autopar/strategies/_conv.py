"""Convolutions (plain and transposed) and the bilinear layer: channels at dim 1 of a batched input.

Convolution (``conv1d/2d/3d`` with int or string (``"same"``/``"valid"``) padding,
``conv_transpose1d/2d/3d``, ``convolution``). ``input`` (N, C_in, *spatial) or unbatched
(C_in, *spatial); ``weight`` (C_out, C_in/groups, *k), transposed (C_in, C_out/groups, *k):

- batch split: ``input`` S0 -> output S0, weight and bias replicated (their gradients partial);
- output-channel split (``groups == 1``): the weight's output-channel dim (0, transposed 1) and
  ``bias`` S0 -> output S(channel);
- input-channel split (``groups == 1``): ``input`` S(channel) and the weight's input-channel dim
  (1, transposed 0) -> output ``P``: each rank sums over its channels only. The bias is ``P``
  (it must be added once, not once per rank);
- depthwise split (``groups == C_in``): ``input`` S(channel), ``weight`` S0 (group-major in both
  layouts), ``bias`` S0 -> output S(channel); every shard holds whole groups, and the local op
  runs with ``groups / shards`` (``local_args``). Other group counts would need the split to fall
  on group boundaries, which depends on the mesh axis size, so they get no channel split;
- pending sums (the op is linear in input and in weight): ``input`` P (weight R) or ``weight`` P
  (input R), bias P -> output P, every rank doing the whole work.
Spatial dims are never split (a window straddles shard edges: it would need halo exchange).

Bilinear (``bilinear``: y[..., o] = sum_ij x1[..., i] W[o, i, j] x2[..., j] + b[o]):

- split of a leading dim: ``input1`` and ``input2`` S(d) -> output S(d);
- output-feature split: ``weight`` S0, ``bias`` S0 -> output S(-1);
- contraction splits: ``input1`` S(-1) with ``weight`` S1, or ``input2`` S(-1) with ``weight``
  S2 -> output P, the bias P;
- pending sums: the op is linear in each of input1, input2 and weight separately, so one of
  them P (the others R), bias P -> output P.
"""

from __future__ import annotations

import torch

from autopar.layout.placement import Partial, Shard
from autopar.strategies.registry import AxisOption, OpInfo, Sample, register
from autopar.strategies.samples import rand

aten = torch.ops.aten
P = Partial()

_TRANSPOSED = (aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input)


# ------------------------------------------------------------------------------ convolution
def _with_bias(info: OpInfo, placement, **inputs):
    if info.input("bias") is not None:
        inputs["bias"] = placement
    return inputs


def _is_transposed(info: OpInfo) -> bool:
    return info.target in _TRANSPOSED or bool(info.bound.get("transposed", False))


def _channel_dim(info: OpInfo) -> int:
    return 1 if info.input("input").ndim == info.input("weight").ndim else 0


def _conv_rule(info: OpInfo) -> list[AxisOption]:
    x, groups = info.input("input"), info.arg("groups")
    channel = _channel_dim(info)
    # Weight dims holding the output and the input channels.
    w_out, w_in = (1, 0) if _is_transposed(info) else (0, 1)
    options = []
    if channel == 1:
        options.append(info.option(Shard(0), input=Shard(0)))
    if groups == 1:
        options.append(info.option(Shard(channel), **_with_bias(info, Shard(0), weight=Shard(w_out))))
        options.append(info.option(P, **_with_bias(info, P, input=Shard(channel), weight=Shard(w_in))))
    elif groups == x.shape[channel]:
        options.append(info.option(Shard(channel), **_with_bias(info, Shard(0), input=Shard(channel),
                                                                 weight=Shard(0))))
    options.append(info.option(P, work_split=False, **_with_bias(info, P, input=P)))
    options.append(info.option(P, work_split=False, **_with_bias(info, P, weight=P)))
    return options


def _local_groups(info: OpInfo, bound, input_specs, output_specs, mesh_shape):
    """A depthwise split leaves ``groups / shards`` whole groups on every rank."""
    groups = info.arg("groups")
    spec = input_specs[info.slot_index("input")]
    if groups > 1 and spec is not None:
        bound["groups"] = groups // spec.num_shards(_channel_dim(info), mesh_shape)
    return bound


def _register_conv(op, samples) -> None:
    register(op, has_flops=True, samples=samples, local_args=_local_groups)(_conv_rule)


def _conv_samples(n: int):
    k, sp = [3] * n, (6, 5, 4)[:n]  # odd and even spatial sizes

    def samples() -> list[Sample]:
        return [
            Sample((rand(4, 4, *sp), rand(8, 4, *k), rand(8), [1] * n, [1] * n), label="bias-pad"),
            Sample((rand(4, 8, *sp), rand(4, 8, *[2] * n), None, [2] * n), label="stride-no-bias"),
            Sample((rand(4, 8, *sp), rand(8, 2, *[1] * n), None, [1] * n, [0] * n, [1] * n, 4), label="groups"),
            Sample((rand(4, 4, *sp), rand(8, 1, *k), rand(8), [1] * n, [1] * n, [1] * n, 4), label="depthwise"),
            Sample((rand(4, *sp), rand(8, 4, *k), rand(8)), label="unbatched"),
        ]

    return samples


def _conv_padding_samples(n: int):
    sp = (6, 5, 4)[:n]

    def samples() -> list[Sample]:
        return [
            Sample((rand(4, 4, *sp), rand(8, 4, *[3] * n), rand(8), [1] * n, "same"), label="same"),
            Sample((rand(4, 4, *sp), rand(8, 4, *[2] * n), None, [1] * n, "same", [2] * n), label="same-even-dilated"),
            Sample((rand(4, 4, *sp), rand(4, 1, *[3] * n), rand(4), [1] * n, "same", [1] * n, 4),
                   label="same-depthwise"),
            Sample((rand(4, 4, *sp), rand(8, 4, *[2] * n), rand(8), [2] * n, "valid"), label="valid"),
        ]

    return samples


def _conv_transpose_samples(n: int):
    k, sp = [3] * n, (4, 3, 2)[:n]

    def samples() -> list[Sample]:
        return [
            Sample((rand(4, 4, *sp), rand(4, 8, *k), rand(8), [2] * n, [1] * n, [1] * n), label="stride-outpad"),
            Sample((rand(4, 8, *sp), rand(8, 4, *[2] * n), None), label="no-bias"),
            Sample((rand(4, 8, *sp), rand(8, 2, *[1] * n), rand(8), [1] * n, [0] * n, [0] * n, 4), label="groups"),
            Sample((rand(4, 4, *sp), rand(4, 2, *k), rand(8), [1] * n, [0] * n, [0] * n, 4, [2] * n),
                   label="depthwise-dilated"),
            Sample((rand(4, *sp), rand(4, 8, *k), rand(8)), label="unbatched"),
        ]

    return samples


def _convolution_samples() -> list[Sample]:
    return [
        Sample((rand(4, 4, 6, 5), rand(8, 4, 3, 3), rand(8), [1, 1], [1, 1], [1, 1], False, [0, 0], 1), label="conv"),
        Sample((rand(4, 4, 4, 3), rand(4, 8, 3, 3), rand(8), [2, 2], [1, 1], [1, 1], True, [1, 1], 1),
               label="transposed"),
        Sample((rand(4, 8, 6), rand(8, 1, 3), None, [1], [1], [1], False, [0], 8), label="depthwise"),
    ]


_register_conv(aten.conv1d.default, _conv_samples(1))
_register_conv(aten.conv2d.default, _conv_samples(2))
_register_conv(aten.conv3d.default, _conv_samples(3))
_register_conv(aten.conv1d.padding, _conv_padding_samples(1))
_register_conv(aten.conv2d.padding, _conv_padding_samples(2))
_register_conv(aten.conv3d.padding, _conv_padding_samples(3))
_register_conv(aten.conv_transpose1d.default, _conv_transpose_samples(1))
_register_conv(aten.conv_transpose2d.input, _conv_transpose_samples(2))
_register_conv(aten.conv_transpose3d.input, _conv_transpose_samples(3))
_register_conv(aten.convolution.default, _convolution_samples)


# --------------------------------------------------------------------------------- bilinear
def _bilinear_rule(info: OpInfo) -> list[AxisOption]:
    out = info.output.ndim - 1
    bias = lambda p: {"bias": p} if info.input("bias") is not None else {}  # noqa: E731
    options = [info.option(Shard(d), input1=Shard(d), input2=Shard(d)) for d in range(out)]
    options += [
        info.option(Shard(out), weight=Shard(0), **bias(Shard(0))),
        info.option(P, input1=Shard(out), weight=Shard(1), **bias(P)),
        info.option(P, input2=Shard(out), weight=Shard(2), **bias(P)),
    ]
    options += [info.option(P, work_split=False, **{name: P}, **bias(P)) for name in ("input1", "input2", "weight")]
    return options


register(aten.bilinear.default, has_flops=True, samples=lambda: [
    Sample((rand(4, 4), rand(4, 8), rand(8, 4, 8), rand(8)), label="bias"),
    Sample((rand(4, 2, 4), rand(4, 2, 4), rand(4, 4, 4)), label="3-d-no-bias"),
])(_bilinear_rule)
