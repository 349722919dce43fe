"""More hand-written user models for the probe (``user_models`` lists them all): two towers with a
contrastive loss, ``nn.TransformerEncoder`` with masks, frozen / no-grad parts, in-place slice
writes with gather, weight-norm parametrization and a module under two names, a plain tensor
attribute with unfold and pixel shuffle, a dense mixture of experts, GQA with repeat_interleave."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .user_cases import B, D, T, V, Case, ce as _ce, ids as _ids, inside as _inside, mse as _mse, tag_loss as _tag_loss


# -- 16. CLIP-style two towers: normalised features, a learnable logit scale, arange labels --------
class TwoTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.img = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, D), nn.GELU(), nn.Linear(D, D))
        self.txt_emb = nn.EmbeddingBag(V, D, mode="mean")
        self.txt = nn.Linear(D, D)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(10.0)))

    def forward(self, images, tokens):
        a = F.normalize(self.img(images), dim=-1)
        b = F.normalize(self.txt(self.txt_emb(tokens)), dim=-1)
        logits = self.logit_scale.exp() * a @ b.t()
        labels = torch.arange(images.shape[0])
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def _two_tower():
    return TwoTower(), (torch.randn(B, 3, 8, 8), _ids(shape=(B, 6))), None


# -- 17. nn.TransformerEncoder with a causal mask and src_key_padding_mask ------------------------
class TorchEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        layer = nn.TransformerEncoderLayer(D, 4, 2 * D, dropout=0.0, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(D, V)

    def forward(self, ids, pad):
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        return self.head(self.enc(self.emb(ids), mask=mask, src_key_padding_mask=pad, is_causal=True))


def _torch_encoder():
    ids = _ids()
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[:, -3:] = True
    return TorchEncoder(), (ids, pad), ids.roll(-1, dims=1)


# -- 18. frozen parts: a requires_grad=False embedding, a no_grad teacher, an eval-mode submodule -
class Distill(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.emb.weight.requires_grad_(False)
        self.teacher = nn.Sequential(nn.Linear(D, D), nn.Dropout(0.5), nn.Linear(D, V))
        self.teacher.requires_grad_(False)
        self.teacher.eval()
        self.student = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, V))

    def forward(self, ids):
        h = self.emb(ids)
        with torch.no_grad():
            soft = self.teacher(h).softmax(-1)
        logp = self.student(h).log_softmax(-1)
        return F.kl_div(logp, soft, reduction="batchmean")


def _distill():
    model = Distill()
    model.train()
    model.teacher.eval()
    return model, (_ids(),), None


# -- 19. in-place slice writes, cumsum positions from a mask, gather, index_select --------------
class PointerNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.pos = nn.Embedding(T + 1, D)
        self.q = nn.Linear(D, D)

    def forward(self, ids, mask, picks):
        positions = (mask.long().cumsum(-1) * mask.long())
        h = self.emb(ids) + self.pos(positions)
        h = h.clone()
        h[:, 0] = h[:, 0] * 2.0                      # an in-place write into a slice
        scores = torch.einsum("bd,btd->bt", self.q(h[:, 0]), h)
        scores = scores.masked_fill(~mask, -1e4)
        chosen = torch.gather(h, 1, picks[:, :, None].expand(-1, -1, D))
        summary = torch.index_select(h, 1, torch.tensor([1, 3, 5])).mean(1)
        return scores, chosen.sum(1) + summary


def _pointer():
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, -4:] = False
    return PointerNet(), (_ids(), mask, torch.randint(0, T, (B, 3))), torch.randint(0, T - 4, (B,))


def _pointer_loss(out, targets):
    scores, summary = out
    return F.cross_entropy(scores, targets) + summary.pow(2).mean()


# -- 20. weight-norm parametrization and a module shared under two names ---------------------------
class Parametrized(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.utils.parametrizations.weight_norm(nn.Linear(D, D))
        shared = nn.Linear(D, D)
        self.enc_proj = shared
        self.dec_proj = shared                       # one module, two names
        self.out = nn.Linear(D, 2)

    def forward(self, x):
        h = F.relu(self.enc_proj(self.fc(x)))
        return self.out(self.dec_proj(h)).mean(1)


def _parametrized():
    return Parametrized(), (torch.randn(B, T, D),), torch.randint(0, 2, (B,))


# -- 21. a mask stored as a plain tensor attribute, pad / unfold patches, pixel shuffle ----------
class PatchNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.causal = torch.tril(torch.ones(16, 16))  # not a buffer: a plain attribute
        self.embed = nn.Linear(3 * 4 * 4, D)
        self.mix = nn.Linear(D, D)
        self.up = nn.Conv2d(D, 3 * 4, 3, padding=1)
        self.shuffle = nn.PixelShuffle(2)

    def forward(self, img):
        x = F.pad(img, (1, 1, 1, 1))[:, :, 1:-1, 1:-1]
        patches = x.unfold(2, 4, 4).unfold(3, 4, 4)             # B, C, 4, 4, 4, 4
        patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(img.shape[0], 16, -1)
        h = self.embed(patches)
        h = h + (self.causal / self.causal.sum(-1, keepdim=True)) @ self.mix(h)
        grid = h.transpose(1, 2).reshape(img.shape[0], D, 4, 4)
        return self.shuffle(self.up(grid))                      # B, 3, 8, 8


def _patch():
    return PatchNet(), (torch.randn(B, 3, 16, 16),), torch.randn(B, 3, 8, 8)


# -- 22. a hand-written top-1 mixture of experts (dense dispatch via one_hot) --------------------
class DenseMoE(nn.Module):
    def __init__(self, experts: int = 4):
        super().__init__()
        self.gate = nn.Linear(D, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, D, 2 * D) * 0.1)
        self.w2 = nn.Parameter(torch.randn(experts, 2 * D, D) * 0.1)

    def forward(self, x):
        probs = self.gate(x).softmax(-1)
        top, idx = probs.max(-1)
        dispatch = F.one_hot(idx, probs.shape[-1]).to(x.dtype) * top[..., None]   # B, T, E
        h = torch.einsum("btd,edf->btef", x, self.w1).relu()
        y = torch.einsum("btef,efd->bted", h, self.w2)
        aux = (probs.mean((0, 1)) * dispatch.gt(0).float().mean((0, 1))).sum() * probs.shape[-1]
        return x + torch.einsum("bted,bte->btd", y, dispatch), aux


def _moe():
    return DenseMoE(), (torch.randn(B, T, D),), torch.randn(B, T, D)


def _moe_loss(out, targets):
    y, aux = out
    return F.mse_loss(y, targets) + 0.01 * aux


# -- 23. GQA attention with repeat_interleave, arange positions, a bool mask via torch.where ---
class GQA(nn.Module):
    def __init__(self, heads: int = 4, kv: int = 2):
        super().__init__()
        self.h, self.kv, self.hd = heads, kv, D // heads
        self.emb = nn.Embedding(V, D)
        self.pos = nn.Embedding(T, D)
        self.q = nn.Linear(D, D, bias=False)
        self.kvp = nn.Linear(D, 2 * kv * self.hd, bias=False)
        self.o = nn.Linear(D, D, bias=False)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, ids):
        b, t = ids.shape
        h = self.emb(ids) + self.pos(torch.arange(t, device=ids.device))
        q = self.q(h).view(b, t, self.h, self.hd).transpose(1, 2)
        k, v = self.kvp(h).view(b, t, 2 * self.kv, self.hd).transpose(1, 2).chunk(2, dim=1)
        k = k.repeat_interleave(self.h // self.kv, dim=1)
        v = v.repeat_interleave(self.h // self.kv, dim=1)
        allowed = torch.arange(t)[:, None] >= torch.arange(t)[None, :]
        bias = torch.where(allowed, 0.0, float("-inf"))
        att = (q @ k.transpose(-1, -2) / math.sqrt(self.hd) + bias).softmax(-1)
        h = h + self.o((att @ v).transpose(1, 2).reshape(b, t, D))
        return self.head(h)


def _gqa():
    ids = _ids()
    return GQA(), (ids,), ids.roll(-1, dims=1)


MORE_CASES: tuple[Case, ...] = (
    Case("clip_two_tower", _two_tower, _inside),
    Case("torch_transformer_encoder", _torch_encoder, _tag_loss),
    Case("frozen_teacher_no_grad", _distill, _inside),
    Case("pointer_inplace_gather", _pointer, _pointer_loss),
    Case("weight_norm_shared_module", _parametrized, _ce),
    Case("plain_attr_mask_unfold_shuffle", _patch, _mse),
    Case("dense_moe_one_hot", _moe, _moe_loss),
    Case("gqa_repeat_interleave", _gqa, _tag_loss),
)
