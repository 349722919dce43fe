"""``benchmarks/moe.py`` and the fixed EP x TP x DP configurations behind it.

Fast: the configurations of 8 x 8 devices, and a tiny Mixtral planned within one on 2 x 2 (every
experts op expert-parallel on the ``ep`` axis, Megatron's axis never splitting the batch). Full
sweep: Mixtral-8x22B and the DeepSeek-V3-like shape on 8 x 8, auto against every configuration.
"""

from __future__ import annotations

import pytest
import torch

from autopar.layout.mesh import MeshSpec
from autopar.layout.placement import Shard, TensorSpec
from autopar.planner.baselines import expert_layouts, make_restriction

from tests.benchmarks import load_script


def test_expert_layouts_of_8x8():
    layouts = {(x.ep, x.tp, x.dp): x for x in expert_layouts(8, 8, experts=8)}
    # tp divides a node, ep divides dp and the 8 experts: 4 tp sizes x 4 ep sizes
    assert len(layouts) == 16 and all(ep * (dp // ep) * tp == 64 for ep, tp, dp in layouts)
    assert layouts[8, 8, 8].shape == (8, 8) and layouts[8, 8, 8].roles == ("ep", "megatron")
    assert layouts[4, 2, 32].shape == (8, 4, 2) and layouts[4, 2, 32].roles == ("dp", "ep", "megatron")
    assert layouts[1, 1, 64].shape == (64,) and layouts[1, 1, 64].roles == ("dp",)
    assert str(layouts[2, 4, 16]) == "ep 2 x tp 4 x dp 16"
    assert {x.ep for x in expert_layouts(8, 8, experts=6)} == {1, 2}  # every rank as many experts


def test_fixed_configuration_plans_expert_parallel_on_its_axis():
    from autopar.planner.options import PlanOptions
    from autopar.planner.orchestrate import plan_traced, trace_for_planning
    from autopar.tracer import profile
    from tests.tracer.test_experts import mixtral

    ids = torch.randint(0, 128, (8, 8), generator=torch.Generator().manual_seed(3))
    # vocabulary 128: Megatron's axis reads the embedding split by vocabulary, evenly
    traced = trace_for_planning(mixtral(vocab=128), {"input_ids": ids, "labels": ids}, precision="fp32")
    prof = profile(traced)
    layout = next(x for x in expert_layouts(2, 2, experts=4) if (x.ep, x.tp) == (2, 2))
    assert layout.roles == ("ep", "megatron")
    mesh = MeshSpec.cluster(nodes=2, devices_per_node=2, device="h100-80gb")
    options = PlanOptions(preset="h100-80gb")
    restrict = (str(layout), make_restriction(layout.roles, mesh_shape=mesh.shape, expert_parallel=True))
    fixed = plan_traced(traced, prof, mesh=mesh, options=options, restrict=restrict).plan
    experts = [n for n in fixed.nodes if n.op == "autopar.moe_experts.default"]
    assert len(experts) == 2
    for n in experts:
        hidden, gate_up = TensorSpec.parse(n.input_specs[0]), TensorSpec.parse(n.input_specs[3])
        assert hidden.placements[0] == gate_up.placements[0] == Shard(0)  # the all-to-all on axis 0
        assert 1 not in hidden.shard_axes(0)  # Megatron's axis never splits the batch


@pytest.mark.full_sweep
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("shape", ["mixtral", "deepseek"])
def test_auto_chooses_expert_parallelism_and_beats_every_fixed_configuration(shape):
    bench = load_script("moe")
    layers, batch = {"mixtral": (56, 64), "deepseek": (8, 16)}[shape]
    rows = bench.run_shape(shape, batch=batch, seq=4096, layers=layers, tps={1, 2, 4, 8}, eps={1, 2, 4, 8})
    auto, fixed = rows[0], [r for r in rows[1:] if r["step_s"] is not None]
    assert auto["config"] == "auto" and fixed
    assert auto["expert_degree"] > 1
    assert auto["step_s"] <= min(r["step_s"] for r in fixed) * (1 + 1e-9)
    assert all(r["expert_degree"] == r["ep"] for r in fixed)
    assert auto["peak_bytes"] <= 80 * 2**30
