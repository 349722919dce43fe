"""``boost`` without a data loader or meta inputs (the product notes' ``boost(model, optimizer,
criterion, lr_scheduler=...)``): the model is planned at its first forward.

A plan needs the inputs' shapes, and without a loader nothing says them before the training
loop's first ``model(batch)``. So ``boost`` returns a :class:`DeferredModule` and a
:class:`~autopar.booster.optimizer.BoostedOptimizer` that is not yet bound: the first call of the
module runs the ordinary ``boost`` with that call's arguments as the meta inputs (every rank
traces, the ranks compare fingerprints, rank 0 plans and broadcasts: every rank must make that
first call with same-shaped inputs), binds the optimizer to the built module (the rebuilt
optimizer, ZeRO pieces and loss scaler, the scheduler re-pointed) and from then on forwards to
the built module. Rank 0 says once, at ``boost``, that planning is deferred.

Before the first forward the optimizer's ``zero_grad`` is the original's (harmless: nothing has
a gradient yet) and ``step`` / the module's distributed state raise, naming the cause.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from autopar.booster.optimizer import BoostedOptimizer

__all__ = ["DeferredModule", "boost_deferred"]

_NOT_YET = ("the boosted model is planned at its first forward (boost got no dataloader or meta_inputs): "
            "call it once with a batch on every rank first")


class DeferredModule(nn.Module):
    """The boosted model until its first forward plans it; then the built module's proxy."""

    def __init__(self, build: Callable[[tuple, dict], nn.Module]) -> None:
        super().__init__()
        self._build = build
        self.module: nn.Module | None = None  # the built ParallelModule (a submodule once built)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.module is None:
            self.module = self._build(args, kwargs)
            # built in the mode the model was traced in; the mode this module was set to counts
            # (a first call after ``.eval()`` evaluates)
            self.module.train(self.training)
        return self.module(*args, **kwargs)

    def _built(self) -> nn.Module:
        if self.module is None:
            raise RuntimeError(_NOT_YET)
        return self.module

    # The ParallelModule protocol, delegated (the Booster's checkpoints and clipping use it).
    @property
    def plan(self) -> Any:
        return self._built().plan

    @property
    def device_mesh(self) -> Any:
        return self._built().device_mesh

    def parameters_by_fqn(self) -> dict[str, nn.Parameter]:
        return self._built().parameters_by_fqn()

    def optimizer(self, optimizer_class: type, /, params: Iterable | None = None, **kwargs: Any) -> Any:
        return self._built().optimizer(optimizer_class, params, **kwargs)

    def zero_parameters(self) -> list:
        return self._built().zero_parameters()

    def attach_zero(self, optimizer: Any) -> None:
        self._built().attach_zero(optimizer)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        parameters: Iterable[torch.Tensor] | None = None) -> torch.Tensor:
        return self._built().clip_grad_norm_(max_norm, norm_type, parameters=parameters)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self._built().full_state_dict()

    def full_gradients(self) -> dict[str, torch.Tensor | None]:
        return self._built().full_gradients()

    def full_state_entries(self) -> list:
        return self._built().full_state_entries()

    def full_state_items(self) -> Iterator:
        return self._built().full_state_items()

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> None:
        self._built().load_full_state_dict(state_dict, strict=strict)

    def __getattr__(self, name: str) -> Any:
        try:  # nn.Module's own (parameters, buffers, submodules) first
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__["_modules"].get("module")
            if module is None:
                raise
            return getattr(module, name)  # the built module's other attributes (local_inputs, ...)


class _Unbound(BoostedOptimizer):
    """The BoostedOptimizer before the first forward: bound in place by :func:`boost_deferred`."""

    def step(self, closure: Any = None) -> Any:
        raise RuntimeError(_NOT_YET)

    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        raise RuntimeError(_NOT_YET)

    def clip_grad_by_value(self, clip_value: float) -> None:
        raise RuntimeError(_NOT_YET)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)  # the original's: no gradients exist yet


def boost_deferred(booster: Any, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                   criterion: Callable | None, lr_scheduler: Any) -> tuple:
    """``boost``'s result for a model planned at its first forward (see the module docstring).
    ``booster``: the calling ``Booster`` (not imported here: booster.py imports this module)."""
    if booster.plugin.pipeline is not None:
        raise ValueError("a pipelined plan (pp_size) is made before training: give boost a dataloader "
                         "(from plugin.prepare_dataloader) or meta_inputs")
    unbound = None if optimizer is None else _Unbound(optimizer, None, max_norm=booster.plugin.max_norm)

    def build(args: tuple, kwargs: dict) -> nn.Module:
        if args and kwargs:
            raise ValueError("the first forward of a boosted model planned at its first forward takes its inputs "
                             "either all positional or all by keyword (they become the plan's meta inputs)")
        meta_inputs = dict(kwargs) if kwargs else tuple(args)
        module, bopt, *_ = booster.boost(model, optimizer, criterion, None, lr_scheduler, meta_inputs=meta_inputs)
        if unbound is not None:  # bind in place: the user holds this object
            unbound.__dict__.update(bopt.__dict__)
            unbound.__class__ = BoostedOptimizer
        booster._origins[deferred] = booster._origins[module]
        return module

    deferred = DeferredModule(build).train(model.training)  # the mode the model will be traced in
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print("[autopar] boost: no dataloader or meta_inputs, so the model is planned at its first forward "
              "from that batch's shapes (every rank must call it with same-shaped inputs)", flush=True)
    return deferred, unbound, criterion, None, lr_scheduler
