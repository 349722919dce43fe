"""Budgets refused without a solve: what every plan of a ``Problem`` holds whatever it chooses.

The parameters, their gradients and optimizer state are held the whole step, so a budget below
each node's fewest parameter bytes admits no plan, recomputing or not. On a large problem that
is said at once (an infeasible fixed configuration of Mixtral-8x22B spent 60-90 s in
``minimum_budget`` to say so); a small one keeps its exact smallest budget, which is cheap and is
how users and the tight-budget sweeps ask for it (the error of a 1-byte budget)."""

from __future__ import annotations

from autopar.solver.problem import Problem

__all__ = ["FLOOR_NODES", "at_least", "below_parameters", "parameter_floor"]

FLOOR_NODES = 2_000  # from this size an infeasible budget below the parameters is reported without a solve


def parameter_floor(problem: Problem) -> int:
    """The fewest parameter bytes (gradients and optimizer state included) any plan holds: each
    node's smallest option."""
    return sum(min(o.param_bytes for o in n.options) for n in problem.nodes)


def below_parameters(problem: Problem) -> ValueError | None:
    """The error for a budget below ``parameter_floor`` on a problem of at least ``FLOOR_NODES``
    nodes; None when the parameters fit or the problem is small."""
    floor = parameter_floor(problem)
    if problem.budget_bytes is None or floor <= problem.budget_bytes or problem.num_nodes < FLOOR_NODES:
        return None
    return at_least(problem, floor, where="with or without recompute",
                    why="what the parameters, their gradients and optimizer state alone take in every op's "
                        "fewest-bytes layout", hint="a bigger mesh, ZeRO, offload or a larger budget")


def at_least(problem: Problem, least: int, *, where: str, why: str, hint: str) -> ValueError:
    """The refusal of ``problem``'s budget below ``least`` bytes, a bound found without a solve."""
    mesh = "x".join(map(str, problem.mesh_shape)) or "?"
    return ValueError(
        f"memory budget {problem.budget_bytes} bytes ({problem.budget_bytes / 2**30:.3f} GiB) per device "
        f"cannot be met on mesh {mesh} {where}: the smallest budget any plan meets is at least {least} bytes "
        f"({least / 2**30:.3f} GiB), {why}. Try {hint}.")
