"""Pipeline stages by an even cut at repeated-block boundaries, and the pipelined ``Plan``.

``even_stages(traced, num_stages=S, virtual_stages=v)`` cuts the traced (micro-batch) graph into
``S * v`` stages that each hold a contiguous run of whole repeated blocks (``transformer.h.3``,
``model.layers.3``: :mod:`autopar.layout.blocks`), as evenly as the block count allows:

- the repeated-block container is the module prefix with the most block indices (GPT-2's
  ``transformer.h``); with N blocks and K = S * v stages, stage k holds blocks
  ``[k * N // K, (k + 1) * N // K)``;
- ops are walked in graph order: an op inside block b goes to b's stage, any other op to the
  stage of the latest block op before it (so embeddings and everything before the first block
  go to stage 0, the final norm, the head and the loss to the last stage); a ``getitem`` goes
  with the op whose output it reads;
- a parameter, buffer or user input is listed in every stage that reads it (GPT-2's tied
  ``wte``: the first and the last stage); values crossing a cut are the runtime's business
  (:mod:`autopar.runtime.pipeline_split`).

Stage k runs on pipeline rank ``k % S`` (the loop placement of torch's interleaved schedules).
The stage search proper (a DP over cut points priced by the cost model) is not here: this is
the simple, cost-free cut the runtime is tested with.

``pipeline_plan(sub_plan, traced, mesh=..., ...)`` wraps a plan solved on the stage sub-mesh
(the mesh without its first axis) into a full-mesh ``Plan`` carrying a ``PipelinePlan``.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from dataclasses import replace
from typing import Any

from autopar.layout.blocks import split_block
from autopar.layout.mesh import MeshSpec, default_axis_names, parse_mesh_shape
from autopar.plans import PIPELINE_SCHEDULES, PipelinePlan, Plan, StagePlan, stage_mesh_of
from autopar.tracer.graph import MODULE_KEY, TracedGraph

__all__ = ["even_stages", "pipeline_plan", "block_container", "batch_size", "micro_inputs", "microbatch_counts",
           "PIPELINE_CASTS"]

# How a pipeline's micro-batch graph casts weights under bf16/fp16 (``autopar.tracer.precision``):
# one cast per reading module, so a tied weight is cast on each stage holding it rather than
# its first stage's low-precision copy sent through every stage per micro-batch. The planner and
# every rank's build trace alike, or the plan's node names would not match.
PIPELINE_CASTS = "per_module"


def block_container(traced: TracedGraph) -> tuple[str, int] | None:
    """(module prefix, number of blocks) of the repeated-block container with the most block
    indices among the ops, or None when the model has no repeated block."""
    seen: dict[str, set[int]] = {}
    for node in traced.compute_nodes():
        found = split_block(node.meta.get(MODULE_KEY, ""))
        if found is not None:
            seen.setdefault(found[0], set()).add(found[1])
    if not seen:
        return None
    prefix = max(seen, key=lambda p: len(seen[p]))  # first seen wins ties (dicts keep order)
    indices = sorted(seen[prefix])
    if indices != list(range(len(indices))):
        raise ValueError(f"the blocks of {prefix!r} are not numbered 0..{len(indices) - 1}: {indices}")
    return prefix, len(indices)


def even_stages(traced: TracedGraph, *, num_stages: int, virtual_stages: int = 1) -> tuple[StagePlan, ...]:
    for what, n in (("num_stages", num_stages), ("virtual_stages", virtual_stages)):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{what} must be a positive int, got {n!r}")
    total = num_stages * virtual_stages
    found = block_container(traced)
    num_blocks = 0 if found is None else found[1]
    if num_blocks < total:
        raise ValueError(f"{traced.model_name} has {num_blocks} repeated blocks"
                         + (f" ({found[0]}.0..{num_blocks - 1})" if found else "")
                         + f"; {num_stages} pipeline stages x {virtual_stages} virtual stages need at least "
                           f"{total} (one whole block per stage)")
    prefix = found[0]
    block_stage = {b: k for k in range(total) for b in range(k * num_blocks // total, (k + 1) * num_blocks // total)}
    stage_of: dict[str, int] = {}
    current = 0
    for node in traced.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and node.target is operator.getitem and node.args[0].name in stage_of:
            stage_of[node.name] = stage_of[node.args[0].name]
            continue
        where = split_block(node.meta.get(MODULE_KEY, ""))
        if where is not None and where[0] == prefix:
            current = max(current, block_stage[where[1]])
        stage_of[node.name] = current
    _check_order(traced, stage_of)
    readers: dict[str, set[int]] = {}
    for node in traced.nodes:
        if node.op == "placeholder":
            readers[node.name] = {stage_of[u.name] for u in node.users if u.name in stage_of}
            if any(u.op == "output" for u in node.users):
                readers[node.name].add(total - 1)
    stages = []
    for k in range(total):
        names = tuple(n.name for n in traced.nodes
                      if (n.op == "placeholder" and k in readers[n.name]) or stage_of.get(n.name) == k)
        first, last = min(b for b, s in block_stage.items() if s == k), max(b for b, s in block_stage.items() if s == k)
        stages.append(StagePlan(index=k, rank=k % num_stages, layers=(first, last + 1), nodes=names))
    return tuple(stages)


def _check_order(traced: TracedGraph, stage_of: dict[str, int]) -> None:
    """Every op reads values from its own or earlier stages (assert: graph order guarantees it
    for the walk above; a later planner's cuts go through the same check)."""
    for node in traced.nodes:
        for src in node.all_input_nodes:
            if src.name in stage_of and node.name in stage_of:
                assert stage_of[src.name] <= stage_of[node.name], (src.name, node.name)


def pipeline_plan(sub_plan: Plan, traced: TracedGraph, *, mesh: MeshSpec | tuple[int, ...] | str, num_stages: int,
                  num_microbatches: int, schedule: str, virtual_stages: int = 1) -> Plan:
    """The full-mesh plan: ``sub_plan`` (solved on ``traced``, the micro-batch graph, on the
    stage sub-mesh) with even stages over mesh axis 0 of ``mesh`` (size ``num_stages``; a shape
    gets the stage plan's device costs)."""
    if not isinstance(mesh, MeshSpec):
        shape = parse_mesh_shape(mesh)
        base = sub_plan.mesh
        mesh = MeshSpec(shape=shape, axis_names=default_axis_names(len(shape)), alpha=(base.alpha[0],) * len(shape),
                        beta=(base.beta[0],) * len(shape), peak_flops=base.peak_flops,
                        mem_bandwidth=base.mem_bandwidth, mem_capacity=base.mem_capacity, name=base.name,
                        half_peak_flops=base.half_peak_flops)
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r} is not one of {PIPELINE_SCHEDULES}")
    if mesh.shape[0] != num_stages:
        raise ValueError(f"the pipeline axis (mesh axis 0) of mesh {mesh.shape} has size {mesh.shape[0]}, "
                         f"not num_stages={num_stages}")
    sub = stage_mesh_of(mesh)
    if tuple(sub_plan.mesh.shape) != tuple(sub.shape):
        raise ValueError(f"the stage plan is for mesh {sub_plan.mesh.shape}; stages of mesh {mesh.shape} run on "
                         f"{sub.shape} (the mesh without its pipeline axis)")
    if sub_plan.graph_hash != traced.graph_hash:
        raise ValueError(f"the stage plan was made for graph {sub_plan.graph_hash}, the traced graph is "
                         f"{traced.graph_hash}")
    if sub_plan.pipeline is not None:
        raise ValueError("the stage plan is already pipelined")
    if schedule in ("gpipe", "1f1b") and virtual_stages != 1:
        raise ValueError(f"schedule {schedule!r} runs one stage per rank; got virtual_stages={virtual_stages} "
                         f"(use 'interleaved-1f1b' or 'zero-bubble')")
    if schedule == "interleaved-1f1b" and virtual_stages < 2:
        raise ValueError(f"schedule 'interleaved-1f1b' needs virtual_stages >= 2, got {virtual_stages}")
    if any(n.zero_stage for n in sub_plan.nodes):
        raise ValueError("pipelined plans do not run with ZeRO yet: plan the stages with zero_stage=0")
    if sub_plan.recompute and schedule == "zero-bubble":
        raise ValueError("activation recompute does not run under the zero-bubble schedule (its split backward "
                         "unpacks a checkpoint region twice): plan with checkpoint='none' or another schedule")
    stages = even_stages(traced, num_stages=num_stages, virtual_stages=virtual_stages)
    stage_of = {name: st.index for st in stages for name in st.nodes}
    for region in sub_plan.recompute:  # a recompute region runs inside one stage
        inside = {stage_of[name] for name in region.nodes if name in stage_of}
        if len(inside) > 1:
            raise ValueError(f"recompute region {region.name!r} spans pipeline stages {sorted(inside)}")
    counts = Counter(name for st in stages for name in st.nodes)
    placeholders = {p.name for p in traced.placeholders}
    doubled = sorted(n for n, c in counts.items() if c > 1 and n not in placeholders)
    assert not doubled, doubled  # ops run on exactly one stage
    pipe = PipelinePlan(num_stages=num_stages, num_microbatches=num_microbatches, schedule=schedule,
                        virtual_stages=virtual_stages, stages=stages)
    return replace(sub_plan, mesh=mesh, pipeline=pipe)


def batch_size(meta_inputs: Any) -> int:
    """Dim 0 of the first tensor input (the batch every batch-major input shares)."""
    import torch
    from torch.utils import _pytree as pytree

    for leaf in pytree.tree_leaves(meta_inputs):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise ValueError("pipelining splits the batch along dim 0, but the inputs hold no tensor with a batch dim")


def micro_inputs(meta_inputs: Any, num_microbatches: int) -> Any:
    """``meta_inputs`` with every batch-major tensor cut to one micro-batch (its first rows)."""
    import torch
    from torch.utils import _pytree as pytree

    batch = batch_size(meta_inputs)
    if batch % num_microbatches:
        raise ValueError(f"microbatches={num_microbatches} does not divide the batch of {batch}")
    micro = batch // num_microbatches
    return pytree.tree_map(lambda x: x[:micro] if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch
                           else x, meta_inputs)


def microbatch_counts(batch: int, *, num_stages: int, asked: int | str, limit: int = 3) -> tuple[int, ...]:
    """``asked``, or for ``"auto"`` up to ``limit`` divisors of ``batch`` that are multiples of
    ``num_stages``: the smallest, the largest and one between (geometric middle)."""
    if asked != "auto":
        if batch % asked:
            raise ValueError(f"microbatches={asked} does not divide the batch of {batch}")
        return (asked,)
    found = [d for d in range(num_stages, batch + 1, num_stages) if batch % d == 0]
    if not found:
        raise ValueError(f"pipeline of {num_stages} stages: no micro-batch count divides the batch of {batch} and is a "
                         f"multiple of {num_stages}; give microbatches= or a batch that {num_stages} divides")
    if len(found) <= limit:
        return tuple(found)
    mid = min(found, key=lambda d: abs(math.log(d) - (math.log(found[0]) + math.log(found[-1])) / 2))
    return tuple(sorted({found[0], mid, found[-1]}))
