"""Depth-independent problem build: the records of a repeated block's ops, stamped from block 2's.

A graph of N identical blocks (``TracedGraph.block_structure``: same ops, shapes, module paths and
wiring relative to the block, checked by ``autopar.tracer.depth``) gives every op of block k the
records of the same op of block 2, up to renaming: the same strategies, options, choices and edge
matrices, its inputs read from block k / k-1 where block 2's read block 2 / 1, its own parameters
where block 2's read block 2's. The builder computes block 2 op by op (``_Builder._op``, which
hands each template op's records to :meth:`BlockStamps.keep`) and stamps blocks 3 .. N-1 from them.

What the graph's shape does not fix is checked per block or per op before a record is stamped,
and an op that fails a check is built on its own (the same records, computed):

* per block: which values take a gradient (a frozen block prices no gradient sums) and where each
  value's storage lives (the activation parts an option counts), renamed, equal to block 2's;
* per op: the decisions its inputs read hold the very ``Choice`` tuples block 2's inputs hold (so
  the same parameter layouts, ZeRO and offload options, hence the same edge matrices); the storages
  whose last saver it is (the profile's), renamed; the previous reader of each input
  (``ReaderChain``, fed here in graph order as the per-op path feeds it), renamed.

``tests/planner/test_builder.py`` compares the stamped build with the op-by-op build.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from autopar.layout.blocks import block_of, split_block
from autopar.planner.records import Decision, InputSlot
from autopar.planner.segments import storage_base
from autopar.plans import NodeKind
from autopar.solver.problem import Node
from autopar.tracer.depth import blocks_of
from autopar.tracer.graph import BUFFER, PARAMETER, TracedGraph

__all__ = ["BlockStamps", "Template"]

_TEMPLATE = 2  # the block whose ops are computed and stamped onto the later ones


@dataclass(frozen=True, slots=True)
class Template:
    """What block 2's op left in the builder: its records and what they were computed from."""

    decision: Decision
    node: Node
    values: tuple[InputSlot | None, ...]
    parts: tuple[tuple[str, int], ...]  # (storage producer, bytes) whose last saver it is
    shared: tuple[tuple[int, tuple[str, int]], ...]  # slot -> its value's previous reader
    edges: tuple[tuple[str, np.ndarray], ...]  # (source, matrix) in the order they were added
    fallback: bool


class BlockStamps:
    """Which ops are stamped from which template op, and the renaming per block."""

    def __init__(self, traced: TracedGraph, needs_grad: set[str], base_of: Callable[[Any], str]) -> None:
        self.traced, self.needs_grad, self.base_of = traced, needs_grad, base_of
        self.s = blocks_of(traced)
        self.templates: dict[str, Template] = {}
        self.template_of: dict[str, tuple[str, int]] = {}  # stamped op -> (template op, block)
        self.is_template: set[str] = set()
        self._rename: tuple[int, dict[str, str] | None] = (-1, None)  # the current block's
        if self.s is None or len(self.s.blocks) <= _TEMPLATE + 1:
            self.s = None
            return
        blocks = self.s.blocks
        self.is_template = {n.name for n in blocks[_TEMPLATE]}
        for k in range(_TEMPLATE + 1, len(blocks)):
            for t, n in zip(blocks[_TEMPLATE], blocks[k]):
                self.template_of[n.name] = (t.name, k)
        # Block -> {relative FQN: placeholder name} of its own parameters and buffers.
        self._params: dict[int, dict[str, str]] = {k: {} for k in range(len(blocks))}
        # ``Node.block`` of block k's ops (module paths of a run all name that block: depth.py)
        self._block_names = [block_of(traced.module_path(run[0])) for run in blocks]
        for p in traced.placeholders:
            where = split_block(p.fqn) if p.kind in (PARAMETER, BUFFER) else None
            if where is not None and where[0] == self.s.prefix and where[1] in self._params:
                own = f"{self.s.prefix}.{where[1]}"
                self._params[where[1]][p.fqn[len(own):]] = p.name

    # ------------------------------------------------------------------------------ renaming
    def rename(self, k: int) -> dict[str, str] | None:
        """Block 2's names (and blocks 0, 1's, its own parameters') -> block k's (k-2, k-1's, its
        own); None when block k cannot be stamped (a check below fails)."""
        if self._rename[0] != k:
            self._rename = (k, self._make_rename(k))
        return self._rename[1]

    def _make_rename(self, k: int) -> dict[str, str] | None:
        blocks, t = self.s.blocks, _TEMPLATE
        mine, theirs = self._params[k], self._params[t]
        if mine.keys() != theirs.keys():
            return None
        out = {theirs[rel]: mine[rel] for rel in theirs}
        for d in range(t + 1):  # blocks 0 .. 2 -> k-2 .. k
            out.update((a.name, b.name) for a, b in zip(blocks[t - d], blocks[k - d]))
        # Values taking a gradient (a frozen block prices no gradient sum) and storage owners
        # (the activation parts an option counts), in block k and the block it reads:
        for d in (0, 1):
            for a, b in zip(blocks[t - d], blocks[k - d]):
                if (a.name in self.needs_grad) != (b.name in self.needs_grad):
                    return None
                base = self.base_of(a)
                if out.get(base, base) != self.base_of(b):
                    return None
        for rel, name in theirs.items():
            if (name in self.needs_grad) != (mine[rel] in self.needs_grad):
                return None
        return out

    def template_node(self, name: str):
        """The fx node of stamped op ``name``'s template."""
        return self.traced.node(self.template_of[name][0])

    # ------------------------------------------------------------------------------ records
    def keep(self, name: str, template: Template) -> None:
        self.templates[name] = template

    def stamp(self, name: str, decisions, parts: list[tuple[str, int]]) -> tuple[Template, dict, tuple, str] | None:
        """Block k's op ``name`` from its template: (the template, block k's renaming, the op's
        inputs renamed, block k's name) when the per-block and input checks hold, else None (build
        it on its own).
        ``parts``: the op's own saved parts (``_Builder._saved_parts``)."""
        where = self.template_of.get(name)
        if where is None:
            return None
        t = self.templates.get(where[0])
        rename = self.rename(where[1]) if t is not None else None
        if rename is None:
            return None
        inputs = []
        for v in t.decision.inputs:
            if v is None:
                inputs.append(None)
                continue
            mine = decisions.get(rename.get(v.producer, v.producer))
            if mine is None or mine.choices is not decisions[v.producer].choices:
                return None
            inputs.append(InputSlot(mine.name, v.index, v.shape, v.itemsize))
        if tuple((rename.get(p, p), b) for p, b in t.parts) != tuple(parts):
            return None
        return t, rename, tuple(inputs), self._block_names[where[1]]

    def shared_matches(self, t: Template, rename: dict, shared: dict, decisions) -> bool:
        """The previous readers found for the stamped op are block 2's, renamed, and hold the
        same choices (so the gradient-sum edges from them are block 2's matrices)."""
        if len(shared) != len(t.shared):
            return False
        for slot, (reader, reader_slot) in t.shared:
            got = shared.get(slot)
            mine = rename.get(reader, reader)
            if got != (mine, reader_slot) or decisions[mine].choices is not decisions[reader].choices:
                return False
        return True


def stamped_records(t: Template, name: str, inputs: tuple, *, module: str, block: str, live,
                    segment: str | None) -> tuple[Decision, Node, tuple[InputSlot | None, ...]]:
    """The stamped op's ``Decision``, ``Node`` and output values."""
    decision = Decision(name, NodeKind.OP, t.decision.choices, inputs, module=module, op=t.decision.op)
    node = Node(name, t.node.options, live=live, block=block, signature=t.node.signature, segment=segment)
    values = tuple(None if v is None else InputSlot(name, v.index, v.shape, v.itemsize) for v in t.values)
    return decision, node, values
