"""The ``Plan`` of a pipelined search's chosen cuts (``autopar.planner.pipeline.search``): each
stage solved once more with the layouts earlier stages chose for shared parameters, the
schedule's estimate over the stages' figures, and the stage record ``Plan.pipeline`` holds."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from autopar.layout.blocks import split_block
from autopar.layout.mesh import MeshSpec
from autopar.planner.assemble import assemble_plan, solver_stats
from autopar.planner.checkpointing import regions_of
from autopar.planner.pipeline.schedule import SCHEDULE_VIRTUAL_STAGES
from autopar.plans import Estimate, PipelinePlan, Plan
from autopar.solver.problem import Solution
from autopar.tracer.graph import TracedGraph

if TYPE_CHECKING:  # the search module imports this one
    from autopar.planner.pipeline.search import PipelineCandidate, StageCost, StageCosts

__all__ = ["assemble_pipelined"]


def assemble_pipelined(costs: StageCosts, traced: TracedGraph, bounds: tuple[int, ...], *, schedule: str, num_stages: int,
              num_microbatches: int, factor: float, flight: list[int], budget: int | None, modes: tuple[bool, ...],
              options, mesh: MeshSpec,
              candidates: list[PipelineCandidate], timings: dict[str, float]) -> Plan:
    """Solve the chosen stages once more, slowest first (by the search's figures): a parameter two
    stages read (GPT-2's tied ``wte``) takes the layout the slower stage picks, the other stage
    is solved with it fixed."""
    num = len(bounds) - 1
    order = sorted(range(num), key=lambda k: -(costs.cost(bounds[k], bounds[k + 1], in_flight=flight[k], factor=factor,
                                                          budget=budget, recompute=modes[k]).time_s))
    choice: dict[str, str] = {}
    found_at: dict[int, StageCost] = {}
    for k in order:
        fixed = {n: choice[n] for n in costs.decisions(bounds[k], bounds[k + 1]) if n in choice}
        kw = dict(in_flight=flight[k], factor=factor, budget=budget, recompute=modes[k])
        # The search's own layout of the stage serves when it agrees with what earlier stages
        # fixed (a stage sharing nothing with them, or sharing the same layouts): no solve.
        found = costs.searched(bounds[k], bounds[k + 1], **kw)
        if found is None or any(found[0][n] != v for n, v in fixed.items()):
            found = costs.solve_range(bounds[k], bounds[k + 1], fixed=fixed, **kw)
        if found is None:
            raise ValueError(f"pipeline stage {k} (blocks {bounds[k]}..{bounds[k + 1] - 1}) does not fit the budget "
                             f"with the layouts other stages chose for their shared parameters")
        choice.update(found[0])
        found_at[k] = found[1]
    stage_costs = [found_at[k] for k in range(num)]
    slowest = max(range(len(stage_costs)), key=lambda k: stage_costs[k].time_s)
    top = stage_costs[slowest]
    sync = max(c.sync_s for c in stage_costs)
    step = factor * top.time_s + sync
    compute, reshard = factor * top.compute_s, factor * top.reshard_s
    estimate = Estimate(step_s=step, compute_s=compute, comm_s=max(step - compute - reshard, 0.0), reshard_s=reshard,
                        param_bytes=max(c.param_bytes for c in stage_costs),
                        peak_bytes=max(c.peak_bytes for c in stage_costs))
    gap = max(c.gap for c in stage_costs)
    solution = Solution(choice=choice, objective=step, lp_bound=step * (1 - gap), dual_bound=step * (1 - gap),
                        gap=gap, status="optimal" if all(c.status == "optimal" for c in stage_costs) else "feasible",
                        backend=options.solver, timings=timings, peak_bytes=estimate.peak_bytes,
                        num_variables=0, num_constraints=0)
    built = costs.built
    units = tuple(u for u in costs.units if any(m and bounds[k] <= split_block(u)[1] < bounds[k + 1]
                                                for k, m in enumerate(modes)))
    regions = regions_of(built.problem, units) if units else ()
    checkpoint = {"mode": "stage-blocks", "method": "full recompute of every block in the stages that pick it"} \
        if units else {"mode": "none", "method": "none"}
    plan = assemble_plan(traced, built, choice=choice, evaluation=built.problem.evaluate(choice), solution=solution,
                         timings=timings, checkpoint=checkpoint, recompute=regions, reduce_dtype=options.reduce_dtype)
    pipe = PipelinePlan(num_stages=num_stages, num_microbatches=num_microbatches, schedule=schedule,
                        virtual_stages=SCHEDULE_VIRTUAL_STAGES[schedule],
                        stages=costs.stage_plans(bounds, num_stages=num_stages))
    record = {"factor": factor, "num_solves": costs.num_solves, "boundary_bytes": list(costs.boundary_bytes),
              "stages": [{"time_s": c.time_s, "sync_s": c.sync_s, "p2p_s": c.p2p_s, "peak_bytes": c.peak_bytes,
                          "param_bytes": c.param_bytes, "in_flight": c.in_flight, "saved_bytes": c.saved_bytes,
                          "in_flight_saved_bytes": c.in_flight * c.saved_bytes, "recompute": c.recompute}
                         for c in stage_costs],
              "candidates": [str(c) for c in candidates]}
    return replace(plan, mesh=mesh, estimate=estimate, pipeline=pipe, budget_bytes=options.budget_bytes(mesh),
                   solver={**solver_stats(solution), "pipeline": record})
