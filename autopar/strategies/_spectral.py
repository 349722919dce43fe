"""Short-time Fourier transform (``aten.stft``, both overloads): a spectrogram front-end's first op.

``self`` is a signal (L) or a batch of signals (B, L); the output is (B?, n_fft // 2 + 1 or n_fft,
frames), complex. Every signal is transformed on its own, so the batch dim splits: ``self`` S(0)
-> output S(0) (2-D input only); ``window`` stays replicated. The transform is linear in the
signal for a fixed window, so ``self`` P -> output P too (each rank transforms its summand;
``work_split=False``). The frequency and frame dims do not split: every frame reads n_fft
consecutive samples of the whole signal. Local op: the same op on the local batch, arguments
unchanged (n_fft, hop and window describe one signal).
"""

from __future__ import annotations

import torch

from autopar.layout.placement import Partial, Shard
from autopar.strategies.registry import AxisOption, OpInfo, Sample, register
from autopar.strategies.samples import rand

aten = torch.ops.aten


def _stft_samples() -> list[Sample]:
    window = torch.hann_window(8, dtype=torch.float64)
    return [Sample((rand(4, 32), 8), {"hop_length": 4, "window": window, "return_complex": True}, label="batch"),
            Sample((rand(32), 8), {"hop_length": 2, "return_complex": True}, label="one-signal")]


def _stft_center_samples() -> list[Sample]:
    window = torch.hann_window(8, dtype=torch.float64)
    return [Sample((rand(4, 32), 8, 4, None, window, True, "reflect"), {"return_complex": True}, label="centered")]


def _stft_rule(info: OpInfo) -> list[AxisOption]:
    batched = [info.option(Shard(0), self=Shard(0))] if info.input("self").ndim == 2 else []
    return batched + [info.option(Partial(), self=Partial(), work_split=False)]


register(aten.stft.default, samples=_stft_samples)(_stft_rule)
register(aten.stft.center, samples=_stft_center_samples)(_stft_rule)
