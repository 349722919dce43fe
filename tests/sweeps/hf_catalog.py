"""The transformers architecture catalog: tiny models built from each config class's OWN defaults.

Every entry starts from ``ConfigClass()`` and changes only:

- size fields (``SHRINK``, applied where the default config has the field; per-entry ``sizes``
  for fields whose meaning is family-specific, such as a vision model's stage widths): hidden
  size, layers, heads, KV heads, intermediate size, vocabulary, experts, image size ...;
- special token ids that the shrunk vocabulary no longer holds (moved to ``vocab - 1``);
- dropout-like probabilities, set to 0 so that the comparison with the eager model is exact
  (autopar's masks are mesh-invariant, ``tests/runtime/test_randomness.py``, but not torch's);
- ``extra``: a setting eager mode needs at all (T5's ``decoder_start_token_id``).

``use_cache``, the attention implementation, activations, tying, norms, rotary settings, MoE
routing (top-k, with the shrunk expert count) and everything else stay at the default.

Precision: float64 (parameters, buffers and float inputs; MoE models float32, see ARCHS), as in
the rule checks: the comparison
at rtol 1e-4 then sees sharding errors only, not float32 summation-order noise (a batch-norm
weight gradient whose elements cancel to ~1e-2 differs by ~1e-5 in float32 between any two
summation orders).

Depth: 1 layer (Gemma-2: 2, it alternates two kinds of layers): planning on a 2-D mesh costs
several seconds per layer on 2 cores.

Inputs: batch 4, sequence 8; token ids below the vocabulary; labels valid for the head (token
labels for LMs and seq2seq, class ids below ``num_labels`` for classifiers); 32x32 images.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

from .harness import Entry

BATCH, SEQ, TARGET_SEQ, IMAGE = 4, 8, 6, 32
AUDIO = 400  # samples: 8 frames after the shrunk feature extractor's strides 5, 2, 2
VOCAB = 128

# Generic size fields: applied when the default config has the field and it holds an int.
SHRINK: dict[str, int] = {
    "vocab_size": VOCAB, "decoder_vocab_size": VOCAB,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64,
    "n_embd": 64, "n_layer": 1, "n_head": 4, "n_inner": 128, "n_positions": 64,
    "dim": 64, "hidden_dim": 128, "n_layers": 1, "n_heads": 4,
    "d_model": 64, "d_ff": 128, "d_kv": 16, "num_layers": 1, "num_decoder_layers": 1, "num_heads": 4,
    "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
    "ffn_dim": 128, "word_embed_proj_dim": 64, "num_kv_heads": 2, "ffn_hidden_size": 128,
    "rotary_dim": 8, "pooler_hidden_size": 64, "pooler_output_size": 64,
    "num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
    "image_size": IMAGE, "patch_size": 8,
}

_DROPOUT_WORDS = ("dropout", "pdrop", "drop_path", "layerdrop", "drop_rate")


@dataclass
class Arch:
    model: str                    # transformers class name
    config: str                   # its config class name
    task: str                     # "causal" | "masked" | "seqcls" | "seq2seq" | "image" ...
    group: str                    # what the entry stands for (GQA decoder, MoE, ...)
    sizes: dict[str, Any] = field(default_factory=dict)  # family-specific size fields
    extra: dict[str, Any] = field(default_factory=dict)  # settings eager needs at all
    dtype: torch.dtype = torch.float64
    sub_configs: bool = False     # a composite config (CLIP): each sub-config shrunk the same way


ARCHS: list[Arch] = [
    # ---- decoder-only language models
    Arch("GPT2LMHeadModel", "GPT2Config", "causal", "decoder"),
    Arch("LlamaForCausalLM", "LlamaConfig", "causal", "decoder-gqa"),
    Arch("MistralForCausalLM", "MistralConfig", "causal", "decoder-gqa"),
    Arch("Qwen2ForCausalLM", "Qwen2Config", "causal", "decoder-gqa"),
    Arch("Qwen3ForCausalLM", "Qwen3Config", "causal", "decoder-gqa"),
    Arch("GemmaForCausalLM", "GemmaConfig", "causal", "decoder-gqa"),
    # Two layers: Gemma-2 alternates sliding-window and full attention.
    Arch("Gemma2ForCausalLM", "Gemma2Config", "causal", "decoder-gqa", sizes={"num_hidden_layers": 2}),
    Arch("Phi3ForCausalLM", "Phi3Config", "causal", "decoder-gqa"),
    Arch("Starcoder2ForCausalLM", "Starcoder2Config", "causal", "decoder-gqa"),
    Arch("GraniteForCausalLM", "GraniteConfig", "causal", "decoder"),
    Arch("Olmo2ForCausalLM", "Olmo2Config", "causal", "decoder"),
    Arch("CohereForCausalLM", "CohereConfig", "causal", "decoder"),
    Arch("StableLmForCausalLM", "StableLmConfig", "causal", "decoder"),
    Arch("PhiForCausalLM", "PhiConfig", "causal", "decoder"),
    Arch("GPTNeoXForCausalLM", "GPTNeoXConfig", "causal", "decoder"),
    Arch("GPTJForCausalLM", "GPTJConfig", "causal", "decoder"),
    Arch("OPTForCausalLM", "OPTConfig", "causal", "decoder"),
    Arch("BloomForCausalLM", "BloomConfig", "causal", "decoder"),
    Arch("FalconForCausalLM", "FalconConfig", "causal", "decoder"),
    Arch("GPTBigCodeForCausalLM", "GPTBigCodeConfig", "causal", "decoder"),
    # ---- mixture of experts (top-k routing). float32: the default experts implementation calls
    # torch._grouped_mm, which has no float64 kernel.
    Arch("MixtralForCausalLM", "MixtralConfig", "causal", "moe", dtype=torch.float32),
    Arch("Qwen2MoeForCausalLM", "Qwen2MoeConfig", "causal", "moe", dtype=torch.float32),
    Arch("OlmoeForCausalLM", "OlmoeConfig", "causal", "moe", dtype=torch.float32),
    # ---- encoder-only classifiers
    Arch("BertForSequenceClassification", "BertConfig", "seqcls", "encoder"),
    Arch("RobertaForSequenceClassification", "RobertaConfig", "seqcls", "encoder"),
    Arch("DebertaV2ForSequenceClassification", "DebertaV2Config", "seqcls", "encoder"),
    Arch("DistilBertForSequenceClassification", "DistilBertConfig", "seqcls", "encoder"),
    Arch("AlbertForSequenceClassification", "AlbertConfig", "seqcls", "encoder", sizes={"embedding_size": 32}),
    Arch("ElectraForSequenceClassification", "ElectraConfig", "seqcls", "encoder", sizes={"embedding_size": 32}),
    # Token mixing by a 2-D Fourier transform (complex intermediates, ``view_as_real``) instead of attention.
    Arch("FNetForSequenceClassification", "FNetConfig", "seqcls", "encoder"),
    # ---- encoder-decoder
    Arch("T5ForConditionalGeneration", "T5Config", "seq2seq", "encoder-decoder",
         extra={"decoder_start_token_id": 0}),  # T5's convention: decoding starts at the pad id
    Arch("BartForConditionalGeneration", "BartConfig", "seq2seq", "encoder-decoder"),
    Arch("PegasusForConditionalGeneration", "PegasusConfig", "seq2seq", "encoder-decoder"),
    # ---- vision
    Arch("ViTForImageClassification", "ViTConfig", "image", "vit"),
    Arch("DeiTForImageClassification", "DeiTConfig", "image", "vit"),
    Arch("BeitForImageClassification", "BeitConfig", "image", "vit"),
    Arch("Dinov2ForImageClassification", "Dinov2Config", "image", "vit"),
    Arch("SwinForImageClassification", "SwinConfig", "image", "vit",
         # patch 2 on 32x32: stage resolutions 16, 8, 4, 2 all hold the 2x2 window; the first
         # stage keeps 2 blocks (its second block shifts the windows)
         sizes={"patch_size": 2, "embed_dim": 16, "depths": [2, 1, 1, 1], "num_heads": [2, 2, 4, 4],
                "window_size": 2}),
    Arch("ResNetForImageClassification", "ResNetConfig", "image", "conv",
         sizes={"embedding_size": 16, "hidden_sizes": [16, 32, 32, 64], "depths": [1, 1, 1, 1]}),
    Arch("ConvNextForImageClassification", "ConvNextConfig", "image", "conv",
         sizes={"patch_size": 4, "hidden_sizes": [8, 16, 32, 64], "depths": [1, 1, 1, 1]}),
    Arch("RegNetForImageClassification", "RegNetConfig", "image", "conv",
         sizes={"embedding_size": 16, "hidden_sizes": [16, 32, 32, 64], "depths": [1, 1, 1, 1],
                "groups_width": 8}),
    Arch("MobileNetV2ForImageClassification", "MobileNetV2Config", "image", "conv",
         sizes={"depth_multiplier": 0.25}),
]


# Families held out of the default sweep (issue: probe of families the catalog had not seen),
# each matched on (2,) and (2, 2) at 1.1x its smallest budget; the full sweep runs them
# (``test_transformers.py``), the default run a few (``test_held_out.py``). Tasks beyond ARCHS':
# "audio" (raw waveform, class labels), "speech2seq" (log-mel features, token labels),
# "contrastive" (image-text pairs, ``return_loss``), "forecast" (past and future series),
# "probabilistic" (the same with time features and observed masks, a distribution's likelihood).
# Family-specific non-size settings in ``sizes`` say why in a comment.
HELD_OUT: list[Arch] = [
    # ---- encoders
    # YOSO's attention is a custom autograd.Function (YosoCumulation, its expectation form: a
    # backward that is not its forward's derivative), traced as one op trained with that backward.
    Arch("YosoForMaskedLM", "YosoConfig", "masked", "encoder", sizes={"num_hidden_layers": 2}),
    Arch("ConvBertForSequenceClassification", "ConvBertConfig", "seqcls", "encoder",
         sizes={"embedding_size": 32, "conv_kernel_size": 3}),
    Arch("SqueezeBertForSequenceClassification", "SqueezeBertConfig", "seqcls", "encoder",
         sizes={"embedding_size": 64}),
    Arch("MPNetForSequenceClassification", "MPNetConfig", "seqcls", "encoder"),
    Arch("FunnelForSequenceClassification", "FunnelConfig", "seqcls", "encoder",
         sizes={"block_sizes": [1, 1], "block_repeats": [1, 1], "d_head": 16, "d_inner": 128}),
    Arch("XLNetForSequenceClassification", "XLNetConfig", "seqcls", "encoder",
         sizes={"d_head": 16, "d_inner": 128, "mem_len": 16}),
    # block-sparse attention needs sequences of several 64-token blocks; at 8 tokens transformers
    # falls back to full attention anyway (with a warning): say so
    Arch("BigBirdForSequenceClassification", "BigBirdConfig", "seqcls", "encoder",
         sizes={"attention_type": "original_full"}),
    Arch("RoFormerForSequenceClassification", "RoFormerConfig", "seqcls", "encoder", sizes={"embedding_size": 64}),
    Arch("MegatronBertForSequenceClassification", "MegatronBertConfig", "seqcls", "encoder"),
    # ---- decoders
    Arch("CTRLLMHeadModel", "CTRLConfig", "causal", "decoder", sizes={"dff": 128}),
    Arch("PersimmonForCausalLM", "PersimmonConfig", "causal", "decoder"),
    Arch("NemotronForCausalLM", "NemotronConfig", "causal", "decoder-gqa",
         sizes={"head_dim": 16, "num_key_value_heads": 2}),
    Arch("GPTNeoForCausalLM", "GPTNeoConfig", "causal", "decoder",  # a global and a local-attention layer
         sizes={"attention_types": [[["global", "local"], 1]], "num_layers": 2, "window_size": 4}),
    Arch("CodeGenForCausalLM", "CodeGenConfig", "causal", "decoder"),
    # float32: its sinusoidal positions overflow a float64 cast (eager fails the same way)
    Arch("XGLMForCausalLM", "XGLMConfig", "causal", "decoder", dtype=torch.float32),
    Arch("BioGptForCausalLM", "BioGptConfig", "causal", "decoder"),
    Arch("DiffLlamaForCausalLM", "DiffLlamaConfig", "causal", "decoder-gqa"),
    Arch("BitNetForCausalLM", "BitNetConfig", "causal", "decoder-gqa"),
    Arch("Cohere2ForCausalLM", "Cohere2Config", "causal", "decoder-gqa",
         sizes={"sliding_window": 4, "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}),
    Arch("Glm4ForCausalLM", "Glm4Config", "causal", "decoder-gqa"),
    Arch("HeliumForCausalLM", "HeliumConfig", "causal", "decoder-gqa"),
    Arch("OlmoForCausalLM", "OlmoConfig", "causal", "decoder"),
    Arch("SmolLM3ForCausalLM", "SmolLM3Config", "causal", "decoder-gqa"),
    # ---- state-space and recurrent (and hybrids with attention)
    Arch("FalconMambaForCausalLM", "FalconMambaConfig", "causal", "ssm", sizes={"state_size": 4, "time_step_rank": 8}),
    Arch("Mamba2ForCausalLM", "Mamba2Config", "causal", "ssm",
         sizes={"state_size": 4, "n_groups": 1, "head_dim": 16, "num_heads": 8, "chunk_size": 4}),
    Arch("RwkvForCausalLM", "RwkvConfig", "causal", "ssm",  # 2 layers: its init divides by layers - 1
         sizes={"attention_hidden_size": 64, "context_length": 16, "num_hidden_layers": 2}),
    Arch("RecurrentGemmaForCausalLM", "RecurrentGemmaConfig", "causal", "ssm",  # recurrent, recurrent, attention
         sizes={"lru_width": 64, "attention_window_size": 4, "num_hidden_layers": 3, "num_key_value_heads": 4}),
    Arch("BambaForCausalLM", "BambaConfig", "causal", "ssm",
         sizes={"num_hidden_layers": 2, "attn_layer_indices": [1], "mamba_n_heads": 8, "mamba_d_head": 16,
                "mamba_d_state": 4, "mamba_chunk_size": 4, "mamba_n_groups": 1}),
    Arch("Lfm2ForCausalLM", "Lfm2Config", "causal", "ssm",
         sizes={"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"], "block_ff_dim": 128}),
    # ---- mixture of experts (float32: see ARCHS)
    # Jamba: a Mamba layer, an attention + MoE layer
    Arch("JambaForCausalLM", "JambaConfig", "causal", "moe", dtype=torch.float32,
         sizes={"num_hidden_layers": 2, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
                "expert_layer_offset": 1, "mamba_d_state": 4, "mamba_dt_rank": 8}),
    Arch("GraniteMoeForCausalLM", "GraniteMoeConfig", "causal", "moe", dtype=torch.float32),
    # DBRX's sub-configs: kv heads, and clip_qkv set (transformers 5's default None fails eagerly
    # in torch.clamp), rope_theta (missing from its attention config's defaults)
    Arch("DbrxForCausalLM", "DbrxConfig", "causal", "moe", dtype=torch.float32,
         sizes={"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2}}),
    Arch("GptOssForCausalLM", "GptOssConfig", "causal", "moe", dtype=torch.float32, sizes={"sliding_window": 4}),
    Arch("MiniMaxForCausalLM", "MiniMaxConfig", "causal", "moe", dtype=torch.float32,  # lightning + softmax attention
         sizes={"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"], "block_size": 4}),
    Arch("Glm4MoeForCausalLM", "Glm4MoeConfig", "causal", "moe", dtype=torch.float32,
         sizes={"first_k_dense_replace": 0, "n_routed_experts": 4, "n_group": 1, "topk_group": 1}),
    Arch("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig", "causal", "moe", dtype=torch.float32,
         sizes={"moe_num_experts": 4, "moe_k": 2, "moe_layer_start_index": 0}),
    Arch("NllbMoeForConditionalGeneration", "NllbMoeConfig", "seq2seq", "moe", dtype=torch.float32,
         sizes={"sparse_step": 1}),
    # ---- encoder-decoder
    Arch("WhisperForConditionalGeneration", "WhisperConfig", "speech2seq", "encoder-decoder",
         sizes={"num_mel_bins": 16, "max_source_positions": 8}),
    Arch("BlenderbotForConditionalGeneration", "BlenderbotConfig", "seq2seq", "encoder-decoder"),
    Arch("PLBartForConditionalGeneration", "PLBartConfig", "seq2seq", "encoder-decoder"),
    Arch("M2M100ForConditionalGeneration", "M2M100Config", "seq2seq", "encoder-decoder"),
    # ---- vision
    Arch("Swinv2ForImageClassification", "Swinv2Config", "image", "vit",
         sizes={"patch_size": 2, "embed_dim": 16, "depths": [2, 1, 1, 1], "num_heads": [2, 2, 4, 4], "window_size": 2}),
    Arch("PoolFormerForImageClassification", "PoolFormerConfig", "image", "conv",
         sizes={"hidden_sizes": [16, 32], "depths": [1, 1], "num_encoder_blocks": 2, "patch_sizes": [7, 3],
                "strides": [4, 2], "padding": [2, 1]}),
    Arch("MobileViTForImageClassification", "MobileViTConfig", "image", "vit",
         sizes={"hidden_sizes": [16, 16, 32], "neck_hidden_sizes": [8, 8, 16, 16, 16, 32, 64]}),
    # training batch norms inside the attention blocks; patch 16: its stem's four stride-2 convs
    Arch("LevitForImageClassification", "LevitConfig", "image", "vit",
         sizes={"patch_size": 16, "hidden_sizes": [16, 32, 48], "num_attention_heads": [1, 2, 3], "depths": [1, 1, 1],
                "key_dim": [8, 8, 8],
                "down_ops": [["Subsample", 8, 1, 4, 2, 2], ["Subsample", 8, 2, 4, 2, 2]]}),
    Arch("FocalNetForImageClassification", "FocalNetConfig", "image", "vit",
         sizes={"embed_dim": 16, "depths": [1, 1], "hidden_sizes": [16, 32], "patch_size": 4}),
    # depths 1, 2, 3: its drop-path list is indexed by stage
    Arch("CvtForImageClassification", "CvtConfig", "image", "vit",
         sizes={"embed_dim": [16, 32, 32], "num_heads": [1, 2, 2], "depth": [1, 2, 3], "mlp_ratio": [2.0, 2.0, 2.0],
                "drop_path_rate": [0.0, 0.0, 0.0]}),
    Arch("PvtForImageClassification", "PvtConfig", "image", "vit",
         sizes={"hidden_sizes": [16, 32], "depths": [1, 1], "num_encoder_blocks": 2,
                "sequence_reduction_ratios": [2, 1], "num_attention_heads": [1, 2], "patch_sizes": [4, 2],
                "strides": [4, 2], "mlp_ratios": [2, 2]}),
    # ---- speech (conv feature extractor with group norm, weight-normed positional conv);
    # mask_time_prob 0: SpecAugment masks random time steps in training, like dropout
    *(Arch(model, config, "audio", "audio", sizes={
        "conv_dim": [16, 16, 16], "conv_stride": [5, 2, 2], "conv_kernel": [10, 3, 3], "num_feat_extract_layers": 3,
        "num_conv_pos_embeddings": 4, "num_conv_pos_embedding_groups": 4, "mask_time_prob": 0.0,
        "classifier_proj_size": 32})
      for model, config in (("Wav2Vec2ForSequenceClassification", "Wav2Vec2Config"),
                            ("HubertForSequenceClassification", "HubertConfig"),
                            ("WavLMForSequenceClassification", "WavLMConfig"),
                            ("Data2VecAudioForSequenceClassification", "Data2VecAudioConfig"))),
    # ---- image-text (contrastive loss over the batch)
    Arch("CLIPModel", "CLIPConfig", "contrastive", "multimodal", sizes={"projection_dim": 32}, sub_configs=True),
    Arch("SiglipModel", "SiglipConfig", "contrastive", "multimodal", sub_configs=True),
    # ---- time series (patches by Tensor.unfold)
    Arch("PatchTSTForPrediction", "PatchTSTConfig", "forecast", "timeseries",
         sizes={"num_input_channels": 2, "context_length": 16, "patch_length": 4, "patch_stride": 4,
                "prediction_length": 4}),
    # probabilistic forecasts: a StudentT head's negative log-likelihood (torch.distributions);
    # Informer's ProbSparse attention writes rows of a converted cumsum in place
    *(Arch(model, config, "probabilistic", "timeseries", sizes={
        "prediction_length": 4, "context_length": 8, "lags_sequence": [1, 2], "num_time_features": 1,
        "d_model": 16, "encoder_ffn_dim": 32, "decoder_ffn_dim": 32, "encoder_attention_heads": 2,
        "decoder_attention_heads": 2})
      for model, config in (("TimeSeriesTransformerForPrediction", "TimeSeriesTransformerConfig"),
                            ("InformerForPrediction", "InformerConfig"))),
]


def _is_dropout(key: str, value: Any) -> bool:
    return isinstance(value, float) and not isinstance(value, bool) and any(w in key for w in _DROPOUT_WORDS)


def tiny_config(arch: Arch):
    """The config class's defaults with sizes shrunk, dropout 0 and out-of-vocab token ids moved."""
    import transformers

    return _tiny(getattr(transformers, arch.config), arch)


def _tiny(cls, arch: Arch):
    # Only the constructor's own arguments: derived fields (Swin's num_layers) are recomputed.
    accepted = set(inspect.signature(cls.__init__).parameters)
    defaults = {k: v for k, v in cls().to_dict().items() if k in accepted}
    kwargs: dict[str, Any] = {}
    for key, value in SHRINK.items():
        if isinstance(defaults.get(key), int) and not isinstance(defaults[key], bool):
            kwargs[key] = value
    for key, value in defaults.items():
        if _is_dropout(key, value):
            kwargs[key] = 0.0
    kwargs.update(arch.sizes)
    vocab = kwargs.get("vocab_size", defaults.get("vocab_size"))
    if isinstance(vocab, int):
        for key, value in defaults.items():
            if key.endswith("_token_id") and isinstance(value, int) and value >= vocab:
                kwargs[key] = vocab - 1
            elif key.endswith("_token_id") and isinstance(value, list):
                kwargs[key] = [v if v < vocab else vocab - 1 for v in value]
    kwargs.update(arch.extra)
    if arch.sub_configs:
        plain = Arch(arch.model, arch.config, arch.task, arch.group)
        for key, sub in getattr(cls, "sub_configs", {}).items():
            kwargs[key] = _tiny(sub, plain).to_dict()
    return cls(**kwargs)


def _inputs(arch: Arch, config) -> dict:
    vocab = getattr(config, "vocab_size", VOCAB)
    if arch.task in ("causal", "masked"):  # masked LM: a label per position, as causal
        return {"input_ids": torch.randint(0, vocab, (BATCH, SEQ)),
                "labels": torch.randint(0, vocab, (BATCH, SEQ))}
    if arch.task == "seqcls":
        return {"input_ids": torch.randint(0, vocab, (BATCH, SEQ)),
                "labels": torch.randint(0, config.num_labels, (BATCH,))}
    if arch.task == "seq2seq":
        return {"input_ids": torch.randint(0, vocab, (BATCH, SEQ)),
                "labels": torch.randint(0, vocab, (BATCH, TARGET_SEQ))}
    if arch.task == "image":
        return {"pixel_values": torch.randn(BATCH, config.num_channels, IMAGE, IMAGE),
                "labels": torch.randint(0, config.num_labels, (BATCH,))}
    if arch.task == "audio":
        return {"input_values": torch.randn(BATCH, AUDIO), "labels": torch.randint(0, config.num_labels, (BATCH,))}
    if arch.task == "speech2seq":  # the encoder's convs halve the frames to max_source_positions
        return {"input_features": torch.randn(BATCH, config.num_mel_bins, 2 * config.max_source_positions),
                "labels": torch.randint(0, vocab, (BATCH, TARGET_SEQ))}
    if arch.task == "contrastive":
        vision = config.vision_config
        return {"input_ids": torch.randint(0, config.text_config.vocab_size, (BATCH, SEQ)),
                "pixel_values": torch.randn(BATCH, vision.num_channels, vision.image_size, vision.image_size),
                "return_loss": True}
    if arch.task == "probabilistic":  # the past reaches back by the largest lag
        past, future, features = (config.context_length + max(config.lags_sequence), config.prediction_length,
                                  config.num_time_features)
        return {"past_values": torch.randn(BATCH, past), "past_time_features": torch.randn(BATCH, past, features),
                "past_observed_mask": torch.ones(BATCH, past), "future_values": torch.randn(BATCH, future),
                "future_time_features": torch.randn(BATCH, future, features)}
    if arch.task == "forecast":
        return {"past_values": torch.randn(BATCH, config.context_length, config.num_input_channels),
                "future_values": torch.randn(BATCH, config.prediction_length, config.num_input_channels)}
    raise ValueError(f"unknown task {arch.task!r}")


def build(arch: Arch):
    import transformers

    config = tiny_config(arch)
    model = getattr(transformers, arch.model)(config).to(arch.dtype)
    model.train()
    inputs = _inputs(arch, config)
    return model, {k: v.to(arch.dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                   for k, v in inputs.items()}


def entries(names: list[str] | None = None, *, archs: list[Arch] | None = None) -> list[Entry]:
    """Sweep entries of ``archs`` (default ``ARCHS``; ``HELD_OUT`` for the probed families)."""
    chosen = [a for a in (ARCHS if archs is None else archs) if names is None or a.model in names]
    return [Entry(a.model, (lambda a=a: build(a)), group=a.group) for a in chosen]


def deepseek_entry() -> Entry:
    """DeepSeek-V3 at the tiny sizes of issue 27 (multi-head latent attention, shared + routed
    experts, group-limited routing): the held-out model that trained with wrong gradients under
    a tight budget (an in-place write through a view lost to a layout conversion)."""

    def make():
        import transformers

        config = transformers.DeepseekV3Config(
            vocab_size=101, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
            n_shared_experts=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=64)
        ids = torch.randint(0, 101, (4, 16))
        return transformers.DeepseekV3ForCausalLM(config), {"input_ids": ids, "labels": ids}

    return Entry("DeepseekV3ForCausalLM", make, group="moe")
