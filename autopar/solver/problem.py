"""The planner's contract: a plain-data ``Problem`` in, a plain-data ``Solution`` out.

No torch import. Everything is str / int / float / tuples, frozen, with ``to_json``/``from_json``.
The problem builder (graph + profile + strategies -> ``Problem``) lives elsewhere; the solver
(``simplify``, the ILPs, ``pipeline``) only ever sees these records.

Units: **seconds** for every cost, **bytes per device** for every memory figure. All figures
are for one training step (forward + backward) on one device of the mesh.

The model the solver optimises (``Problem.evaluate`` computes it for a given choice, exactly as
the ILP does):

* Every node picks exactly one of its ``options``.
* Step time = sum over nodes of ``compute_s + comm_s`` of the chosen option
  + sum over edges of ``costs[src choice][dst choice]`` (resharding, forward + backward)
  - the communication hidden under compute: ``min(comm_overlap * A, W)`` with ``A`` the chosen
  options' ``async_s`` plus the edges' ``async_costs`` at the chosen pairs and ``W`` the options'
  ``overlap_s`` (``autopar.solver.overlap``; 0 when ``comm_overlap`` is 0: the plain sum).
* Memory timeline: integer time points ``0 .. timeline_length-1`` (a linear order of the
  forward and backward pass, e.g. forward op ``i`` at ``i`` and its backward at
  ``2N-1-i``). A node's chosen ``act_bytes`` is held on every point of its closed interval
  ``live = (start, end)`` (typically: produced at ``start`` in forward, freed after its last
  backward use at ``end``). An edge's ``mem[src choice][dst choice]`` (a parameter copy its
  reader gathers and saves for backward: a property of the pair) is held likewise on the
  edge's ``mem_live``. Parameters, gradients and optimizer state (``param_bytes``) are
  held for the whole step. Per-device peak = sum of ``param_bytes`` + max over time points of
  the ``act_bytes`` live there. The plan is feasible when peak <= ``budget_bytes``.

Repeated structure: a node's ``block`` names the repeated module instance it belongs to, as
``"<prefix>.<index>"`` (e.g. ``"transformer.h.3"``: the *root* of the repeated module, not a
sub-module). Blocks with the same prefix whose nodes, in problem order, have equal
``signature`` sequences and equal option names are treated as identical and share decisions
(see ``autopar.solver.simplify``).

Recompute (activation checkpointing): ``Node.segment`` names the checkpointable segment the
node belongs to and ``StrategyOption.forward_s`` is what recomputing it costs.
``Problem.evaluate(choice, recompute=..., segment_inputs=...)`` evaluates a choice with some
segments recomputed (``autopar.solver.timeline``); the recompute ILP
(``autopar.solver.recompute_ilp``) decides them together with the sharding.
"""

from __future__ import annotations

import copy
import dataclasses

import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np

from autopar.solver.timeline import Evaluation, SegmentInputs, evaluate

__all__ = ["StrategyOption", "Node", "Edge", "Problem", "Solution", "PROBLEM_VERSION"]

PROBLEM_VERSION = 1


def _check_number(owner: str, name: str, value: Any, *, integer: bool = False) -> None:
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type or not math.isfinite(value) or value < 0:
        kind = "an int" if integer else "a finite number"
        raise ValueError(f"{owner}: {name} must be {kind} >= 0, got {value!r}")


# ----------------------------------------------------------------------------------- records
@dataclass(frozen=True, slots=True)
class StrategyOption:
    """One way to run one node, with per-device figures for one training step.

    name:        readable strategy name, unique within its node (e.g. ``"S0R = S0R x RR"``).
    compute_s:   forward + backward compute seconds on one device (local shard roofline).
    comm_s:      forward + backward communication seconds *inside* the op (e.g. the all-reduce
                 of a row-parallel matmul), not the resharding of its inputs (that is on edges).
    param_bytes: bytes of parameters + gradients + optimizer state this choice puts on each
                 device (the builder applies the optimizer multiplier); 0 for non-parameter nodes.
                 Held for the whole step.
    act_bytes:   bytes of this node's output kept alive per device over ``Node.live``.
    forward_s:   forward-only seconds (compute + comm); what recomputing this node costs.
    async_s:     the part of ``comm_s`` issued asynchronously (a parameter's gradient sum, which
                 the runtime buckets and overlaps with backward: ``autopar.solver.overlap``).
    overlap_s:   compute seconds asynchronous communication can run beside (backward compute).
    """

    name: str
    compute_s: float
    comm_s: float = 0.0
    param_bytes: int = 0
    act_bytes: int = 0
    forward_s: float = 0.0
    async_s: float = 0.0
    overlap_s: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"StrategyOption name must be a non-empty str, got {self.name!r}")
        owner = f"option {self.name!r}"
        for f in ("compute_s", "comm_s", "forward_s", "async_s", "overlap_s"):
            _check_number(owner, f, getattr(self, f))
        if self.async_s > self.comm_s:
            raise ValueError(f"{owner}: async_s {self.async_s!r} is part of comm_s {self.comm_s!r}, "
                             f"so cannot exceed it")
        for f in ("param_bytes", "act_bytes"):
            _check_number(owner, f, getattr(self, f), integer=True)

    @property
    def cost_s(self) -> float:
        """Node-local seconds: compute + in-op communication."""
        return self.compute_s + self.comm_s

    def __str__(self) -> str:
        return (f"{self.name} [{self.compute_s:.3g}s + comm {self.comm_s:.3g}s, "
                f"param {self.param_bytes}B, act {self.act_bytes}B]")


# Option tuples whose names were checked unique (the builder gives every repeat of a block
# position the same tuple), with whether any holds activation bytes; an entry holds its tuple,
# so its id is not reused while listed.
_VALID_OPTIONS: dict[int, tuple[tuple, bool]] = {}
_VALID_OPTIONS_MAX = 65536
# id(options tuple) -> (the tuple, {option name: its first index}) for ``Node.option_index``.
_OPTION_INDEX: dict[int, tuple[tuple, dict[str, int]]] = {}


@dataclass(frozen=True, slots=True)
class Node:
    """One decision: which of ``options`` this graph node runs with.

    name:      unique node name (the fx node name).
    options:   the candidate strategies (at least one; names unique).
    live:      closed interval ``(start, end)`` of timeline points on which the chosen
               ``act_bytes`` is held; ``None`` when the node holds no activation (then every
               option must have ``act_bytes == 0``).
    block:     ``"<prefix>.<index>"`` of the repeated module instance the node belongs to, or None.
    signature: op + shapes (+ anything else that makes two nodes interchangeable); equal
               signatures at equal positions of equal blocks mean identical nodes.
    segment:   checkpointable segment id (for recompute decisions), or None.
    """

    name: str
    options: tuple[StrategyOption, ...]
    live: tuple[int, int] | None = None
    block: str | None = None
    signature: str = ""
    segment: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", tuple(self.options))
        if self.live is not None:
            object.__setattr__(self, "live", tuple(self.live))
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Node name must be a non-empty str, got {self.name!r}")
        if not self.options:
            raise ValueError(f"node {self.name!r} has no options")
        valid = _VALID_OPTIONS.get(id(self.options))
        if valid is None or valid[0] is not self.options:
            names = [o.name for o in self.options]
            if len(set(names)) != len(names):
                raise ValueError(f"node {self.name!r} has duplicate option names {names}")
            if len(_VALID_OPTIONS) >= _VALID_OPTIONS_MAX:
                _VALID_OPTIONS.clear()
            valid = _VALID_OPTIONS[id(self.options)] = (self.options, any(o.act_bytes for o in self.options))
        if self.live is None:
            if valid[1]:
                raise ValueError(f"node {self.name!r} has act_bytes but no live interval")
        elif not (len(self.live) == 2 and type(self.live[0]) is int and type(self.live[1]) is int
                  and 0 <= self.live[0] <= self.live[1]) and (  # (plain ints: the common case, checked fast)
                len(self.live) != 2 or not all(isinstance(t, int) and not isinstance(t, bool) for t in self.live)
                or not 0 <= self.live[0] <= self.live[1]):
            raise ValueError(f"node {self.name!r}: live must be (start, end) with 0 <= start <= end, "
                             f"got {self.live!r}")

    @property
    def num_options(self) -> int:
        return len(self.options)

    def option_index(self, name: str) -> int:
        # Looked up in a per-options-tuple table: repeated blocks' nodes share their options
        # tuple, and a deep model's evaluations and plan assembly ask for every node.
        hit = _OPTION_INDEX.get(id(self.options))
        if hit is None or hit[0] is not self.options:
            if len(_OPTION_INDEX) >= _VALID_OPTIONS_MAX:
                _OPTION_INDEX.clear()
            names: dict[str, int] = {}
            for i, o in enumerate(self.options):
                names.setdefault(o.name, i)
            hit = _OPTION_INDEX[id(self.options)] = (self.options, names)
        i = hit[1].get(name)
        if i is not None:
            return i
        raise ValueError(f"node {self.name!r} has no option {name!r}; options: {[o.name for o in self.options]}")

    def __str__(self) -> str:
        where = f" in {self.block}" if self.block else ""
        return f"{self.name}{where} ({self.num_options} options, live {self.live})"


@dataclass(frozen=True, slots=True)
class Edge:
    """Data flowing from ``src`` to ``dst``: ``costs[i][j]`` is the resharding time (forward +
    backward seconds) when ``src`` runs option ``i`` and ``dst`` runs option ``j``. At most one
    edge per ordered pair: sum the matrices when a node consumes a value twice.

    ``async_costs[i][j]`` (None: all 0): seconds of ``dst``'s ``comm_s`` issued asynchronously
    when the pair is (i, j) -- a parameter's gradient sum is bucketed only when its reader takes
    it in the parameter's own layout (``autopar.solver.overlap``).

    ``mem[i][j]`` (None: all 0): bytes per device held on the timeline points ``mem_live``
    (closed) when the pair is (i, j) -- the copy of a parameter stored in ``src``'s layout that
    ``dst``'s strategy gathers (converts) and autograd keeps from its forward to its backward
    (``autopar.planner.saved_bytes.gathered_copies``). It counts in the memory rows like an
    activation; a recomputed reader's copy is counted over the whole interval too (one rule for
    the ILPs and the evaluator: an upper bound, checkpoint re-gathers it in backward)."""

    src: str
    dst: str
    costs: tuple[tuple[float, ...], ...]
    async_costs: tuple[tuple[float, ...], ...] | None = None
    mem: tuple[tuple[int, ...], ...] | None = None
    mem_live: tuple[int, int] | None = None
    # ``costs`` as a read-only float array, made once here: converting the nested tuples again
    # cost the solver 16 s of its 3-axis Llama-8B simplification (94M entries).
    array: np.ndarray = field(init=False, repr=False, compare=False)
    async_array: np.ndarray | None = field(init=False, repr=False, compare=False)
    mem_array: np.ndarray | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "costs", tuple(tuple(float(c) for c in row) for row in self.costs))
        if self.src == self.dst:
            raise ValueError(f"edge {self.src!r} -> {self.dst!r} is a self-loop")
        widths = {len(r) for r in self.costs}
        if not self.costs or len(widths) != 1 or 0 in widths:
            raise ValueError(f"edge {self.src!r} -> {self.dst!r}: costs must be a non-empty "
                             f"rectangular matrix, got row lengths {[len(r) for r in self.costs]}")
        # One vectorised check (edges hold most of a problem's numbers); the slow per-number
        # pass only runs to name the offending value.
        flat = np.asarray(self.costs, dtype=float)
        if not (np.isfinite(flat).all() and (flat >= 0).all()):
            for row in self.costs:
                for c in row:
                    _check_number(f"edge {self.src!r} -> {self.dst!r}", "cost", c)
        flat.flags.writeable = False
        object.__setattr__(self, "array", flat)
        object.__setattr__(self, "async_array", self._async_array(flat.shape))
        object.__setattr__(self, "mem_array", self._mem_array(flat.shape))

    def _mem_array(self, shape: tuple[int, ...]) -> np.ndarray | None:
        if self.mem_live is not None:
            object.__setattr__(self, "mem_live", tuple(self.mem_live))
        if self.mem is None:
            if self.mem_live is not None:
                raise ValueError(f"edge {self.src!r} -> {self.dst!r}: mem_live {self.mem_live!r} without mem")
            return None
        mem = np.asarray(self.mem)
        if mem.shape != shape or not np.issubdtype(mem.dtype, np.integer) or (mem < 0).any():
            raise ValueError(f"edge {self.src!r} -> {self.dst!r}: mem must be a {shape} matrix of ints >= 0, "
                             f"got shape {mem.shape} dtype {mem.dtype}")
        live = self.mem_live
        if not (isinstance(live, tuple) and len(live) == 2 and all(type(t) is int for t in live)
                and 0 <= live[0] <= live[1]):
            raise ValueError(f"edge {self.src!r} -> {self.dst!r}: mem_live must be (start, end) with "
                             f"0 <= start <= end, got {live!r}")
        if not mem.any():  # no bytes: one form for both
            object.__setattr__(self, "mem", None)
            object.__setattr__(self, "mem_live", None)
            return None
        object.__setattr__(self, "mem", tuple(map(tuple, mem.tolist())))
        mem = mem.astype(np.int64)
        mem.flags.writeable = False
        return mem

    def _async_array(self, shape: tuple[int, ...]) -> np.ndarray | None:
        if self.async_costs is None:
            return None
        asy = np.asarray(self.async_costs, dtype=float)
        if asy.shape != shape:
            raise ValueError(f"edge {self.src!r} -> {self.dst!r}: async_costs is {asy.shape}, costs {shape}")
        if not (np.isfinite(asy).all() and (asy >= 0).all()):
            raise ValueError(f"edge {self.src!r} -> {self.dst!r}: async_costs must be finite and >= 0")
        if not asy.any():  # all zero is no asynchronous seconds: one form for both
            object.__setattr__(self, "async_costs", None)
            return None
        object.__setattr__(self, "async_costs", tuple(map(tuple, asy.tolist())))
        asy.flags.writeable = False
        return asy

    def moved(self, src: str, dst: str, mem_live: tuple[int, int] | None) -> "Edge":
        """This edge between ``src`` and ``dst`` (its ``mem`` held on ``mem_live``), unchecked: its
        matrices were validated when it was made (a repeated block's edges reuse their template's)."""
        if src == dst:
            raise ValueError(f"edge {src!r} -> {dst!r} is a self-loop")
        edge = object.__new__(Edge)
        for f in dataclasses.fields(Edge):
            object.__setattr__(edge, f.name, getattr(self, f.name))
        object.__setattr__(edge, "src", src)
        object.__setattr__(edge, "dst", dst)
        object.__setattr__(edge, "mem_live", None if self.mem is None else tuple(mem_live))
        return edge

    def restricted(self, rows, cols) -> "Edge":
        """This edge between the options ``rows`` of ``src`` and ``cols`` of ``dst``."""
        where = np.ix_(list(rows), list(cols))
        return Edge(self.src, self.dst, self.array[where].tolist(),
                    None if self.async_array is None else self.async_array[where].tolist(),
                    None if self.mem_array is None else self.mem_array[where].tolist(), self.mem_live)

    def __str__(self) -> str:
        return f"{self.src} -> {self.dst} ({len(self.costs)}x{len(self.costs[0])})"


@dataclass(frozen=True, slots=True)
class Problem:
    """Everything the solver needs. ``budget_bytes=None`` means no memory constraint.

    nodes:           decisions, in a deterministic order (graph order; blocks rely on it).
    edges:           resharding costs between nodes.
    budget_bytes:    per-device memory budget, or None.
    timeline_length: number of timeline points; every ``Node.live`` lies inside it.
    mesh_shape:      the mesh this problem was built for (reporting and error hints).
    meta:            free-form (str -> str/int/float) provenance, e.g. model name, graph hash.
    comm_overlap:    share of asynchronous communication hidden under compute, in [0, 1] (the
                     mesh's ``MeshSpec.comm_overlap``; module docstring).

    A modified copy is ``dataclasses.replace(problem, nodes=...)`` (checked again on creation).
    """

    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...] = ()
    budget_bytes: int | None = None
    timeline_length: int = 0
    mesh_shape: tuple[int, ...] = ()
    meta: tuple[tuple[str, str | int | float], ...] = ()
    comm_overlap: float = 0.0
    _index: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "edges", tuple(self.edges))
        object.__setattr__(self, "mesh_shape", tuple(self.mesh_shape))
        meta = self.meta.items() if isinstance(self.meta, Mapping) else self.meta
        object.__setattr__(self, "meta", tuple(sorted((str(k), v) for k, v in meta)))
        index: dict[str, int] = {}
        for i, n in enumerate(self.nodes):
            if n.name in index:
                raise ValueError(f"duplicate node name {n.name!r}")
            index[n.name] = i
        object.__setattr__(self, "_index", index)
        if not self.nodes:
            raise ValueError("a Problem needs at least one node")
        if self.budget_bytes is not None:
            _check_number("Problem", "budget_bytes", self.budget_bytes, integer=True)
        _check_number("Problem", "timeline_length", self.timeline_length, integer=True)
        _check_number("Problem", "comm_overlap", self.comm_overlap)
        if self.comm_overlap > 1:
            raise ValueError(f"Problem: comm_overlap must be in [0, 1], got {self.comm_overlap!r}")
        for n in self.nodes:
            if n.live is not None and n.live[1] >= self.timeline_length:
                raise ValueError(f"node {n.name!r}: live {n.live} outside the timeline "
                                 f"0..{self.timeline_length - 1}")
        seen: set[tuple[str, str]] = set()
        for e in self.edges:
            for end in (e.src, e.dst):
                if end not in index:
                    raise ValueError(f"edge {e.src!r} -> {e.dst!r}: unknown node {end!r}")
            if (e.src, e.dst) in seen:
                raise ValueError(f"duplicate edge {e.src!r} -> {e.dst!r}; sum their cost matrices")
            seen.add((e.src, e.dst))
            if e.mem_live is not None and e.mem_live[1] >= self.timeline_length:
                raise ValueError(f"edge {e.src!r} -> {e.dst!r}: mem_live {e.mem_live} outside the timeline "
                                 f"0..{self.timeline_length - 1}")
            shape = (len(e.costs), len(e.costs[0]))
            want = (len(self.nodes[index[e.src]].options), len(self.nodes[index[e.dst]].options))
            if shape != want:
                raise ValueError(f"edge {e.src!r} -> {e.dst!r}: cost matrix is {shape[0]}x{shape[1]}, "
                                 f"nodes have {want[0]}x{want[1]} options")

    # ----------------------------------------------------------------------------- queries
    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def num_edges(self) -> int:
        return len(self.edges)

    @property
    def meta_dict(self) -> dict[str, str | int | float]:
        return dict(self.meta)

    def node(self, name: str) -> Node:
        i = self._index.get(name)
        if i is None:
            raise ValueError(f"unknown node {name!r}")
        return self.nodes[i]

    def index(self, name: str) -> int:
        self.node(name)
        return self._index[name]

    def with_budget(self, budget_bytes: int | None) -> "Problem":
        """This problem with another budget. Nodes and edges were validated when it was made and
        are shared, so only the budget is checked (a full re-validation walks every node and
        edge: 10% of a 96-layer model's simplification)."""
        if budget_bytes is not None:
            _check_number("Problem", "budget_bytes", budget_bytes, integer=True)
        out = copy.copy(self)
        object.__setattr__(out, "budget_bytes", budget_bytes)
        return out

    def __str__(self) -> str:
        budget = "none" if self.budget_bytes is None else f"{self.budget_bytes}B"
        return (f"Problem({self.num_nodes} nodes, {self.num_edges} edges, budget {budget}, "
                f"timeline {self.timeline_length}, mesh {self.mesh_shape})")

    # -------------------------------------------------------------------------- evaluation
    def evaluate(self, choice: Mapping[str, str], *, recompute: Iterable[str] = (),
                 segment_inputs: SegmentInputs | None = None) -> Evaluation:
        """Step time and per-device memory timeline of ``choice`` (node name -> option name),
        optionally with the segments in ``recompute`` recomputed (``autopar.solver.timeline``)."""
        return evaluate(self, choice, recompute=recompute, segment_inputs=segment_inputs)

    # ------------------------------------------------------------------------------- JSON
    def to_json(self) -> str:
        data = {
            "version": PROBLEM_VERSION,
            "budget_bytes": self.budget_bytes,
            "timeline_length": self.timeline_length,
            "mesh_shape": list(self.mesh_shape),
            "meta": dict(self.meta),
            "comm_overlap": self.comm_overlap,
            "nodes": [
                {"name": n.name, "live": None if n.live is None else list(n.live), "block": n.block,
                 "signature": n.signature, "segment": n.segment,
                 "options": [[o.name, o.compute_s, o.comm_s, o.param_bytes, o.act_bytes, o.forward_s]
                             + ([o.async_s, o.overlap_s] if o.async_s or o.overlap_s else [])
                             for o in n.options]}
                for n in self.nodes
            ],
            "edges": [{"src": e.src, "dst": e.dst, "costs": [list(r) for r in e.costs]}
                      | ({} if e.async_array is None else {"async_costs": e.async_array.tolist()})
                      | ({} if e.mem_array is None else {"mem": e.mem_array.tolist(), "mem_live": list(e.mem_live)})
                      for e in self.edges],
        }
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> "Problem":
        data = json.loads(text)
        version = data.get("version")
        if version != PROBLEM_VERSION:
            raise ValueError(f"Problem JSON version {version!r} is not supported (expected {PROBLEM_VERSION})")
        try:
            nodes = tuple(
                Node(n["name"], tuple(StrategyOption(*o) for o in n["options"]),
                     None if n["live"] is None else tuple(n["live"]), n["block"], n["signature"], n["segment"])
                for n in data["nodes"]
            )
            edges = tuple(Edge(e["src"], e["dst"], e["costs"], e.get("async_costs"), e.get("mem"),
                               tuple(e["mem_live"]) if "mem_live" in e else None) for e in data["edges"])
            # comm_overlap and the options' last two figures came later: absent, no overlap.
            return cls(nodes, edges, data["budget_bytes"], data["timeline_length"],
                       tuple(data["mesh_shape"]), data["meta"], data.get("comm_overlap", 0.0))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed Problem JSON: {exc!r}") from None


# ---------------------------------------------------------------------------------- solution
SOLUTION_STATUSES = ("optimal", "feasible")


@dataclass(frozen=True, slots=True)
class Solution:
    """The planner's answer.

    choice:          node name -> chosen option name, for every node of the Problem.
    objective:       estimated step time in seconds (``Problem.evaluate(choice).objective``).
    lp_bound:        optimum of the LP relaxation (a lower bound on any plan's step time); None
                     when it is unknown (the relaxation did not finish: a known plan answered).
    dual_bound:      best proven lower bound (== objective when ``status == "optimal"``; None
                     when unknown).
    gap:             ``(objective - dual_bound) / objective``: how far from optimal it may be
                     (None when the bound is unknown).
    status:          ``"optimal"`` or ``"feasible"`` (stopped at the time limit with a plan, or a
                     known plan that the planner's estimate prices below the ILP's optimum).
    backend:         ``"highs"`` or ``"cbc"``.
    timings:         seconds per phase: ``simplify_s``, ``build_s``, ``lp_s``, ``solve_s``.
    peak_bytes:      per-device peak memory of the plan (``Problem.evaluate``).
    num_variables:   columns of the solved ILP (after simplification).
    num_constraints: rows of the solved ILP.
    recompute:       segments chosen for recomputation (always empty for the sharding ILP alone).
    stats:           simplification counts (groups, merged nodes, aliased nodes, ...).
    """

    choice: dict[str, str]
    objective: float
    lp_bound: float | None
    dual_bound: float | None
    gap: float | None
    status: str
    backend: str
    timings: dict[str, float]
    peak_bytes: int
    num_variables: int
    num_constraints: int
    recompute: tuple[str, ...] = ()
    stats: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in SOLUTION_STATUSES:
            raise ValueError(f"Solution status must be one of {SOLUTION_STATUSES}, got {self.status!r}")
        object.__setattr__(self, "recompute", tuple(self.recompute))

    def __str__(self) -> str:
        t = ", ".join(f"{k} {v:.3f}s" for k, v in self.timings.items())
        bound = "unknown" if self.lp_bound is None else f"{self.lp_bound:.6g}s"
        gap = "unknown" if self.gap is None else f"{self.gap:.2%}"
        return (f"{self.status} ({self.backend}): {self.objective:.6g}s, LP bound {bound}, "
                f"gap {gap}, peak {self.peak_bytes}B, {self.num_variables} vars x "
                f"{self.num_constraints} rows; {t}")

    def to_json(self) -> str:
        data = {"version": PROBLEM_VERSION}
        for f in self.__dataclass_fields__:
            value = getattr(self, f)
            data[f] = list(value) if isinstance(value, tuple) else value
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> "Solution":
        data = json.loads(text)
        version = data.pop("version", None)
        if version != PROBLEM_VERSION:
            raise ValueError(f"Solution JSON version {version!r} is not supported (expected {PROBLEM_VERSION})")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ValueError(f"malformed Solution JSON: {exc}") from None

