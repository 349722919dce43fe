"""Resampling: upsampling (nearest, linear, bilinear, bicubic, trilinear, anti-aliased), pixel
(un)shuffle, channel shuffle, im2col / col2im (``nn.Unfold`` / ``nn.Fold``).

All of these are linear in their input, so every op also offers ``self`` P -> output P (each
rank resamples its summand; ``work_split=False``). Local op: the same op on local shards with
its arguments unchanged -- no split below touches a dim that an argument (``output_size``,
``kernel_size`` ...) describes.

Upsampling (``upsample_*`` / ``_upsample_*``, ``.vec`` and ``.default``; ``input`` (N, C,
*spatial)): batch and channel split, ``input`` S(d) -> output S(d): every output plane is
interpolated from its own input plane. Spatial dims are not split (interpolation windows cross
shard edges, and fractional scales do not map input blocks onto output blocks).

Pixel shuffle (``pixel_shuffle(r)``: (*, C r^2, H, W) -> (*, C, H r, W r), output[c, h r + i,
w r + j] = input[c r^2 + i r + j, h, w]) and its inverse ``pixel_unshuffle``: EVERY dim splits,
``self`` S(d) -> output S(d). A contiguous block of output channels comes from a contiguous block
of input channels (C r^2 / n of them), and a block of H / n input rows from a block of H r / n
output rows; the central check that both the input and the output dim divide by the shard count
is exactly the condition for these blocks to line up.

Channel shuffle (``channel_shuffle(g)``: (N, C, *), output channel
c' g + i = input channel i C / g + c'): every dim but the channels splits; a block of output
channels gathers channels from all g input blocks, so the channel dim is not split.

im2col (``self`` (N, C, H, W) or (C, H, W) -> (N, C kh kw, L)) and col2im (the inverse): batch
split, and channel split ``S(C)`` <-> ``S(C kh kw)``: the column dim is channel-major, so a block
of C / n channels is a block of C kh kw / n columns. The spatial dims (and L) are not split.
"""

from __future__ import annotations

import torch

from autopar.layout.placement import Partial, Shard
from autopar.strategies.registry import AxisOption, OpInfo, Sample, register
from autopar.strategies.samples import rand

aten = torch.ops.aten
P = Partial()


def _input_name(info: OpInfo) -> str:
    """``.vec`` overloads call the tensor ``input``, the others ``self``."""
    return "self" if "self" in info.bound else "input"


def _linear(info: OpInfo) -> AxisOption:
    return info.option(P, work_split=False, **{_input_name(info): P})


def _same_dim_rule(dims_of):
    """``input`` S(d) -> output S(d) for every d in ``dims_of(info)``, plus P -> P."""

    def rule(info: OpInfo) -> list[AxisOption]:
        name = _input_name(info)
        return [info.option(Shard(d), **{name: Shard(d)}) for d in dims_of(info)] + [_linear(info)]

    rule.__name__ = f"{dims_of.__name__}_rule"
    rule.__module__ = __name__
    return rule


# ------------------------------------------------------------------------------- upsampling
def _make_leading_dims(num_spatial: int):
    def leading(info: OpInfo) -> range:
        return range(info.input(_input_name(info)).ndim - num_spatial)

    leading.__name__ = f"leading_of_{num_spatial}d"
    return leading


def _upsample_samples(n: int, *, align_corners: bool | None, overload: str):
    """Samples for one overload: ``.vec`` (output_size | scale_factors) or ``.default``."""
    flag = () if align_corners is None else (align_corners,)
    sp = (4, 3, 2)[:n]

    def samples() -> list[Sample]:
        if overload == "vec":
            out = [Sample((rand(4, 4, *sp), None, *flag, [2.0] * n), label="scale-2"),
                   Sample((rand(4, 4, *sp), [5, 4, 3][:n], *flag, None), label="output-size")]
            if align_corners is not None:  # the other corner mode, fractional scale
                out.append(Sample((rand(4, 4, *sp), None, not align_corners, [1.5] * n), label="scale-1.5"))
            return out
        scales = [2.0] * n
        return [Sample((rand(4, 4, *sp), [2 * s for s in sp], *flag, *scales), label="scale-2"),
                Sample((rand(4, 4, *sp), [5, 4, 3][:n], *flag), label="output-size")]

    return samples


_UPSAMPLE = [  # (overload packet, spatial dims, has align_corners)
    (aten.upsample_nearest1d, 1, False), (aten.upsample_nearest2d, 2, False), (aten.upsample_nearest3d, 3, False),
    (aten._upsample_nearest_exact1d, 1, False), (aten._upsample_nearest_exact2d, 2, False),
    (aten._upsample_nearest_exact3d, 3, False),
    (aten.upsample_linear1d, 1, True), (aten.upsample_bilinear2d, 2, True), (aten.upsample_bicubic2d, 2, True),
    (aten.upsample_trilinear3d, 3, True), (aten._upsample_bilinear2d_aa, 2, True),
    (aten._upsample_bicubic2d_aa, 2, True),
]
for _packet, _n, _corners in _UPSAMPLE:
    _rule = _same_dim_rule(_make_leading_dims(_n))
    for _overload in ("vec", "default"):
        _samples = _upsample_samples(_n, align_corners=_corners if _corners else None, overload=_overload)
        register(getattr(_packet, _overload), samples=_samples)(_rule)


# ---------------------------------------------------------------------- pixel / channel shuffle
def every_dim(info: OpInfo) -> range:
    return range(info.input("self").ndim)


def all_but_channels(info: OpInfo) -> list[int]:
    return [d for d in range(info.input("self").ndim) if d != 1]


register(aten.pixel_shuffle.default, samples=lambda: [
    Sample((rand(4, 16, 4, 4), 2), label="r-2"),
    Sample((rand(2, 4, 36, 4, 8), 3), label="r-3-5-d"),
])(_same_dim_rule(every_dim))
register(aten.pixel_unshuffle.default, samples=lambda: [
    Sample((rand(4, 4, 8, 8), 2), label="r-2"),
    Sample((rand(2, 4, 4, 12, 24), 3), label="r-3-5-d"),
])(_same_dim_rule(every_dim))
register(aten.channel_shuffle.default, samples=lambda: [
    Sample((rand(4, 8, 4, 4), 2), label="2-groups"),
    Sample((rand(4, 12, 8), 3), label="3-groups-3-d"),
])(_same_dim_rule(all_but_channels))


# -------------------------------------------------------------------------- im2col / col2im
def _im2col_rule(info: OpInfo) -> list[AxisOption]:
    batched = info.input("self").ndim == 4
    options = [info.option(Shard(0), self=Shard(0))] if batched else []
    channel = 1 if batched else 0
    return options + [info.option(Shard(channel), self=Shard(channel)), _linear(info)]


def _col2im_rule(info: OpInfo) -> list[AxisOption]:
    batched = info.input("self").ndim == 3
    options = [info.option(Shard(0), self=Shard(0))] if batched else []
    channel = 1 if batched else 0
    return options + [info.option(Shard(channel), self=Shard(channel)), _linear(info)]


register(aten.im2col.default, samples=lambda: [
    Sample((rand(4, 4, 5, 4), [2, 2], [1, 1], [0, 0], [1, 1]), label="k2"),
    Sample((rand(4, 4, 6, 6), [3, 2], [2, 1], [1, 0], [2, 1]), label="dilation-pad-stride"),
    Sample((rand(4, 5, 5), [2, 2], [1, 1], [0, 0], [1, 1]), label="unbatched"),
])(_im2col_rule)
register(aten.col2im.default, samples=lambda: [
    Sample((rand(4, 16, 12), [5, 4], [2, 2], [1, 1], [0, 0], [1, 1]), label="k2"),
    Sample((rand(4, 24, 10), [6, 6], [3, 2], [2, 1], [1, 0], [2, 1]), label="dilation-pad-stride"),
    Sample((rand(16, 16), [5, 5], [2, 2], [1, 1], [0, 0], [1, 1]), label="unbatched"),
])(_col2im_rule)
