"""``AutoParallelModule``: the emitted local graph as an ``nn.Module`` each rank trains.

Contract:

- ``forward`` takes the original model's inputs (positional or keyword; the FULL global batch,
  identical on every rank) and returns the original output structure (tuple, dict or HF
  ``ModelOutput``) with full, replicated values on every rank. With ``local_inputs=True``
  (see :func:`autopar.api.autoparallelize`), each rank passes only its own piece of
  every input, as laid out by ``input_specs``.
- ``parameters()`` / ``named_parameters()`` are this rank's local shards, named
  ``graph_module.<canonical FQN>``: any torch optimizer works on them. The gradient of a
  parameter arrives in the parameter's own layout, so replicated parameters receive
  identical gradients on every replica.
- ``full_state_dict()``: original FQNs (tied aliases all present, persistent buffers included)
  -> full tensors, gathered (a collective: every rank must call). ``load_full_state_dict(sd)``
  slices a full state dict into the local shards (no communication). ``full_gradients()``:
  FQN -> full gradient (or None), gathered.
- ``code`` is the emitted graph's Python code: the inserted collectives appear by name.

:func:`clip_grad_norm_` computes the true global norm over the shards.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Iterable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from autopar.plans import Plan
from autopar.runtime.collectives import gather_full
from autopar.runtime.kernels import all_reduce_axes
from autopar.runtime.materialize import slice_local
from autopar.runtime.process_mesh import ProcessMesh
from autopar.layout.placement import TensorSpec
from autopar.tracer.graph import BUFFER, INPUT, PARAMETER, TracedGraph, keyword_path

__all__ = ["AutoParallelModule", "clip_grad_norm_"]


class AutoParallelModule(nn.Module):
    def __init__(self, graph_module: fx.GraphModule, *, traced: TracedGraph, plan: Plan, pmesh: ProcessMesh,
                 specs: dict[str, TensorSpec], attr_of: dict[str, str], signature: inspect.Signature,
                 state_keys: tuple[str, ...], local_inputs: bool = False) -> None:
        super().__init__()
        self.graph_module = graph_module
        self.plan = plan
        self.pmesh = pmesh
        self.local_inputs = local_inputs
        self._traced = traced
        self._signature = signature
        self._specs = dict(specs)  # placeholder name -> layout
        self._attr_of = dict(attr_of)  # placeholder name -> graph_module attribute path
        self._placeholders = {p.name: p for p in traced.placeholders}
        self._inputs = [p for p in traced.placeholders if p.kind == INPUT]
        self._state_keys = state_keys
        self.input_specs = {p.fqn: TensorSpec.parse(plan.node(p.name).output_specs[0]) for p in self._inputs
                            if _has_decision(plan, p.name)}

    # ------------------------------------------------------------------------------ running
    @property
    def code(self) -> str:
        return self.graph_module.code

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        values = self._flat_inputs(args, kwargs)
        return self._traced.unflatten_outputs(list(self.graph_module(*values)))

    def _flat_inputs(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as err:
            raise ValueError(f"inputs do not fit {self._traced.model_name}.forward{self._signature}: {err}") from None
        leaves = {keyword_path(path): v for path, v in pytree.tree_flatten_with_path(dict(bound.arguments))[0]}
        values = []
        for p in self._inputs:
            if p.fqn not in leaves:
                raise ValueError(f"input {p.fqn!r} of {self._traced.model_name} is missing; given: {sorted(leaves)}")
            value = leaves[p.fqn]
            want = p.shape
            if self.local_inputs and p.fqn in self.input_specs:
                want = self.input_specs[p.fqn].local_shape(p.shape, self.pmesh.shape)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(want) or value.dtype != p.dtype:
                got = (f"{value.dtype}{list(value.shape)}" if isinstance(value, torch.Tensor)
                       else type(value).__name__)
                raise ValueError(f"input {p.fqn!r}: expected {p.dtype}{list(want)} "
                                 f"({'local piece' if self.local_inputs else 'global value'}), got {got}")
            values.append(value)
        return values

    # ------------------------------------------------------------------------ state and grads
    def _local(self, name: str) -> torch.Tensor:
        return self.graph_module.get_parameter(self._attr_of[name]) if self._placeholders[name].kind == PARAMETER \
            else self.graph_module.get_buffer(self._attr_of[name])

    def _tensors(self) -> Iterable[tuple[str, Any, torch.Tensor]]:
        """(placeholder name, Placeholder, local tensor) for every parameter and buffer."""
        for name, ph in self._placeholders.items():
            if ph.kind in (PARAMETER, BUFFER) and name in self._specs:
                yield name, ph, self._local(name)

    def local_specs(self) -> dict[str, TensorSpec]:
        """Canonical FQN -> layout of every parameter and buffer."""
        return {ph.fqn: self._specs[name] for name, ph, _ in self._tensors()}

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        full: dict[str, torch.Tensor] = {}
        for name, ph, local in self._tensors():
            value = _snapshot(local.detach(), self._specs[name], self.pmesh)
            for alias in ph.aliases:
                full[alias] = value
        return {k: full[k] for k in self._state_keys if k in full}

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> None:
        known = set()
        missing = []
        for name, ph, local in self._tensors():
            known.update(ph.aliases)
            key = next((a for a in ph.aliases if a in state_dict), None)
            if key is None:
                if ph.fqn in self._state_keys:
                    missing.append(ph.fqn)
                continue
            value = state_dict[key]
            if tuple(value.shape) != tuple(ph.shape):
                raise ValueError(f"load_full_state_dict: {key!r} has shape {tuple(value.shape)}, "
                                 f"the model's is {tuple(ph.shape)}")
            local.copy_(slice_local(value, self._specs[name], self.pmesh).to(local.device, local.dtype))
        unexpected = sorted(set(state_dict) - known)
        if strict and (missing or unexpected):
            raise ValueError(f"load_full_state_dict: missing keys {missing}, unexpected keys {unexpected}")

    @torch.no_grad()
    def full_gradients(self) -> dict[str, torch.Tensor | None]:
        out: dict[str, torch.Tensor | None] = {}
        for name, ph, local in self._tensors():
            if ph.kind != PARAMETER:
                continue
            grad = None if local.grad is None else _snapshot(local.grad, self._specs[name], self.pmesh)
            for alias in ph.aliases:
                out[alias] = grad
        return out

    def param_specs(self) -> list[tuple[nn.Parameter, TensorSpec]]:
        return [(local, self._specs[name]) for name, ph, local in self._tensors() if ph.kind == PARAMETER]

    def local_parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())


def _has_decision(plan: Plan, name: str) -> bool:
    try:
        plan.node(name)
    except KeyError:
        return False
    return True


# ------------------------------------------------------------------------------ clip_grad_norm_
@torch.no_grad()
def _snapshot(local: torch.Tensor, spec: TensorSpec, pmesh) -> torch.Tensor:
    """The full tensor, never the live shard: a replicated local would otherwise be returned
    itself and change under the caller with the next optimizer step."""
    value = gather_full(local, spec, pmesh)
    same = value.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
    return value.clone() if same else value


def clip_grad_norm_(model: AutoParallelModule, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of ``model``'s local shards by the TRUE global norm; returns it.

    Each shard's contribution is summed over the mesh axes that shard it and counted once over
    the axes that replicate it (replicas hold identical gradients). Every rank must call."""
    if not isinstance(model, AutoParallelModule):
        raise ValueError(f"clip_grad_norm_ needs an AutoParallelModule, got {type(model).__name__}")
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"norm_type must be positive, got {norm_type}")
    pairs = [(p, spec) for p, spec in model.param_specs() if p.grad is not None]
    device = pairs[0][0].grad.device if pairs else torch.device("cpu")
    by_axes: dict[tuple[int, ...], torch.Tensor] = {}
    for p, spec in pairs:
        axes = tuple(sorted(a for d in spec.sharded_dims() for a in spec.shard_axes(d)))
        g = p.grad.detach().float()
        part = g.abs().max() if math.isinf(norm_type) else g.abs().pow(norm_type).sum()
        acc = by_axes.get(axes)
        if acc is None:
            by_axes[axes] = part
        else:
            by_axes[axes] = torch.maximum(acc, part) if math.isinf(norm_type) else acc + part
    # One collective per distinct set of shard axes, in a fixed order on every rank.
    total = torch.zeros((), device=device)
    for axes in sorted(by_axes):
        op = "max" if math.isinf(norm_type) else "sum"
        reduced = all_reduce_axes(by_axes[axes].reshape(1), axes, model.pmesh, op)[0]
        total = torch.maximum(total, reduced) if math.isinf(norm_type) else total + reduced
    norm = total if math.isinf(norm_type) else total.pow(1.0 / norm_type)
    coef = float(max_norm) / (float(norm) + 1e-6)
    if coef < 1.0:
        for p, _ in pairs:
            p.grad.mul_(coef)
    return norm
