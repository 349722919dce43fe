"""Recompute analysis: which op runs backward may recompute, and what each one keeps.

Every op inside a repeated block (``autopar.layout.blocks.block_of``) gets a **segment**: its
module path (``"transformer.h.3.mlp.act"``) as a contiguous run of ops (``op_segments``), the
unit the recompute ILP may recompute, as can the whole block (``"transformer.h.3"``). The fine
segments let the cheap-to-recompute, memory-heavy parts (activation functions, attention) go
alone; the block keeps only its own input. The block's own ops (residual adds) form the segment
``"<block>.(self)"``.

A recomputed segment keeps only its inputs (what ``torch.utils.checkpoint`` holds):
``segment_inputs`` lists, per segment, the activation values it reads from outside with their
local bytes per producer option. An input whose storage is counted by a node *outside* the
segment (``saved_by``) is left out (that node holds it whatever the segment does), so a storage
is never counted twice. One counted inside (its last saver recomputed) that an earlier reader
outside saves too is kept as that reader's copy, in the reader's input layout (``_kept_copy``:
two column-parallel projections of one norm read its split output gathered, one conversion for
both; the kept one holds the gathered copy, and so does the checkpoint).

Blocks holding an op that changes model state when run again (``mutates_state``: a training
batch norm, ``num_batches_tracked += 1``) get no segments (``without_stateful_segments``).
"""

from __future__ import annotations

import functools
import operator
from collections import Counter
from dataclasses import replace
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.fx as fx

from autopar.plans import NodeKind
from autopar.planner.records import Decision
from autopar.layout.blocks import block_of
from autopar.solver.problem import Problem
from autopar.solver.timeline import SegmentInput
from autopar.tracer.graph import TracedGraph
from autopar.tracer.profile import ModelProfile, _is_view

__all__ = ["mutates_state", "op_segments", "without_stateful_segments", "saved_by", "holder_of_producer",
           "savers_of_producer", "segment_inputs", "storage_base", "node_vals"]

# Kinds whose values are held all step whatever is recomputed: never a segment's kept input.
_HELD = (NodeKind.PARAMETER, NodeKind.BUFFER, NodeKind.INPUT)

_BATCH_NORMS = ("aten.batch_norm.", "aten._native_batch_norm_legit", "aten.native_batch_norm.",
                "aten.cudnn_batch_norm.", "aten._batch_norm_impl_index.")


def node_vals(node: fx.Node) -> tuple[Any, ...]:
    """A node's ``meta["val"]`` as a tuple (one element for a single-output node)."""
    val = node.meta.get("val")
    return tuple(val) if isinstance(val, (tuple, list)) else (val,)


def mutates_state(node: fx.Node) -> bool:
    """Whether running ``node`` again would change model state: an in-place write into a
    parameter or buffer (BatchNorm's ``num_batches_tracked += 1``), or a training-mode batch norm
    that updates its running statistics. Such ops must never be recomputed in backward."""
    if node.op != "call_function":
        return False
    try:
        written, batch_norm = _mutation_info(node.target)
    except TypeError:  # an unhashable callable target
        written, batch_norm = _mutation_info.__wrapped__(node.target)
    for i in written:
        value = node.args[i] if i < len(node.args) else None
        if isinstance(value, fx.Node) and value.op == "placeholder":
            return True
    if batch_norm:
        args = list(node.args) + [None] * 6
        running_mean = node.kwargs.get("running_mean", args[3])
        training = node.kwargs.get("training", args[5])
        return running_mean is not None and bool(training)
    return False


@functools.lru_cache(maxsize=None)
def _mutation_info(target: Any) -> tuple[tuple[int, ...], bool]:
    """(positions of the arguments ``target`` writes, whether it is a batch norm), per op: every
    repeat of a block asks for the same few targets."""
    schema = getattr(target, "_schema", None)  # ATen overloads have one, Python callables not
    written = () if schema is None else tuple(
        i for i, arg in enumerate(schema.arguments) if arg.alias_info is not None and arg.alias_info.is_write)
    return written, str(target).startswith(_BATCH_NORMS)


def op_segments(ops: Iterable[tuple[str, str]]) -> dict[str, str | None]:
    """Op name -> its segment, for ``ops`` = (name, module path) in graph order (module docstring).

    A module whose ops resume after other ops gets a fresh segment (``"<module>#2"``), so every
    segment is one contiguous run; ops outside any repeated block get None."""
    out: dict[str, str | None] = {}
    runs: Counter[str] = Counter()  # module -> runs of it so far
    current: tuple[str, str] | None = None  # (module, segment) of the run in progress
    for name, path in ops:
        block = block_of(path)
        if block is None:
            out[name], current = None, None
            continue
        module = f"{block}.(self)" if path == block else path  # the block's own ops: not the block
        if current is None or current[0] != module:
            runs[module] += 1
            current = (module, module if runs[module] == 1 else f"{module}#{runs[module]}")
        out[name] = current[1]
    return out


def without_stateful_segments(problem: Problem, traced: TracedGraph) -> Problem:
    """``problem`` without the segments of blocks holding an op that mutates state
    (``mutates_state``): recomputing them would update running statistics twice."""
    tainted = {block_of(n.segment) for n in problem.nodes
               if n.segment is not None and mutates_state(traced.node(n.name))}
    if not tainted:
        return problem
    nodes = tuple(replace(n, segment=None) if n.segment is not None and block_of(n.segment) in tainted
                  else n for n in problem.nodes)
    return replace(problem, nodes=nodes)


def saved_by(prof: ModelProfile) -> dict[int, str]:
    """Saved storage id -> the node whose activation counts it: its *last* saver in graph order.

    A storage several nodes save (attention's output, saved by the attention op and by the
    projection reading it) is held until the last of them has run its backward, and by any one
    of them that is not recomputed. Counting it at the last saver, and as a recompute region's
    kept input exactly when that saver is inside the region (``segment_inputs``), is right
    whichever of the savers are recomputed: a kept last saver holds it; a recomputed one's
    region keeps it as an input (a region that reads a storage from outside holds it)."""
    out: dict[int, str] = {}
    for p in prof.nodes:
        for sid, _, _ in p.saved_parts:
            out[sid] = p.name
    return out


def holder_of_producer(prof: ModelProfile) -> dict[str, str]:
    """Producer node -> the node counting the storages it made (``saved_by``); a profile without
    parts: the first node saving them."""
    out: dict[str, str] = {}
    last = saved_by(prof)
    for p in prof.nodes:
        for producer in p.saved_from:
            out.setdefault(producer, p.name)
        for sid, producer, _ in p.saved_parts:
            out[producer] = last[sid]
    return out


def savers_of_producer(prof: ModelProfile) -> dict[str, tuple[str, ...]]:
    """Producer node -> every node saving a storage it made, in graph order."""
    out: dict[str, list[str]] = {}
    for p in prof.nodes:
        for _, producer, _ in p.saved_parts:
            names = out.setdefault(producer, [])
            if not names or names[-1] != p.name:
                names.append(p.name)
    return {k: tuple(v) for k, v in out.items()}


def _kept_copy(decisions: Mapping[str, Decision], seg: str, segment_of: Mapping[str, str],
               savers: Iterable[str], base: str, traced: TracedGraph, mesh_shape: tuple[int, ...],
               base_of: Callable[[fx.Node], str] | None) -> SegmentInput | None:
    """What the runtime keeps of a value the segment reads whose last saver is inside it while an
    earlier reader outside it saves it too: that reader's copy, in ITS input layout (a gathered
    copy when it reads the value converted, as two column-parallel projections of one norm's
    output do) -- it holds it whether or not the segment is recomputed, and the segment's
    checkpoint keeps that same conversion's output (the emitter converts once for both). None
    when no reader outside saves it (the segment keeps the value as its producer laid it out)."""
    for name in reversed(tuple(savers)):
        reader = decisions.get(name)
        if reader is None or segment_of.get(name) == seg:
            continue
        for slot, value in enumerate(reader.inputs):
            if value is None:
                continue
            node = traced.node(value.producer)
            if (storage_base(node).name if base_of is None else base_of(node)) != base:
                continue
            sizes = tuple(value.local_bytes(c.input_specs[slot], mesh_shape)
                          if slot < len(c.input_specs) and c.input_specs[slot] is not None else 0
                          for c in reader.choices)
            if all(sizes):
                return SegmentInput(name, sizes)
    return None


def segment_inputs(traced: TracedGraph, prof: ModelProfile, decisions: Mapping[str, Decision],
                   mesh_shape: tuple[int, ...], segment_of: Mapping[str, str], *,
                   base_of: Callable[[fx.Node], str] | None = None) -> dict[str, tuple[SegmentInput, ...]]:
    """Per segment (``segment_of``: op decision -> segment; each a contiguous run of ops), the
    activation values its ops read from outside it, with their local bytes per producer option.
    Left out: parameters, buffers and user inputs (held anyway), and values whose storage is
    counted by a node outside the segment (``saved_by``: that node, or its own region, holds it
    whatever the segment does). Non-float tensors count too: the checkpoint keeps every tensor
    input. ``base_of``: ``storage_base(node).name``, from the caller's cache."""
    holder = holder_of_producer(prof)
    savers = savers_of_producer(prof)
    out: dict[str, list[SegmentInput]] = {}
    seen: set[tuple[str, str, int]] = set()
    # Local bytes per producer option: repeated blocks' producers share their choices, so each
    # (choices, output, shape) is sized once.
    sizes_of: dict[tuple, tuple[int, ...]] = {}
    for dst in decisions.values():
        seg = segment_of.get(dst.name)
        if seg is None:
            continue
        for value in dst.inputs:
            if value is None:
                continue
            src = value.producer
            if segment_of.get(src) == seg or decisions[src].kind in _HELD:
                continue
            if (seg, src, value.index) in seen:
                continue
            seen.add((seg, src, value.index))
            src_node = traced.node(src)
            vals = node_vals(src_node)
            if value.index >= len(vals) or not isinstance(vals[value.index], torch.Tensor):
                continue
            base = storage_base(src_node).name if base_of is None else base_of(src_node)
            saver = holder.get(base)
            if saver is not None and segment_of.get(saver) != seg:
                continue
            copy = _kept_copy(decisions, seg, segment_of, savers.get(base, ()), base, traced, mesh_shape, base_of)
            if copy is not None:
                out.setdefault(seg, []).append(copy)
                continue
            choices = decisions[src].choices
            key = (id(choices), value.index, value.shape, value.itemsize)
            sizes = sizes_of.get(key)
            if sizes is None:
                sizes = sizes_of[key] = tuple(value.local_bytes(c.output_specs[value.index], mesh_shape)
                                              for c in choices)
            out.setdefault(seg, []).append(SegmentInput(src, sizes))
    return {k: tuple(v) for k, v in out.items()}


def storage_base(node: fx.Node) -> fx.Node:
    """The node whose output owns ``node``'s storage (through views and ``getitem``)."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node) and (
            node.target is operator.getitem or _is_view(node.target)):
        node = node.args[0]
    return node
