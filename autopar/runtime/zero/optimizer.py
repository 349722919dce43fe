"""``ZeroOptimizer``: the inner optimizer over the module's parameters, each ZeRO parameter
replaced by this device's piece (:mod:`autopar.runtime.zero`)."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from autopar.layout.buckets import bucket_cap_bytes
from autopar.runtime.dtensors import local_of
from autopar.runtime.local_step import stepping_locally
from autopar.runtime.parallel_module import ParallelModule
from autopar.runtime.zero.comm import GatherPlan, Scratch
from autopar.runtime.zero.pieces import Piece, piece_of

__all__ = ["ZeroOptimizer"]


class ZeroOptimizer:
    """``optimizer_class`` over the module's parameters, ZeRO parameters replaced by their pieces
    (the package docstring). ``state_dict``/``param_groups``/``zero_grad`` are the inner optimizer's."""

    def __init__(self, module: ParallelModule, optimizer_class: type, /, params: Iterable | None = None,
                 **kwargs: Any) -> None:
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
        # Gathered in buckets of the gradient buckets' cap, as the planner prices them
        # (``planner.zero_pricing.zero_gather_seconds``); laid out once, buffers kept.
        self._gather = GatherPlan(self.pieces, cap_bytes=bucket_cap_bytes())
        # ZeRO-2's send buffers borrow the gather's receive buffer in backward (comm.Scratch)
        self.scratch = Scratch(self._gather)
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
        with stepping_locally(self.optimizer):  # same values, no DTensor dispatch (runtime.local_step)
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
        one all-gather per bucket of pieces, mesh axis and dtype (:mod:`autopar.runtime.zero.comm`)."""
        self._gather.run()

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



def _swapped(params: Iterable | None, module: ParallelModule, swap: dict[int, torch.nn.Parameter]) -> list:
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
