"""The transformers sweep (issue 11): architectures at their own default configs train like one device.

Each architecture of ``hf_catalog.ARCHS`` (its config class's defaults with only sizes shrunk,
dropout 0) is traced, planned on meshes (2,) and (2, 2) with nearly free links and NO replicate
fallback, and trained one step on 2 and 4 real gloo processes: the loss, every parameter
gradient and the buffers the step updates equal the single-device values (rtol 1e-4, atol 1e-6;
float64, MoE float32: see hf_catalog).

The default run leaves out ``TWINS`` (architectures whose code is another default one's with
minor changes; ``full_sweep`` runs them). Acceptance: every architecture not in ``NOT_STRICT``
does so; at least 25 do; and the passing
ones include each required kind (decoder-only with grouped-query attention, mixture of experts
with top-k routing, encoder-decoder, encoder-only classifier, conv vision model, ViT). A listed
architecture must fail to trace with a clear ``TraceError``; one that now passes fails the test
(the list must stay true).
"""

from __future__ import annotations

import inspect

import pytest

from . import harness, hf_catalog

MESHES = [(2,), (2, 2)]
MIN_PASSING = 25
REQUIRED_GROUPS = {
    "decoder-gqa": "decoder-only with grouped-query attention",
    "moe": "mixture of experts with top-k routing",
    "encoder-decoder": "encoder-decoder",
    "encoder": "encoder-only classifier",
    "conv": "conv vision model",
    "vit": "vision transformer",
}

# Architectures that cannot trace, with the reason (each must raise a clear TraceError).
NOT_STRICT: dict[str, str] = {
    "DebertaV2ForSequenceClassification": "data-dependent: its loss keeps the labels >= 0 with "
                                          "nonzero() and branches on how many there are",
}

# Config fields a tiny config may differ in from the class defaults besides SHRINK, the
# entry's own sizes/extra, dropout and out-of-vocabulary token ids: fields the config derives
# from the shrunk sizes in its constructor.
# (a layer-kind list per layer; backbone stage names per layer; the held-out families': GPT-Neo's
# per-layer attention kinds, SmolLM3's per-layer RoPE flags, LFM2's attention layer indices,
# ERNIE-4.5-MoE's last MoE layer, Mamba-2's time-step rank and RecurrentGemma's init scale from
# the hidden size and depth, the speech models' and SigLIP's output widths = the hidden size, the
# time-series models' input features from the lags and time features).
DERIVED = {"layer_types", "stage_names", "out_features", "out_indices", "attention_layers", "no_rope_layers",
           "full_attn_idxs", "moe_layer_end_index", "time_step_rank", "final_w_init_variance_scale",
           "output_hidden_size", "projection_size", "feature_size"}


def test_catalog_covers_the_required_kinds_from_default_configs():

    assert len(hf_catalog.ARCHS) >= MIN_PASSING
    groups = {a.group for a in hf_catalog.ARCHS}
    assert set(REQUIRED_GROUPS) <= groups, f"missing kinds: {set(REQUIRED_GROUPS) - groups}"
    names = [a.model for a in hf_catalog.ARCHS]
    assert len(names) == len(set(names))
    assert set(NOT_STRICT) <= set(names)
    check_tiny_configs(hf_catalog.ARCHS)


# The training targets of each task: the keyword the model's forward takes them by.
TARGETS = {"contrastive": "return_loss", "forecast": "future_values", "probabilistic": "future_values"}


def check_tiny_configs(archs: list[hf_catalog.Arch]) -> None:
    """Each tiny config differs from its class's defaults in sizes, dropout and token ids only
    (a composite config's sub-configs likewise, each checked the same way)."""
    import transformers

    for arch in archs:
        cls = getattr(transformers, arch.config)
        default, tiny = cls().to_dict(), hf_catalog.tiny_config(arch).to_dict()
        allowed = set(hf_catalog.SHRINK) | set(arch.sizes) | set(arch.extra) | DERIVED
        if arch.sub_configs:
            allowed |= set(getattr(cls, "sub_configs", {}))
            for key, sub in cls.sub_configs.items():
                check_tiny_configs([hf_catalog.Arch(arch.model, sub.__name__, arch.task, arch.group)])
        changed = {k for k in set(default) | set(tiny) if default.get(k) != tiny.get(k)}
        unexpected = sorted(k for k in changed - allowed if not (
            hf_catalog._is_dropout(k, default.get(k)) or k.endswith("_token_id")))
        assert not unexpected, f"{arch.model}: tiny config changes non-size fields {unexpected}"
        assert tiny.get("use_cache") == default.get("use_cache"), arch.model
        assert set(arch.extra) <= {"decoder_start_token_id"}, arch.model
        target = TARGETS.get(arch.task, "labels")
        assert target in inspect.signature(getattr(transformers, arch.model).forward).parameters, arch.model


# Architectures whose modeling code is another default one's with minor changes: run with the
# whole sweeps (``pytest -m full_sweep``), each beside the default architecture that runs its
# code path (same layers, same ops) by default.
TWINS: dict[str, str] = {
    "MistralForCausalLM": "LlamaForCausalLM",  # Llama's code; sliding window off by default
    "Qwen2ForCausalLM": "LlamaForCausalLM",  # Llama's code with q/k/v biases (GPT-2's biased linears)
    "GraniteForCausalLM": "LlamaForCausalLM",  # Llama's code with scalar multipliers
    "OlmoeForCausalLM": "MixtralForCausalLM",  # Mixtral's top-k experts, Olmo-2's q/k norms
    "ElectraForSequenceClassification": "BertForSequenceClassification",  # Bert + Albert's embedding projection
    "PegasusForConditionalGeneration": "BartForConditionalGeneration",  # Bart's layers, pre-norm, fixed positions
    "DeiTForImageClassification": "ViTForImageClassification",  # ViT's layers, one more token
}


def default_names() -> list[str]:
    return [a.model for a in hf_catalog.ARCHS if a.model not in TWINS]


def test_twins_name_default_architectures():
    names = {a.model for a in hf_catalog.ARCHS}
    assert set(TWINS) <= names and set(TWINS.values()) <= set(default_names())
    assert len(default_names()) >= MIN_PASSING + len(NOT_STRICT)


# Mesh (2,) in the default run, without the TWINS; every architecture on (2,) and (2, 2) with the
# whole sweeps (``pytest -m full_sweep``): planning every architecture on both took 90 s of the
# default suite.
@pytest.fixture(scope="module", params=[pytest.param(([MESHES[0]], True), id="2"),
                                        pytest.param((MESHES, False), id="2-and-2x2", marks=pytest.mark.full_sweep)])
def results(request) -> dict[str, harness.Result]:
    meshes, default = request.param
    entries = hf_catalog.entries(default_names() if default else None)
    # Two sweeps at once: the serial tracing, not the (forked) planning, was the critical path.
    return {r.name: r for r in harness.sweep(entries, meshes, task_timeout=120, workers=2)}


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_architectures_plan_without_fallback_and_match_one_device(results):
    failures = [f"{name}: {r.cause()}" for name, r in results.items()
                if name not in NOT_STRICT and not r.strict_ok]
    assert not failures, (f"{len(failures)} of {len(results)} architectures do not plan without "
                          f"fallback and match on the sweep's meshes:\n" + "\n".join(failures)
                          + "\n\nby cause:\n" + harness.format_failures(results.values()))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_plans_split_the_model(results):
    replicated = harness.replicated_plans(results)
    assert not replicated, "plans that replicate every op:\n" + "\n".join(replicated)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_listed_architectures_raise_a_clear_trace_error(results):
    errors = []
    for name, reason in NOT_STRICT.items():
        r = results[name]
        if r.strict_ok:
            errors.append(f"{name} now plans without fallback and matches: remove it from NOT_STRICT")
        elif r.trace_error is None or r.trace_error.startswith(("(not a TraceError)", "profile failed")):
            errors.append(f"{name} ({reason}): expected a clear TraceError, got: {r.cause()}")
    assert not errors, "\n".join(errors)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_at_least_25_architectures_and_every_required_kind_pass(results):
    passing = [r for r in results.values() if r.strict_ok]
    assert len(passing) >= MIN_PASSING, (f"{len(passing)} architectures pass, need {MIN_PASSING}:\n"
                                         + harness.format_failures(results.values()))
    kinds = {r.group for r in passing}
    missing = {g: d for g, d in REQUIRED_GROUPS.items() if g not in kinds}
    assert not missing, f"no passing architecture of kind(s): {sorted(missing.values())}"
