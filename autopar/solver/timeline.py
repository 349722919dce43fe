"""The cost model evaluated for one choice: step time and the per-device memory timeline.

``evaluate`` is the one evaluator: ``Problem.evaluate`` is it, the solve pipeline checks every
solver answer with it (with or without recompute), and the report draws its memory chart from
its ``Evaluation.activations``. The model without recompute is the ``Problem`` docstring's.

Recompute (activation checkpointing). A *unit* is a checkpointable segment (``Node.segment``,
e.g. ``"transformer.h.3.attn"``) or the repeated block around it (``"transformer.h.3"``); units
that hold no activation do not exist. On the timeline a unit spans ``[start, end]``: the first
start and the last end of its nodes' ``live`` intervals, and ``bwd`` is the first end (where
the unit's backward begins). With a unit recomputed:

* each node's activation loses its *forward part* ``[start, bwd-1]`` and keeps its *backward
  part* ``[bwd, end]`` (backward rematerialises the whole unit when it reaches it, then frees
  each saved tensor after its own backward, as non-reentrant checkpoint does);
* the values the unit reads from outside (``SegmentInput``: what a checkpoint region keeps) are
  held on ``[start, end]``; a value several recomputed units read is one tensor, held from the
  first such unit's start to the last one's end;
* step time grows by the forward seconds (``StrategyOption.forward_s``) of its nodes.

An edge's memory (``Edge.mem``: a parameter copy its reader gathers and saves for backward) is
held on the edge's ``mem_live`` whether or not the reader is recomputed: the ILPs count it so (an
upper bound for a recomputed reader, whose checkpoint region re-gathers it in backward only).

A unit is recomputed alone or inside its block, never both. No torch import.

The functions here take a ``Problem`` (``autopar.solver.problem``) but name only the fields they
read (``Timed``): ``problem.py`` imports this module for ``Problem.evaluate``, so this one
importing ``Problem`` back would make the two one module in all but name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Iterable, Mapping, Protocol

from autopar.layout.blocks import block_of
from autopar.solver.overlap import hidden_seconds

__all__ = ["Evaluation", "SegmentInput", "SegmentInputs", "SegmentGeometry", "Timed", "segment_geometry", "evaluate",
           "activation_bytes", "edge_bytes_at"]


class Timed(Protocol):
    """What the evaluator reads of a ``autopar.solver.problem.Problem``: its nodes (``name``,
    ``options``, ``option_index``, ``live``, ``segment``), its edges (``src``, ``dst``,
    ``costs``, ``async_array``, ``mem_array``, ``mem_live``), its timeline's length and its ``comm_overlap``."""

    nodes: tuple[Any, ...]
    edges: tuple[Any, ...]
    timeline_length: int
    num_nodes: int
    comm_overlap: float

SegmentInputs = Mapping[str, Iterable["SegmentInput"]]  # unit -> the values it keeps when recomputed


@dataclass(frozen=True, slots=True)
class SegmentInput:
    """An activation a recomputed unit keeps: ``bytes[k]`` when node ``node`` runs option ``k``."""

    node: str
    bytes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SegmentGeometry:
    """Where a unit sits on the timeline (module docstring): ``[start, bwd-1]`` forward part,
    ``[bwd, end]`` backward part. ``parent``: the block of a fine segment (None for a block)."""

    name: str
    start: int
    bwd: int
    end: int
    parent: str | None = None


@dataclass(frozen=True, slots=True)
class Evaluation:
    """The cost model evaluated for one full choice (``evaluate``). Seconds for one training
    step; bytes per device."""

    objective: float  # seconds: compute + comm + reshard - hidden (compute includes recompute)
    compute_s: float
    comm_s: float  # in ops, asynchronous communication included (hidden or not)
    reshard_s: float
    param_bytes: int  # parameters, gradients and optimizer state, held the whole step
    activations: tuple[int, ...] = field(repr=False)  # live activation bytes per timeline point
    async_s: float = 0.0  # the part of comm_s issued asynchronously (``autopar.solver.overlap``)
    hidden_s: float = 0.0  # the part of async_s hidden under compute (not in objective)

    @property
    def exposed_async_s(self) -> float:
        """Asynchronous communication the step waits for: ``async_s - hidden_s``."""
        return max(self.async_s - self.hidden_s, 0.0)

    @property
    def peak_bytes(self) -> int:
        """``param_bytes`` + the largest live activation total."""
        return self.param_bytes + max(self.activations, default=0)

    @property
    def peak_time(self) -> int | None:
        """The first timeline point of the activation peak (None: no activations)."""
        top = max(self.activations, default=0)
        return self.activations.index(top) if top > 0 else None

    def __str__(self) -> str:
        hidden = f", {self.hidden_s:.4g}s of it hidden" if self.hidden_s else ""
        return (f"{self.objective:.6g}s (compute {self.compute_s:.4g}s, comm {self.comm_s:.4g}s{hidden}, "
                f"reshard {self.reshard_s:.4g}s), peak {self.peak_bytes}B at t={self.peak_time}")


def segment_geometry(problem: Timed) -> dict[str, SegmentGeometry]:
    """Every recomputable unit that holds activations: fine segments and their blocks."""
    spans: dict[str, list] = {}
    parent: dict[str, str | None] = {}
    for n in problem.nodes:
        if n.segment is None or n.live is None or not any(o.act_bytes for o in n.options):
            continue
        block = block_of(n.segment)
        parent[n.segment] = block if block != n.segment else None
        units = [n.segment] + ([block] if parent[n.segment] else [])
        s, e = n.live
        for u in units:
            span = spans.setdefault(u, [s, e, e])
            span[0], span[1], span[2] = min(span[0], s), min(span[1], e), max(span[2], e)
    out = {}
    for u, (s0, b, e) in spans.items():
        if not s0 < b:
            raise ValueError(f"segment {u!r}: an item ends at {b}, before the segment's forward ends")
        out[u] = SegmentGeometry(u, s0, b, e, parent.get(u))
    return out


def _chosen_units(recompute: Iterable[str], geo: Mapping[str, SegmentGeometry]) -> set[str]:
    chosen = set(recompute)
    unknown = chosen - set(geo)
    if unknown:
        raise ValueError(f"cannot recompute unknown segments {sorted(unknown)}; known: {sorted(geo)}")
    both = sorted(u for u in chosen if geo[u].parent in chosen)
    if both:
        raise ValueError(f"segments {both} are recomputed both alone and inside their block")
    return chosen


def _recomputed_unit(segment: str | None, chosen: set[str]) -> str | None:
    """The recomputed unit a node of ``segment`` belongs to: its block or its fine segment."""
    if segment is None:
        return None
    block = block_of(segment)
    return block if block in chosen else segment if segment in chosen else None


def _held_inputs(problem: Timed, inputs: SegmentInputs, pick: Mapping[str, int], chosen: set[str],
                 geo: Mapping[str, SegmentGeometry]) -> list[tuple[int, int, int]]:
    """(bytes, first, last timeline point) of every value the recomputed units keep, each value
    once (module docstring)."""
    held: dict[str, list] = {}
    for u in sorted(chosen):
        for si in inputs.get(u, ()):
            c = si.bytes[pick[si.node]]
            span = held.setdefault(si.node, [c, geo[u].start, geo[u].end])
            span[1], span[2] = min(span[1], geo[u].start), max(span[2], geo[u].end)
    return [tuple(v) for v in held.values()]


def _pick(problem: Timed, choice: Mapping[str, str]) -> dict[str, int]:
    """node name -> chosen option index; ``choice`` must name every node exactly."""
    missing = [n.name for n in problem.nodes if n.name not in choice]
    if missing or len(choice) != problem.num_nodes:
        names = {n.name for n in problem.nodes}
        extra = [k for k in choice if k not in names]
        raise ValueError(f"choice must name every node exactly: missing {missing[:5]}, unknown {extra[:5]}")
    return {n.name: n.option_index(choice[n.name]) for n in problem.nodes}


def evaluate(problem: Timed, choice: Mapping[str, str], *, recompute: Iterable[str] = (),
             segment_inputs: SegmentInputs | None = None) -> Evaluation:
    """Step time and memory timeline of ``choice`` (node name -> option name) with the units in
    ``recompute`` recomputed, keeping ``segment_inputs`` (unit -> ``SegmentInput``s; none when
    omitted)."""
    pick = _pick(problem, choice)
    geo = segment_geometry(problem) if recompute else {}
    chosen = _chosen_units(recompute, geo)
    compute = comm = reshard = recompute_s = async_s = overlap_s = 0.0
    params = 0
    delta = [0] * (problem.timeline_length + 1)
    for n in problem.nodes:
        o = n.options[pick[n.name]]
        compute += o.compute_s
        comm += o.comm_s
        async_s += o.async_s
        overlap_s += o.overlap_s
        params += o.param_bytes
        unit = _recomputed_unit(n.segment, chosen) if chosen else None
        if unit is not None:
            recompute_s += o.forward_s
        if n.live is not None and o.act_bytes:
            delta[n.live[0] if unit is None else geo[unit].bwd] += o.act_bytes
            delta[n.live[1] + 1] -= o.act_bytes
    for e in problem.edges:
        reshard += e.costs[pick[e.src]][pick[e.dst]]
        if e.async_array is not None:
            async_s += float(e.async_array[pick[e.src], pick[e.dst]])
        if e.mem_array is not None:
            c = int(e.mem_array[pick[e.src], pick[e.dst]])
            delta[e.mem_live[0]] += c
            delta[e.mem_live[1] + 1] -= c
    for c, first, last in _held_inputs(problem, segment_inputs or {}, pick, chosen, geo):
        delta[first] += c
        delta[last + 1] -= c
    delta.pop()
    hidden = hidden_seconds(problem.comm_overlap, async_s, overlap_s)
    total = compute + comm + reshard + recompute_s
    # Subtracted only when something hides: without overlap the objective is the plain sum, bit for bit.
    return Evaluation(total - hidden if hidden else total, compute + recompute_s, comm, reshard, params,
                      tuple(accumulate(delta)), async_s=async_s, hidden_s=hidden)


def edge_bytes_at(problem: Timed, choice: Mapping[str, str], t: int) -> int:
    """The part of ``evaluate``'s ``activations[t]`` held by edges (``Edge.mem``: parameter copies
    readers gathered and keep for backward) under ``choice``."""
    index = {n.name: n for n in problem.nodes}
    return sum(int(e.mem_array[index[e.src].option_index(choice[e.src]), index[e.dst].option_index(choice[e.dst])])
               for e in problem.edges if e.mem_array is not None and e.mem_live[0] <= t <= e.mem_live[1])


def activation_bytes(problem: Timed, choice: Mapping[str, str], *, recompute: Iterable[str] = (),
                     segment_inputs: SegmentInputs | None = None, include_inputs: bool = False) -> int:
    """Bytes saved for backward when the forward pass ends (the last forward point,
    ``timeline_length // 2 - 1``): what ``saved_tensors_hooks`` plus the checkpoint regions'
    kept inputs hold at that moment, per ``evaluate``. User inputs (held by the caller: live over
    the whole timeline) are left out unless ``include_inputs``."""
    recompute = tuple(recompute)
    t = problem.timeline_length // 2 - 1
    if t < 0:
        return 0
    total = evaluate(problem, choice, recompute=recompute, segment_inputs=segment_inputs).activations[t]
    if include_inputs:
        return total
    chosen = set(recompute)
    whole = (0, problem.timeline_length - 1)
    return total - sum(n.options[n.option_index(choice[n.name])].act_bytes for n in problem.nodes
                       if n.live == whole and _recomputed_unit(n.segment, chosen) is None)
