"""``benchmarks/_measure.py``'s memory accounting: each storage once, a parameter's views (what a
planned module reads: ``to_local()``, ``t()``) state rather than activations, and an optimizer's
own parameters (ZeRO pieces: views of the parameters) counted by their storage."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from _measure import SavedBytes, state_bytes  # noqa: E402


def test_saved_bytes_leaves_out_views_of_parameters():
    weight = torch.nn.Parameter(torch.randn(32, 64))
    x = torch.randn(8, 64, requires_grad=True)
    counted, naive = SavedBytes([weight]), SavedBytes()
    for saved in (counted, naive):
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            h = x.tanh()  # saves its output: an activation
            y = h @ weight.view(32, 64).t()  # a view of the weight's storage, not the leaf itself
        y.sum().backward()
    activation = 8 * 64 * 4
    assert counted.peak == activation
    assert naive.peak == activation + weight.numel() * 4  # the weight's storage taken for an activation


def test_state_bytes_counts_each_storage_once():
    param = torch.nn.Parameter(torch.randn(16, 4))
    param.grad = torch.randn(16, 4)
    piece = torch.nn.Parameter(param.detach()[:4])  # a ZeRO piece: a view of the parameter
    piece.grad = torch.randn(4, 4)  # ZeRO-2: its reduce-scattered gradient, its own storage
    opt = torch.optim.AdamW([piece], lr=0.1)
    opt.step()  # two moments of the piece, and the step count
    moments = 2 * 4 * 4 * 4
    assert state_bytes([param], opt) == 2 * 16 * 4 * 4 + 4 * 4 * 4 + moments + 4
