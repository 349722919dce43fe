"""``LowLevelZeroPlugin``: Colossal-AI's signature, and ZeRO-1/2 as the planner's zero1/zero2 family.

On 2 gloo ranks GPT-2 tiny with ``stage=1`` and ``stage=2`` in fp32: 3 AdamW steps through the
booster give the single-device losses and final parameters (rtol 1e-4), and the boosted module's
``.plan`` is a ``Plan`` whose trainable parameters are all at the asked ZeRO stage; stage 1 on
the device and stage 2 with ``cpu_offload`` by default, the other two under ``full_sweep``.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

from autopar import zoo
from autopar.booster import AutoParallelPlugin, Booster, LowLevelZeroPlugin
from autopar.booster.low_level_zero import LOW_LEVEL_ZERO_PARAMETERS
from autopar.runtime.launch import run_local

LR, EPS, STEPS = 1e-3, 1e-5, 3


def test_signature_matches_colossalai():
    params = list(inspect.signature(LowLevelZeroPlugin.__init__).parameters.values())[1:]
    assert [p.name for p in params] == list(LOW_LEVEL_ZERO_PARAMETERS)
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)
    assert {p.name: p.default for p in params} == LOW_LEVEL_ZERO_PARAMETERS
    assert LOW_LEVEL_ZERO_PARAMETERS["initial_scale"] == 2**32 and LOW_LEVEL_ZERO_PARAMETERS["stage"] == 1
    plugin = LowLevelZeroPlugin()
    assert isinstance(plugin, AutoParallelPlugin)
    assert (plugin.zero_stage, plugin.precision, plugin.initial_scale) == (1, "fp16", 2.0**32)
    # every parameter by position, at its default: no TypeError
    positional = LowLevelZeroPlugin(*LOW_LEVEL_ZERO_PARAMETERS.values())
    assert positional.zero_stage == 1
    two = LowLevelZeroPlugin(2, "fp32", 1024.0, max_norm=1.0, communication_dtype=torch.bfloat16,
                             reduce_bucket_size_in_m=25, overlap_communication=False, verbose=True)
    assert (two.zero_stage, two.precision, two.initial_scale, two.max_norm, two.reduce_dtype) == \
        (2, "fp32", 1024.0, 1.0, "bf16")


def test_booster_mixed_precision_rebuilds_the_plugin():
    given = LowLevelZeroPlugin(2, "fp32", max_norm=1.0, cpu_offload=True)
    plugin = Booster(mixed_precision="bf16", plugin=given).plugin
    assert isinstance(plugin, LowLevelZeroPlugin)
    assert (plugin.precision, plugin.zero_stage, plugin.max_norm, plugin.cpu_offload) == ("bf16", 2, 1.0, True)


def test_unsupported_knobs_raise_naming_them():
    with pytest.raises(NotImplementedError, match="master_weights"):
        LowLevelZeroPlugin(master_weights=False)


def test_scaler_knobs_map_onto_the_plugin():
    plugin = LowLevelZeroPlugin(min_scale=2, max_scale=2.0**16, hysteresis=1, norm_type=1.0)
    assert (plugin.min_scale, plugin.max_scale, plugin.hysteresis, plugin.norm_type) == (2, 2.0**16, 1, 1.0)
    assert (LowLevelZeroPlugin().hysteresis, LowLevelZeroPlugin().min_scale) == (2, 1)  # Colossal-AI's rule


@pytest.mark.parametrize("stage", [0, 3, "auto", True])
def test_bad_stage(stage):
    with pytest.raises(ValueError, match="stage"):
        LowLevelZeroPlugin(stage=stage)


def _model():
    torch.manual_seed(0)
    return zoo.build("gpt2", tiny=True, batch=4, seq=16, device="cpu")


def _single(model, inputs):
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for _ in range(STEPS):
        loss = model(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _body(rank, world, model, inputs, stage, cpu_offload=False):
    booster = Booster(LowLevelZeroPlugin(stage=stage, precision="fp32", cpu_offload=cpu_offload))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    pm, bopt, *_ = booster.boost(model, opt, meta_inputs=inputs)
    losses = []
    for _ in range(STEPS):
        loss = pm(**inputs).loss
        booster.backward(loss, bopt)
        bopt.step()
        bopt.zero_grad()
        losses.append(loss.item())
    stages = {n.name: n.zero_stage for n in pm.plan.nodes if n.kind == "parameter"}
    tiers = {tuple(t) for t in pm.plan.offload.values()} if pm.plan.offload else set()
    return losses, pm.full_state_dict(), pm.plan, stages, tiers


# Stage 1 on the device and stage 2 offloaded stay in the default suite (each stage and each
# optimizer-state tier once); the other two combinations are with the whole sweeps.
@pytest.mark.parametrize("stage, cpu_offload", [
    (1, False),
    pytest.param(1, True, marks=pytest.mark.full_sweep),  # stage 1: [1-device]; offload: [2-cpu_offload]
    pytest.param(2, False, marks=pytest.mark.full_sweep),  # stage 2: [2-cpu_offload]; device: [1-device]
    (2, True),
], ids=["1-device", "1-cpu_offload", "2-device", "2-cpu_offload"])
def test_low_level_zero_trains_like_one_device(stage, cpu_offload):
    from autopar.plans import Plan

    model, inputs = _model()
    ref_losses, ref_params = _single(model, inputs)
    results = run_local(_body, 2, model, inputs, stage, cpu_offload, timeout=300)
    for losses, state, plan, stages, tiers in results:
        if cpu_offload:  # ZeRO-Offload: the optimizer state's tier is the host
            assert tiers and all(t[-1] == "host" for t in tiers), tiers
        else:
            assert not tiers or tiers == {("device", "device")}, tiers
        assert isinstance(plan, Plan)
        assert stages and set(stages.values()) == {stage}, stages
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-6)
        for name, ref in ref_params.items():
            torch.testing.assert_close(state[name], ref, rtol=1e-4, atol=1e-5, msg=name)
