"""Recurrent layers (``lstm``, ``gru``, ``rnn_tanh``, ``rnn_relu``) and their cells: batch split.

Whole layers (``*.input`` overloads; arguments ``input, hx, params, has_biases, num_layers,
dropout, train, bidirectional, batch_first``): ``input`` is (T, B, F), or (B, T, F) with
``batch_first``; every hidden state in ``hx`` (LSTM: [h_0, c_0], others: h_0) is
(layers * directions, B, H) whatever ``batch_first`` says. Outputs: ``output`` laid out like
``input``, then h_n (and c_n for LSTM) like ``hx``.

- batch split: ``input`` S(batch dim), every ``hx`` tensor S1 -> ``output`` S(batch dim), h_n and
  c_n S1; the weights in ``params`` are replicated. Every sequence runs its own recurrence with the
  same weights, so the local op computes exactly its samples; the weight gradients are partial
  sums over the local samples (derived ``grad_partial``, all-reduced in backward). Inter-layer
  dropout draws its own mask per sample either way.

Cells (``lstm_cell``, ``gru_cell``, ``rnn_tanh_cell``, ``rnn_relu_cell``; arguments ``input``
(B, F), ``hx`` (B, H) -- a list [h, c] for LSTM --, ``w_ih``, ``w_hh``, ``b_ih``, ``b_hh``):

- batch split: ``input`` and every ``hx`` tensor S0 -> every output S0, weights replicated.

Not offered: splits of the hidden dim (every gate reads the whole previous hidden state, so the
recurrence would need an all-gather per time step inside the op), the packed-sequence
overloads (``*.data``), and unbatched calls (``nn`` modules add a batch dim of 1 before the op).
"""

from __future__ import annotations

import torch

from autopar.layout.placement import Shard
from autopar.strategies.registry import AxisOption, OpInfo, Sample, register
from autopar.strategies.samples import rand

aten = torch.ops.aten


def _hx_split(info: OpInfo, dim: int):
    """``dim`` split of every hidden state: ``hx`` is a list for LSTM ([h, c]), a tensor otherwise."""
    hx = info.arg("hx")
    return [Shard(dim)] * len(hx) if isinstance(hx, list) else Shard(dim)


def _layer_rule(info: OpInfo) -> list[AxisOption]:
    if info.input("input").ndim != 3:
        return []
    batch = 0 if info.arg("batch_first") else 1
    outputs = (Shard(batch),) + (Shard(1),) * (len(info.outputs) - 1)
    return [info.option(outputs, input=Shard(batch), hx=_hx_split(info, 1))]


def _cell_rule(info: OpInfo) -> list[AxisOption]:
    if info.input("input").ndim != 2:
        return []
    outputs = Shard(0) if len(info.outputs) == 1 else (Shard(0),) * len(info.outputs)
    return [info.option(outputs, input=Shard(0), hx=_hx_split(info, 0))]


# ----------------------------------------------------------------------------------- samples
def _params(gates: int, input_size: int, hidden: int, layers: int, bidirectional: bool,
            bias: bool) -> list[torch.Tensor]:
    """The flat weight list of ``nn.RNNBase``: per layer, per direction w_ih, w_hh[, b_ih, b_hh]."""
    directions = 2 if bidirectional else 1
    out = []
    for layer in range(layers):
        features = input_size if layer == 0 else hidden * directions
        for _ in range(directions):
            out += [rand(gates * hidden, features) * 0.5, rand(gates * hidden, hidden) * 0.5]
            if bias:
                out += [rand(gates * hidden) * 0.1, rand(gates * hidden) * 0.1]
    return out


def _layer_samples(gates: int, lstm: bool):
    def samples() -> list[Sample]:
        out = []
        for label, layers, bidir, batch_first, bias in [("2-layers-bidirectional-batch-first", 2, True, True, True),
                                                         ("1-layer-seq-first-no-bias", 1, False, False, False)]:
            directions = 2 if bidir else 1
            x = rand(4, 3, 4) if batch_first else rand(3, 4, 4)
            h = [rand(layers * directions, 4, 4) for _ in range(2 if lstm else 1)]
            params = _params(gates, 4, 4, layers, bidir, bias)
            out.append(Sample((x, h if lstm else h[0], params, bias, layers, 0.0, True, bidir, batch_first),
                              label=label))
        return out

    return samples


def _cell_samples(gates: int, lstm: bool):
    def samples() -> list[Sample]:
        h = [rand(4, 8) for _ in range(2 if lstm else 1)]
        weights = (rand(gates * 8, 4) * 0.5, rand(gates * 8, 8) * 0.5)
        return [
            Sample((rand(4, 4), h if lstm else h[0], *weights, rand(gates * 8) * 0.1, rand(gates * 8) * 0.1),
                   label="bias"),
            Sample((rand(4, 4), h if lstm else h[0], *weights), label="no-bias"),
        ]

    return samples


for _layer, _cell, _gates in [(aten.lstm.input, aten.lstm_cell.default, 4), (aten.gru.input, aten.gru_cell.default, 3),
                              (aten.rnn_tanh.input, aten.rnn_tanh_cell.default, 1),
                              (aten.rnn_relu.input, aten.rnn_relu_cell.default, 1)]:
    _lstm = _layer is aten.lstm.input
    register(_layer, has_flops=True, samples=_layer_samples(_gates, _lstm))(_layer_rule)
    register(_cell, has_flops=True, samples=_cell_samples(_gates, _lstm))(_cell_rule)
