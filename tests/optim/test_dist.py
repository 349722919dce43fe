"""autopar.optim._dist: layouts read from DTensors, this rank's block along a dim (uneven and
nested shards, DTensor's left-to-right order), batched partial sums; and every optimizer on a
3-D mesh."""

from __future__ import annotations

import pytest
import torch

from autopar.optim import CAME, Adafactor, GaLoreAdamW, Lamb
from autopar.optim._dist import SumReducer, layout_of, local_range
from autopar.runtime.launch import run_local

from .harness import TIMEOUT, all_reduces, run_distributed

SPECS_3D = [
    ((7, 6), ("S0", "S0", "S0")), ((9,), ("S0", "R", "S0")), ((6, 10), ("S1", "S0", "R")),
    ((5, 4, 6), ("R", "S2", "S0")), ((4, 9), ("S1", "S1", "S0")), ((3, 5), ("R", "R", "R")),
]


def _blocks_body(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (2, 2, 2))
    cases = [((7, 6), (Shard(0), Shard(0), Shard(0))), ((11, 3), (Shard(0), Replicate(), Shard(0))),
             ((5, 9), (Shard(1), Shard(0), Shard(1))), ((2, 3, 13), (Replicate(), Shard(2), Shard(2))),
             ((3,), (Shard(0), Shard(0), Shard(0)))]  # 3 over 8 ranks: most blocks empty
    red, expect = SumReducer(), []
    for shape, placements in cases:
        full = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
        d = distribute_tensor(full.clone(), mesh, placements, src_data_rank=None)
        layout = layout_of(d)
        index = tuple(slice(*local_range(layout, n, dim)) for dim, n in enumerate(shape))
        assert torch.equal(d.to_local(), full[index]), (shape, placements, index)
        # full sums over dim 0 and over everything, from the local block's partial sums
        red.add(d.to_local().sum(dim=0), layout, layout.over(0))
        expect.append(full.sum(dim=0)[index[1:]])
        red.add(d.to_local().sum(), layout, layout.all())
        expect.append(full.sum())
    with CommDebugMode() as comm:
        got = red.run()
    for g, e in zip(got, expect):
        torch.testing.assert_close(g, e)
    try:
        layout_of(DTensor.from_local(torch.ones(4), mesh, (Partial(), Replicate(), Replicate()),
                                     run_check=False))
    except ValueError as e:
        partial = str(e)
    else:
        partial = ""
    return comm.get_total_counts(), partial


def test_blocks_and_sums_match_dtensor_on_a_3d_mesh():
    for calls, partial in run_local(_blocks_body, 8, timeout=TIMEOUT):
        # ten partial sums over the distinct mesh-dim sets {0,1,2} {0,2} {1} {1,2} (the dim-0
        # sums of 2x3x13 need none): one call per mesh dim of each set, not per tensor
        assert calls == 3 + 2 + 1 + 2, calls
        assert "Partial" in partial, partial


def test_plain_tensors_need_no_process_group():
    layout = layout_of(torch.ones(3, 4))
    assert layout.mesh is None and not layout.is_sharded and layout.over(0, 1) == ()
    assert local_range(layout, 4, 1) == (0, 4)
    red = SumReducer()
    i = red.add(torch.tensor([1.0, 2.0]), layout, ())
    assert torch.equal(red.run()[i], torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("make_opt", [
    lambda ps: Lamb(ps, lr=0.05, weight_decay=0.1),
    lambda ps: Adafactor(ps, weight_decay=0.1),
    lambda ps: CAME(ps, lr=1e-2, weight_decay=0.1),
    lambda ps: GaLoreAdamW(ps, lr=0.02, rank=2, update_proj_gap=3),
], ids=["lamb", "adafactor", "came", "galore"])
def test_optimizers_on_a_3d_mesh(make_opt):
    counts = run_distributed(make_opt, (2, 2, 2), SPECS_3D, steps=3)
    for one, two in counts[1:]:  # GaLore gathers on step 1 (its refresh); all-reduces never grow
        assert one == two, (one, two)
    assert all(all_reduces(one) == all_reduces(two) > 0 for one, two in counts), counts
