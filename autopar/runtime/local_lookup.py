"""A replicated embedding lookup that a plan then splits, looked up on the split indices instead.

A data-parallel plan may read an untied embedding table whole, look up the FULL batch of
replicated token ids on every rank, and split the result over the batch (the Qwen2-style
decoder of ``benchmarks/_measure.py``: ``embedding(W, input_ids)`` then ``split``). The split's
backward is then a blocking all-gather of the activation gradient at the very end of backward --
queued on the process group behind the gradient buckets already in flight, so it waits for
them -- followed by the table's backward over the whole batch on every rank; the forward looked
up twice the rows it keeps.

``split_lookup`` emits the same values the way DDP runs them: the ids are split (a local slice,
no communication), the rank looks up its own rows, and the table's gradient -- now a partial sum
over this rank's rows -- joins the gradient buckets (``runtime.bucketing``) like every other
data-parallel weight. The forward value is bit-equal (a lookup copies rows); the table's gradient
is the same sum of the same row gradients, added per rank and then across ranks (DDP's order).

It applies only where that is the whole story: the table is a trained parameter read by this
lookup alone, replicated, not ZeRO-sharded nor table-wise, and no larger than the looked-up
batch (``_small_table``: a large vocabulary keeps the plan's all-gather, which moves less); the
lookup is dense without ``scale_grad_by_freq`` (whose counts are global); the ids are replicated
integers; the target layout shards only dims of the ids (``S(d)``, no segments, no partial); and
the replicated result has no other reader than the converting consumer (metadata checks without
sizes aside).

``AUTOPAR_LOCAL_LOOKUP=0`` (read when a graph is emitted) keeps the plan's conversion (an A/B).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
import torch.fx as fx

from autopar.layout.conversion import plan_conversion
from autopar.layout.placement import Replicate, Shard, TensorSpec
from autopar.strategies import input_nodes
from autopar.strategies.registry import bind, needs_no_decision
from autopar.tracer.graph import PARAMETER, PLACEHOLDER_KEY

__all__ = ["local_lookup_enabled", "split_lookup"]

aten = torch.ops.aten


def local_lookup_enabled() -> bool:
    """Whether emission applies ``split_lookup`` (``AUTOPAR_LOCAL_LOOKUP=0``: it does not)."""
    return os.environ.get("AUTOPAR_LOCAL_LOOKUP", "1").strip().lower() not in ("0", "false", "off", "no")


def _readers(node: fx.Node) -> list[fx.Node]:
    """``node``'s traced consumers that take a value (metadata asserts left out)."""
    return [u for u in node.users if not (u.op == "call_function" and needs_no_decision(u))]


def _sizeless_assert(node: fx.Node) -> bool:
    """An emitted metadata check that reads no size or stride (it holds on any shard)."""
    if node.op != "call_function" or node.target is not aten._assert_tensor_metadata.default:
        return False
    bound = bind(node.target, node.args, node.kwargs)
    return bound.get("size") is None and bound.get("stride") is None


def _ids_layout(want: TensorSpec, ids_rank: int) -> bool:
    """``want`` shards some dims of the lookup's result that are dims of its ids, and nothing else."""
    shards = [p for p in want.placements if isinstance(p, Shard)]
    return (bool(shards) and len(shards) + sum(isinstance(p, Replicate) for p in want.placements) == want.num_axes
            and all(p.segments == 1 and p.dim < ids_rank for p in shards))


def _small_table(table: fx.Node, lookup: fx.Node) -> bool:
    """The table holds no more bytes than the looked-up batch: its gradient's all-reduce then moves
    at most twice what the split's all-gather would, and saves that blocking collective and the
    lookup of the other ranks' rows. A large vocabulary looked up by a small batch keeps the
    plan's choice (Llama-3's 128k-row table outweighs any batch of fewer tokens)."""
    t, out = table.meta.get("val"), lookup.meta.get("val")
    return (isinstance(t, torch.Tensor) and isinstance(out, torch.Tensor)
            and t.numel() * t.element_size() <= out.numel() * out.element_size())


def split_lookup(em: Any, src: fx.Node, want: TensorSpec, consumer: fx.Node,
                 add_bucket: Callable[[fx.Node, tuple[int, ...]], fx.Node]) -> fx.Node | None:
    """``src`` (a traced replicated ``embedding``) emitted anew in layout ``want`` from split ids
    and a bucketed table (see the module docstring), or None where that does not apply. ``em``:
    the emitter (its graph, env, layout, plan, mesh and comm module names); ``add_bucket(table,
    axes)``: a ``grad_bucket`` node of the table's emitted placeholder for partial ``axes``."""
    if src.op != "call_function" or src.target is not aten.embedding.default or _readers(src) != [consumer]:
        return None
    if sum(a is src for a in input_nodes(consumer)) != 1:
        return None
    have = em.layout.get(src.name)
    bound = bind(src.target, src.args, src.kwargs)
    table, ids = bound.get("weight"), bound.get("indices")
    if (not isinstance(have, TensorSpec) or not have.is_replicated() or bound.get("sparse")
            or bound.get("scale_grad_by_freq") or not isinstance(table, fx.Node) or not isinstance(ids, fx.Node)):
        return None
    ph, ids_val = table.meta.get(PLACEHOLDER_KEY), ids.meta.get("val")
    if (table.op != "placeholder" or ph is None or ph.kind != PARAMETER or not ph.requires_grad
            or _readers(table) != [src] or em.decisions[table.name].zero_stage or table.name in em.table_owners
            or not _small_table(table, src)
            or not isinstance(em.layout.get(table.name), TensorSpec) or not em.layout[table.name].is_replicated()):
        return None
    if (not isinstance(ids_val, torch.Tensor) or ids_val.dtype.is_floating_point or not _ids_layout(want, ids_val.dim())
            or not isinstance(em.layout.get(ids.name), TensorSpec) or not em.layout[ids.name].is_replicated()):
        return None
    old = em.env[src.name]
    if (old.args[:2] != (em.env[table.name], em.env[ids.name])
            or not all(_sizeless_assert(u) for u in old.users)):
        return None  # read through conversions, or read by a check of the full size
    steps = plan_conversion(em.layout[ids.name], want, tuple(ids_val.shape), ids_val.dtype.itemsize,
                            em.plan.mesh).steps
    if any(step.kind != "split" for step in steps):
        return None
    axes = tuple(a for a, p in enumerate(want.placements) if isinstance(p, Shard))
    with em.graph.inserting_before(old.next):
        local_ids = em.env[ids.name]
        for step in steps:  # local slices of the replicated ids, no communication
            local_ids = em.graph.call_module(em.comm_names["split"], (local_ids,),
                                             {"axis": step.axis, "dst_dim": step.dst_dim})
        new = em.graph.create_node("call_function", old.target, (add_bucket(table, axes), local_ids, *old.args[2:]),
                                   dict(old.kwargs))
    new.meta.update(old.meta)
    old.replace_all_uses_with(new)
    em.graph.erase_node(old)
    em.env[src.name], em.layout[src.name] = new, want
    return new
