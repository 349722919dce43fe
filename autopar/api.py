"""The public entry points: ``plan`` (offline, no process group).

``plan(model, meta_inputs, *, mesh, ...)`` traces the model on fake tensors, profiles it,
enumerates sharding strategies per node, builds the plain-data problem, solves the ILP under the
per-device memory budget and returns a :class:`~autopar.plans.Plan`. With ``baselines=True`` it
also solves data parallel, ZeRO-3, Megatron TP and DP x TP in the same cost model.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Sequence

from autopar.layout.mesh import MeshSpec, parse_bytes
from autopar.plans import BaselineResult, Estimate, NodePlan, Plan

__all__ = ["plan", "plan_graph", "Progress"]


class Progress:
    """Stage lines with elapsed time (``verbose``), or silence. ``sink`` receives each line."""

    def __init__(self, verbose: bool = False, sink: Callable[[str], None] | None = None) -> None:
        self.verbose = verbose
        self.sink = sink or (lambda line: print(line, file=sys.stderr, flush=True))
        self.timings: dict[str, float] = {}
        self._start = time.perf_counter()

    @contextmanager
    def stage(self, name: str, detail: str = ""):
        if self.verbose:
            self.sink(f"[autopar {time.perf_counter() - self._start:6.1f}s] {name}{' ' + detail if detail else ''} ...")
        t0 = time.perf_counter()
        yield
        self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - t0
        if self.verbose:
            self.sink(f"[autopar {time.perf_counter() - self._start:6.1f}s] {name} done in {self.timings[name]:.2f}s")


def plan(
    model: Any,
    meta_inputs: tuple | dict,
    *,
    mesh: MeshSpec | Sequence[int] | str,
    memory_budget: int | float | str | None = None,
    solver: str = "auto",
    time_limit: float = 60.0,
    device: str = "cpu",
    baselines: bool = False,
    optimizer_multiplier: float = 2.0,
    allow_replicate_fallback: bool = False,
    verbose: bool = False,
    progress: Progress | None = None,
    context: dict | None = None,
    checkpoint: str = "auto",
) -> Plan:
    """Plan ``model`` on ``mesh`` offline. ``mesh``: a MeshSpec, or a shape (``(2, 4)``/``"2x4"``)
    with the ``device`` preset's costs. ``memory_budget``: bytes or ``"16GiB"``; None = the
    device capacity from the MeshSpec. ``context``: a dict that receives the intermediate
    ``traced``, ``profile``, ``built`` and ``solution`` (for reports that need per-node data).
    ``checkpoint``: activation recompute planning, ``"auto"`` (the faster of the joint ILP +
    Rotor refinement and Rotor alone; nothing when the budget cannot bind), ``"ilp"``,
    ``"rotor"``, ``"both"`` or ``"none"`` (see ``autopar.planner.checkpointing``)."""
    from autopar.strategies import needs_decomposition
    from autopar.tracer import profile as profile_graph
    from autopar.tracer import trace

    progress = progress or Progress(verbose)
    with progress.stage("trace"):
        traced = trace(model, meta_inputs, decompose_if=needs_decomposition)
    with progress.stage("profile"):
        prof = profile_graph(traced)
    return plan_graph(traced, prof, mesh=mesh, memory_budget=memory_budget, solver=solver,
                      time_limit=time_limit, device=device, baselines=baselines,
                      optimizer_multiplier=optimizer_multiplier,
                      allow_replicate_fallback=allow_replicate_fallback, progress=progress,
                      context=context, checkpoint=checkpoint)


def plan_graph(
    traced: Any,
    prof: Any,
    *,
    mesh: MeshSpec | Sequence[int] | str,
    memory_budget: int | float | str | None = None,
    solver: str = "auto",
    time_limit: float = 60.0,
    device: str = "cpu",
    baselines: bool = False,
    optimizer_multiplier: float = 2.0,
    allow_replicate_fallback: bool = False,
    progress: Progress | None = None,
    context: dict | None = None,
    checkpoint: str = "auto",
) -> Plan:
    """``plan`` from an existing trace and profile (one trace serves many meshes and budgets)."""
    from autopar.planner.builder import BuildOptions, build_problem

    mesh = MeshSpec.coerce(mesh, device=device)
    budget = mesh.mem_capacity if memory_budget is None else parse_bytes(memory_budget)
    progress = progress or Progress(False)
    options = BuildOptions(optimizer_multiplier=optimizer_multiplier,
                           allow_replicate_fallback=allow_replicate_fallback)
    with progress.stage("strategies", f"{sum(1 for _ in traced.compute_nodes())} ops on mesh {mesh}"):
        built = build_problem(traced, prof, mesh, budget_bytes=budget, options=options)
    from autopar.planner.checkpointing import plan_recompute

    rc = plan_recompute(traced, prof, built, mode=checkpoint, solver=solver, time_limit=time_limit,
                        solve_plain=lambda p: _solve(p, solver=solver, time_limit=time_limit,
                                                     progress=progress, stage="solve"))
    solution = rc.solution
    if context is not None:
        context.update(traced=traced, profile=prof, built=built, solution=solution, recompute=rc)
    results = ()
    if baselines:
        results = tuple(_baseline(name, traced, built, mesh, solver, time_limit, progress)
                        for name in _applicable_baselines(mesh.ndim))
    return Plan(
        model=traced.model_name, graph_hash=traced.graph_hash, mesh=mesh, budget_bytes=budget,
        nodes=_node_plans(traced, built, rc.choice),
        estimate=_estimate_of(rc.evaluation),
        solver=_solver_stats(solution), timings=dict(progress.timings), baselines=results,
        fallbacks=built.fallbacks, recompute=rc.regions,
        checkpoint={"mode": checkpoint, "method": rc.method, "units": list(rc.units),
                    "activation_bytes": rc.activation_bytes, **rc.info},
    )


# ----------------------------------------------------------------------------------- helpers
def _solve(problem, *, solver, time_limit, progress, stage):
    from autopar.solver.ilp import solve

    with progress.stage(stage, f"{problem.num_nodes} decisions, {problem.num_edges} edges"):
        return solve(problem, solver=solver, time_limit=time_limit)


def _applicable_baselines(num_axes: int) -> list[str]:
    from autopar.planner.baselines import BASELINES, baseline_roles

    return [b for b in BASELINES if baseline_roles(b, num_axes) is not None]


def _baseline(name, traced, built, mesh, solver, time_limit, progress) -> BaselineResult:
    from autopar.planner.baselines import baseline_roles, make_restriction

    try:
        with progress.stage(f"baseline {name}"):
            problem = _restricted_problem(built, traced, make_restriction(baseline_roles(name, mesh.ndim)), name)
        solution = _solve(problem, solver=solver, time_limit=time_limit, progress=progress,
                          stage=f"baseline {name} solve")
    except ValueError as exc:  # the family cannot fit the budget (or has no legal layout)
        return BaselineResult(name, False, None, str(exc).splitlines()[0])
    return BaselineResult(name, True, _estimate(problem, solution.choice))


def _restricted_problem(built, traced, restriction, name: str):
    """``built.problem`` keeping only the options ``restriction`` allows: the problem
    ``build_problem(..., restriction=...)`` builds (same options, costs and liveness), sliced from
    the unrestricted one instead of re-deriving every strategy and conversion cost."""
    from autopar.solver.problem import Edge, Node, Problem

    keep: dict[str, list[int]] = {}
    nodes = []
    for node in built.problem.nodes:
        kind = built.kinds[node.name]
        idx = list(range(node.num_options))
        if kind != "output":  # the graph output is fixed (replicated), as in the builder
            fx_node = traced.node(node.name)
            idx = [i for i in idx if restriction(kind, fx_node, built.choices[node.name][i])]
        if not idx:
            module = traced.module_path(traced.node(node.name)) or "<top level>"
            raise ValueError(f"the {name} restriction leaves no option for {kind} {node.name!r} (module {module})")
        keep[node.name] = idx
        nodes.append(Node(node.name, tuple(node.options[i] for i in idx), live=node.live, block=node.block,
                          signature=node.signature, segment=node.segment))
    edges = tuple(Edge(e.src, e.dst, tuple(tuple(e.costs[i][j] for j in keep[e.dst]) for i in keep[e.src]))
                  for e in built.problem.edges)
    p = built.problem
    return Problem(tuple(nodes), edges, p.budget_bytes, p.timeline_length, p.mesh_shape,
                   {**p.meta_dict, "restriction": name})


def _estimate(problem, choice) -> Estimate:
    return _estimate_of(problem.evaluate(choice))


def _estimate_of(ev) -> Estimate:
    return Estimate(step_s=ev.objective, compute_s=ev.compute_s, comm_s=ev.comm_s,
                    reshard_s=ev.reshard_s, param_bytes=ev.param_bytes, peak_bytes=ev.peak_bytes)


def _solver_stats(solution) -> dict:
    return {
        "status": solution.status, "backend": solution.backend, "objective": solution.objective,
        "lp_bound": solution.lp_bound, "gap": solution.gap, "timings": dict(solution.timings),
        "num_variables": solution.num_variables, "num_constraints": solution.num_constraints,
    }


def _node_plans(traced, built, choice: dict[str, str]) -> tuple[NodePlan, ...]:
    from autopar.tracer.graph import PLACEHOLDER_KEY

    out = []
    for node in built.problem.nodes:
        idx = node.option_index(choice[node.name])
        c = built.choices[node.name][idx]
        fx_node = traced.node(node.name)
        kind = built.kinds[node.name]
        if kind == "op":
            where, op = traced.module_path(fx_node), str(fx_node.target)
        elif kind == "output":
            where, op = "", ""
        else:
            where, op = fx_node.meta[PLACEHOLDER_KEY].fqn, ""
        out.append(NodePlan(
            name=node.name, kind=kind, strategy=c.name,
            input_specs=tuple(None if s is None else str(s) for s in c.input_specs),
            output_specs=tuple(None if s is None else str(s) for s in c.output_specs),
            op=op, module=where,
        ))
    return tuple(out)
