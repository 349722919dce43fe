"""Even pipeline cuts at repeated-block boundaries, the pipelined Plan and its JSON."""

import dataclasses
import json

import pytest

from autopar import zoo
from autopar.api import plan_traced
from autopar.layout.mesh import MeshSpec
from autopar.planner.pipeline.assemble import pipeline_plan
from autopar.planner.pipeline.geometry import block_container, even_stages
from autopar.plans import PipelinePlan, Plan, RecomputeRegion, StagePlan, stage_mesh_of
from autopar.runtime.pipeline.split import split_stages
from autopar.strategies import needs_decomposition
from autopar.tracer import profile, trace


@pytest.fixture(scope="module")
def mlp():
    model, inputs = zoo.build("mlp", tiny=True, num_layers=6, batch=2, device="cpu")
    traced = trace(model, inputs, decompose_if=needs_decomposition)
    return traced, plan_traced(traced, profile(traced), mesh=(2,)).plan


def test_even_stages_hold_whole_blocks_in_order(mlp):
    traced, _ = mlp
    assert block_container(traced) == ("blocks", 6)
    stages = even_stages(traced, num_stages=2, virtual_stages=2)
    assert [s.layers for s in stages] == [(0, 1), (1, 3), (3, 4), (4, 6)]
    assert [s.rank for s in stages] == [0, 1, 0, 1]  # interleaved (loop) placement
    ops = [n.name for n in traced.nodes if n.op not in ("placeholder", "output")]
    placed = [name for s in stages for name in s.nodes if name in set(ops)]
    assert placed == ops  # every op once, contiguous in graph order
    modules = {n.name: traced.module_path(n) for n in traced.nodes}
    for s in stages:
        blocks = {int(modules[n].split(".")[1]) for n in s.nodes if modules[n].startswith("blocks.")}
        assert blocks == set(range(*s.layers))
    # the input x feeds the first block (stage 0), the labels only the loss (last stage); the
    # head's weight is read by the last stage only
    assert "x" in stages[0].nodes and "labels" in stages[-1].nodes and "labels" not in stages[0].nodes
    head = traced.by_fqn("head.weight").name
    assert [head in s.nodes for s in stages] == [False, False, False, True]


def test_too_few_blocks_is_a_clear_error(mlp):
    traced, _ = mlp
    with pytest.raises(ValueError, match=r"has 6 repeated blocks .*; 4 pipeline stages x 2 virtual stages need at "
                                         r"least 8"):
        even_stages(traced, num_stages=4, virtual_stages=2)
    with pytest.raises(ValueError, match="num_stages must be a positive int"):
        even_stages(traced, num_stages=0)


def test_boundary_values_are_threaded_to_later_stages(mlp):
    traced, sub = mlp
    plan = pipeline_plan(sub, traced, mesh=MeshSpec.preset("cpu", (3, 2)), num_stages=3, num_microbatches=4,
                         schedule="1f1b")
    graphs = split_stages(traced, plan.pipeline)
    assert graphs[0].inputs == ("x", "labels")
    # labels are read by the loss only: sent through every stage to the last
    assert all("labels" in g.outputs for g in graphs[:-1]) and all("labels" in g.inputs for g in graphs[1:])
    assert graphs[-1].outputs == tuple(a.name for a in traced.flat_outputs)
    for a, b in zip(graphs, graphs[1:]):
        assert a.outputs == b.inputs


def test_pipelined_plan_round_trips_through_json(mlp):
    traced, sub = mlp
    mesh = MeshSpec.preset("cpu", (2, 2))
    plan = pipeline_plan(sub, traced, mesh=mesh, num_stages=2, num_microbatches=8, schedule="interleaved-1f1b",
                         virtual_stages=2)
    assert plan.mesh == mesh and plan.stage_mesh().shape == (2,) and plan.nodes == sub.nodes
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.pipeline == plan.pipeline
    text = plan.summary()
    assert "pipeline 2 stages x 2 virtual on mesh axis 0, 8 micro-batches, interleaved-1f1b" in text
    assert "stage 3 on pipeline rank 1: blocks 4..5" in text
    old = json.loads(plan.to_json())
    del old["pipeline"]  # a plan file written before pipelines existed
    assert Plan.from_json(json.dumps(old)).pipeline is None


def test_one_dimensional_mesh_leaves_one_device_per_stage(mlp):
    traced, _ = mlp
    mesh = MeshSpec.preset("cpu", (4,))
    assert stage_mesh_of(mesh).shape == (1,)
    one = plan_traced(traced, profile(traced), mesh=stage_mesh_of(mesh)).plan
    plan = pipeline_plan(one, traced, mesh=mesh, num_stages=4, num_microbatches=4, schedule="gpipe")
    assert plan.stage_mesh().shape == (1,) and len(plan.pipeline.stages) == 4
    by_shape = pipeline_plan(one, traced, mesh=(4,), num_stages=4, num_microbatches=4, schedule="gpipe")
    assert by_shape.mesh.shape == (4,) and by_shape.pipeline == plan.pipeline


def test_pipeline_plan_checks_its_arguments(mlp):
    traced, sub = mlp
    mesh = MeshSpec.preset("cpu", (2, 2))
    with pytest.raises(ValueError, match="schedule 'pipedream' is not one of"):
        pipeline_plan(sub, traced, mesh=mesh, num_stages=2, num_microbatches=4, schedule="pipedream")
    with pytest.raises(ValueError, match=r"the stage plan is for mesh \(2,\); stages of mesh \(2, 4\) run on \(4,\)"):
        pipeline_plan(sub, traced, mesh=MeshSpec.preset("cpu", (2, 4)), num_stages=2, num_microbatches=4,
                      schedule="gpipe")
    with pytest.raises(ValueError, match="'gpipe' runs one stage per rank"):
        pipeline_plan(sub, traced, mesh=mesh, num_stages=2, num_microbatches=4, schedule="gpipe", virtual_stages=2)
    region = RecomputeRegion("blocks.0", tuple(n.name for n in traced.compute_nodes())[:3])
    with pytest.raises(ValueError, match="recompute does not run under the zero-bubble schedule"):
        pipeline_plan(dataclasses.replace(sub, recompute=(region,)), traced, mesh=mesh, num_stages=2,
                      num_microbatches=4, schedule="zero-bubble", virtual_stages=2)
    spanning = RecomputeRegion("all", tuple(n.name for n in traced.compute_nodes()))
    with pytest.raises(ValueError, match=r"recompute region 'all' spans pipeline stages \[0, 1\]"):
        pipeline_plan(dataclasses.replace(sub, recompute=(spanning,)), traced, mesh=mesh, num_stages=2,
                      num_microbatches=4, schedule="1f1b")
    with pytest.raises(ValueError, match="needs 4 stages, the plan lists 1"):
        PipelinePlan(num_stages=2, num_microbatches=4, schedule="gpipe", virtual_stages=2,
                     stages=(StagePlan(0, 0, (0, 1), ()),))
