"""Model zoo: real model families built from ``transformers`` config classes, plus a plain MLP.

Contract: ``build(name, ...) -> (model, inputs)`` where ``inputs`` is a kwargs dict of tensors
(labels included, so a traced graph ends in the loss). Models are in training mode.

- ``device="meta"`` (default): parameters and inputs live on ``meta``; nothing is allocated.
- ``device="cpu"``: real, randomly initialised weights and valid random inputs (token ids below
  the vocabulary size, class labels below the number of classes), deterministic under
  ``torch.manual_seed``. Intended for tiny configs in numerical tests.

``tiny=True`` keeps the family (same modules, same ops) at toy size: 2 layers, hidden 64,
4 heads (Llama: 2 KV heads), vocab 128, small images, batch 4, seq 16, dropout 0 so that
numerical comparisons are exact. Every tiny size divides by 2 and 4, so sharding tests can split
heads, hidden and vocab on meshes of 2 and 4. Real sizes are the published ones.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

NAMES: tuple[str, ...] = (
    "mlp", "gpt2", "gpt2-medium", "gpt2-xl", "bert-base",
    "llama-1b", "llama-8b", "llama-70b", "vit-base", "resnet50",
)

_TINY_BATCH = 4
_TINY_SEQ = 16
_TINY_VOCAB = 128
_BATCH = 8


class MLP(nn.Module):
    """Plain Linear/GELU/Linear blocks with residuals and a classification head + loss.

    ``forward(x, labels)`` takes ``x`` of shape (batch, seq, hidden) and integer ``labels`` of
    shape (batch, seq); it returns ``(loss, logits)``.
    """

    def __init__(self, *, hidden: int, ffn: int, num_layers: int, num_classes: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
            for _ in range(num_layers)
        )
        self.head = nn.Linear(hidden, num_classes)
        self.num_classes = num_classes
        self.hidden = hidden

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for block in self.blocks:
            x = x + block(x)
        logits = self.head(x)
        loss = F.cross_entropy(logits.reshape(-1, self.num_classes), labels.reshape(-1))
        return loss, logits


def _pick(value: int | None, default: int) -> int:
    return default if value is None else value


def _token_inputs(*, vocab: int, batch: int, seq: int, device: str) -> dict:
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    labels = torch.randint(0, vocab, (batch, seq), device=device)
    return {"input_ids": ids, "labels": labels}


def _build_mlp(*, tiny, batch, seq, num_layers, device):
    hidden, classes = (64, 32) if tiny else (4096, 1024)
    model = MLP(hidden=hidden, ffn=4 * hidden, num_layers=_pick(num_layers, 2 if tiny else 4),
                num_classes=classes)
    x = torch.randn(batch, seq, hidden, device=device)
    labels = torch.randint(0, classes, (batch, seq), device=device)
    return model, {"x": x, "labels": labels}


_GPT2_SIZES = {  # name -> (layers, hidden, heads)
    "gpt2": (12, 768, 12),
    "gpt2-medium": (24, 1024, 16),
    "gpt2-xl": (48, 1600, 25),
}


def _gpt2(name: str) -> Callable:
    def build(*, tiny, batch, seq, num_layers, device):
        from transformers import GPT2Config, GPT2LMHeadModel

        layers, hidden, heads = (2, 64, 4) if tiny else _GPT2_SIZES[name]
        vocab = _TINY_VOCAB if tiny else 50257
        drop = 0.0 if tiny else 0.1
        config = GPT2Config(
            vocab_size=vocab, n_positions=max(seq, 64 if tiny else 1024), n_embd=hidden,
            n_layer=_pick(num_layers, layers), n_head=heads, use_cache=False,
            resid_pdrop=drop, embd_pdrop=drop, attn_pdrop=drop, attn_implementation="sdpa",
            bos_token_id=vocab - 1, eos_token_id=vocab - 1,
        )
        model = GPT2LMHeadModel(config)
        model.loss_type = "ForCausalLM"  # HF's default for this class, named to skip a warning
        return model, _token_inputs(vocab=vocab, batch=batch, seq=seq, device=device)
    return build


def _build_bert(*, tiny, batch, seq, num_layers, device):
    from transformers import BertConfig, BertForMaskedLM

    vocab = _TINY_VOCAB if tiny else 30522
    drop = 0.0 if tiny else 0.1
    config = BertConfig(
        vocab_size=vocab, hidden_size=64 if tiny else 768,
        num_hidden_layers=_pick(num_layers, 2 if tiny else 12),
        num_attention_heads=4 if tiny else 12, intermediate_size=128 if tiny else 3072,
        max_position_embeddings=max(seq, 64 if tiny else 512),
        hidden_dropout_prob=drop, attention_probs_dropout_prob=drop, attn_implementation="sdpa",
    )
    model = BertForMaskedLM(config)
    return model, _token_inputs(vocab=vocab, batch=batch, seq=seq, device=device)


_LLAMA_SIZES = {  # name -> (layers, hidden, heads, kv heads, intermediate, tied embeddings)
    "llama-1b": (16, 2048, 32, 8, 8192, True),    # Llama-3.2-1B
    "llama-8b": (32, 4096, 32, 8, 14336, False),  # Llama-3-8B
    "llama-70b": (80, 8192, 64, 8, 28672, False),  # Llama-3-70B
}


def _llama(name: str) -> Callable:
    def build(*, tiny, batch, seq, num_layers, device):
        from transformers import LlamaConfig, LlamaForCausalLM

        if tiny:
            layers, hidden, heads, kv_heads, inter, tied = 2, 64, 4, 2, 128, False
        else:
            layers, hidden, heads, kv_heads, inter, tied = _LLAMA_SIZES[name]
        vocab = _TINY_VOCAB if tiny else 128256
        config = LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
            num_hidden_layers=_pick(num_layers, layers), num_attention_heads=heads,
            num_key_value_heads=kv_heads, max_position_embeddings=max(seq, 64 if tiny else 8192),
            rope_theta=500000.0, tie_word_embeddings=tied, use_cache=False,
            attn_implementation="sdpa",
        )
        model = LlamaForCausalLM(config)
        model.loss_type = "ForCausalLM"  # HF's default for this class, named to skip a warning
        return model, _token_inputs(vocab=vocab, batch=batch, seq=seq, device=device)
    return build


def _build_vit(*, tiny, batch, seq, num_layers, device):
    from transformers import ViTConfig, ViTForImageClassification

    image, classes = (32, 10) if tiny else (224, 1000)
    drop = 0.0  # ViT-Base publishes dropout 0.0
    config = ViTConfig(
        hidden_size=64 if tiny else 768, num_hidden_layers=_pick(num_layers, 2 if tiny else 12),
        num_attention_heads=4 if tiny else 12, intermediate_size=128 if tiny else 3072,
        image_size=image, patch_size=8 if tiny else 16, num_labels=classes,
        hidden_dropout_prob=drop, attention_probs_dropout_prob=drop, attn_implementation="sdpa",
    )
    model = ViTForImageClassification(config)
    pixels = torch.randn(batch, 3, image, image, device=device)
    labels = torch.randint(0, classes, (batch,), device=device)
    return model, {"pixel_values": pixels, "labels": labels}


def _build_resnet(*, tiny, batch, seq, num_layers, device):
    from transformers import ResNetConfig, ResNetForImageClassification

    if tiny:
        image, classes, embed, sizes, depths = 32, 10, 16, [32, 64], [1, 1]
    else:
        image, classes, embed, sizes, depths = 224, 1000, 64, [256, 512, 1024, 2048], [3, 4, 6, 3]
    if num_layers is not None:  # depth sweep: blocks per stage
        depths = [num_layers] * len(sizes)
    config = ResNetConfig(
        embedding_size=embed, hidden_sizes=sizes, depths=depths, layer_type="bottleneck",
        num_labels=classes,
    )
    model = ResNetForImageClassification(config)
    pixels = torch.randn(batch, 3, image, image, device=device)
    labels = torch.randint(0, classes, (batch,), device=device)
    return model, {"pixel_values": pixels, "labels": labels}


_BUILDERS: dict[str, Callable] = {
    "mlp": _build_mlp,
    **{name: _gpt2(name) for name in _GPT2_SIZES},
    "bert-base": _build_bert,
    **{name: _llama(name) for name in _LLAMA_SIZES},
    "vit-base": _build_vit,
    "resnet50": _build_resnet,
}
assert set(_BUILDERS) == set(NAMES)


def build(
    name: str, *, tiny: bool = False, batch: int | None = None, seq: int | None = None,
    num_layers: int | None = None, device: str = "meta",
) -> tuple[nn.Module, dict]:
    """(model, inputs) for a zoo model; see the module docstring for sizes and devices.

    ``num_layers`` overrides depth (transformer layers, MLP blocks, ResNet blocks per stage).
    ``seq`` is ignored by the image models.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown zoo model {name!r}; known: {', '.join(NAMES)}")
    if device not in ("meta", "cpu"):
        raise ValueError(f"device must be 'meta' or 'cpu', got {device!r}")
    for label, value in (("batch", batch), ("seq", seq), ("num_layers", num_layers)):
        if value is not None and value < 1:
            raise ValueError(f"{label} must be >= 1, got {value}")
    batch = _pick(batch, _TINY_BATCH if tiny else _BATCH)
    seq = _pick(seq, _TINY_SEQ if tiny else (512 if name == "bert-base" else 1024))
    with torch.device(device):
        model, inputs = _BUILDERS[name](
            tiny=tiny, batch=batch, seq=seq, num_layers=num_layers, device=device)
    model.train()
    return model, inputs


def default_demo() -> tuple[nn.Module, dict]:
    """The embedded `make demo` model: GPT-2 with 4 layers, hidden 256, 4 heads, on meta."""
    from transformers import GPT2Config, GPT2LMHeadModel

    batch, seq = 8, 256
    config = GPT2Config(n_positions=1024, n_embd=256, n_layer=4, n_head=4, use_cache=False,
                        attn_implementation="sdpa")
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
        model.loss_type = "ForCausalLM"
        inputs = _token_inputs(vocab=config.vocab_size, batch=batch, seq=seq, device="meta")
    model.train()
    return model, inputs
