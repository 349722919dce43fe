"""Local parameter and buffer shards for one rank, from real weights or from a model on ``meta``.

``local_shards(model, traced, specs, pmesh, device=..., seed=0, init_weights=True)`` returns the
local piece of every parameter, buffer and lifted constant placeholder under its layout, keyed
by placeholder name (parameters as ``nn.Parameter`` with the original ``requires_grad``).

- A tensor with real data is sliced (``TensorSpec.local_index`` at this rank's coordinate:
  a segmented dim takes this rank's piece of every segment).
- A tensor on ``meta`` is initialised the way the model would initialise it, one group at a time,
  so no rank ever holds the whole parameter set (a model on meta is never materialised whole):

  1. a dry run on ``meta`` calls every module's initialiser -- ``reset_parameters()`` if it has
     one, then the enclosing Hugging Face model's ``_init_weights(module)`` -- children before
     parents (the order of HF's ``initialize_weights``), recording which tensors each call
     writes in place. A parent's initialiser may overwrite a child's tensor (GPT-2 rescales
     ``c_proj``); the LAST writer decides the value;
  2. for each writer, only the tensors it writes last are allocated (full size, on CPU), the
     RNG is seeded from ``seed`` and the module path (so every rank draws the same values,
     replicated shards agree), the initialiser runs (writes to tensors still on meta are
     no-ops), the local shards are sliced off and the full tensors freed.

  A tied parameter is one tensor; its last writer initialises it. A meta tensor that no
  initialiser writes is an error naming it; with ``init_weights=False`` shards are allocated
  uninitialised (zeros), to be filled by ``load_full_state_dict``.

``MaterializeStats.peak_bytes`` is the largest number of full-tensor bytes held at once.
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from autopar.plans import TableOwner
from autopar.runtime import table_wise
from autopar.runtime.process_mesh import ProcessMesh
from autopar.layout.placement import TensorSpec
from autopar.strategies.fused import take_local
from autopar.tracer.graph import PARAMETER, TracedGraph

__all__ = ["local_shards", "slice_local", "MaterializeStats"]


@dataclass
class MaterializeStats:
    peak_bytes: int = 0  # largest full-size bytes allocated at once while initialising
    initialised: int = 0  # tensors initialised from meta
    sliced: int = 0  # tensors sliced from real data


def slice_local(full: torch.Tensor, spec: TensorSpec, pmesh: ProcessMesh) -> torch.Tensor:
    """This rank's piece of ``full`` under ``spec`` (a fresh contiguous tensor; no ``P``)."""
    if spec.has_partial():
        raise ValueError(f"a value at rest cannot have a partial layout: {spec}")
    return take_local(full.detach(), spec, pmesh.shape, pmesh.coordinate)


def local_shards(model: nn.Module, traced: TracedGraph, specs: dict[str, TensorSpec], pmesh: ProcessMesh, *,
                 device: torch.device, seed: int = 0, init_weights: bool = True,
                 owners: dict[str, TableOwner] | None = None
                 ) -> tuple[dict[str, torch.Tensor], MaterializeStats]:
    """``owners``: the plan's table-wise tables (``runtime.table_wise``), whole on their owner."""
    stats = MaterializeStats()
    originals = _original_tensors(model, traced, specs)
    owners = owners or {}

    def piece(name: str, full: torch.Tensor) -> torch.Tensor:
        if name in owners:
            return table_wise.cut(full, specs[name], owners[name], pmesh)
        return slice_local(full, specs[name], pmesh)

    out: dict[str, torch.Tensor] = {}
    meta = {name: t for name, t in originals.items() if t.device.type == "meta"}
    for name, tensor in originals.items():
        if name not in meta:
            out[name] = piece(name, tensor).to(device)
            stats.sliced += 1
    if meta:
        if init_weights:
            out.update(_init_from_meta(model, traced, meta, piece, device, seed, stats))
        else:
            for name, t in meta.items():
                shape = piece(name, torch.empty(t.shape, dtype=t.dtype, device="meta")).shape
                out[name] = torch.zeros(shape, dtype=t.dtype, device=device)
    by_name = {p.name: p for p in traced.placeholders}
    for name in list(out):
        ph = by_name[name]
        if ph.kind == PARAMETER:
            out[name] = nn.Parameter(out[name], requires_grad=bool(originals[name].requires_grad))
    return out, stats


def _original_tensors(model: nn.Module, traced: TracedGraph, specs: dict[str, TensorSpec]) -> dict[str, torch.Tensor]:
    state = {**dict(model.named_parameters(remove_duplicate=False)),
             **dict(model.named_buffers(remove_duplicate=False))}
    out = {}
    for ph in traced.placeholders:
        if ph.name not in specs:
            continue
        if ph.fqn in state:
            out[ph.name] = state[ph.fqn]
        elif ph.fqn in traced.constants and isinstance(traced.constants[ph.fqn], torch.Tensor):
            out[ph.name] = traced.constants[ph.fqn]
        else:
            raise ValueError(f"{ph.kind} {ph.fqn!r} (placeholder {ph.name!r}) is not in the model")
    return out


# --------------------------------------------------------------------------- meta initialisation
def _initialiser(model: nn.Module) -> Callable[[str, nn.Module], None]:
    """fn(path, module): the module's own reset, then the enclosing HF model's _init_weights."""
    modules = dict(model.named_modules(remove_duplicate=False))

    def hf_owner(path: str) -> Any:
        parts = path.split(".") if path else []
        for k in range(len(parts), -1, -1):
            m = modules.get(".".join(parts[:k]))
            if m is not None and hasattr(m, "_init_weights") and hasattr(m, "config"):
                return m
        return None

    def init(path: str, module: nn.Module) -> None:
        owns = any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))
        with torch.no_grad():
            if owns and callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
            owner = hf_owner(path)
            if owner is not None:
                owner._init_weights(module)

    return init


def _post_order(model: nn.Module) -> list[tuple[str, nn.Module]]:
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def visit(path: str, module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        for name, child in module.named_children():
            visit(f"{path}.{name}" if path else name, child)
        out.append((path, module))

    visit("", model)
    return out


def _root(t: torch.Tensor) -> torch.Tensor:
    while getattr(t, "_base", None) is not None:
        t = t._base
    return t


_IN_PLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__"}


class _WriteRecorder(TorchFunctionMode):
    """Records the root tensor of every in-place call (``normal_``, ``copy_``, ``zero_`` ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        kwargs = kwargs or {}
        in_place = (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_DUNDERS
        # torch.nn.init functions pass their tensor by keyword (``tensor=``).
        target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
        if in_place and isinstance(target, torch.Tensor):
            self.written.append(id(_root(target)))
        return func(*args, **kwargs)


def _init_from_meta(model, traced, meta, piece, device, seed, stats) -> dict[str, torch.Tensor]:
    init = _initialiser(model)
    order = _post_order(model)
    by_id = {id(t): name for name, t in meta.items()}
    last_writer: dict[str, int] = {}
    for k, (path, module) in enumerate(order):
        recorder = _WriteRecorder()
        with recorder:
            init(path, module)
        for tid in recorder.written:
            if tid in by_id:
                last_writer[by_id[tid]] = k
    fqn = {p.name: p.fqn for p in traced.placeholders}
    missing = sorted(fqn[n] for n in meta if n not in last_writer)
    if missing:
        raise ValueError(
            f"cannot initialise {', '.join(missing)} of a model on meta: no reset_parameters() or "
            f"_init_weights() writes them; pass init_weights=False and load_full_state_dict(), or "
            f"build the model with real weights")
    groups: dict[int, list[str]] = defaultdict(list)
    for name, k in last_writer.items():
        groups[k].append(name)
    owners = _owner_slots(model, meta)
    out = {}
    for k in sorted(groups):
        path, module = order[k]
        out.update(_init_group(path, module, groups[k], init, meta, owners, piece, device, seed, stats))
    return out


def _owner_slots(model: nn.Module, meta: dict[str, torch.Tensor]) -> dict[int, list[tuple[dict, str]]]:
    """id(tensor) -> every (module._parameters or _buffers, key) that holds it (tied names)."""
    ids = {id(t) for t in meta.values()}
    slots: dict[int, list[tuple[dict, str]]] = defaultdict(list)
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for key, t in table.items():
                if t is not None and id(t) in ids:
                    slots[id(t)].append((table, key))
    return slots


def _init_group(path, module, names, init, meta, owners, piece, device, seed, stats):
    fulls, saved = {}, []
    for name in names:
        t = meta[name]
        full = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        fulls[name] = nn.Parameter(full, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else full
        for table, key in owners[id(t)]:
            saved.append((table, key, t))
            table[key] = fulls[name]
    stats.peak_bytes = max(stats.peak_bytes, sum(f.numel() * f.element_size() for f in fulls.values()))
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed((seed * 1_000_003 + zlib.crc32(path.encode())) % (2**63))
            init(path, module)
        out = {name: piece(name, full).to(device) for name, full in fulls.items()}
    finally:
        for table, key, t in saved:
            table[key] = t
    stats.initialised += len(names)
    return out
