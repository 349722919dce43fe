"""Whole-model state of a ``PipelineModule``: every rank sees full tensors, whichever stage holds them.

A parameter lives only on the pipeline ranks whose stages read it, sharded over each stage's
sub-mesh. Gathering one means: its holders at the lowest such pipeline rank (the owner) gather it
over their sub-mesh, then the owner broadcasts it over the pipeline axis (a flag first, so a
gradient that is None on the owner stays None everywhere). Loading is local: every rank receives
the same full state dict and slices what its stages hold (a tied weight's copies on several
pipeline ranks all get the same value).

The streaming pair ``full_state_entries`` / ``full_state_items`` has ``AutoParallelModule``'s
meaning, so ``Booster.save_model`` writes a pipelined model one shard file at a time.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
import torch.distributed as dist

from autopar.runtime.dtensors import local_of
from autopar.runtime.module import _snapshot, collect_full_state, load_full_tensors
from autopar.tracer.graph import BUFFER, PARAMETER

__all__ = ["PipelineState"]


class PipelineState:
    """Mixed into ``PipelineModule``; uses its ``_traced``, ``_placeholders``, ``_holders``,
    ``_specs``, ``_dtensors``, ``_state_keys``, ``_device``, ``pmesh``, ``pp_group``, ``pp_rank``."""

    # ------------------------------------------------------------------------- one tensor
    def _gather_one(self, name: str, value_of: Callable[[str], torch.Tensor | None]) -> torch.Tensor | None:
        """The full tensor ``value_of(name)`` (this rank's local piece, or None) on every rank.
        Every rank calls, for the same names in the same order."""
        owner = min(self._holders[name])
        mine = None
        if self.pp_rank == owner:  # the owner's whole sub-mesh gathers together (same pipeline rank)
            local = value_of(name)
            mine = None if local is None else _snapshot(local.detach(), self._specs[name], self.pmesh)
        src = dist.get_global_rank(self.pp_group, owner)
        flag = torch.tensor([int(mine is not None)], device=self._device)
        dist.broadcast(flag, src=src, group=self.pp_group)
        if not flag.item():
            return None
        ph = self._placeholders[name]
        value = mine if self.pp_rank == owner else torch.empty(ph.shape, dtype=ph.dtype, device=self._device)
        dist.broadcast(value, src=src, group=self.pp_group)
        return value

    def _held(self, kinds: tuple) -> list[str]:
        return [p.name for p in self._traced.placeholders if p.kind in kinds and p.name in self._holders]

    def _gathered(self, kinds: tuple, value_of) -> dict[str, torch.Tensor | None]:
        return {name: self._gather_one(name, value_of) for name in self._held(kinds)}

    def _local(self, name: str) -> torch.Tensor:
        return local_of(self._dtensors[name])

    # ------------------------------------------------------------------------- state dict
    def _state_order(self) -> list[tuple[str, tuple[str, ...]]]:
        """(placeholder name, its state-dict names in state-dict order) of every parameter and
        persistent buffer, ordered by the state-dict position of the first name."""
        pos = {k: i for i, k in enumerate(self._state_keys)}
        out = []
        for name in self._held((PARAMETER, BUFFER)):
            names = tuple(sorted((a for a in self._placeholders[name].aliases if a in pos), key=pos.__getitem__))
            if names:
                out.append((name, names))
        return sorted(out, key=lambda item: pos[item[1][0]])

    def full_state_entries(self) -> list[tuple[tuple[str, ...], torch.Size, torch.dtype]]:
        """(state-dict names, full shape, dtype) per parameter and buffer, tied weights once (as
        ``AutoParallelModule.full_state_entries``). No collective: every rank knows the plan."""
        return [(names, torch.Size(self._placeholders[name].shape), self._placeholders[name].dtype)
                for name, names in self._state_order()]

    def full_state_items(self) -> Iterator[tuple[tuple[str, ...], torch.Tensor]]:
        """Each parameter and buffer gathered whole, one at a time, in ``full_state_entries``
        order, on every rank (every rank must consume all of it: collectives per tensor)."""
        for name, names in self._state_order():
            yield names, self._gather_one(name, self._local)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Original state-dict names (tied aliases included) -> full tensors, on every rank."""
        return collect_full_state(self.full_state_items(), self._state_keys)

    @torch.no_grad()
    def _full_values_by_fqn(self) -> dict[str, torch.Tensor]:
        """Original FQN (every alias) -> full tensor of every parameter and buffer, non-persistent
        buffers included (what the eval replica runs on), on every rank."""
        values = self._gathered((PARAMETER, BUFFER), self._local)
        return {alias: value for name, value in values.items() if value is not None
                for alias in self._placeholders[name].aliases}

    @torch.no_grad()
    def full_gradients(self) -> dict[str, torch.Tensor | None]:
        """Parameter FQN (tied aliases included) -> full gradient or None, on every rank."""
        def grad_of(name: str) -> torch.Tensor | None:
            grad = self._dtensors[name].grad
            return None if grad is None else local_of(grad)

        grads = self._gathered((PARAMETER,), grad_of)
        return {alias: grads[name] for name in grads for alias in self._placeholders[name].aliases}

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> None:
        """Copy full tensors (original names; a tied weight under any of its names) into the
        pieces this rank's stages hold. No collective. ``strict``: every parameter and persistent
        buffer of the model must be there, and nothing else."""
        entries = ((ph, self._local(ph.name) if ph.name in self._dtensors else None, self._specs.get(ph.name))
                   for ph in self._traced.placeholders if ph.kind in (PARAMETER, BUFFER))
        load_full_tensors(entries, state_dict, state_keys=self._state_keys, pmesh=self.pmesh, strict=strict)

