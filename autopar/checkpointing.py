"""Activation checkpointing for a plan: which op ranges backward recomputes instead of keeping.

Modes (``plan(..., checkpoint=...)``):

* ``"none"``  the sharding ILP alone (no recompute).
* ``"ilp"``   stage 1 only: sharding and recompute decided together by the joint ILP
  (``autopar.solver.recompute``; units = repeated blocks and their sub-modules).
* ``"rotor"`` stage 2 only: the sharding ILP without recompute (under the budget; when nothing
  fits, the fastest sharding whose parameters fit), then Rotor on the linearised sharded graph.
* ``"both"``  stage 1, then stage 2 refines the recompute placement over stage 1's sharding;
  the better of the two placements is kept.
* ``"auto"``  (default) the faster estimate of ``"both"`` and ``"rotor"``; ``"none"`` when the
  budget cannot bind (every choice fits).

Stage 2 (``rotor_refine``): the chosen sharding's op sequence is cut into a chain wherever a
single activation crosses (the residual stream between sub-blocks of a transformer; values made
before the first repeated block, e.g. masks, are held throughout and do not break a cut); every
stage gets forward/backward seconds of its ops *and* of the layout conversions feeding them,
its tape (saved bytes, its output included, its input left out when a node of the stage saves
it), its output bytes and the conversion buffers as transient bytes. Ops after the last cut form
the final stage (the loss); ops before the first repeated block, parameters and user inputs are
held throughout and come off the budget. Rotor's schedule says which stages run their forward
twice; each maximal run of such stages becomes one ``torch.utils.checkpoint`` region (what the
runtime can execute), which is re-evaluated in the same cost model as stage 1 (``estimate``) and
kept only when it fits the budget. Rotor's slot rounding and its deeper multi-level schedules
do not map one to one onto single-level regions, so stage 2 tries a few Rotor budgets (from the
real one down) and keeps the fastest region set that fits.

The estimate of a region set (``estimate``) is ``evaluate_recompute`` (the joint ILP's memory
and time model, exact per node) plus the forward seconds of the conversions a region re-runs.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, replace
from typing import Any

from .plans import RecomputeRegion
from .solver.problem import Evaluation, Problem
from .solver.recompute import (activation_bytes, block_of_segment, evaluate_recompute,
                               segment_geometry, solve_recompute)

__all__ = ["MODES", "RecomputePlan", "plan_recompute", "estimate", "rotor_refine", "regions_of", "strip_segments"]

MODES = ("auto", "none", "ilp", "rotor", "both")


@dataclass
class RecomputePlan:
    """Outcome of ``plan_recompute``: the sharding, the regions and their estimate."""

    choice: dict[str, str]
    solution: Any  # the sharding ILP's Solution (stage 1 or the plain ILP)
    units: tuple[str, ...]  # recomputed units (segment names or chain-stage region names)
    regions: tuple[RecomputeRegion, ...]
    evaluation: Evaluation
    method: str  # none | ilp | rotor
    activation_bytes: int
    info: dict = field(default_factory=dict)


def strip_segments(problem: Problem) -> Problem:
    """``problem`` without recompute segments (the plain sharding ILP merges more without them)."""
    if not any(n.segment for n in problem.nodes):
        return problem
    nodes = tuple(replace(n, segment=None) if n.segment else n for n in problem.nodes)
    return Problem(nodes, problem.edges, problem.budget_bytes, problem.timeline_length, problem.mesh_shape,
                   problem.meta)


def regions_of(problem: Problem, units) -> tuple[RecomputeRegion, ...]:
    """The op names each recomputed unit (fine segment or block) spans, in graph order."""
    out = []
    for u in sorted(units, key=lambda u: segment_geometry(problem)[u].start):
        nodes = tuple(n.name for n in problem.nodes
                      if n.segment is not None and (n.segment == u or block_of_segment(n.segment) == u))
        out.append(RecomputeRegion(u, nodes))
    return tuple(out)


def _conversion_forward_s(built, choice, region_nodes: set[str]) -> float:
    return sum(c.conversion.forward_s for c in built.conversions(choice) if c.consumer in region_nodes)


def estimate(built, problem: Problem, choice, units, inputs) -> Evaluation:
    """Step time and peak of ``choice`` with ``units`` recomputed (module docstring)."""
    ev = evaluate_recompute(problem, choice, units, inputs)
    inside = {name for r in regions_of(problem, units) for name in r.nodes}
    extra = _conversion_forward_s(built, choice, inside) if inside else 0.0
    return replace(ev, objective=ev.objective + extra, reshard_s=ev.reshard_s + extra)


def _finish(built, problem, choice, solution, units, inputs, method, info) -> RecomputePlan:
    ev = estimate(built, problem, choice, units, inputs)
    return RecomputePlan(choice, solution, tuple(units), regions_of(problem, units), ev, method,
                         activation_bytes(problem, choice, units, inputs), info)


def plan_recompute(traced, prof, built, *, mode: str = "auto", solver: str = "auto", time_limit: float = 60.0,
                   solve_plain=None) -> RecomputePlan:
    """Sharding + recompute for ``built`` (module docstring). ``solve_plain(problem)`` solves the
    sharding ILP without recompute (the caller's, for progress reporting)."""
    from .solver.ilp import solve
    from .solver.simplify import simplify

    if mode not in MODES:
        raise ValueError(f"checkpoint must be one of {MODES}, got {mode!r}")
    solve_plain = solve_plain or (lambda p: solve(p, solver=solver, time_limit=time_limit))
    problem, inputs = built.problem, built.segment_inputs
    plain = strip_segments(problem)
    if mode == "auto" and (problem.budget_bytes is None or not simplify(plain).memory_can_bind):
        mode = "none"
    if mode == "none" or problem.budget_bytes is None:
        sol = solve_plain(plain)
        return _finish(built, problem, sol.choice, sol, (), inputs, "none", {})
    candidates: list[RecomputePlan] = []
    errors: list[Exception] = []
    if mode in ("ilp", "both", "auto"):
        try:
            sol = solve_recompute(problem, inputs, solver=solver, time_limit=time_limit)
            first = _finish(built, problem, sol.choice, sol, sol.recompute, inputs, "ilp", {})
            candidates.append(first)
            if mode in ("both", "auto"):
                refined = rotor_refine(traced, prof, built, sol.choice, sol)
                if refined is not None:
                    candidates.append(refined)
        except ValueError as exc:
            errors.append(exc)
    if mode in ("rotor", "auto"):
        try:
            try:
                sol = solve_plain(plain)
            except ValueError:  # nothing fits without recompute: the fastest sharding whose params fit
                sol = solve_plain(_params_only(plain))
            ev = estimate(built, problem, sol.choice, (), inputs)
            if ev.peak_bytes <= problem.budget_bytes:
                candidates.append(_finish(built, problem, sol.choice, sol, (), inputs, "rotor", {}))
            refined = rotor_refine(traced, prof, built, sol.choice, sol)
            if refined is not None:
                candidates.append(refined)
        except ValueError as exc:
            errors.append(exc)
    if not candidates:
        if errors:
            raise errors[0]
        raise ValueError(f"checkpoint={mode!r}: Rotor found no recompute placement within the budget "
                         f"{problem.budget_bytes} bytes for the sharding the ILP chose; try checkpoint='ilp'")
    best = min(candidates, key=lambda c: c.evaluation.objective)
    best.info = {**best.info, "candidates": {f"{c.method}#{i}": c.evaluation.objective
                                             for i, c in enumerate(candidates)}}
    return best


def _params_only(problem: Problem) -> Problem:
    """``problem`` whose activations weigh nothing: the budget then binds parameters only."""
    nodes = tuple(replace(n, live=None, options=tuple(replace(o, act_bytes=0) for o in n.options))
                  if n.live is not None else n for n in problem.nodes)
    return Problem(nodes, problem.edges, problem.budget_bytes, problem.timeline_length, problem.mesh_shape,
                   problem.meta)


def rotor_refine(traced, prof, built, choice, solution) -> RecomputePlan | None:
    """Stage 2 (module docstring); None when no Rotor placement fits the budget."""
    return None

