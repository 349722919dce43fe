"""Build this rank's pipeline stages: ``build_pipeline(model, traced, plan, device=...)``.

Every rank cuts the micro-batch graph into stage graphs (:mod:`autopar.runtime.pipeline.split`),
emits the ones it holds on the stage sub-mesh, takes their data-parallel gradient sums out of
the graphs (run once per step instead of once per micro-batch), materialises only the
parameters and buffers those stages read, and makes the process groups that sum a tied
weight's copies; :class:`~autopar.runtime.pipeline.module.PipelineModule` runs the result.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.plans import Plan
from autopar.runtime.draws import check_ranks_draw_alike
from autopar.runtime.materialize import local_shards
from autopar.runtime.eval_replica import EvalReplica
from autopar.runtime.fold import fold_constants, traced_ndim
from autopar.runtime.modes import traced_mode
from autopar.runtime.nodes import GradAllReduce
from autopar.runtime.passes import STATE_KEY, emit_local_graph
from autopar.runtime.pipeline.module import PipelineModule, StageModule
from autopar.runtime.pipeline.split import boundary_layouts, split_stages
from autopar.runtime.process_mesh import ProcessMesh
from autopar.runtime.recompute import apply_recompute
from autopar.strategies import rng
from autopar.tracer.graph import INPUT, TracedGraph

__all__ = ["build_pipeline", "pipeline_device_mesh"]


_ZB_RECOMPUTE = ("activation recompute does not run under the zero-bubble schedule: its split backward "
                 "(input gradients, later weight gradients) unpacks a checkpoint region's saved tensors in two "
                 "autograd passes, which torch.utils.checkpoint refuses for Llama's blocks; plan with "
                 "checkpoint='none' or another schedule")


def pipeline_device_mesh(plan: Plan, *, device_type: str) -> DeviceMesh:
    """The full-shape ``DeviceMesh`` (pipeline axis first; a 1-D mesh gets a trailing axis of size 1)."""
    sub = plan.stage_mesh()
    if plan.mesh.ndim == 1:
        shape, names = (plan.mesh.shape[0], 1), (plan.mesh.axis_names[0], sub.axis_names[0])
    else:
        shape, names = plan.mesh.shape, plan.mesh.axis_names
    return init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))


def _tied_groups(holders: dict[str, tuple[int, ...]], device_mesh: DeviceMesh) -> dict[str, Any]:
    """Parameter name -> the process group of the pipeline ranks holding it at this rank's
    sub-mesh coordinate (None where this rank holds it alone). Every rank creates every group,
    in the same order (``new_group`` is collective over the default group)."""
    mesh = device_mesh.mesh.reshape(device_mesh.mesh.shape[0], -1)
    me = dist.get_rank()
    made: dict[tuple[int, ...], Any] = {}
    out: dict[str, Any] = {}
    for name, pp_ranks in holders.items():
        if len(pp_ranks) < 2:
            continue
        for col in range(mesh.shape[1]):
            ranks = tuple(int(mesh[p, col]) for p in pp_ranks)
            if ranks not in made:
                made[ranks] = dist.new_group(list(ranks))
            if me in ranks:
                out[name] = made[ranks]
    return out


def build_pipeline(model: nn.Module, traced: TracedGraph, plan: Plan, *, device: torch.device | str,
                   seed: int = 0, init_weights: bool = True) -> PipelineModule:
    """This rank's stages of ``plan`` (a plan with ``pipeline``) as a ``PipelineModule``. Every
    rank of the default process group calls it; ``traced`` is the MICRO-batch trace."""
    pipe = plan.pipeline
    if pipe is None:
        raise ValueError("build_pipeline needs a plan with a pipeline (Plan.pipeline); use build_module otherwise")
    if plan.graph_hash != traced.graph_hash:
        raise ValueError(f"stale plan for {plan.model}: made for graph {plan.graph_hash}, the micro-batch trace is "
                         f"{traced.graph_hash}")
    zero2 = [n.name for n in plan.nodes if n.zero_stage == 2]
    if zero2:
        raise ValueError(f"pipelined stages run ZeRO-1 at most; the plan shards the gradients of {len(zero2)} "
                         f"parameters (ZeRO-2, e.g. {zero2[0]!r}): plan with zero_stage 0 or 1")
    if plan.precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"pipelined stages compute in fp32, bf16 or fp16, the plan asks for {plan.precision!r}")
    if plan.recompute and pipe.schedule == "zero-bubble":
        raise ValueError(_ZB_RECOMPUTE)
    if pipe.schedule in ("gpipe", "1f1b") and pipe.virtual_stages != 1:
        raise ValueError(f"schedule {pipe.schedule!r} runs one stage per rank, the plan has "
                         f"{pipe.virtual_stages} virtual stages")
    for st in pipe.stages:
        if st.rank != st.index % pipe.num_stages:
            raise ValueError(f"stage {st.index} is on pipeline rank {st.rank}; torch's schedules place it on "
                             f"{st.index % pipe.num_stages}")
    device = torch.device(device)
    device_mesh = pipeline_device_mesh(plan, device_type=device.type)
    sub_names = device_mesh.mesh_dim_names[1:]
    pmesh = ProcessMesh(device_mesh[sub_names[0]] if len(sub_names) == 1 else device_mesh[tuple(sub_names)])
    pp_rank = device_mesh.get_local_rank(0)
    graphs = split_stages(traced, pipe)
    holders: dict[str, set[int]] = {}
    for g in graphs:
        for name in g.state:
            holders.setdefault(name, set()).add(pipe.stages[g.index].rank)
    mine = [g for g in graphs if pipe.stages[g.index].rank == pp_rank]
    # Boundary values cross in their producer's layout (no gather before a cut, no split after):
    # a received value is a placeholder named like its producer, and with ``local_inputs`` the
    # emitter lays it out as the plan's decision of that name says; the sender converts to the
    # same. User inputs (and values without a single-output decision) cross replicated.
    user = {p.name for p in traced.placeholders if p.kind == INPUT}
    stage_plan = dataclasses.replace(plan, mesh=plan.stage_mesh(), pipeline=None,
                                     nodes=tuple(n for n in plan.nodes if n.name not in user))
    layouts = boundary_layouts(stage_plan, graphs, len(pmesh.shape))
    emitted = [emit_local_graph(g.traced, stage_plan, pmesh, device=device, bucket_cap=0, local_inputs=True,
                                output_specs=layouts if g.index < len(graphs) - 1 else None) for g in mine]
    for g, e in zip(mine, emitted):  # activation checkpointing: each region inside its stage
        ops = {n.name for n in g.traced.nodes if n.op != "placeholder"}  # received values keep producer names
        regions = [r for r in plan.recompute if ops & set(r.nodes)]
        stray = [r.name for r in regions if not set(r.nodes) <= ops]
        if stray:
            raise ValueError(f"recompute regions {stray} span pipeline stages")
        if regions:
            apply_recompute(e.graph, e.modules, regions)
    deferred: dict[str, tuple[int, ...]] = {}
    for e in emitted:
        for name, axes in _defer_gradient_sync(e).items():
            if deferred.setdefault(name, axes) != axes:  # two stages of this rank disagree: cannot happen
                raise AssertionError(f"{name}: gradient sync over {deferred[name]} and {axes}")
    specs = {name: spec for e in emitted for name, spec in e.specs.items()}
    shards, _ = local_shards(model, traced, specs, pmesh, device=device, seed=seed, init_weights=init_weights)
    modules = []
    for g, e in zip(mine, emitted):
        state_names = {n.name for n in e.graph.nodes if n.meta.get(STATE_KEY)}
        root: dict[str, Any] = dict(e.modules)
        for name, target in e.attr_of.items():
            if name not in state_names:
                root[target] = shards[name]  # lifted constants: plain local tensors
        gm = fx.GraphModule(root, e.graph, class_name=f"Pipeline{traced.model_name}Stage{g.index}")
        # as build_module does: the stage computes its mask once, and its attention runs in the
        # folded form the planner priced (``split`` gives every stage its own input-independent values)
        fold_constants(gm, ndim_of=lambda node, traced=g.traced: traced_ndim(traced, node))
        modules.append(StageModule(gm, g, shards))
    state_keys = tuple(model.state_dict(keep_vars=True))
    held_by = {k: tuple(sorted(v)) for k, v in holders.items()}
    trained = {p.name for p in traced.params if p.requires_grad}
    tied = _tied_groups({k: v for k, v in held_by.items() if k in trained}, device_mesh)
    check_ranks_draw_alike(traced.gm.graph)
    mode = traced_mode(model, draws=rng.graph_draws(traced.gm.graph))
    return PipelineModule(plan=plan, traced=traced, device_mesh=device_mesh, pmesh=pmesh, stage_modules=modules,
                          layouts=layouts, leaves=shards, specs=specs, signature=inspect.signature(model.forward),
                          state_keys=state_keys, device=device, holders=held_by, deferred=deferred,
                          tied_groups=tied, mode=mode, evaluator=EvalReplica.of(model, traced, mode=mode))


def _defer_gradient_sync(emitted) -> dict[str, tuple[int, ...]]:
    """Take the parameters' gradient all-reduces out of the graph, to run once per step.

    A parameter whose every use in the stage graph goes through ``grad_all_reduce`` over the
    same mesh axes (data parallelism inside the stage) has its partial gradient summed over
    those axes in backward -- once per MICRO-batch. Summing the accumulated local gradient once
    after the last micro-batch gives the same sum with 1/M of the collectives (DDP's
    ``no_sync``): the nodes are removed here and ``PipelineModule.step`` all-reduces. Returns
    parameter placeholder name -> axes."""
    graph = emitted.graph
    reducers = {name for name, m in emitted.modules.items() if isinstance(m, GradAllReduce)}
    out = {}
    for node in list(graph.nodes):
        if node.op != "placeholder" or not node.meta.get(STATE_KEY) or not node.users:
            continue
        users = list(node.users)
        if not all(u.op == "call_module" and u.target in reducers for u in users):
            continue
        axes = {tuple(u.kwargs["axes"]) for u in users}
        if len(axes) != 1:
            continue
        for u in users:
            u.replace_all_uses_with(node)
            graph.erase_node(u)
        out[node.name] = axes.pop()
    return out
