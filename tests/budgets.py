"""Memory budgets derived from the planner's own figures, for tests that need a plan forced into
some shape (shard parameters, offload, recompute): a fraction of the way between two minimum
budgets, or between a minimum and the unconstrained peak, instead of a constant sized from one
version of the cost model -- a price change moves both ends with the plans."""

from __future__ import annotations

import re
from typing import Any, Callable

_SMALLEST = re.compile(r"smallest budget any plan meets is (?:between \d+ and )?(\d+) bytes")


def smallest_budget(plan: Callable[[int], Any]) -> int:
    """The smallest per-device budget any plan meets, as the planner itself finds it (its
    minimum-peak solve, named in its refusal of a 1-byte budget). ``plan(budget)`` plans with the
    options of interest; the first figure named is taken (a default pipeline's refusal names the
    plan without a pipeline first)."""
    try:
        plan(1)
    except ValueError as err:
        found = _SMALLEST.search(str(err))
        if found is None:
            raise
        return int(found[1])
    raise AssertionError("a 1-byte budget was met: no smallest budget to read")


def between(low: int, high: int, fraction: float) -> int:
    """The budget ``fraction`` of the way from ``low`` to ``high`` bytes."""
    if not low < high:
        raise AssertionError(f"no room between budgets {low} and {high}")
    return int(low + fraction * (high - low))
