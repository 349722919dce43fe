"""Depth-independent profiling: profile a shallow cut of a graph of identical blocks, stamp the rest.

A model of N identical blocks (``transformer.h.0`` ... ``transformer.h.{N-1}``; block 0 may be of
another kind, e.g. DeepSeek-V3's dense first layer before its MoE layers: blocks 1 .. N-1 must
be identical, each reading the previous one by distance from its end) profiles each op of
block k (0 < k < N-1) like the matching op of block 2: same op, shapes and wiring, so the same
FLOPs, bytes and saved storages, up to renaming. :func:`block_structure` recognises that shape
of graph (the graph before, N blocks in a row, the graph after; each block reading only itself,
the previous block, the graph before and its own parameters); :func:`shallow_graph` cuts blocks
3 .. N-2 out (the last block then reads block 2); :func:`stamp` expands the cut graph's profile
to the full one. Anything not recognised returns None and the caller profiles the full graph.

Exactness: the cut graph up to block 2 is the full graph's prefix, so its forward profile is the
same; block k's ops see the same saved-storage history as block 2's (a storage made before the
blocks is first saved in block 0; one made in block k-1 by block k-1's ops). ``stamp`` checks
that block 1 and block 2 came out the same up to renaming before trusting it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch.fx as fx

from autopar.layout.blocks import split_block
from autopar.tracer.graph import (PLACEHOLDER_KEY, BUFFER, PARAMETER, TracedGraph, lazy_graph_module, map_args,
                                  tensor_vals)

_TEMPLATE = 2      # the block whose profile is stamped onto blocks 3 .. N-2
_MIN_BLOCKS = 6    # below this the cut saves too little to be worth the checks


@dataclass(frozen=True)
class BlockStructure:
    """Op nodes of a graph split as ``before + blocks[0] + ... + blocks[N-1] + after``."""

    prefix: str
    blocks: tuple[tuple[fx.Node, ...], ...]
    before: tuple[fx.Node, ...]
    after: tuple[fx.Node, ...]


def blocks_of(traced: TracedGraph) -> BlockStructure | None:
    """``block_structure(traced)``, found once per graph (kept on it until a rewrite; the unrolled
    trace hands over the blocks it made): the profile and the problem builder both walk them."""
    if traced._blocks is None:
        traced._blocks = (block_structure(traced),)
    return traced._blocks[0]


def block_structure(traced: TracedGraph, *, indices: tuple[int, ...] | None = None,
                    min_blocks: int = _MIN_BLOCKS) -> BlockStructure | None:
    """The graph's repeated blocks, when they are identical and wired as a chain; else None.
    ``indices``: the block indices expected, in order (default 0 .. N-1)."""
    ops = [n for n in traced.graph.nodes if n.op not in ("placeholder", "output")]
    where = [split_block(traced.module_path(n)) for n in ops]
    inside = [i for i, w in enumerate(where) if w is not None]
    if not inside:
        return None
    first, last = inside[0], inside[-1]
    prefix = where[first][0]
    runs: list[list[fx.Node]] = []
    seen: list[int] = []
    for i in range(first, last + 1):
        w = where[i]
        if w is None or w[0] != prefix or ops[i].op != "call_function":
            return None  # a node between blocks, a second stack or a subgraph: not a plain chain
        if not seen or w[1] != seen[-1]:
            if w[1] in seen:
                return None
            seen.append(w[1])
            runs.append([])
        runs[-1].append(ops[i])
    if tuple(seen) != (indices if indices is not None else tuple(range(len(seen)))) \
            or len(runs) < min_blocks:
        return None
    structure = BlockStructure(prefix, tuple(tuple(r) for r in runs), tuple(ops[:first]),
                               tuple(ops[last + 1:]))
    position = {n: (k, j) for k, run in enumerate(structure.blocks) for j, n in enumerate(run)}
    signatures = [_signature(traced, structure, k, seen[k], position) for k in range(len(runs))]
    if any(s is None or s != signatures[1] for s in signatures[1:]):
        return None
    if any(position.get(a, (len(runs) - 1,))[0] != len(runs) - 1
           for n in (*structure.after, traced.output_node) for a in n.all_input_nodes):
        return None  # the graph after the blocks reads an inner block (e.g. every hidden state)
    return structure


def _signature(traced: TracedGraph, s: BlockStructure, k: int, label: int, index: dict) -> tuple | None:
    """Block k's ops with their inputs named relative to the block: equal signatures, equal costs."""
    own = f"{s.prefix}.{label}"
    out = []
    for node in s.blocks[k]:
        bad = False

        def token(arg: Any) -> Any:
            nonlocal bad
            if not isinstance(arg, fx.Node):
                return ("c", type(arg).__name__, repr(arg))
            if arg in index:
                kb, j = index[arg]
                if kb not in (k, k - 1):
                    bad = True
                # The previous block's ops by their distance from its end: block 1 then reads a
                # different first block (DeepSeek-V3's dense layer 0 before its MoE layers) as
                # block 2 reads block 1.
                return ("b", k - kb, j if kb == k else j - len(s.blocks[kb]))
            info = arg.meta.get(PLACEHOLDER_KEY)
            if info is not None and info.kind in (PARAMETER, BUFFER) and info.fqn.startswith(own + "."):
                return ("w", info.fqn[len(own):])
            if info is None and arg.op != "placeholder" and split_block(traced.module_path(arg)):
                bad = True
            return ("x", arg.name)

        args = map_args((node.args, node.kwargs), token)
        vals = tuple((tuple(v.shape), v.dtype, tuple(v.stride())) for v in tensor_vals(node.meta.get("val")))
        path = traced.module_path(node)[len(own):]
        out.append((str(node.target), repr(args), vals, path))
        if bad:
            return None
    return tuple(out)


def shallow_graph(traced: TracedGraph, s: BlockStructure) -> TracedGraph:
    """The graph without blocks 3 .. N-2: the last block reads block 2 where it read block N-2."""
    n = len(s.blocks)
    cut = {node for run in s.blocks[_TEMPLATE + 1:n - 1] for node in run}
    redirect = dict(zip(s.blocks[n - 2], s.blocks[_TEMPLATE]))
    used: set[fx.Node] = set()
    for node in traced.graph.nodes:
        if node not in cut:
            used.update(node.all_input_nodes)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in traced.graph.nodes:
        if node in cut or (node.op == "placeholder" and node not in used
                           and node.meta[PLACEHOLDER_KEY].kind in (PARAMETER, BUFFER)):
            continue
        env[node] = graph.node_copy(node, lambda a: env[redirect.get(a, a)])
        assert env[node].name == node.name, (node.name, env[node].name)
    gm = lazy_graph_module(traced.gm, graph)
    kept = {node.name for node in graph.nodes}
    shallow = TracedGraph(gm, placeholders=tuple(p for p in traced.placeholders if p.name in kept),
                          in_spec=traced.in_spec, out_spec=traced.out_spec,
                          constants=traced.constants, loss_name=traced.loss_node.name
                          if traced.loss_node is not None else None, model_name=traced.model_name)
    shallow.precision = traced.precision
    return shallow


def stamp(traced: TracedGraph, s: BlockStructure, shallow_nodes: tuple) -> list | None:
    """Full-graph NodeProfiles, in op order, from the shallow graph's (None: blocks differ)."""
    by_name = {p.name: p for p in shallow_nodes}
    n = len(s.blocks)
    names = [[node.name for node in run] for run in s.blocks]
    block_of_name = {nm: (k, j) for k, run in enumerate(names) for j, nm in enumerate(run)}
    keys = _storage_keys(shallow_nodes)

    def shift(src: int, dst: int) -> dict[str, str]:
        """Names in blocks src-1, src -> the same ops in blocks dst-1, dst (the previous blocks
        matched from their ends: block 0 may differ, ``_signature``)."""
        return {**dict(zip(*tail_aligned(names[src - 1], names[dst - 1]))), **dict(zip(names[src], names[dst]))}

    ids: dict = {}  # storage key -> id in first-saved order, as a full profile numbers them

    def moved(p, rename: dict, name: str, module: str, *, number: bool = False):
        """``p`` renamed; ``number``: its storages numbered (called in op order), else keyed."""
        parts = tuple(((rename.get(keys[sid][0], keys[sid][0]), keys[sid][1]), rename.get(producer, producer),
                       nbytes) for sid, producer, nbytes in p.saved_parts)
        if number:
            parts = tuple((ids.setdefault(key, len(ids)), producer, nbytes) for key, producer, nbytes in parts)
        return _replaced(p, name=name, module=module, saved_from=tuple(rename.get(f, f) for f in p.saved_from),
                         saved_parts=parts)

    def reads_only(p, blocks: set[int]) -> bool:
        """Every storage ``p`` keeps was made outside the blocks or in one of ``blocks``."""
        return all(block_of_name.get(f, (None,))[0] in (None, *blocks)
                   for f in (*p.saved_from, *(x[1] for x in p.saved_parts)))

    # Trust the template only if block 1 (after block 0) and block 2 (after block 1) agree.
    one_to_two = shift(1, _TEMPLATE)
    for a, b in zip(names[1], names[_TEMPLATE]):
        pa, pb = by_name[a], by_name[b]
        if moved(pa, one_to_two, b, pb.module) != moved(pb, {}, b, pb.module) \
                or not reads_only(pb, {_TEMPLATE - 1, _TEMPLATE}):
            return None
    tail = shift(_TEMPLATE, n - 2)  # the last block and after read block 2 where they read N-2
    rename, shifted_to = {}, None  # block k's renaming, made once per block
    before = set(s.before)
    out = []
    for node in traced.compute_nodes():
        k, j = block_of_name.get(node.name, (None, None))
        if k is None or k <= _TEMPLATE or k == n - 1:
            p = by_name[node.name]
            if k is None and node in before or k is not None and k <= _TEMPLATE:
                out.append(moved(p, {}, p.name, p.module, number=True))  # the full graph's own prefix
                continue
            if not reads_only(p, {_TEMPLATE, n - 1}):
                return None  # the tail keeps a storage of an early block: not a chain
            out.append(moved(p, tail, p.name, p.module, number=True))
            continue
        if k != shifted_to:
            rename, shifted_to = shift(_TEMPLATE, k), k
        src = by_name[names[_TEMPLATE][j]]
        out.append(moved(src, rename, node.name, traced.module_path(node), number=True))
    return out


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _replaced(p: Any, **changes: Any) -> Any:
    """``dataclasses.replace(p, **changes)`` for a plain dataclass (every field an init field),
    with its field names looked up once per class: stamping makes one per op of a deep model."""
    names = _FIELD_NAMES.get(type(p))
    if names is None:
        names = _FIELD_NAMES[type(p)] = tuple(f.name for f in fields(p))
    return type(p)(**{name: changes[name] if name in changes else getattr(p, name) for name in names})


def _storage_keys(nodes: tuple) -> dict[int, tuple[str, int]]:
    """Storage id -> (producer, ordinal among the producer's saved storages): a name that
    survives renaming (ids are per profile)."""
    seen: dict[int, tuple[str, int]] = {}
    count: dict[str, int] = {}
    for p in nodes:
        for sid, producer, _ in p.saved_parts:
            if sid not in seen:
                seen[sid] = (producer, count.get(producer, 0))
                count[producer] = count.get(producer, 0) + 1
    return seen


def tail_aligned(a, b) -> tuple:
    """``a`` and ``b`` cut to their common length from the end: ops of a block the next one reads
    by distance from its end (``_signature``), paired even when the first block is different."""
    m = min(len(a), len(b))
    return tuple(a[len(a) - m:]), tuple(b[len(b) - m:])
