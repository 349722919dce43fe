"""Pooling over the trailing 1, 2 or 3 spatial dims: max, average, adaptive max and average.

Input (``self``): (*leading, *spatial) with ``leading`` = (N, C) batched or (C,) unbatched.
Local op: the same op on local shards, with its arguments unchanged (they hold only window and
spatial sizes, and spatial dims are never split).

- split of any leading dim (batch, channels): ``self`` S(d) -> every output S(d). Each output
  element reads one (sample, channel) plane only, so the local op computes exactly the rows of
  its shard. The ``indices`` output of the max pools (``max_poolNd_with_indices``,
  ``adaptive_max_poolNd``) holds flat positions INSIDE a spatial plane, the same on every rank.
- average pools (plain and adaptive) are linear: ``self`` P -> output P (every rank pools its
  summand; ``work_split=False``, each rank does the whole work). Max pools are not linear.
Spatial dims are never split: a window that straddles a shard edge would need a halo exchange
(and adaptive windows depend on the global spatial size).

``lp_pool`` and ``local_response_norm`` are not ATen ops in the traced graph: they decompose
into pointwise ops and ``avg_poolNd`` (LRN through a 3-D average pool over (C, H, W)).
"""

from __future__ import annotations

import torch

from autopar.layout.placement import Partial, Shard
from autopar.strategies.registry import AxisOption, OpInfo, Sample, register
from autopar.strategies.samples import rand

aten = torch.ops.aten
P = Partial()


def _pool_rule(*, linear: bool, num_spatial: int):
    def rule(info: OpInfo) -> list[AxisOption]:
        ndim = info.input("self").ndim
        num_outputs = len(info.outputs)
        options = []
        for d in range(ndim - num_spatial):
            out = Shard(d) if num_outputs == 1 else (Shard(d),) * num_outputs
            options.append(info.option(out, self=Shard(d)))
        if linear:
            options.append(info.option(P, work_split=False, self=P))
        return options

    rule.__name__ = f"{'average' if linear else 'max'}_pool{num_spatial}d_rule"
    rule.__module__ = __name__
    return rule


# ----------------------------------------------------------------------------------- samples
def _shape(num_spatial: int, size: int = 4, batched: bool = True) -> tuple[int, ...]:
    return ((4, 4) if batched else (4,)) + (size,) * num_spatial


def _max_samples(n: int) -> list[Sample]:
    return [
        Sample((rand(*_shape(n, 8 if n < 3 else 5)), [3] * n, [2] * n, [1] * n), label="stride-pad"),
        Sample((rand(*_shape(n, 6 if n < 3 else 5)), [2] * n, [2] * n, [0] * n, [2] * n, True),
               label="dilation-ceil"),
        Sample((rand(*_shape(n, batched=False)), [2] * n), label="unbatched"),
    ]


def _avg_samples(n: int) -> list[Sample]:
    samples = [
        Sample((rand(*_shape(n, 8 if n < 3 else 5)), [3] * n, [2] * n, [1] * n), label="pad"),
        Sample((rand(*_shape(n, 5)), [2] * n, [2] * n, [1] * n, True, False), label="ceil-no-count-pad"),
        Sample((rand(*_shape(n, batched=False)), [2] * n), label="unbatched"),
    ]
    if n > 1:  # avg_pool1d has no divisor_override
        samples.append(Sample((rand(*_shape(n)), [2] * n, [2] * n, [0] * n, False, True, 3), label="divisor"))
    return samples


def _adaptive_samples(n: int) -> list[Sample]:
    return [
        Sample((rand(*_shape(n)), [1] * n), label="global"),
        Sample((rand(*_shape(n, 6 if n < 3 else 5)), [3, 2, 4][:n]), label="uneven-windows"),
        Sample((rand(*_shape(n, batched=False)), [2] * n), label="unbatched"),
    ]


def _register(op, samples, *, linear: bool, num_spatial: int) -> None:
    register(op, samples=lambda: samples(num_spatial))(_pool_rule(linear=linear, num_spatial=num_spatial))


for _n, (_max, _max_idx, _avg, _adaptive_avg, _adaptive_max) in {
    1: (aten.max_pool1d, aten.max_pool1d_with_indices, aten.avg_pool1d, aten.adaptive_avg_pool1d,
        aten.adaptive_max_pool1d),
    2: (aten.max_pool2d, aten.max_pool2d_with_indices, aten.avg_pool2d, aten.adaptive_avg_pool2d,
        aten.adaptive_max_pool2d),
    3: (aten.max_pool3d, aten.max_pool3d_with_indices, aten.avg_pool3d, aten.adaptive_avg_pool3d,
        aten.adaptive_max_pool3d),
}.items():
    _register(_max.default, _max_samples, linear=False, num_spatial=_n)
    _register(_max_idx.default, _max_samples, linear=False, num_spatial=_n)
    _register(_avg.default, _avg_samples, linear=True, num_spatial=_n)
    _register(_adaptive_avg.default, _adaptive_samples, linear=True, num_spatial=_n)
    _register(_adaptive_max.default, _adaptive_samples, linear=False, num_spatial=_n)


# ------------------------------------------------------------------------- fractional max pool
# ``fractional_max_poolNd(self (N, C, *spatial), kernel_size, output_size, random_samples (N, C, n))``:
# the pseudo-random window offsets are an INPUT, one row per (sample, channel) plane, so a batch or
# channel split that splits ``random_samples`` alike is exact (both outputs follow).
def _fractional_rule(info: OpInfo) -> list[AxisOption]:
    num_spatial = len(info.arg("output_size"))
    if info.input("self").ndim != num_spatial + 2:
        return []  # unbatched: (C, *spatial) with samples (1, C, n) -- only channels could split
    return [info.option((Shard(d), Shard(d)), self=Shard(d), random_samples=Shard(d)) for d in (0, 1)]


def _fractional_samples(n: int):
    def samples() -> list[Sample]:
        gen = torch.Generator().manual_seed(7)
        offsets = torch.rand(4, 4, n, generator=gen, dtype=torch.float64)
        return [Sample((rand(4, 4, *(8,) * n), [2] * n, [4] * n, offsets), label=f"{n}d",
                       no_grad=("random_samples",))]
    return samples


register(aten.fractional_max_pool2d.default, samples=_fractional_samples(2))(_fractional_rule)
register(aten.fractional_max_pool3d.default, samples=_fractional_samples(3))(_fractional_rule)
