"""Issue 29: the boosted optimizer's user-called clipping under fp16 loss scaling, on 2 gloo ranks.

``clip_grad_by_norm`` / ``clip_grad_by_value`` called before ``step()`` must act on the TRUE
gradient: the scaler unscales first (once; ``step()`` does not unscale again), as torch's AMP
recipe does (``scaler.unscale_(opt)``, then clip). Before the fix the clip saw the scaled
gradient (norm ~ scale x true norm) and shrank the update by the scale. The reference is
single-device fp32 (torch's own clipping, then SGD); fp16 compute differs within ~1e-2.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from autopar import zoo
from autopar.api import plan as make_plan
from autopar.booster import AutoParallelPlugin, Booster
from autopar.runtime.launch import run_local

LR, MAX_NORM, CLIP_VALUE, SCALE = 0.1, 1.0, 1e-3, 65536.0
SHARD_MAX_NORM = 0.1  # below the tiny GPT-2's first gradient norm in L2 and in max


def _boosted_update(rank, world, model, inputs, mode, plan):
    booster = Booster(AutoParallelPlugin(precision="fp16", initial_scale=SCALE, plan=plan))
    pm, bopt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=LR), meta_inputs=inputs)
    before = {k: v.clone() for k, v in pm.full_state_dict().items()}
    booster.backward(pm(**inputs)[0], bopt)
    norm = None
    if mode == "norm":
        norm = float(bopt.clip_grad_by_norm(MAX_NORM))
    else:
        bopt.clip_grad_by_value(CLIP_VALUE)
    bopt.step()
    after = pm.full_state_dict()
    return {"norm": norm, "update": {k: after[k] - before[k] for k in before}, "scale": bopt.scaler.get_scale(),
            "pieces": len(bopt.zero.pieces) if bopt.zero is not None else 0}


def _reference_update(model, inputs, mode):
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    ref(**inputs)[0].backward()
    if mode == "norm":
        norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))
    else:
        torch.nn.utils.clip_grad_value_(ref.parameters(), CLIP_VALUE)
        norm = None
    opt.step()
    after = ref.state_dict()
    return norm, {k: after[k] - before[k] for k in before}


CLIP_CASES = (("norm", 0), ("value", 0), ("norm", 2))


def _boosted_updates(rank, world, model, inputs, cases):
    """Every case's update, one after the other in the same 2 ranks (one launch for the three),
    each on its own copy of the model."""
    return [_boosted_update(rank, world, copy.deepcopy(model), inputs, mode, plan) for mode, plan in cases]


@pytest.fixture(scope="module")
def clip_runs():
    """Per (mode, ZeRO stage): the reference (norm, update) and each rank's result. One plan and
    one launch for the three cases (each boosts its own copy of the model)."""
    torch.manual_seed(0)
    model, inputs = zoo.build("gpt2", tiny=True, device="cpu", batch=4, seq=16)
    plan = make_plan(model, inputs, mesh=(2,), checkpoint="none", precision="fp16", pipeline=1)
    plans = {}
    for mode, zero_stage in CLIP_CASES:
        plans[mode, zero_stage] = plan
        if zero_stage:  # the tiny model never needs ZeRO: ask for sharded gradient pieces by hand
            plans[mode, zero_stage] = dataclasses.replace(plan, nodes=tuple(
                dataclasses.replace(n, zero_stage=zero_stage) if n.kind == "parameter" else n for n in plan.nodes))
    per_rank = run_local(_boosted_updates, 2, model, inputs, [(mode, plans[mode, z]) for mode, z in CLIP_CASES],
                         timeout=180)
    return {case: (_reference_update(model, inputs, case[0]), [ranks[i] for ranks in per_rank])
            for i, case in enumerate(CLIP_CASES)}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode,zero_stage", CLIP_CASES)
def test_user_clip_under_fp16_matches_fp32_reference(mode, zero_stage, clip_runs):
    (want_norm, want), results = clip_runs[mode, zero_stage]
    for res in results:
        assert (res["pieces"] > 0) == (zero_stage == 2), res["pieces"]  # ZeRO-2: sharded gradient pieces
        assert res["scale"] == SCALE, "no overflow expected: the step must have been taken"
        if mode == "norm":
            # the norm of the true gradient, not scale x it (46,615 at scale 65,536 before the fix)
            assert res["norm"] == pytest.approx(want_norm, rel=2e-2), (res["norm"], want_norm)
            assert want_norm > MAX_NORM, "the reference must actually clip for the test to mean anything"
        got = torch.cat([res["update"][k].flatten().float() for k in want])
        ref = torch.cat([want[k].flatten().float() for k in want])
        # whole update within fp16 tolerance of the fp32 update (before the fix: ~1e-5 of it)
        assert (got - ref).norm() <= 3e-2 * ref.norm(), ((got - ref).norm(), ref.norm(), got.norm())
        if mode == "value":  # per-element clamp of the true gradient: no step beyond lr * clip
            assert got.abs().max() <= LR * CLIP_VALUE * (1 + 1e-3)


def _sharded_chunks(rank, world, model, inputs, norm_type):
    plugin = AutoParallelPlugin(placement_policy="static", shard_param_frac=0.5, mesh=(2,),
                                chunk_search_range=(1024, 1024, 1024))
    booster = Booster(plugin)
    pm, bopt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3), meta_inputs=inputs)
    booster.backward(pm(**inputs).loss, bopt)
    norm = float(bopt.clip_grad_by_norm(SHARD_MAX_NORM, norm_type))
    by_norm = pm.full_gradients()
    bopt.clip_grad_by_value(CLIP_VALUE)
    summary = pm.gemini.summary()
    return norm, by_norm, pm.full_gradients(), (summary["sharded"], len(pm.gemini.manager.chunks))


NORM_TYPES = (2.0, float("inf"))


def _sharded_chunks_each(rank, world, model, inputs):
    """Both norm types, one after the other in the same 2 ranks, each on its own copy of the model."""
    return [_sharded_chunks(rank, world, copy.deepcopy(model), inputs, norm_type) for norm_type in NORM_TYPES]


@pytest.fixture(scope="module")
def chunk_runs():
    """The tiny GPT-2, its inputs and, per norm type, each rank's result (one launch for both)."""
    torch.manual_seed(0)
    model, inputs = zoo.build("gpt2", tiny=True, device="cpu", batch=4, seq=16)
    per_rank = run_local(_sharded_chunks_each, 2, model, inputs, timeout=180)
    return model, inputs, {norm_type: [ranks[i] for ranks in per_rank] for i, norm_type in enumerate(NORM_TYPES)}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_user_clip_counts_gradients_held_as_chunk_shards(norm_type, chunk_runs):
    """Sharded Gemini chunks keep gradients outside ``.grad`` (chunk shards): clipping by norm
    counts them (their powers all-reduced) and scales them, clipping by value clamps them."""
    model, inputs, results = chunk_runs
    ref = copy.deepcopy(model)
    ref(**inputs).loss.backward()
    want_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), SHARD_MAX_NORM, norm_type))
    assert want_norm > SHARD_MAX_NORM, "the reference must actually clip for the test to mean anything"
    want = {n: p.grad.clone() for n, p in ref.named_parameters()}
    for norm, by_norm, by_value, (sharded, chunks) in results[norm_type]:
        assert 0 < len(sharded) < chunks, (sharded, chunks)
        assert norm == pytest.approx(want_norm, rel=1e-4)
        for name, grad in want.items():
            torch.testing.assert_close(by_norm[name], grad, rtol=1e-4, atol=1e-6, msg=name)
            torch.testing.assert_close(by_value[name], grad.clamp(-CLIP_VALUE, CLIP_VALUE), rtol=1e-4, atol=1e-7,
                                       msg=name)
