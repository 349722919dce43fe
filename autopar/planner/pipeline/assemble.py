"""The pipelined ``Plan``: of a stage search's chosen cuts (``assemble_pipelined``), or of the
even cut around a plan solved on the stage sub-mesh (``pipeline_plan``).

``assemble_pipelined`` solves each chosen stage once more with the layouts earlier stages chose
for shared parameters, prices the schedule's estimate over the stages' figures and records the
stages ``Plan.pipeline`` holds. ``pipeline_plan(sub_plan, traced, mesh=..., ...)`` wraps a plan
solved on the stage sub-mesh (the mesh without its first axis) into a full-mesh ``Plan``
carrying a ``PipelinePlan`` of ``even_stages`` (the runtime's tests build on it).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from autopar.layout.blocks import split_block
from autopar.layout.mesh import MeshSpec, default_axis_names, parse_mesh_shape
from autopar.planner.assemble import assemble_plan, solver_stats
from autopar.planner.checkpointing import regions_of
from autopar.planner.pipeline.costs import StageCost, StageCosts
from autopar.planner.pipeline.geometry import even_stages
from autopar.planner.pipeline.order import rank_counts
from autopar.planner.pipeline.schedule import SCHEDULE_VIRTUAL_STAGES, PipelineCandidate
from autopar.plans import PIPELINE_SCHEDULES, Estimate, PipelinePlan, Plan, stage_mesh_of
from autopar.solver.problem import Solution
from autopar.tracer.graph import TracedGraph

__all__ = ["assemble_pipelined", "pipeline_plan", "rank_memory"]


def assemble_pipelined(costs: StageCosts, traced: TracedGraph, bounds: tuple[int, ...], *, schedule: str,
                       num_stages: int, num_microbatches: int, factor: float, flight: list[int], budget: int | None,
                       modes: tuple[bool, ...], options, mesh: MeshSpec, candidates: list[PipelineCandidate],
                       timings: dict[str, float]) -> Plan:
    """Solve the chosen stages once more, slowest first (by the search's figures): a parameter two
    stages read (GPT-2's tied ``wte``) takes the layout the slower stage picks, the other stage
    is solved with it fixed."""
    num, geo = len(bounds) - 1, costs.geometry
    order = sorted(range(num), key=lambda k: -(costs.cost(bounds[k], bounds[k + 1], in_flight=flight[k], factor=factor,
                                                          budget=budget, recompute=modes[k]).time_s))
    choice: dict[str, str] = {}
    found_at: dict[int, StageCost] = {}
    for k in order:
        fixed = {n: choice[n] for n in geo.decisions(bounds[k], bounds[k + 1]) if n in choice}
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
    v = SCHEDULE_VIRTUAL_STAGES[schedule]
    ranks = rank_memory(stage_costs, schedule=schedule, num_stages=num_stages, num_microbatches=num_microbatches)
    estimate = Estimate(step_s=step, compute_s=compute, comm_s=max(step - compute - reshard, 0.0), reshard_s=reshard,
                        param_bytes=max(sum(stage_costs[c * num_stages + r].param_bytes for c in range(v))
                                        for r in range(num_stages)),
                        peak_bytes=max(peak for _, peak in ranks))
    gap = max(c.gap for c in stage_costs)
    solution = Solution(choice=choice, objective=step, lp_bound=step * (1 - gap), dual_bound=step * (1 - gap),
                        gap=gap, status="optimal" if all(c.status == "optimal" for c in stage_costs) else "feasible",
                        backend=options.solver, timings=timings, peak_bytes=estimate.peak_bytes,
                        num_variables=0, num_constraints=0)
    built = costs.built
    units = tuple(u for u in geo.units if any(m and bounds[k] <= split_block(u)[1] < bounds[k + 1]
                                                for k, m in enumerate(modes)))
    regions = regions_of(built.problem, units) if units else ()
    checkpoint = {"mode": "stage-blocks", "method": "full recompute of every block in the stages that pick it"} \
        if units else {"mode": "none", "method": "none"}
    plan = assemble_plan(traced, built, choice=choice, evaluation=built.problem.evaluate(choice), solution=solution,
                         timings=timings, checkpoint=checkpoint, recompute=regions, reduce_dtype=options.reduce_dtype)
    pipe = PipelinePlan(num_stages=num_stages, num_microbatches=num_microbatches, schedule=schedule,
                        virtual_stages=SCHEDULE_VIRTUAL_STAGES[schedule],
                        stages=geo.stage_plans(bounds, num_stages=num_stages))
    record = {"factor": factor, "num_solves": costs.num_solves, "boundary_bytes": list(geo.boundary_bytes),
              "rank_saved_bytes": [saved for saved, _ in ranks], "rank_peak_bytes": [peak for _, peak in ranks],
              "stages": [{"time_s": c.time_s, "sync_s": c.sync_s, "p2p_s": c.p2p_s, "overhead_s": c.overhead_s,
                          "peak_bytes": c.peak_bytes,
                          "param_bytes": c.param_bytes, "in_flight": c.in_flight, "saved_bytes": c.saved_bytes,
                          "in_flight_saved_bytes": c.in_flight * c.saved_bytes, "recompute": c.recompute}
                         for c in stage_costs],
              "candidates": [str(c) for c in candidates]}
    return replace(plan, mesh=mesh, estimate=estimate, pipeline=pipe, budget_bytes=options.budget_bytes(mesh),
                   solver={**solver_stats(solution), "pipeline": record})


def rank_memory(stage_costs: list[StageCost], *, schedule: str, num_stages: int,
                num_microbatches: int) -> list[tuple[int, int]]:
    """Each pipeline rank's (saved bytes at its peak, peak bytes). One stage per rank: the stage's
    own figures. With ``v`` chunks per rank (stage ``c * S + r`` is rank ``r``'s chunk ``c``): all
    chunks' parameter bytes, the most saved bytes the chunks hold together at any point of
    torch's order for the rank (``pipeline.order.rank_counts``; zero-bubble: every chunk its
    ``in_flight``, the bound ``pipeline.schedule.in_flight`` prices) and the largest one-chunk
    transient above its saved bytes (a rank runs one chunk at a time). This is the plan's
    ``peak_bytes`` (it was the largest chunk's peak: about half the measured bytes of GPT-2's
    interleaved ranks). It is at most the sum of the rank's chunk peaks (each chunk is priced at
    its own in-flight peak, ``pipeline.order.chunk_peaks``), so chunks searched under ``budget /
    v`` each keep the rank within the budget."""
    v = len(stage_costs) // num_stages
    if v == 1:
        return [(c.in_flight * c.saved_bytes, c.peak_bytes) for c in stage_costs]
    out = []
    for r in range(num_stages):
        chunks = [stage_costs[c * num_stages + r] for c in range(v)]
        params = sum(c.param_bytes for c in chunks)
        transient = max(max(c.peak_bytes - c.param_bytes - c.in_flight * c.saved_bytes, 0) for c in chunks)
        if schedule == "interleaved-1f1b":
            states = rank_counts(schedule, rank=r, num_stages=num_stages, virtual_stages=v,
                                 num_microbatches=num_microbatches)
            saved = max(sum(n * c.saved_bytes for n, c in zip(state, chunks)) for state in states)
        else:
            saved = sum(c.in_flight * c.saved_bytes for c in chunks)
        out.append((saved, params + saved + transient))
    return out


def pipeline_plan(sub_plan: Plan, traced: TracedGraph, *, mesh: MeshSpec | tuple[int, ...] | str, num_stages: int,
                  num_microbatches: int, schedule: str, virtual_stages: int = 1) -> Plan:
    """The full-mesh plan: ``sub_plan`` (solved on ``traced``, the micro-batch graph, on the
    stage sub-mesh) with even stages over mesh axis 0 of ``mesh`` (size ``num_stages``; a shape
    gets the stage plan's device costs)."""
    if not isinstance(mesh, MeshSpec):
        shape = parse_mesh_shape(mesh)
        base = sub_plan.mesh
        mesh = MeshSpec(shape=shape, axis_names=default_axis_names(len(shape)), alpha=(base.alpha[0],) * len(shape),
                        beta=(base.beta[0],) * len(shape), peak_flops=base.peak_flops,
                        mem_bandwidth=base.mem_bandwidth, mem_capacity=base.mem_capacity, name=base.name,
                        half_peak_flops=base.half_peak_flops, comm_overlap=base.comm_overlap)
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r} is not one of {PIPELINE_SCHEDULES}")
    if mesh.shape[0] != num_stages:
        raise ValueError(f"the pipeline axis (mesh axis 0) of mesh {mesh.shape} has size {mesh.shape[0]}, "
                         f"not num_stages={num_stages}")
    sub = stage_mesh_of(mesh)
    if tuple(sub_plan.mesh.shape) != tuple(sub.shape):
        raise ValueError(f"the stage plan is for mesh {sub_plan.mesh.shape}; stages of mesh {mesh.shape} run on "
                         f"{sub.shape} (the mesh without its pipeline axis)")
    if sub_plan.graph_hash != traced.graph_hash:
        raise ValueError(f"the stage plan was made for graph {sub_plan.graph_hash}, the traced graph is "
                         f"{traced.graph_hash}")
    if sub_plan.pipeline is not None:
        raise ValueError("the stage plan is already pipelined")
    if schedule in ("gpipe", "1f1b") and virtual_stages != 1:
        raise ValueError(f"schedule {schedule!r} runs one stage per rank; got virtual_stages={virtual_stages} "
                         f"(use 'interleaved-1f1b' or 'zero-bubble')")
    if schedule == "interleaved-1f1b" and virtual_stages < 2:
        raise ValueError(f"schedule 'interleaved-1f1b' needs virtual_stages >= 2, got {virtual_stages}")
    if any(n.zero_stage for n in sub_plan.nodes):
        raise ValueError("pipelined plans do not run with ZeRO yet: plan the stages with zero_stage=0")
    if sub_plan.recompute and schedule == "zero-bubble":
        raise ValueError("activation recompute does not run under the zero-bubble schedule (its split backward "
                         "unpacks a checkpoint region twice): plan with checkpoint='none' or another schedule")
    stages = even_stages(traced, num_stages=num_stages, virtual_stages=virtual_stages)
    stage_of = {name: st.index for st in stages for name in st.nodes}
    for region in sub_plan.recompute:  # a recompute region runs inside one stage
        inside = {stage_of[name] for name in region.nodes if name in stage_of}
        if len(inside) > 1:
            raise ValueError(f"recompute region {region.name!r} spans pipeline stages {sorted(inside)}")
    counts = Counter(name for st in stages for name in st.nodes)
    placeholders = {p.name for p in traced.placeholders}
    doubled = sorted(n for n, c in counts.items() if c > 1 and n not in placeholders)
    assert not doubled, doubled  # ops run on exactly one stage
    pipe = PipelinePlan(num_stages=num_stages, num_microbatches=num_microbatches, schedule=schedule,
                        virtual_stages=virtual_stages, stages=stages)
    return replace(sub_plan, mesh=mesh, pipeline=pipe)
