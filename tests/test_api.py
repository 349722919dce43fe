"""autopar.api: plan() keeps its keywords, plan_model/plan_traced return the PlanResult."""

import json
import warnings

import pytest
import torch
from torch import nn

from autopar.api import PlanOptions, PlanResult, plan, plan_model, plan_traced
from autopar.tracer import profile, trace


def _model():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    return model, (torch.empty(32, 64, device="meta"),)


def _figures(p) -> dict:
    """The plan without wall-clock seconds."""
    data = json.loads(p.to_json())
    data.pop("timings")
    data["solver"].pop("timings")
    return data


def test_plan_keywords_build_the_same_plan_as_plan_model():
    model, inputs = _model()
    p = plan(model, inputs, mesh="2x2", memory_budget="1GiB", solver="highs", time_limit=30.0, preset="h100-80gb",
             baselines=True, optimizer_multiplier=2.0, allow_replicate_fallback=False, checkpoint="none")
    options = PlanOptions(memory_budget="1GiB", solver="highs", time_limit=30.0, preset="h100-80gb",
                          baselines=True, checkpoint="none")
    result = plan_model(model, inputs, mesh=(2, 2), options=options)
    assert isinstance(result, PlanResult)
    assert _figures(result.plan) == _figures(p)
    assert p.mesh.name == "h100-80gb" and p.budget_bytes == 2**30 and p.checkpoint["mode"] == "none"
    assert {b.name for b in p.baselines} == {"data-parallel", "zero3", "megatron-tp", "dp x tp"}
    # the intermediate results belong to this plan
    assert [n.name for n in result.built.problem.nodes] == [n.name for n in result.plan.nodes]
    assert result.traced.graph_hash == result.plan.graph_hash
    assert result.recompute.method == "none" and result.recompute.choice.keys() == result.built.decisions.keys()
    assert "decisions" in str(result)


def test_plan_traced_reuses_a_trace():
    model, inputs = _model()
    traced = trace(model, inputs)
    prof = profile(traced)
    small = plan_traced(traced, prof, mesh=(2,), options=PlanOptions(checkpoint="none"))
    large = plan_traced(traced, prof, mesh=(4,), options=PlanOptions(checkpoint="none"))
    assert small.traced is large.traced is traced and small.profile is prof
    assert (small.plan.mesh.shape, large.plan.mesh.shape) == ((2,), (4,))
    assert set(small.plan.timings) == {"strategies", "solve"}  # no trace or profile stage here


def test_device_is_the_deprecated_name_of_preset():
    model, inputs = _model()
    with pytest.warns(FutureWarning, match="pass preset='h100-80gb'"):
        old = plan(model, inputs, mesh=(2,), device="h100-80gb", checkpoint="none")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        new = plan(model, inputs, mesh=(2,), preset="h100-80gb", checkpoint="none")
    assert _figures(old) == _figures(new) and new.mesh.name == "h100-80gb"
    with pytest.raises(ValueError, match="preset='cpu' and device='h100-80gb'"):
        plan(model, inputs, mesh=(2,), preset="cpu", device="h100-80gb")


def test_bad_options_fail_before_the_trace():
    class Untraceable(nn.Module):
        def forward(self, x):
            raise AssertionError("traced although the options were bad")

    with pytest.raises(ValueError, match="got 'sometimes'"):
        plan(Untraceable(), (torch.empty(2, device="meta"),), mesh=(2,), checkpoint="sometimes")
    with pytest.raises(ValueError, match="mesh shape"):
        plan(Untraceable(), (torch.empty(2, device="meta"),), mesh="2xq")
