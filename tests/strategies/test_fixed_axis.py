"""``enumerate_strategies(fixed=)``: one mesh axis pinned (mesh="auto"'s restricted 3-axis plans)."""

from __future__ import annotations

import pytest
import torch

from autopar.layout.mesh import MeshSpec
from autopar.layout.placement import Partial, Replicate, Shard
from autopar.strategies import axis_placements, enumerate_strategies
from autopar.strategies.check import reference
from autopar.strategies.samples import rand
from autopar.strategies.registry import Sample

aten = torch.ops.aten
R = Replicate()


def _all(target, sample, shape, **kwargs):
    info, _ = reference(target, sample)
    return info, enumerate_strategies(info, MeshSpec.preset("cpu", shape), flops=(1e9, 2e9), **kwargs)


@pytest.mark.parametrize("target, sample", [
    (aten.mm.default, Sample((rand(8, 8), rand(8, 8)))),
    (aten.add.Tensor, Sample((rand(4, 8), rand(4, 8)))),
    (aten.sum.dim_IntList, Sample((rand(4, 8), [1]))),
])
def test_pinning_an_axis_keeps_exactly_the_strategies_placing_so_on_it(target, sample):
    info, full = _all(target, sample, (2, 2, 2))
    for axis in range(3):
        for pin in {axis_placements(s, axis) for s in full}:
            _, kept = _all(target, sample, (2, 2, 2), fixed=pin)
            want = [s for s in full if axis_placements(s, axis) == pin]
            assert [s.name for s in kept] == [s.name for s in want]  # same order, same costs
            assert [(s.compute_s, s.comm_s) for s in kept] == [(s.compute_s, s.comm_s) for s in want]


def test_a_pin_from_another_mesh_maps_onto_an_axis_of_the_same_size():
    info, two = _all(aten.mm.default, Sample((rand(8, 8), rand(8, 8))), (2, 4))
    row = next(s for s in two if s.name == "RS1 x RS0 -> RP")  # row-parallel over axis 1 (size 4)
    on_axis, ins, outs = axis_placements(row, 1)
    assert on_axis == 1 and ins == (Shard(1), Shard(0)) and outs == (Partial(),)
    _, kept = _all(aten.mm.default, Sample((rand(8, 8), rand(8, 8))), (2, 2, 4), fixed=(2, ins, outs))
    assert kept and all(axis_placements(s, 2)[1:] == (ins, outs) for s in kept)
    with pytest.raises(ValueError, match="places its tensors"):
        _all(aten.mm.default, Sample((rand(8, 8), rand(8, 8))), (2, 2, 4), fixed=(2, (Shard(1), R), (R,)))
    with pytest.raises(ValueError, match="1 inputs / 1 outputs given"):
        _all(aten.mm.default, Sample((rand(8, 8), rand(8, 8))), (2, 2, 4), fixed=(2, (R,), (R,)))
