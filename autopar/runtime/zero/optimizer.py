"""ZeRO-1/2 over the plan's replicated axes: ``model.optimizer(torch.optim.AdamW, lr=...)``.

A parameter the plan lays out replicated over some mesh axes (``dp`` devices in all) is, under
``zero_stage`` 1 or 2, updated by ONE of those devices per piece: its optimizer state lives only
for this device's piece. The piece is a DTensor **view** into the parameter's local tensor, with
the replicated axes turned into ``Shard(d)`` (``layout.placement.zero_split`` picks ``d``;
DTensor's own chunking, so uneven and nested pieces agree with ``distribute_tensor``); the inner
optimizer -- any ``torch.optim`` optimizer, or
``autopar.optim``'s layer-wise ones, which are correct on any placements -- updates it in place,
and the updated pieces are all-gathered back into the replicated parameter after the step.

- stage 1: the gradient is all-reduced as without ZeRO (``.grad`` is whole); the piece's
  gradient is a view of it. A plain optimizer over ``model.parameters()`` would still be correct
  (it just keeps all of its state).
- stage 2: data-parallel gradients are reduce-scattered in the backward pass
  (``runtime/bucketing.py``, sharded buckets) straight into the pieces; only gradient
  contributions that are not partial (an op computed whole on every device) reach ``.grad``, and
  ``step`` folds this device's part of them in. ``.grad`` of such a parameter is therefore not
  its gradient: the module refuses to run backward for an optimizer it does not know of.

Every rank must call ``step`` (it ends in collectives). The all-gathers after the step and the
ZeRO-2 reduce-scatters at the end of backward are batched: one collective per mesh axis and
dtype for all pieces (``runtime.zero_comm``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from autopar.layout.placement import TensorSpec, zero_split
from autopar.runtime.dtensors import local_of
from autopar.runtime.zero_comm import gather_pieces

__all__ = ["ZeroOptimizer", "Piece", "piece_of"]


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
        m = self.master
        return DTensor.from_local(local, m.device_mesh, m.placements, run_check=False, shape=m.shape,
                                  stride=m.stride())


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


class ZeroOptimizer:
    """``optimizer_class`` over the module's parameters, ZeRO parameters replaced by their pieces
    (module docstring). ``state_dict``/``param_groups``/``zero_grad`` are the inner optimizer's."""

    def __init__(self, module, optimizer_class: type, /, params: Iterable | None = None, **kwargs: Any) -> None:
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise ValueError(f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}")
        self.module = module
        self.pieces: list[Piece] = []
        swap: dict[int, torch.nn.Parameter] = {}
        for name, param, stage, spec in module.zero_parameters():
            piece = piece_of(name, param, stage, spec)
            if piece is not None:
                self.pieces.append(piece)
                swap[id(param)] = piece.master
        self.optimizer = optimizer_class(_swapped(params, module, swap), **kwargs)
        self._state_module: torch.nn.Module | None = None
        module.attach_zero(self)

    # ------------------------------------------------------------------------ optimizer API
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def state_module(self) -> torch.nn.Module:
        """A module whose ``named_parameters`` are the module's (same names) with each ZeRO
        parameter replaced by its piece -- the parameters the inner optimizer holds. Give it to
        ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(opt.state_module(),
        opt.optimizer)`` / ``set_optimizer_state_dict``: the state is keyed by parameter name and
        every tensor is a DTensor of the full parameter's shape, so a checkpoint reshards across
        meshes, plans and ZeRO stages like the module's own parameters do."""
        if self._state_module is None:
            piece_of_param = {id(p.param): p.master for p in self.pieces}
            root = torch.nn.Module()
            for name, param in self.module.named_parameters():
                *path, leaf = name.split(".")
                owner = root
                for part in path:
                    if not hasattr(owner, part):
                        owner.add_module(part, torch.nn.Module())
                    owner = getattr(owner, part)
                owner.register_parameter(leaf, piece_of_param.get(id(param), param))
            self._state_module = root
        return self._state_module

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for piece in self.pieces:
            piece.param.grad = None
            piece.master.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ZeroOptimizer.step does not take a closure (the module's forward is collective)")
        self.prepare_grads()
        result = self.optimizer.step()
        self.all_gather()
        return result

    @torch.no_grad()
    def prepare_grads(self) -> None:
        """Give each piece its gradient (before clipping or unscaling the inner optimizer's)."""
        for piece in self.pieces:
            self._piece_grad(piece)

    @torch.no_grad()
    def all_gather(self) -> None:
        """Every piece back into its replicated parameter (after the inner optimizer's step):
        one all-gather per mesh axis and dtype for all pieces (``runtime.zero_comm``)."""
        gather_pieces(self.pieces)

    def __repr__(self) -> str:
        stages = sorted({p.stage for p in self.pieces})
        return (f"ZeroOptimizer(ZeRO-{'/'.join(map(str, stages)) or '0'} for {len(self.pieces)} parameters, "
                f"{self.optimizer!r})")

    # ------------------------------------------------------------------------------ pieces
    def _piece_grad(self, piece: Piece) -> None:
        """The piece's gradient: a view of the whole (stage 1), or the reduce-scattered piece
        (stage 2, already in ``master.grad``) plus this piece of the non-partial contributions."""
        grad = piece.param.grad
        if piece.stage == 1:
            piece.master.grad = None if grad is None else piece.wrap(piece.local_grad_view(grad))
            return
        if grad is not None:
            extra = piece.local_grad_view(grad)
            if piece.master.grad is None:
                piece.master.grad = piece.wrap(extra.clone())
            else:
                local_of(piece.master.grad).add_(extra)
            piece.param.grad = None



def _swapped(params: Iterable | None, module, swap: dict[int, torch.nn.Parameter]) -> list:
    """``params`` (None: all of ``module``'s, in plan order; or parameters; or param-group
    dicts) with each ZeRO parameter replaced by its piece."""
    if params is None:
        return [swap.get(id(p), p) for _, p, _, _ in module.zero_parameters()]
    out = []
    for item in params:
        if isinstance(item, dict):
            out.append({**item, "params": [swap.get(id(p), p) for p in item["params"]]})
        else:
            out.append(swap.get(id(item), item))
    return out
