"""The model zoo: published sizes on meta, tiny configs on CPU, argument checking."""

import pytest
import torch

from autopar import zoo

# Parameter counts of the published models (tied embeddings counted once), as built on meta.
PUBLISHED = {
    "gpt2": 124_439_808,
    "gpt2-xl": 1_557_611_200,
    "llama-1b": 1_235_814_400,
    "llama-8b": 8_030_261_248,
    "vit-base": 86_567_656,
    "resnet50": 25_557_032,
}


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_sizes_on_meta(name):
    model, inputs = zoo.build(name)
    assert num_params(model) == PUBLISHED[name]
    assert all(p.device.type == "meta" for p in model.parameters())
    assert all(t.device.type == "meta" for t in inputs.values())
    assert "labels" in inputs and model.training


def test_default_input_shapes():
    assert zoo.build("gpt2")[1]["input_ids"].shape == (8, 1024)
    assert zoo.build("bert-base")[1]["input_ids"].shape == (8, 512)
    assert zoo.build("vit-base")[1]["pixel_values"].shape == (8, 3, 224, 224)
    assert zoo.build("gpt2", batch=2, seq=128)[1]["labels"].shape == (2, 128)


def test_llama_shapes_are_grouped_query():
    model, _ = zoo.build("llama-8b")
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads) == (32, 4096, 32)
    assert (cfg.num_key_value_heads, cfg.intermediate_size, cfg.vocab_size) == (8, 14336, 128256)
    tiny, _ = zoo.build("llama-1b", tiny=True)
    assert tiny.config.num_key_value_heads < tiny.config.num_attention_heads


def test_num_layers_overrides_depth():
    assert zoo.build("gpt2", num_layers=3)[0].config.n_layer == 3
    assert zoo.build("gpt2-xl", num_layers=2)[0].config.n_embd == 1600
    assert len(zoo.build("mlp", tiny=True, num_layers=5)[0].blocks) == 5
    assert zoo.build("resnet50", num_layers=1)[0].config.depths == [1, 1, 1, 1]


@pytest.mark.parametrize("name", zoo.NAMES)
def test_tiny_cpu_runs_and_is_deterministic(name):
    torch.manual_seed(0)
    model, inputs = zoo.build(name, tiny=True, device="cpu")
    torch.manual_seed(0)
    model2, inputs2 = zoo.build(name, tiny=True, device="cpu")
    for key in inputs:
        assert torch.equal(inputs[key], inputs2[key])
    for p, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, p2)
    assert num_params(model) < 200_000
    out = model(**inputs)
    loss = out[0] if isinstance(out, tuple) else out.loss
    assert loss.dim() == 0 and torch.isfinite(loss)
    if "input_ids" in inputs:
        vocab = model.config.vocab_size
        assert int(inputs["input_ids"].max()) < vocab and int(inputs["labels"].max()) < vocab


def test_default_demo_is_small_gpt2():
    model, inputs = zoo.default_demo()
    assert (model.config.n_layer, model.config.n_embd) == (4, 256)
    assert set(inputs) == {"input_ids", "labels"}


def test_bad_arguments():
    with pytest.raises(ValueError, match="gpt2-xl"):  # the message lists the known names
        zoo.build("gpt3")
    with pytest.raises(ValueError, match="device"):
        zoo.build("gpt2", device="cuda:7")
    with pytest.raises(ValueError, match="batch must be >= 1, got 0"):
        zoo.build("gpt2", batch=0)


def test_dlrm_is_mlperf_criteo_1tb_on_meta():
    model, inputs = zoo.build("dlrm")
    assert [t.num_embeddings for t in model.tables] == list(zoo.CRITEO_1TB_ROWS)
    assert len(model.tables) == 26 and max(zoo.CRITEO_1TB_ROWS) == 40_000_000
    assert {t.embedding_dim for t in model.tables} == {128} and {t.mode for t in model.tables} == {"sum"}
    assert inputs["indices"].shape == (65536 * sum(zoo.CRITEO_1TB_HOTNESS),)
    assert inputs["offsets"].shape == (26, 65536) and inputs["dense"].shape == (65536, 13)
    assert model.top[0].in_features == 128 + 27 * 26 // 2  # the bottom output + the pairwise dots
    assert all(p.device.type == "meta" for p in model.parameters())


def test_tiny_dlrm_bags_are_jagged_and_valid():
    torch.manual_seed(0)
    model, inputs = zoo.build("dlrm", tiny=True, device="cpu")
    offsets, start = inputs["offsets"], 0
    for t, table in enumerate(model.tables):
        count = 4 * model.hotness[t]
        ids = inputs["indices"][start:start + count]
        start += count
        assert int(ids.max()) < table.num_embeddings and offsets[t, 0] == 0
        assert bool((offsets[t, 1:] >= offsets[t, :-1]).all()) and int(offsets[t, -1]) <= count
    assert start == inputs["indices"].numel()
    loss, logits = model(**inputs)
    loss.backward()
    assert logits.shape == (4,) and all(p.grad is not None for p in model.parameters())
