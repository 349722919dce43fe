"""Normalisation over trailing dims: layer_norm, rms_norm. Local op: the same op on local shards.

Only the leading (non-normalised) dims are split: every rank normalises whole rows, the
replicated weight and bias get partial gradients (all-reduced in backward, derived centrally).
The normalised dims are not split: that needs sum/sum-of-squares all-reduces inside the op,
which no rule here implements.
"""

from __future__ import annotations

import torch

from ..spec import Shard
from .registry import AxisOption, OpInfo, Sample, register
from .samples import rand

aten = torch.ops.aten


def _leading_dim_options(info: OpInfo) -> list[AxisOption]:
    x = info.input("input")
    num_normalized = len(info.arg("normalized_shape"))
    return [info.option(Shard(d), input=Shard(d)) for d in range(x.ndim - num_normalized)]


def _layer_norm_samples() -> list[Sample]:
    return [
        Sample((rand(4, 4, 8), [8], rand(8), rand(8), 1e-5), label="affine"),
        Sample((rand(4, 4, 8), [4, 8]), label="2-dims-no-affine"),
    ]


def _rms_norm_samples() -> list[Sample]:
    return [Sample((rand(4, 4, 8), [8], rand(8), 1e-6), label="affine"),
            Sample((rand(4, 8), [8]), label="no-weight")]


register(aten.layer_norm.default, samples=_layer_norm_samples)(_leading_dim_options)
register(aten.rms_norm.default, samples=_rms_norm_samples)(_leading_dim_options)
