"""Tiny zoo models traced once per session (tracing is the slow part of these tests)."""

import pytest
import torch

from autopar import zoo
from autopar.tracer import trace

# One representative per architecture family (gpt2-medium/-xl are gpt2 at tiny size).
FAMILIES = ("mlp", "gpt2", "bert-base", "llama-1b", "vit-base", "resnet50")

_CACHE: dict = {}


def traced_tiny(name: str):
    """(model, inputs, traced) for a tiny zoo model with real CPU weights, seed 0."""
    if name not in _CACHE:
        torch.manual_seed(0)
        model, inputs = zoo.build(name, tiny=True, device="cpu")
        _CACHE[name] = (model, inputs, trace(model, inputs, name=name))
    return _CACHE[name]


@pytest.fixture(params=FAMILIES)
def family(request):
    return (request.param, *traced_tiny(request.param))


@pytest.fixture
def tiny():
    """The traced_tiny function, as a fixture (test modules here are not a package)."""
    return traced_tiny
