"""Emit the module every rank trains from a plan: ``build_module(model, traced, plan)``.

Pure runtime: the plan comes from elsewhere (``autopar.autoparallelize`` solves it on rank 0 or
loads it, then calls ``build_module`` on every rank), so nothing here imports the planner or the
solver. ``check_plan`` says why a plan does not fit this model or process group;
``runtime_device`` and ``mesh_preset`` pick this rank's device and its cost preset.
"""

from __future__ import annotations

import inspect
import math
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from autopar.layout.mesh import MeshSpec
from autopar.plans import Plan
from autopar.runtime.draws import check_ranks_draw_alike
from autopar.runtime.dtensors import to_dtensor
from autopar.runtime.materialize import local_shards
from autopar.runtime.eval_replica import EvalReplica
from autopar.runtime.modes import traced_mode
from autopar.runtime.module import AutoParallelModule
from autopar.runtime.early import hoist_early_sums
from autopar.runtime.prefetch import prefetch_enabled, prefetch_gathers
from autopar.runtime.fold import fold_constants, traced_ndim
from autopar.runtime.passes import STATE_KEY, emit_local_graph
from autopar.runtime.process_mesh import ProcessMesh
from autopar.runtime.table_wise import check_tables, owners_of, to_table_dtensor
from autopar.strategies import rng

__all__ = ["build_module", "check_plan", "runtime_device", "mesh_preset", "attach_tensor"]


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
        # batch_norm_stats="per_rank" rewrites the traced graph, and a Plan does not carry options.
        per_rank = any("chunked_batch_norm" in n.op for n in plan.nodes)
        hint = (" (it was made with batch_norm_stats='per_rank': apply it with that option too)" if per_rank
                else " (or batch_norm_stats, which changes the traced graph, differs from the plan's)")
        raise ValueError(f"stale plan for {plan.model}: it was made for graph hash {plan.graph_hash}, this "
                         f"model traces to {graph_hash} (the model, its inputs' shapes or autopar changed){hint}; "
                         f"re-plan it")
    size = math.prod(plan.mesh.shape)
    if size != world_size:
        raise ValueError(f"plan mesh {plan.mesh.shape} has {size} devices but the process group has "
                         f"{world_size} ranks")
    if mesh is not None and tuple(mesh.shape) != tuple(plan.mesh.shape):
        raise ValueError(f"the plan is for mesh {plan.mesh.shape}, autoparallelize was given mesh {mesh.shape}")


def build_module(model: nn.Module, traced, plan: Plan, *, device: torch.device, seed: int = 0,
                 init_weights: bool = True, local_inputs: bool = False) -> AutoParallelModule:
    """Emit the local graph of ``traced`` under ``plan`` and attach this rank's shards."""
    check_tables(plan, traced)
    if plan.pipeline is not None:
        raise ValueError("the plan is pipelined (Plan.pipeline): build it with "
                         "autopar.runtime.pipeline.build_pipeline(model, micro_batch_trace, plan, device=...)")
    pmesh = ProcessMesh.from_spec(plan.mesh, device_type=device.type)
    emitted = emit_local_graph(traced, plan, pmesh, device=device, local_inputs=local_inputs, pending_outputs=True,
                               early_sums=True)
    if plan.recompute:  # activation checkpointing: regions become torch.utils.checkpoint calls
        from autopar.runtime.recompute import apply_recompute

        apply_recompute(emitted.graph, emitted.modules, plan.recompute)
    hoist_early_sums(emitted.graph, emitted.modules)  # after the regions: never across one
    if prefetch_enabled():  # sharded parameters gathered one reader ahead (top level, like the sums)
        prefetch_gathers(emitted.graph, emitted.modules, pmesh, state_key=STATE_KEY)
    owners = owners_of(plan)
    shards, stats = local_shards(model, traced, emitted.specs, pmesh, device=device, seed=seed,
                                 init_weights=init_weights, owners=owners)
    root: dict[str, Any] = dict(emitted.modules)
    state_names = {n.name for n in emitted.graph.nodes if n.meta.get(STATE_KEY)}
    for name, target in emitted.attr_of.items():
        if name not in state_names:
            root[target] = shards[name]  # lifted constants stay plain local tensors
    gm = fx.GraphModule(root, emitted.graph, class_name=f"AutoParallel{traced.model_name}")
    # the attention mask from arange: computed once here, not every step
    fold_constants(gm, ndim_of=lambda node: traced_ndim(traced, node))
    shapes = {p.name: p.shape for p in traced.placeholders}
    for name in sorted(state_names):
        if name in owners:  # a table-wise table: whole on its owner, zero rows on its peers
            dtensor = to_table_dtensor(shards[name], emitted.specs[name], owners[name], pmesh, shapes[name])
        else:
            dtensor = to_dtensor(shards[name], emitted.specs[name], pmesh, shapes[name])
        if isinstance(shards[name], nn.Parameter):
            dtensor = nn.Parameter(dtensor, requires_grad=shards[name].requires_grad)
        attach_tensor(gm, emitted.attr_of[name], dtensor)
    mode = traced_mode(model, draws=rng.graph_draws(traced.gm.graph))
    module = AutoParallelModule(
        gm, traced=traced, plan=plan, pmesh=pmesh, specs=emitted.specs, attr_of=emitted.attr_of,
        signature=inspect.signature(model.forward), state_keys=tuple(model.state_dict(keep_vars=True)),
        local_inputs=local_inputs, mode=mode, evaluator=EvalReplica.of(model, traced, mode=mode))
    module.materialize_stats = stats
    module.num_conversions = emitted.num_conversions
    check_ranks_draw_alike(traced.gm.graph)
    return module


def attach_tensor(root: nn.Module, path: str, tensor: torch.Tensor) -> None:
    """Register ``tensor`` (a parameter or a buffer) at the dotted ``path`` under ``root``,
    creating empty container modules on the way (the original model's names)."""
    *parents, leaf = path.split(".")
    owner = root
    for part in parents:
        child = owner._modules.get(part)
        if child is None:
            child = nn.Module()
            owner.add_module(part, child)
        owner = child
    if isinstance(tensor, nn.Parameter):
        owner.register_parameter(leaf, tensor)
    else:
        owner.register_buffer(leaf, tensor)
