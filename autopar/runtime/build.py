"""``autoparallelize``: plan (or load a plan) and emit the module every rank trains.

Called on EVERY rank after ``torch.distributed.init_process_group``. How ranks agree on the
plan: rank 0 solves and broadcasts the plan's JSON (``broadcast_object_list``); a solver
failure on rank 0 is broadcast too, so every rank raises the same error instead of hanging.
Every rank traces the model itself (tracing is deterministic; the plan's graph hash is
checked against each rank's own trace).
"""

from __future__ import annotations

import inspect
import math
import os
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from autopar.layout.mesh import MeshSpec
from autopar.plans import Plan
from autopar.runtime.materialize import local_shards
from autopar.runtime.module import AutoParallelModule
from autopar.runtime.passes import emit_local_graph
from autopar.runtime.process_mesh import ProcessMesh

__all__ = ["autoparallelize", "check_plan", "runtime_device", "mesh_preset"]


def runtime_device(device: str | torch.device | None = None) -> torch.device:
    """This rank's device: as given, else ``cuda:<LOCAL_RANK>`` under NCCL, else CPU."""
    if device is not None:
        return torch.device(device)
    if dist.is_initialized() and dist.get_backend() == "nccl":
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % max(torch.cuda.device_count(), 1)))
        return torch.device("cuda", local)
    return torch.device("cpu")


def mesh_preset(device: torch.device) -> str:
    """The ``MeshSpec`` preset for a mesh given as a shape on ``device``."""
    if device.type != "cuda":
        return "cpu"
    return "h100-80gb" if "H100" in torch.cuda.get_device_name(device) else "a100-80gb"


def check_plan(plan: Plan, *, graph_hash: str, world_size: int, mesh: MeshSpec | None) -> None:
    """``ValueError`` saying what does not match: graph hash, world size or mesh."""
    if plan.graph_hash != graph_hash:
        raise ValueError(f"stale plan for {plan.model}: it was made for graph hash {plan.graph_hash}, this "
                         f"model traces to {graph_hash} (the model, its inputs' shapes or autopar changed); "
                         f"re-plan it")
    size = math.prod(plan.mesh.shape)
    if size != world_size:
        raise ValueError(f"plan mesh {plan.mesh.shape} has {size} devices but the process group has "
                         f"{world_size} ranks")
    if mesh is not None and tuple(mesh.shape) != tuple(plan.mesh.shape):
        raise ValueError(f"the plan is for mesh {plan.mesh.shape}, autoparallelize was given mesh {mesh.shape}")


def autoparallelize(
    model: nn.Module,
    meta_inputs: tuple | dict,
    *,
    mesh: MeshSpec | Sequence[int] | str | None = None,
    memory_budget: int | float | str | None = None,
    plan: Plan | str | os.PathLike | None = None,
    solver: str = "auto",
    time_limit: float | None = None,
    device: str | torch.device | None = None,
    seed: int = 0,
    init_weights: bool = True,
    local_inputs: bool = False,
    allow_replicate_fallback: bool = False,
    checkpoint: str = "auto",
) -> AutoParallelModule:
    """Shard ``model`` over the current process group; see the module docstring.

    ``mesh``: None = 1-D over the world size; a shape gets the ``cpu`` preset on CPU (an H100 or
    A100 preset on CUDA); or a ``MeshSpec``. ``plan``: a ``Plan`` or a path to its JSON, applied
    without solving. ``device``: where the local shards live (default: see ``runtime_device``).
    ``seed``: initialisation seed for a model on ``meta`` (``init_weights=False``: zeros, to be
    filled with ``load_full_state_dict``). ``local_inputs``: ``forward`` receives each rank's
    piece of every input under the plan's input layouts instead of the full batch.
    ``checkpoint``: activation recompute planning (``autopar.api.plan``); a loaded plan's
    recompute regions are applied as they are.
    """
    from autopar.api import plan as solve_plan
    from autopar.strategies import needs_decomposition
    from autopar.tracer import trace

    if not dist.is_initialized():
        raise ValueError("autoparallelize needs torch.distributed.init_process_group() first")
    world = dist.get_world_size()
    dev = runtime_device(device)
    spec = None if mesh is None else MeshSpec.coerce(mesh, device=mesh_preset(dev))
    if spec is not None and spec.num_devices != world:
        raise ValueError(f"mesh {spec.shape} has {spec.num_devices} devices but the process group has {world} ranks")
    if plan is None:
        spec = spec or MeshSpec.coerce((world,), device=mesh_preset(dev))
        plan, traced = _solve_on_rank0(solve_plan, model, meta_inputs, mesh=spec, memory_budget=memory_budget,
                                       solver=solver, time_limit=time_limit,
                                       allow_replicate_fallback=allow_replicate_fallback,
                                       checkpoint=checkpoint)
        traced = traced or trace(model, meta_inputs, decompose_if=needs_decomposition)
    else:
        plan = plan if isinstance(plan, Plan) else Plan.load(os.fspath(plan))
        traced = trace(model, meta_inputs, decompose_if=needs_decomposition)
    check_plan(plan, graph_hash=traced.graph_hash, world_size=world, mesh=spec)
    return build_module(model, traced, plan, device=dev, seed=seed, init_weights=init_weights,
                        local_inputs=local_inputs)


def build_module(model: nn.Module, traced, plan: Plan, *, device: torch.device, seed: int = 0,
                 init_weights: bool = True, local_inputs: bool = False) -> AutoParallelModule:
    """Emit the local graph of ``traced`` under ``plan`` and attach this rank's shards."""
    pmesh = ProcessMesh.from_spec(plan.mesh, device_type=device.type)
    emitted = emit_local_graph(traced, plan, pmesh, device=device, local_inputs=local_inputs)
    if plan.recompute:  # activation checkpointing: regions become torch.utils.checkpoint calls
        from autopar.runtime.recompute import apply_recompute

        apply_recompute(emitted.graph, emitted.modules, plan.recompute)
    shards, stats = local_shards(model, traced, emitted.specs, pmesh, device=device, seed=seed,
                                 init_weights=init_weights)
    root: dict[str, Any] = dict(emitted.modules)
    for name, target in emitted.attr_of.items():
        root[target] = shards[name]
    gm = fx.GraphModule(root, emitted.graph, class_name=f"AutoParallel{traced.model_name}")
    module = AutoParallelModule(
        gm, traced=traced, plan=plan, pmesh=pmesh, specs=emitted.specs, attr_of=emitted.attr_of,
        signature=inspect.signature(model.forward), state_keys=tuple(model.state_dict(keep_vars=True)),
        local_inputs=local_inputs)
    module.materialize_stats = stats
    module.num_conversions = emitted.num_conversions
    return module


def _solve_on_rank0(solve_plan, model, meta_inputs, **kwargs):
    """Rank 0 solves; every rank gets the plan (or rank 0's error) by broadcast."""
    traced, error = None, None
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        context: dict = {}
        try:
            kw = dict(kwargs)
            if kw.get("time_limit") is None:
                kw.pop("time_limit")
            result = solve_plan(model, meta_inputs, context=context, **kw)
            payload[0] = ("ok", result.to_json())
            traced = context.get("traced")
        except Exception as exc:  # noqa: BLE001 -- re-raised on every rank below
            payload[0], error = ("error", f"{type(exc).__name__}: {exc}"), exc
    dist.broadcast_object_list(payload, src=0)
    status, text = payload[0]
    if error is not None:
        raise error
    if status != "ok":
        raise ValueError(f"planning failed on rank 0: {text}")
    return Plan.from_json(text), traced
