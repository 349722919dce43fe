"""Fixtures of the pipeline planner's tests."""

import pytest

from autopar import zoo
from autopar.strategies import needs_decomposition
from autopar.tracer import profile, trace


@pytest.fixture(scope="package")
def traced_models():
    """GPT-2 (8 blocks) and Llama (4 blocks), tiny, traced at a micro-batch of 2 with profiles:
    the stage search's and the floors' tests share them (traced once for this package; neither
    module rewrites a graph)."""
    out = {}
    for name, layers in (("gpt2", 8), ("llama-1b", 4)):
        model, micro = zoo.build(name, tiny=True, num_layers=layers, batch=2, device="meta")
        traced = trace(model, micro, decompose_if=needs_decomposition)
        out[name] = (traced, profile(traced))
    return out
