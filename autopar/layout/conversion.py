"""Layout conversion (the "shape-consistency manager"): from one ``TensorSpec`` to another.

A conversion is a sequence of ``ReshardStep``s, each acting on exactly one mesh axis. This
module is plain data and search: no torch import. ``autopar.runtime.collectives`` executes the steps
as autograd-aware collectives.

Step kinds (``axis`` is the mesh axis; dims are tensor dims):

===============  ===========================  ==============================================
kind             layout change on ``axis``    forward / backward (the gradient layout rule)
===============  ===========================  ==============================================
all_gather       S(src_dim) -> R              all-gather  / local split
split            R -> S(dst_dim)              local split / all-gather
all_to_all       S(src_dim) -> S(dst_dim)     all-to-all  / reverse all-to-all
all_reduce       P -> R                       all-reduce  / identity
reduce_scatter   P -> S(dst_dim)              reduce-scatter / all-gather
to_partial       R -> P                       keep on coordinate 0, zeros elsewhere / identity
===============  ===========================  ==============================================

A segmented shard ``S(d/k)`` (``placement.Shard(d, segments=k)``) is gathered and split by the
same two kinds with ``segments=k``: the all-gather's pieces are reordered locally (coordinate-major
to segment-major) after the collective, the split keeps this coordinate's piece of every segment;
both cost what the plain step costs (the reorder is a local copy the plain step makes too). Every
other change of a segmented layout goes through ``R``.

Gradient layout invariant (docs/architecture.md, Invariants): the gradient of a value arrives in the same
layout as the value, except that the gradient of a ``P`` value is replicated (each summand's
gradient is the full gradient).

Local consistency: when several mesh axes shard one dim, the lower axis index is the major
digit of the shard index. A step may only add or remove the *minor-most* (highest-index) axis
sharding a dim, so every intermediate layout is an ordinary ``TensorSpec``. Adding a shard of
dim ``d`` on ``axis`` therefore needs every other axis sharding ``d`` to have a lower index, and
removing it needs ``axis`` to be the highest one. A ``P`` axis changes only by reducing
(``all_reduce`` / ``reduce_scatter``); steps on *other* axes are linear, so they commute with
the pending sum and stay legal.

Planner (``plan_conversion``): Dijkstra over the valid layouts of one tensor shape on one mesh.
Edge weight = forward + backward seconds of the step (a training step pays both), ties broken
on fewer steps. Step costs come from ``autopar.layout.cost`` with the *full* bytes over the step's axis:

===============  ==================================  ============================
kind             forward                             backward (the dual)
===============  ==================================  ============================
all_gather       all-gather of ``local * n``         split of the gathered piece
split            copy of the ``local / n`` piece     all-gather of ``local``
all_to_all       all-to-all of ``local * n``         the same all-to-all
all_reduce       all-reduce of ``local``             0 (identity)
reduce_scatter   reduce-scatter of ``local``         all-gather of ``local``
to_partial       copy of ``local`` (zeroing)         0 (identity)
===============  ==================================  ============================

(``local`` = bytes of the step's input on one device, ``n`` = size of the step's axis.)
``peak_extra_bytes`` is the largest buffer one step allocates next to its input: the step's
output piece, plus for ``all_to_all`` the contiguous send buffer. Results are cached by
``(src, dst, shape, itemsize, mesh)``; planning never runs inside a training step.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from autopar.layout.cost import collective_seconds, copy_seconds
from autopar.layout.mesh import MeshSpec
from autopar.layout.placement import P, R, Partial, Replicate, Shard, TensorSpec

__all__ = [
    "ReshardStep",
    "replicate_steps",
    "STEP_KINDS",
    "Conversion",
    "plan_conversion",
    "conversion_seconds",
    "conversion_cache_info",
    "clear_conversion_cache",
    "apply_step",
    "step_seconds",
    "step_extra_bytes",
    "valid_specs",
]

STEP_KINDS = ("all_gather", "split", "all_to_all", "all_reduce", "reduce_scatter", "to_partial")


@dataclass(frozen=True, slots=True)
class ReshardStep:
    kind: str
    axis: int
    src_dim: int | None = None  # all_gather, all_to_all
    dst_dim: int | None = None  # split, all_to_all, reduce_scatter
    segments: int = 1  # all_gather of / split into a segmented shard S(d/segments)

    def __post_init__(self) -> None:
        if self.kind not in STEP_KINDS:
            raise ValueError(f"unknown reshard step kind {self.kind!r}; expected one of {STEP_KINDS}")
        if self.segments != 1 and self.kind not in ("all_gather", "split"):
            raise ValueError(f"reshard step {self.kind} on axis {self.axis} got segments={self.segments}; "
                             f"only all_gather and split move a segmented shard")
        needs_src = self.kind in ("all_gather", "all_to_all")
        needs_dst = self.kind in ("split", "all_to_all", "reduce_scatter")
        if (self.src_dim is not None) != needs_src or (self.dst_dim is not None) != needs_dst:
            raise ValueError(
                f"reshard step {self.kind} on axis {self.axis} got src_dim={self.src_dim}, "
                f"dst_dim={self.dst_dim}; it needs "
                f"{'src_dim' if needs_src else 'no src_dim'} and {'dst_dim' if needs_dst else 'no dst_dim'}"
            )

    def __str__(self) -> str:
        dims = ""
        if self.kind == "all_to_all":
            dims = f" S{self.src_dim}->S{self.dst_dim}"
        elif self.src_dim is not None:
            dims = f" {Shard(self.src_dim, self.segments).compact}"
        elif self.dst_dim is not None:
            dims = f" {Shard(self.dst_dim, self.segments).compact}"
        return f"{self.kind}[axis{self.axis}]{dims}"


# ---------------------------------------------------------------------------- step semantics
def apply_step(spec: TensorSpec, step: ReshardStep) -> TensorSpec:
    """The layout after ``step``; ``ValueError`` if the step does not apply to ``spec``.

    Checks the placement on the step's axis and the local-consistency rule, not divisibility
    (that depends on the shape; see ``valid_specs``).
    """
    if not 0 <= step.axis < spec.num_axes:
        raise ValueError(f"step {step} names mesh axis {step.axis}, but spec {spec} has {spec.num_axes} axes")
    cur = spec.placements[step.axis]
    kind = step.kind
    if kind in ("all_gather", "all_to_all"):
        if cur != Shard(step.src_dim, step.segments):
            raise ValueError(f"step {step} needs {Shard(step.src_dim, step.segments).compact} on axis {step.axis}, "
                             f"spec is {spec}")
        if max(spec.shard_axes(step.src_dim)) != step.axis:
            raise ValueError(
                f"step {step} on {spec}: axis {step.axis} is not the minor-most axis sharding "
                f"dim {step.src_dim}"
            )
    elif kind in ("split", "to_partial") and cur != R:
        raise ValueError(f"step {step} needs R on axis {step.axis}, spec is {spec}")
    elif kind in ("all_reduce", "reduce_scatter") and cur != P:
        raise ValueError(f"step {step} needs P on axis {step.axis}, spec is {spec}")
    if step.dst_dim is not None:
        others = [a for a in spec.shard_axes(step.dst_dim) if a != step.axis]
        if others and max(others) > step.axis:
            raise ValueError(
                f"step {step} on {spec}: axis {step.axis} would not be the minor-most axis "
                f"sharding dim {step.dst_dim} (axes {others} already shard it)"
            )
        if kind == "all_to_all" and step.dst_dim == step.src_dim:
            raise ValueError(f"step {step}: all_to_all needs two different dims")
        if step.segments > 1 and others:
            raise ValueError(f"step {step} on {spec}: a segmented dim is sharded by one mesh axis only "
                             f"(axes {others} already shard dim {step.dst_dim})")
        return spec.with_placement(step.axis, Shard(step.dst_dim, step.segments))
    return spec.with_placement(step.axis, P if kind == "to_partial" else R)


def _local_bytes(spec: TensorSpec, shape: tuple[int, ...], itemsize: int, mesh_shape) -> int:
    return math.prod(spec.local_shape(shape, mesh_shape)) * itemsize


def step_seconds(
    step: ReshardStep, spec: TensorSpec, *, shape: tuple[int, ...], itemsize: int, mesh: MeshSpec
) -> tuple[float, float]:
    """(forward, backward) seconds of ``step`` applied to a tensor laid out as ``spec``."""
    return _step_seconds(step, _local_bytes(spec, shape, itemsize, mesh.shape), mesh)


def _step_seconds(step: ReshardStep, local: int, mesh: MeshSpec) -> tuple[float, float]:
    """``step_seconds`` of a step whose input holds ``local`` bytes per device."""
    n = mesh.shape[step.axis]
    axis = step.axis
    kind = step.kind
    if kind == "all_gather":
        gathered = local * n
        return (collective_seconds("all_gather", gathered, mesh, axis),
                collective_seconds("split", gathered, mesh, axis))
    if kind == "split":
        return (collective_seconds("split", local, mesh, axis),
                collective_seconds("all_gather", local, mesh, axis))
    if kind == "all_to_all":
        t = collective_seconds("all_to_all", local * n, mesh, axis)
        return t, t
    if kind == "all_reduce":
        return collective_seconds("all_reduce", local, mesh, axis), 0.0
    if kind == "reduce_scatter":
        return (collective_seconds("reduce_scatter", local, mesh, axis),
                collective_seconds("all_gather", local, mesh, axis))
    # to_partial: zero the piece on every coordinate but 0 (a write of the local piece).
    return (copy_seconds(local, mesh) if n > 1 else 0.0), 0.0


def step_extra_bytes(step: ReshardStep, spec: TensorSpec, *, shape: tuple[int, ...], itemsize: int,
                     mesh_shape: tuple[int, ...]) -> int:
    """Bytes one device allocates for ``step`` next to its input buffer."""
    return _step_extra_bytes(step, _local_bytes(spec, shape, itemsize, mesh_shape), mesh_shape)


def _step_extra_bytes(step: ReshardStep, local: int, mesh_shape: tuple[int, ...]) -> int:
    n = mesh_shape[step.axis]
    if step.kind == "all_gather":
        return local * n
    if step.kind in ("split", "reduce_scatter"):
        return local // n
    if step.kind == "all_to_all":
        return 2 * local  # contiguous send chunks + receive buffer
    return local  # all_reduce (out of place under autograd), to_partial (zeroed copy)


# --------------------------------------------------------------------------------- layouts
def valid_specs(shape: tuple[int, ...], mesh_shape: tuple[int, ...],
                segments: tuple[int, ...] = ()) -> tuple[TensorSpec, ...]:
    """Every layout of ``shape`` on ``mesh_shape``: R, P or S(dim) per axis, dims dividing evenly;
    also S(dim/k) for each segment count k in ``segments``."""
    options = [R, P] + [Shard(d, k) for k in (1, *segments) for d in range(len(shape))]
    out = []
    for placements in itertools.product(options, repeat=len(mesh_shape)):
        spec = TensorSpec(placements)
        if spec.is_valid(shape, mesh_shape):
            out.append(spec)
    return tuple(out)


def _candidate_steps(spec: TensorSpec, num_dims: int, mesh_shape, segments: tuple[int, ...] = ()) -> list[ReshardStep]:
    steps = []
    for axis, p in enumerate(spec.placements):
        if isinstance(p, Shard):
            steps.append(ReshardStep("all_gather", axis, src_dim=p.dim, segments=p.segments))
            if p.segments == 1:
                steps += [ReshardStep("all_to_all", axis, src_dim=p.dim, dst_dim=d)
                          for d in range(num_dims) if d != p.dim]
        elif isinstance(p, Replicate):
            steps.append(ReshardStep("to_partial", axis))
            steps += [ReshardStep("split", axis, dst_dim=d, segments=k)
                      for k in (1, *segments) for d in range(num_dims)]
        else:
            steps.append(ReshardStep("all_reduce", axis))
            steps += [ReshardStep("reduce_scatter", axis, dst_dim=d) for d in range(num_dims)]
    return steps


@dataclass(frozen=True, slots=True)
class _Edge:
    step: ReshardStep
    dst: TensorSpec
    forward_s: float
    backward_s: float
    extra_bytes: int


@lru_cache(maxsize=256)
def _layout_graph(shape: tuple[int, ...], itemsize: int, mesh: MeshSpec,
                  segments: tuple[int, ...] = ()) -> dict[TensorSpec, tuple[_Edge, ...]]:
    """Adjacency of the layout graph; built once per (shape, itemsize, mesh, segment counts),
    shared by pairs. Segmented layouts join the graph only for the counts a pair names, so the
    plain graph (every other tensor's) stays as small as before."""
    graph: dict[TensorSpec, tuple[_Edge, ...]] = {}
    specs = valid_specs(shape, mesh.shape, segments)
    valid = {str(spec) for spec in specs}  # what ``is_valid`` accepts among the step results
    for spec in specs:
        local = _local_bytes(spec, shape, itemsize, mesh.shape)  # once per layout, not per step
        edges = []
        for step in _candidate_steps(spec, len(shape), mesh.shape, segments):
            try:
                nxt = apply_step(spec, step)
            except ValueError:
                continue  # breaks local consistency
            if str(nxt) not in valid:
                continue  # uneven split
            fwd, bwd = _step_seconds(step, local, mesh)
            edges.append(_Edge(step, nxt, fwd, bwd, _step_extra_bytes(step, local, mesh.shape)))
        graph[spec] = tuple(edges)
    return graph


# ------------------------------------------------------------------------------- the planner
@dataclass(frozen=True, slots=True)
class Conversion:
    """The cheapest step sequence from ``src`` to ``dst`` and what it costs."""

    src: TensorSpec
    dst: TensorSpec
    steps: tuple[ReshardStep, ...]
    forward_s: float
    backward_s: float
    peak_extra_bytes: int

    @property
    def total_s(self) -> float:
        """Forward + backward: what a training step pays for this conversion."""
        return self.forward_s + self.backward_s

    @property
    def specs(self) -> tuple[TensorSpec, ...]:
        """The layouts visited: ``src``, then the layout after each step (ends with ``dst``)."""
        out = [self.src]
        for step in self.steps:
            out.append(apply_step(out[-1], step))
        return tuple(out)

    def count(self, kind: str) -> int:
        return sum(1 for s in self.steps if s.kind == kind)

    @property
    def sum_axes(self) -> tuple[int, ...] | None:
        """The mesh axes, sorted, of a conversion made of all-reduces only (a partial sum made
        whole: one collective on their group where the runtime leaves it in flight); else None."""
        if not self.steps or any(s.kind != "all_reduce" for s in self.steps):
            return None
        return tuple(sorted(s.axis for s in self.steps))

    def __str__(self) -> str:
        body = " ; ".join(str(s) for s in self.steps) if self.steps else "identity"
        return f"{self.src} -> {self.dst}: {body}"


# Costs equal up to float rounding must tie, so the tie-break on step count decides.
_COST_RESOLUTION_S = 1e-15

_cache: dict[tuple, Conversion] = {}
_cache_hits = 0
_cache_misses = 0


def conversion_cache_info() -> tuple[int, int, int]:
    """(hits, misses, size) of the conversion cache."""
    return _cache_hits, _cache_misses, len(_cache)


def clear_conversion_cache() -> None:
    global _cache_hits, _cache_misses
    _cache.clear()
    _layout_graph.cache_clear()
    _indexed_graph.cache_clear()
    _shortest_tree.cache_clear()
    _cache_hits = _cache_misses = 0


def _check_args(shape, itemsize, mesh) -> tuple[int, ...]:
    if not isinstance(mesh, MeshSpec):
        raise ValueError(f"mesh must be a MeshSpec, got {mesh!r}")
    try:
        shape = tuple(shape)
    except TypeError:
        raise ValueError(f"shape must be a tuple of ints, got {shape!r}") from None
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in shape):
        raise ValueError(f"shape must be non-negative ints, got {shape!r}")
    if isinstance(itemsize, bool) or not isinstance(itemsize, int) or itemsize < 1:
        raise ValueError(f"itemsize must be a positive int (bytes per element), got {itemsize!r}")
    return shape


def _as_spec(spec: TensorSpec | str, role: str, shape, mesh: MeshSpec) -> TensorSpec:
    spec = TensorSpec.parse(spec) if isinstance(spec, str) else spec
    if not isinstance(spec, TensorSpec):
        raise ValueError(f"{role} must be a TensorSpec or a string like 'S0R', got {spec!r}")
    try:
        spec.validate(shape, mesh.shape)
    except ValueError as exc:
        raise ValueError(f"invalid {role} layout {spec} for shape {shape} on mesh {mesh.shape}: {exc}") from None
    return spec


def plan_conversion(
    src: TensorSpec | str, dst: TensorSpec | str, shape: tuple[int, ...], itemsize: int, mesh: MeshSpec
) -> Conversion:
    """Cheapest conversion of a ``shape`` tensor (``itemsize`` bytes/element) from ``src`` to ``dst``."""
    global _cache_hits, _cache_misses
    shape = _check_args(shape, itemsize, mesh)
    src = _as_spec(src, "source", shape, mesh)
    dst = _as_spec(dst, "target", shape, mesh)
    key = (src, dst, shape, itemsize, mesh)
    hit = _cache.get(key)
    if hit is not None:
        _cache_hits += 1
        return hit
    _cache_misses += 1
    conv = _dijkstra(src, dst, shape, itemsize, mesh)
    _cache[key] = conv
    return conv


@dataclass(frozen=True, slots=True)
class _IndexedGraph:
    """The layout graph with layouts numbered: searches run on ints (hashing a ``TensorSpec``
    costs more than the search itself). ``adjacency[i]``: ``(j, edge)`` per step out of layout i."""

    specs: tuple[TensorSpec, ...]
    index: dict[str, int]  # str(spec) -> its number
    adjacency: tuple[tuple[tuple[int, _Edge], ...], ...]


@lru_cache(maxsize=256)
def _indexed_graph(shape: tuple[int, ...], itemsize: int, mesh: MeshSpec,
                   segments: tuple[int, ...] = ()) -> _IndexedGraph:
    graph = _layout_graph(shape, itemsize, mesh, segments)
    specs = tuple(graph)
    index = {str(spec): i for i, spec in enumerate(specs)}
    adjacency = tuple(tuple((index[str(e.dst)], e) for e in graph[spec]) for spec in specs)
    return _IndexedGraph(specs, index, adjacency)


@lru_cache(maxsize=4096)
def _shortest_tree(src: int, shape: tuple[int, ...], itemsize: int,
                   mesh: MeshSpec, segments: tuple[int, ...] = ()) -> dict[int, tuple[int, _Edge]]:
    """Dijkstra from layout number ``src`` (``_indexed_graph``) to every layout:
    ``{layout: (previous layout, edge)}``.

    One search serves every target of ``src`` (cost matrices ask for all of them).
    """
    adjacency = _indexed_graph(shape, itemsize, mesh, segments).adjacency
    # Heap entries: (rounded cost, steps, tie counter, layout). The counter keeps the order of
    # equal entries deterministic (insertion order) and keeps layouts out of comparisons.
    counter = itertools.count()
    best: dict[int, tuple[int, int]] = {src: (0, 0)}
    prev: dict[int, tuple[int, _Edge]] = {}
    exact: dict[int, float] = {src: 0.0}
    heap = [(0, 0, next(counter), src)]
    done: set[int] = set()
    while heap:
        _, num_steps, _, spec = heapq.heappop(heap)
        if spec in done:
            continue
        done.add(spec)
        for dst, edge in adjacency[spec]:
            if dst in done:
                continue
            cost = exact[spec] + edge.forward_s + edge.backward_s
            key = (round(cost / _COST_RESOLUTION_S), num_steps + 1)
            if dst not in best or key < best[dst]:
                best[dst] = key
                exact[dst] = cost
                prev[dst] = (spec, edge)
                heapq.heappush(heap, (key[0], key[1], next(counter), dst))
    return prev


def _path(prev: dict[int, tuple[int, _Edge]], src: int, dst: int) -> list[_Edge]:
    """The tree's edges from ``src`` to ``dst``, in order."""
    # Every layout reaches R and R reaches every layout, so a valid dst is always in the tree.
    assert dst == src or dst in prev, (src, dst)
    edges = []
    while dst != src:
        dst, edge = prev[dst]
        edges.append(edge)
    edges.reverse()
    return edges


def _segment_counts(*specs: TensorSpec | str) -> tuple[int, ...]:
    """The segment counts (> 1) the layouts name: the segmented layouts a search needs."""
    counts = {p.segments for spec in specs for p in TensorSpec.parse(spec).placements
              if isinstance(p, Shard) and p.segments > 1}
    return tuple(sorted(counts))


def _dijkstra(src: TensorSpec, dst: TensorSpec, shape, itemsize: int, mesh: MeshSpec) -> Conversion:
    segments = _segment_counts(src, dst)
    index = _indexed_graph(shape, itemsize, mesh, segments).index
    i, j = index[str(src)], index[str(dst)]
    edges = _path(_shortest_tree(i, shape, itemsize, mesh, segments), i, j)
    return Conversion(
        src=src,
        dst=dst,
        steps=tuple(e.step for e in edges),
        forward_s=sum(e.forward_s for e in edges),
        backward_s=sum(e.backward_s for e in edges),
        peak_extra_bytes=max((e.extra_bytes for e in edges), default=0),
    )


def conversion_seconds(src: TensorSpec | str, dsts: Sequence[TensorSpec | str], shape: tuple[int, ...],
                       itemsize: int, mesh: MeshSpec) -> tuple[float, ...]:
    """``plan_conversion(src, dst, ...).total_s`` for every ``dst`` in ``dsts`` (the same floats),
    from one search: what a cost matrix row needs, without building a ``Conversion`` per pair."""
    shape = _check_args(shape, itemsize, mesh)
    segments = _segment_counts(src, *dsts)
    graph = _indexed_graph(shape, itemsize, mesh, segments)
    i = _layout_number(src, "source", shape, mesh, graph)
    prev = _shortest_tree(i, shape, itemsize, mesh, segments)
    out = []
    for dst in dsts:
        edges = _path(prev, i, _layout_number(dst, "target", shape, mesh, graph))
        out.append(sum(e.forward_s for e in edges) + sum(e.backward_s for e in edges))
    return tuple(out)


def _layout_number(spec: TensorSpec | str, role: str, shape, mesh: MeshSpec, graph: _IndexedGraph) -> int:
    number = graph.index.get(str(TensorSpec.parse(spec) if isinstance(spec, str) else spec))
    if number is None:  # not a valid layout of this shape: say why
        _as_spec(spec, role, shape, mesh)
        raise AssertionError(f"{spec} is valid for {shape} on {mesh.shape} but not in its layout graph")
    return number


def replicate_steps(spec: TensorSpec | str) -> tuple[ReshardStep, ...]:
    """Steps from ``spec`` to fully replicated: all-reduce partials, all-gather shards.

    Axes go from the highest index down, so each all-gather removes the minor-most axis that
    shards its dim (the local-consistency rule)."""
    spec = TensorSpec.parse(spec)
    steps = []
    for axis in reversed(range(spec.num_axes)):
        p = spec.placements[axis]
        if isinstance(p, Shard):
            steps.append(ReshardStep("all_gather", axis, src_dim=p.dim, segments=p.segments))
        elif isinstance(p, Partial):
            steps.append(ReshardStep("all_reduce", axis))
    return tuple(steps)
