"""Fixtures of the pipeline planner's tests."""

import pytest

from autopar import zoo
from autopar.planner import orchestrate
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


@pytest.fixture
def micro_traces_once(monkeypatch):
    """The planner's micro-batch traces memoised for one test, per model, count and precision: a
    test planning one model several times (other meshes, options or counts) traces each
    micro-batch graph once, as the mesh and the search are not in a trace. The full-batch trace
    is left alone."""
    memo, real = {}, orchestrate._trace_and_profile

    def once(model, meta_inputs, *, precision, microbatches=None, **kw):
        if microbatches is None:
            return real(model, meta_inputs, precision=precision, **kw)
        key = (id(model), microbatches, precision)
        if key not in memo:
            memo[key] = real(model, meta_inputs, precision=precision, microbatches=microbatches, **kw)
        return memo[key]

    monkeypatch.setattr(orchestrate, "_trace_and_profile", once)
    return memo
