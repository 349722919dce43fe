"""Issue 29: ``prepare_dataloader(dataset, batch_size=8)`` means 8 samples per DATA-PARALLEL rank.

On 2 gloo ranks the global batch is 16 (``batch_size x world size / pp_size``): the loader
yields 16-sample global batches before ``boost``; under a plan that splits the batch each rank
loads its 8; rank 0 (only) prints the global batch in one line; ``shuffle``/``seed`` give one
order on every rank and ``drop_last``, ``pin_memory``, ``num_workers`` and other keywords keep
their ``DataLoader`` meaning. Before the fix 8 samples made one global step on any world size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io

import pytest
import torch

from autopar import zoo
from autopar.api import plan as make_plan
from autopar.booster import AutoParallelPlugin, Booster
from autopar.booster.dataloader import GlobalBatchSampler
from autopar.runtime.launch import run_local
from tests.booster.test_dataloader import Samples

PER_RANK, SAMPLES = 8, 40


def collate_tagged(samples):  # a keyword DataLoader receives as it is
    out = torch.utils.data.default_collate(samples)
    out["x"] = out["x"] + 0  # a real collate step: the batch still a dict of stacked tensors
    return out


def _load(rank, world, model, dataset, plan):
    plugin = AutoParallelPlugin(plan=plan)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        loader = plugin.prepare_dataloader(dataset, batch_size=PER_RANK, shuffle=True, seed=3, drop_last=True,
                                           pin_memory=False, num_workers=0, collate_fn=collate_tagged)
    settings = (loader.pin_memory, loader.num_workers, loader.collate_fn is collate_tagged)
    before = [b["x"].shape[0] for b in loader]
    first_labels = next(iter(loader))["labels"]
    pm, _, _, loader, _ = Booster(plugin).boost(model, dataloader=loader)
    after = [b["x"].shape[0] for b in loader]
    loss = pm(**next(iter(loader)))[0].item()  # the split module takes this rank's piece
    return {"printed": printed.getvalue(), "settings": settings, "before": before, "after": after,
            "local": pm.local_inputs, "first_labels": first_labels, "loss": loss, "dp": plugin.data_parallel_size()}


@pytest.mark.timeout(120)
def test_batch_size_is_per_data_parallel_rank_on_2_ranks():
    torch.manual_seed(0)
    world, global_batch = 2, 2 * PER_RANK
    model, inputs = zoo.build("mlp", tiny=True, device="cpu", batch=global_batch, seq=4)
    dataset = Samples(torch.randn(SAMPLES, *inputs["x"].shape[1:]), torch.randint(0, 32, (SAMPLES, 4)))
    base = make_plan(model, inputs, mesh=(world,))
    plan = dataclasses.replace(base, nodes=tuple(  # inputs split along the batch: each rank loads its piece
        dataclasses.replace(node, output_specs=("S0",)) if node.kind == "input" else node for node in base.nodes))
    order = next(iter(GlobalBatchSampler(SAMPLES, global_batch, shuffle=True, seed=3, drop_last=True)))
    steps = SAMPLES // global_batch  # drop_last: 2 full global batches of 16, the 8 left over dropped
    want_loss = model(dataset.x[order], dataset.labels[order])[0].item()
    results = run_local(_load, world, model, dataset, plan, timeout=100)
    for rank, res in enumerate(results):
        assert res["dp"] == world
        assert res["before"] == [global_batch] * steps, res["before"]  # 8 per rank x 2 ranks
        assert res["local"] and res["after"] == [PER_RANK] * steps, res["after"]
        assert torch.equal(res["first_labels"], dataset.labels[order])  # one seeded order on every rank
        assert res["settings"] == (False, 0, True)
        assert res["loss"] == pytest.approx(want_loss, rel=1e-5)  # the loss of the whole 16-sample batch
        lines = res["printed"].splitlines()
        if rank == 0:
            assert len(lines) == 1 and f"global batch of {global_batch} samples" in lines[0], lines
        else:
            assert lines == [], lines


def test_single_process_keeps_batch_size_and_rejects_bad_pp():
    loader = AutoParallelPlugin().prepare_dataloader(list(range(10)), batch_size=4, drop_last=False)
    assert [len(b) for b in loader] == [4, 4, 2]
    assert AutoParallelPlugin(mesh=(2, 2), pp_size=2).data_parallel_size() == 2  # before dist starts: the mesh
