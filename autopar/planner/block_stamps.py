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
  (``ReaderChain``, fed here in graph order as the per-op path feeds it), renamed; no input is a
  parameter of the last gradient bucket (``BuiltProblem.exposed``: its sum hides nothing).

``tests/planner/test_builder.py`` compares the stamped build with the op-by-op build.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from autopar.layout.blocks import block_of, split_block
from autopar.planner.records import Decision, InputSlot
from autopar.plans import NodeKind
from autopar.solver.problem import Node
from autopar.tracer.depth import blocks_of, tail_aligned
from autopar.tracer.graph import BUFFER, MODULE_KEY, PARAMETER, TracedGraph

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
        self._facts: dict[int, tuple] = {}  # ``_template_facts``
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
        for d in range(t + 1):  # blocks 0 .. 2 -> k-2 .. k (block 0 may differ: matched from the end)
            out.update((a.name, b.name) for a, b in zip(*tail_aligned(blocks[t - d], blocks[k - d])))
        # Values taking a gradient (a frozen block prices no gradient sum) and storage owners
        # (the activation parts an option counts), in block k and the block it reads:
        needs_grad = self.needs_grad
        for d in (0, 1):
            pattern, views = self._template_facts(d)
            mine_run = blocks[k - d]
            if tuple(n.name in needs_grad for n in mine_run) != pattern:
                return None
            # A storage is its own owner unless the op is a view or ``getitem`` (the same ops in
            # every block: ``storage_base`` follows the same arguments); those are checked.
            for j, base in views:
                if out.get(base, base) != self.base_of(mine_run[j]):
                    return None
        for rel, name in theirs.items():
            if (name in self.needs_grad) != (mine[rel] in self.needs_grad):
                return None
        return out

    def _template_facts(self, d: int) -> tuple[tuple[bool, ...], tuple[tuple[int, str], ...]]:
        """Block 2-d's gradient pattern and (position, storage owner) of its ops owning none."""
        facts = self._facts.get(d)
        if facts is None:
            run = self.s.blocks[_TEMPLATE - d]
            bases = [(j, self.base_of(n)) for j, n in enumerate(run)]
            facts = self._facts[d] = (tuple(n.name in self.needs_grad for n in run),
                                      tuple((j, b) for j, b in bases if b != run[j].name))
        return facts

    def template_node(self, name: str):
        """The fx node of stamped op ``name``'s template."""
        return self.traced.node(self.template_of[name][0])

    # ------------------------------------------------------------------------------ records
    def keep(self, name: str, template: Template) -> None:
        self.templates[name] = template

    def stamp(self, b, node) -> bool | dict | None:
        """Block k's op ``node`` stamped into builder ``b`` (``planner.builder._Builder``) from
        its template: True when done; None when a check before the reader chain fails, or the
        previous readers the chain gave when a check after it fails (the op is then built on
        its own, with them: the chain is asked once per input)."""
        name = node.name
        where = self.template_of.get(name)
        if where is None:
            return None
        t = self.templates.get(where[0])
        rename = self.rename(where[1]) if t is not None else None
        if rename is None:
            return None
        decisions = b.decisions
        inputs = []
        for v in t.decision.inputs:
            if v is None:
                inputs.append(None)
                continue
            mine = decisions.get(rename.get(v.producer, v.producer))
            if mine is None or mine.choices is not decisions[v.producer].choices:
                return None
            if v.producer in b.exposed or mine.name in b.exposed:  # the last bucket's sums hide nothing
                return None
            inputs.append(InputSlot(mine.name, v.index, v.shape, v.itemsize))
        parts = b._saved_parts(node)
        if len(parts) != len(t.parts) or any((rename.get(p, p), n) != q for (p, n), q in zip(t.parts, parts)):
            return None
        previous = b.chain.previous
        shared = {slot: prev for slot, v in enumerate(inputs) if (prev := previous(name, slot, v)) is not None}
        if len(shared) != len(t.shared):
            return shared
        for slot, (reader, reader_slot) in t.shared:
            mine = rename.get(reader, reader)
            if shared.get(slot) != (mine, reader_slot) or decisions[mine].choices is not decisions[reader].choices:
                return shared
        # Every check holds: block 2's records, renamed.
        i = b.op_index[name]
        decisions[name] = Decision(name, NodeKind.OP, t.decision.choices, tuple(inputs),
                                   module=node.meta.get(MODULE_KEY, ""), op=t.decision.op,
                                   bucketed=t.decision.bucketed)
        b.nodes.append(Node(name, t.node.options, live=(i, 2 * b.num_ops - 1 - i) if parts else None,
                            block=self._block_names[where[1]], signature=t.node.signature,
                            segment=b.segment_of_op[name]))
        b.sources[name] = (name, 0)
        b.values[name] = tuple(None if v is None else InputSlot(name, v.index, v.shape, v.itemsize)
                               for v in t.values)
        if t.fallback:
            b.fallbacks.append(name)
        add_edge = b._add_edge
        for src, matrix, asy in t.edges:
            add_edge(rename.get(src, src), name, matrix, asy)
        return True
