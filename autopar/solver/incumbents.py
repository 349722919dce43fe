"""Plans known during one planning call, and the neighbourhood heuristic that finds a first plan.

Why: at a tight budget the ILPs' relaxations are weak and fractional, and HiGHS's search meets
good plans late. A 2-layer DeepseekV3 on 2x2 at 560 kB: the joint recompute ILP's relaxation is
9.22 ms with 149 of 220 option groups fractional; HiGHS's first plan after 33 s was 101 ms, its
second (59 s) 10.8 ms. A time limit there used to end in ``SolveTimeout`` or a 93% gap.

**Known plans** (``keeping``, ``remember``, ``fitting``). Within a planning call (the scope of
``autopar.solver.driver.remembering``), every plan a solve returns and every minimum-peak plan
``minimum_budget`` finds is kept with the graph it is a plan of (the problem's ``edges`` tuple:
a budget change, ``strip_segments`` or a params-only copy keep it). A plan is a choice (node ->
option name) and the units it recomputes; it is a plan of any problem on the same graph, and
``Problem.evaluate`` says exactly what it costs there and whether it fits that problem's budget.
A solve that runs out of time without a plan answers with the fastest known plan that fits
(``fitting``): a minimum-peak plan fits every budget at or above its peak, so a budget at or
above the minimum the planner reported always has one.

**Neighbourhood** (``neighbourhood``): the ILP restricted to the options its LP relaxation uses
(every option with a positive value) plus the options of the known plans that fit, solved as a
MIP. A
restricted model's plans are plans of the full model with the same objective and memory (every
term is kept for the options left; a group left with one option is a constant, its edges folded
into its neighbours' costs), so its answer is a feasible plan of the full model, i.e. an upper
bound; its optimality is not claimed (the caller measures its gap against the full model's
bound). The support is small where it matters: DeepseekV3 above, 1-4 options per group (the
full model has up to 768): a 2,611-column MIP solved in 3 s to 10.26 ms, the minimum-peak
plan's options keeping it feasible; a 1-layer Llama at 1.1x its minimum budget: 0.35 s to
4.914 ms against the optimum 4.908 ms that HiGHS proved in 54 s; T5 tiny at 1.1x: 10.29 ms
against the optimum 9.67 ms HiGHS proved in 226 s (its relaxation: 7.22 ms). No torch import.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Mapping

import numpy as np

from autopar.solver.ilp import IlpModel, Outcome
from autopar.solver.problem import Problem, Solution
from autopar.solver.recompute_ilp import RecomputeModel
from autopar.solver.simplify import EdgeItem, Member, MemItem, Reduced, settle_edge_items
from autopar.solver.timeline import Evaluation, SegmentInputs

__all__ = ["KnownPlan", "keeping", "remember", "known", "fits", "fitting", "unless_faster", "adopted", "restrict",
           "neighbourhood"]

_MAX_KNOWN = 16  # plans kept per call (oldest dropped): each costs an evaluation when a solve falls back


@dataclass(frozen=True)
class KnownPlan:
    """A plan of the graph ``edges`` (a problem's ``edges`` tuple, by identity): ``choice``
    (node -> option name) with ``recompute`` units recomputed, their kept inputs ``inputs``."""

    edges: tuple
    choice: Mapping[str, str]
    recompute: tuple[str, ...] = ()
    inputs: SegmentInputs | None = None


_known: list[KnownPlan] | None = None


@contextmanager
def keeping() -> Iterator[None]:
    """Within the block, ``remember`` keeps plans (nested blocks share the outer one's)."""
    global _known
    outer, _known = _known, ([] if _known is None else _known)
    try:
        yield
    finally:
        _known = outer


def remember(problem: Problem, choice: Mapping[str, str], recompute=(), inputs: SegmentInputs | None = None) -> None:
    """Keep a plan of ``problem``'s graph (nothing outside ``keeping``)."""
    if _known is None:
        return
    plan = KnownPlan(problem.edges, dict(choice), tuple(recompute), inputs if recompute else None)
    for i, other in enumerate(_known):
        if other.edges is plan.edges and other.recompute == plan.recompute and other.choice == plan.choice:
            del _known[i]  # the newest copy goes last
            break
    _known.append(plan)
    del _known[:-_MAX_KNOWN]


def known(problem: Problem, inputs: SegmentInputs | None = None) -> list[KnownPlan]:
    """The known plans of ``problem``'s graph that it can evaluate: without recompute, or with
    units of ``inputs`` (the same segment inputs object)."""
    return [p for p in (_known or ()) if p.edges is problem.edges and (not p.recompute or p.inputs is inputs)]


def fits(problem: Problem, inputs: SegmentInputs | None = None, *,
         fixed: Mapping[str, bool] | None = None) -> list[tuple[KnownPlan, Evaluation]]:
    """The known plans that fit ``problem``'s budget, evaluated exactly on it, fastest first;
    ``fixed`` (recompute unit -> decision): only those that keep those decisions."""
    out = []
    for plan in known(problem, inputs):
        if fixed and any((u in plan.recompute) != bool(v) for u, v in fixed.items()):
            continue
        ev = problem.evaluate(plan.choice, recompute=plan.recompute, segment_inputs=plan.inputs)
        if problem.budget_bytes is None or ev.peak_bytes <= problem.budget_bytes:
            out.append((plan, ev))
    return sorted(out, key=lambda found: found[1].objective)


def fitting(problem: Problem, inputs: SegmentInputs | None = None) -> tuple[KnownPlan, Evaluation] | None:
    """The fastest known plan that fits ``problem``'s budget, evaluated exactly on it; None when
    none fits."""
    found = fits(problem, inputs)
    return found[0] if found else None


def unless_faster(solution: Solution, problem: Problem, inputs: SegmentInputs | None,
                  fixed: Mapping[str, bool] | None = None) -> Solution:
    """``solution``, not proven optimal (stopped at its time limit, or within the MIP gap), or the
    fastest known plan that fits when that one is faster (``fits``): a search stopped at its time
    limit among near-ties kept a plan 0.1% above the data-parallel one the planner seeds (GPT-2 on
    2x2), which measured 17% slower."""
    keeps = fits(problem, inputs, fixed=fixed)
    if not keeps or keeps[0][1].objective >= solution.objective:
        return solution
    return adopted(solution, *keeps[0])


def adopted(solution: Solution, plan: KnownPlan, ev: Evaluation) -> Solution:
    """``solution`` answering with the known ``plan`` (``ev``: its evaluation on the solved problem)
    instead: status "feasible", its gap against ``solution``'s bound."""
    bound = None if solution.dual_bound is None else min(solution.dual_bound, ev.objective)
    gap = None if bound is None else (ev.objective - bound) / ev.objective if ev.objective > 0 else 0.0
    return replace(solution, choice=dict(plan.choice), objective=ev.objective, dual_bound=bound, gap=gap,
                   peak_bytes=ev.peak_bytes, recompute=plan.recompute, status="feasible")


def restrict(reduced: Reduced, keep: list[np.ndarray]) -> Reduced:
    """``reduced`` with group ``g`` limited to the options ``keep[g]`` (sorted indices; at least
    one), every term kept for them (module docstring); edges of a group left with one option
    are folded into the other end's cost (or the constant), as ``simplify`` leaves them."""
    cost = [reduced.cost[g][k].astype(float) for g, k in enumerate(keep)]
    constant = reduced.constant
    edges = {}
    for (a, b), mat in reduced.edges.items():
        constant += _fold_or_keep(edges, cost, a, b, mat[np.ix_(keep[a], keep[b])], keep)
    # Pairwise memory items restricted alike; one touching a 1-option group is a MemItem now.
    settled, pairs = settle_edge_items([EdgeItem(it.a, it.b, it.start, it.end, it.bytes[np.ix_(keep[it.a], keep[it.b])])
                                        for it in reduced.edge_items], [len(k) for k in keep])
    for it in pairs:
        edges.setdefault((it.a, it.b), np.zeros(it.bytes.shape))
    overlap = reduced.overlap
    if overlap is not None:  # the edges' asynchronous seconds go where their edges went
        asy = [v[k].astype(float) for v, k in zip(overlap.async_s, keep)]
        kept_async: dict = {}
        for (a, b), mat in overlap.edges.items():
            # a constant left here is asynchronous seconds every plan has: onto a 1-option group
            asy[a][0] += _fold_or_keep(kept_async, asy, a, b, mat[np.ix_(keep[a], keep[b])], keep)
        overlap = replace(overlap, async_s=tuple(asy), compute_s=tuple(v[k] for v, k in zip(overlap.compute_s, keep)),
                          edges=kept_async)
    return replace(
        reduced, cost=tuple(cost), param=tuple(reduced.param[g][k] for g, k in enumerate(keep)),
        forward=tuple({s: v[k] for s, v in reduced.forward[g].items()} for g, k in enumerate(keep)),
        mem_items=tuple(MemItem(it.group, it.start, it.end, it.bytes[keep[it.group]], it.segment)
                        for it in reduced.mem_items) + settled, edge_items=pairs,
        edges=edges, constant=constant,
        members=tuple(Member(m.node, m.group, tuple(m.option_names[k] for k in keep[m.group]))
                      for m in reduced.members),
        overlap=overlap)


def _fold_or_keep(edges: dict, vecs: list, a: int, b: int, sub: np.ndarray, keep: list) -> float:
    """Keep edge ``(a, b)`` restricted to ``sub`` in ``edges`` when both ends keep several options;
    else fold it into the other end's vector in ``vecs``; returns what is left for a constant."""
    if len(keep[a]) > 1 and len(keep[b]) > 1:
        edges[(a, b)] = sub
    elif len(keep[b]) > 1:
        vecs[b] = vecs[b] + sub[0, :]
    elif len(keep[a]) > 1:
        vecs[a] = vecs[a] + sub[:, 0]
    else:
        return float(sub[0, 0])
    return 0.0


def _group_options(reduced: Reduced, choice: Mapping[str, str]) -> list[int | None]:
    """Per group, the option a node-level plan picks for its first member (None when that
    option was simplified away: the plan is then not of this model, only a hint for it)."""
    out: list[int | None] = [None] * reduced.num_groups
    for m in reduced.members:
        if out[m.group] is None and choice.get(m.node) in m.option_names:
            out[m.group] = m.option_names.index(choice[m.node])
    return out


def neighbourhood(model: IlpModel, problem: Problem, inputs: SegmentInputs | None, backend: str, *,
                  limit: float | None, limits: Callable[[], dict[str, float]]) -> Outcome | None:
    """A plan of ``model`` from its restriction to the LP support (the values its variables
    hold) and the options of the known plans that fit (module docstring), or None when that MIP
    has none in time. ``limit``: the memory limit ``model`` was built with; ``limits()``: the
    run's ``time_limit``/``hard_limit``. On success the model's ``x`` (and ``r``) hold the plan.

    Only plans that fit are added: they keep the restriction feasible, the others only make it
    larger (a 2-layer DeepseekV3 on 2x2 at 1.1x its minimum: with the options of three known
    plans that do not fit, 5.2 s to 13.968 ms; without, 2.4 s to 13.976 ms)."""
    reduced = model.reduced
    keep = [set() if xs is None else {k for k, v in enumerate(xs) if model.lp.value(v) > 1e-6} for xs in model.x]
    for plan, _ in fits(problem, inputs):
        for g, k in enumerate(_group_options(reduced, plan.choice)):
            if k is not None and model.x[g] is not None:
                keep[g].add(k)
    keep = [np.array(sorted(k) or [0], dtype=int) if xs is not None else np.zeros(1, dtype=int)
            for k, xs in zip(keep, model.x)]
    sub_reduced = restrict(reduced, keep)
    name = model.name + "_nbhd"
    if isinstance(model, RecomputeModel):
        sub: IlpModel = RecomputeModel(sub_reduced, problem, inputs, name, fixed=model.fixed, order=model.order)
    else:
        sub = IlpModel(sub_reduced, name)
    sub.build_fastest(limit)
    out = sub.run(backend, **limits())
    if out.value is None:
        return None
    values = np.zeros(model.lp.num_columns) if model.lp.values is None else model.lp.values
    for xs, k, s in zip(model.x, keep, sub.choice()):
        if xs is not None:
            values[xs] = 0.0
            values[xs[k[s]]] = 1.0
    if isinstance(model, RecomputeModel):
        chosen = set(sub.recomputed())
        for u, v in model.r.items():
            values[v] = 1.0 if u in chosen else 0.0
    model.lp.values = values
    return replace(out, status="feasible", dual_bound=None)
