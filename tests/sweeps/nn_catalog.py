"""The torch.nn module catalog: a constructor + input recipe for every buildable ``torch.nn`` class.

Every public class of ``torch.nn.modules`` is either in ``SAMPLES`` (one or more recipes) or in
``EXCLUDED`` with the reason. Each sample is wrapped in :class:`Sweep`, whose forward ends in a
scalar loss: the module's output (its first element for tuple outputs, recursively) as
``out.double().pow(2).mean()``.

Precision: float64 (parameters and float inputs are built under float64 default dtype), as in the
rule checks, so that rtol 1e-4 / atol 1e-6 sees sharding errors, never float32 summation-order
noise.

Inputs: every float input that is not a ``Target`` is multiplied by a learnable gain (shape
``input.shape[1:]``, broadcast over the batch, initialised near 1), so the backward through the
module's inputs is checked as a parameter gradient even for modules without parameters.
``Target`` marks inputs that take no gradient (loss targets, lengths, offsets); integer inputs
never take one.

Randomness: autopar's draws are mesh-invariant (``strategies/rng.py``) but are not the eager
model's, which draws from torch's generator, so every dropout module has two samples in training
mode: ``p=0``, compared exactly (``nn.Dropout`` keeps its op in the graph; the feature and alpha
dropouts decompose to the identity at trace time), and ``p=0.5`` (variant ``random``), whose
random ops must trace and plan without fallback like any other and whose step must run on the
ranks with a finite loss and every gradient present, but whose values are not compared with the
eager model (``Entry.exact=False``; equality across meshes is ``tests/runtime/test_randomness.py``'s).
``RReLU`` likewise: ``lower == upper`` (exact) and a random slope range. ``FractionalMaxPool``
takes fixed ``_random_samples``.

Sizes: batch 4 and feature sizes of 4, 8 or 16, so that every dimension a rule may shard
divides by the mesh axis (2).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .harness import Entry


class Target:
    """An input that takes no learnable gain (a loss target, lengths, offsets)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class Compose(nn.Module):
    """``fn(module, *inputs)``: a module that needs prepared inputs (probabilities for BCELoss,
    pooling indices for MaxUnpool, log-probabilities for CTCLoss)."""

    def __init__(self, module: nn.Module, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.m = module
        self.fn = fn

    def forward(self, *inputs):
        return self.fn(self.m, *inputs)


def first_tensor(out: Any) -> torch.Tensor:
    while isinstance(out, (tuple, list)):
        out = out[0]
    return out


class Sweep(nn.Module):
    """The module under test, learnable input gains, and a scalar loss on its output."""

    def __init__(self, module: nn.Module, inputs: list) -> None:
        super().__init__()
        self.m = module
        self.num_inputs = len(inputs)
        self.learn = []
        for i, v in enumerate(inputs):
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                setattr(self, f"gain{i}", nn.Parameter(1 + 0.1 * torch.randn(v.shape[1:])))
                self.learn.append(i)

    def forward(self, a, b=None, c=None, d=None):
        args = [a, b, c, d][: self.num_inputs]
        for i in self.learn:
            args[i] = args[i] * getattr(self, f"gain{i}")
        return first_tensor(self.m(*args)).double().pow(2).mean()


# ------------------------------------------------------------------------------ input helpers
def x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


def pos(*shape: int) -> torch.Tensor:
    return torch.rand(*shape) + 0.5


def idx(high: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, high, shape)


def sign(*shape: int) -> Target:
    return Target(torch.randint(0, 2, shape).float() * 2 - 1)


def probs(*shape: int) -> Target:
    return Target(torch.randn(*shape).softmax(-1))


def tgt(t: torch.Tensor) -> Target:
    return Target(t)


def _multilabel_targets() -> Target:
    t = torch.full((4, 8), -1, dtype=torch.long)
    t[:, 0] = torch.randint(0, 8, (4,))
    t[:2, 1] = torch.randint(0, 8, (2,))
    return Target(t)


def _ctc(m, log_probs, targets, input_lengths, target_lengths):
    return m(log_probs.log_softmax(2), targets, input_lengths, target_lengths)


def _ctc_int_lengths(m, log_probs, targets):
    # lengths as Python ints: the loss's shapes no longer depend on tensor values
    return m(log_probs.log_softmax(2), targets, [12, 12, 12, 12], [4, 3, 4, 2])


def _pool_unpool(pool) -> Callable:
    return lambda m, v: m(*pool(v, 2, return_indices=True))


def _masked_attention(m, v, key_padding_mask):
    causal = torch.triu(torch.ones(v.shape[1], v.shape[1], dtype=torch.bool), 1)
    return m(v, v, v, attn_mask=causal, key_padding_mask=key_padding_mask, need_weights=False)


def _enc_layer() -> nn.TransformerEncoderLayer:
    return nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)


def _dec_layer() -> nn.TransformerDecoderLayer:
    return nn.TransformerDecoderLayer(16, 4, 32, dropout=0.0, batch_first=True)


Recipe = Callable[[], tuple[nn.Module, list]]

# (class name, variant, recipe). The variant is '' for the first (plain) sample of a class.
SAMPLES: list[tuple[str, str, Recipe]] = [
    # ---- activations
    *[(name, "", lambda name=name: (getattr(nn, name)(), [x(4, 8)])) for name in (
        "CELU", "ELU", "GELU", "Hardshrink", "Hardsigmoid", "Hardswish", "Hardtanh", "LeakyReLU",
        "LogSigmoid", "Mish", "PReLU", "ReLU", "ReLU6", "SELU", "SiLU", "Sigmoid", "Softplus",
        "Softshrink", "Softsign", "Tanh", "Tanhshrink", "Identity")],
    ("GELU", "tanh", lambda: (nn.GELU(approximate="tanh"), [x(4, 8)])),
    ("PReLU", "channels", lambda: (nn.PReLU(8), [x(4, 8, 6)])),
    ("GLU", "", lambda: (nn.GLU(), [x(4, 8)])),
    ("Softmax", "", lambda: (nn.Softmax(dim=-1), [x(4, 8)])),
    ("Softmin", "", lambda: (nn.Softmin(dim=-1), [x(4, 8)])),
    ("LogSoftmax", "", lambda: (nn.LogSoftmax(dim=-1), [x(4, 8)])),
    ("Softmax2d", "", lambda: (nn.Softmax2d(), [x(4, 4, 6, 6)])),
    ("Threshold", "", lambda: (nn.Threshold(0.1, 20.0), [x(4, 8)])),
    ("RReLU", "", lambda: (nn.RReLU(0.1, 0.1), [x(4, 8)])),
    # ---- shape
    ("Flatten", "", lambda: (nn.Flatten(), [x(4, 2, 4)])),
    ("Unflatten", "", lambda: (nn.Unflatten(1, (2, 4)), [x(4, 8)])),
    ("Sequential", "", lambda: (nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)), [x(4, 8)])),
    ("PixelShuffle", "", lambda: (nn.PixelShuffle(2), [x(4, 8, 4, 4)])),
    ("PixelUnshuffle", "", lambda: (nn.PixelUnshuffle(2), [x(4, 2, 8, 8)])),
    ("ChannelShuffle", "", lambda: (nn.ChannelShuffle(2), [x(4, 4, 4, 4)])),
    ("Fold", "", lambda: (nn.Fold((8, 8), 2, stride=2), [x(4, 16, 16)])),
    ("Unfold", "", lambda: (nn.Unfold(2, stride=2), [x(4, 4, 8, 8)])),
    ("Unfold", "overlapping", lambda: (nn.Unfold(3, padding=1), [x(4, 4, 4, 4)])),
    # ---- linear, embedding, distance
    ("Linear", "", lambda: (nn.Linear(8, 16), [x(4, 8)])),
    ("Linear", "3d", lambda: (nn.Linear(8, 16), [x(4, 6, 8)])),
    ("Bilinear", "", lambda: (nn.Bilinear(8, 6, 16), [x(4, 8), x(4, 6)])),
    ("Embedding", "", lambda: (nn.Embedding(16, 8), [idx(16, 4, 6)])),
    ("Embedding", "padding_idx", lambda: (nn.Embedding(16, 8, padding_idx=0), [idx(16, 4, 6)])),
    ("Embedding", "max_norm", lambda: (nn.Embedding(16, 8, max_norm=1.0), [idx(16, 4, 6)])),
    ("EmbeddingBag", "", lambda: (nn.EmbeddingBag(16, 8), [idx(16, 4, 6)])),
    ("EmbeddingBag", "max", lambda: (nn.EmbeddingBag(16, 8, mode="max"), [idx(16, 4, 6)])),
    ("EmbeddingBag", "sum_offsets_weights", lambda: (
        nn.EmbeddingBag(16, 8, mode="sum"), [idx(16, 12), tgt(torch.tensor([0, 3, 6, 9])), pos(12)])),
    ("CosineSimilarity", "", lambda: (nn.CosineSimilarity(dim=1), [x(4, 8), x(4, 8)])),
    ("PairwiseDistance", "", lambda: (nn.PairwiseDistance(), [x(4, 8), x(4, 8)])),
    # ---- convolutions
    ("Conv1d", "", lambda: (nn.Conv1d(4, 8, 3, padding=1), [x(4, 4, 8)])),
    ("Conv1d", "same_dilated", lambda: (nn.Conv1d(4, 8, 3, padding="same", dilation=2), [x(4, 4, 8)])),
    ("Conv2d", "", lambda: (nn.Conv2d(4, 8, 3, padding=1), [x(4, 4, 8, 8)])),
    ("Conv2d", "strided_grouped", lambda: (nn.Conv2d(4, 8, 3, stride=2, padding=1, groups=2), [x(4, 4, 8, 8)])),
    ("Conv2d", "dilated_nobias", lambda: (nn.Conv2d(4, 8, 3, dilation=2, bias=False), [x(4, 4, 8, 8)])),
    ("Conv2d", "reflect", lambda: (nn.Conv2d(4, 8, 3, padding=1, padding_mode="reflect"), [x(4, 4, 8, 8)])),
    ("Conv2d", "circular", lambda: (nn.Conv2d(4, 8, 3, padding=1, padding_mode="circular"), [x(4, 4, 8, 8)])),
    ("Conv3d", "", lambda: (nn.Conv3d(4, 8, 3, padding=1), [x(4, 4, 4, 4, 4)])),
    ("ConvTranspose1d", "", lambda: (nn.ConvTranspose1d(4, 8, 3, stride=2), [x(4, 4, 8)])),
    ("ConvTranspose2d", "", lambda: (nn.ConvTranspose2d(4, 8, 3, stride=2, padding=1, output_padding=1),
                                     [x(4, 4, 4, 4)])),
    ("ConvTranspose2d", "grouped", lambda: (nn.ConvTranspose2d(4, 8, 2, stride=2, groups=2), [x(4, 4, 4, 4)])),
    ("ConvTranspose3d", "", lambda: (nn.ConvTranspose3d(4, 8, 2, stride=2), [x(4, 4, 2, 2, 2)])),
    # ---- pooling
    ("AvgPool1d", "", lambda: (nn.AvgPool1d(2), [x(4, 4, 8)])),
    ("AvgPool2d", "", lambda: (nn.AvgPool2d(2), [x(4, 4, 8, 8)])),
    ("AvgPool2d", "padded_ceil", lambda: (nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=False),
                                          [x(4, 4, 8, 8)])),
    ("AvgPool3d", "", lambda: (nn.AvgPool3d(2), [x(4, 4, 4, 4, 4)])),
    ("MaxPool1d", "", lambda: (nn.MaxPool1d(2), [x(4, 4, 8)])),
    ("MaxPool2d", "", lambda: (nn.MaxPool2d(2), [x(4, 4, 8, 8)])),
    ("MaxPool2d", "overlapping_indices", lambda: (nn.MaxPool2d(3, 2, 1, return_indices=True), [x(4, 4, 8, 8)])),
    ("MaxPool3d", "", lambda: (nn.MaxPool3d(2), [x(4, 4, 4, 4, 4)])),
    ("AdaptiveAvgPool1d", "", lambda: (nn.AdaptiveAvgPool1d(3), [x(4, 4, 8)])),
    ("AdaptiveAvgPool2d", "", lambda: (nn.AdaptiveAvgPool2d((3, 5)), [x(4, 4, 8, 8)])),
    ("AdaptiveAvgPool2d", "global", lambda: (nn.AdaptiveAvgPool2d(1), [x(4, 4, 8, 8)])),
    ("AdaptiveAvgPool3d", "", lambda: (nn.AdaptiveAvgPool3d(3), [x(4, 4, 4, 4, 4)])),
    ("AdaptiveMaxPool1d", "", lambda: (nn.AdaptiveMaxPool1d(3), [x(4, 4, 8)])),
    ("AdaptiveMaxPool2d", "", lambda: (nn.AdaptiveMaxPool2d((3, 5)), [x(4, 4, 8, 8)])),
    ("AdaptiveMaxPool3d", "", lambda: (nn.AdaptiveMaxPool3d(3), [x(4, 4, 4, 4, 4)])),
    ("LPPool1d", "", lambda: (nn.LPPool1d(2, 2), [x(4, 4, 8)])),
    ("LPPool2d", "", lambda: (nn.LPPool2d(2, 2), [x(4, 4, 8, 8)])),
    ("LPPool3d", "", lambda: (nn.LPPool3d(2, 2), [x(4, 4, 4, 4, 4)])),
    ("FractionalMaxPool2d", "", lambda: (nn.FractionalMaxPool2d(2, output_size=4, _random_samples=torch.rand(4, 4, 2)),
                                         [x(4, 4, 8, 8)])),
    ("FractionalMaxPool3d", "", lambda: (nn.FractionalMaxPool3d(2, output_size=2, _random_samples=torch.rand(4, 4, 3)),
                                         [x(4, 4, 4, 4, 4)])),
    ("MaxUnpool1d", "", lambda: (Compose(nn.MaxUnpool1d(2), _pool_unpool(F.max_pool1d)), [x(4, 4, 8)])),
    ("MaxUnpool2d", "", lambda: (Compose(nn.MaxUnpool2d(2), _pool_unpool(F.max_pool2d)), [x(4, 4, 8, 8)])),
    ("MaxUnpool3d", "", lambda: (Compose(nn.MaxUnpool3d(2), _pool_unpool(F.max_pool3d)), [x(4, 4, 4, 4, 4)])),
    # ---- normalisation
    ("BatchNorm1d", "", lambda: (nn.BatchNorm1d(8), [x(4, 8)])),
    ("BatchNorm1d", "3d", lambda: (nn.BatchNorm1d(8), [x(4, 8, 6)])),
    ("BatchNorm2d", "", lambda: (nn.BatchNorm2d(4), [x(4, 4, 6, 6)])),
    ("BatchNorm3d", "", lambda: (nn.BatchNorm3d(4), [x(4, 4, 2, 4, 4)])),
    ("GroupNorm", "", lambda: (nn.GroupNorm(2, 8), [x(4, 8, 6)])),
    ("InstanceNorm1d", "", lambda: (nn.InstanceNorm1d(8), [x(4, 8, 6)])),
    ("InstanceNorm1d", "affine", lambda: (nn.InstanceNorm1d(8, affine=True), [x(4, 8, 6)])),
    ("InstanceNorm2d", "", lambda: (nn.InstanceNorm2d(4, affine=True), [x(4, 4, 6, 6)])),
    ("InstanceNorm3d", "", lambda: (nn.InstanceNorm3d(4), [x(4, 4, 2, 4, 4)])),
    ("LayerNorm", "", lambda: (nn.LayerNorm(8), [x(4, 6, 8)])),
    ("LayerNorm", "2d_shape", lambda: (nn.LayerNorm([6, 8]), [x(4, 6, 8)])),
    ("RMSNorm", "", lambda: (nn.RMSNorm(8), [x(4, 6, 8)])),
    ("LocalResponseNorm", "", lambda: (nn.LocalResponseNorm(3), [x(4, 8, 6, 6)])),
    ("CrossMapLRN2d", "", lambda: (nn.CrossMapLRN2d(3), [x(4, 8, 6, 6)])),
    # ---- dropout (p=0: see the module docstring)
    ("Dropout", "", lambda: (nn.Dropout(0.0), [x(4, 8)])),
    ("Dropout1d", "", lambda: (nn.Dropout1d(0.0), [x(4, 4, 8)])),
    ("Dropout2d", "", lambda: (nn.Dropout2d(0.0), [x(4, 4, 6, 6)])),
    ("Dropout3d", "", lambda: (nn.Dropout3d(0.0), [x(4, 4, 2, 4, 4)])),
    ("AlphaDropout", "", lambda: (nn.AlphaDropout(0.0), [x(4, 8)])),
    ("FeatureAlphaDropout", "", lambda: (nn.FeatureAlphaDropout(0.0), [x(4, 4, 6, 6)])),
    # random: traced, planned and run, values not compared (RANDOM)
    ("Dropout", "random", lambda: (nn.Dropout(0.5), [x(4, 8)])),
    ("Dropout1d", "random", lambda: (nn.Dropout1d(0.5), [x(4, 4, 8)])),
    ("Dropout2d", "random", lambda: (nn.Dropout2d(0.5), [x(4, 4, 6, 6)])),
    ("Dropout3d", "random", lambda: (nn.Dropout3d(0.5), [x(4, 4, 2, 4, 4)])),
    ("AlphaDropout", "random", lambda: (nn.AlphaDropout(0.5), [x(4, 8)])),
    ("FeatureAlphaDropout", "random", lambda: (nn.FeatureAlphaDropout(0.5), [x(4, 4, 6, 6)])),
    ("RReLU", "random", lambda: (nn.RReLU(0.1, 0.3), [x(4, 8)])),
    # ---- padding
    ("ConstantPad1d", "", lambda: (nn.ConstantPad1d((1, 2), 0.5), [x(4, 4, 8)])),
    ("ConstantPad2d", "", lambda: (nn.ConstantPad2d((1, 2, 0, 1), 0.5), [x(4, 4, 6, 6)])),
    ("ConstantPad3d", "", lambda: (nn.ConstantPad3d(1, 0.5), [x(4, 4, 2, 4, 4)])),
    ("ZeroPad1d", "", lambda: (nn.ZeroPad1d((1, 2)), [x(4, 4, 8)])),
    ("ZeroPad2d", "", lambda: (nn.ZeroPad2d((1, 2, 0, 1)), [x(4, 4, 6, 6)])),
    ("ZeroPad3d", "", lambda: (nn.ZeroPad3d(1), [x(4, 4, 2, 4, 4)])),
    ("ReflectionPad1d", "", lambda: (nn.ReflectionPad1d((1, 2)), [x(4, 4, 8)])),
    ("ReflectionPad2d", "", lambda: (nn.ReflectionPad2d((1, 2, 2, 1)), [x(4, 4, 6, 6)])),
    ("ReflectionPad3d", "", lambda: (nn.ReflectionPad3d(1), [x(4, 4, 4, 4, 4)])),
    ("ReplicationPad1d", "", lambda: (nn.ReplicationPad1d((1, 2)), [x(4, 4, 8)])),
    ("ReplicationPad2d", "", lambda: (nn.ReplicationPad2d((1, 2, 2, 1)), [x(4, 4, 6, 6)])),
    ("ReplicationPad3d", "", lambda: (nn.ReplicationPad3d(1), [x(4, 4, 4, 4, 4)])),
    ("CircularPad1d", "", lambda: (nn.CircularPad1d((1, 2)), [x(4, 4, 8)])),
    ("CircularPad2d", "", lambda: (nn.CircularPad2d((1, 2, 2, 1)), [x(4, 4, 6, 6)])),
    ("CircularPad3d", "", lambda: (nn.CircularPad3d(1), [x(4, 4, 4, 4, 4)])),
    # ---- upsampling
    ("Upsample", "", lambda: (nn.Upsample(scale_factor=2), [x(4, 4, 4, 4)])),
    ("Upsample", "linear", lambda: (nn.Upsample(scale_factor=2, mode="linear"), [x(4, 4, 8)])),
    ("Upsample", "bilinear", lambda: (nn.Upsample(scale_factor=2, mode="bilinear"), [x(4, 4, 4, 4)])),
    ("Upsample", "bicubic_align", lambda: (nn.Upsample(size=6, mode="bicubic", align_corners=True),
                                           [x(4, 4, 4, 4)])),
    ("Upsample", "trilinear", lambda: (nn.Upsample(scale_factor=2, mode="trilinear"), [x(4, 4, 2, 4, 4)])),
    ("Upsample", "nearest_exact_size", lambda: (nn.Upsample(size=(6, 10), mode="nearest-exact"),
                                                [x(4, 4, 4, 4)])),
    ("UpsamplingNearest2d", "", lambda: (nn.UpsamplingNearest2d(scale_factor=2), [x(4, 4, 4, 4)])),
    ("UpsamplingBilinear2d", "", lambda: (nn.UpsamplingBilinear2d(scale_factor=2), [x(4, 4, 4, 4)])),
    # ---- recurrent
    ("RNN", "", lambda: (nn.RNN(8, 8, batch_first=True), [x(4, 6, 8)])),
    ("RNN", "relu_2layer_bidirectional", lambda: (
        nn.RNN(8, 8, 2, nonlinearity="relu", batch_first=True, bidirectional=True), [x(4, 6, 8)])),
    ("LSTM", "", lambda: (nn.LSTM(8, 8, batch_first=True), [x(4, 6, 8)])),
    ("LSTM", "initial_state", lambda: (Compose(nn.LSTM(8, 8, batch_first=True), lambda m, v, h, c: m(v, (h, c))),
                                       [x(4, 6, 8), x(1, 4, 8), x(1, 4, 8)])),
    ("LSTM", "2layer_bidirectional_proj", lambda: (
        nn.LSTM(8, 8, 2, batch_first=True, bidirectional=True, proj_size=4), [x(4, 6, 8)])),
    ("GRU", "", lambda: (nn.GRU(8, 8, batch_first=True), [x(4, 6, 8)])),
    ("GRU", "seq_first_2layer", lambda: (nn.GRU(8, 8, 2), [x(6, 4, 8)])),
    ("RNNCell", "", lambda: (nn.RNNCell(8, 8), [x(4, 8)])),
    ("LSTMCell", "", lambda: (nn.LSTMCell(8, 8), [x(4, 8)])),
    ("GRUCell", "", lambda: (nn.GRUCell(8, 8), [x(4, 8)])),
    # ---- attention and transformer layers
    ("MultiheadAttention", "", lambda: (nn.MultiheadAttention(16, 4, batch_first=True),
                                        [x(4, 6, 16), x(4, 6, 16), x(4, 6, 16)])),
    ("MultiheadAttention", "kdim_vdim", lambda: (nn.MultiheadAttention(16, 4, kdim=8, vdim=12),
                                                 [x(6, 4, 16), x(5, 4, 8), x(5, 4, 12)])),
    ("MultiheadAttention", "causal_padding_masks", lambda: (
        Compose(nn.MultiheadAttention(16, 4, batch_first=True), _masked_attention),
        [x(4, 6, 16), tgt(torch.tensor([[False] * 6, [False] * 6, [False] * 4 + [True] * 2, [False] * 5 + [True]]))])),
    ("TransformerEncoderLayer", "", lambda: (_enc_layer(), [x(4, 6, 16)])),
    ("TransformerEncoderLayer", "norm_first_gelu", lambda: (
        nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, activation="gelu", batch_first=True, norm_first=True),
        [x(4, 6, 16)])),
    ("TransformerDecoderLayer", "", lambda: (_dec_layer(), [x(4, 6, 16), x(4, 5, 16)])),
    ("TransformerEncoder", "", lambda: (nn.TransformerEncoder(_enc_layer(), 2, enable_nested_tensor=False),
                                        [x(4, 6, 16)])),
    ("TransformerDecoder", "", lambda: (nn.TransformerDecoder(_dec_layer(), 2), [x(4, 6, 16), x(4, 5, 16)])),
    ("Transformer", "", lambda: (nn.Transformer(16, 4, 1, 1, 32, dropout=0.0, batch_first=True),
                                 [x(4, 6, 16), x(4, 5, 16)])),
    # ---- losses (valid targets)
    ("L1Loss", "", lambda: (nn.L1Loss(), [x(4, 8), tgt(x(4, 8))])),
    ("MSELoss", "", lambda: (nn.MSELoss(), [x(4, 8), tgt(x(4, 8))])),
    ("MSELoss", "sum", lambda: (nn.MSELoss(reduction="sum"), [x(4, 8), tgt(x(4, 8))])),
    ("HuberLoss", "", lambda: (nn.HuberLoss(delta=0.5), [x(4, 8), tgt(x(4, 8))])),
    ("SmoothL1Loss", "", lambda: (nn.SmoothL1Loss(beta=0.5), [x(4, 8), tgt(x(4, 8))])),
    ("CrossEntropyLoss", "", lambda: (nn.CrossEntropyLoss(), [x(4, 8), idx(8, 4)])),
    ("CrossEntropyLoss", "probabilities", lambda: (nn.CrossEntropyLoss(), [x(4, 8), probs(4, 8)])),
    ("CrossEntropyLoss", "weight_smoothing", lambda: (
        nn.CrossEntropyLoss(weight=pos(8), label_smoothing=0.1), [x(4, 8), idx(8, 4)])),
    ("CrossEntropyLoss", "spatial_ignore_index", lambda: (
        nn.CrossEntropyLoss(ignore_index=0), [x(4, 8, 3, 3), idx(8, 4, 3, 3)])),
    ("CrossEntropyLoss", "none", lambda: (nn.CrossEntropyLoss(reduction="none"), [x(4, 8), idx(8, 4)])),
    ("NLLLoss", "", lambda: (nn.NLLLoss(), [x(4, 8), idx(8, 4)])),
    ("NLLLoss", "weight", lambda: (nn.NLLLoss(weight=pos(8)), [x(4, 8), idx(8, 4)])),
    ("NLLLoss2d", "", lambda: (nn.NLLLoss2d(), [x(4, 8, 3, 3), idx(8, 4, 3, 3)])),
    ("BCELoss", "", lambda: (Compose(nn.BCELoss(), lambda m, v, t: m(torch.sigmoid(v), t)),
                             [x(4, 8), tgt(torch.rand(4, 8))])),
    ("BCEWithLogitsLoss", "", lambda: (nn.BCEWithLogitsLoss(), [x(4, 8), tgt(torch.rand(4, 8))])),
    ("BCEWithLogitsLoss", "pos_weight", lambda: (nn.BCEWithLogitsLoss(pos_weight=pos(8)),
                                                 [x(4, 8), tgt(torch.rand(4, 8))])),
    ("KLDivLoss", "", lambda: (nn.KLDivLoss(reduction="batchmean"), [x(4, 8), probs(4, 8)])),
    ("KLDivLoss", "log_target", lambda: (nn.KLDivLoss(reduction="batchmean", log_target=True),
                                         [x(4, 8), tgt(torch.randn(4, 8).log_softmax(-1))])),
    ("PoissonNLLLoss", "", lambda: (nn.PoissonNLLLoss(), [x(4, 8), tgt(pos(4, 8))])),
    ("GaussianNLLLoss", "", lambda: (nn.GaussianNLLLoss(), [x(4, 8), tgt(x(4, 8)), pos(4, 8)])),
    ("CosineEmbeddingLoss", "", lambda: (nn.CosineEmbeddingLoss(margin=0.2), [x(4, 8), x(4, 8), sign(4)])),
    ("HingeEmbeddingLoss", "", lambda: (nn.HingeEmbeddingLoss(), [x(4, 8), sign(4, 8)])),
    ("MarginRankingLoss", "", lambda: (nn.MarginRankingLoss(margin=0.1), [x(4), x(4), sign(4)])),
    ("SoftMarginLoss", "", lambda: (nn.SoftMarginLoss(), [x(4, 8), sign(4, 8)])),
    ("MultiLabelSoftMarginLoss", "", lambda: (nn.MultiLabelSoftMarginLoss(),
                                              [x(4, 8), tgt(torch.randint(0, 2, (4, 8)).float())])),
    ("MultiLabelMarginLoss", "", lambda: (nn.MultiLabelMarginLoss(), [x(4, 8), _multilabel_targets()])),
    ("MultiMarginLoss", "", lambda: (nn.MultiMarginLoss(), [x(4, 8), idx(8, 4)])),
    ("TripletMarginLoss", "", lambda: (nn.TripletMarginLoss(), [x(4, 8), x(4, 8), x(4, 8)])),
    ("TripletMarginWithDistanceLoss", "", lambda: (nn.TripletMarginWithDistanceLoss(),
                                                   [x(4, 8), x(4, 8), x(4, 8)])),
    ("CTCLoss", "", lambda: (Compose(nn.CTCLoss(), _ctc), [
        x(12, 4, 6), torch.randint(1, 6, (4, 4)), tgt(torch.full((4,), 12)), tgt(torch.tensor([4, 3, 4, 2]))])),
    ("CTCLoss", "int_lengths", lambda: (Compose(nn.CTCLoss(), _ctc_int_lengths),
                                        [x(12, 4, 6), torch.randint(1, 6, (4, 4))])),
    ("LinearCrossEntropyLoss", "", lambda: (nn.LinearCrossEntropyLoss(8, 16), [x(4, 8), idx(16, 4)])),
    ("AdaptiveLogSoftmaxWithLoss", "", lambda: (nn.AdaptiveLogSoftmaxWithLoss(8, 16, [4, 8]),
                                                [x(4, 8), idx(16, 4)])),
]

# Classes of torch.nn.modules that get no sample, with the reason.
EXCLUDED: dict[str, str] = {
    "Module": "abstract base class: no forward",
    "Container": "deprecated container base: no forward",
    "ModuleList": "container: no forward",
    "ModuleDict": "container: no forward",
    "ParameterList": "container: no forward",
    "ParameterDict": "container: no forward",
    "RNNBase": "base class of RNN/LSTM/GRU (sampled through them)",
    "RNNCellBase": "base class of RNNCell/LSTMCell/GRUCell (sampled through them)",
    "SyncBatchNorm": "needs a process group and a GPU in its own forward; autopar's plans sync "
                     "BatchNorm themselves (BatchNorm1d/2d/3d are sampled)",
    **{name: "lazy module: its parameters only exist after a first real forward; the materialised "
             "module is the sampled non-lazy class" for name in (
        "LazyBatchNorm1d", "LazyBatchNorm2d", "LazyBatchNorm3d", "LazyConv1d", "LazyConv2d",
        "LazyConv3d", "LazyConvTranspose1d", "LazyConvTranspose2d", "LazyConvTranspose3d",
        "LazyInstanceNorm1d", "LazyInstanceNorm2d", "LazyInstanceNorm3d", "LazyLinear")},
}


def module_classes() -> dict[str, type]:
    """Every public ``nn.Module`` class of ``torch.nn.modules``, by name."""
    out = {}
    for name in torch.nn.modules.__all__:
        obj = getattr(torch.nn.modules, name)
        if inspect.isclass(obj) and issubclass(obj, nn.Module):
            out[name] = obj
    return out


def sample_name(cls_name: str, variant: str) -> str:
    return f"{cls_name}[{variant}]" if variant else cls_name


def _builder(recipe: Recipe) -> Callable[[], tuple[nn.Module, tuple]]:
    def build():
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            module, inputs = recipe()
        finally:
            torch.set_default_dtype(previous)
        model = Sweep(module, [None if isinstance(v, Target) else v for v in inputs])
        return model, tuple(v.tensor if isinstance(v, Target) else v for v in inputs)
    return build


def entries() -> list[Entry]:
    return [Entry(sample_name(cls_name, variant), _builder(recipe), group=cls_name, focus="m",
                  exact=variant != "random")
            for cls_name, variant, recipe in SAMPLES]
