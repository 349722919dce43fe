"""Pipeline stages planned jointly with the sharding (Alpa's structure): inter-op DP x intra-op ILP.

``search_stages(traced, profile, mesh=..., options=..., num_stages=S, num_microbatches=M, ...)``
plans the MICRO-batch graph ``traced`` (batch / M) as ``S`` pipeline ranks over mesh axis 0:

1. one ``Problem`` on the stage sub-mesh (the mesh without axis 0), built once: tracing and
   building do not depend on where the cuts go (``pipeline.costs.stage_costs``);
2. every op gets a block position as in :func:`autopar.planner.pipeline.geometry.even_stages`
   (its repeated block; ops before the first block go with block 0, after the last with the
   last); a stage holding blocks ``[a, b)`` runs the ops whose position is in that range and
   reads the parameters / inputs those ops read (a tied weight read by two stages is on both:
   ``pipeline.geometry.StageGeometry``);
3. a stage's cost is the intra-stage ILP on the Problem sliced to its decisions
   (:meth:`autopar.planner.pipeline.costs.StageCosts.cost`: in-flight micro-batches, the step
   factor's share of gradient syncs, the stage budget and the point-to-point transfers priced
   there), memoised by range shape: identical middle ranges share one solve;
4. ``schedule_cuts`` (:mod:`autopar.planner.pipeline.schedule`) picks the cut minimising the
   schedule's step time, ``factor * max stage time + max gradient sync`` (``best_cuts``), solving
   a stage whose budget binds only when its lower bound (the shape's unconstrained optimum) can
   beat the best cut found (``LazyCuts``: exact); the schedule of lowest floor is searched first
   (``pipeline.bounds``) and its step bounds the other schedules' searches;
5. the chosen stages are solved once more in pipeline order, each with the placeholders an
   earlier stage chose fixed (one layout per parameter: ``Plan.nodes`` covers all stages), and
   the ``Plan`` records them (``Plan.pipeline``), the per-stage figures
   (``Plan.solver["pipeline"]``) and an ``Estimate`` whose ``step_s`` is the schedule's formula
   over those figures (``pipeline.assemble``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Callable

from autopar.layout.mesh import MeshSpec
from autopar.planner.pipeline.assemble import assemble_pipelined
from autopar.planner.pipeline.bounds import config_floors, in_bound_order
from autopar.planner.pipeline.costs import StageCosts, stage_costs
from autopar.planner.pipeline.schedule import SCHEDULE_VIRTUAL_STAGES, PipelineCandidate, schedule_cuts
from autopar.plans import Plan
from autopar.solver.problem import Problem, Solution
from autopar.tracer.graph import TracedGraph

__all__ = ["PipelineSearch", "search_stages"]


@dataclass(frozen=True, slots=True)
class PipelineSearch:
    plan: Plan | None  # the fastest candidate's plan (None: none fits)
    candidates: tuple[PipelineCandidate, ...]
    num_solves: int


def search_stages(traced: TracedGraph, profile, *, mesh: MeshSpec, options, num_stages: int, num_microbatches: int,
                  schedules: tuple[str, ...], progress=None, solve: Callable[[Problem], Solution] | None = None,
                  window: int | str | None = None, costs: StageCosts | None = None,
                  bound: float | None = None) -> PipelineSearch:
    """The fastest pipelined plan of the micro-batch graph ``traced`` over ``num_stages`` ranks on
    mesh axis 0 among ``schedules`` (module docstring). ``options``: a ``PlanOptions``.
    ``window``: stages hold between ``B / K - window`` and ``B / K + window`` blocks (None: any
    count; ``"auto"``: ``pipeline.schedule.stage_window``, as ``autopar.plan`` searches). ``costs``: stage costs of
    ``traced`` on this mesh's stage sub-mesh already built (benchmarks share them and their memo
    across schedules; built with ``options.zero_stage`` and no checkpoint, as here). ``bound``: the best
    step another configuration reached (``pipeline.bounds.in_bound_order``): a schedule whose
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
                              num_microbatches=num_microbatches, factor=factor, flight=flight, budget=stage_budget,
                              modes=modes, options=options, mesh=mesh, candidates=candidates,
                              timings={"build_s": t_build, "search_s": time.perf_counter() - t0 - t_build})
    # The chosen candidate's figure is the assembled plan's (shared layouts fixed across stages).
    candidates[at] = replace(candidates[at], step_s=plan.estimate.step_s, assembled=True)
    plan = replace(plan, solver={**plan.solver, "pipeline": {**plan.solver["pipeline"],
                                                             "candidates": [str(c) for c in candidates]}})
    return PipelineSearch(plan, tuple(candidates), costs.num_solves)
