"""The sharding ILP: fastest plan under a per-device memory budget.

Solved on the ``Reduced`` model of ``autopar.solver.simplify`` (groups ``g`` with options ``s``).

Variables
    ``x[g,s] in {0,1}``                     group g runs option s (a constant for 1-option groups)
    ``e[a,b,s,t] >= 0`` (continuous)        edge (a,b) sees options (s,t)
    ``P >= 0``, ``M[k] >= 0`` (continuous)  parameter bytes, live activation bytes at candidate k

    ``h >= 0`` (continuous, with overlap)    asynchronous communication hidden under compute

Objective (seconds per training step)
    ``min  const + sum_{g,s} cost[g][s] x[g,s] + sum_{(a,b),s,t} C_ab[s,t] e[a,b,s,t] - h``
    (``- h`` only when the problem has overlap: ``Reduced.overlap``)

Constraints, one method each
    choice (``add_one_hot``):          ``sum_s x[g,s] = 1``
    marginals (``add_edge_marginals``): ``sum_t e[a,b,s,t] = x[a,s]`` and ``sum_s e[a,b,s,t] = x[b,t]``.
        Continuous ``e`` is exact: with binary x, row ``s*`` (the chosen one) is the only row with
        mass 1 and column ``t*`` the only column with mass 1, so ``e`` is the indicator of (s*, t*).
        Rows of ``C_ab`` that are equal (options of ``a`` whose output the edge converts alike)
        share one row of ``e`` whose marginal is the sum of their ``x``, and likewise columns:
        exact by the same argument (the chosen option's class is the only one with mass 1), and
        the LP relaxation keeps its value (an aggregated ``e`` splits back in proportion to the
        ``x`` of each class). A 2-layer DeepseekV3 on 2x2: 212,599 edge columns -> 118,266.
    memory (``add_memory``):           ``P + M[k] <= budget`` at every peak candidate ``k``, with
        ``P = sum param[g][s] x[g,s]`` and ``M[k] = sum_{items i live at k} held_i``,
        ``held_i = sum_s bytes_i[s] x[g_i,s]``; a pairwise item (``Reduced.edge_items``: a parameter
        copy its reader keeps) holds ``sum_{s,t} bytes_i[s,t] e[a,b,s,t]`` (exact as the edge
        costs are: ``e`` is the chosen pair's indicator; its rows and columns grouped equal in
        the items' matrices too; the minimum-peak model adds these edges' variables alone).
        Candidates are the timeline points whose live sets are maximal (``simplify.peak_candidates``);
        a candidate whose coefficients are dominated by another's is dropped. Small models write
        each ``M[k]`` out; large ones chain ``M[k] = M[k-1] + held(items starting at k) -
        held(items ending at k-1)`` (each item appears twice: memory rows stay linear in size). Memory rows count MiB
        (``MEM_UNIT``) rather than bytes, for the solvers' tolerances.
    overlap (``add_overlap``):         ``h <= rho (A0 + sum a[g][s] x[g,s] + sum M_ab[s,t] e[a,b,s,t])``
        and ``h <= W0 + sum w[g][s] x[g,s]``: ``a`` and ``M_ab`` the asynchronous communication
        seconds of options and of edges (a parameter's gradient sum is asynchronous only when
        its reader takes it in its own layout: a pair), ``w`` the compute they may hide under,
        ``rho`` the mesh's ``comm_overlap`` (``autopar.solver.overlap``).
        Minimising ``- h`` sets ``h = min(rho A, W)`` at the optimum, the evaluator's hidden seconds;
        a plan the backend returns gets that ``h`` written back (``polish_hidden``) before its
        objective is read, so every answer is priced as ``Problem.evaluate`` prices it.

Recompute: ``autopar.solver.recompute_ilp.RecomputeModel`` is this model plus recompute
variables; ``add_recompute`` (nothing here) is where it adds them, and it writes its own memory
rows. ``build_fastest`` and ``build_min_peak`` assemble either family in the same order.

Backends (``autopar.solver.linear``: the model is arrays, not a modelling library's objects):
``"highs"`` (highspy, the model passed in bulk) and ``"cbc"`` (the CBC binary bundled with
pulp, reading the model through pulp's ``COIN_CMD``); ``"auto"`` prefers HiGHS. The status is
``optimal`` (proved, to ``MIP_REL_GAP``), ``feasible`` (time limit, plan found), ``infeasible``
or ``no_solution`` (``Outcome``).

Watchdog: every backend run happens in a forked child with a hard deadline (``IlpModel.run``,
``autopar.solver.watchdog``), since HiGHS runs in-process and has been seen to ignore its time
limit. A HiGHS run that overruns keeps its best streamed solution; one with none, or one that
crashes or fails, is retried once with CBC within ``HARD_FACTOR`` x the time limit.

Solving a problem end to end (simplify, build, solve, check, errors) is
``autopar.solver.driver``. No torch import.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass

import numpy as np

from autopar.solver.linear import LinearProgram, cbc_path, highs_available, silence_highs_banner, solve_cbc, \
    solve_highs
from autopar.solver.memitems import equal_lines as _equal_lines, undominated_rows
from autopar.solver.simplify import MemItem, Reduced, peak_candidates
from autopar.solver.watchdog import run_in_child

__all__ = ["IlpModel", "Outcome", "Terms", "undominated_rows", "available_backends", "pick_backend",
           "MIP_REL_GAP", "INTEGRAL_TOL", "MEM_UNIT", "HARD_FACTOR", "CHILD_SOLVERS"]

log = logging.getLogger(__name__)

MIP_REL_GAP = 1e-4  # "optimal" means proved within this relative gap
# An LP-relaxation value this close to an integer counts as that integer (HiGHS's primal
# feasibility tolerance is 1e-7; an x this close to 0/1 picks the same option either way).
INTEGRAL_TOL = 1e-6
# HiGHS 1.15.1's presolve "aggregator" rule (bit 12) loops forever, ignoring time_limit, on
# some of our small models (marginal equalities + the parameter-bytes row); switch it off.
_HIGHS_OPTIONS = {"presolve_rule_off": 1 << 12}
# LP relaxations run without presolve: on our models it costs more than it saves (the joint
# recompute LP of Llama-70B on 16x8: 6.1 s with it, 3.4 s without; its sharding LP 0.34 -> 0.16 s).
# MIP searches keep it (the recompute model's x-step: 7 s with it, 59 s without).
_HIGHS_LP_OPTIONS = {**_HIGHS_OPTIONS, "presolve": "off"}
# The watchdog (``IlpModel.run``): a run returns by HARD_FACTOR x its time limit whatever the
# backend does. HiGHS overrunning its limit is killed _GRACE of that slack after the limit (it
# normally stops within milliseconds of it); CBC, the fallback, gets the rest.
HARD_FACTOR = 1.1
_GRACE = 0.3
_CBC_MARGIN = 0.3  # CBC is told this share of its time (at most 1 s) less: see _solve_cbc
_DENSE_MEMORY_LIMIT = 4_000_000  # candidates x option slots up to which memory rows are written out
# Memory rows count MiB, not bytes, so their coefficients stay near 1 for the solvers' tolerances
# (a power of two: the scaling itself is exact in floating point).
MEM_UNIT = float(1 << 20)
# A solver accepts a row violated within its feasibility tolerance, which HiGHS applies to the
# scaled row: at an 80 GiB budget a plan came back 64 B over and failed the exact byte check
# after the solve. The memory rows therefore hold the budget less this fraction of it (860 B at
# 80 GiB; on a small budget it is below the tolerance, so exact budgets still admit their plans).
ROW_MARGIN = 1e-8
Terms = list[tuple[int, float]]  # a linear expression's variable part: (column, coefficient)


def available_backends() -> tuple[str, ...]:
    found = []
    if highs_available():
        silence_highs_banner()
        found.append("highs")
    if cbc_path():
        found.append("cbc")
    return tuple(found)


def pick_backend(solver: str) -> str:
    """The backend ``solver`` names (``"auto"``: the first available); ValueError if unavailable."""
    backends = available_backends()
    if solver == "auto":
        if not backends:
            raise ValueError("no ILP backend available: install highspy or a pulp with bundled CBC")
        return backends[0]
    if solver not in ("highs", "cbc"):
        raise ValueError(f"unknown solver {solver!r}; expected 'auto', 'highs' or 'cbc'")
    if solver not in backends:
        raise ValueError(f"solver {solver!r} is not available here; available: {backends}")
    return solver


@dataclass(frozen=True, slots=True)
class Outcome:
    """One solver run: its status, objective and proven bound (None where it has none)."""

    status: str  # optimal | feasible | infeasible | no_solution
    value: float | None  # objective value, its constant included
    dual_bound: float | None
    seconds: float
    backend: str = ""  # the backend whose answer this is (cbc after a HiGHS fallback)
    note: str = ""  # what the watchdog did: a backend stopped, failed or replaced; "" when nothing





def _solve_highs(lp: LinearProgram, report, *, relax: bool, msg: bool, gap: float, deadline: float,
                 abs_gap: float | None = None, plan_limit: int | None = None):
    """In the watchdog's child: solve with HiGHS, reporting each improving solution as
    ``(objective without constant, column values, dual bound)``; returns ``(status, column
    values, dual bound or None)`` (``autopar.solver.linear.solve_highs``). ``abs_gap``: stop when
    proved within this many objective units as well (``gap`` is relative to the objective
    *without* its constant). ``plan_limit``: tests only (``CHILD_SOLVERS``). No warm start: HiGHS
    1.15.1 started from a feasible plan of the recompute ILP (``setSolution``) has returned a
    worse plan as "optimal" (tests/solver/test_recompute_ilp.py, budget 150: 7.4 against 5.4)."""
    # HiGHS reads mip_max_improving_sols=0 as no limit: 0 plans is 0 nodes, a stop before the root.
    stop = {} if relax or plan_limit is None else (
        {"mip_max_nodes": 0} if plan_limit == 0 else {"mip_max_improving_sols": plan_limit})
    return solve_highs(lp, relax=relax, msg=msg, gap=gap, deadline=deadline, abs_gap=abs_gap,
                       options={**(_HIGHS_LP_OPTIONS if relax else _HIGHS_OPTIONS), **stop},
                       on_plan=lambda obj, values, bound: report((obj, values, bound)))


def _solve_cbc(lp: LinearProgram, report, *, relax: bool, msg: bool, gap: float, deadline: float,
               abs_gap: float | None = None, plan_limit: int | None = None):
    """In the watchdog's child: solve with CBC (a subprocess of this child); as ``_solve_highs``
    without progress reports (CBC's binary has no callbacks) or bound. CBC checks its (wall-clock)
    limit only between phases and overruns it by up to a few tenths of a second (its root node's
    cuts; more under load), and a killed CBC leaves no plan, so it is told to stop earlier."""
    del report
    left = deadline - time.monotonic()
    limit = max(left - min(_CBC_MARGIN * left, 1.0), 1e-2)
    # CBC has no "0 plans" limit (maxSolutions 0 means none): stopping at the root with its
    # heuristics and cuts off leaves the root LP's fractional answer, i.e. no plan.
    stop = [] if relax or plan_limit is None else (
        ["maxNodes 0", "heuristicsOnOff off", "cuts off"] if plan_limit == 0 else [f"maxSolutions {plan_limit}"])
    return solve_cbc(lp, relax=relax, msg=msg, gap=gap, time_limit=limit, abs_gap=abs_gap, options=stop)


# What the watchdog's child runs per backend. Tests put hanging backends here, and bind
# ``plan_limit`` (functools.partial): the MIP search then stops once it has found that many
# plans (0: before its first), answering as a time limit that struck there would ("feasible"
# with its bound, or no plan), but at the same point on any machine -- a test that needs a
# search cut short cannot wait for a time limit, which strikes at a point that depends on the
# machine's speed and load. Production never sets it.
CHILD_SOLVERS = {"highs": _solve_highs, "cbc": _solve_cbc}
_REUSE_MAX_VARIABLES = 20_000  # beyond this, pickling the model costs more than a fork


class IlpModel:
    """The ILP over a ``Reduced`` problem (a ``LinearProgram``); each constraint family is one method."""

    def __init__(self, reduced: Reduced, name: str = "autopar"):
        self.reduced = reduced
        self.lp = LinearProgram(name)
        self.x: list[list[int] | None] = []  # group -> its option columns (None: a 1-option group)
        self.objective: str | None = None  # "time" or "peak", once built
        self.hidden: tuple[int, Terms, float, Terms, float] | None = None  # add_overlap: h and its two bounds
        self.edge_async: list[tuple[np.ndarray, np.ndarray]] = []  # (edge columns, async seconds): add_overlap
        # Pairwise memory items (add_edge_marginals): a column per distinct item holding its MiB above
        # its minimum (one row over its edge's columns), and per item (start, end, that column's
        # index in edge_held, the minimum): memory rows read one column per item, not its cells.
        self.edge_held: list[int] = []
        self.edge_mem: list[tuple[int, int, int, float]] = []

    @property
    def name(self) -> str:
        return self.lp.name

    # ---------------------------------------------------------------------- expressions
    def linear(self, g: int, vec: np.ndarray) -> tuple[Terms, float]:
        """``sum_s vec[s] x[g,s]`` as (terms, constant): the minimum moves into the constant."""
        low = float(vec.min())
        xs = self.x[g]
        if xs is None:
            return [], low
        return [(xs[s], float(v - low)) for s, v in enumerate(vec) if v != low], low

    def step_time_terms(self) -> tuple[Terms, float]:
        """Objective: node costs (edges are added by ``add_edge_marginals``)."""
        terms, const = [], self.reduced.constant
        for g, cost in enumerate(self.reduced.cost):
            t, c = self.linear(g, cost)
            terms += t
            const += c
        return terms, const

    # -------------------------------------------------------------- constraint families
    def add_one_hot(self) -> None:
        for cost in self.reduced.cost:
            if len(cost) == 1:
                self.x.append(None)
                continue
            xs = self.lp.add_binaries(len(cost))
            self.x.append(xs)
            self.lp.add_rows([len(xs)], xs, np.ones(len(xs)), lower=1.0, upper=1.0)

    def add_edge_marginals(self, *, memory_only: bool = False) -> None:
        """The edge variables, their marginal rows and their costs (added to the objective
        directly: one array per edge). An edge with asynchronous seconds (``Reduced.overlap``)
        or pairwise memory items groups rows and columns equal in all those matrices, and keeps
        its variables and those matrices for ``add_overlap`` and the memory rows (``edge_mem``).
        ``memory_only``: the edges of pairwise memory items alone, without costs (minimum peak)."""
        asyncs = {} if self.reduced.overlap is None or memory_only else self.reduced.overlap.edges
        held: dict[tuple[int, int], list] = {}
        distinct: dict[tuple, int] = {}  # (pair, MiB matrix) -> index in edge_held: aliased blocks' items share
        for it in self.reduced.edge_items:
            held.setdefault((it.a, it.b), []).append(it)
        for (a, b), mat in self.reduced.edges.items():
            if memory_only and (a, b) not in held:
                continue
            xa, xb = self.x[a], self.x[b]
            assert xa is not None and xb is not None, "edges of 1-option groups are folded by simplify"
            asy = asyncs.get((a, b))
            mems = [it.bytes for it in held.get((a, b), ())]
            # classes of equal rows, then of equal columns (module docstring), in all the matrices
            both = [mat] + ([] if asy is None else [asy]) + mems
            rows = _equal_lines(np.hstack(both))
            reps = [r[0] for r in rows]
            cols = _equal_lines(np.vstack([m[reps] for m in both]).T)
            where = np.ix_(reps, [c[0] for c in cols])
            sub = mat[where]
            ka, kb = sub.shape
            e = self.lp.add_columns(ka * kb).reshape(ka, kb)
            if asy is not None:
                self.edge_async.append((e, asy[where]))
            for it in held.get((a, b), ()):
                mib = it.bytes[where] / MEM_UNIT
                low, key = float(mib.min()), (a, b, mib.tobytes())
                if key not in distinct:
                    nz = np.nonzero(mib > low)
                    h = self.lp.add_column()
                    self.lp.add_row([(h, 1.0)] + list(zip(e[nz].tolist(), (low - mib[nz]).tolist())),
                                    lower=0.0, upper=0.0)
                    distinct[key] = len(self.edge_held)
                    self.edge_held.append(h)
                self.edge_mem.append((it.start, it.end, distinct[key], low))
            # Row s: sum_t e[s,t] - sum_{k in class s} x_a[k] = 0; column t likewise.
            lengths, index, value = [], [], []
            for s, members in enumerate(rows):
                lengths.append(kb + len(members))
                index += e[s].tolist() + [xa[k] for k in members]
                value += [1.0] * kb + [-1.0] * len(members)
            for t, members in enumerate(cols):
                lengths.append(ka + len(members))
                index += e[:, t].tolist() + [xb[k] for k in members]
                value += [1.0] * ka + [-1.0] * len(members)
            self.lp.add_rows(lengths, index, value, lower=0.0, upper=0.0)
            if not memory_only:
                nz = np.nonzero(sub)
                self.lp.add_objective_arrays(e[nz], sub[nz])

    def param_bytes(self) -> tuple[Terms, float]:
        terms, const = [], 0.0
        for g, vec in enumerate(self.reduced.param):
            t, c = self.linear(g, vec / MEM_UNIT)
            terms += t
            const += c
        if len(terms) > 1:  # one variable instead of repeating the sum in every memory row
            p = self.lp.add_column()
            self.lp.add_row(terms + [(p, -1.0)], lower=0.0, upper=0.0)
            terms = [(p, 1.0)]
        return terms, const

    def memory_rhs(self, *, budget: float | None, peak: int | None) -> tuple[Terms, float]:
        """The right-hand side of every memory row, moved left: ``(terms, upper bound)``; a
        budget in bytes, or the ``peak`` column (MiB)."""
        if peak is not None:
            return [(peak, -1.0)], 0.0
        return [], float(budget) / MEM_UNIT

    def add_memory(self, *, budget: float | None = None, peak: int | None = None) -> int:
        """Memory rows at the peak candidates; returns how many. ``budget``: bytes; or ``peak``:
        a column that then counts MiB."""
        items = list(self.reduced.mem_items)
        p_terms, p_const = self.param_bytes()
        rhs_terms, upper = self.memory_rhs(budget=budget, peak=peak)
        cands = peak_candidates(items + self.edge_spans())
        if not cands:
            self.lp.add_row(p_terms + rhs_terms, upper=upper, const=p_const)
            return 1
        ranges = []
        for it in items + self.edge_spans():
            a, b = bisect.bisect_left(cands, it.start), bisect.bisect_right(cands, it.end) - 1
            assert a <= b, f"{it} contains no peak candidate"
            ranges.append((a, b))
        slots = sum(len(c) for c in self.reduced.cost) + len(self.edge_held)
        if len(cands) * slots <= _DENSE_MEMORY_LIMIT:
            rows = self._dense_memory_rows(items, ranges, len(cands))
        else:
            rows = self._chained_memory_rows(items, ranges, len(cands))
        for terms, const in rows:
            self.lp.add_row(terms + p_terms + rhs_terms, upper=upper, const=const + p_const)
        return len(rows)

    def edge_spans(self) -> list[MemItem]:
        """The pairwise items' intervals (no bytes), for ``peak_candidates``."""
        return [MemItem(-1, start, end, np.zeros(1)) for start, end, _, _ in self.edge_mem]

    def slot_columns(self) -> np.ndarray:
        """Per option slot (group ``g`` owns ``offsets[g]:offsets[g+1]``), its ``x`` column; -1
        for the slot of a 1-option group (a constant)."""
        out = []
        for g, cost in enumerate(self.reduced.cost):
            xs = self.x[g]
            out += [-1] * len(cost) if xs is None else list(xs)
        return np.array(out, dtype=np.int64)

    def _dense_memory_rows(self, items, ranges, num_cands):
        """Write each candidate's live total out; drop candidates dominated coefficient-wise.
        Pairwise items (``edge_mem``, after ``items`` in ``ranges``): their columns' slots follow the options'."""
        offsets = np.cumsum([0] + [len(c) for c in self.reduced.cost])
        coef = np.zeros((num_cands + 1, offsets[-1] + len(self.edge_held)))
        const = np.zeros(num_cands + 1)
        for it, (a, b) in zip(items, ranges):
            vec = it.bytes / MEM_UNIT
            low = vec.min()
            sl = slice(offsets[it.group], offsets[it.group + 1])
            coef[a, sl] += vec - low
            coef[b + 1, sl] -= vec - low
            const[a] += low
            const[b + 1] -= low
        for (_, _, k, low), (a, b) in zip(self.edge_mem, ranges[len(items):]):
            coef[a, offsets[-1] + k] += 1.0
            coef[b + 1, offsets[-1] + k] -= 1.0
            const[a] += low
            const[b + 1] -= low
        coef, const = np.cumsum(coef, axis=0)[:-1], np.cumsum(const)[:-1]
        slot_cols = np.concatenate([self.slot_columns(), np.array(self.edge_held, dtype=np.int64)])
        return [(self.row_terms(coef[k], slot_cols), float(const[k])) for k in undominated_rows(coef, const)]

    @staticmethod
    def row_terms(row: np.ndarray, slot_cols: np.ndarray) -> Terms:
        """Terms ``coef * x[g,s]`` of one memory row over the option slots (``slot_columns``);
        sub-byte coefficients are noise and dropped."""
        nz = np.flatnonzero((row[:len(slot_cols)] > 0.5 / MEM_UNIT) & (slot_cols >= 0))
        return list(zip(slot_cols[nz].tolist(), row[nz].tolist()))

    def _chained_memory_rows(self, items, ranges, num_cands):
        """``M[k] = M[k-1] + starting - ending``: every item enters two equalities."""
        enter: list[list[int]] = [[] for _ in range(num_cands)]
        leave: list[list[int]] = [[] for _ in range(num_cands)]
        for i, (a, b) in enumerate(ranges):
            enter[a].append(i)
            if b + 1 < num_cands:
                leave[b + 1].append(i)
        held = [self.linear(it.group, it.bytes / MEM_UNIT) for it in items]  # MiB each item holds
        held += [([(self.edge_held[k], 1.0)], low) for _, _, k, low in self.edge_mem]  # pairwise items
        rows, prev = [], None
        for k in range(num_cands):
            m = self.lp.add_column()
            terms, const = ([] if prev is None else [(prev, 1.0)]), 0.0
            for i in enter[k]:
                terms += held[i][0]
                const += held[i][1]
            for i in leave[k]:
                terms += [(v, -c) for v, c in held[i][0]]
                const -= held[i][1]
            self.lp.add_row(terms + [(m, -1.0)], lower=0.0, upper=0.0, const=const)
            rows.append(([(m, 1.0)], 0.0))
            prev = m
        return rows

    def add_overlap(self, objective: Terms) -> None:
        """The hidden seconds ``h`` and its two bounds (module docstring); appends ``-h`` to
        ``objective``. Nothing without overlap (``Reduced.overlap`` None)."""
        ov = self.reduced.overlap
        if ov is None:
            return
        bounds = []
        for vecs, scale in ((ov.async_s, ov.rho), (ov.compute_s, 1.0)):
            terms, const = [], 0.0
            for g, vec in enumerate(vecs):
                t, c = self.linear(g, scale * vec)
                terms += t
                const += c
            bounds.append((terms, const))
        for e, asy in self.edge_async:  # the edges' asynchronous seconds (add_edge_marginals)
            where = np.nonzero(asy)
            bounds[0][0].extend(zip(e[where].tolist(), (ov.rho * asy[where]).tolist()))
        h = self.lp.add_column()
        for terms, const in bounds:  # h - sum(terms) <= const
            self.lp.add_row([(h, 1.0)] + [(v, -c) for v, c in terms], upper=const)
        self.hidden = (h, *bounds[0], *bounds[1])
        objective.append((h, -1.0))

    def polish_hidden(self, values: np.ndarray) -> None:
        """Set ``h`` in ``values`` to the largest its bounds allow at the other columns' values
        (a backend's plan may leave it lower: a heuristic's, or within tolerance)."""
        if self.hidden is None:
            return
        h, a_terms, a_const, w_terms, w_const = self.hidden
        x = np.nan_to_num(values)

        def bound(terms: Terms, const: float) -> float:
            return const + sum(c * x[v] for v, c in terms)

        values[h] = max(0.0, min(bound(a_terms, a_const), bound(w_terms, w_const)))

    # ------------------------------------------------------------------------- assembling
    def add_recompute(self, objective: Terms) -> None:
        """Recompute decisions: none in the sharding ILP (``RecomputeModel`` adds them)."""

    def build_fastest(self, limit: float | None) -> None:
        """The fastest plan whose peak stays within ``limit`` bytes (None: no memory rows)."""
        self.objective = "time"
        self.add_one_hot()
        terms, const = self.step_time_terms()
        self.add_edge_marginals()
        self.add_recompute(terms)
        self.add_overlap(terms)
        if limit is not None:
            self.add_memory(budget=limit * (1.0 - ROW_MARGIN))
        self.lp.add_objective(terms, const)

    def build_min_peak(self) -> None:
        """The smallest peak any choice reaches, step time ignored (the objective counts MiB)."""
        self.objective = "peak"
        self.add_one_hot()
        self.add_edge_marginals(memory_only=True)
        self.add_recompute([])
        peak = self.lp.add_column()
        self.add_memory(peak=peak)
        self.lp.add_objective([(peak, 1.0)])

    # --------------------------------------------------------------------------- solving
    def run(self, backend: str, *, time_limit: float, relax: bool = False, msg: bool = False,
            gap: float = MIP_REL_GAP, hard_limit: float | None = None, abs_gap: float | None = None,
            fallback: bool = True) -> Outcome:
        """Solve with ``backend``, told to stop after ``time_limit`` seconds, and return within
        ``hard_limit`` seconds (default ``HARD_FACTOR * time_limit``) whatever the backend does.

        The backend runs in a forked child (``autopar.solver.watchdog``). HiGHS that overruns its
        limit is killed a grace period after it. If it streamed an improving solution before it
        was stopped (or crashed, or failed), the best one is the answer (``"feasible"``, with
        HiGHS's last bound); if not, CBC solves once more until ``hard_limit`` -- unless
        ``fallback`` is False (the caller holds a plan already, and a second backend's first plan
        in the time left would rarely beat it). Either way ``Outcome.note`` says what happened,
        ``Outcome.backend`` whose answer it is, and a warning is logged. CBC still running at
        ``hard_limit`` is killed (``"no_solution"``); CBC crashing raises RuntimeError.
        ``abs_gap`` as in ``_solve_highs`` (both backends)."""
        t0 = time.monotonic()
        extra = {"abs_gap": abs_gap}
        if not self.lp.num_columns:  # everything was decided by simplification
            if not self.lp.rows_hold_without_columns():
                return Outcome("infeasible", None, None, 0.0, backend)
            self.lp.values = np.zeros(0)
            return Outcome("optimal", self.lp.constant, self.lp.constant, 0.0, backend)
        soft = t0 + time_limit
        hard = t0 + (HARD_FACTOR * time_limit if hard_limit is None else max(hard_limit, time_limit))
        if backend != "highs" or cbc_path() is None or not fallback:  # nothing to fall back on
            kill_at = hard if backend != "highs" or fallback else soft + _GRACE * (hard - soft)
            out = self._attempt(backend, relax=relax, msg=msg, gap=gap, soft=soft, kill_at=kill_at, t0=t0, **extra)
            if out.note and backend == "highs":
                log.warning("autopar: %s (%s)", out.note, self.lp.name)
            return out
        first = self._attempt("highs", relax=relax, msg=msg, gap=gap, soft=soft,
                              kill_at=soft + _GRACE * (hard - soft), t0=t0, **extra)
        if not first.note:
            return first
        if first.status != "no_solution":  # stopped after streaming plans: the best is kept
            log.warning("autopar: %s (%s)", first.note, self.lp.name)
            return first
        now = time.monotonic()
        note = f"{first.note}; retried with cbc"
        log.warning("autopar: %s (%s)", note, self.lp.name)
        second = self._attempt("cbc", relax=relax, msg=msg, gap=gap, soft=max(soft, now + 0.6 * (hard - now)),
                               kill_at=hard, t0=t0, **extra)
        return dataclasses.replace(second, note=f"{note}: {second.note}" if second.note else note)

    def _attempt(self, backend: str, *, relax: bool, msg: bool, gap: float, soft: float, kill_at: float,
                 t0: float, abs_gap: float | None = None) -> Outcome:
        """One backend run in a watched child. A HiGHS run that failed without a plan returns
        ``no_solution`` with a ``note`` (the caller falls back); CBC's failures raise."""
        optional = {"abs_gap": abs_gap} if abs_gap else {}  # only when asked for (tests' fake backends)
        self.lp.arrays()  # built once here, not in every child
        fn = functools.partial(CHILD_SOLVERS[backend], self.lp, relax=relax, msg=msg, gap=gap, deadline=soft,
                               **optional)
        # Small models go to the long-lived worker (pickling beats a fork of a big planner process).
        res = run_in_child(fn, deadline=kill_at, reuse=self.lp.num_columns <= _REUSE_MAX_VARIABLES)
        seconds = time.monotonic() - t0
        if res.ended == "done":
            status, values, bound = res.final
            out = self._outcome(backend, status, values, bound, relax=relax, seconds=seconds)
            if out.status == "no_solution" and backend == "highs" and time.monotonic() < soft - 0.05 * (soft - t0):
                return dataclasses.replace(out, note="highs stopped without a plan before its time limit")
            return out
        limit = f"{soft - t0:.3g}s"
        what = {"killed": f"did not return within its {limit} limit (+{kill_at - soft:.2g}s grace) and was "
                          f"stopped", "died": "died", "error": f"failed ({res.detail})"}[res.ended]
        if res.latest is not None:  # HiGHS streamed plans before it overran, died or failed: keep the best
            _, values, bound = res.latest
            out = self._outcome(backend, "feasible", values, bound, relax=relax, seconds=seconds)
            return dataclasses.replace(out, note=f"{backend} {what}; its best plan is kept")
        if backend == "cbc" and res.ended != "killed":
            raise RuntimeError(f"the ILP backend cbc {what}")
        return Outcome("no_solution", None, None, seconds, backend, note=f"{backend} {what}")

    def _outcome(self, backend: str, status: str, values, bound: float | None, *, relax: bool,
                 seconds: float) -> Outcome:
        """An ``Outcome`` from the child's answer; its values become this model's ``lp.values``."""
        if status == "infeasible":
            return Outcome("infeasible", None, None, seconds, backend)
        if status not in ("optimal", "feasible"):
            return Outcome("no_solution", None, None, seconds, backend)
        self.lp.values = np.array(values, dtype=float)
        self.polish_hidden(self.lp.values)
        value = self.lp.objective_value(self.lp.values)
        best = value if status == "optimal" else None
        if bound is not None and not relax and np.isfinite(bound):
            # HiGHS proves a bound even when "optimal" (to MIP_REL_GAP); it is handed the
            # objective without its constant term.
            best = bound + self.lp.constant
        return Outcome(status, value, best, seconds, backend)

    def integral(self, tol: float = INTEGRAL_TOL) -> bool:
        """Whether the values last written into the model (after ``run``) give every integer
        variable an integer value: then the LP relaxation's optimum is the MIP's too."""
        if self.lp.values is None:
            return False
        values = self.lp.values[self.lp.arrays()["integer"]]
        return bool(np.all(np.abs(values - np.round(values)) <= tol))

    def choice(self) -> list[int]:
        """The chosen option of every group (after ``run``)."""
        values = self.lp.values
        return [0 if xs is None else int(np.argmax(np.nan_to_num(values[xs]))) for xs in self.x]

    def recomputed(self) -> tuple[str, ...]:
        """The recomputed units (after ``run``): none in the sharding ILP."""
        return ()

    @property
    def stats(self) -> dict[str, int]:
        """Model counts the solution reports beyond ``Reduced.stats``."""
        return {}

    @property
    def num_variables(self) -> int:
        return self.lp.num_columns

    @property
    def num_constraints(self) -> int:
        return self.lp.num_rows
