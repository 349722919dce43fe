"""HiGHS through highspy for the ILP (``autopar.solver.ilp``): a pulp model handed to highspy in
bulk with the time left until its deadline, the run's status read back as pulp's, and the
copyright banner HiGHS 1.16 prints on stdout kept off it. No torch import."""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pulp

__all__ = ["DeadlineHighs", "columns_of", "silence_highs_banner"]


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


class DeadlineHighs(pulp.HiGHS):
    """pulp's HiGHS told the time left when its search starts (building the highspy model from
    pulp's counts against the deadline too), with the model passed to highspy in two bulk calls
    (pulp adds it a column and a row at a time and lists the problem's variables four times:
    2.7 s of a 3.4 s Llama-8B 8x8 relaxation, whose simplex took 0.7 s)."""

    def __init__(self, *, deadline: float, **kwargs):
        super().__init__(**kwargs)
        self.deadline = deadline

    def callSolver(self, lp):
        lp.solverModel.setOptionValue("time_limit", max(self.deadline - time.monotonic(), 1e-3))
        super().callSolver(lp)

    def actualSolve(self, lp):  # type: ignore[override]
        self.createAndConfigureSolver(lp)
        variables = columns_of(lp)
        _pass_model(lp.solverModel, lp, variables, mip=self.mip)
        self.callSolver(lp)
        # The values go back to the parent as an array (``_solve_highs``), not into this
        # (forked) child's variables.
        status, sol_status, self.values = _highs_result(lp.solverModel)
        lp.assignStatus(status, sol_status)
        return status


def _pass_model(highs, lp: pulp.LpProblem, variables: list, *, mip: bool) -> None:
    """``lp`` (a minimisation) into ``highs``: columns in ``variables``' order, rows in
    constraint order -- what pulp's ``buildSolverModel`` adds one by one."""
    import highspy

    inf = highspy.kHighsInf
    assert lp.sense == pulp.LpMinimize, "autopar's models minimise"
    col = {id(v): i for i, v in enumerate(variables)}
    n = len(variables)
    cost = np.zeros(n)
    for v, c in lp.objective.items():
        cost[col[id(v)]] = c
    lower = np.array([-inf if v.lowBound is None else v.lowBound for v in variables], dtype=float)
    upper = np.array([inf if v.upBound is None else v.upBound for v in variables], dtype=float)
    highs.addCols(n, cost, lower, upper, 0, np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0))
    if mip:
        ints = np.array([i for i, v in enumerate(variables) if v.cat == pulp.LpInteger], dtype=np.int32)
        if len(ints):
            highs.changeColsIntegrality(len(ints), ints, np.full(len(ints), highspy.HighsVarType.kInteger))
    starts, index, value, row_lo, row_hi = [], [], [], [], []
    for con in lp._constraints.values():
        starts.append(len(index))
        for v, c in con.items():
            if c != 0:
                index.append(col[id(v)])
                value.append(c)
        lo, hi = con.getLb(), con.getUb()
        row_lo.append(-inf if lo is None else lo)
        row_hi.append(inf if hi is None else hi)
    if starts:
        highs.addRows(len(starts), np.array(row_lo, dtype=float), np.array(row_hi, dtype=float), len(index),
                      np.array(starts, dtype=np.int32), np.array(index, dtype=np.int32), np.array(value, dtype=float))


def _highs_result(highs) -> tuple[int, int, np.ndarray]:
    """(pulp status, pulp solution status, column values) of a finished run, as pulp's
    ``findSolutionValues`` maps them (a limit reached with no plan: not solved)."""
    import highspy

    ms = highspy.HighsModelStatus
    status = highs.getModelStatus()
    values = np.array(highs.getSolution().col_value, dtype=float)
    if status == ms.kOptimal:
        return pulp.LpStatusOptimal, pulp.LpSolutionOptimal, values
    if status in (ms.kInfeasible, ms.kUnboundedOrInfeasible):
        return pulp.LpStatusInfeasible, pulp.LpSolutionInfeasible, values
    if status == ms.kUnbounded:
        return pulp.LpStatusUnbounded, pulp.LpSolutionUnbounded, values
    # A limit that stopped the search leaves the best plan found, if any. kSolutionLimit (a node
    # or plan limit) is set only by tests (``autopar.solver.ilp.CHILD_SOLVERS``'s ``plan_limit``).
    limits = (ms.kTimeLimit, ms.kIterationLimit, ms.kSolutionLimit)
    stopped = (ms.kObjectiveBound, ms.kObjectiveTarget, ms.kInterrupt, *limits)
    if status in stopped and not (status in limits and highs.getObjectiveValue() == float(highspy.kHighsInf)):
        return pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible, values
    return pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound, values


def columns_of(prob: pulp.LpProblem) -> list:
    """``prob.variables()`` as ``IlpModel.columns`` cached it (pulp re-registers every
    constraint's variables on each call: 0.4 s on a 35k-column model), unless the objective has
    a variable the cache lacks (pulp's dummy for a constant objective)."""
    cols = prob.__dict__.get("_autopar_columns")
    if cols is not None:
        if len(prob.objective) > 1:  # pulp adds its dummy to an objective without variables only
            return cols
        known = {id(v) for v in cols}
        if all(id(v) in known for v in prob.objective):
            return cols
    return prob.variables()
