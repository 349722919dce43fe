"""``AutoParallelPlugin`` and ``Booster`` check their arguments when made (every rank alike,
before any collective), echoing the bad value."""

from __future__ import annotations

import pytest
import torch

from autopar.booster import AutoParallelPlugin, Booster
from autopar.layout.mesh import MeshSpec

BAD = [
    ({"mesh": "2xq"}, "mesh.*'2xq'"),
    ({"mesh": (2, 0)}, r"mesh.*\(2, 0\)"),
    ({"memory_budget": -1}, "-1"),
    ({"memory_budget": "lots"}, "'lots'"),
    ({"precision": "fp8"}, "precision.*'fp8'"),
    ({"reduce_dtype": "int8"}, "reduce_dtype.*'int8'"),
    ({"zero_stage": 3}, "zero_stage.*3"),
    ({"zero_stage": "1"}, "zero_stage.*'1'"),
    ({"zero_stage": True}, "zero_stage.*True"),
    ({"max_norm": -0.5}, "max_norm.*-0.5"),
    ({"max_norm": float("inf")}, "max_norm.*inf"),
    ({"max_norm": "1"}, "max_norm.*'1'"),
    ({"checkpoint": "sometimes"}, "checkpoint.*'sometimes'"),
    ({"solver": "gurobi"}, "solver.*'gurobi'"),
    ({"time_limit": 0}, "time_limit.*0"),
    ({"seed": 1.5}, "seed.*1.5"),
    ({"allow_replicate_fallback": "yes"}, "allow_replicate_fallback.*'yes'"),
    ({"plan": 42}, "plan.*42"),
    ({"plan": "/no/such/plan.json"}, "plan.*'/no/such/plan.json'"),
    ({"device": "gpu7"}, "device.*'gpu7'"),
    ({"initial_scale": 0}, "initial_scale.*0"),
    ({"growth_factor": 1.0}, "growth_factor.*1.0"),
    ({"backoff_factor": 1.5}, "backoff_factor.*1.5"),
    ({"growth_interval": 0}, "growth_interval.*0"),
]


@pytest.mark.parametrize("kwargs,match", BAD, ids=[next(iter(k)) + "=" + repr(next(iter(k.values()))) for k, _ in BAD])
def test_bad_plugin_arguments_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AutoParallelPlugin(**kwargs)


@pytest.mark.parametrize("stage,planned", [("auto", "auto"), (0, 0), (1, 1), (2, 2)])
def test_zero_stage_reaches_autoparallelize(stage, planned):
    assert AutoParallelPlugin(zero_stage=stage).autoparallelize_kwargs()["zero_stage"] == planned


@pytest.mark.parametrize("pp_size,planned", [(None, "auto"), ("auto", "auto"), (2, 0)])
def test_zero_stage_auto_under_a_pipeline(pp_size, planned):
    # pp_size="auto": the planner keeps "auto" for the plan without a pipeline (0 in its stages).
    assert AutoParallelPlugin(pp_size=pp_size).autoparallelize_kwargs()["zero_stage"] == planned


def test_good_arguments_are_normalised():
    p = AutoParallelPlugin(mesh="2x2", memory_budget="1GiB", precision="bfloat16", zero_stage=0, max_norm=1,
                           reduce_dtype=torch.float32, device="cpu")
    assert (p.mesh, p.memory_budget, p.precision, p.reduce_dtype) == ((2, 2), 2**30, "bf16", "fp32")
    assert AutoParallelPlugin(mesh=MeshSpec.preset("cpu", (4,))).mesh.shape == (4,)
    assert AutoParallelPlugin().zero_stage == "auto"


def test_booster_checks_its_arguments():
    with pytest.raises(ValueError, match="AutoParallelPlugin.*'ddp'"):
        Booster(plugin="ddp")
    booster = Booster()
    model = torch.nn.Linear(2, 2)
    deferred, *_ = booster.boost(model)  # no inputs to plan from: planned at the first forward
    with pytest.raises(RuntimeError, match="planned at its first forward"):
        deferred.plan
    with pytest.raises(ValueError, match="a pipelined plan .* dataloader .* or meta_inputs"):
        Booster(AutoParallelPlugin(pp_size=2)).boost(model)
    with pytest.raises(ValueError, match="lr_scheduler needs the optimizer"):
        booster.boost(model, lr_scheduler=object(), meta_inputs=(torch.zeros(1, 2),))
    with pytest.raises(ValueError, match="boosted model"):
        booster.save_model(model, "unused")
    with pytest.raises(ValueError, match="returned by Booster.boost"):
        booster.backward(torch.zeros(()), torch.optim.SGD(model.parameters(), lr=1.0))


def test_a_list_of_meshes_is_candidates_planned_by_the_plugin():
    flat, square = MeshSpec.preset("cpu", (4,)), MeshSpec.preset("cpu", (2, 2))
    p = AutoParallelPlugin(mesh=[flat, "2x2"], pp_size="auto")
    assert p.candidates == (flat, (2, 2)) and p.data_parallel_size() == 4
    assert p.autoparallelize_kwargs()["mesh"] is None  # the chosen plan brings its mesh
    assert AutoParallelPlugin(mesh=(2, 2)).candidates is None and AutoParallelPlugin().candidates is None
    with pytest.raises(ValueError, match="different device counts"):
        AutoParallelPlugin(mesh=[flat, (2,)])
    with pytest.raises(ValueError, match="refine=True re-plans"):
        AutoParallelPlugin(mesh=[flat, square], refine=True)
    with pytest.raises(ValueError, match=r"mesh must be .*'2xq'"):
        AutoParallelPlugin(mesh=[flat, "2xq"])
