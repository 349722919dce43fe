"""The public ``Plan`` record from a solved problem, and baseline families as restricted problems.

``autopar.api`` assembles the plans it returns here, and so can anyone who solves a problem
from ``build_problem`` by other means (benchmarks solve a baseline family's problem on its own and
run the resulting plan): every record field is derived from the built problem, the solver's
choice and its evaluation in one place.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from autopar.planner.baselines import BASELINES, FAMILY_ZERO, ZERO_BASELINES, baseline_roles, make_restriction
from autopar.plans import BaselineResult, Estimate, NodeKind, NodePlan, Plan
from autopar.solver.problem import Problem

__all__ = ["assemble_plan", "node_plans", "estimate_of", "solver_stats", "applicable_baselines", "baseline_result",
           "baseline_problem", "family_built", "restricted_built", "restricted_problem"]


def assemble_plan(traced, built, *, choice: dict[str, str], evaluation, solution,
                  timings: dict[str, float] | None = None, baselines: tuple = (), recompute: tuple = (),
                  checkpoint: dict[str, Any] | None = None, reduce_dtype: str = "fp32") -> Plan:
    """The ``Plan`` of ``choice`` (decision -> option name) on ``built`` (its mesh and budget).
    ``evaluation``: the choice's cost-model evaluation (with recompute, where there is any);
    ``solution``: the solver's ``Solution`` (its statistics go into ``Plan.solver``)."""
    return Plan(
        model=traced.model_name, graph_hash=traced.graph_hash, mesh=built.mesh,
        budget_bytes=built.problem.budget_bytes, nodes=node_plans(built, choice),
        estimate=estimate_of(evaluation), solver=solver_stats(solution), timings=dict(timings or {}),
        baselines=tuple(baselines), fallbacks=built.fallbacks, recompute=tuple(recompute),
        checkpoint=dict(checkpoint or {}), precision=traced.precision, reduce_dtype=reduce_dtype,
    )


def node_plans(built, choice: dict[str, str]) -> tuple[NodePlan, ...]:
    """One ``NodePlan`` per decision of ``built``, for the chosen option."""
    out = []
    names: dict[int, tuple] = {}  # id(choice) -> (choice, its spec names): repeated blocks share choices
    for node in built.problem.nodes:
        decision = built.decision(node.name)
        c = built.choice_of(node.name, choice[node.name])
        hit = names.get(id(c))
        if hit is None:
            hit = names[id(c)] = (c, tuple(None if s is None else str(s) for s in c.input_specs),
                                  tuple(None if s is None else str(s) for s in c.output_specs))
        out.append(NodePlan(
            name=node.name, kind=decision.kind, strategy=c.name, input_specs=hit[1], output_specs=hit[2],
            op=decision.op, module=decision.module or "",  # the graph output has no module
            zero_stage=c.zero_stage,
        ))
    return tuple(out)


def estimate_of(evaluation) -> Estimate:
    """The public ``Estimate`` of a cost-model ``Evaluation``."""
    ev = evaluation
    return Estimate(step_s=ev.objective, compute_s=ev.compute_s, comm_s=ev.comm_s,
                    reshard_s=ev.reshard_s, param_bytes=ev.param_bytes, peak_bytes=ev.peak_bytes,
                    async_s=ev.async_s, hidden_s=ev.hidden_s)


def solver_stats(solution) -> dict:
    """``Plan.solver``: status, backend, objective, bound, gap, timings and model size."""
    return {
        "status": solution.status, "backend": solution.backend, "objective": solution.objective,
        "lp_bound": solution.lp_bound, "gap": solution.gap, "timings": dict(solution.timings),
        "num_variables": solution.num_variables, "num_constraints": solution.num_constraints,
    }


# ------------------------------------------------------------------------------- baselines
def applicable_baselines(num_axes: int, *, zero: bool = False) -> tuple[str, ...]:
    """The baseline families (``autopar.planner.baselines``) defined on a mesh of ``num_axes`` axes;
    ``zero``: the problem has ZeRO options (``zero_stage="auto"``), so ZeRO-1/2 families too."""
    return tuple(b for b in BASELINES if baseline_roles(b, num_axes) is not None
                 and (zero or b not in ZERO_BASELINES))


def baseline_problem(name: str, traced, built) -> Problem:
    """``built.problem`` restricted to baseline family ``name`` on ``built``'s mesh. ValueError:
    the family does not apply to the mesh, or leaves some decision without an option."""
    return restricted_problem(built, traced, _family_restriction(name, built), name)


def seed_data_parallel(traced, built, options):
    """Keep the data-parallel family's plan as a known plan of ``built.problem`` (``solver.incumbents``,
    inside the planning call's ``remembering``), so that a solve of the full problem stopped short of
    its optimum never answers with a plan its cost model prices above data parallelism
    (``solver.driver``): among near-ties such a stop kept GPT-2 on 2x2 on a layout 0.1% above it
    that measured 17% slower. Nothing when the family does not apply or finds no plan within a tenth
    of ``options.time_limit`` (a restricted problem: milliseconds). Returns (the family's problem,
    its solution) when that solution is optimal -- the data-parallel baseline's, which
    ``plan_traced`` then does not solve again -- else None."""
    from autopar.solver import incumbents
    from autopar.solver.driver import SolveTimeout, solve

    if "data-parallel" not in applicable_baselines(built.mesh.ndim):
        return None
    try:
        problem = baseline_problem("data-parallel", traced, built)
        solution = solve(problem, solver=options.solver, time_limit=0.1 * options.time_limit)
    except (ValueError, SolveTimeout):
        return None
    incumbents.remember(built.problem, solution.choice)
    return (problem, solution) if solution.status == "optimal" else None


def baseline_result(name: str, traced, built, *, solve, progress, solved: tuple | None = None) -> BaselineResult:
    """Family ``name``'s best plan on ``built`` as a ``BaselineResult`` (refused: why), solved by
    ``solve(problem, stage name)``; ``solved``: (its problem, an optimal solution) found already
    (``seed_data_parallel``'s), not solved again."""
    from autopar.planner.checkpointing import estimate
    from autopar.solver.driver import SolveTimeout

    try:
        with progress.stage(f"baseline {name}"):
            problem, solution = solved or (baseline_problem(name, traced, built), None)
        solution = solution or solve(problem, f"baseline {name} solve")
    except (ValueError, SolveTimeout) as exc:  # the family cannot fit the budget (or has no legal layout), or
        return BaselineResult(name, False, None, str(exc).splitlines()[0])  # no plan of it was found in time
    return BaselineResult(name, True, estimate_of(estimate(built, problem, solution.choice, (), built.segment_inputs)))


def family_built(name: str, traced, built):
    """``built`` restricted to family ``name``: the ``BuiltProblem`` whose problem is
    ``baseline_problem``'s and whose decisions keep the matching choices, so everything that
    reads a built problem (the pipeline stage search, ``assemble_plan``) plans within the family."""
    return restricted_built(built, traced, _family_restriction(name, built), name)


def restricted_built(built, traced, restriction, name: str):
    """``built`` keeping only the choices ``restriction`` allows (``restricted_problem``), its
    decisions' choices sliced to match."""
    keep: dict[str, list[int]] = {}
    problem = restricted_problem(built, traced, restriction, name, keep=keep)
    decisions = {n: d if n not in keep else replace(d, choices=tuple(d.choices[i] for i in keep[n]))
                 for n, d in built.decisions.items()}
    return replace(built, problem=problem, decisions=decisions)


def _family_restriction(name: str, built):
    roles = baseline_roles(name, built.mesh.ndim)
    if roles is None:
        raise ValueError(f"family {name!r} does not apply to mesh {built.mesh.shape}")
    # Stages are a choice only where the problem offers several per layout (zero_stage="auto").
    # (A problem built at one stage gives its sharded layouts stage 0: several stages overall, one per layout.)
    staged = any(len({(str(c.output_specs[0]), c.zero_stage) for c in d.choices})
                 > len({str(c.output_specs[0]) for c in d.choices})
                 for d in built.decisions.values() if d.kind == NodeKind.PARAMETER)
    if name in FAMILY_ZERO and not staged:
        raise ValueError(f"family {name!r} needs a problem with ZeRO options (zero_stage='auto')")
    stage = FAMILY_ZERO.get(name, 0) if staged else None
    return make_restriction(roles, zero_stage=stage, mesh_shape=built.mesh.shape)


def restricted_problem(built, traced, restriction, name: str, *, keep: dict[str, list[int]] | None = None) -> Problem:
    """``built.problem`` keeping only the options ``restriction(kind, fx_node, choice)`` allows
    (same options, costs and liveness as the unrestricted problem, whose edges are sliced
    instead of re-deriving every strategy and conversion cost). ``keep`` receives each node's
    kept option indices."""
    keep = {} if keep is None else keep
    nodes = []
    for node in built.problem.nodes:
        decision = built.decision(node.name)
        kind = decision.kind
        idx = list(range(node.num_options))
        if kind != NodeKind.OUTPUT:  # the graph output is fixed (replicated), as in the builder
            fx_node = traced.node(node.name)
            idx = [i for i in idx if restriction(kind, fx_node, decision.choices[i])]
        if not idx:
            module = traced.module_path(traced.node(node.name)) or "<top level>"
            raise ValueError(f"the {name} restriction leaves no option for {kind} {node.name!r} (module {module})")
        keep[node.name] = idx
        nodes.append(replace(node, options=tuple(node.options[i] for i in idx)))
    edges = tuple(e.restricted(keep[e.src], keep[e.dst]) for e in built.problem.edges)
    p = built.problem
    return replace(p, nodes=tuple(nodes), edges=edges, meta={**p.meta_dict, "restriction": name})
