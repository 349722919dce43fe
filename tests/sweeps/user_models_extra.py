"""A third batch of hand-written user models for the probe (``user_models`` lists them all):
spectrogram front-ends, a spatial transformer, Python loops over RNN cells, WaveNet-style gated
causal convolutions, a VQ-VAE straight-through estimator, autocast and forward hooks inside the
model, metric losses, top-k routing with ``index_add``, an eval-mode batch norm in a training
model, linear attention with ``cumsum``, an integer position buffer, a list input with a Python
float argument."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .user_cases import B, D, T, V, Case, ce as _ce, ids as _ids, inside as _inside, mse as _mse, tag_loss as _tag_loss


# -- 24. STFT magnitude front-end ----------------------------------------------------------------
class Spectro(nn.Module):
    def __init__(self, n_fft: int = 32):
        super().__init__()
        self.n_fft = n_fft
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)
        self.conv = nn.Conv1d(n_fft // 2 + 1, D, 3, padding=1)
        self.head = nn.Linear(D, 6)

    def forward(self, wav):
        spec = torch.stft(wav, self.n_fft, hop_length=8, window=self.window, return_complex=True).abs()
        return self.head(F.relu(self.conv(torch.log1p(spec))).mean(-1))


def _spectro():
    return Spectro(), (torch.randn(B, 256),), torch.randint(0, 6, (B,))


# -- 25. spatial transformer: affine_grid + grid_sample --------------------------------------------
class STN(nn.Module):
    def __init__(self):
        super().__init__()
        self.loc = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 6))
        nn.init.zeros_(self.loc[1].weight)
        with torch.no_grad():
            self.loc[1].bias.copy_(torch.tensor([1.0, 0, 0, 0, 1.0, 0]))
        self.cls = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                 nn.Linear(8, 10))

    def forward(self, img):
        theta = self.loc(img).view(-1, 2, 3)
        grid = F.affine_grid(theta, list(img.shape), align_corners=False)
        return self.cls(F.grid_sample(img, grid, align_corners=False))


def _stn():
    return STN(), (torch.randn(B, 3, 16, 16),), torch.randint(0, 10, (B,))


# -- 26. an LSTMCell stepped in a Python loop ----------------------------------------------------
class CellLoop(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.cell = nn.LSTMCell(D, D)
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        h = c = ids.new_zeros(ids.shape[0], D, dtype=torch.float32)
        x = self.emb(ids)
        outs = []
        for t in range(ids.shape[1]):
            h, c = self.cell(x[:, t], (h, c))
            outs.append(h)
        return self.head(torch.stack(outs, dim=1))


def _cell_loop():
    ids = _ids()
    return CellLoop(), (ids,), ids.roll(-1, dims=1)


# -- 27. WaveNet-style gated dilated causal convolutions ------------------------------------------
class WaveNet(nn.Module):
    def __init__(self, c: int = 16):
        super().__init__()
        self.inp = nn.Conv1d(1, c, 1)
        self.filters = nn.ModuleList(nn.Conv1d(c, 2 * c, 2, dilation=d) for d in (1, 2, 4))
        self.res = nn.ModuleList(nn.Conv1d(c, c, 1) for _ in range(3))
        self.out = nn.Conv1d(c, 1, 1)

    def forward(self, wav):
        x = self.inp(wav.unsqueeze(1))
        for conv, res, d in zip(self.filters, self.res, (1, 2, 4)):
            f, g = conv(F.pad(x, (d, 0))).chunk(2, dim=1)
            x = x + res(torch.tanh(f) * torch.sigmoid(g))
        return self.out(x).squeeze(1)


def _wavenet():
    wav = torch.randn(B, 128)
    return WaveNet(), (wav,), wav.roll(-1, dims=1)


# -- 28. VQ-VAE: nearest code by cdist / argmin, straight-through estimator -----------------------
class VQ(nn.Module):
    def __init__(self, codes: int = 16):
        super().__init__()
        self.enc = nn.Linear(D, D)
        self.codebook = nn.Embedding(codes, D)
        self.dec = nn.Linear(D, D)

    def forward(self, x):
        z = self.enc(x)
        idx = torch.cdist(z.flatten(0, 1), self.codebook.weight).argmin(-1).view(z.shape[:-1])
        q = self.codebook(idx)
        commit = F.mse_loss(z, q.detach()) + 0.25 * F.mse_loss(q, z.detach())
        q = z + (q - z).detach()
        return F.mse_loss(self.dec(q), x) + commit


def _vq():
    return VQ(), (torch.randn(B, T, D),), None


# -- 29. an autocast region and a forward hook inside the model ----------------------------------
class HookedAutocast(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, 2 * D)
        self.b = nn.Linear(2 * D, D)
        self.head = nn.Linear(D, 4)
        self.b.register_forward_hook(lambda mod, args, out: out * 0.5)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = F.gelu(self.a(x))
        h = self.b(h.float())
        return self.head(h.mean(1))


def _hooked():
    return HookedAutocast(), (torch.randn(B, T, D),), torch.randint(0, 4, (B,))


# -- 30. metric learning: triplet margin loss + cosine similarity --------------------------------
class Embedder(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D, 2 * D), nn.ReLU(), nn.Linear(2 * D, D))

    def forward(self, anchor, positive, negative):
        a, p, n = self.net(anchor), self.net(positive), self.net(negative)
        cos = F.cosine_similarity(a, p, dim=-1).mean()
        return F.triplet_margin_loss(a, p, n, margin=0.5) - 0.1 * cos + 0.01 * torch.cdist(a, n).mean()


def _embedder():
    return Embedder(), (torch.randn(B, D), torch.randn(B, D), torch.randn(B, D)), None


# -- 31. top-k routing with index_add_ (sparse dispatch) ------------------------------------------
class TopKMoE(nn.Module):
    def __init__(self, experts: int = 4):
        super().__init__()
        self.gate = nn.Linear(D, experts)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(experts))

    def forward(self, x):
        flat = x.flatten(0, 1)
        probs = self.gate(flat).softmax(-1)
        weights, idx = probs.topk(2, dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            w = (weights * (idx == e)).sum(-1, keepdim=True)   # dense: 0 where not routed
            out = out + w * expert(flat)
        counts = torch.zeros(len(self.experts)).index_add_(0, idx.flatten(), torch.ones(idx.numel()))
        return out.view_as(x), (counts / idx.numel() * probs.mean(0)).sum() * len(self.experts)


def _topk():
    return TopKMoE(), (torch.randn(B, T, D),), torch.randn(B, T, D)


def _topk_loss(out, targets):
    y, aux = out
    return F.mse_loss(y, targets) + 0.01 * aux


# -- 32. an eval-mode (frozen statistics) batch norm in a training model ---------------------------
class FrozenBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.bn.running_mean.uniform_(-0.5, 0.5)
        self.bn.running_var.uniform_(0.5, 1.5)
        self.head = nn.Linear(8, 10)

    def forward(self, img):
        return self.head(F.relu(self.bn(self.conv(img))).mean((2, 3)))


def _frozen_bn():
    model = FrozenBN()
    model.train()
    model.bn.eval()
    return model, (torch.randn(B, 3, 8, 8),), torch.randint(0, 10, (B,))


# -- 33. causal linear attention with cumsum, an integer position buffer ------------------------
class LinearAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.register_buffer("position_ids", torch.arange(64).unsqueeze(0))   # persistent, int64
        self.pos = nn.Embedding(64, D)
        self.qkv = nn.Linear(D, 3 * D)
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        h = self.emb(ids) + self.pos(self.position_ids[:, : ids.shape[1]])
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        q, k = F.elu(q) + 1, F.elu(k) + 1
        kv = torch.cumsum(k.unsqueeze(-1) * v.unsqueeze(-2), dim=1)          # B, T, D, D
        norm = torch.cumsum(k, dim=1)
        out = torch.einsum("btd,btde->bte", q, kv) / (q * norm).sum(-1, keepdim=True)
        return self.head(h + out)


def _linear_attention():
    ids = _ids()
    return LinearAttention(), (ids,), ids.roll(-1, dims=1)


# -- 34. inputs that are not one tensor each: a list of crops, lengths, a Python float -----------
class MultiCrop(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.head = nn.Linear(D, 5)

    def forward(self, crops, lengths, temperature: float):
        mask = (torch.arange(crops[0].shape[1])[None] < lengths[:, None]).to(crops[0].dtype)
        pooled = [(torch.tanh(self.proj(c)) * mask[..., None]).sum(1) / mask.sum(1, keepdim=True) for c in crops]
        return self.head(torch.stack(pooled).mean(0)) / temperature


def _multi_crop():
    crops = [torch.randn(B, T, D), torch.randn(B, T, D)]
    return MultiCrop(), (crops, torch.randint(4, T + 1, (B,)), 0.7), torch.randint(0, 5, (B,))


EXTRA_CASES: tuple[Case, ...] = (
    Case("stft_spectrogram", _spectro, _ce),
    Case("stn_grid_sample", _stn, _ce),
    Case("lstm_cell_python_loop", _cell_loop, _tag_loss),
    Case("wavenet_gated_causal_conv", _wavenet, _mse),
    Case("vqvae_straight_through", _vq, _inside),
    Case("autocast_region_forward_hook", _hooked, _ce),
    Case("triplet_cosine_cdist", _embedder, _inside),
    Case("topk_routing_index_add", _topk, _topk_loss),
    Case("eval_batchnorm_in_training", _frozen_bn, _ce),
    Case("linear_attention_cumsum", _linear_attention, _tag_loss),
    Case("list_input_lengths_float_arg", _multi_crop, _ce),
)
