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


# ------------------------------------------------------------------------------ mesh="auto"
def test_world_cluster_comes_from_the_arguments_or_the_launcher():
    from autopar.api import world_cluster

    assert world_cluster(8, None, None, environ={}) == (1, 8)  # no launcher: one node
    assert world_cluster(8, None, None, environ={"LOCAL_WORLD_SIZE": "4"}) == (2, 4)  # torchrun's per-node count
    assert world_cluster(8, 2, None, environ={"LOCAL_WORLD_SIZE": "8"}) == (2, 4)  # an argument wins
    assert world_cluster(8, None, 2, environ={}) == (4, 2) and world_cluster(8, 4, 2, environ={}) == (4, 2)
    with pytest.raises(ValueError, match=r"3 nodes x 2 devices per node \(given\) is not the world size 8"):
        world_cluster(8, 3, 2, environ={})
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE=3\) is not the world size 8"):
        world_cluster(8, None, None, environ={"LOCAL_WORLD_SIZE": "3"})
    with pytest.raises(ValueError, match="nodes must be a positive int, got 0"):
        world_cluster(8, 0, None, environ={})


def _auto_body(rank, world, model, inputs):
    import os

    from autopar.api import autoparallelize

    out = {}
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    pm = autoparallelize(model, inputs, mesh="auto", checkpoint="none")
    out["mesh"] = tuple(pm.plan.mesh.shape)
    out["loss"] = pm(**inputs)[0].item()
    os.environ["LOCAL_WORLD_SIZE"] = "4" if rank == 3 else "2"  # one rank sees another launch layout
    try:
        autoparallelize(model, inputs, mesh="auto", checkpoint="none")
        out["disagree"] = ("no error", "")
    except Exception as exc:  # noqa: BLE001 -- compared across ranks
        out["disagree"] = (type(exc).__name__, str(exc))
    return out


@pytest.mark.slow
def test_autoparallelize_mesh_auto_searches_on_rank_0_and_every_rank_builds_it():
    from autopar import zoo
    from autopar.runtime.launch import run_local

    torch.manual_seed(0)
    model, inputs = zoo.build("mlp", tiny=True, device="cpu")
    offline = plan(model, inputs, mesh="auto", nodes=2, devices_per_node=2, preset="cpu", checkpoint="none")
    results = run_local(_auto_body, 4, model, inputs, timeout=120)
    assert {r["mesh"] for r in results} == {tuple(offline.mesh.shape)}  # the search's choice, on every rank
    assert len({r["loss"] for r in results}) == 1 and torch.isfinite(torch.tensor(results[0]["loss"]))
    kinds, texts = {r["disagree"][0] for r in results}, {r["disagree"][1] for r in results}
    assert kinds == {"ValueError"} and len(texts) == 1, results
    text = texts.pop()
    assert "ranks disagree on the mesh" in text and "auto over 2 nodes x 2 devices" in text
    assert "rank 3 auto over 1 nodes x 4 devices" in text


def test_subpackages_and_protocol_resolve_after_import_autopar():
    """What a user types after ``import autopar`` alone, in a fresh process (no earlier import
    of the subpackage): ``autopar.optim.Lamb``, ``autopar.booster.Booster`` and its plugin."""
    import subprocess
    import sys

    code = ("import autopar; print(autopar.optim.Lamb.__name__, autopar.booster.Booster.__name__, "
            "autopar.booster.AutoParallelPlugin.__name__, autopar.ParallelModule.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["Lamb", "Booster", "AutoParallelPlugin", "ParallelModule"]
    import autopar

    with pytest.raises(AttributeError, match="no attribute 'optimm'"):
        autopar.optimm

