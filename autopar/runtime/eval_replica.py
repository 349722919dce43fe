"""Evaluation mode of a module traced in training mode: a gathered replica of the original model.

A module's emitted graph is the one traced in training mode (a training batch norm normalises by
the batch and writes its running statistics, dropout draws masks), so ``model.eval()`` cannot
change what that graph computes. Evaluation instead runs the ORIGINAL model's code, in eval mode,
on every rank, with the full parameters and buffers gathered from the shards (the
``full_state_dict`` machinery): batch norms use the running statistics the training steps
updated, dropout is off, nothing is drawn and no gradient is tracked -- what one device computes
after ``model.eval()``, whatever the plan.

- The structure: a deep copy of the model made at build (``EvalReplica.of``), whose parameters
  and buffers carried by the trace are ``meta`` tensors (no memory; the gathered values replace
  them through ``torch.func.functional_call``). The ones the trace does not carry (never read in
  training, so never trained) keep their values.
- Freshness: the gathered state lives from the first eval call to the next ``.train()`` (the
  modules' ``train`` calls ``forget``: training never holds the copy, and every validation pass
  after training starts from a fresh gather). Within a pass, each call compares the id and
  ``_version`` of every parameter and buffer and of its local tensor with what it saw at the
  gather -- a torch optimizer's in-place step bumps the DTensor's version, ZeRO's and the local
  step's and ``load_full_state_dict``'s writes the local tensor's, a replaced tensor has another
  id -- and one all-reduce of that verdict makes every rank gather again together (an empty
  shard need not see its version move). Writes through ``.data`` escape version counters: made
  in evaluation mode, they are seen after ``.train()`` and ``.eval()`` again. A module in the
  chunk runtime (``module.gemini``: its optimizer writes chunks, not the parameters' tensors)
  gathers at every eval call.
- Cost: the full parameters and buffers on every rank, logged once by rank 0 (``logging`` at
  INFO, this module's logger); more than the plan's per-device budget (``Plan.budget_bytes``, else the mesh's memory
  capacity) is refused with a ``ValueError`` naming it.
- Random ops that still draw in eval mode (a ``torch.rand`` the model calls whatever its mode)
  draw from torch's generator forked and seeded alike on every rank (autopar's seed and the eval
  call's count), so ranks agree and training's draws are left alone.

Not covered, refused with ``NotImplementedError``: a mixed-precision plan (its graph computes by
the precision pass's policy, the replica would compute in fp32) and a model whose structure
cannot be deep-copied.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from autopar.plans import Plan
from autopar.runtime.dtensors import local_of
from autopar.runtime.modes import TracedMode
from autopar.strategies import rng
from autopar.tracer.graph import BUFFER, PARAMETER, TracedGraph

__all__ = ["EvalReplica", "mesh_device"]

log = logging.getLogger(__name__)


class EvalReplica:
    """The eval-mode forward of one module (``AutoParallelModule`` or ``PipelineModule``)."""

    def __init__(self, skeleton: nn.Module | None, *, model_name: str, full_bytes: int,
                 refusal: str | None = None) -> None:
        self._skeleton = skeleton  # a plain attribute of its owner: never one of its submodules
        self._model_name = model_name
        self.full_bytes = full_bytes  # the full parameters and buffers the trace carries
        self._refusal = refusal  # why evaluation cannot run on a replica, if it cannot
        self._state: dict[str, torch.Tensor] | None = None
        self._seen: tuple | None = None
        self._calls = 0
        self._logged = False
        self._placed = False  # the tensors the trace does not carry moved to the module's device

    @classmethod
    def of(cls, model: nn.Module, traced: TracedGraph, *, mode: TracedMode) -> "EvalReplica | None":
        """The replica of ``model`` (as traced into ``traced``), its structure copied now; None
        when no eval call needs one (``mode``: traced in evaluation mode, or nothing in the model
        tells the modes apart and its one graph serves both)."""
        if not (mode.training and mode.sensitive is not None):
            return None
        carried = [p for p in traced.placeholders if p.kind in (PARAMETER, BUFFER)]
        full_bytes = sum(p.numel * (p.dtype.itemsize if p.dtype is not None else 0) for p in carried)
        refusal = None
        if traced.precision != "fp32":
            refusal = (f"the plan computes in {traced.precision} by autopar's precision pass, which an eval-mode "
                       f"replica of the model cannot reproduce")
            return cls(None, model_name=traced.model_name, full_bytes=full_bytes, refusal=refusal)
        try:
            skeleton = _skeleton(model, {a for p in carried for a in p.aliases})
        except Exception as exc:  # noqa: BLE001 -- said at the first eval call, not at build
            return cls(None, model_name=traced.model_name, full_bytes=full_bytes,
                       refusal=f"its structure could not be copied for evaluation ({type(exc).__name__}: {exc})")
        return cls(skeleton, model_name=traced.model_name, full_bytes=full_bytes)

    def run(self, owner: nn.Module, args: tuple, kwargs: dict, *, plan: Plan, device: torch.device,
            gather: Callable[[], dict[str, torch.Tensor]], sensitive: str, always: bool = False) -> Any:
        """The model's eval-mode outputs for ``args``/``kwargs`` (full inputs) on every rank.
        ``gather``: original FQN -> full tensor of every parameter and buffer (a collective);
        ``always``: gather at every call (updates the version check cannot see)."""
        if self._refusal is not None:
            raise NotImplementedError(
                f"{self._model_name} was traced and planned in training mode, and its {sensitive} behaves "
                f"differently in evaluation mode; evaluation runs on a gathered eval-mode replica of the model, "
                f"but {self._refusal}. Autoparallelize the model in evaluation mode (model.eval() before "
                f"autoparallelize, then load_full_state_dict from this one)")
        self._check_budget(plan)
        device = torch.device(device)
        if always or self._stale(owner, device):
            self._state = None  # the old copy goes before the new one is gathered
            self._state = gather()
            self._announce()
        if not self._placed:
            _place(self._skeleton, device)
            self._placed = True
        self._calls += 1
        with torch.no_grad(), _alike_draws(device, self._calls):
            return functional_call(self._skeleton, self._state, args, kwargs, tie_weights=True, strict=False)

    def _check_budget(self, plan: Plan) -> None:
        budget, what = ((plan.budget_bytes, "the plan's memory budget (Plan.budget_bytes)")
                        if plan.budget_bytes is not None else
                        (plan.mesh.mem_capacity, "the device memory capacity of the plan's mesh"))
        if self.full_bytes > budget:
            raise ValueError(
                f"{self._model_name} in evaluation mode runs on a replica of the whole model on every rank: its "
                f"full parameters and buffers alone take {_gib(self.full_bytes)}, more than {what}, {_gib(budget)} "
                f"per device. To evaluate sharded, autoparallelize the model in evaluation mode (model.eval() "
                f"before autoparallelize: a plan of its own) and load_full_state_dict from this one into it")

    def forget(self) -> None:
        """Drop the gathered state (the module goes back to training)."""
        self._state, self._seen = None, None

    def _stale(self, owner: nn.Module, device: torch.device) -> bool:
        """Whether any rank has no gathered state or saw its parameters or buffers change since
        the last gather (a collective)."""
        seen = tuple((id(t), t._version, id(local), local._version)
                     for t in _tensors(owner) for local in (local_of(t),))
        flag = torch.tensor([int(self._state is None or seen != self._seen)], device=device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self._seen = seen
        return bool(flag.item())

    def _announce(self) -> None:
        if not self._logged:  # once, on rank 0
            self._logged = True
            if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
                return
            log.info("%s: evaluation mode runs on a gathered eval-mode replica of the model on every rank "
                     "(full parameters and buffers: %s, gathered again after each update)",
                     self._model_name, _gib(self.full_bytes))


def _tensors(owner: nn.Module):
    yield from owner.parameters()
    yield from owner.buffers()


def _skeleton(model: nn.Module, carried: set[str]) -> nn.Module:
    """An eval-mode deep copy of ``model`` whose tensors named in ``carried`` are ``meta``
    stand-ins (the gathered values replace them at each call; copying them would cost the
    model's memory once more)."""
    memo: dict[int, Any] = {}
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for name, t in named:
        if name in carried and id(t) not in memo:
            stand_in = torch.empty(t.shape, dtype=t.dtype, device="meta")
            memo[id(t)] = nn.Parameter(stand_in, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) \
                else stand_in
    return copy.deepcopy(model, memo).eval()


def _place(skeleton: nn.Module, device: torch.device) -> None:
    """Move the skeleton's real tensors (those the trace does not carry: never trained) to
    ``device``, where the gathered ones are; the meta stand-ins stay."""
    for module in skeleton.modules():
        for table in (module._parameters, module._buffers):
            for key, t in table.items():
                if t is None or t.is_meta or t.device == device:
                    continue
                moved = t.detach().to(device)
                table[key] = nn.Parameter(moved, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) \
                    else moved


class _alike_draws:
    """torch's generator forked and seeded alike on every rank for one eval call."""

    def __init__(self, device: torch.device, call: int) -> None:
        self._fork = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
        self._device = device
        self._seed = (rng.initial_seed() * 1_000_003 + call) % (1 << 63)

    def __enter__(self) -> None:
        self._fork.__enter__()
        torch.random.default_generator.manual_seed(self._seed)
        if self._device.type == "cuda":  # only this device's generator: the forked one
            with torch.cuda.device(self._device):
                torch.cuda.manual_seed(self._seed)

    def __exit__(self, *exc: Any) -> None:
        self._fork.__exit__(*exc)


def mesh_device(device_mesh: Any) -> torch.device:
    """This rank's device of ``device_mesh`` (where a flag for its collectives lives)."""
    if device_mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_mesh.device_type)


def _gib(n: int) -> str:
    return f"{n} bytes ({n / 2**30:.3f} GiB)"
