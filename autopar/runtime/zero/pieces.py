"""A ZeRO parameter's piece on this device: a DTensor view into the parameter's local tensor,
the replicated axes turned into ``Shard`` (:mod:`autopar.runtime.zero`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from autopar.layout.placement import TensorSpec, zero_split
from autopar.runtime.dtensors import grad_like, local_of

__all__ = ["Piece", "piece_of"]


@dataclass
class Piece:
    """One ZeRO parameter: the full DTensor ``param`` and this device's piece ``master``."""

    name: str  # placeholder name in the traced graph
    param: torch.nn.Parameter
    master: torch.nn.Parameter
    slices: tuple[slice, ...]  # the piece within the parameter's local tensor
    stage: int
    dim: int = 0  # the tensor dim the ZeRO axes split
    axes: tuple[int, ...] = ()  # the ZeRO mesh axes, in mesh order (each splits the previous block)

    def local_grad_view(self, grad: torch.Tensor) -> torch.Tensor:
        return local_of(grad)[self.slices]

    def wrap(self, local: torch.Tensor) -> DTensor:
        """``local`` (this piece's gradient) as a DTensor laid out as the piece: the piece's own
        spec reused (``dtensors.grad_like``), not ``from_local``'s autograd function, once per
        piece per step."""
        return grad_like(local, self.master)


def piece_of(name: str, param: torch.nn.Parameter, stage: int, spec: TensorSpec) -> Piece | None:
    """``param``'s piece on this device under ZeRO ``stage``, the parameter laid out ``spec``
    (``layout.placement.zero_split`` says which dim its replicated axes split; None: nothing to
    split)."""
    if not isinstance(param, DTensor) or stage == 0:
        return None
    mesh = param.device_mesh
    split = zero_split(spec, param.dim(), tuple(mesh.shape))
    if split is None:
        return None
    dim, axes = split
    placements = tuple(Shard(dim) if a in axes else p for a, p in enumerate(param.placements))
    have_shape, have_offset = compute_local_shape_and_global_offset(param.shape, mesh, param.placements)
    want_shape, want_offset = compute_local_shape_and_global_offset(param.shape, mesh, placements)
    slices = tuple(slice(w - h, w - h + n) for h, w, n in zip(have_offset, want_offset, want_shape))
    view = local_of(param).detach()[slices]
    master = DTensor.from_local(view, mesh, placements, run_check=False, shape=param.shape,
                                stride=param.stride())
    return Piece(name, param, torch.nn.Parameter(master, requires_grad=param.requires_grad), slices, stage,
                 dim=dim, axes=axes)
