"""The sharding ILP: fastest plan under a per-device memory budget (DESIGN.md decision 6).

Solved on the ``Reduced`` model of ``autopar.solver.simplify`` (groups ``g`` with options ``s``).

Variables
    ``x[g,s] in {0,1}``                     group g runs option s (a constant for 1-option groups)
    ``e[a,b,s,t] >= 0`` (continuous)        edge (a,b) sees options (s,t)
    ``P >= 0``, ``M[k] >= 0`` (continuous)  parameter bytes, live activation bytes at candidate k

Objective (seconds per training step)
    ``min  const + sum_{g,s} cost[g][s] x[g,s] + sum_{(a,b),s,t} C_ab[s,t] e[a,b,s,t]``

Constraints, one method each
    choice (``add_one_hot``):          ``sum_s x[g,s] = 1``
    marginals (``add_edge_marginals``): ``sum_t e[a,b,s,t] = x[a,s]`` and ``sum_s e[a,b,s,t] = x[b,t]``.
        Continuous ``e`` is exact: with binary x, row ``s*`` (the chosen one) is the only row with
        mass 1 and column ``t*`` the only column with mass 1, so ``e`` is the indicator of (s*, t*).
    memory (``add_memory``):           ``P + M[k] <= budget`` at every peak candidate ``k``, with
        ``P = sum param[g][s] x[g,s]`` and ``M[k] = sum_{items i live at k} held_i``,
        ``held_i = sum_s bytes_i[s] x[g_i,s]``. Candidates are the timeline points whose live
        sets are maximal (``simplify.peak_candidates``); a candidate whose coefficients are
        dominated by another's is dropped. Small models write each ``M[k]`` out; large ones
        chain ``M[k] = M[k-1] + held(items starting at k) - held(items ending at k-1)`` (each
        item appears twice, so the memory rows stay linear in size). Memory rows count MiB
        (``MEM_UNIT``) rather than bytes, for the solvers' tolerances.

Recompute (the checkpoint issue adds it without rewriting anything here): a binary ``r[seg]``
per checkpointable segment; ``held_bytes`` of an item in ``seg`` becomes a continuous
``k_i >= held_i - max(bytes_i) r[seg]`` (exact: memory rows only bound it from above), and
``step_time_terms`` gains ``sum_s forward[g][seg][s] y[g,seg,s]`` with
``y >= x[g,s] + r[seg] - 1``. Both are overridable methods of ``IlpModel``.

Backends through pulp: ``"highs"`` (``pulp.HiGHS``, the highspy API) and ``"cbc"``
(``pulp.COIN_CMD`` on the CBC binary bundled with pulp, i.e. what the deprecated
``PULP_CBC_CMD`` runs); ``"auto"`` prefers HiGHS. pulp reports ``Optimal`` when CBC stops at
its time limit with a plan, so the status comes from ``sol_status``: ``optimal`` (proved, to
``MIP_REL_GAP``), ``feasible`` (time limit, plan found). An infeasible budget raises
``ValueError`` with the smallest budget any plan meets (a second ILP minimising the peak); no
plan within the time limit raises ``SolveTimeout``. No torch import.
"""

from __future__ import annotations

import bisect
import os
import shutil
import time
from dataclasses import dataclass

import numpy as np
import pulp

from autopar.solver.problem import Problem, Solution
from autopar.solver.simplify import MemItem, Reduced, peak_candidates, simplify

__all__ = ["solve", "minimum_budget", "IlpModel", "SolveTimeout", "available_backends", "MIP_REL_GAP"]

MIP_REL_GAP = 1e-4  # "optimal" means proved within this relative gap
# HiGHS 1.15.1's presolve "aggregator" rule (bit 12) loops forever, ignoring time_limit, on
# some of our small models (marginal equalities + the parameter-bytes row); switch it off.
_HIGHS_OPTIONS = {"presolve_rule_off": 1 << 12}
_DENSE_MEMORY_LIMIT = 4_000_000
# Memory rows count MiB, not bytes, so their coefficients stay near 1 for the solvers' tolerances
# (a power of two: the scaling itself is exact in floating point).
MEM_UNIT = float(1 << 20)  # candidates x option slots up to which memory rows are written out


class SolveTimeout(RuntimeError):
    """The solver found no plan within the time limit."""


def _cbc_path() -> str | None:
    """A ``cbc`` on PATH, else the binary bundled with pulp (``PULP_CBC_CMD`` is deprecated in
    pulp 3.3, ``COIN_CMD`` on the same binary is not)."""
    from pulp.apis.coin_api import pulp_cbc_path

    found = shutil.which("cbc")
    if found:
        return found
    return pulp_cbc_path if os.path.isfile(pulp_cbc_path) and os.access(pulp_cbc_path, os.X_OK) else None


def available_backends() -> tuple[str, ...]:
    found = []
    if pulp.HiGHS(msg=False).available():
        found.append("highs")
    if _cbc_path():
        found.append("cbc")
    return tuple(found)


def _pick_backend(solver: str) -> str:
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
class _Outcome:
    status: str  # optimal | feasible | infeasible | no_solution
    value: float | None  # objective without the model's constant
    dual_bound: float | None
    seconds: float


def _expr(terms, const: float = 0.0) -> pulp.LpAffineExpression:
    """A pulp expression that *adds* repeated variables (pulp's constructor keeps the last)."""
    acc: dict = {}
    for v, c in terms:
        acc[v] = acc.get(v, 0.0) + c
    return pulp.LpAffineExpression([(v, c) for v, c in acc.items() if c != 0.0], const)


def undominated_rows(coef: np.ndarray, const: np.ndarray) -> list[int]:
    """Indices (ascending) of the memory rows ``const[k] + coef[k] . x`` that no other row
    dominates coefficient-wise: a dominated row can never be the binding peak."""
    order = np.argsort(-(const + coef.sum(axis=1)), kind="stable")
    kept: list[int] = []
    for k in order:
        # Dominators are usually the largest rows, which come first: compare with those only,
        # which bounds this loop to candidates x 64 x slots.
        top = kept[:64]
        if top and ((coef[top] >= coef[k] - 1e-12).all(axis=1) & (const[top] >= const[k] - 1e-12)).any():
            continue
        kept.append(int(k))
    return sorted(kept)


class IlpModel:
    """A pulp model over a ``Reduced`` problem; each constraint family is one method."""

    def __init__(self, reduced: Reduced, name: str = "autopar"):
        self.reduced = reduced
        self.prob = pulp.LpProblem(name, pulp.LpMinimize)
        self.x: list[list[pulp.LpVariable] | None] = []
        self.constant = reduced.constant
        self.num_edge_vars = 0

    # ---------------------------------------------------------------------- expressions
    def linear(self, g: int, vec: np.ndarray) -> tuple[list[tuple[pulp.LpVariable, float]], float]:
        """``sum_s vec[s] x[g,s]`` as (terms, constant): the minimum moves into the constant."""
        low = float(vec.min())
        xs = self.x[g]
        if xs is None:
            return [], low
        return [(xs[s], float(v - low)) for s, v in enumerate(vec) if v != low], low

    def held_bytes(self, item: MemItem) -> tuple[list[tuple[pulp.LpVariable, float]], float]:
        """MiB ``item`` holds while live (the recompute hook replaces this)."""
        return self.linear(item.group, item.bytes / MEM_UNIT)

    def step_time_terms(self) -> tuple[list[tuple[pulp.LpVariable, float]], float]:
        """Objective: node costs (edges are added by ``add_edge_marginals``)."""
        terms, const = [], self.constant
        for g, cost in enumerate(self.reduced.cost):
            t, c = self.linear(g, cost)
            terms += t
            const += c
        return terms, const

    # -------------------------------------------------------------- constraint families
    def add_one_hot(self) -> None:
        for g, cost in enumerate(self.reduced.cost):
            if len(cost) == 1:
                self.x.append(None)
                continue
            xs = [self.prob.add_variable(f"x_{g}_{s}", cat=pulp.LpBinary) for s in range(len(cost))]
            self.x.append(xs)
            self.prob += _expr([(v, 1.0) for v in xs]) == 1, f"one_hot_{g}"

    def add_edge_marginals(self, objective: list[tuple[pulp.LpVariable, float]]) -> None:
        for (a, b), mat in self.reduced.edges.items():
            xa, xb = self.x[a], self.x[b]
            assert xa is not None and xb is not None, "edges of 1-option groups are folded by simplify"
            ka, kb = mat.shape
            e = [[self.prob.add_variable(f"e_{a}_{b}_{s}_{t}", lowBound=0) for t in range(kb)] for s in range(ka)]
            self.num_edge_vars += ka * kb
            for s in range(ka):
                self.prob += _expr([(v, 1.0) for v in e[s]] + [(xa[s], -1.0)]) == 0, f"mr_{a}_{b}_{s}"
            for t in range(kb):
                self.prob += _expr([(e[s][t], 1.0) for s in range(ka)] + [(xb[t], -1.0)]) == 0, f"mc_{a}_{b}_{t}"
            objective += [(e[s][t], float(mat[s, t])) for s in range(ka) for t in range(kb) if mat[s, t]]

    def param_bytes(self) -> tuple[list[tuple[pulp.LpVariable, float]], float]:
        terms, const = [], 0.0
        for g, vec in enumerate(self.reduced.param):
            t, c = self.linear(g, vec / MEM_UNIT)
            terms += t
            const += c
        if len(terms) > 1:  # one variable instead of repeating the sum in every memory row
            p = self.prob.add_variable("P", lowBound=0)
            self.prob += _expr(terms + [(p, -1.0)]) == 0, "param_bytes"
            terms = [(p, 1.0)]
        return terms, const

    def add_memory(self, limit: float | pulp.LpVariable) -> int:
        """Memory rows at the peak candidates; returns how many. ``limit`` is bytes, or a
        variable that then counts MiB."""
        items = [it for it in self.reduced.mem_items]
        p_terms, p_const = self.param_bytes()
        rhs_terms = [] if not isinstance(limit, pulp.LpVariable) else [(limit, -1.0)]
        rhs_const = 0.0 if isinstance(limit, pulp.LpVariable) else float(limit) / MEM_UNIT
        cands = peak_candidates(items)
        if not cands:
            self.prob += _expr(p_terms + rhs_terms, p_const) <= rhs_const, "mem_params"
            return 1
        ranges = []
        for it in items:
            a, b = bisect.bisect_left(cands, it.start), bisect.bisect_right(cands, it.end) - 1
            assert a <= b, f"{it} contains no peak candidate"
            ranges.append((a, b))
        slots = sum(len(c) for c in self.reduced.cost)
        if len(cands) * slots <= _DENSE_MEMORY_LIMIT:
            rows = self._dense_memory_rows(items, ranges, len(cands))
        else:
            rows = self._chained_memory_rows(items, ranges, len(cands))
        for k, (terms, const) in enumerate(rows):
            self.prob += _expr(terms + p_terms + rhs_terms, const + p_const) <= rhs_const, f"mem_{k}"
        return len(rows)

    def _dense_memory_rows(self, items, ranges, num_cands):
        """Write each candidate's live total out; drop candidates dominated coefficient-wise."""
        offsets = np.cumsum([0] + [len(c) for c in self.reduced.cost])
        coef = np.zeros((num_cands + 1, offsets[-1]))
        const = np.zeros(num_cands + 1)
        for it, (a, b) in zip(items, ranges):
            vec = it.bytes / MEM_UNIT
            low = vec.min()
            sl = slice(offsets[it.group], offsets[it.group + 1])
            coef[a, sl] += vec - low
            coef[b + 1, sl] -= vec - low
            const[a] += low
            const[b + 1] -= low
        coef, const = np.cumsum(coef, axis=0)[:-1], np.cumsum(const)[:-1]
        return [(self.row_terms(coef[k], offsets), float(const[k])) for k in undominated_rows(coef, const)]

    def row_terms(self, row: np.ndarray, offsets) -> list[tuple[pulp.LpVariable, float]]:
        """Terms ``coef * x[g,s]`` of one memory row laid out as ``offsets`` (group ``g`` owns
        ``row[offsets[g]:offsets[g+1]]``); sub-byte coefficients are noise and dropped."""
        terms = []
        for g in range(len(self.reduced.cost)):
            xs = self.x[g]
            if xs is None:
                continue
            for s in np.flatnonzero(row[offsets[g]:offsets[g + 1]] > 0.5 / MEM_UNIT):
                terms.append((xs[s], float(row[offsets[g] + s])))
        return terms

    def _chained_memory_rows(self, items, ranges, num_cands):
        """``M[k] = M[k-1] + starting - ending``: every item enters two equalities."""
        enter: list[list[int]] = [[] for _ in range(num_cands)]
        leave: list[list[int]] = [[] for _ in range(num_cands)]
        for i, (a, b) in enumerate(ranges):
            enter[a].append(i)
            if b + 1 < num_cands:
                leave[b + 1].append(i)
        held = [self.held_bytes(it) for it in items]
        rows, prev = [], None
        for k in range(num_cands):
            m = self.prob.add_variable(f"M_{k}", lowBound=0)
            terms, const = ([] if prev is None else [(prev, 1.0)]), 0.0
            for i in enter[k]:
                terms += held[i][0]
                const += held[i][1]
            for i in leave[k]:
                terms += [(v, -c) for v, c in held[i][0]]
                const -= held[i][1]
            self.prob += _expr(terms + [(m, -1.0)], const) == 0, f"M_def_{k}"
            rows.append(([(m, 1.0)], 0.0))
            prev = m
        return rows

    def set_objective(self, terms, const) -> None:
        self.prob.setObjective(_expr(terms, const))

    # --------------------------------------------------------------------------- solving
    def run(self, backend: str, *, time_limit: float, relax: bool = False, msg: bool = False,
            gap: float = MIP_REL_GAP) -> _Outcome:
        if backend == "highs":
            solver = pulp.HiGHS(mip=not relax, msg=msg, timeLimit=time_limit, gapRel=gap, **_HIGHS_OPTIONS)
        else:
            solver = pulp.COIN_CMD(path=_cbc_path(), mip=not relax, msg=msg, timeLimit=time_limit, gapRel=gap)
        t0 = time.perf_counter()
        if not self.prob.variables():  # everything was decided by simplification
            if not all(c.valid(1e-9) for c in self.prob.constraints()):
                return _Outcome("infeasible", None, None, 0.0)
            value = float(self.prob.objective.constant)
            return _Outcome("optimal", value, value, 0.0)
        self.prob.solve(solver)
        seconds = time.perf_counter() - t0
        sol = self.prob.sol_status
        if self.prob.status == pulp.LpStatusInfeasible or sol == pulp.LpSolutionInfeasible:
            return _Outcome("infeasible", None, None, seconds)
        if sol not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            return _Outcome("no_solution", None, None, seconds)
        value = float(pulp.value(self.prob.objective) or 0.0)
        status = "optimal" if sol == pulp.LpSolutionOptimal else "feasible"
        bound = value if status == "optimal" else None
        if backend == "highs" and not relax:
            # HiGHS proves a bound even when "optimal" (to MIP_REL_GAP); pulp hands HiGHS the
            # objective without its constant term.
            proved = float(self.prob.solverModel.getInfo().mip_dual_bound)
            if np.isfinite(proved):
                bound = proved + float(self.prob.objective.constant)
        return _Outcome(status, value, bound, seconds)

    def choice(self) -> list[int]:
        out = []
        for xs in self.x:
            out.append(0 if xs is None else int(np.argmax([v.varValue or 0.0 for v in xs])))
        return out

    @property
    def num_variables(self) -> int:
        return len(self.prob.variables())

    @property
    def num_constraints(self) -> int:
        return self.prob.numConstraints()


def _build(reduced: Reduced, *, limit: float | None, name: str) -> IlpModel:
    model = IlpModel(reduced, name)
    model.add_one_hot()
    terms, const = model.step_time_terms()
    model.add_edge_marginals(terms)
    if limit is not None:
        model.add_memory(limit)
    model.set_objective(terms, const)
    return model


def minimum_budget(problem: Problem, *, solver: str = "auto", time_limit: float = 60.0,
                   alias: bool = True) -> tuple[int, int]:
    """``(achieved, lower_bound)``: the smallest per-device peak any plan reaches (a second ILP
    that minimises the peak, step time ignored) and a proven lower bound on it (equal when
    proved optimal). ``alias`` as in ``solve``: with it, "any plan" means any plan that
    ``solve`` can return."""
    backend = _pick_backend(solver)
    # Budget 0 makes every simplification memory-safe, hence exact for the peak objective too.
    reduced = simplify(problem.with_budget(0), alias=alias, merge=True)
    model = IlpModel(reduced, "autopar_min_peak")
    model.add_one_hot()
    peak = model.prob.add_variable("peak", lowBound=0)
    model.add_memory(peak)
    model.set_objective([(peak, 1.0)], 0.0)
    lp = model.run(backend, time_limit=time_limit, relax=True)
    out = model.run(backend, time_limit=time_limit, gap=0.0)  # an exact figure for the error message
    if out.value is None:
        raise SolveTimeout(f"no plan found within {time_limit}s while minimising peak memory")
    achieved = problem.evaluate(reduced.expand(model.choice())).peak_bytes
    bound = out.dual_bound if out.dual_bound is not None else (lp.value or 0.0)
    if out.status == "optimal":
        bound = out.value
    return achieved, int(min(achieved, np.ceil(bound * MEM_UNIT - 1e-3)))


def _infeasible(problem: Problem, backend: str, time_limit: float, alias: bool) -> Exception:
    achieved, lower = minimum_budget(problem, solver=backend, time_limit=time_limit, alias=alias)
    if achieved <= problem.budget_bytes:
        return RuntimeError(f"{backend} reported budget {problem.budget_bytes} infeasible, yet a plan with "
                            f"peak {achieved} bytes fits it (solver tolerance?); retry with the other backend")
    exact = achieved == lower
    need = f"{achieved} bytes ({achieved / 2**30:.3f} GiB)" if exact else (
        f"between {lower} and {achieved} bytes ({lower / 2**30:.3f}-{achieved / 2**30:.3f} GiB)")
    mesh = "x".join(map(str, problem.mesh_shape)) or "?"
    return ValueError(
        f"memory budget {problem.budget_bytes} bytes ({problem.budget_bytes / 2**30:.3f} GiB) per device "
        f"cannot be met on mesh {mesh}: the smallest budget any plan meets is {need}. "
        f"Try a bigger mesh (more devices to shard over), activation recompute, or a larger budget."
    )


def solve(problem: Problem, *, solver: str = "auto", time_limit: float = 60.0, alias: bool = True,
          merge: bool = True, msg: bool = False) -> Solution:
    """The fastest plan for ``problem`` within its budget (see the module docstring).

    solver:     ``"auto"`` (HiGHS when available), ``"highs"`` or ``"cbc"``.
    time_limit: seconds for each of the two solver runs: the LP relaxation (for ``lp_bound``),
                then the MIP search; at the limit the best plan found is returned with
                ``status="feasible"`` and its gap to the best proven bound.
    alias:      share decisions between identical repeated blocks (``simplify`` item 1).
    merge:      dominated-option pruning and exact follow-merge (``simplify`` items 3-4).
    msg:        show the backend's log.

    Raises ``ValueError`` when no plan fits the budget (with the smallest budget that does),
    ``SolveTimeout`` when no plan is found within the time limit.
    """
    if not time_limit > 0:
        raise ValueError(f"time_limit must be positive seconds, got {time_limit!r}")
    backend = _pick_backend(solver)
    t0 = time.perf_counter()
    reduced = simplify(problem, alias=alias, merge=merge)
    t1 = time.perf_counter()
    limit = float(problem.budget_bytes) if reduced.memory_can_bind else None
    model = _build(reduced, limit=limit, name="autopar")
    t2 = time.perf_counter()
    lp = model.run(backend, time_limit=time_limit, relax=True, msg=msg)
    if lp.status == "infeasible":
        raise _infeasible(problem, backend, time_limit, alias)
    if lp.status != "optimal":
        raise SolveTimeout(f"the LP relaxation did not finish within {time_limit}s ({problem})")
    out = model.run(backend, time_limit=time_limit, msg=msg)
    if out.status == "infeasible":
        raise _infeasible(problem, backend, time_limit, alias)
    if out.status == "no_solution":
        raise SolveTimeout(f"{backend} found no plan within time_limit={time_limit}s ({problem}); "
                           f"LP bound {lp.value:.6g}s. "
                           f"Raise time_limit or try solver='highs'.")
    choice = reduced.expand(model.choice())
    return checked_solution(choice, problem.evaluate(choice), out, lp, budget=problem.budget_bytes,
                            backend=backend, model=model, stats=dict(reduced.stats),
                            timings={"simplify_s": t1 - t0, "build_s": t2 - t1})


def checked_solution(choice, ev, out: _Outcome, lp: _Outcome, *, budget, backend: str, model: "IlpModel",
                     stats: dict, timings: dict, recompute: tuple[str, ...] = ()) -> Solution:
    """The ``Solution`` for ``choice`` (evaluated as ``ev``), after checking that the cost model
    agrees with the solver's objective and that the plan fits the budget; the gap is measured
    against the best proven bound (never below the LP relaxation)."""
    assert abs(ev.objective - out.value) <= 1e-4 * (1 + abs(ev.objective)), (ev.objective, out.value)
    if budget is not None and ev.peak_bytes > budget:
        raise RuntimeError(f"{backend}'s plan peaks at {ev.peak_bytes} bytes, over the budget "
                           f"{budget} (solver tolerance?); retry with the other backend")
    dual = out.dual_bound if out.dual_bound is not None else lp.value
    dual = min(max(dual, lp.value), ev.objective)
    gap = (ev.objective - dual) / ev.objective if ev.objective > 0 else 0.0
    return Solution(
        choice=choice, objective=ev.objective, lp_bound=lp.value, dual_bound=dual, gap=gap,
        status=out.status, backend=backend,
        timings={**timings, "lp_s": lp.seconds, "solve_s": out.seconds},
        peak_bytes=ev.peak_bytes, num_variables=model.num_variables, num_constraints=model.num_constraints,
        recompute=recompute, stats=stats,
    )
