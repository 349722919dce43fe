"""Model, optimizer and scheduler checkpoints of a boosted model, independent of its plan.

Model: full tensors under the original names, written by rank 0: one file (``shard=False``), or
a directory in the Hugging Face layout -- ``model.safetensors``, or
``model-00001-of-0000N.safetensors`` shards with ``model.safetensors.index.json``
(``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``); ``pytorch_model*.bin``
with ``use_safetensors=False`` -- plus the model's HF config, so ``transformers``'
``from_pretrained`` loads the directory. Tied parameters are written once (under the first
name, the one ``named_parameters()`` reports; HF ties the others back). Since the tensors are
full, ``load_model`` loads them under any plan and mesh: every rank reads the files and keeps
its own slices (no communication); a plain, never boosted module copies them.

Optimizer: ``torch.distributed.checkpoint`` of ``get_optimizer_state_dict`` (keyed by parameter
name): every rank writes its shards, and the load reshards to the new module's layouts, so it
reloads under another mesh or world size; or (``shard=False``) the same state gathered into one
``torch.save`` file by rank 0, which every rank reads and slices on load. torch's and
``autopar.optim``'s optimizers keep DTensor state; an optimizer that keeps plain per-rank pieces
has them lifted to DTensors where their shape tells the layout (``_lift``), and is refused where
it does not. Scheduler: its ``state_dict()``, written by rank 0 with ``torch.save``.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from autopar.booster.optimizer import BoostedOptimizer
    from autopar.runtime.parallel_module import ParallelModule

__all__ = ["save_model", "load_model", "save_optimizer", "load_optimizer", "save_lr_scheduler",
           "load_lr_scheduler", "shard_groups"]

SAFE_INDEX, BIN_INDEX = "model.safetensors.index.json", "pytorch_model.bin.index.json"
SAFE_SINGLE, BIN_SINGLE = "model.safetensors", "pytorch_model.bin"
SCALER_KEY = "grad_scaler"
# What save_model writes (weights and indexes; the config is overwritten anyway).
_STALE = re.compile(r"(model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?|"
                    r"pytorch_model(-\d{5}-of-\d{5})?\.bin(\.index\.json)?)")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _on_rank0(write: Callable[[], None]) -> None:
    """Rank 0 runs ``write``; every rank returns once it is done, or raises its error (so a
    failed write cannot leave the other ranks waiting)."""
    error: BaseException | None = None
    if _rank() == 0:
        try:
            write()
        except Exception as exc:  # noqa: BLE001 -- re-raised on every rank below
            error = exc
    if not dist.is_initialized():
        if error is not None:
            raise error
        return
    verdict: list[Any] = [None if error is None else f"{type(error).__name__}: {error}"]
    dist.broadcast_object_list(verdict, src=0)
    if error is not None:
        raise error
    if verdict[0] is not None:
        raise RuntimeError(f"writing the checkpoint failed on rank 0: {verdict[0]}")


def _shard_name(single: str, index: int, total: int) -> str:
    stem, ext = single.rsplit(".", 1)
    return f"{stem}-{index:05d}-of-{total:05d}.{ext}"


def shard_groups(sizes: list[int], max_bytes: int) -> list[list[int]]:
    """Consecutive groups of indices into ``sizes`` (bytes) of at most ``max_bytes`` each, in
    order (a tensor larger than that is a group of its own, as in Hugging Face's sharding)."""
    groups: list[list[int]] = [[]]
    size = 0
    for i, nbytes in enumerate(sizes):
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += nbytes
    return groups


def save_model(module: ParallelModule, path: str | os.PathLike, *, config: Any = None, shard: bool = False,
               size_per_shard: float = 1024, use_safetensors: bool = False,
               architectures: list[str] | None = None, prefix: str | None = None) -> None:
    """See ``Booster.save_model``. ``config``: the original model's HF config (or None).

    Streams: the tensors of one shard file are gathered (a collective per tensor, every rank),
    rank 0 writes the file, and they are dropped before the next file's, so no rank ever holds
    more than one file's worth of full tensors (a model larger than a host's memory saves)."""
    if not isinstance(size_per_shard, (int, float)) or isinstance(size_per_shard, bool) \
            or not 0 < size_per_shard < math.inf:
        raise ValueError(f"size_per_shard must be a positive number of MiB, got {size_per_shard!r}")
    for name, value in (("shard", shard), ("use_safetensors", use_safetensors)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a bool, got {value!r}")
    if prefix is not None and (not isinstance(prefix, str) or "/" in prefix or os.sep in prefix):
        raise ValueError(f"prefix must be None or a file-name prefix without '/', got {prefix!r}")
    path = os.fspath(path)
    # shard=False names a file, unless it is a directory already (HF's single-file layout in it)
    one_file = not shard and not os.path.isdir(path) and not path.endswith(("/", os.sep))
    entries = module.full_state_entries()  # each tensor once, under its first name (tied weights)
    sizes = [math.prod(shape) * dtype.itemsize for _, shape, dtype in entries]
    groups = shard_groups(sizes, int(size_per_shard * 2**20)) if shard else [list(range(len(entries)))]
    single = _prefixed(SAFE_SINGLE if use_safetensors else BIN_SINGLE, prefix)
    files = [single] if len(groups) == 1 else [_shard_name(single, i + 1, len(groups)) for i in range(len(groups))]
    if one_file:
        path, files = os.path.dirname(os.path.abspath(path)), [os.path.basename(path)]
    writer = _Rank0Writer()
    writer.run(lambda: _start(path, files, prefix=prefix, clean=not one_file))
    items = module.full_state_items()
    for group, file in zip(groups, files):
        tensors = {}
        for _ in group:
            names, value = next(items)  # every rank gathers; only rank 0 keeps
            if writer.writing:
                tensors[names[0]] = value.contiguous()
        # bound now: the group's tensors are released (``del``) before the next group is gathered
        writer.run(functools.partial(_write, tensors, os.path.join(path, file), use_safetensors))
        del tensors

    def finish() -> None:
        if len(groups) > 1:
            index = {"metadata": {"total_size": sum(sizes)},
                     "weight_map": {entries[i][0][0]: file for group, file in zip(groups, files) for i in group}}
            index_name = _prefixed(SAFE_INDEX if use_safetensors else BIN_INDEX, prefix)
            with open(os.path.join(path, index_name), "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)
        if config is not None and not one_file:
            hf_config = config
            if architectures and not getattr(config, "architectures", None):
                hf_config = type(config).from_dict(config.to_dict())  # a copy: the user's stays as it was
                hf_config.architectures = list(architectures)
            hf_config.save_pretrained(path)

    writer.run(finish)
    writer.done()  # the files exist for every rank once save_model returns


def _prefixed(name: str, prefix: str | None) -> str:
    return f"{prefix}-{name}" if prefix else name


def _start(path: str, files: list[str], *, prefix: str | None, clean: bool) -> None:
    os.makedirs(path, exist_ok=True)
    if not clean:  # one named file: the directory around it is the user's
        return
    lead = re.escape(f"{prefix}-") if prefix else ""
    for stale in os.listdir(path):  # a previous save's files (same prefix) that this one does not overwrite
        if re.fullmatch(lead + _STALE.pattern, stale) and stale not in files:
            os.remove(os.path.join(path, stale))


class _Rank0Writer:
    """Rank 0's file writes between collectives: after a failed write rank 0 stops writing but
    keeps taking part in the gathers, and ``done`` raises the error on every rank (a failure
    cannot leave the other ranks waiting in a collective)."""

    def __init__(self) -> None:
        self.error: BaseException | None = None

    @property
    def writing(self) -> bool:
        return _rank() == 0 and self.error is None

    def run(self, write: Callable[[], None]) -> None:
        if self.writing:
            try:
                write()
            except Exception as exc:  # noqa: BLE001 -- raised on every rank by done()
                self.error = exc

    def done(self) -> None:
        def check() -> None:
            if self.error is not None:
                raise self.error

        _on_rank0(check)


def _write(tensors: dict[str, torch.Tensor], file: str, use_safetensors: bool) -> None:
    if use_safetensors:
        from safetensors.torch import save_file

        save_file(tensors, file, metadata={"format": "pt"})
    else:
        torch.save(tensors, file)


def _checkpoint_files(path: str) -> list[str]:
    """The weight files of a ``save_model`` checkpoint: the file ``path`` itself, or in the
    directory ``path`` the files its index names, or its one weight file (any prefix)."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise ValueError(f"{path!r}: no such model checkpoint (file or directory)")
    names = sorted(os.listdir(path))
    for kind in (SAFE_INDEX, BIN_INDEX, SAFE_SINGLE, BIN_SINGLE):  # index files first, safetensors first
        found = [n for n in names if n == kind or n.endswith("-" + kind)]
        if len(found) > 1:
            raise ValueError(f"{path!r} holds several checkpoints ({found}): load one by its file or its own "
                             f"directory")
        if found and kind.endswith(".json"):
            with open(os.path.join(path, found[0])) as f:
                return [os.path.join(path, n) for n in sorted(set(json.load(f)["weight_map"].values()))]
        if found:
            return [os.path.join(path, found[0])]
    raise ValueError(f"{path!r} holds no model checkpoint ({SAFE_SINGLE}, {SAFE_INDEX}, {BIN_SINGLE} or "
                     f"{BIN_INDEX}, optionally with a prefix)")


def read_full_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint written by ``save_model`` (or HF's ``save_pretrained``): a
    single file (safetensors by content, else ``torch.load``) or a directory."""
    state: dict[str, torch.Tensor] = {}
    for file in _checkpoint_files(os.fspath(path)):
        if _is_safetensors(file):
            from safetensors.torch import load_file

            state.update(load_file(file))
        else:
            state.update(torch.load(file, map_location="cpu", weights_only=True))
    return state


def _is_safetensors(file: str) -> bool:
    """A safetensors file starts with its header's length (8 bytes, little endian) and the header
    (a json object); a ``torch.save`` file is a zip archive (``PK``)."""
    with open(file, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[:2] != b"PK" and head[8:9] == b"{"


def load_model(module: torch.nn.Module, path: str | os.PathLike, *, strict: bool = True) -> None:
    """See ``Booster.load_model``: a boosted module slices the full tensors into its shards, a
    plain module copies them."""
    from autopar.runtime.parallel_module import ParallelModule

    state = read_full_state_dict(path)
    if isinstance(module, ParallelModule):
        module.load_full_state_dict(state, strict=strict)
    else:
        load_plain(module, state, strict=strict)


@torch.no_grad()
def load_plain(module: torch.nn.Module, state: dict[str, torch.Tensor], *, strict: bool = True) -> None:
    """A full state dict into a plain module: a tensor tied under several names (written once)
    fills all of them; shapes must match; ``strict``: nothing missing, nothing unexpected."""
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, value in module.state_dict(keep_vars=True).items():
        groups.setdefault(id(value), ([], value))[0].append(name)
    missing, known = [], set()
    for names, target in groups.values():
        known.update(names)
        value = next((state[n] for n in names if n in state), None)
        if value is None:
            missing.append(names[0])
        elif tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"{names[0]}: checkpoint shape {list(value.shape)}, model {list(target.shape)}")
        else:
            target.copy_(value)
    unexpected = sorted(set(state) - known)
    if strict and (missing or unexpected):
        raise ValueError(f"load_model(strict=True): missing {missing}, unexpected {unexpected}")


# --------------------------------------------------------------------------------- optimizer
def _lift(value: Any, param: torch.Tensor, where: str) -> Any:
    """A plain-tensor optimizer state of a sharded DTensor parameter as a DTensor, so DCP saves
    every rank's piece and reshards it on load (DCP takes a plain tensor for a replicated one
    and would keep one rank's copy). For an optimizer computing on the local blocks, elementwise
    state has the local shard's shape (it is sharded like the parameter); a factored statistic
    has size 1 where the parameter's shard has its extent, and is the same on every shard of
    that dim (Adafactor-style row/column statistics). Anything else cannot be laid out from its
    shape alone.
    Scalars (step counts), DTensor state (torch's optimizers) and state of replicated
    parameters stay as they are (DCP treats plain tensors as replicated)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if (not isinstance(param, DTensor) or not isinstance(value, torch.Tensor) or isinstance(value, DTensor)
            or value.dim() == 0 or all(isinstance(pl, Replicate) for pl in param.placements)):
        return value
    local = param.to_local()
    if value.dim() != local.dim() or any(v not in (n, 1) for v, n in zip(value.shape, local.shape)):
        raise NotImplementedError(
            f"save/load_optimizer: the state {where} has shape {list(value.shape)}, neither the local shard's "
            f"{list(local.shape)} nor a factored statistic of it, so its layout across the shards of "
            f"{list(param.shape)} ({param.placements}) is unknown; it cannot be resharded")
    placements, shape = [], list(value.shape)
    for axis, pl in enumerate(param.placements):
        # (a fused projection's S(d/k) is a _StridedShard: elementwise state is split like it)
        if isinstance(pl, (Shard, _StridedShard)) and value.shape[pl.dim] == local.shape[pl.dim]:
            placements.append(pl)
            shape[pl.dim] *= param.device_mesh.size(axis)
        else:  # replicated, or a statistic reduced over this dim: the same on every shard of it
            placements.append(Replicate())
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(value.contiguous(), param.device_mesh, placements, run_check=False,
                              shape=torch.Size(shape), stride=stride)


def _holder(optimizer: BoostedOptimizer):
    """The module whose parameters the optimizer holds under the boosted module's names: ZeRO
    pieces in place of the parameters they shard (``ZeroOptimizer.state_module``)."""
    return optimizer.zero.state_module() if optimizer.zero is not None else optimizer.module


def _lifted(optim_state: dict[str, Any], module) -> dict[str, Any]:
    params = dict(module.named_parameters())
    state = {fqn: {key: _lift(value, params[fqn], f"{key!r} of {fqn}") if fqn in params else value
                   for key, value in entries.items()}
             for fqn, entries in optim_state["state"].items()}
    return {**optim_state, "state": state}


def _unlifted(optim_state: dict[str, Any], like: dict[str, Any]) -> dict[str, Any]:
    """The loaded state back as local tensors where ``like`` (the optimizer's own) had them."""
    from torch.distributed.tensor import DTensor

    state = {fqn: {key: value.to_local() if isinstance(value, DTensor) and not isinstance(like[fqn][key], DTensor)
                   else value for key, value in entries.items()}
             for fqn, entries in optim_state["state"].items()}
    return {**optim_state, "state": state}


def _refuse_uneven(optimizer: BoostedOptimizer) -> None:
    """NotImplementedError for a parameter whose local piece is not DTensor's even shard (a
    table-wise embedding table, whole on its owner: ``Plan.tables``): DCP would describe its state
    with the even shard's shape and offset, a checkpoint that loads wrong."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for group in optimizer.optim.param_groups:
        for p in group["params"]:
            if isinstance(p, DTensor):
                even, _ = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                if tuple(even) != tuple(p._local_tensor.shape):
                    raise NotImplementedError(
                        f"save_optimizer/load_optimizer: a parameter of shape {tuple(p.shape)} is held whole by one "
                        f"device (a table-wise embedding table, Plan.tables), which torch.distributed.checkpoint "
                        f"cannot describe; plan without table-wise tables to checkpoint the optimizer this way")


def _strided(value: Any) -> bool:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(value, DTensor) and any(isinstance(pl, _StridedShard) for pl in value.placements)


def _blockwise(value: Any) -> Any:
    """``value`` (nested dicts and lists) with every ``S(d/k)`` DTensor -- a fused projection's
    state, DTensor's ``_StridedShard``: ``k`` blocks per rank, which DCP cannot describe (it
    takes a piece for one block) -- as the same tensor cut in plain blocks: a gather and a local
    slice per such tensor, at checkpoint time only. The directory so holds the plain layout any
    other plan loads."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    if _strided(value):
        plain = [Shard(pl.dim) if isinstance(pl, _StridedShard) else pl for pl in value.placements]
        return distribute_tensor(value.full_tensor(), value.device_mesh, plain, src_data_rank=None)
    if isinstance(value, dict):
        return {k: _blockwise(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_blockwise(v) for v in value]
    return value


def _restrided(loaded: Any, like: Any) -> Any:
    """``_blockwise``'s reverse after a load: each tensor ``like`` holds ``S(d/k)`` back in that
    layout (DCP filled the others in place)."""
    from torch.distributed.tensor import distribute_tensor

    if _strided(like):
        return distribute_tensor(loaded.full_tensor(), like.device_mesh, like.placements, src_data_rank=None)
    if isinstance(like, dict):
        return {k: _restrided(loaded[k], v) for k, v in like.items()}
    if isinstance(like, list):
        return [_restrided(a, b) for a, b in zip(loaded, like)]
    return loaded


def _optimizer_checkpoint(optimizer: BoostedOptimizer):
    """(the module holding the optimizer's parameters, its state dict, what DCP saves or fills:
    the state as DTensors and the fp16 scaler's state)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    holder = _holder(optimizer)
    _refuse_uneven(optimizer)
    own = get_optimizer_state_dict(holder, optimizer.optim)
    state: dict[str, Any] = {"optim": _lifted(own, holder)}
    if optimizer.scaler is not None:
        state[SCALER_KEY] = optimizer.scaler.state_dict()
    return holder, own, state


def save_optimizer(optimizer: BoostedOptimizer, path: str | os.PathLike, *, shard: bool = True) -> None:
    """See ``Booster.save_optimizer``: ``shard`` a DCP directory, else one ``torch.save`` file."""
    import torch.distributed.checkpoint as dcp

    if not isinstance(shard, bool):
        raise ValueError(f"shard must be a bool, got {shard!r}")
    _, _, state = _optimizer_checkpoint(optimizer)
    if shard:
        dcp.save(_blockwise(state), checkpoint_id=os.fspath(path))
        return
    full = _merged(_gathered(state))  # a collective per sharded tensor, every rank in the same order

    def write() -> None:
        parent = os.path.dirname(os.fspath(path))
        if parent:
            os.makedirs(parent, exist_ok=True)
        torch.save(full, os.fspath(path))

    _on_rank0(write)


def load_optimizer(optimizer: BoostedOptimizer, path: str | os.PathLike) -> None:
    """See ``Booster.load_optimizer``: a DCP directory or ``save_optimizer(shard=False)``'s file."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    # get_optimizer_state_dict initialises missing state, so there is a layout to load into.
    holder, own, state = _optimizer_checkpoint(optimizer)
    path = os.fspath(path)
    if os.path.isfile(path):
        full = torch.load(path, map_location="cpu", weights_only=True)
        placed = _placed(state, full, "optimizer state")
        # hyper-parameters from the file; each group's parameters this rank's own (a pipeline
        # stage holds some of them, the file all)
        groups = [{**saved, "params": own_group["params"]}
                  for own_group, saved in zip(state["optim"]["param_groups"], full["optim"]["param_groups"])]
        state = {**placed, "optim": {**placed["optim"], "param_groups": groups}}
    elif os.path.isdir(path):
        blocks = _blockwise(state)
        dcp.load(blocks, checkpoint_id=path)
        state = _restrided(blocks, state)
    else:
        raise ValueError(f"{path!r}: no such optimizer checkpoint (file or directory)")
    set_optimizer_state_dict(holder, optimizer.optim, optim_state_dict=_unlifted(state["optim"], own["state"]))
    if optimizer.scaler is not None:
        optimizer.scaler.load_state_dict(state[SCALER_KEY])


def _gathered(value: Any) -> Any:
    """``value`` (the optimizer checkpoint's nested dicts and lists) with every DTensor made full
    and every tensor on the CPU."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor().cpu()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _gathered(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_gathered(v) for v in value)
    return value


def _merged(full: dict[str, Any]) -> dict[str, Any] | None:
    """One rank's gathered optimizer checkpoint completed with every other rank's entries where
    ranks hold different parameters (pipeline stages: each gathers its own stage's state); the
    merge is rank 0's (None elsewhere). Ranks holding the same entries exchange only their names."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return full
    names: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(names, sorted(full["optim"]["state"]))
    if all(n == names[0] for n in names):
        return full
    parts: list[Any] = [None] * dist.get_world_size() if _rank() == 0 else None
    dist.gather_object(full, parts, dst=0)
    if _rank() != 0:
        return None
    merged = parts[0]
    for other in parts[1:]:
        for fqn, entry in other["optim"]["state"].items():
            merged["optim"]["state"].setdefault(fqn, entry)
        for group, more in zip(merged["optim"]["param_groups"], other["optim"]["param_groups"]):
            group["params"] = list(dict.fromkeys([*group["params"], *more["params"]]))
    return merged


def _placed(target: Any, full: Any, where: str) -> Any:
    """``full`` (a gathered checkpoint) laid out like ``target``: each DTensor of ``target`` gets
    its slices of the full tensor (no communication: every rank holds ``full``), each plain
    tensor the full value on its device, everything else ``full``'s value."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, dict):
        if not isinstance(full, dict) or set(target) - set(full):
            missing = sorted(map(str, set(target) - set(full))) if isinstance(full, dict) else "all"
            raise ValueError(f"load_optimizer: the checkpoint lacks {where} entries {missing}")
        return {k: _placed(v, full[k], f"{where}[{k!r}]") for k, v in target.items()}
    if isinstance(target, torch.Tensor):
        if not isinstance(full, torch.Tensor) or tuple(full.shape) != tuple(target.shape):
            got = list(full.shape) if isinstance(full, torch.Tensor) else type(full).__name__
            raise ValueError(f"load_optimizer: {where} has shape {list(target.shape)} here, {got} in the checkpoint")
        if isinstance(target, DTensor):
            return distribute_tensor(full.to(target.dtype), target.device_mesh, target.placements,
                                     src_data_rank=None)
        return full.to(device=target.device, dtype=target.dtype)
    return full


# --------------------------------------------------------------------------------- scheduler
def save_lr_scheduler(scheduler: Any, path: str | os.PathLike) -> None:
    """See ``Booster.save_lr_scheduler``."""
    def write() -> None:
        parent = os.path.dirname(os.fspath(path))
        if parent:
            os.makedirs(parent, exist_ok=True)
        torch.save(scheduler.state_dict(), os.fspath(path))

    _on_rank0(write)


def load_lr_scheduler(scheduler: Any, path: str | os.PathLike) -> None:
    """See ``Booster.load_lr_scheduler``."""
    scheduler.load_state_dict(torch.load(os.fspath(path), map_location="cpu", weights_only=True))
