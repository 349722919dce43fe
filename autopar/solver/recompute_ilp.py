"""Recompute (activation checkpointing) decided inside the sharding ILP: one objective, one budget.

Segments
--------
A *segment* is a contiguous run of ops that may be recomputed as one
``torch.utils.checkpoint`` region: the builder names one per repeated block
(``Node.segment = "transformer.h.3"``). For a choice ``x`` (one option per node):

* ``A_s(x)``: bytes the segment's nodes save for backward (their ``act_bytes``);
* ``c_s(x)``: bytes of the activations the segment reads from outside (``SegmentInput``: what a
  checkpoint region keeps; inputs whose storage an outside node saves anyway are left out by the
  builder, so no storage counts twice);
* ``F_s(x)``: forward seconds of its nodes (``StrategyOption.forward_s``): what recomputing costs.

Timeline of a segment (items of the ``Problem`` memory timeline, closed intervals): ``S0`` = the
first start of its items, ``b`` = the first end (the point where the segment's backward begins),
``E`` = the last end. Kept (``r_s = 0``): each item is held on ``[start, end]`` as in
``Problem.evaluate``. Recomputed (``r_s = 1``): each item's *forward part* ``[start, b-1]`` is
gone; its *backward part* ``[b, end]`` stays (backward rematerialises the whole segment when it
reaches it, then frees each saved tensor after its own backward, as non-reentrant checkpoint
does), and the inputs ``c_s(x)`` are held on ``[S0, E]``. Step time grows by ``F_s(x)``. A value
several recomputed segments read is one tensor: ``evaluate_recompute`` counts it once (from the
first such segment's start to the last one's end); the ILP counts it per segment (an upper bound).

Every forward part of a segment is live at every timeline point ``t`` with ``N <= t < b`` (the
backward half; all items start in forward, ``start < N``) and at the last forward start, the
only points where a peak can be (``simplify.peak_candidates``: nothing ends in forward). So on
``[S0, b-1]`` a segment contributes ``H_s = (1 - r_s) A_s(x) + r_s c_s(x)`` at every peak
candidate, and on ``[b, E]`` its backward parts plus ``J_s = r_s c_s(x)``.

Linearisation (exact for binary ``x`` and ``r``; all in MiB or seconds)
--------------------------------------------------------------------
Variables per segment: ``r_s`` binary; ``H_s, J_s, T_s >= 0`` continuous. With
``A_s(x) = sum_{g,k} a_{s,g,k} x[g,k]`` (likewise ``c_s``, ``F_s``) and the big-M constants
``MA_s = sum_g max_k a_{s,g,k}`` (likewise ``Mc_s``, ``MF_s``)::

    H_s >= A_s(x) - MA_s r_s          H_s >= c_s(x) - Mc_s (1 - r_s)
    J_s >= c_s(x) - Mc_s (1 - r_s)    T_s >= F_s(x) - MF_s (1 - r_s)
    memory at candidate k:  P + sum(plain items live at k) + sum_{s: S0<=k<b} H_s
                            + sum_{s: b<=k<=E} (backward parts live at k + J_s)  <= budget
    objective:              (the sharding ILP's) + sum_s T_s

``H``, ``J`` appear only in ``<=`` memory rows with coefficient +1 and ``T`` only in the
minimised objective, so each takes the larger of its lower bounds: with ``r_s = 0`` the bounds
give ``H_s = A_s``, ``J_s = 0``, ``T_s = 0``; with ``r_s = 1``, ``H_s = J_s = c_s``,
``T_s = F_s`` (``A_s <= MA_s`` etc.). Nothing multiplies two variables.

Size and repeated blocks: ``x`` stays shared between identical blocks (``simplify`` aliasing), so
the sharding part of the model is flat in depth; recompute adds one binary, three continuous
variables and four rows per block (the memory rows already grow with the timeline). An integer
count per alias class ``k = sum_i r_i`` would not be exact here: which blocks are recomputed
changes which memory rows drop (a recomputed block frees memory only *before* its own backward),
and the contribution at a candidate is ``min(k, #blocks live there)``, not linear in ``k``.

Everything is re-evaluated exactly by ``evaluate_recompute`` (item by item, on the true
intervals) and checked against the solver's objective. No torch import.
"""

from __future__ import annotations

import bisect
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np
import pulp

from autopar.solver.ilp import MEM_UNIT, IlpModel, SolveTimeout, _expr, _pick_backend, checked_solution, undominated_rows
from autopar.solver.blocks import block_of
from autopar.solver.problem import Evaluation, Problem, Solution
from autopar.solver.simplify import MemItem, Reduced, peak_candidates, simplify

__all__ = ["SegmentInput", "SegmentGeometry", "segment_geometry", "evaluate_recompute", "RecomputeModel",
           "solve_recompute", "minimum_budget_recompute", "activation_bytes"]


@dataclass(frozen=True, slots=True)
class SegmentInput:
    """An activation a recomputed segment keeps: ``bytes[k]`` when node ``node`` runs option ``k``."""

    node: str
    bytes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SegmentGeometry:
    """Where a unit sits on the timeline (module docstring): ``[start, bwd-1]`` forward part,
    ``[bwd, end]`` backward part. ``parent``: the block of a fine segment (None for a block)."""

    name: str
    start: int
    bwd: int
    end: int
    parent: str | None = None


def segment_geometry(problem: Problem) -> dict[str, SegmentGeometry]:
    """Every recomputable unit that holds activations: fine segments and their blocks."""
    spans: dict[str, list] = {}
    parent: dict[str, str | None] = {}
    for n in problem.nodes:
        if n.segment is None or n.live is None or not any(o.act_bytes for o in n.options):
            continue
        block = block_of(n.segment)
        parent[n.segment] = block if block != n.segment else None
        units = [n.segment] + ([block] if parent[n.segment] else [])
        s, e = n.live
        for u in units:
            span = spans.setdefault(u, [s, e, e])
            span[0], span[1], span[2] = min(span[0], s), min(span[1], e), max(span[2], e)
    out = {}
    for u, (s0, b, e) in spans.items():
        if not s0 < b:
            raise ValueError(f"segment {u!r}: an item ends at {b}, before the segment's forward ends")
        out[u] = SegmentGeometry(u, s0, b, e, parent.get(u))
    return out


def _units_of(segment: str | None, geo: Mapping[str, SegmentGeometry]) -> tuple[str, ...]:
    """The units a node of ``segment`` belongs to: its fine segment and its block (if known)."""
    if segment is None:
        return ()
    block = block_of(segment)
    return tuple(u for u in dict.fromkeys((segment, block)) if u is not None and u in geo)


def _held_inputs(problem: Problem, inputs: Mapping[str, Iterable[SegmentInput]], choice: Mapping[str, str],
                 chosen: Iterable[str], geo: Mapping[str, SegmentGeometry]) -> list[tuple[int, int, int]]:
    """(bytes, first, last timeline point) of every value the recomputed units keep: a value
    several regions read (an attention mask) is one tensor, held from the first region's start
    to the last one's end. (The ILP counts it once per region: conservative.)"""
    held: dict[str, list] = {}
    for u in sorted(chosen):
        for si in inputs.get(u, ()):
            c = si.bytes[problem.node(si.node).option_index(choice[si.node])]
            span = held.setdefault(si.node, [c, geo[u].start, geo[u].end])
            span[1], span[2] = min(span[1], geo[u].start), max(span[2], geo[u].end)
    return [tuple(v) for v in held.values()]


def _check_units(recompute: Iterable[str], geo: Mapping[str, SegmentGeometry]) -> set[str]:
    chosen = set(recompute)
    unknown = chosen - set(geo)
    if unknown:
        raise ValueError(f"cannot recompute unknown segments {sorted(unknown)}; known: {sorted(geo)}")
    both = sorted(u for u in chosen if geo[u].parent in chosen)
    if both:
        raise ValueError(f"segments {both} are recomputed both alone and inside their block")
    return chosen


def evaluate_recompute(problem: Problem, choice: Mapping[str, str], recompute: Iterable[str],
                       inputs: Mapping[str, Iterable[SegmentInput]]) -> Evaluation:
    """``Problem.evaluate`` with the units in ``recompute`` recomputed (module docstring)."""
    base = problem.evaluate(choice)
    geo = segment_geometry(problem)
    chosen = _check_units(recompute, geo)
    extra = 0.0
    delta = np.zeros(problem.timeline_length + 1, dtype=np.int64)
    for n in problem.nodes:
        o = n.options[n.option_index(choice[n.name])]
        seg = n.segment
        block = block_of(seg) if seg is not None else None
        unit = block if block in chosen else seg if seg in chosen else None
        if unit is not None:
            extra += o.forward_s
        if n.live is None or not o.act_bytes:
            continue
        start = geo[unit].bwd if unit is not None else n.live[0]
        delta[start] += o.act_bytes
        delta[n.live[1] + 1] -= o.act_bytes
    for c, start, end in _held_inputs(problem, inputs, choice, chosen, geo):
        delta[start] += c
        delta[end + 1] -= c
    running = np.cumsum(delta[:-1])
    peak_t = int(np.argmax(running)) if len(running) and running.max() > 0 else None
    peak = int(running.max()) if peak_t is not None else 0
    return Evaluation(base.objective + extra, base.compute_s + extra, base.comm_s, base.reshard_s,
                      base.param_bytes, base.param_bytes + peak, peak_t)


def activation_bytes(problem: Problem, choice: Mapping[str, str], recompute: Iterable[str],
                     inputs: Mapping[str, Iterable[SegmentInput]], *, include_inputs: bool = False) -> int:
    """Bytes saved for backward when the forward pass ends (timeline point ``N-1``): what
    ``saved_tensors_hooks`` plus the checkpoint regions' kept inputs hold at that moment. User
    inputs (held by the caller) are left out unless ``include_inputs``."""
    geo = segment_geometry(problem)
    chosen = _check_units(recompute, geo)
    t = problem.timeline_length // 2 - 1
    total = 0
    for n in problem.nodes:
        if n.live is None or any(u in chosen for u in _units_of(n.segment, geo)):
            continue
        o = n.options[n.option_index(choice[n.name])]
        if n.live[0] <= t <= n.live[1] and (include_inputs or n.live != (0, problem.timeline_length - 1)):
            total += o.act_bytes
    for c, start, end in _held_inputs(problem, inputs, choice, chosen, geo):
        if start <= t <= end:
            total += c
    return total


# ----------------------------------------------------------------------------------- the ILP
class RecomputeModel(IlpModel):
    """``IlpModel`` plus the recompute variables and memory rows of the module docstring."""

    def __init__(self, reduced: Reduced, problem: Problem, inputs: Mapping[str, Iterable[SegmentInput]],
                 name: str = "autopar_recompute"):
        super().__init__(reduced, name)
        self.problem = problem
        self.geo = segment_geometry(problem)
        self.units = sorted(self.geo, key=lambda s: (self.geo[s].start, self.geo[s].parent is not None, s))
        self.r: dict[str, pulp.LpVariable] = {}
        self.c_vec = self._input_vectors(inputs)  # seg -> {group: MiB per group option}

    def _input_vectors(self, inputs) -> dict[str, dict[int, np.ndarray]]:
        member = {m.node: m for m in self.reduced.members}
        out: dict[str, dict[int, np.ndarray]] = {}
        for seg in self.geo:
            vecs: dict[int, np.ndarray] = {}
            for si in inputs.get(seg, ()):
                m = member[si.node]
                node = self.problem.node(si.node)
                vec = np.array([si.bytes[node.option_index(o)] for o in m.option_names], dtype=float) / MEM_UNIT
                vecs[m.group] = vecs.get(m.group, 0.0) + vec
            out[seg] = vecs
        return out

    def _sum(self, vecs: Mapping[int, np.ndarray]) -> tuple[list, float, float]:
        """``sum_g vec_g . x_g`` as (terms, constant, its maximum)."""
        terms, const, top = [], 0.0, 0.0
        for g, vec in vecs.items():
            t, c = self.linear(g, np.asarray(vec, dtype=float))
            terms += t
            const += c
            top += float(np.max(vec))
        return terms, const, top

    def add_recompute(self, objective: list) -> list[tuple[pulp.LpVariable, float]]:
        """Variables and linking rows (module docstring); appends ``T_u`` to ``objective``."""
        self.spans: list[tuple[pulp.LpVariable, int, int]] = []  # (var, first, last timeline point)
        fwd_vecs: dict[str, dict[int, np.ndarray]] = defaultdict(dict)
        for g, table in enumerate(self.reduced.forward):
            for seg, vec in table.items():
                for u in dict.fromkeys((seg, block_of(seg))):
                    if u in self.geo:
                        prev = fwd_vecs[u].get(g)
                        fwd_vecs[u][g] = vec if prev is None else prev + vec
        act_vecs: dict[str, dict[int, np.ndarray]] = defaultdict(dict)
        for it in self.reduced.mem_items:
            if it.segment in self.geo:
                prev = act_vecs[it.segment].get(it.group)
                vec = it.bytes / MEM_UNIT
                act_vecs[it.segment][it.group] = vec if prev is None else prev + vec
        for i, u in enumerate(self.units):
            self.r[u] = self.prob.add_variable(f"r_{i}", cat=pulp.LpBinary)
        for i, u in enumerate(self.units):
            g, r = self.geo[u], self.r[u]
            c_terms, c_const, c_max = self._sum(self.c_vec[u])
            f_terms, f_const, f_max = self._sum(fwd_vecs.get(u, {}))
            t = self.prob.add_variable(f"T_{i}", lowBound=0)
            self.prob += _expr(f_terms + [(r, f_max), (t, -1.0)], f_const - f_max) <= 0, f"T_f_{i}"
            objective.append((t, 1.0))

            def at_least_c(var, tag):  # var >= c(x) - Mc (1 - r)
                self.prob += _expr(c_terms + [(r, c_max), (var, -1.0)], c_const - c_max) <= 0, f"{tag}_c_{i}"

            if g.parent is None and any(self.geo[v].parent == u for v in self.units):  # a block
                j = self.prob.add_variable(f"J_{i}", lowBound=0)
                at_least_c(j, "J")
                self.spans.append((j, g.start, g.end))
                continue
            a_terms, a_const, a_max = self._sum(act_vecs[u])
            rb = self.r.get(g.parent) if g.parent is not None else None
            b_block = self.geo[g.parent].bwd if rb is not None else g.bwd
            if rb is not None:
                self.prob += _expr([(r, 1.0), (rb, 1.0)]) <= 1, f"excl_{i}"
            # before the block's backward: A unless recomputed (alone or in the block), c if alone
            h = self.prob.add_variable(f"H_{i}", lowBound=0)
            drop = [(r, -a_max)] + ([(rb, -a_max)] if rb is not None else [])
            self.prob += _expr(a_terms + drop + [(h, -1.0)], a_const) <= 0, f"H_a_{i}"
            at_least_c(h, "H")
            self.spans.append((h, g.start, b_block - 1))
            if b_block < g.bwd:  # the block is rematerialised, this segment not yet (if alone)
                h2 = self.prob.add_variable(f"H2_{i}", lowBound=0)
                self.prob += _expr(a_terms + [(r, -a_max), (h2, -1.0)], a_const) <= 0, f"H2_a_{i}"
                at_least_c(h2, "H2")
                self.spans.append((h2, b_block, g.bwd - 1))
            j = self.prob.add_variable(f"J_{i}", lowBound=0)
            at_least_c(j, "J")
            self.spans.append((j, g.bwd, g.end))
        return objective

    def add_memory(self, limit: float | pulp.LpVariable) -> int:
        """Memory rows at the peak candidates of the split timeline (module docstring)."""
        p_terms, p_const = self.param_bytes()
        rhs_terms = [] if not isinstance(limit, pulp.LpVariable) else [(limit, -1.0)]
        rhs_const = 0.0 if isinstance(limit, pulp.LpVariable) else float(limit) / MEM_UNIT
        plain: list[MemItem] = []
        for it in self.reduced.mem_items:
            g = self.geo.get(it.segment)
            if g is None:
                plain.append(it)
            else:  # the backward part; the forward part lives in H
                plain.append(MemItem(it.group, g.bwd, it.end, it.bytes, it.segment))
        spans = [MemItem(-1, a, b, np.zeros(1)) for _, a, b in self.spans]
        cands = peak_candidates(plain + spans)
        if not cands:
            self.prob += _expr(p_terms + rhs_terms, p_const) <= rhs_const, "mem_params"
            return 1
        offsets = np.cumsum([0] + [len(c) for c in self.reduced.cost])
        width = offsets[-1] + len(self.spans)
        coef = np.zeros((len(cands) + 1, width))
        const = np.zeros(len(cands) + 1)

        def add(start, end, cols, vals, low):
            a, b = bisect.bisect_left(cands, start), bisect.bisect_right(cands, end) - 1
            if a > b:
                return
            coef[a, cols] += vals
            coef[b + 1, cols] -= vals
            const[a] += low
            const[b + 1] -= low

        for it in plain:
            vec = it.bytes / MEM_UNIT
            low = float(vec.min())
            add(it.start, it.end, slice(offsets[it.group], offsets[it.group + 1]), vec - low, low)
        for c, (_, a, b) in enumerate(self.spans):
            add(a, b, [offsets[-1] + c], 1.0, 0.0)
        coef, const = np.cumsum(coef, axis=0)[:-1], np.cumsum(const)[:-1]
        extra = [v for v, _, _ in self.spans]
        kept = undominated_rows(coef, const)
        for row, k in enumerate(kept):
            terms = self.row_terms(coef[k], offsets)
            terms += [(extra[c], 1.0) for c in np.flatnonzero(coef[k, offsets[-1]:] > 0.5)]
            self.prob += _expr(terms + p_terms + rhs_terms, float(const[k]) + p_const) <= rhs_const, f"mem_{row}"
        return len(kept)

    def recomputed(self) -> tuple[str, ...]:
        return tuple(u for u in self.units if (self.r[u].varValue or 0.0) > 0.5)


def _build(reduced, problem, inputs, *, limit, name, fixed=None) -> RecomputeModel:
    model = RecomputeModel(reduced, problem, inputs, name)
    model.add_one_hot()
    terms, const = model.step_time_terms()
    model.add_edge_marginals(terms)
    model.add_recompute(terms)
    for i, (unit, value) in enumerate(sorted((fixed or {}).items())):
        if unit not in model.r:
            raise ValueError(f"cannot fix unknown segment {unit!r}; known: {sorted(model.r)}")
        model.prob += _expr([(model.r[unit], 1.0)]) == int(bool(value)), f"fix_{i}"
    model.add_memory(limit)
    model.set_objective(terms, const)
    return model


def minimum_budget_recompute(problem: Problem, inputs: Mapping[str, Iterable[SegmentInput]], *,
                             solver: str = "auto", time_limit: float = 60.0, alias: bool = True) -> int:
    """The smallest per-device peak any plan reaches with recompute allowed (time ignored)."""
    backend = _pick_backend(solver)
    reduced = simplify(problem.with_budget(0), alias=alias, merge=True)
    model = RecomputeModel(reduced, problem, inputs, "autopar_recompute_min_peak")
    model.add_one_hot()
    model.add_recompute([])
    peak = model.prob.add_variable("peak", lowBound=0)
    model.add_memory(peak)
    model.set_objective([(peak, 1.0)], 0.0)
    out = model.run(backend, time_limit=time_limit, gap=0.0)
    if out.value is None:
        raise SolveTimeout(f"no plan found within {time_limit}s while minimising peak memory")
    return evaluate_recompute(problem, reduced.expand(model.choice()), model.recomputed(), inputs).peak_bytes


def solve_recompute(problem: Problem, inputs: Mapping[str, Iterable[SegmentInput]], *, solver: str = "auto",
                    time_limit: float = 60.0, alias: bool = True, merge: bool = True,
                    msg: bool = False, fixed: Mapping[str, bool] | None = None) -> Solution:
    """The fastest plan for ``problem`` within its budget, sharding and recompute decided
    together. ``inputs``: segment -> ``SegmentInput``s (``BuiltProblem.segment_inputs``).
    Arguments and errors as ``autopar.solver.ilp.solve``; ``Solution.recompute`` lists the
    recomputed segments and ``objective``/``peak_bytes`` are ``evaluate_recompute``'s.
    ``fixed``: unit -> recomputed or not, imposed (e.g. uniform per-block checkpointing)."""
    if not time_limit > 0:
        raise ValueError(f"time_limit must be positive seconds, got {time_limit!r}")
    if problem.budget_bytes is None:
        raise ValueError("recompute needs a memory budget (budget_bytes=None never recomputes)")
    backend = _pick_backend(solver)
    t0 = time.perf_counter()
    reduced = simplify(problem, alias=alias, merge=merge)
    t1 = time.perf_counter()
    model = _build(reduced, problem, inputs, limit=float(problem.budget_bytes), name="autopar_recompute",
                   fixed=fixed)
    t2 = time.perf_counter()
    lp = model.run(backend, time_limit=time_limit, relax=True, msg=msg)
    out = model.run(backend, time_limit=time_limit, msg=msg) if lp.status == "optimal" else lp
    if out.status == "infeasible" and fixed:
        raise ValueError(f"no plan fits the budget {problem.budget_bytes} bytes with the fixed recompute "
                         f"decisions {dict(fixed)}")
    if out.status == "infeasible":
        need = minimum_budget_recompute(problem, inputs, solver=backend, time_limit=time_limit, alias=alias)
        mesh = "x".join(map(str, problem.mesh_shape)) or "?"
        raise ValueError(
            f"memory budget {problem.budget_bytes} bytes ({problem.budget_bytes / 2**30:.3f} GiB) per device "
            f"cannot be met on mesh {mesh} even with recompute: the smallest budget any plan meets is "
            f"{need} bytes ({need / 2**30:.3f} GiB). Try a bigger mesh or a larger budget.")
    if lp.status != "optimal":
        raise SolveTimeout(f"the LP relaxation did not finish within {time_limit}s ({problem})")
    if out.status == "no_solution":
        raise SolveTimeout(f"{backend} found no plan within time_limit={time_limit}s ({problem}); "
                           f"LP bound {lp.value:.6g}s. Raise time_limit.")
    choice = reduced.expand(model.choice())
    recompute = model.recomputed()
    return checked_solution(choice, evaluate_recompute(problem, choice, recompute, inputs), out, lp,
                            budget=problem.budget_bytes, backend=backend, model=model,
                            stats={**reduced.stats, "num_segments": len(model.units)},
                            timings={"simplify_s": t1 - t0, "build_s": t2 - t1}, recompute=recompute)
