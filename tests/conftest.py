"""Shared fixtures: device-free meshes of 1, 2 and 3 axes (CPU preset costs)."""

import pytest

from autopar.layout.mesh import MeshSpec


@pytest.fixture(params=[(2,), (4,)], ids=lambda s: "x".join(map(str, s)))
def mesh_1d(request) -> MeshSpec:
    return MeshSpec.preset("cpu", request.param)


@pytest.fixture(params=[(2, 2), (2, 4)], ids=lambda s: "x".join(map(str, s)))
def mesh_2d(request) -> MeshSpec:
    return MeshSpec.preset("cpu", request.param)


@pytest.fixture
def mesh_3d() -> MeshSpec:
    return MeshSpec.preset("cpu", (2, 2, 2))


@pytest.fixture(params=[(2,), (4,), (2, 2), (2, 2, 2)], ids=lambda s: "x".join(map(str, s)))
def any_mesh(request) -> MeshSpec:
    return MeshSpec.preset("cpu", request.param)
