"""Pipeline stages planned jointly with the sharding (Alpa's structure): inter-op DP x intra-op ILP.

``search_stages(traced, profile, mesh=..., options=..., num_stages=S, num_microbatches=M, ...)``
plans the MICRO-batch graph ``traced`` (batch / M) as ``S`` pipeline ranks over mesh axis 0:

1. one ``Problem`` on the stage sub-mesh (the mesh without axis 0), built once: tracing and
   building do not depend on where the cuts go;
2. every op gets a block position as in :func:`autopar.planner.pipeline.geometry.even_stages`
   (its repeated block; ops before the first block go with block 0, after the last with the
   last); a stage holding blocks ``[a, b)`` runs the ops whose position is in that range and
   reads the parameters / inputs those ops read (a tied weight read by two stages is on both);
3. a stage's cost is the intra-stage ILP on the Problem sliced to its decisions
   (:meth:`StageCosts.cost`), memoised by (first?, last?, the blocks' structure classes, in-flight
   count, step factor, budget): identical middle ranges share one solve. In the slice:

   - ``in_flight - 1`` extra micro-batches' saved activations are priced as persistent memory:
     every op option that is saved for backward (a live interval in the Problem) carries
     ``(k - 1) * act_bytes`` more ``param_bytes`` (held the whole step), so the ILP's memory
     constraint sees one micro-batch's activation timeline plus k - 1 micro-batches' saved bytes;
   - parameter options (whose ``comm_s`` is the gradient synchronisation over the sub-mesh)
     are scaled by ``1 / factor`` (``factor = M v + bubble``): the step runs every other option
     ``factor`` times on the bottleneck stage but synchronises gradients once, so the ILP
     minimises this stage's share of the step;
   - a stage with ``v`` virtual stages per rank gets ``budget / v`` (its rank holds v chunks);
   - values crossing the cut are sent replicated (``autopar.runtime.pipeline_split``); the
     conversions at each side of a boundary are not priced, the point-to-point transfer is:
     ``2 (alpha_0 + beta_0 * bytes)`` per micro-batch (activation forward, its gradient back)
     over axis 0's link, part of the sending stage's time;
4. ``schedule_cuts`` (:mod:`autopar.planner.pipeline.schedule`) picks the cut minimising the
   schedule's step time, ``factor * max stage time + max gradient sync`` (``best_cuts``), solving
   a stage whose budget binds only when its lower bound (the shape's unconstrained optimum) can
   beat the best cut found (``LazyCuts``: exact); the schedule of lowest floor is searched first
   (``pipeline_bounds``) and its step bounds the other schedules' searches;
5. the chosen stages are solved once more in pipeline order, each with the placeholders an
   earlier stage chose fixed (one layout per parameter: ``Plan.nodes`` covers all stages), and
   the ``Plan`` records them (``Plan.pipeline``), the per-stage figures
   (``Plan.solver["pipeline"]``) and an ``Estimate`` whose ``step_s`` is the schedule's formula
   over those figures.
"""

from __future__ import annotations

import math
import operator
import time
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from autopar.layout.blocks import block_of, split_block
from autopar.layout.mesh import MeshSpec
from autopar.planner.pipeline.bounds import config_floors, in_bound_order
from autopar.planner.pipeline.costs import HELD, RangeFamilies
from autopar.planner.pipeline.schedule import (SCHEDULE_VIRTUAL_STAGES, PipelineCandidate, check_pipeline_zero,
                                               schedule_cuts, schedules_for)
from autopar.planner.pipeline.assemble import assemble_pipelined
from autopar.planner.pipeline.geometry import block_container
from autopar.plans import NodeKind, Plan, StagePlan, stage_mesh_of
from autopar.solver.problem import Edge, Node, Problem, Solution, StrategyOption
from autopar.solver.timeline import segment_geometry
from autopar.solver.timeline import activation_bytes
from autopar.tracer.graph import MODULE_KEY, TracedGraph

# A kept value's layout follows its producer's (``StageCosts.slice``): any other pairing costs
# this many seconds, more than any real step, so an optimum never takes it while one fits.
_TIE_S = 1e4
# Relative slack on a stage's lower bound (the solver proves optima to MIP_REL_GAP = 1e-4): a range
# is skipped only when even its bound, less this, cannot beat the best cut found.
_BOUND_SLACK = 1e-3

__all__ = ["StageCost", "StageCosts", "PipelineCandidate", "PipelineSearch", "stage_costs", "search_stages", "schedule_cuts",
           "schedules_for", "check_pipeline_zero"]


@dataclass(frozen=True, slots=True)
class StageCost:
    """One stage's figures: per micro-batch ``time_s`` (ops + resharding + its boundary's
    point-to-point ``p2p_s``), once-per-step gradient ``sync_s``, per-device ``peak_bytes``
    (with its in-flight micro-batches), ``param_bytes`` (parameters, gradients, optimizer) and
    ``saved_bytes``: what ONE micro-batch's forward keeps saved for backward per device (user
    inputs left out, as ``autopar.solver.timeline.activation_bytes``); the stage holds
    ``in_flight * saved_bytes`` at its peak."""

    time_s: float
    sync_s: float
    p2p_s: float
    compute_s: float
    reshard_s: float
    peak_bytes: int
    param_bytes: int
    in_flight: int
    status: str = "optimal"
    gap: float = 0.0
    saved_bytes: int = 0
    recompute: bool = False  # every block of the stage recomputed in backward (Megatron's "full")


@dataclass(frozen=True, slots=True)
class PipelineSearch:
    plan: Plan | None  # the fastest candidate's plan (None: none fits)
    candidates: tuple[PipelineCandidate, ...]
    num_solves: int


class StageCosts(RangeFamilies):
    """Stage slices of one micro-batch Problem and their memoised intra-stage solves."""

    def __init__(self, traced: TracedGraph, built, *, mesh: MeshSpec, solve: Callable[[Problem], Solution]) -> None:
        found = block_container(traced)
        if found is None:
            raise ValueError(f"{traced.model_name} has no repeated blocks to cut into pipeline stages")
        self.traced, self.built, self.mesh, self._solve = traced, built, mesh, solve
        self.prefix, self.num_blocks = found
        self.num_solves = self.num_reused = 0
        # (shortest, longest) stage length the current cut search asks for (``_between``); None: off
        self.lengths: tuple[int, int] | None = None
        # range shape (+ in-flight, budget) -> (choice, cost, the range it was solved on) or None
        self._memo: dict[tuple, tuple[dict[str, str], StageCost, tuple[int, int]] | None] = {}
        self._unfit: dict[tuple, int] = {}  # (range shape, budget) -> fewest in flight found not to fit
        self._solved_on: dict[tuple, tuple[int, int]] = {}  # unconstrained memo key -> the range solved
        self._quick: dict[tuple, np.ndarray] = {}  # (factor, recompute) -> prefix sums of ops' cheapest options
        self.floors: dict[tuple, float] = {}  # block shape -> its floor (``pipeline_bounds.block_floor``)
        self.floor_sums: dict[float, tuple[float, ...]] = {}  # factor -> prefix sums of the blocks' floors
        self.floor_blocks: list[tuple[set[str], tuple]] | None = None  # per block: decisions, shared pattern
        self._position()
        self._classes()
        self._boundaries()
        self._recompute_geometry()

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
        """Bytes crossing each cut ``b`` (between blocks b - 1 and b): tensors made before, read after."""
        import torch

        delta = [0] * (self.num_blocks + 1)
        placeholders = {p.name: p for p in self.traced.placeholders}
        for node in self.traced.nodes:
            if node.op == "output":
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

    def p2p_s(self, b: int) -> float:
        """Forward send + backward receive over axis 0's link at cut ``b`` (0 at the model's end)."""
        if b >= self.num_blocks or self.boundary_bytes[b] == 0:
            return 0.0
        return 2 * (self.mesh.alpha[0] + self.mesh.beta[0] * self.boundary_bytes[b])

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
            # as ``autopar.runtime.pipeline_split`` keeps them.
            return self.readers[name] or {0}
        return {self.pos[name]}

    def stage_plans(self, bounds: tuple[int, ...], *, num_stages: int) -> tuple[StagePlan, ...]:
        stages = []
        for k in range(len(bounds) - 1):
            a, b = bounds[k], bounds[k + 1]
            names = tuple(n.name for n in self.traced.nodes
                          if (n.op == "placeholder" and any(a <= p < b for p in self.readers[n.name]))
                          or (n.name in self.pos and a <= self.pos[n.name] < b))
            stages.append(StagePlan(index=k, rank=k % num_stages, layers=(a, b), nodes=names))
        return tuple(stages)

    # ---------------------------------------------------------------------------- solves
    def _shape(self, a: int, b: int, factor: float, recompute: bool) -> tuple:
        return a == 0, b == self.num_blocks, self.block_class[a:b], factor, recompute

    def free(self, a: int, b: int, *, factor: float, recompute: bool = False):
        """The range shape's unconstrained optimum (one solve per shape, or none: ``_between``):
        (choice, cost, in-flight bytes), or None when no layout exists at all."""
        free_key = (*self._shape(a, b, factor, recompute), None, None)
        if free_key not in self._memo:
            self._memo[free_key] = self._between(a, b, factor=factor, recompute=recompute) or \
                self.solve_range(a, b, in_flight=1, factor=factor, budget=None, recompute=recompute)
            self._solved_on[free_key] = (a, b)
        return self._memo[free_key]

    def free_fits(self, a: int, b: int, *, in_flight: int, factor: float, budget: int | None,
                  recompute: bool = False) -> bool:
        """Whether the unconstrained optimum fits ``budget`` with ``in_flight`` micro-batches (then
        ``cost`` is it, without a solve of its own)."""
        free = self.free(a, b, factor=factor, recompute=recompute)
        return free is not None and (budget is None or free[1].peak_bytes + (in_flight - 1) * free[2] <= budget)

    def lower_bound(self, a: int, b: int, *, factor: float, recompute: bool = False) -> float | None:
        """A lower bound on ``time_s + sync_s / factor`` of the range under ANY budget and
        in-flight count (the unconstrained optimum's value: a budget only removes layouts), less
        the solver's relative gap; None: no bound (the free solve was not proved optimal)."""
        free = self.free(a, b, factor=factor, recompute=recompute)
        if free is None or free[1].status != "optimal":
            return None
        c = free[1]
        return (c.time_s - c.p2p_s + c.sync_s / factor) * (1 - _BOUND_SLACK) + self.p2p_s(b)

    def has_free(self, a: int, b: int, *, factor: float, recompute: bool = False) -> bool:
        return (*self._shape(a, b, factor, recompute), None, None) in self._memo

    def quick_bound(self, a: int, b: int, *, factor: float, recompute: bool = False) -> float:
        """A lower bound on ``time_s + sync_s / factor`` of the range without a solve of its own:
        each of its ops at its cheapest option (as ``slice`` prices it), no resharding, plus the
        cut's point-to-point (the objective adds edges >= 0 and parameters' syncs >= 0); or,
        where tighter, the sum of its blocks' floors (``pipeline_bounds.step_floor`` stored
        them, at a factor >= ``factor``: valid here) plus the point-to-point."""
        floors = min((f for f in self.floor_sums if f >= factor), default=None)
        floor = -math.inf if floors is None else self.floor_sums[floors][b] - self.floor_sums[floors][a]
        return max(floor + self.p2p_s(b), self._cheapest(a, b, factor=factor, recompute=recompute))

    def _cheapest(self, a: int, b: int, *, factor: float, recompute: bool) -> float:
        key = (factor, recompute)
        if key not in self._quick:
            per_block = np.zeros(self.num_blocks + 1)
            for node in self.built.problem.nodes:
                if self.kind[node.name] != NodeKind.OP:
                    continue
                extra = recompute and node.name in self.unit_of
                per_block[self.pos[node.name] + 1] += min(o.cost_s + (o.forward_s if extra else 0.0)
                                                          for o in node.options)
            self._quick[key] = np.cumsum(per_block)
        sums = self._quick[key]
        return float(sums[b] - sums[a]) * (1 - _BOUND_SLACK) + self.p2p_s(b)

    def cost(self, a: int, b: int, *, in_flight: int, factor: float, budget: int | None,
             recompute: bool = False) -> StageCost | None:
        """The memoised stage cost (None: it does not fit ``budget``); ``recompute``: every block of
        the stage recomputed in backward (``slice``)."""
        shape = self._shape(a, b, factor, recompute)
        key = (*shape, in_flight, budget)
        if key not in self._memo:
            # The unconstrained optimum (one solve per range shape) answers whenever it fits with
            # this in-flight count; only a binding budget needs a solve of its own. Its peak with
            # k micro-batches in flight is its peak with one plus (k - 1) x what one keeps saved
            # (``slice``: the in-flight bytes are linear in k), so no second evaluation is needed.
            free = self.free(a, b, factor=factor, recompute=recompute)
            peak = None if free is None else free[1].peak_bytes + (in_flight - 1) * free[2]
            if free is not None and (budget is None or peak <= budget):
                self._memo[key] = (free[0], replace(free[1], peak_bytes=peak, in_flight=in_flight), free[2])
            elif self._unfit.get((shape, budget), math.inf) <= in_flight:
                # Nothing fits with fewer micro-batches in flight: nothing fits with more (each
                # adds bytes >= 0 to every layout's peak).
                self._memo[key] = None
            else:
                self._memo[key] = self.solve_range(a, b, in_flight=in_flight, factor=factor, budget=budget,
                                                   recompute=recompute)
                if self._memo[key] is None:
                    self._unfit[shape, budget] = min(self._unfit.get((shape, budget), math.inf), in_flight)
        found = self._memo[key]
        return None if found is None else replace(found[1], time_s=found[1].time_s - found[1].p2p_s + self.p2p_s(b),
                                                  p2p_s=self.p2p_s(b))

    def searched(self, a: int, b: int, *, in_flight: int, factor: float, budget: int | None,
                 recompute: bool = False) -> tuple[dict[str, str], StageCost] | None:
        """The search's (choice, cost) of the stage holding ``[a, b)`` when its memo entry was
        solved on this very range (a range of the same shape elsewhere names other nodes)."""
        cost = self.cost(a, b, in_flight=in_flight, factor=factor, budget=budget, recompute=recompute)
        found = self._memo[(*self._shape(a, b, factor, recompute), in_flight, budget)]
        if cost is None or found is None or set(found[0]) != self.decisions(a, b):
            return None
        return found[0], cost

    def solve_range(self, a: int, b: int, *, in_flight: int, factor: float, budget: int | None,
                    fixed: dict[str, str] | None = None,
                    recompute: bool = False) -> tuple[dict[str, str], StageCost, int] | None:
        """(choice, cost, bytes each further in-flight micro-batch adds) of the stage holding
        ``[a, b)``, placeholders in ``fixed`` held to their option; None when nothing fits."""
        problem = self.slice(self.decisions(a, b), in_flight=in_flight, factor=factor, budget=budget,
                             fixed=fixed or {}, recompute=recompute)
        self.num_solves += 1
        try:
            sol = self._solve(problem)
        except ValueError:  # no layout of this stage fits the budget
            return None
        held = [n.name for n in problem.nodes if n.name.endswith(HELD)]
        if any(sol.choice[h] != sol.choice[h[:-len(HELD)]] for h in held):
            return None  # only a layout change of a kept value (priced _TIE_S) fits: infeasible
        return self._figures(problem, b, sol.choice, in_flight=in_flight, factor=factor, recompute=recompute,
                             status=sol.status, gap=1.0 if sol.gap is None else sol.gap)  # None: no bound known

    def _figures(self, problem: Problem, b: int, choice: dict[str, str], *, in_flight: int, factor: float,
                 recompute: bool, status: str, gap: float) -> tuple[dict[str, str], StageCost, int]:
        """(choice without held values, the stage's figures, in-flight bytes) of ``choice`` on the slice."""
        ev = problem.evaluate(choice)
        original = self.built.problem

        def chosen(name):
            node = original.node(name)
            return node.options[node.option_index(choice[name])]

        params = [n.name for n in problem.nodes if self.kind.get(n.name) == NodeKind.PARAMETER]
        sync = sum(chosen(n).cost_s for n in params)
        param_bytes = sum(chosen(n.name).param_bytes for n in problem.nodes
                          if n.name in self.kind and self.kind[n.name] != NodeKind.OP)
        extra = sum(self._in_flight_bytes(problem, n, c, recompute=recompute) for n, c in choice.items())
        p2p = self.p2p_s(b)
        cost = StageCost(time_s=ev.objective - sync / factor + p2p, sync_s=sync, p2p_s=p2p, compute_s=ev.compute_s,
                         reshard_s=ev.reshard_s, peak_bytes=ev.peak_bytes, param_bytes=param_bytes,
                         in_flight=in_flight, status=status, gap=gap,
                         saved_bytes=activation_bytes(problem, choice), recompute=recompute)
        return {n: c for n, c in choice.items() if not n.endswith(HELD)}, cost, extra

    def _in_flight_bytes(self, problem: Problem, name: str, option: str, *, recompute: bool) -> int:
        """Bytes one more in-flight micro-batch keeps for node ``name`` of the stage slice
        ``problem`` (``slice``): a kept value's, or a not-recomputed op's saved activation."""
        if name.endswith(HELD):
            node = problem.node(name)
            return node.options[node.option_index(option)].act_bytes
        base = self.built.problem.node(name)
        if self.kind[name] != NodeKind.OP or base.live is None or (recompute and name in self.unit_of):
            return 0
        return base.options[base.option_index(option)].act_bytes

    def _recompute_geometry(self) -> None:
        """The stage-recomputable units (the container's blocks), the unit of each op and where
        each unit's backward begins (``autopar.solver.timeline``)."""
        geo = segment_geometry(self.built.problem)
        self.units = {u: g for u, g in geo.items() if g.parent is None and (split_block(u) or ("", 0))[0] == self.prefix}
        self.unit_of: dict[str, str] = {}
        for node in self.built.problem.nodes:
            if node.segment is not None and self.kind[node.name] == NodeKind.OP:
                block = block_of(node.segment)
                if block in self.units:
                    self.unit_of[node.name] = block
        self.segment_inputs = getattr(self.built, "segment_inputs", None) or {}

    def slice(self, names: set[str], *, in_flight: int, factor: float, budget: int | None,
              fixed: dict[str, str], recompute: bool = False) -> Problem:
        """The Problem restricted to ``names`` and priced for the stage (module docstring).

        ``recompute``: every block unit of the stage is recomputed in backward, written into the
        plain sharding Problem exactly as ``Problem.evaluate(..., recompute=units,
        segment_inputs=...)`` prices it (``autopar.solver.timeline``): its ops cost their
        ``forward_s`` more and hold their activation only from the unit's backward start on; each
        value the units keep (a ``SegmentInput`` made inside the stage) becomes a node
        ``<value>@held`` holding its bytes over the units' span, whose layout is tied to its
        producer's by an edge priced ``_TIE_S`` off the diagonal. The value a stage receives
        over its cut is not priced in either mode. In flight, a recomputed op keeps nothing, a
        kept value ``(k - 1)`` x its bytes."""
        base = self.built.problem
        units = {u for u in self.units if split_block(u)[1] in self._stage_blocks(names)} if recompute else set()
        keep: dict[str, list[int]] = {}
        nodes = []
        for node in base.nodes:
            if node.name not in names:
                continue
            idx = [node.option_index(fixed[node.name])] if node.name in fixed else list(range(node.num_options))
            keep[node.name] = idx
            kind = self.kind[node.name]
            unit = self.unit_of.get(node.name) if units else None
            unit = unit if unit in units else None
            opts = []
            for i in idx:
                o = node.options[i]
                if kind == NodeKind.PARAMETER:
                    o = replace(o, compute_s=o.compute_s / factor, comm_s=o.comm_s / factor)
                elif unit is not None:
                    o = replace(o, compute_s=o.compute_s + o.forward_s)
                elif kind == NodeKind.OP and node.live is not None and in_flight > 1:
                    o = replace(o, param_bytes=o.param_bytes + (in_flight - 1) * o.act_bytes)
                opts.append(o)
            live = node.live if unit is None or node.live is None else (self.units[unit].bwd, node.live[1])
            nodes.append(replace(node, options=tuple(opts), live=live))
        edges = []
        for e in base.edges:
            if e.src in keep and e.dst in keep:
                if len(keep[e.src]) == len(e.costs) and len(keep[e.dst]) == len(e.costs[0]):
                    edges.append(e)
                else:
                    edges.append(Edge(e.src, e.dst, e.array[np.ix_(keep[e.src], keep[e.dst])].tolist()))
        held: dict[str, list] = {}
        for u in sorted(units):
            g = self.units[u]
            for si in self.segment_inputs.get(u, ()):
                if si.node in keep:
                    span = held.setdefault(si.node, [si.bytes, g.start, g.end])
                    span[1], span[2] = min(span[1], g.start), max(span[2], g.end)
        for value, (sizes, first, last) in held.items():
            src, idx = base.node(value), keep[value]
            opts = tuple(StrategyOption(src.options[i].name, 0.0, param_bytes=(in_flight - 1) * sizes[i],
                                        act_bytes=sizes[i]) for i in idx)
            nodes.append(Node(value + HELD, opts, live=(first, last), signature="held|" + src.signature))
            edges.append(Edge(value, value + HELD, [[0.0 if i == j else _TIE_S for j in idx] for i in idx]))
        return replace(base, nodes=tuple(nodes), edges=tuple(edges), budget_bytes=budget,
                       meta={**base.meta_dict, "pipeline_stage": f"{len(nodes)} decisions"})

    def _stage_blocks(self, names: set[str]) -> set[int]:
        return {self.pos[n] for n in names if n in self.unit_of}


def stage_costs(traced: TracedGraph, profile, *, mesh: MeshSpec, options,
                solve: Callable[[Problem], Solution] | None = None) -> StageCosts:
    """The ``StageCosts`` of the micro-batch graph ``traced`` on ``mesh``'s stage sub-mesh: its
    Problem built with ``options`` (ZeRO 0 or 1) without a checkpoint mode (stages decide
    recompute themselves), solved by ``solve`` (default: the options' solver and time limit)."""
    from autopar.planner.builder import build_problem
    from autopar.solver.driver import solve as solve_ilp

    check_pipeline_zero(options.zero_stage)
    built = build_problem(traced, profile, stage_mesh_of(mesh), budget_bytes=None,
                          options=replace(options, checkpoint="none", pipeline=None))
    solve = solve or (lambda p: solve_ilp(p, solver=options.solver, time_limit=options.time_limit))
    return StageCosts(traced, built, mesh=mesh, solve=solve)


def search_stages(traced: TracedGraph, profile, *, mesh: MeshSpec, options, num_stages: int, num_microbatches: int,
                  schedules: tuple[str, ...], progress=None, solve: Callable[[Problem], Solution] | None = None,
                  window: int | str | None = None, costs: StageCosts | None = None,
                  bound: float | None = None) -> PipelineSearch:
    """The fastest pipelined plan of the micro-batch graph ``traced`` over ``num_stages`` ranks on
    mesh axis 0 among ``schedules`` (module docstring). ``options``: a ``PlanOptions``.
    ``window``: stages hold between ``B / K - window`` and ``B / K + window`` blocks (None: any
    count; ``"auto"``: ``pipeline_schedule.stage_window``, as ``autopar.plan`` searches). ``costs``: stage costs of
    ``traced`` on this mesh's stage sub-mesh already built (benchmarks share them and their memo
    across schedules; built with ``options.zero_stage`` and no checkpoint, as here). ``bound``: the best
    step another configuration reached (``pipeline_bounds.in_bound_order``): a schedule whose
    ``step_floor`` is not below it is not searched, and stages that cannot beat it are not solved;
    ``plan`` is None when no schedule beats it."""
    if mesh.shape[0] != num_stages:
        raise ValueError(f"pipeline={num_stages} needs mesh axis 0 of size {num_stages}; mesh {mesh.shape} has "
                         f"{mesh.shape[0]}")
    t0 = time.perf_counter()
    budget = options.budget_bytes(mesh)
    if costs is None:
        costs = stage_costs(traced, profile, mesh=mesh, options=options, solve=solve)
    elif tuple(costs.mesh.shape) != tuple(mesh.shape):
        raise ValueError(f"stage costs built for mesh {costs.mesh.shape}, searched on {mesh.shape}")
    t_build = time.perf_counter() - t0
    found_for: dict[str, PipelineCandidate] = {}
    floors = config_floors(costs, schedules=schedules, num_stages=num_stages, num_microbatches=num_microbatches,
                           window=window)

    def run(schedule: str, incumbent: float):
        found = schedule_cuts(costs, schedule=schedule, num_stages=num_stages, num_microbatches=num_microbatches,
                              budget=budget, window=window, bound=None if incumbent == math.inf else incumbent,
                              recompute=(False,) if options.checkpoint == "none" else (False, True))
        found_for[schedule] = found[0]
        return found

    def skipped(schedule: str, floor: float, incumbent: float):
        found_for[schedule] = PipelineCandidate(num_microbatches, schedule, SCHEDULE_VIRTUAL_STAGES[schedule], None,
                                                f"not searched: its floor {floor * 1e3:.3f} ms/step does not beat "
                                                f"{incumbent * 1e3:.3f}")

    # Lowest floor first (1F1B first among equals), each schedule's search bounded by the best step
    # so far; a schedule that cannot be cut at all (infinite floor) is run first, to say why.
    order = sorted(schedules, key=lambda s: s != "1f1b")
    results = in_bound_order({s: -math.inf if floors[s] == math.inf else floors[s] for s in order}, run,
                             step_of=lambda found: None if found[1] is None else found[1].objective,
                             skipped=skipped, incumbent=math.inf if bound is None else bound)
    done = [(s, found) for s, found in results.items() if found[1] is not None]
    best = None if not done else min(((s, *found[1:]) for s, found in done), key=lambda b: b[1].objective)
    candidates = [found_for[s] for s in schedules]
    if best is None:
        return PipelineSearch(None, tuple(candidates), costs.num_solves)
    schedule, cuts, factor, flight, stage_budget, modes = best
    at = next(i for i, c in enumerate(candidates) if c.schedule == schedule)
    plan = assemble_pipelined(costs, traced, cuts.bounds, schedule=schedule, num_stages=num_stages,
                     num_microbatches=num_microbatches, factor=factor, flight=flight, budget=stage_budget, modes=modes,
                     options=options, mesh=mesh, candidates=candidates,
                     timings={"build_s": t_build, "search_s": time.perf_counter() - t0 - t_build})
    # The chosen candidate's figure is the assembled plan's (shared layouts fixed across stages).
    candidates[at] = replace(candidates[at], step_s=plan.estimate.step_s, assembled=True)
    plan = replace(plan, solver={**plan.solver, "pipeline": {**plan.solver["pipeline"],
                                                             "candidates": [str(c) for c in candidates]}})
    return PipelineSearch(plan, tuple(candidates), costs.num_solves)
