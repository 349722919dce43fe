"""benchmarks/_measure.py's memory definition: bytes saved for backward exclude the parameters'
storage however the runtime reaches it (a ``DTensor.to_local()`` is a non-leaf view of it)."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))


def _saved(weight, params):
    from _measure import SavedBytes  # benchmarks/_measure.py

    x = torch.randn(8, 16, requires_grad=True)
    saved = SavedBytes(params)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        # A view of the parameter, as a DTensor parameter's local tensor is; tanh saves its output.
        loss = torch.tanh(x @ weight.view(16, 4)).sum()
    loss.backward()
    return saved.peak


def test_saved_bytes_skip_views_of_parameters_but_count_activations():
    weight = torch.nn.Parameter(torch.randn(16, 4))
    # matmul saves x (a leaf that requires grad: skipped as an input like a parameter) and the
    # weight's view; tanh saves its (8, 4) output: 128 bytes.
    assert _saved(weight, [weight]) == 8 * 4 * 4
    assert _saved(weight, []) == 8 * 4 * 4 + 16 * 4 * 4  # without the parameters named: counted
