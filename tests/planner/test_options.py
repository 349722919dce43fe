"""PlanOptions: one checked record of the planning options."""

import dataclasses

import pytest

from autopar.layout.mesh import MeshSpec
from autopar.planner import checkpointing
from autopar.planner.options import CHECKPOINT_MODES, PlanOptions


def test_defaults_and_normalised_budget():
    options = PlanOptions()
    mesh = MeshSpec.preset("a100-80gb", (2, 4))
    assert options.budget_bytes(mesh) == mesh.mem_capacity  # None: the device capacity
    assert PlanOptions(memory_budget="16GiB").memory_budget == 16 * 2**30
    assert PlanOptions(memory_budget="16GiB").budget_bytes(mesh) == 16 * 2**30
    assert options.mesh((2, 2)) == MeshSpec.preset("cpu", (2, 2))
    assert PlanOptions(preset="h100-80gb").mesh("2x4") == MeshSpec.preset("h100-80gb", (2, 4))
    assert PlanOptions(preset="h100-80gb").mesh(mesh) is mesh
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.solver = "cbc"
    assert "checkpoint auto" in str(options) and "16.00 GiB" in str(PlanOptions(memory_budget="16GiB"))


@pytest.mark.parametrize("bad, needle", [
    ({"checkpoint": "sometimes"}, "got 'sometimes'"),
    ({"solver": "glpk"}, "unknown solver 'glpk'"),
    ({"time_limit": 0}, "got 0"),
    ({"time_limit": "60"}, "got '60'"),
    ({"preset": "tpu-v9"}, "unknown device preset 'tpu-v9'"),
    ({"optimizer_multiplier": -1.0}, "got -1.0"),
    ({"optimizer_multiplier": float("inf")}, "got inf"),
    ({"memory_budget": "40QB"}, "'40QB'"),
])
def test_bad_values_are_value_errors_that_echo_them(bad, needle):
    with pytest.raises(ValueError) as info:
        PlanOptions(**bad)
    assert needle in str(info.value)


def test_checkpoint_modes_are_the_planners():
    assert checkpointing.MODES is CHECKPOINT_MODES
