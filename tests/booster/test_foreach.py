"""The boosted optimizer over DTensor parameters uses torch's foreach kernels where the user left
the choice to torch (``foreach=None``), keeps an explicit ``foreach=False``, and trains like one
device either way (2 gloo ranks, the tiny MLP under a budget that shards parameters, ZeRO free)."""

from __future__ import annotations

import copy

import pytest
import torch

from autopar import zoo
from autopar.api import plan as make_plan
from autopar.booster import AutoParallelPlugin, Booster
from autopar.booster.optimizer import foreach_over_dtensors
from autopar.runtime.launch import run_local

STEPS = 3
# As the plugin matrix: Adam divides by sqrt(v) + eps, so a gradient that is zero in exact
# arithmetic but rounding in a sharded sum becomes an lr-sized step under a tiny eps.
LR, EPS = 1e-3, 1e-6


def test_foreach_is_chosen_only_where_torch_was_left_to_choose():
    groups = [{"params": [], "foreach": None}, {"params": [], "foreach": False}]
    got, kwargs = foreach_over_dtensors(torch.optim.AdamW, groups, {"lr": 1.0, "foreach": None})
    assert kwargs["foreach"] is True and [g["foreach"] for g in got] == [True, False]
    assert foreach_over_dtensors(torch.optim.AdamW, groups, {"foreach": False}) == (groups, {"foreach": False})
    from autopar.optim import Lamb

    assert foreach_over_dtensors(Lamb, groups, {}) == (groups, {})  # not one of torch's


def _train(rank, world, model, inputs, budget, foreach):
    booster = Booster(AutoParallelPlugin(memory_budget=budget, zero_stage="auto"))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, foreach=foreach)
    pm, bopt, *_ = booster.boost(model, opt, meta_inputs=inputs)
    losses = []
    for _ in range(STEPS):
        loss = pm(**inputs)[0]
        booster.backward(loss, bopt)
        bopt.step()
        bopt.zero_grad()
        losses.append(loss.item())
    return losses, [g["foreach"] for g in bopt.param_groups], pm.full_state_dict()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("foreach", [None, False])
def test_boosted_adamw_trains_like_one_device(foreach):
    torch.manual_seed(0)
    model, inputs = zoo.build("mlp", tiny=True, device="cpu", batch=4, seq=4)
    budget = int(0.6 * make_plan(model, inputs, mesh=(2,)).estimate.peak_bytes)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    want = []
    for _ in range(STEPS):
        loss = ref(**inputs)[0]
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    for losses, flags, state in run_local(_train, 2, model, inputs, budget, foreach, timeout=120):
        assert flags == [foreach is None] * len(flags)
        assert losses == pytest.approx(want, rel=1e-5), (losses, want)
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-5)
