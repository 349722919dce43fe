"""Where a pipeline can be cut: repeated blocks, each op's block position, stage ranges.

A pipeline stage holds a contiguous run of whole repeated blocks (``transformer.h.3``,
``model.layers.3``: :mod:`autopar.layout.blocks`) of the repeated-block container, the module
prefix with the most block indices (GPT-2's ``transformer.h``):

- ops are walked in graph order: an op inside block b has position b, any other op the position
  of the latest block op before it (so embeddings and everything before the first block go with
  block 0, the final norm, the head and the loss with the last block); a ``getitem`` goes with
  the op whose output it reads; the stage holding blocks ``[a, b)`` runs the ops of positions
  ``a .. b - 1``;
- a parameter, buffer or user input is listed in every stage that reads it (GPT-2's tied
  ``wte``: the first and the last stage); values crossing a cut are the runtime's business
  (:mod:`autopar.runtime.pipeline.split`).

Stage k runs on pipeline rank ``k % S`` (the loop placement of torch's interleaved schedules).

``even_stages(traced, num_stages=S, virtual_stages=v)`` is the simple, cost-free cut the runtime
is tested with: ``S * v`` stages, stage k holding blocks ``[k * N // K, (k + 1) * N // K)`` of N.
``StageGeometry`` is what the stage search prices (:mod:`autopar.planner.pipeline.costs`): every
op's position, each stage range's decisions, the bytes crossing each cut, the blocks a stage
can recompute, and range *families* (ranges that differ only in how many identical interior
blocks they hold). ``micro_inputs`` cuts the inputs to one micro-batch, the graph the stages
are planned on.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np

from autopar.layout.blocks import block_of, split_block
from autopar.plans import NodeKind, StagePlan
from autopar.planner.records import BuiltProblem
from autopar.solver.timeline import segment_geometry
from autopar.tracer.attention_form import input_independent
from autopar.tracer.graph import MODULE_KEY, TracedGraph

__all__ = ["even_stages", "block_container", "StageGeometry", "batch_size", "micro_inputs", "microbatch_counts",
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


def batch_size(meta_inputs: Any) -> int:
    """Dim 0 of the first tensor input (the batch every batch-major input shares;
    :mod:`autopar.tracer.microbatch`, the rule the runtime splits by too)."""
    from autopar.tracer.microbatch import batch_size as rule_batch_size

    return rule_batch_size(meta_inputs)


def micro_inputs(meta_inputs: Any, num_microbatches: int) -> Any:
    """``meta_inputs`` with every batch-major tensor cut to one micro-batch (its first rows), every
    other input whole: :func:`autopar.tracer.microbatch.micro_batch`, the rule the runtime's
    pipeline splits full batches by, so the traced micro-batch graph is the one run."""
    from autopar.tracer.microbatch import micro_batch

    return micro_batch(meta_inputs, num_microbatches)


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


class StageGeometry:
    """The stage ranges of one micro-batch Problem (``built``, solved on the stage sub-mesh) over
    the blocks of ``traced`` (module docstring): positions, decisions, cut bytes, recompute
    units and range families. Plain structure, no cost: ``StageCosts`` prices it."""

    def __init__(self, traced: TracedGraph, built: BuiltProblem) -> None:
        found = block_container(traced)
        if found is None:
            raise ValueError(f"{traced.model_name} has no repeated blocks to cut into pipeline stages")
        self.traced, self.built = traced, built
        self.prefix, self.num_blocks = found
        self._position()
        self._classes()
        self._boundaries()
        self._recompute_units()

    # ------------------------------------------------------------------------- structure
    def _position(self) -> None:
        """Block position of every op (as ``even_stages``) and the positions reading each placeholder."""
        pos: dict[str, int] = {}
        in_block: set[str] = set()  # ops inside a block of the container (not before or after all blocks)
        current = 0
        for node in self.traced.nodes:
            if node.op in ("placeholder", "output"):
                continue
            if node.op == "call_function" and node.target is operator.getitem and node.args[0].name in pos:
                pos[node.name] = pos[node.args[0].name]
                if node.args[0].name in in_block:
                    in_block.add(node.name)
                continue
            where = split_block(node.meta.get(MODULE_KEY, ""))
            if where is not None and where[0] == self.prefix:
                current = max(current, where[1])
                in_block.add(node.name)
            pos[node.name] = current
        last = self.num_blocks - 1
        readers: dict[str, set[int]] = {}
        for node in self.traced.nodes:
            if node.op == "placeholder":
                readers[node.name] = {pos[u.name] for u in node.users if u.name in pos}
                if any(u.op == "output" for u in node.users):
                    readers[node.name].add(last)
        self.pos, self.readers, self.in_block = pos, readers, in_block
        self.kind = {n.name: self.built.decision(n.name).kind for n in self.built.problem.nodes}

    def _classes(self) -> None:
        """Blocks with equal decision signatures get one class id (ranges of equal classes share solves)."""
        sigs: dict[int, list[str]] = {b: [] for b in range(self.num_blocks)}
        for node in self.built.problem.nodes:
            if node.name in self.pos and self.kind[node.name] == NodeKind.OP:
                sigs[self.pos[node.name]].append(node.signature + "|" + ",".join(o.name for o in node.options))
        ids: dict[tuple, int] = {}
        self.block_class = tuple(ids.setdefault(tuple(sigs[b]), len(ids)) for b in range(self.num_blocks))

    def _boundaries(self) -> None:
        """Bytes crossing each cut ``b`` (between blocks b - 1 and b): tensors made before, read after.
        An input-independent value (a causal mask from ``arange``s) is computed by every stage
        reading it, never sent (``runtime.pipeline.split``)."""
        import torch

        delta = [0] * (self.num_blocks + 1)
        placeholders = {p.name: p for p in self.traced.placeholders}
        free = input_independent(self.traced.gm.graph)
        for node in self.traced.nodes:
            if node.op == "output" or node in free:
                continue
            if node.op == "placeholder":
                if placeholders[node.name].kind != NodeKind.INPUT:
                    continue  # parameters and buffers are held by their stages, never sent
                made = 0
                reads = self.readers[node.name]
            else:
                made = self.pos[node.name]
                reads = {self.pos[u.name] for u in node.users if u.name in self.pos}
                if any(u.op == "output" for u in node.users):
                    reads.add(self.num_blocks - 1)
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor) or not reads or max(reads) <= made:
                continue
            size = val.numel() * val.element_size()
            delta[made + 1] += size
            delta[max(reads) + 1] -= size
        self.boundary_bytes = tuple(int(x) for x in np.cumsum(delta))  # [b]: bytes crossing cut b

    def _recompute_units(self) -> None:
        """The stage-recomputable units (the container's blocks), the unit of each op and where
        each unit's backward begins (``autopar.solver.timeline``)."""
        geo = segment_geometry(self.built.problem)
        self.units = {u: g for u, g in geo.items()
                      if g.parent is None and (split_block(u) or ("", 0))[0] == self.prefix}
        self.unit_of: dict[str, str] = {}
        for node in self.built.problem.nodes:
            if node.segment is not None and self.kind[node.name] == NodeKind.OP:
                block = block_of(node.segment)
                if block in self.units:
                    self.unit_of[node.name] = block
        self.segment_inputs = getattr(self.built, "segment_inputs", None) or {}

    # ------------------------------------------------------------------------ stage ranges
    def decisions(self, a: int, b: int) -> set[str]:
        """The Problem decisions of the stage holding blocks ``[a, b)``."""
        return {node.name for node in self.built.problem.nodes if any(a <= p < b for p in self.blocks_of(node.name))}

    def blocks_of(self, name: str) -> set[int] | range:
        """The blocks whose stage holds decision ``name``: an op's, the blocks reading a
        placeholder, the last block for the output."""
        kind = self.kind[name]
        if kind == NodeKind.OUTPUT:
            return {self.num_blocks - 1}
        if name in self.readers:
            # Placeholders no op reads (a rotary embedding's unused buffer) stay with stage 0,
            # as ``autopar.runtime.pipeline.split`` keeps them.
            return self.readers[name] or {0}
        return {self.pos[name]}

    def stage_blocks(self, names: set[str]) -> set[int]:
        """The blocks of the recomputable ops among ``names``."""
        return {self.pos[n] for n in names if n in self.unit_of}

    def stage_plans(self, bounds: tuple[int, ...], *, num_stages: int) -> tuple[StagePlan, ...]:
        stages = []
        for k in range(len(bounds) - 1):
            a, b = bounds[k], bounds[k + 1]
            names = tuple(n.name for n in self.traced.nodes
                          if (n.op == "placeholder" and any(a <= p < b for p in self.readers[n.name]))
                          or (n.name in self.pos and a <= self.pos[n.name] < b))
            stages.append(StagePlan(index=k, rank=k % num_stages, layers=(a, b), nodes=names))
        return tuple(stages)

    def shape(self, a: int, b: int) -> tuple:
        """What the solves of ``[a, b)`` depend on: (first?, last?, its blocks' classes)."""
        return a == 0, b == self.num_blocks, self.block_class[a:b]

    # ---------------------------------------------------------------------- range families
    def family(self, a: int, b: int):
        """Ranges of one family differ only in how many interior blocks they hold, all of one
        class: (first?, last?, first block's class, last block's class, interior class)."""
        if b - a < 3 or len(set(self.block_class[a + 1:b - 1])) != 1:
            return None
        return a == 0, b == self.num_blocks, self.block_class[a], self.block_class[b - 1], self.block_class[a + 1]

    def member(self, a: int, b: int, length: int) -> tuple[int, int] | None:
        """The range of ``length`` blocks in the family of ``[a, b)`` (same first/last flags)."""
        lo = 0 if a == 0 else (self.num_blocks - length if b == self.num_blocks else a)
        hi = lo + length
        if lo < 0 or hi > self.num_blocks or (lo == 0) != (a == 0) or (hi == self.num_blocks) != (b == self.num_blocks):
            return None
        return (lo, hi) if self.family(lo, hi) == self.family(a, b) else None

    def per_block(self, a: int, b: int) -> tuple[list[list[str]], list[str]]:
        """Per block of ``[a, b)`` its decisions in problem order (its ops, the parameters only it
        reads), and the stage's other decisions."""
        per: list[list[str]] = [[] for _ in range(b - a)]
        rest = []
        for name in (n.name for n in self.built.problem.nodes):
            kind = self.kind[name]
            if kind == NodeKind.OP and name in self.in_block and a <= self.pos[name] < b:
                per[self.pos[name] - a].append(name)
            elif kind == NodeKind.PARAMETER and len(self.readers.get(name, ())) == 1 and \
                    a <= next(iter(self.readers[name])) < b:
                per[next(iter(self.readers[name])) - a].append(name)
            else:
                rest.append(name)
        return per, rest

    def pattern(self, a: int, b: int, choice: dict[str, str]):
        """The choice of ``[a, b)`` independent of its length: first, interior (all equal, as
        repeated-block aliasing makes them), last block's options, and the rest by name."""
        per, rest = self.per_block(a, b)
        inner = {tuple(choice[n] for n in blk) for blk in per[1:-1]}
        if len(inner) != 1:
            return None
        return (tuple(choice[n] for n in per[0]), inner.pop(), tuple(choice[n] for n in per[-1]),
                tuple((n, choice[n]) for n in rest if n in choice))
