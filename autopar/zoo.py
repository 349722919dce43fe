"""Model zoo: real model families built from ``transformers`` config classes, plus a plain MLP.

Contract: ``build(name, ...) -> (model, inputs)`` where ``inputs`` is a kwargs dict of tensors
(labels included, so a traced graph ends in the loss). Models are in training mode.

- ``device="meta"`` (default): parameters and inputs live on ``meta``; nothing is allocated.
- ``device="cpu"``: real, randomly initialised weights and valid random inputs (token ids below
  the vocabulary size, class labels below the number of classes), deterministic under
  ``torch.manual_seed``. Intended for tiny configs in numerical tests.

``dlrm`` is the MLPerf DLRM on Criteo 1TB (26 tables of dim 128, published cardinalities and
multi-hot sizes, global batch 65536), with DLRM's pairwise dot interaction; ``tiny=True`` gives 4
small tables pooling by sum, mean, max and sum, over bags of random length (possibly empty).

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
    "llama-1b", "llama-8b", "llama-70b", "vit-base", "resnet50", "dlrm",
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


class DLRM(nn.Module):
    """DLRM (Naumov et al. 2019): a bottom MLP on the dense features, one ``nn.EmbeddingBag`` per
    sparse feature, the pairwise dot products of the ``1 + T`` feature vectors, a top MLP, BCE loss.

    ``forward(dense, indices, offsets, labels)``: ``dense`` (B, num_dense) floats; ``indices`` the
    ids of every table back to back, table ``t`` owning ``B * hotness[t]`` of them (a static
    slice); ``offsets`` (T, B) where each table's bags start within its own slice (bags may vary in
    length and be empty, as in a jagged batch); ``labels`` (B,) in {0, 1}. Returns ``(loss, logits)``.
    """

    def __init__(self, *, num_dense: int, table_rows: tuple[int, ...], dim: int, bottom: tuple[int, ...],
                 top: tuple[int, ...], hotness: tuple[int, ...], modes: tuple[str, ...] | None = None) -> None:
        super().__init__()
        if len(hotness) != len(table_rows):
            raise ValueError(f"{len(table_rows)} tables but {len(hotness)} hotness values")
        modes = modes or ("sum",) * len(table_rows)
        self.bottom = _mlp((num_dense, *bottom, dim), last_relu=True)
        self.tables = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode=mode) for rows, mode in zip(table_rows, modes))
        features = 1 + len(table_rows)
        # Flat positions of the upper triangle (i < j) of the (F, F) dot-product matrix; a buffer,
        # so that the graph indexes with a placeholder rather than a constant made inside forward.
        rows, cols = torch.triu_indices(features, features, offset=1)
        self.register_buffer("pairs", rows * features + cols, persistent=False)
        self.top = _mlp((dim + len(rows), *top, 1), last_relu=False)
        self.hotness = tuple(hotness)

    def forward(self, dense: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor,
                labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch = dense.shape[0]
        x = self.bottom(dense)
        pooled, start = [], 0
        for t, table in enumerate(self.tables):
            count = batch * self.hotness[t]
            pooled.append(table(indices[start:start + count], offsets[t]))
            start += count
        features = torch.stack([x, *pooled], dim=1)  # (B, F, dim)
        dots = torch.bmm(features, features.transpose(1, 2)).flatten(1)
        logits = self.top(torch.cat([x, dots.index_select(1, self.pairs)], dim=1)).squeeze(1)
        return F.binary_cross_entropy_with_logits(logits, labels), logits


def _mlp(sizes: tuple[int, ...], *, last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


# MLPerf Training's DLRM on Criteo 1TB (recommendation_v2/torchrec_dlrm in github.com/mlcommons/training,
# its README's --num_embeddings_per_feature and --multi_hot_sizes): rows and ids per sample of each
# of the 26 tables; embedding dim 128, dense arch 512-256-128, over arch 1024-1024-512-256-1.
CRITEO_1TB_ROWS = (40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
                   2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36)
CRITEO_1TB_HOTNESS = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)
CRITEO_1TB_BATCH = 65536  # MLPerf's global batch


def dlrm_inputs(model: DLRM, *, batch: int, device: str) -> dict:
    """Random valid inputs: ids below each table's size, bags of random lengths (possibly empty)."""
    num_dense = model.bottom[0].in_features
    dense = torch.randn(batch, num_dense, device=device)
    labels = torch.randint(0, 2, (batch,), device=device).float()
    ids, offsets = [], []
    for table, hot in zip(model.tables, model.hotness):
        count = batch * hot
        ids.append(torch.randint(0, table.num_embeddings, (count,), device=device))
        if device == "meta":
            offsets.append(torch.empty(batch, dtype=torch.long, device=device))
        else:  # bag starts: sorted cut points of the table's ids, the first at 0
            cuts = torch.sort(torch.randint(0, count + 1, (batch - 1,))).values
            offsets.append(torch.cat([torch.zeros(1, dtype=torch.long), cuts]))
    return {"dense": dense, "indices": torch.cat(ids), "offsets": torch.stack(offsets), "labels": labels}


def _build_dlrm(*, tiny, batch, seq, num_layers, device):
    if tiny:
        model = DLRM(num_dense=16, table_rows=(32, 64, 16, 48), dim=8, bottom=(32,), top=(32,),
                     hotness=(2, 3, 1, 4), modes=("sum", "mean", "max", "sum"))
    else:
        model = DLRM(num_dense=13, table_rows=CRITEO_1TB_ROWS, dim=128, bottom=(512, 256), top=(1024, 1024, 512, 256),
                     hotness=CRITEO_1TB_HOTNESS)
    return model, dlrm_inputs(model, batch=batch, device=device)


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
    "dlrm": _build_dlrm,
}
assert set(_BUILDERS) == set(NAMES)


def build(
    name: str, *, tiny: bool = False, batch: int | None = None, seq: int | None = None,
    num_layers: int | None = None, device: str = "meta",
) -> tuple[nn.Module, dict]:
    """(model, inputs) for a zoo model; see the module docstring for sizes and devices.

    ``num_layers`` overrides depth (transformer layers, MLP blocks, ResNet blocks per stage; not
    DLRM's). ``seq`` is ignored by the image models and DLRM.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown zoo model {name!r}; known: {', '.join(NAMES)}")
    if device not in ("meta", "cpu"):
        raise ValueError(f"device must be 'meta' or 'cpu', got {device!r}")
    for label, value in (("batch", batch), ("seq", seq), ("num_layers", num_layers)):
        if value is not None and value < 1:
            raise ValueError(f"{label} must be >= 1, got {value}")
    batch = _pick(batch, _TINY_BATCH if tiny else (CRITEO_1TB_BATCH if name == "dlrm" else _BATCH))
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
