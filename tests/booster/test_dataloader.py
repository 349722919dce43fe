"""``prepare_dataloader``: one seeded global order on every rank, and each rank loading only its
slice of every batch when the plan splits every input's batch dim the same way.

The planner often leaves inputs replicated (a local split of a replicated input costs nothing,
so input layouts are a tie), so the per-rank path is driven here by a plan whose input layouts
are set to the batch split (what a user would load with ``AutoParallelPlugin(plan=...)``): the
MLP on 2 ranks then loads half of each global batch per rank and trains exactly like one device.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from autopar import zoo
from autopar.api import plan as make_plan
from autopar.booster import AutoParallelPlugin
from autopar.booster.dataloader import GlobalBatchSampler, batch_split
from autopar.layout.placement import TensorSpec
from autopar.runtime.launch import run_local

BATCH, STEPS, MAX_NORM = 8, 3, 0.3


def test_global_order_is_seeded_and_pieces_are_contiguous_slices():
    sampler = GlobalBatchSampler(20, 4, shuffle=True, seed=5, drop_last=True)
    again = GlobalBatchSampler(20, 4, shuffle=True, seed=5, drop_last=True)
    batches = list(sampler)
    assert batches == list(again) and len(batches) == len(sampler) == 5
    assert sorted(i for b in batches for i in b) == list(range(20))
    assert batches != [list(range(i, i + 4)) for i in range(0, 20, 4)]  # shuffled
    sampler.set_epoch(1)
    assert list(sampler) != batches  # another epoch, another order
    sampler.set_epoch(0)
    sampler.piece = (1, 2)
    assert list(sampler) == [b[2:] for b in batches]
    assert len(GlobalBatchSampler(10, 4, shuffle=False, seed=0, drop_last=False)) == 3
    assert list(GlobalBatchSampler(10, 4, shuffle=False, seed=0, drop_last=False))[-1] == [8, 9]


def test_batch_split_rule():
    s = TensorSpec.parse
    shapes = {"x": (8, 16, 4), "labels": (8, 16)}
    # both split along the batch by axis 0 of a (2, 2) mesh: the rank at coordinate (1, 0) loads piece 1 of 2
    assert batch_split({"x": s("S0R"), "labels": s("S0R")}, shapes, 8, (2, 2), (1, 0)) == (1, 2)
    # by both axes, axis 0 the major digit
    assert batch_split({"x": s("S0S0"), "labels": s("S0S0")}, shapes, 8, (2, 2), (1, 1)) == (3, 4)
    assert batch_split({"x": s("RR"), "labels": s("RR")}, shapes, 8, (2, 2), (1, 1)) == (0, 1)  # whole batch
    assert batch_split({"x": s("S0R"), "labels": s("RR")}, shapes, 8, (2, 2), (0, 0)) is None  # disagree
    assert batch_split({"x": s("S0S1"), "labels": s("S0R")}, shapes, 8, (2, 2), (0, 0)) is None  # not dim 0
    assert batch_split({"x": s("S0R")}, shapes, 8, (2, 2), (0, 0)) is None  # labels has no layout
    assert batch_split({"x": s("S0R"), "labels": s("S0R")}, shapes, 4, (2, 2), (0, 0)) is None  # not batched


def test_prepare_dataloader_rejects_bad_arguments():
    plugin = AutoParallelPlugin()
    data = torch.utils.data.TensorDataset(torch.zeros(4, 2))
    for kwargs, match in (({"batch_size": 0}, "batch_size"), ({"batch_size": 2, "seed": "x"}, "seed"),
                          ({"batch_size": 2, "shuffle": 1}, "shuffle"),
                          ({"batch_size": 2, "sampler": None}, "sampler")):
        with pytest.raises(ValueError, match=match):
            plugin.prepare_dataloader(data, **kwargs)
    with pytest.raises(ValueError, match="map-style"):
        plugin.prepare_dataloader(Stream(), 2)


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(3))

    def __len__(self) -> int:
        return 3


class Samples(torch.utils.data.Dataset):
    def __init__(self, x: torch.Tensor, labels: torch.Tensor) -> None:
        self.x, self.labels = x, labels

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.labels[i]}


def _train(rank, world, model, dataset, plan):
    from autopar.booster import Booster

    plugin = AutoParallelPlugin(plan=plan, max_norm=MAX_NORM)
    booster = Booster(plugin)
    loader = plugin.prepare_dataloader(dataset, BATCH // world, shuffle=True, seed=3, drop_last=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pm, opt, _, loader, _ = booster.boost(model, opt, dataloader=loader)
    losses, rows = [], []
    for batch in loader:
        rows.append(batch["x"].shape[0])
        loss = pm(**batch)[0]
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    # boosting again with the same loader takes its meta inputs from a GLOBAL batch again
    again, *_ = booster.boost(model, dataloader=loader)
    assert again.local_inputs and [b["x"].shape[0] for b in loader] == rows
    return pm.local_inputs, rows, losses


@pytest.mark.timeout(120)
def test_each_rank_loads_its_slice_of_a_batch_split_plan():
    torch.manual_seed(0)
    model, inputs = zoo.build("mlp", tiny=True, device="cpu", batch=BATCH, seq=4)
    n = BATCH * STEPS
    dataset = Samples(torch.randn(n, *inputs["x"].shape[1:]), torch.randint(0, 32, (n, 4)))
    base = make_plan(model, inputs, mesh=(2,))
    split = {"input": ("S0",)}
    plan = dataclasses.replace(base, nodes=tuple(
        dataclasses.replace(node, output_specs=split[node.kind]) if node.kind in split else node
        for node in base.nodes))
    ref, opt = copy.deepcopy(model), None
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    want = []
    for indices in GlobalBatchSampler(n, BATCH, shuffle=True, seed=3, drop_last=True):
        loss = ref(dataset.x[indices], dataset.labels[indices])[0]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    for local_inputs, rows, losses in run_local(_train, 2, model, dataset, plan, timeout=100):
        assert local_inputs and rows == [BATCH // 2] * STEPS  # half of every global batch per rank
        assert losses == pytest.approx(want, rel=1e-4)
