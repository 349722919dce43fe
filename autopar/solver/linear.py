"""A mixed-integer linear program held as arrays, and the two backends that solve it.

Why not a modelling library's objects: the sharding ILP of a mid-sized model has 100-200k
columns, nearly all edge variables added in bulk (``autopar.solver.ilp``). Built as pulp
objects, one column and one row at a time, a Swin tiny on 2x2 took 1.3-1.6 s per model to
build and ~0.5 s more per run to hand over (the columns listed, the rows walked, the values
written back), four models per tight-budget plan: half of its planning time. Here a column is
an index, rows are appended as CSR slices (one numpy call for a whole edge), and the model goes
to HiGHS in two bulk calls. CBC, the fallback, reads the same arrays through pulp
(``to_pulp``), built only when it runs.

``LinearProgram`` minimises ``constant + cost . v`` subject to ``row_lower <= A v <=
row_upper`` and ``lower <= v <= upper``, some columns integer. ``values`` (after a solve, or
set by the caller) holds one value per column, NaN where unknown. No torch import.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np

__all__ = ["LinearProgram", "INF", "solve_highs", "solve_cbc", "cbc_path", "highs_available",
           "silence_highs_banner", "STATUSES"]

INF = float("inf")
# What a backend run answers (``solve_highs``/``solve_cbc``): proved optimal (to the gap asked
# for), a plan found before a limit struck, no plan exists, or no plan was found.
STATUSES = ("optimal", "feasible", "infeasible", "no_solution")


class LinearProgram:
    """A minimisation over columns ``0..num_columns-1`` (module docstring)."""

    def __init__(self, name: str):
        self.name = name
        self.constant = 0.0
        self.values: np.ndarray | None = None
        # Plain lists while building (a row or column appended costs a list extend, not an
        # array), made arrays once by ``arrays()``.
        self._lower: list[float] = []
        self._upper: list[float] = []
        self._integer: list[bool] = []
        self._cost_cols: list[np.ndarray] = []
        self._cost_vals: list[np.ndarray] = []
        self._row_len: list[int] = []
        self._row_idx: list[int] = []
        self._row_val: list[float] = []
        self._row_lo: list[float] = []
        self._row_hi: list[float] = []
        self.num_columns = 0
        self.num_rows = 0
        self._frozen: dict | None = None

    def __getstate__(self) -> dict:
        """Once built, a child (``autopar.solver.watchdog``'s worker) needs the arrays only."""
        state = dict(self.__dict__)
        if self._frozen is not None:
            for key in ("_lower", "_upper", "_integer", "_cost_cols", "_cost_vals", "_row_len", "_row_idx",
                        "_row_val", "_row_lo", "_row_hi"):
                state[key] = []
        return state

    # ------------------------------------------------------------------------- building
    def add_columns(self, n: int, *, lower: float = 0.0, upper: float = INF, integer: bool = False) -> np.ndarray:
        """``n`` new columns with these bounds; returns their indices."""
        cols = np.arange(self.num_columns, self.num_columns + n, dtype=np.int64)
        self._lower += [float(lower)] * n
        self._upper += [float(upper)] * n
        self._integer += [bool(integer)] * n
        self.num_columns += n
        self._frozen = None
        return cols

    def add_column(self, *, lower: float = 0.0, upper: float = INF, integer: bool = False) -> int:
        self._lower.append(float(lower))
        self._upper.append(float(upper))
        self._integer.append(bool(integer))
        self.num_columns += 1
        self._frozen = None
        return self.num_columns - 1

    def add_binaries(self, n: int) -> list[int]:
        return self.add_columns(n, lower=0.0, upper=1.0, integer=True).tolist()

    def add_rows(self, lengths, index, value, *, lower, upper) -> None:
        """Rows in CSR form: row ``i`` has ``lengths[i]`` entries, taken in turn from
        ``index``/``value`` (a column at most once per row); ``lower``/``upper``: per row, or
        one bound for all."""
        lengths = list(lengths)
        n = len(lengths)
        self._row_len += lengths
        self._row_idx += index.tolist() if isinstance(index, np.ndarray) else list(index)
        self._row_val += value.tolist() if isinstance(value, np.ndarray) else list(value)
        self._row_lo += np.broadcast_to(np.asarray(lower, dtype=float), (n,)).tolist()
        self._row_hi += np.broadcast_to(np.asarray(upper, dtype=float), (n,)).tolist()
        self.num_rows += n
        self._frozen = None

    def add_row(self, terms: Sequence[tuple[int, float]], *, lower: float = -INF, upper: float = INF,
                const: float = 0.0) -> None:
        """One row ``lower <= const + sum(c * v[col]) <= upper``; a column named twice counts
        the sum of its coefficients, zero coefficients are dropped."""
        acc: dict[int, float] = {}
        for col, c in terms:
            acc[col] = acc.get(col, 0.0) + c
        cols = [k for k, c in acc.items() if c != 0.0]
        self._row_len.append(len(cols))
        self._row_idx += cols
        self._row_val += [acc[k] for k in cols]
        self._row_lo.append(float(lower - const))
        self._row_hi.append(float(upper - const))
        self.num_rows += 1
        self._frozen = None

    def add_objective(self, terms: Sequence[tuple[int, float]], const: float = 0.0) -> None:
        """Add ``const + sum(c * v[col])`` to the objective."""
        if terms:
            cols, vals = zip(*terms)
            self.add_objective_arrays(np.asarray(cols), np.asarray(vals))
        self.constant += const
        self._frozen = None

    def add_objective_arrays(self, cols: np.ndarray, vals: np.ndarray) -> None:
        self._cost_cols.append(np.asarray(cols, dtype=np.int64))
        self._cost_vals.append(np.asarray(vals, dtype=float))
        self._frozen = None

    # ------------------------------------------------------------------------- reading
    def arrays(self) -> dict:
        """The model as arrays: ``cost, lower, upper, integer`` per column; ``starts, index,
        value, row_lower, row_upper`` row-wise (CSR). Cached until the model changes."""
        if self._frozen is None:
            def cat(parts, dtype):
                return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)

            cost = np.zeros(self.num_columns)
            if self._cost_cols:
                np.add.at(cost, cat(self._cost_cols, np.int64), cat(self._cost_vals, float))
            lengths = np.array(self._row_len, dtype=np.int64)
            self._frozen = {
                "cost": cost, "lower": np.array(self._lower, dtype=float),
                "upper": np.array(self._upper, dtype=float), "integer": np.array(self._integer, dtype=bool),
                "starts": np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if len(lengths) else
                np.zeros(0, np.int64),
                "index": np.array(self._row_idx, dtype=np.int64), "value": np.array(self._row_val, dtype=float),
                "row_lower": np.array(self._row_lo, dtype=float), "row_upper": np.array(self._row_hi, dtype=float),
            }
        return self._frozen

    def objective_value(self, values: np.ndarray) -> float:
        return self.constant + float(self.arrays()["cost"] @ np.nan_to_num(values))

    def value(self, col: int) -> float:
        """The column's value (0.0 when unknown)."""
        if self.values is None:
            return 0.0
        v = self.values[col]
        return 0.0 if np.isnan(v) else float(v)

    def rows_hold_without_columns(self, tol: float = 1e-9) -> bool:
        """For a model without columns (every row's activity is 0): whether every row holds."""
        a = self.arrays()
        return bool(np.all(a["row_lower"] <= tol) and np.all(a["row_upper"] >= -tol))

    def set_bounds(self, col: int, *, lower: float, upper: float) -> None:
        self._lower[col], self._upper[col] = float(lower), float(upper)
        if self._frozen is not None:
            self._frozen["lower"][col], self._frozen["upper"][col] = lower, upper

    @contextmanager
    def fixed(self, cols: Sequence[int]) -> Iterator[None]:
        """Within the block, columns ``cols`` are fixed at their current values, rounded (they
        are binaries)."""
        saved = [(self._lower[c], self._upper[c]) for c in cols]
        for c in cols:
            v = round(self.value(c))
            self.set_bounds(c, lower=v, upper=v)
        try:
            yield
        finally:
            for c, (low, up) in zip(cols, saved):
                self.set_bounds(c, lower=low, upper=up)

    def to_pulp(self, *, relax: bool):
        """The model as a pulp ``LpProblem`` (CBC reads it), columns ``c<i>`` in index order."""
        import pulp

        a = self.arrays()
        prob = pulp.LpProblem(self.name, pulp.LpMinimize)
        cat = [pulp.LpInteger if (i and not relax) else pulp.LpContinuous for i in a["integer"]]
        cols = [pulp.LpVariable(f"c{i}", None if lo == -INF else lo, None if hi == INF else hi, cat[i])
                for i, (lo, hi) in enumerate(zip(a["lower"].tolist(), a["upper"].tolist()))]
        nz = np.flatnonzero(a["cost"])
        prob.setObjective(pulp.LpAffineExpression([(cols[i], float(a["cost"][i])) for i in nz], self.constant))
        ends = np.append(a["starts"][1:], len(a["index"]))
        for r, (s, e) in enumerate(zip(a["starts"].tolist(), ends.tolist())):
            expr = pulp.LpAffineExpression([(cols[i], c) for i, c in zip(a["index"][s:e].tolist(),
                                                                         a["value"][s:e].tolist())])
            lo, hi = float(a["row_lower"][r]), float(a["row_upper"][r])
            if lo == hi:
                prob += expr == lo, f"r{r}"
            else:
                if lo > -INF:
                    prob += expr >= lo, f"r{r}_lo"
                if hi < INF:
                    prob += expr <= hi, f"r{r}_hi"
        return prob, cols


# ---------------------------------------------------------------------------- backends
_BANNER_SILENCED = False


def silence_highs_banner() -> None:
    """HiGHS 1.16 prints a copyright banner on stdout (C stdio, fd 1) when a process creates its
    first solver, whatever its options say; a CLI's stdout must carry only what it prints. So
    that first solver is created here, once, with fd 1 pointed at /dev/null (C's buffer flushed
    before it is pointed back)."""
    global _BANNER_SILENCED
    if _BANNER_SILENCED:
        return
    _BANNER_SILENCED = True
    import ctypes

    import highspy

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            highspy.Highs()
            ctypes.CDLL(None).fflush(None)
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def highs_available() -> bool:
    try:
        import highspy  # noqa: F401
    except ImportError:
        return False
    return True


def cbc_path() -> str | None:
    """A ``cbc`` on PATH, else the binary bundled with pulp."""
    found = shutil.which("cbc")
    if found:
        return found
    try:
        from pulp.apis.coin_api import pulp_cbc_path
    except ImportError:
        return None
    return pulp_cbc_path if os.path.isfile(pulp_cbc_path) and os.access(pulp_cbc_path, os.X_OK) else None


def solve_highs(lp: LinearProgram, *, relax: bool, msg: bool, gap: float, deadline: float, options: dict,
                abs_gap: float | None = None, on_plan=None) -> tuple[str, np.ndarray, float | None]:
    """Solve ``lp`` with HiGHS until ``deadline`` (``time.monotonic``); ``on_plan(objective without
    constant, values, dual bound)`` is called on each improving MIP plan. Returns ``(status,
    values, dual bound or None)``, the status one of ``STATUSES``."""
    import highspy

    a = lp.arrays()
    h = highspy.Highs()
    h.setOptionValue("output_flag", bool(msg))
    if not relax:
        h.setOptionValue("mip_rel_gap", gap)
        if abs_gap is not None:
            h.setOptionValue("mip_abs_gap", abs_gap)
    for key, value in options.items():
        h.setOptionValue(key, value)
    if on_plan is not None and not relax:
        def improving(_kind, _message, out, _data_in, _user):
            on_plan(float(out.objective_function_value), np.array(out.mip_solution, dtype=float),
                    float(out.mip_dual_bound))

        h.setCallback(improving, None)
        h.startCallback(highspy.cb.HighsCallbackType.kCallbackMipImprovingSolution)
    inf = highspy.kHighsInf
    n = lp.num_columns
    lower = np.where(np.isinf(a["lower"]), -inf, a["lower"])
    upper = np.where(np.isinf(a["upper"]), inf, a["upper"])
    h.addCols(n, a["cost"], lower, upper, 0, np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0))
    ints = np.flatnonzero(a["integer"]).astype(np.int32)
    if not relax and len(ints):
        h.changeColsIntegrality(len(ints), ints, np.full(len(ints), highspy.HighsVarType.kInteger))
    if len(a["row_lower"]):
        h.addRows(len(a["row_lower"]), np.where(np.isinf(a["row_lower"]), -inf, a["row_lower"]),
                  np.where(np.isinf(a["row_upper"]), inf, a["row_upper"]), len(a["index"]),
                  a["starts"].astype(np.int32), a["index"].astype(np.int32), a["value"])
    # The time left when the search starts: building the model counts against the deadline.
    h.setOptionValue("time_limit", max(deadline - time.monotonic(), 1e-3))
    h.run()
    bound = None if relax or not len(ints) else float(h.getInfo().mip_dual_bound)
    values = np.array(h.getSolution().col_value, dtype=float)
    ms = highspy.HighsModelStatus
    status = h.getModelStatus()
    if status == ms.kOptimal:
        return "optimal", values, bound
    if status in (ms.kInfeasible, ms.kUnboundedOrInfeasible):
        return "infeasible", values, bound
    # A limit that stopped the search leaves the best plan found, if any. kSolutionLimit (a node
    # or plan limit) is set only by tests (``autopar.solver.ilp.CHILD_SOLVERS``'s ``plan_limit``).
    limits = (ms.kTimeLimit, ms.kIterationLimit, ms.kSolutionLimit)
    stopped = (ms.kObjectiveBound, ms.kObjectiveTarget, ms.kInterrupt, *limits)
    if status in stopped and not relax and h.getObjectiveValue() != float(inf) and len(values) == n:
        return "feasible", values, bound
    return "no_solution", np.full(n, np.nan), bound


def solve_cbc(lp: LinearProgram, *, relax: bool, msg: bool, gap: float, time_limit: float,
              abs_gap: float | None = None, options: Sequence[str] = ()) -> tuple[str, np.ndarray, None]:
    """Solve ``lp`` with the CBC binary (through pulp's ``COIN_CMD``, on the model ``to_pulp``
    builds) for at most ``time_limit`` wall-clock seconds; as ``solve_highs`` without a bound.
    pulp reports ``Optimal`` when CBC stops at its time limit with a plan, so the status comes
    from pulp's solution status."""
    import pulp

    prob, cols = lp.to_pulp(relax=relax)
    prob.solve(pulp.COIN_CMD(path=cbc_path(), mip=not relax, msg=msg, timeLimit=time_limit, gapRel=gap,
                             gapAbs=abs_gap, timeMode="elapsed", options=list(options)))
    values = np.array([np.nan if v.varValue is None else v.varValue for v in cols], dtype=float)
    if prob.status == pulp.LpStatusInfeasible or prob.sol_status == pulp.LpSolutionInfeasible:
        return "infeasible", values, None
    if prob.sol_status == pulp.LpSolutionOptimal:
        return "optimal", values, None
    if prob.sol_status == pulp.LpSolutionIntegerFeasible:
        return "feasible", values, None
    return "no_solution", values, None
