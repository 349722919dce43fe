"""Lower bounds on a pipelined configuration's step before its stage search, and the search of
several configurations in bound order (branch and bound over configurations).

A configuration -- (micro-batch graph, stage sub-mesh, micro-batch count ``M``, schedule) -- is
searched by ``autopar.planner.pipeline.search.search_stages``: tens of intra-stage ILP solves.
``step_floor`` bounds its best step from below with one small solve per block class:

- ``block_floor(j)``: the least ``time + sync / factor`` of block ``j``'s own decisions (its
  ops, the parameters and inputs it reads) over every layout, memory ignored, where a decision
  several blocks read (a tied weight, an attention mask) is priced 0. A stage holding blocks
  ``[a, b)`` solves a problem whose decisions are the union of its blocks' and whose objective
  sums node and edge costs (all >= 0): dropping the edges between blocks, pricing the shared
  decisions 0 and letting each block choose them on its own only lowers the optimum, so
  ``sum_j block_floor(j) + schedule_s(b) <= time_s + sync_s / factor`` of any plan of the stage
  (``schedule_s``: the cut's point-to-point and the schedule actions' overhead, in every stage time), with or
  without recompute (which only adds forward seconds) and under any budget;
- the step of a cut is ``factor * max_k t_k + max_k sync_k >= factor * max_k (t_k + sync_k / factor)``,
  so ``factor * min over cuts of max_k floor(stage k)`` (``best_cuts`` over the floors, the
  search's stage-length window applied) bounds every plan of the configuration.

Blocks of one class (equal decision signatures, the same shared pattern) share one solve; a
96-layer model has three (first, middle, last). ``in_bound_order`` searches configurations
cheapest bound first and skips one once its bound cannot beat the best step found: exact, the
same optimum as searching every configuration.

The floors of one ``StageCosts`` live in its ``BlockFloors`` (``costs.floors``): this module fills
it and ``StageCosts.quick_bound`` reads it (``range_floor``), so the search after a configuration's
floors prices its stage ranges no lower than their blocks' floors. The functions here take the
``StageCosts`` (:mod:`autopar.planner.pipeline.costs`, which builds on this module) for its
slices and solves.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable, Hashable, TypeVar

from autopar.planner.pipeline.geometry import StageGeometry
from autopar.planner.pipeline.schedule import (SCHEDULE_VIRTUAL_STAGES, best_cuts, idle_speedup, stage_window,
                                              step_factor)
from autopar.plans import NodeKind
from autopar.solver.driver import SolveTimeout

__all__ = ["BlockFloors", "block_floor", "step_floor", "config_floors", "in_bound_order"]

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")


class BlockFloors:
    """The block floors of one ``StageGeometry``, memoised: per block shape its floor
    (``block_floor``), per step factor the prefix sums of every block's floor (``step_floor``),
    and per block its decisions with the (signature, shared?) pattern of its non-op ones."""

    def __init__(self, geometry: StageGeometry) -> None:
        self.geometry = geometry
        self.values: dict[tuple, float] = {}  # block shape -> its floor
        self.sums: dict[float, tuple[float, ...]] = {}  # factor -> prefix sums of the blocks' floors
        self._blocks: list[tuple[set[str], tuple]] | None = None

    def shared(self, name: str) -> bool:
        """Whether decision ``name`` is read by more than one block (priced 0 in a block's floor)."""
        geo = self.geometry
        return geo.kind[name] != NodeKind.OP and len(geo.readers.get(name, ())) > 1

    def block(self, j: int) -> tuple[set[str], tuple]:
        """Block ``j``'s decisions and the (signature, shared?) of its non-op ones, for every block
        at once (one pass over the problem)."""
        if self._blocks is None:
            geo = self.geometry
            nodes = geo.built.problem.nodes
            names: list[set[str]] = [set() for _ in range(geo.num_blocks)]
            for node in nodes:
                for b in geo.blocks_of(node.name):
                    names[b].add(node.name)
            held = [tuple((n.signature, self.shared(n.name)) for n in nodes
                          if n.name in names[b] and geo.kind[n.name] != NodeKind.OP) for b in range(geo.num_blocks)]
            self._blocks = list(zip(names, held))
        return self._blocks[j]

    def key(self, j: int, *, factor: float) -> tuple:
        """Blocks of one class with the same shared pattern have one floor (one solve); a block
        holding parameters of the last gradient bucket (``BuiltProblem.exposed``: their sums hide
        nothing) is priced apart from its class."""
        geo = self.geometry
        names, pattern = self.block(j)
        return (j == 0, j == geo.num_blocks - 1, geo.block_class[j], factor, pattern,
                not geo.built.exposed.isdisjoint(names))

    def range_floor(self, a: int, b: int, *, factor: float) -> float:
        """The sum of the floors of blocks ``[a, b)`` at the smallest factor >= ``factor`` stored
        (a floor only falls as the factor grows: valid at ``factor``); ``-inf`` when none is."""
        at = min((f for f in self.sums if f >= factor), default=None)
        return -math.inf if at is None else self.sums[at][b] - self.sums[at][a]


def block_floor(costs, j: int, *, factor: float) -> float:
    """The least ``time + sync / factor`` of block ``j``'s own decisions (module docstring) on
    ``costs`` (a ``StageCosts``), memoised in ``costs.floors`` by the block's class and shared
    pattern; the solver's proven bound, so a gap never lifts it above the true optimum."""
    floors = costs.floors
    names, _ = floors.block(j)
    key = floors.key(j, factor=factor)
    if key not in floors.values:
        problem = costs.slice(names, in_flight=1, factor=factor, budget=None, fixed={})
        free = tuple(replace(n, options=tuple(replace(o, compute_s=0.0, comm_s=0.0, async_s=0.0, overlap_s=0.0)
                                                      for o in n.options))
                     if floors.shared(n.name) else n for n in problem.nodes)
        try:
            sol = costs.solve(replace(problem, nodes=free))
        except SolveTimeout:  # no plan within the time limit: no bound either (0 is one)
            floors.values[key] = 0.0
        else:
            floors.values[key] = max(0.0, min(sol.objective,
                                              sol.dual_bound if sol.dual_bound is not None else sol.objective))
    return floors.values[key]


def step_floor(costs, *, schedule: str, num_stages: int, num_microbatches: int,
               window: int | str | None = None, floor_factor: float | None = None) -> float:
    """A lower bound on the step of every plan ``search_stages`` can find for ``schedule`` with
    ``num_microbatches`` micro-batches over ``num_stages`` ranks (module docstring); ``window``
    as the search's. ``math.inf`` when the blocks cannot be cut into the schedule's stages.
    ``floor_factor``: price the block floors' syncs at ``1 / floor_factor`` (>= the schedule's
    factor: a floor only falls as the factor grows, so one set of floor solves serves every
    schedule of a configuration)."""
    v = SCHEDULE_VIRTUAL_STAGES[schedule]
    parts = num_stages * v
    if costs.num_blocks < parts:
        return math.inf
    factor = step_factor(schedule, num_stages=num_stages, virtual_stages=v, num_microbatches=num_microbatches,
                         idle_speedup=idle_speedup(costs.mesh))
    if floor_factor is not None and floor_factor < factor:
        raise ValueError(f"floor_factor {floor_factor} is below the schedule's step factor {factor}")
    sums = [0.0]
    for j in range(costs.num_blocks):
        sums.append(sums[-1] + block_floor(costs, j, factor=floor_factor or factor))
    costs.floors.sums[floor_factor or factor] = tuple(sums)  # tightens the search's own stage bounds
    even = costs.num_blocks / parts
    window = stage_window(window, num_blocks=costs.num_blocks, parts=parts)

    def floor(k: int, a: int, b: int):
        if window is not None and abs((b - a) - even) > window:
            return None
        return sums[b] - sums[a] + costs.schedule_s(b), 0.0

    cuts = best_cuts(costs.num_blocks, parts, floor, factor=factor)
    return math.inf if cuts is None else cuts.objective


def config_floors(costs, *, schedules: tuple[str, ...], num_stages: int, num_microbatches: int,
                  window: int | str | None = None) -> dict[str, float]:
    """``step_floor`` of each schedule, from one set of block floors (at the largest factor)."""
    top = max(step_factor(s, num_stages=num_stages, virtual_stages=SCHEDULE_VIRTUAL_STAGES[s],
                          num_microbatches=num_microbatches, idle_speedup=idle_speedup(costs.mesh)) for s in schedules)
    return {s: step_floor(costs, schedule=s, num_stages=num_stages, num_microbatches=num_microbatches, window=window,
                          floor_factor=top) for s in schedules}


def in_bound_order(bounds: dict[K, float], search: Callable[[K, float], R], *,
                   step_of: Callable[[R], float | None],
                   skipped: Callable[[K, float, float], None] | None = None,
                   incumbent: float = math.inf) -> dict[K, R]:
    """Run ``search(key, incumbent)`` over ``bounds``' keys, lowest bound first (ties in the
    dict's order), skipping a key (``skipped(key, its bound, the incumbent)``) once its bound is
    not below the best step found (``step_of(result)``; None: no plan) or the ``incumbent`` given
    (another search's step). ``incumbent`` is ``math.inf`` until a plan is found; until then
    every key is searched, an infinite bound too (its search says why it has no plan). Returns
    the results of the keys searched, in search order."""
    best = incumbent
    out: dict[K, R] = {}
    for key in sorted(bounds, key=lambda k: bounds[k]):
        if best < math.inf and bounds[key] >= best:  # (an infinite bound is searched to say why)
            if skipped is not None:
                skipped(key, bounds[key], best)
            continue
        out[key] = search(key, best)
        step = step_of(out[key])
        if step is not None:
            best = min(best, step)
    return out
