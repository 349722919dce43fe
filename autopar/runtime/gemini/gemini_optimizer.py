"""``GeminiOptimizer``: Adam/AdamW whose fp32 master weights and moments live in the chunks.

A ``torch.optim.Optimizer`` over the module's DTensor parameters (so param groups, lr
schedulers, ``clip_grad_norm_`` over ``.grad`` and ``state_dict`` work as usual). ``step``:

1. host-home payloads still on the device are evicted (they go stale with the update);
2. per chunk, each parameter's ``.grad`` (a view of the chunk's gradient buffer, ``grads``) is
   read where it is when the optimizer state is on the same tier, else copied into the chunk's
   fp32 landing buffer on the optimizer tier;
3. each parameter's slice of the master is updated in place by ``cpu_optim.adam_update_``
   (torch's Adam/AdamW math, on the host for host-tier chunks, on the device otherwise) with its
   group's hyper-parameters;
4. the master is copied (cast) into the payload's home buffer, which the parameters view,
   unless it is that buffer (fp32 on one tier).

``zero_grad`` frees the gradient chunks no ``.grad`` refers to any more.

Each parameter is updated on its piece of the chunk's flat buffers (``Chunk.piece``: all of it,
or for a sharded chunk the part of it in this rank's shard; Adam is elementwise, so the pieces
together are the whole update). A sharded chunk's gradient is its reduce-scattered shard
(``grads``); a ``.grad`` set on one of its parameters from outside (torch's checkpoint helpers
set zeros to initialise state) is used instead, sliced to the piece.

``state[p]`` holds ``step`` and DTensor views of the chunk's moments, so ``state_dict`` and
``torch.distributed.checkpoint`` see the usual Adam state; ``load_state_dict`` copies loaded
moments back into the chunks (and masters are re-read from the parameters). A sharded chunk's
parameters keep only ``step`` in ``state``: ``state_dict`` all-gathers their moments over the
chunk's data-parallel group (a collective: every rank must call it) and ``load_state_dict``
keeps this rank's pieces of what it is given. A ZeRO chunk (``Chunk.zero``: the plan's ZeRO-1/2)
is stepped like a sharded one on its master shard (its gradient is whole under ZeRO-1, a shard
under ZeRO-2), and its whole payload is then all-gathered from every rank's updated master
(``ChunkManager.gather_payload``): every rank must call ``step``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from autopar.runtime.dtensors import local_of
from autopar.runtime.gemini.cpu_optim import adam_update_
from autopar.runtime.gemini.shards import gather_into

__all__ = ["GeminiOptimizer"]


class GeminiOptimizer(torch.optim.Optimizer):
    def __init__(self, params, *, gemini, kind: str = "adamw", lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        if not 0.0 <= lr or not 0.0 <= eps or not all(0.0 <= b < 1.0 for b in betas) or weight_decay < 0:
            raise ValueError(f"invalid Adam hyper-parameters: lr={lr}, betas={betas}, eps={eps}, "
                             f"weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.gemini = gemini
        self.kind = kind
        self._name_of = {id(p): name for name, p in gemini.manager.params.items()}
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) not in self._name_of:
                    raise ValueError(f"GeminiOptimizer: a parameter of shape {tuple(p.shape)} is not in the "
                                     f"module's chunks")

    def _views(self, p) -> tuple:
        name = self._name_of[id(p)]
        chunk = self.gemini.manager.chunk_of[name]
        return name, chunk

    def _init_state(self, p) -> dict:
        state = self.state[p]
        if not state:
            name, chunk = self._views(p)
            state["step"] = torch.tensor(0.0)
            lo, hi, _, _ = chunk.piece(name)
            for key in ("exp_avg", "exp_avg_sq"):  # fresh state: the chunk's slice may hold an old one's
                getattr(chunk, key)[lo:hi].zero_()
                if not (chunk.sharded or chunk.zero):
                    state[key] = _wrap(chunk.view(getattr(chunk, key), name), p)
        return state

    def _has_grad(self, chunk, name: str, p) -> bool:
        return p.grad is not None or (chunk.scatters and name in chunk.grad_names)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("GeminiOptimizer.step does not take a closure")
        manager = self.gemini.manager
        self.gemini.before_step()
        group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        for chunk in manager.chunks:
            members = [(s, manager.params[s.name]) for s in chunk.slots]
            members = [(s, p) for s, p in members if id(p) in group_of and self._has_grad(chunk, s.name, p)]
            if not members:
                continue
            tier_device = manager._tier_device(chunk.optim_tier)
            home = manager.home_buf(chunk)
            for s, p in members:
                g = group_of[id(p)]
                state = self._init_state(p)
                state["step"] += 1
                lo, hi, plo, phi = chunk.piece(s.name)
                if lo == hi:  # none of it in this rank's shard
                    continue
                beta1, beta2 = g["betas"]
                adam_update_(chunk.master[lo:hi], self._grad_on(chunk, s.name, p, tier_device),
                             chunk.exp_avg[lo:hi], chunk.exp_avg_sq[lo:hi],
                             step=int(state["step"].item()), lr=g["lr"], beta1=beta1, beta2=beta2, eps=g["eps"],
                             weight_decay=g["weight_decay"], kind=self.kind)
                if chunk.master is not home and not chunk.zero:
                    home[lo:hi].copy_(chunk.master[lo:hi], non_blocking=False)
            if chunk.zero:  # the whole payload from every rank's updated shard
                manager.gather_payload(chunk)
            manager.mark_synced(chunk)
        return None

    def sharded_grads(self) -> list[torch.Tensor]:
        """The gradients of this optimizer's parameters that are not ``.grad``: this rank's
        piece of each sharded (or ZeRO-2) chunk's gradient shard (views: unscaling or clipping
        them in place changes what ``step`` reads). Each element of such a gradient is held by
        exactly one rank of the mesh (the chunk's data-parallel group splits what the plan
        keeps replicated; the other axes split it already), so a norm over them is a sum of
        every rank's pieces. What the fp16 scaler unscales and clipping by norm counts."""
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                name, chunk = self._views(p)
                if chunk.scatters and p.grad is None and chunk.grad is not None and name in chunk.grad_names:
                    lo, hi, _, _ = chunk.piece(name)
                    if lo < hi:
                        out.append(chunk.grad[lo:hi])
        return out

    @staticmethod
    def _grad_on(chunk, name: str, p, device: torch.device) -> torch.Tensor:
        """``p``'s gradient piece (fp32) where its optimizer state is: the gradient chunk itself
        when that is there, else copied into the landing buffer (host-link traffic)."""
        lo, hi, plo, phi = chunk.piece(name)
        if chunk.scatters and p.grad is None:
            grad = chunk.grad[lo:hi]
        else:
            grad = local_of(p.grad).reshape(-1)[plo:phi]
        if grad.device == device and grad.dtype == torch.float32:
            return grad
        if chunk.landing is None:  # a .grad set from outside onto another tier
            return grad.to(device=device, dtype=torch.float32)
        view = chunk.landing[lo:hi]
        view.copy_(grad)
        return view

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self.gemini.manager.grads.free_unused()
        self.gemini.manager.grads.clear_sharded(set_to_none=set_to_none)

    @torch.no_grad()
    def state_dict(self) -> dict:
        """torch's, with the moments of sharded chunks' parameters gathered whole (every rank
        must call: one all-gather per moment and sharded chunk that has state)."""
        out = super().state_dict()
        manager = self.gemini.manager
        index, start = {}, 0  # torch's numbering of the parameters in ``state_dict``
        for group in self.param_groups:
            for i, p in enumerate(group["params"], start):
                index.setdefault(id(p), i)
            start += len(group["params"])
        for chunk in manager.chunks:
            params = [(s.name, manager.params[s.name]) for s in chunk.slots]
            params = [(name, p) for name, p in params if p in self.state and id(p) in index]
            if not (chunk.sharded or chunk.zero) or not params:
                continue
            for key in ("exp_avg", "exp_avg_sq"):
                shard = getattr(chunk, key)
                whole = torch.empty(chunk.padded_elems, dtype=shard.dtype, device=manager.device)
                gather_into(whole, shard.to(manager.device), chunk, manager.pmesh)
                for name, p in params:
                    entry = out["state"][index[id(p)]] = dict(out["state"][index[id(p)]])
                    entry[key] = _wrap(chunk.view(whole, name).to(shard.device), p)
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        manager = self.gemini.manager
        with torch.no_grad():
            for p, state in list(self.state.items()):
                name, chunk = self._views(p)
                lo, hi, plo, phi = chunk.piece(name)
                for key in ("exp_avg", "exp_avg_sq"):
                    if key not in state:
                        continue
                    if chunk.sharded or chunk.zero:  # this rank's piece; the state keeps only ``step``
                        getattr(chunk, key)[lo:hi].copy_(local_of(state.pop(key)).reshape(-1)[plo:phi])
                    else:
                        view = chunk.view(getattr(chunk, key), name)
                        view.copy_(local_of(state[key]))
                        state[key] = _wrap(view, p)
                if "step" in state and not isinstance(state["step"], torch.Tensor):
                    state["step"] = torch.tensor(float(state["step"]))
            self.gemini.reload_masters()
        assert manager is self.gemini.manager


def _wrap(view: torch.Tensor, p: Any):
    if isinstance(p, DTensor):
        return DTensor.from_local(view, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())
    return view
