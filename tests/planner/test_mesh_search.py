"""mesh="auto" (autopar.planner.mesh_search): every 1-3 axis arrangement of a cluster, the fastest kept."""

from __future__ import annotations

import math

import pytest
import torch

from autopar import zoo
from autopar.api import plan_model, plan_traced
from autopar.layout.mesh import MeshSpec
from autopar.planner.mesh_search import mesh_shapes, search_meshes
from autopar.planner.options import PlanOptions


def test_shapes_are_every_ordered_factorisation_up_to_three_axes():
    shapes = mesh_shapes(64)
    assert shapes[0] == (64,) and all(math.prod(s) == 64 and min(s) >= 2 for s in shapes)
    assert len(shapes) == len(set(shapes)) == 1 + 5 + 10  # 2^6 into 1, 2, 3 ordered parts
    assert (8, 8) in shapes and (2, 4, 8) in shapes and (8, 4, 2) in shapes
    assert mesh_shapes(12, max_axes=2) == [(12,), (2, 6), (3, 4), (4, 3), (6, 2)]
    assert mesh_shapes(1) == [(1,)] and mesh_shapes(7) == [(7,)]
    with pytest.raises(ValueError, match="positive int"):
        mesh_shapes(0)


def test_cluster_puts_intra_node_links_on_inner_axes():
    mesh = MeshSpec.cluster(nodes=8, devices_per_node=8, shape=(2, 4, 8))
    inter, intra = MeshSpec.cluster(nodes=2, devices_per_node=1).alpha[0], mesh.alpha[2]
    assert mesh.alpha == (inter, inter, intra) and intra < inter
    assert MeshSpec.cluster(nodes=8, devices_per_node=8).shape == (8, 8)
    with pytest.raises(ValueError, match="has 32 devices"):
        MeshSpec.cluster(nodes=8, devices_per_node=8, shape=(4, 8))


def test_search_keeps_the_fastest_feasible_mesh_and_reports_every_candidate():
    torch.manual_seed(0)
    model, inputs = zoo.build("gpt2", tiny=True, batch=8, seq=32, device="meta")
    first = plan_model(model, inputs, mesh=(4,), options=PlanOptions(checkpoint="none"))
    seen = []

    def plan_on(mesh):
        if mesh.shape == (2, 2):
            raise ValueError("no plan fits\nsecond line")
        return plan_traced(first.traced, first.profile, mesh=mesh, options=PlanOptions(checkpoint="none"))

    found = search_meshes(plan_on, nodes=2, devices_per_node=2, device="a100-80gb", report=seen.append)
    assert [r.shape for r in found.rows] == [(4,), (2, 2)] and seen == list(found.rows)
    assert found.best_shape == (4,) and found.best.plan.mesh.shape == (4,)
    assert found.rows[1].note == "ValueError: no plan fits" and not found.rows[1].feasible
    assert "<- chosen" in found.table().splitlines()[2]
    # Every candidate's own plan is no faster than the chosen one.
    assert all(r.step_s >= found.best.plan.estimate.step_s for r in found.rows if r.feasible)
    with pytest.raises(ValueError, match="no mesh of 1 x 2"):
        search_meshes(lambda mesh: (_ for _ in ()).throw(ValueError("nope")), nodes=1, devices_per_node=2)
