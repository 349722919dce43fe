"""Hand-written training models of the kind users write, outside every catalog (the user-model probe).

Each ``Case`` builds (under ``torch.manual_seed``) a model with real CPU weights, the positional
inputs of its forward, the targets (or None when the loss is computed inside forward) and the loss
function a user would write: ``loss_fn(outputs, targets) -> scalar``. The patterns are the ones ML
engineers write by hand and the zoo / catalog models do not: weight tying by assignment, losses
inside forward returned in a dict / tuple / dataclass, masks from triu / where / masked_fill,
``nn.MultiheadAttention`` with ``key_padding_mask``, ``scaled_dot_product_attention`` with
``is_causal`` and with a mask, RNN encoders, a U-Net with norms and upsampling, MLP-Mixer, 1-D
convolutions, rotary caches as non-persistent buffers, gated MLPs with chunk / split, buffers
updated in forward, ``torch.utils.checkpoint``, a parameter used twice, einsum attention, label
smoothing / ``ignore_index``, ``nn.ParameterList`` / ``nn.ModuleDict``.
``tests/sweeps/user_probe.py`` trains them through the public API; ``test_user_models.py`` runs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .user_cases import B, D, T, V, Case, ce as _ce, ids as _ids, inside as _inside, mse as _mse, tag_loss as _tag_loss
from .user_models_extra import EXTRA_CASES
from .user_models_more import MORE_CASES


# -- 1. hand-tied LM: loss inside forward, dict output, label smoothing + ignore_index ---------------
class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.pos = nn.Parameter(torch.randn(T, D) * 0.02)
        self.block = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight  # tied by hand

    def forward(self, ids, labels):
        h = self.emb(ids) + self.pos
        h = h + self.block(h)
        logits = self.head(self.norm(h))
        loss = F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100, label_smoothing=0.1)
        return {"loss": loss, "logits": logits}


def _tied_lm():
    ids = _ids()
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    return TiedLM(), (ids, labels), None


# -- 2. causal attention: SDPA is_causal + a triu/masked_fill mask, rotary cos/sin buffers ----------
def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class RotaryCausalLM(nn.Module):
    def __init__(self, heads: int = 4):
        super().__init__()
        self.heads, hd = heads, D // heads
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        freqs = torch.outer(torch.arange(T).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self.emb = nn.Embedding(V, D)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.qkv2 = nn.Linear(D, 3 * D)
        self.proj2 = nn.Linear(D, D)
        self.head = nn.Linear(D, V)

    def _split(self, x):
        return x.view(x.shape[0], T, self.heads, -1).transpose(1, 2)

    def _attend(self, h, qkv, proj, mask):
        q, k, v = map(self._split, qkv(h).split(D, dim=-1))
        q = q * self.cos + _rotate_half(q) * self.sin
        k = k * self.cos + _rotate_half(k) * self.sin
        if mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return proj(o.transpose(1, 2).reshape(h.shape))

    def forward(self, ids, labels):
        h = self.emb(ids)
        h = h + self._attend(h, self.qkv, self.proj, None)
        future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        mask = torch.zeros(T, T).masked_fill(future, float("-inf"))
        h = h + self._attend(h, self.qkv2, self.proj2, mask)
        logits = self.head(h)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits  # tuple, loss first


def _rotary_lm():
    ids = _ids()
    return RotaryCausalLM(), (ids, ids.roll(-1, dims=1)), None


# -- 3. nn.MultiheadAttention + key_padding_mask, masked mean pooling, loss outside ----------------
class PaddedClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D, padding_idx=0)
        self.attn = nn.MultiheadAttention(D, 4, batch_first=True)
        self.norm = nn.LayerNorm(D)
        self.cls = nn.Linear(D, 5)

    def forward(self, ids):
        pad = ids == 0
        h = self.emb(ids)
        a, _ = self.attn(h, h, h, key_padding_mask=pad, need_weights=False)
        h = self.norm(h + a)
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        pooled = (h * keep).sum(1) / keep.sum(1).clamp(min=1.0)
        return self.cls(pooled)


def _padded_classifier():
    ids = _ids()
    lengths = torch.randint(T // 2, T + 1, (B,))
    ids = torch.where(torch.arange(T) < lengths[:, None], ids.clamp(min=1), torch.zeros_like(ids))
    return PaddedClassifier(), (ids,), torch.randint(0, 5, (B,))


# -- 4. LSTM / GRU encoder + linear head ---------------------------------------------------------
class RNNTagger(nn.Module):
    def __init__(self, cell: type[nn.Module]):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.rnn = cell(D, D, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * D, 7)

    def forward(self, ids):
        out, _ = self.rnn(self.emb(ids))
        return self.head(out)


def _rnn(cell):
    return lambda: (RNNTagger(cell), (_ids(),), torch.randint(0, 7, (B, T)))


# -- 5. U-Net: GroupNorm / InstanceNorm, interpolate, ConvTranspose2d, skips ----------------------
class TinyUNet(nn.Module):
    def __init__(self, c: int = 8):
        super().__init__()
        self.down1 = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.GroupNorm(2, c), nn.SiLU())
        self.down2 = nn.Sequential(nn.Conv2d(c, 2 * c, 3, stride=2, padding=1), nn.InstanceNorm2d(2 * c, affine=True),
                                   nn.ReLU())
        self.mid = nn.Sequential(nn.Conv2d(2 * c, 2 * c, 3, stride=2, padding=1), nn.GroupNorm(4, 2 * c), nn.SiLU())
        self.up1 = nn.ConvTranspose2d(2 * c, 2 * c, 2, stride=2)
        self.fuse = nn.Conv2d(4 * c, c, 3, padding=1)
        self.out = nn.Conv2d(2 * c, 3, 1)

    def forward(self, x):
        s1 = self.down1(x)
        s2 = self.down2(s1)
        m = self.mid(s2)
        u = torch.cat([self.up1(m), s2], dim=1)
        u = F.interpolate(self.fuse(u), scale_factor=2, mode="nearest")
        return self.out(torch.cat([u, s1], dim=1))


def _unet():
    return TinyUNet(), (torch.randn(B, 3, 16, 16),), torch.randn(B, 3, 16, 16)


# -- 6. MLP-Mixer ---------------------------------------------------------------------------------
class MixerBlock(nn.Module):
    def __init__(self, tokens: int, dim: int):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.tok = nn.Sequential(nn.Linear(tokens, 2 * tokens), nn.GELU(), nn.Linear(2 * tokens, tokens))
        self.ch = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        x = x + self.tok(self.n1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.ch(self.n2(x))


class Mixer(nn.Module):
    def __init__(self, patch: int = 4, dim: int = D):
        super().__init__()
        self.stem = nn.Conv2d(3, dim, patch, stride=patch)
        self.blocks = nn.Sequential(*(MixerBlock(16, dim) for _ in range(2)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 10)

    def forward(self, img):
        x = self.stem(img).flatten(2).transpose(1, 2)
        return self.head(self.norm(self.blocks(x)).mean(dim=1))


def _mixer():
    return Mixer(), (torch.randn(B, 3, 16, 16),), torch.randint(0, 10, (B,))


# -- 7. 1-D conv audio model ----------------------------------------------------------------------
class AudioNet(nn.Module):
    def __init__(self, c: int = 16):
        super().__init__()
        self.feat = nn.Sequential(
            nn.Conv1d(1, c, 9, stride=4, padding=4), nn.BatchNorm1d(c), nn.GELU(),
            nn.Conv1d(c, 2 * c, 5, stride=2, padding=2, groups=2), nn.BatchNorm1d(2 * c), nn.GELU(),
            nn.Conv1d(2 * c, 2 * c, 3, padding=2, dilation=2), nn.GELU())
        self.pool = nn.AdaptiveAvgPool1d(1)
        self.head = nn.Linear(2 * c, 6)

    def forward(self, wav):
        return self.head(self.pool(self.feat(wav.unsqueeze(1))).squeeze(-1))


def _audio():
    return AudioNet(), (torch.randn(B, 256),), torch.randint(0, 6, (B,))


# -- 8. rotary with torch.polar / complex multiply ------------------------------------------------
class PolarRotary(nn.Module):
    def __init__(self):
        super().__init__()
        freqs = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
        angles = torch.outer(torch.arange(T).float(), freqs)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)
        self.emb = nn.Embedding(V, D)
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.head = nn.Linear(D, V)

    def _rope(self, x):
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * self.freqs_cis).flatten(-2).type_as(x)

    def forward(self, ids):
        h = self.emb(ids)
        q, k = self._rope(self.q(h)), self._rope(self.k(h))
        scores = q @ k.transpose(-2, -1) / math.sqrt(D)
        scores = torch.where(torch.ones(T, T, dtype=torch.bool).tril(), scores, torch.finfo(scores.dtype).min)
        return self.head(scores.softmax(-1) @ self.v(h))


def _polar():
    ids = _ids()
    return PolarRotary(), (ids,), ids.roll(-1, dims=1)


# -- 9. gated MLP with chunk and split ------------------------------------------------------------
class GatedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, 4 * D, bias=False)     # gate | value, chunked
        self.up2 = nn.Linear(D, 3 * D, bias=False)    # uneven split: 2D | D
        self.down = nn.Linear(2 * D, D, bias=False)
        self.down2 = nn.Linear(2 * D, D, bias=False)
        self.norm = nn.RMSNorm(D)

    def forward(self, x):
        gate, val = self.up(self.norm(x)).chunk(2, dim=-1)
        x = x + self.down(F.silu(gate) * val)
        a, b = self.up2(x).split([2 * D, D], dim=-1)
        return x + self.down2(a * torch.sigmoid(b).repeat(1, 1, 2))


def _gated():
    return GatedMLP(), (torch.randn(B, T, D),), torch.randn(B, T, D)


# -- 10. a bf16 submodule inside an fp32 model ----------------------------------------------------
class MixedDtype(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.low = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D)).to(torch.bfloat16)
        self.out = nn.Linear(D, 4)

    def forward(self, x):
        h = self.inp(x)
        h = h + self.low(h.to(torch.bfloat16)).float()
        return self.out(h.mean(1))


def _mixed():
    return MixedDtype(), (torch.randn(B, T, D),), torch.randint(0, 4, (B,))


# -- 11. buffers updated in forward: an EMA of the input and a step counter ----------------------
class EMANorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("ema", torch.zeros(D))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, 3)

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.ema.mul_(0.9).add_(0.1 * x.mean(dim=(0, 1)))
                self.steps += 1
        return self.fc2(F.relu(self.fc1(x - self.ema))).mean(1)


def _ema():
    return EMANorm(), (torch.randn(B, T, D),), torch.randint(0, 3, (B,))


# -- 12. torch.utils.checkpoint inside the model --------------------------------------------------
class CheckpointedStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.Tanh(),
                                                  nn.Linear(2 * D, D)) for _ in range(3))
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        for layer in self.layers:
            x = x + checkpoint(layer, x, use_reentrant=False)
        return self.head(x).squeeze(-1)


def _checkpointed():
    return CheckpointedStack(), (torch.randn(B, T, D),), torch.randn(B, T)


# -- 13. a parameter used twice; ParameterList + ModuleDict; loss on a dataclass output ------------
@dataclass
class Output:
    loss: torch.Tensor
    logits: torch.Tensor


class Routed(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(D, D)
        self.scales = nn.ParameterList([nn.Parameter(torch.ones(D)), nn.Parameter(torch.full((D,), 0.5))])
        self.heads = nn.ModuleDict({"a": nn.Linear(D, 3), "b": nn.Linear(D, 3)})
        self.bias = nn.Parameter(torch.zeros(D))

    def forward(self, x, y):
        h = torch.tanh(self.shared(x) + self.bias)
        h = torch.tanh(self.shared(h * self.scales[0]) + self.bias)  # the same weight and bias again
        logits = self.heads["a"](h * self.scales[1]) + self.heads["b"](h)
        return Output(loss=F.cross_entropy(logits.mean(1), y), logits=logits)


def _routed():
    return Routed(), (torch.randn(B, T, D), torch.randint(0, 3, (B,))), None


# -- 14. einsum attention -------------------------------------------------------------------------
class EinsumAttention(nn.Module):
    def __init__(self, heads: int = 4):
        super().__init__()
        self.h = heads
        self.wq = nn.Parameter(torch.randn(D, heads, D // heads) * 0.1)
        self.wk = nn.Parameter(torch.randn(D, heads, D // heads) * 0.1)
        self.wv = nn.Parameter(torch.randn(D, heads, D // heads) * 0.1)
        self.wo = nn.Parameter(torch.randn(heads, D // heads, D) * 0.1)

    def forward(self, x):
        q = torch.einsum("btd,dhe->bhte", x, self.wq)
        k = torch.einsum("btd,dhe->bhte", x, self.wk)
        v = torch.einsum("btd,dhe->bhte", x, self.wv)
        att = torch.einsum("bhte,bhse->bhts", q, k) / math.sqrt(q.shape[-1])
        att = att.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf")).softmax(-1)
        return x + torch.einsum("bhts,bhse,hed->btd", att, v, self.wo)


def _einsum():
    return EinsumAttention(), (torch.randn(B, T, D),), torch.randn(B, T, D)


# -- 15. loss outside with a tuple output; smoothing + ignore_index in the criterion -------------
class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D, 2 * D), nn.ReLU(), nn.Linear(2 * D, D), nn.ReLU())
        self.cls = nn.Linear(D, 5)
        self.reg = nn.Linear(D, 1)

    def forward(self, x):
        h = self.body(x)
        return self.cls(h), self.reg(h).squeeze(-1)


def _two_heads():
    labels = torch.randint(0, 5, (B, T))
    labels[:, :3] = -1
    return TwoHeads(), (torch.randn(B, T, D),), (labels, torch.randn(B, T))


def _two_heads_loss(out, targets):
    logits, value = out
    labels, reg = targets
    ce = nn.CrossEntropyLoss(ignore_index=-1, label_smoothing=0.05)(logits.flatten(0, 1), labels.flatten())
    return ce + 0.5 * F.smooth_l1_loss(value, reg)


CASES: tuple[Case, ...] = (
    Case("tied_lm_dict_loss", _tied_lm, _inside),
    Case("rotary_sdpa_causal_mask", _rotary_lm, _inside),
    Case("mha_key_padding", _padded_classifier, _ce),
    Case("lstm_tagger", _rnn(nn.LSTM), _tag_loss),
    Case("gru_tagger", _rnn(nn.GRU), _tag_loss),
    Case("unet_groupnorm_upsample", _unet, _mse),
    Case("mlp_mixer", _mixer, _ce),
    Case("audio_conv1d", _audio, _ce),
    Case("rotary_polar_complex", _polar, _tag_loss),
    Case("gated_mlp_chunk_split", _gated, _mse),
    Case("bf16_submodule", _mixed, _ce),
    Case("ema_buffer_counter", _ema, _ce),
    Case("checkpoint_inside", _checkpointed, _mse),
    Case("param_twice_paramlist_moduledict", _routed, _inside),
    Case("einsum_attention", _einsum, _mse),
    Case("loss_outside_two_heads", _two_heads, _two_heads_loss),
    *MORE_CASES,
    *EXTRA_CASES,
)


def case(name: str) -> Case:
    found = [c for c in CASES if c.name == name]
    if not found:
        raise KeyError(f"no user model {name!r}; known: {[c.name for c in CASES]}")
    return found[0]
