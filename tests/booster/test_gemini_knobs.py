"""AutoParallelPlugin's Gemini knobs through Booster.boost on real gloo processes.

GPT-2 tiny on 2 ranks, ``placement_policy='static'`` with all optimizer state and half the
parameter chunks on the host, and half the chunks sharded over the two ranks
(``shard_param_frac``): 3 AdamW steps through the booster equal single-device training;
``save_model`` / ``save_optimizer`` then a freshly boosted (differently seeded) model loads both
and its next 2 steps equal the uninterrupted run's (masters and moments came back into the chunks).
A plan that offloads (``placement_policy`` then ``'planned'``) executes its ``Plan.offload`` tiers
per parameter, with its ZeRO-2 stages (a data-parallel plan: ZeRO-Offload for replicated
parameters whose state is on the host), and its checkpoint resumes the same way.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from autopar import zoo
from autopar.booster import AutoParallelPlugin, Booster
from autopar.layout.mesh import MeshSpec
from autopar.runtime.launch import run_local

LR, EPS = 1e-3, 1e-5
KNOBS = dict(placement_policy="static", shard_param_frac=0.5, offload_optim_frac=1.0, offload_param_frac=0.5,
             chunk_search_range=(1024, 1024, 1024), mesh=(2,))


def _model(seed=0):
    torch.manual_seed(seed)
    return zoo.build("gpt2", tiny=True, batch=4, seq=16, device="cpu")


def _boosted(model, inputs, plan=None):
    booster = Booster(AutoParallelPlugin(**KNOBS, plan=plan))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    pm, bopt, *_ = booster.boost(model, opt, meta_inputs=inputs)
    return booster, pm, bopt


def _train(booster, pm, opt, inputs, *, steps: int) -> None:
    for _ in range(steps):
        booster.backward(pm(**inputs).loss, opt)
        opt.step()
        opt.zero_grad()


def _body(rank, world, model, inputs, other, path, offload_plan):
    booster, pm, opt = _boosted(copy.deepcopy(model), inputs)
    _train(booster, pm, opt, inputs, steps=3)
    first = pm.full_state_dict()
    booster.save_model(pm, f"{path}/model")
    booster.save_optimizer(opt, f"{path}/optim")
    booster2, pm2, opt2 = _boosted(other, inputs, plan=pm.plan)  # no second solve
    booster2.load_model(pm2, f"{path}/model")
    booster2.load_optimizer(opt2, f"{path}/optim")
    _train(booster2, pm2, opt2, inputs, steps=2)
    tiers = [(c.home, c.optim_tier) for c in pm2.gemini.manager.chunks]
    sharded = (len(pm2.gemini.manager.chunks), pm2.gemini.summary()["sharded"])
    # The planner's own decisions, executed: Plan.offload's tiers per parameter (a plan that
    # offloads makes the policy 'planned'); its checkpoint resumes like any other plan's.
    plugin = AutoParallelPlugin(plan=offload_plan, mesh=offload_plan.mesh)
    assert plugin.placement_policy == "planned"
    booster3, fresh = Booster(plugin), copy.deepcopy(model)
    pm3, opt3, *_ = booster3.boost(fresh, torch.optim.AdamW(fresh.parameters(), lr=LR, eps=EPS), meta_inputs=inputs)
    _train(booster3, pm3, opt3, inputs, steps=3)
    planned = {pm3._placeholders[s.name].fqn: (c.home, c.optim_tier) for c in pm3.gemini.manager.chunks
               for s in c.slots}
    third = pm3.full_state_dict()
    booster3.save_model(pm3, f"{path}/model3")
    booster3.save_optimizer(opt3, f"{path}/optim3")
    booster4, fresh = Booster(plugin), copy.deepcopy(other)
    pm4, opt4, *_ = booster4.boost(fresh, torch.optim.AdamW(fresh.parameters(), lr=LR, eps=EPS), meta_inputs=inputs)
    booster4.load_model(pm4, f"{path}/model3")
    booster4.load_optimizer(opt4, f"{path}/optim3")
    _train(booster4, pm4, opt4, inputs, steps=2)
    return (first, pm2.full_state_dict(), tiers, pm2.gemini.summary(), third, planned, pm4.full_state_dict(), sharded,
            pm4.gemini.summary()["zero"])


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
    from autopar.api import plan as make_plan
    from autopar.offload import OffloadPolicy

    # Cheap links, not free ones: a free all-gather per op made sharded weights cheaper than
    # ZeRO-2's per-piece work, and this test is about a ZeRO-2 plan's offload.
    fast = dataclasses.replace(MeshSpec.preset("cpu", (2,)), alpha=(1e-5,), beta=(1e-13,), name="fast-links")
    offload_plan = make_plan(model, inputs, mesh=fast, zero_stage=2, checkpoint="none", pipeline=1,
                             offload=OffloadPolicy(offload_optim_frac=1.0, offload_param_frac=0.5))
    assert {t for t in offload_plan.offload.values()} == {("host", "host"), ("device", "host")}
    zero2 = {n.module for n in offload_plan.nodes if n.kind == "parameter" and n.zero_stage == 2}
    assert {offload_plan.offload[f] for f in zero2} == {("device", "host")}, zero2  # ZeRO-Offload
    results = run_local(_body, 2, model, inputs, other, str(tmp_path), offload_plan, timeout=240)
    for first, last, tiers, summary, third, planned, resumed, (num_chunks, sharded), zero in results:
        assert zero and set(zero.values()) == {2}, zero  # the plan's ZeRO-2 ran in chunks
        assert 0 < len(sharded) < num_chunks, sharded
        assert all(planned[f] == offload_plan.offload[f] for f in planned if f in offload_plan.offload), planned
        for k, v in third.items():
            assert torch.allclose(v, want[2][k], rtol=1e-4, atol=1e-5), f"planned: {k}"
        for k, v in resumed.items():
            assert torch.allclose(v, want[4][k], rtol=1e-4, atol=1e-5), f"planned, resumed: {k}"
        assert {o for _, o in tiers} == {"host"} and {"host", "device"} == {h for h, _ in tiers}, tiers
        for got, ref_state in ((first, want[2]), (last, want[4])):
            for k, v in got.items():
                assert torch.allclose(v, ref_state[k], rtol=1e-4, atol=1e-5), k
        assert summary["peak_device_bytes"] > 0 and summary["host_bytes"] > 0


def test_gemini_knobs_are_checked():
    with pytest.raises(ValueError, match="placement_policy must be None, 'static', 'auto' or 'planned', got 'cuda'"):
        AutoParallelPlugin(placement_policy="cuda")
    with pytest.raises(ValueError, match="give plan="):
        AutoParallelPlugin(placement_policy="planned")
    with pytest.raises(ValueError, match="go with placement_policy"):
        AutoParallelPlugin(offload_optim_frac=0.5)
    assert AutoParallelPlugin(placement_policy="static", zero_stage=2).autoparallelize_kwargs()["zero_stage"] == 2
    # sharded chunks clip and loss-scale (tests/booster/test_clip_fp16.py, test_gemini_plugin.py)
    clipped = AutoParallelPlugin(placement_policy="static", shard_param_frac=0.5, max_norm=1.0, precision="fp16")
    assert (clipped.shard_param_frac, clipped.max_norm) == (0.5, 1.0)
    with pytest.raises(ValueError, match=r"shard_param_frac=0.5 goes with placement_policy='static', got .*'auto'"):
        AutoParallelPlugin(placement_policy="auto", shard_param_frac=0.5)
    with pytest.raises(ValueError, match=r"shard_param_frac must be a number in \[0, 1\], got 2"):
        AutoParallelPlugin(placement_policy="static", shard_param_frac=2)
    with pytest.raises(ValueError, match=r"chunk_search_range must be \(min, max, step\)"):
        AutoParallelPlugin(placement_policy="static", chunk_search_range=(1, 2))
    with pytest.raises(ValueError, match="needs memory_budget off CUDA"):
        AutoParallelPlugin(placement_policy="auto").gemini_policy("cpu")
    with pytest.raises(ValueError, match="executed by placement_policy='planned'"):
        AutoParallelPlugin(placement_policy="static", offload="auto")
    with pytest.raises(ValueError, match="takes the plan's tiers and chunking"):
        AutoParallelPlugin(offload="auto", chunk_search_range=(1024, 1024, 1024))
    with pytest.raises(ValueError, match="offload must be 'auto', 'none' or an OffloadPolicy"):
        AutoParallelPlugin(offload="host")
    planned = AutoParallelPlugin(offload="auto", memory_budget="1MiB")
    kwargs = planned.autoparallelize_kwargs()
    assert planned.placement_policy == "planned" and kwargs["offload"] == "auto"
    assert kwargs["zero_stage"] == "auto" and kwargs["checkpoint"] == "auto"  # planned jointly with offload
    plugin = AutoParallelPlugin(placement_policy="auto", memory_budget="1MiB")
    assert plugin.gemini_policy("cpu").device_budget == 2**20
    assert plugin.autoparallelize_kwargs()["zero_stage"] == 0  # Gemini's own policies: no ZeRO stages
    assert plugin.autoparallelize_kwargs()["checkpoint"] == "auto"
