"""Families the catalog had not seen (``hf_catalog.HELD_OUT``): speech (Whisper, Wav2Vec2, HuBERT,
WavLM, Data2Vec-Audio), image-text (CLIP, SigLIP), time series (PatchTST; TimeSeriesTransformer and
Informer, StudentT likelihoods), state-space and
recurrent models (FalconMamba, Mamba-2, RWKV, RecurrentGemma, Bamba, LFM2, Jamba), more mixtures
of experts (DBRX, GPT-OSS, MiniMax, GLM-4-MoE, ERNIE-4.5-MoE, NLLB-MoE, GraniteMoE), vision
(Swin-V2, PoolFormer, MobileViT, LeViT, FocalNet, CvT, PVT), encoders and decoders -- each
traced, planned without fallback and trained one step on gloo ranks like one device.

The default run checks the three families whose fixes the probe made: PatchTST (a rule for
``unfold``), WavLM (a decomposition that kept another layout than its op's kernel) and DBRX (its
flat experts loop as ``autopar::moe_experts``), on mesh (2,); and the two whose custom
autograd.Functions train with their own backward (``autopar::autograd_function``): YOSO's attention
and RecurrentGemma's clipped square root, on (2,) (at 1.1x the smallest budget on (2, 2) under
``full_sweep``; tests/runtime/test_functions.py trains such Functions at tight budgets by default).
The whole list on (2,) and (2, 2), and at 1.1x the smallest budget on (2, 2), runs under ``full_sweep``.
"""

from __future__ import annotations

import pytest

from . import harness, hf_catalog
from .test_transformers import check_tiny_configs

FIXED = ["PatchTSTForPrediction", "WavLMForSequenceClassification", "DbrxForCausalLM"]
# Custom autograd.Functions whose backward is not their forward's derivative: YOSO's attention
# (YosoCumulation) and RecurrentGemma's clipped-gradient square root (SqrtBoundDerivative).
FUNCTIONS = ["YosoForMaskedLM", "RecurrentGemmaForCausalLM"]


def _failures(results: list[harness.Result]) -> list[str]:
    return [f"{r.name}: {r.cause()}" for r in results if not r.strict_ok]


def test_fixed_families_configs_change_sizes_only():
    names = [a.model for a in hf_catalog.HELD_OUT]
    assert len(names) == len(set(names)) and not set(names) & {a.model for a in hf_catalog.ARCHS}
    assert set(FIXED) <= set(names)
    check_tiny_configs([a for a in hf_catalog.HELD_OUT if a.model in FIXED])


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("tight", [False, pytest.param(True, marks=pytest.mark.full_sweep)], ids=["2", "2x2-tight"])
def test_custom_function_families_match_one_device(tight):
    """Trained with the Functions' own backwards (one op each, counted in the sweep's own trace),
    on (2,) or at 1.1x the smallest budget on (2, 2)."""
    entries = hf_catalog.entries(FUNCTIONS, archs=hf_catalog.HELD_OUT)
    if tight:
        results = harness.sweep(entries, [(2, 2)], budget_factor=1.1, task_timeout=240)
    else:
        results = harness.sweep(entries, [(2,)], task_timeout=240)
    for r in results:
        assert r.ops.get("autopar.autograd_function.default", 0) >= 2, (r.name, r.cause())
    failures = _failures(results)
    assert not failures, "\n".join(failures)


@pytest.mark.full_sweep
def test_held_out_configs_change_sizes_only():  # building 57 default configs: ~15 s on 2 busy cores
    check_tiny_configs(hf_catalog.HELD_OUT)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fixed_families_match_one_device():
    results = harness.sweep(hf_catalog.entries(FIXED, archs=hf_catalog.HELD_OUT), [(2,)], task_timeout=120)
    failures = _failures(results)
    assert not failures, "\n".join(failures)
    assert not harness.replicated_plans({r.name: r for r in results})


@pytest.mark.full_sweep
@pytest.mark.timeout(3600)
def test_every_held_out_family_matches_one_device():
    results = harness.sweep(hf_catalog.entries(archs=hf_catalog.HELD_OUT), [(2,), (2, 2)], task_timeout=240)
    failures = _failures(results)
    assert not failures, "\n".join(failures) + "\n\nby cause:\n" + harness.format_failures(results)


@pytest.mark.full_sweep
@pytest.mark.timeout(3600)
def test_every_held_out_family_at_a_tight_budget_matches_one_device():
    results = harness.sweep(hf_catalog.entries(archs=hf_catalog.HELD_OUT), [(2, 2)], budget_factor=1.1,
                            task_timeout=240)
    failures = _failures(results)
    assert not failures, "\n".join(failures)
