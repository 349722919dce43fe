"""AutoParallelPlugin's Gemini knobs through Booster.boost on real gloo processes.

GPT-2 tiny on 2 ranks, ``placement_policy='static'`` with all optimizer state and half the
parameter chunks on the host: 3 AdamW steps through the booster equal single-device training;
``save_model`` / ``save_optimizer`` then a freshly boosted (differently seeded) model loads both
and its next 2 steps equal the uninterrupted run's (masters and moments came back into the chunks).
"""

from __future__ import annotations

import copy

import pytest
import torch

from autopar import zoo
from autopar.booster import AutoParallelPlugin, Booster
from autopar.runtime.launch import run_local

LR, EPS = 1e-3, 1e-5
KNOBS = dict(placement_policy="static", offload_optim_frac=1.0, offload_param_frac=0.5,
             chunk_search_range=(1024, 1024, 1024), mesh=(2,))


def _model(seed=0):
    torch.manual_seed(seed)
    return zoo.build("gpt2", tiny=True, batch=4, seq=16, device="cpu")


def _boosted(model, inputs, plan=None):
    booster = Booster(AutoParallelPlugin(**KNOBS, plan=plan))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    pm, bopt, *_ = booster.boost(model, opt, meta_inputs=inputs)
    return booster, pm, bopt


def _body(rank, world, model, inputs, other, path):
    booster, pm, opt = _boosted(copy.deepcopy(model), inputs)
    for _ in range(3):
        booster.backward(pm(**inputs).loss, opt)
        opt.step()
        opt.zero_grad()
    first = pm.full_state_dict()
    booster.save_model(pm, f"{path}/model")
    booster.save_optimizer(opt, f"{path}/optim")
    booster2, pm2, opt2 = _boosted(other, inputs, plan=pm.plan)  # no second solve
    booster2.load_model(pm2, f"{path}/model")
    booster2.load_optimizer(opt2, f"{path}/optim")
    for _ in range(2):
        booster2.backward(pm2(**inputs).loss, opt2)
        opt2.step()
        opt2.zero_grad()
    tiers = [(c.home, c.optim_tier) for c in pm2.gemini.manager.chunks]
    return first, pm2.full_state_dict(), tiers, pm2.gemini.summary()


def test_boost_with_offload_trains_and_checkpoints_like_one_device(tmp_path):
    model, inputs = _model()
    other, _ = _model(seed=1)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    want = []
    for _ in range(5):
        ref(**inputs).loss.backward()
        opt.step()
        opt.zero_grad()
        want.append({k: v.detach().clone() for k, v in ref.state_dict().items()})
    for first, last, tiers, summary in run_local(_body, 2, model, inputs, other, str(tmp_path), timeout=240):
        assert {o for _, o in tiers} == {"host"} and {"host", "device"} == {h for h, _ in tiers}, tiers
        for got, ref_state in ((first, want[2]), (last, want[4])):
            for k, v in got.items():
                assert torch.allclose(v, ref_state[k], rtol=1e-4, atol=1e-5), k
        assert summary["peak_device_bytes"] > 0 and summary["host_bytes"] > 0


def test_gemini_knobs_are_checked():
    with pytest.raises(ValueError, match="placement_policy must be None, 'static' or 'auto', got 'cuda'"):
        AutoParallelPlugin(placement_policy="cuda")
    with pytest.raises(ValueError, match="go with placement_policy"):
        AutoParallelPlugin(offload_optim_frac=0.5)
    with pytest.raises(ValueError, match="zero_stage must be 'auto' or 0"):
        AutoParallelPlugin(placement_policy="static", zero_stage=2)
    with pytest.raises(ValueError, match="shard_param_frac"):
        AutoParallelPlugin(placement_policy="static", shard_param_frac=0.5)
    with pytest.raises(ValueError, match=r"chunk_search_range must be \(min, max, step\)"):
        AutoParallelPlugin(placement_policy="static", chunk_search_range=(1, 2))
    with pytest.raises(ValueError, match="needs memory_budget off CUDA"):
        AutoParallelPlugin(placement_policy="auto").gemini_policy("cpu")
    plugin = AutoParallelPlugin(placement_policy="auto", memory_budget="1MiB")
    assert plugin.gemini_policy("cpu").device_budget == 2**20
    assert plugin.autoparallelize_kwargs()["zero_stage"] == 0
    assert plugin.autoparallelize_kwargs()["checkpoint"] == "none"
