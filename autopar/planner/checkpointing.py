"""Activation checkpointing for a plan: which op ranges backward recomputes instead of keeping.

Modes (``plan(..., checkpoint=...)``):

* ``"none"``  the sharding ILP alone (no recompute).
* ``"ilp"``   stage 1 only: sharding and recompute decided together by the joint ILP
  (``autopar.solver.recompute_ilp``; units = repeated blocks and their sub-modules).
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

The estimate of a region set (``estimate``) is ``Problem.evaluate`` with the regions recomputed
(the joint ILP's memory and time model, exact per node) plus the forward seconds of the
conversions a region re-runs, less what several consumers share (``planner.executed``: a
conversion or a gradient sum runs once for all of them).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from autopar.planner.options import CHECKPOINT_MODES as MODES  # the modes above
from autopar.plans import NodeKind, RecomputeRegion
from autopar.planner.executed import shared_savings, unique_conversions
from autopar.planner.records import BuiltProblem, InputSlot
from autopar.planner.segments import holder_of_producer, mutates_state, segment_inputs
from autopar.layout.blocks import block_of
from autopar.solver.problem import Problem
from autopar.solver.timeline import Evaluation, SegmentInput, activation_bytes, segment_geometry

__all__ = ["MODES", "RecomputePlan", "plan_recompute", "estimate", "rotor_refine", "regions_of", "strip_segments"]


@dataclass(frozen=True)
class RecomputePlan:
    """Outcome of ``plan_recompute``: the sharding, the regions and their estimate.

    ``problem`` is the problem the units are segments of, ``segment_inputs`` what each unit keeps
    (the inputs it was evaluated with): the built problem's, or for a Rotor refinement its own,
    with the Rotor regions as segments."""

    problem: Problem
    segment_inputs: Mapping[str, tuple[SegmentInput, ...]]
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
    return replace(problem, nodes=tuple(replace(n, segment=None) if n.segment else n for n in problem.nodes))


def regions_of(problem: Problem, units) -> tuple[RecomputeRegion, ...]:
    """The op names each recomputed unit (fine segment or block) spans, in graph order."""
    geometry = segment_geometry(problem)  # once: it walks every node
    members: dict[str, list[str]] = {}  # unit -> its ops in graph order (a segment, and its block)
    for n in problem.nodes:
        if n.segment is not None:
            for unit in dict.fromkeys((n.segment, block_of(n.segment))):
                members.setdefault(unit, []).append(n.name)
    return tuple(RecomputeRegion(u, tuple(members.get(u, ()))) for u in sorted(units, key=lambda u: geometry[u].start))


def _conversion_forward_s(built, choice, region_nodes: set[str]) -> float:
    return sum(c.conversion.forward_s for c in unique_conversions(built, choice)[0] if c.consumer in region_nodes)


def estimate(built, problem: Problem, choice, units, inputs) -> Evaluation:
    """Step time and peak of ``choice`` with ``units`` recomputed (module docstring)."""
    ev = problem.evaluate(choice, recompute=units, segment_inputs=inputs)
    inside = {name for r in regions_of(problem, units) for name in r.nodes}
    extra = _conversion_forward_s(built, choice, inside) if inside else 0.0
    comm_saved, reshard_saved = shared_savings(built, choice)  # counted once, as they run
    return replace(ev, objective=ev.objective + extra - comm_saved - reshard_saved, comm_s=ev.comm_s - comm_saved,
                   reshard_s=ev.reshard_s + extra - reshard_saved)


def _finish(built, problem, choice, solution, units, inputs, method, info) -> RecomputePlan:
    ev = estimate(built, problem, choice, units, inputs)
    return RecomputePlan(problem, inputs, choice, solution, tuple(units), regions_of(problem, units), ev, method,
                         activation_bytes(problem, choice, recompute=units, segment_inputs=inputs), info)


def plan_recompute(traced, prof, built, *, mode: str = "auto", solver: str = "auto", time_limit: float = 60.0,
                   solve_plain=None) -> RecomputePlan:
    """Sharding + recompute for ``built`` (module docstring). ``solve_plain(problem)`` solves the
    sharding ILP without recompute (the caller's, for progress reporting)."""
    from autopar.solver.pipeline import solve
    from autopar.solver.simplify import simplify

    if mode not in MODES:
        raise ValueError(f"checkpoint must be one of {MODES}, got {mode!r}")
    solve_plain = solve_plain or (lambda p: solve(p, solver=solver, time_limit=time_limit))
    problem, inputs = built.problem, built.segment_inputs
    plain = strip_segments(problem)
    if mode == "auto" and (problem.budget_bytes is None or not simplify(plain).memory_can_bind):
        mode = "none"
    if mode == "auto":
        # Recompute only adds forward time, so the unconstrained optimum bounds every mode from
        # below: when it fits the budget as it is, it is the answer and the search is skipped.
        free = solve_plain(plain.with_budget(None))
        if plain.evaluate(free.choice).peak_bytes <= problem.budget_bytes:
            return _finish(built, problem, free.choice, free, (), inputs, "none", {"unconstrained_fits": True})
    if mode == "none" or problem.budget_bytes is None:
        sol = solve_plain(plain)
        return _finish(built, problem, sol.choice, sol, (), inputs, "none", {})
    candidates: list[RecomputePlan] = []
    errors: list[Exception] = []
    if mode in ("ilp", "both", "auto"):
        try:
            sol = solve(problem, recompute_inputs=inputs, solver=solver, time_limit=time_limit)
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
    candidate_objectives = {f"{c.method}#{i}": c.evaluation.objective for i, c in enumerate(candidates)}
    return replace(best, info={**best.info, "candidates": candidate_objectives})


def _params_only(problem: Problem) -> Problem:
    """``problem`` whose activations weigh nothing: the budget then binds parameters only."""
    nodes = tuple(replace(n, live=None, options=tuple(replace(o, act_bytes=0) for o in n.options))
                  if n.live is not None else n for n in problem.nodes)
    return replace(problem, nodes=nodes)


ROTOR_BUDGET_FRACTIONS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)


def build_chain(prof, built: BuiltProblem, choice):
    """The chosen sharding's ops as a Rotor ``Chain`` (module docstring). Returns
    ``(chain, stages, held_bytes)``: ``stages[i]`` the op names of stage ``i``, ``held_bytes``
    the activation bytes held outside the chain (ops before it, user inputs)."""
    from autopar.solver.rotor import Chain

    problem = built.problem
    ops = [n for n in problem.nodes if built.decisions[n.name].kind == NodeKind.OP]
    first = next((i for i, n in enumerate(ops) if n.segment is not None), None)
    if first is None:
        return None
    index = {n.name: i for i, n in enumerate(ops)}
    consumers: dict[tuple[str, int], int] = {}  # value -> last consuming op index
    readers: dict[tuple[str, int], set] = {}  # value made before the chain -> blocks reading it
    values: dict[tuple[str, int], InputSlot] = {}  # value -> as its consumers read it
    for dst in built.decisions.values():
        if dst.name not in index:
            continue
        for value in dst.inputs:
            if value is not None and value.producer in index:
                key = (value.producer, value.index)
                values[key] = value
                consumers[key] = max(consumers.get(key, -1), index[dst.name])
                if index[value.producer] < first:
                    readers.setdefault(key, set()).add(block_of(ops[index[dst.name]].segment or "") or "")
    # Values made before the chain count only when one block reads them (the chain's input, not
    # a mask or position table shared by every block: those are held throughout).
    consumers = {k: v for k, v in consumers.items() if index[k[0]] >= first or len(readers.get(k, ())) == 1}
    produced_until: dict[int, list] = {}
    for key, last in consumers.items():
        produced_until.setdefault(max(index[key[0]], first), []).append((key, last))
    cuts, live = [], {}
    for k in range(first, len(ops) - 1):
        for key, last in produced_until.get(k, ()):
            live[key] = last
        live = {key: last for key, last in live.items() if last > k}
        if len(live) == 1:
            cuts.append((k, next(iter(live))))
    if not cuts:
        return None
    option = {n.name: n.options[n.option_index(choice[n.name])] for n in ops}
    conv_f: dict[str, float] = {}
    conv_b: dict[str, float] = {}
    for c in built.conversions(choice):
        conv_f[c.consumer] = conv_f.get(c.consumer, 0.0) + c.conversion.forward_s
        conv_b[c.consumer] = conv_b.get(c.consumer, 0.0) + c.conversion.backward_s

    def local_bytes(key) -> int:
        value = values[key]
        spec = built.choice_of(value.producer, choice[value.producer]).output_specs[value.index]
        return value.local_bytes(spec, built.mesh.shape)

    first_saver = holder_of_producer(prof)  # producer -> the node whose activation counts its storage
    bounds = [first] + [k + 1 for k, _ in cuts] + [len(ops)]
    crossing = [None] + [key for _, key in cuts]  # the value entering each stage
    stages, fwd, bwd, out_b, tape, x0 = [], [], [], [], [], 0
    for i in range(len(bounds) - 1):
        names = [n.name for n in ops[bounds[i]:bounds[i + 1]]]
        stages.append(tuple(names))
        f = sum(option[n].forward_s + conv_f.get(n, 0.0) for n in names)
        total = sum(option[n].cost_s + conv_f.get(n, 0.0) + conv_b.get(n, 0.0) for n in names)
        fwd.append(f)
        bwd.append(max(total - f, 0.0))
        saved = sum(option[n].act_bytes for n in names)
        if i > 0:
            inp = crossing[i]
            a_in = local_bytes(inp)
            if first_saver.get(inp[0]) in names:
                saved = max(saved - a_in, 0)  # the stage input is x_i, counted apart
        out = local_bytes(crossing[i + 1]) if i + 1 < len(crossing) else 0
        out_b.append(out)
        tape.append(saved + out)
    # x_0: the chain's input (what the first stage reads from before the chain), held apart
    held = 0
    for n in problem.nodes:
        o = n.options[n.option_index(choice[n.name])]
        if n.live is not None and (built.decisions[n.name].kind != NodeKind.OP or index.get(n.name, first) < first):
            held += o.act_bytes
    chain = Chain(tuple(fwd), tuple(bwd), x0, tuple(out_b), tuple(tape), (0,) * len(fwd), (0,) * len(fwd),
                  tuple(f"stage{i}" for i in range(len(fwd))))
    return chain, stages, held


def rotor_refine(traced, prof, built, choice, solution) -> RecomputePlan | None:
    """Stage 2 (module docstring); None when no Rotor placement fits the budget."""
    from autopar.solver.rotor import solve_rotor

    problem = built.problem
    made = build_chain(prof, built, choice)
    if made is None:
        return None
    chain, stages, held = made
    # Stages that update model state (running statistics) are never recomputed.
    stateful = {i for i, names in enumerate(stages) if any(mutates_state(traced.node(n)) for n in names)}
    avail = problem.budget_bytes - problem.evaluate(choice).param_bytes - held
    if avail <= 0:
        return None
    best = None
    tried = set()
    for frac in ROTOR_BUDGET_FRACTIONS:
        try:
            sched = solve_rotor(chain, max(int(avail * frac), 1))
        except ValueError:
            break
        runs, cur = [], []
        for i in sched.recomputed_stages:
            if cur and i == cur[-1] + 1:
                cur.append(i)
            else:
                if cur:
                    runs.append(cur)
                cur = [i]
        if cur:
            runs.append(cur)
        if stateful.intersection(sched.recomputed_stages):
            continue
        # One region per run of recomputed stages (only the run's input kept), or one per stage
        # (each stage's input kept: Rotor's checkpoints of x_i); both are what torch can run.
        for grouping in (runs, [[i] for r in runs for i in r]):
            key = tuple(map(tuple, grouping))
            if not grouping or key in tried:
                continue
            tried.add(key)
            region_of = {name: f"rotor[{r[0]}-{r[-1]}]" for r in grouping for i in r for name in stages[i]}
            nodes = tuple(replace(n, segment=region_of.get(n.name)) for n in problem.nodes)
            p2 = replace(problem, nodes=nodes)
            inputs2 = segment_inputs(traced, prof, built.decisions, built.mesh.shape, region_of)
            geo = segment_geometry(p2)
            units = tuple(u for u in dict.fromkeys(region_of.values()) if u in geo)  # regions that save
            plan = _finish(built, p2, choice, solution, units, inputs2, "rotor",
                           {"rotor_stages": len(stages), "rotor_budget_fraction": frac})
            if plan.evaluation.peak_bytes <= problem.budget_bytes and (
                    best is None or plan.evaluation.objective < best.evaluation.objective):
                best = plan
    return best

