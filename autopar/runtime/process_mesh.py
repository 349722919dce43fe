"""``ProcessMesh``: the live counterpart of a ``MeshSpec`` -- real per-axis process groups.

A ``ProcessMesh`` wraps ``torch.distributed.device_mesh.DeviceMesh`` (created with
``init_device_mesh`` over the current default process group) and exposes what the collectives
in ``autopar.runtime.collectives`` need, per mesh axis: the ``ProcessGroup``, the axis size, and this
rank's coordinate on the axis.

Contract relied upon by ``comm``: on every axis group, a rank's *group rank* equals its mesh
coordinate on that axis, so the i-th piece of an all-gather (or the i-th chunk of an
all-to-all) belongs to coordinate i. The constructor checks this once instead of trusting it.

Ranks fill the mesh in row-major order (the last axis is innermost), matching ``MeshSpec``.
The device type defaults to ``cuda`` under NCCL and ``cpu`` otherwise.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.layout.mesh import MeshSpec, default_axis_names, parse_mesh_shape
from autopar.runtime.seats import configure_waits

__all__ = ["ProcessMesh"]


def _default_device_type() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


class ProcessMesh:
    """Per-axis process groups and this rank's mesh coordinate (one object per process)."""

    def __init__(self, device_mesh: DeviceMesh) -> None:
        self.device_mesh = device_mesh
        self.shape: tuple[int, ...] = tuple(int(s) for s in device_mesh.shape)
        names = device_mesh.mesh_dim_names
        self.axis_names: tuple[str, ...] = (
            tuple(names) if names else default_axis_names(len(self.shape))
        )
        coordinate = device_mesh.get_coordinate()
        if coordinate is None:
            raise ValueError(
                f"rank {dist.get_rank()} is not part of the device mesh {device_mesh.mesh.tolist()}"
            )
        self.coordinate: tuple[int, ...] = tuple(int(c) for c in coordinate)
        self.groups: tuple[dist.ProcessGroup, ...] = tuple(
            device_mesh.get_group(axis) for axis in range(len(self.shape))
        )
        self._flat_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}  # see group_over
        rank = dist.get_rank()
        for axis, group in enumerate(self.groups):
            group_rank = dist.get_group_rank(group, rank)
            if group_rank != self.coordinate[axis]:
                # The collectives index pieces by group rank; a mismatch would scramble shards.
                raise RuntimeError(
                    f"rank {rank}: group rank {group_rank} on mesh axis {axis} differs from the "
                    f"mesh coordinate {self.coordinate}"
                )
        # how this process waits for its collectives (``runtime.seats``: poll where ranks have cores)
        self.polls: bool = configure_waits(torch.device(device_mesh.device_type))

    # --------------------------------------------------------------------------- factories
    @classmethod
    def create(
        cls,
        shape: Sequence[int] | str | int,
        *,
        axis_names: Sequence[str] | None = None,
        device_type: str | None = None,
    ) -> "ProcessMesh":
        """Build the mesh over the default process group; ``prod(shape)`` must be its size."""
        if not dist.is_initialized():
            raise ValueError("ProcessMesh needs an initialised default process group")
        shape = parse_mesh_shape(shape)
        world_size = dist.get_world_size()
        if math.prod(shape) != world_size:
            raise ValueError(
                f"mesh {shape} has {math.prod(shape)} devices but the process group has "
                f"{world_size} ranks"
            )
        names = tuple(axis_names) if axis_names else default_axis_names(len(shape))
        if len(names) != len(shape) or len(set(names)) != len(names):
            raise ValueError(f"need {len(shape)} distinct axis names for mesh {shape}, got {names}")
        device_mesh = init_device_mesh(
            device_type or _default_device_type(), shape, mesh_dim_names=names
        )
        return cls(device_mesh)

    @classmethod
    def from_spec(cls, mesh: MeshSpec, *, device_type: str | None = None) -> "ProcessMesh":
        """The live mesh for a planning ``MeshSpec`` (same shape and axis names)."""
        return cls.create(mesh.shape, axis_names=mesh.axis_names, device_type=device_type)

    # ----------------------------------------------------------------------------- queries
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    def axis_size(self, axis: int) -> int:
        return self.shape[self._check_axis(axis)]

    def group(self, axis: int) -> dist.ProcessGroup:
        return self.groups[self._check_axis(axis)]

    def group_over(self, axes: Sequence[int]) -> dist.ProcessGroup | None:
        """One process group spanning mesh ``axes`` together (this rank's slice of the mesh
        flattened over them: one collective where a chain of per-axis ones would run one after
        another), or None where the mesh cannot make one: fewer than two axes, or a mesh that
        is not the whole world (a pipeline stage's sub-mesh, whose ranks run backward at other
        times than the rest of the world, which every group's creation needs). Created at the
        first call, which every rank makes at the same point (the gradient buckets' static issue
        order), then kept."""
        axes = tuple(sorted(self._check_axis(a) for a in axes))
        names = self.device_mesh.mesh_dim_names
        if len(axes) < 2 or not names or self.num_devices != dist.get_world_size():
            return None
        if axes not in self._flat_groups:
            flat = self.device_mesh[tuple(names[a] for a in axes)]._flatten()
            self._flat_groups[axes] = flat.get_group(0)
        return self._flat_groups[axes]

    def groups_over(self, axes: Sequence[int]) -> list[dist.ProcessGroup]:
        """The groups a sum over mesh ``axes`` runs on, one after another: the group spanning
        them where the mesh forms one (``group_over``), else one per axis, in ``axes``' order."""
        spanning = self.group_over(axes) if len(axes) > 1 else None
        return [spanning] if spanning is not None else [self.group(a) for a in axes]

    def axis_coordinate(self, axis: int) -> int:
        return self.coordinate[self._check_axis(axis)]

    def _check_axis(self, axis: int) -> int:
        if not isinstance(axis, int) or not 0 <= axis < len(self.shape):
            raise ValueError(f"mesh axis {axis!r} out of range for process mesh {self.shape}")
        return axis

    def __str__(self) -> str:
        return f"ProcessMesh({'x'.join(map(str, self.shape))}, coord={self.coordinate})"

    __repr__ = __str__
