"""Hugging Face models as users have them: default configs (``use_cache=True``), tiny sizes.

Each model traces, ends in its loss, leaves every config it reached as it was, and its traced
graph, run on the model's real weights, rebuilds the model's own output (class and keys, and the
values where the default config has no dropout).
"""

import pytest
import torch
import transformers as tf
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from autopar.tracer import TraceError, trace
from autopar.tracer.hf import caches_off, configs_of, drop_caches, is_cache

V = 128  # vocabulary
B, S = 2, 8
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=V)


def _tokens(high=V, shape=(B, S)):
    return torch.randint(0, high, shape)


def _lm(model):
    return model, {"input_ids": _tokens(), "labels": _tokens()}


def _t5(**extra):
    return tf.T5ForConditionalGeneration(tf.T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                                     vocab_size=V, **extra))


# name -> (builder, whether the default config has dropout: then values are random in train mode)
MODELS = {
    "gpt2": (lambda: _lm(tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=V,
                                                          bos_token_id=0, eos_token_id=0))), True),
    "llama": (lambda: _lm(tf.LlamaForCausalLM(tf.LlamaConfig(num_key_value_heads=2, **SMALL))), False),
    "qwen2": (lambda: _lm(tf.Qwen2ForCausalLM(tf.Qwen2Config(num_key_value_heads=2, **SMALL))), False),
    "mixtral": (lambda: _lm(tf.MixtralForCausalLM(tf.MixtralConfig(
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **SMALL))), False),
    "t5": (lambda: _lm(_t5(decoder_start_token_id=0, pad_token_id=0)), True),
    "bart": (lambda: _lm(tf.BartForConditionalGeneration(tf.BartConfig(
        d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=V, max_position_embeddings=64))), True),
    "bert-cls": (lambda: (tf.BertForSequenceClassification(tf.BertConfig(**SMALL)),
                          {"input_ids": _tokens(), "labels": _tokens(2, (B,))}), True),
    "vit": (lambda: (tf.ViTForImageClassification(tf.ViTConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=32,
        patch_size=8, num_labels=10)), {"pixel_values": torch.randn(B, 3, 32, 32), "labels": _tokens(10, (B,))}),
        False),
}


def _use_cache(model):
    return [(type(c).__name__, c.use_cache) for c in configs_of(model) if hasattr(c, "use_cache")]


@pytest.mark.parametrize("name", list(MODELS))
def test_default_config_traces_and_outputs_rebuild(name):
    torch.manual_seed(0)
    build, has_dropout = MODELS[name]
    model, inputs = build()
    model.train()
    before = _use_cache(model)
    assert name == "vit" or any(flag for _, flag in before)  # caches on, as users have them
    traced = trace(model, inputs)
    assert _use_cache(model) == before  # the user's configs are left as they were
    assert "forward" not in vars(model)  # and the forward too
    assert traced.loss_node is not None and traced.loss_node.meta["val"].shape == ()

    outputs = traced.unflatten_outputs(traced.gm(*traced.bind(model, inputs)))
    with torch.no_grad():
        eager = model(**inputs, use_cache=False) if "use_cache" in _forward_params(model) else model(**inputs)
    assert type(outputs) is type(eager)
    assert list(outputs.keys()) == list(eager.keys())
    assert "past_key_values" not in outputs
    for key in eager.keys():
        assert outputs[key].shape == eager[key].shape, key
        if not has_dropout:
            torch.testing.assert_close(outputs[key], eager[key], rtol=1e-4, atol=1e-5, msg=key)


def _forward_params(model):
    import inspect

    return inspect.signature(model.forward).parameters


def test_user_given_use_cache_is_kept_and_the_cache_dropped_from_outputs():
    torch.manual_seed(0)
    model, inputs = MODELS["llama"][0]()
    traced = trace(model, {**inputs, "use_cache": True})  # the model builds a DynamicCache
    assert model.config.use_cache is True
    outputs = traced.unflatten_outputs(traced.gm(*traced.bind(model, inputs)))
    assert isinstance(outputs, CausalLMOutputWithPast) and list(outputs.keys()) == ["loss", "logits"]


def test_failed_trace_restores_the_config_and_names_the_missing_attribute():
    # transformers 5's T5Config() has no decoder_start_token_id: T5 fails in eager too.
    model, inputs = _lm(_t5())
    model.config.use_cache = True
    with pytest.raises(TraceError) as info:
        trace(model, inputs)
    err = info.value
    assert "decoder_start_token_id" in err.hint and "config" in err.hint
    assert "not supported by torch.export" not in err.hint
    assert "modeling_t5.py" in err.source and "decoder_start_token_id" in err.source
    assert _use_cache(model) == [("T5Config", True), ("T5Config", False), ("T5Config", True)]
    assert "forward" not in vars(model)
    model.config.use_cache = False  # a user's False stays False too
    model.config.decoder_start_token_id = 0
    model.config.pad_token_id = 0
    trace(model, inputs)
    assert model.config.use_cache is False


class _Holder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.inner = nn.Linear(2, 2)
        self.inner.config = config.text_config  # a submodule's own config, reached once


def test_sub_configs_are_reached_and_restored():
    config = tf.LlavaConfig()
    config.text_config.use_cache = True
    holder = _Holder(config)
    found = configs_of(holder)
    assert config in found and config.text_config in found and config.vision_config in found
    assert len(found) == len({id(c) for c in found})
    with caches_off(holder) as changed:
        assert changed >= 1 and config.text_config.use_cache is False
    assert config.text_config.use_cache is True
    with pytest.raises(KeyError), caches_off(holder):  # restored on failure too
        raise KeyError("boom")
    assert config.text_config.use_cache is True


class _ReturnsCache(nn.Module):
    """No use_cache anywhere: the cache is in the outputs whatever the config says."""

    def __init__(self, structure):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.structure = structure

    def forward(self, x):
        y = self.proj(x)
        cache = tf.DynamicCache()
        cache.update(y[None, None], y[None, None], 0)
        if self.structure == "model_output":
            return CausalLMOutputWithPast(loss=y.sum(), logits=y, past_key_values=cache)
        if self.structure == "dict":
            return {"loss": y.sum(), "cache": cache, "nested": [y, cache]}
        return y.sum(), cache


@pytest.mark.parametrize("structure, expect", [
    ("model_output", lambda y: CausalLMOutputWithPast(loss=y.sum(), logits=y)),
    ("dict", lambda y: {"loss": y.sum(), "cache": None, "nested": [y, None]}),
    ("tuple", lambda y: (y.sum(), None)),
])
def test_caches_in_outputs_become_none_and_structure_is_kept(structure, expect):
    torch.manual_seed(0)
    model = _ReturnsCache(structure)
    x = torch.randn(2, 4)
    traced = trace(model, {"x": x})
    outputs = traced.unflatten_outputs(traced.gm(*traced.bind(model, {"x": x})))
    wanted = expect(model.proj(x))
    assert type(outputs) is type(wanted)
    torch.testing.assert_close(torch.utils._pytree.tree_leaves(outputs), torch.utils._pytree.tree_leaves(wanted))
    assert torch.utils._pytree.tree_structure(outputs) == torch.utils._pytree.tree_structure(wanted)


def test_drop_caches_leaves_other_values_alone():
    cache = tf.DynamicCache()
    assert is_cache(cache) and not is_cache(torch.ones(1)) and not is_cache({"a": cache})
    out = CausalLMOutputWithPast(logits=torch.ones(1))
    assert drop_caches(out) is out  # nothing to drop: the same object
    assert drop_caches((1, [cache], {"k": cache})) == (1, [None], {"k": None})


class _Duck:
    """A cache from another library: recognised by name and get_seq_length."""

    def get_seq_length(self):
        return 0


def test_duck_typed_cache_is_recognised():
    duck = type("KVCache", (_Duck,), {})()
    assert is_cache(duck) and drop_caches([duck]) == [None]
    assert not is_cache(_Duck())
