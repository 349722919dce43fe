"""Communication/compute overlap: the second stream of the step-time model.

Every communication cost the builder emits is one of two kinds:

* **synchronous**: issued on the critical path and waited on at once (a layout conversion inside
  forward or backward, a row-parallel all-reduce, a ZeRO gather after the optimizer step); it
  adds to the step in full;
* **asynchronous**: issued without waiting -- a parameter's partial gradient, which the runtime
  sums in gradient buckets all-reduced (or, ZeRO-2, reduce-scattered) while the rest of backward
  runs (``autopar.runtime.bucketing``), but only where its reader takes the parameter in the
  parameter's own layout (a gathered parameter's sum runs in-graph). So it is a property of a
  pair of choices: ``Edge.async_costs[i][j]``, a part of the reader's ``comm_s`` (an option's own
  asynchronous part, ``StrategyOption.async_s``, adds to it).

Asynchronous communication runs beside compute: the backward compute after its bucket is ready.
That is approximated by the whole step's backward compute (``StrategyOption.overlap_s``). The
last bucket, issued only when backward ends, is not asynchronous at all: the builder counts the
sums of its parameters synchronous (``planner.executed.last_bucket_params``, the runtime's own
cut), so a small model whose gradients fill one bucket hides nothing, as it measures. With ``A``
the chosen async seconds, ``W`` the chosen backward compute and ``rho`` the
mesh's ``comm_overlap``::

    hidden  = min(rho * A, W)          (hidden <= rho * A and hidden <= W, as large as they allow)
    A       = sum of chosen options' async_s + sum over edges of async_costs at the chosen pair
    exposed = A - hidden
    step    = compute + sync communication + exposed  =  (everything summed) - hidden

The evaluator (``autopar.solver.timeline.evaluate``) computes the minimum; the ILP
(``autopar.solver.ilp.IlpModel.add_overlap``) has a column ``h >= 0`` bounded by the two rows
``h <= rho * A`` and ``h <= W`` and subtracted in the objective, which at the optimum is the same
number. ``rho = 0`` (or no asynchronous communication) adds nothing: the model is today's sum.

Simplification stays exact: the step is ``max(C - rho * A, C - W)`` (``C``: everything summed),
so an option that is no worse in both ``C - rho * A`` and ``C - W`` is no worse in the step
(``autopar.solver.simplify``'s dominance and follow tests run on both when overlap is active,
the first with edge costs ``costs - rho * async_costs``).

No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["Overlap", "hidden_seconds", "overlap_active"]


def hidden_seconds(comm_overlap: float, async_s: float, overlap_s: float) -> float:
    """Seconds of ``async_s`` hidden under ``overlap_s`` of compute at ``comm_overlap`` (module
    docstring); exactly 0.0 when nothing can hide."""
    if comm_overlap <= 0.0 or async_s <= 0.0 or overlap_s <= 0.0:
        return 0.0
    return min(comm_overlap * async_s, overlap_s)


def overlap_active(problem) -> bool:
    """Whether a ``Problem`` can hide anything: a positive overlap and some asynchronous
    communication, on an option or an edge (otherwise the model is the plain sum, bit for bit)."""
    return problem.comm_overlap > 0.0 and (any(e.async_array is not None for e in problem.edges) or any(
        o.async_s > 0.0 for n in problem.nodes for o in n.options))


@dataclass(frozen=True, slots=True)
class Overlap:
    """The overlap terms of a simplified model (``autopar.solver.simplify.Reduced.overlap``):
    per group ``g`` and option ``s``, ``async_s[g][s]`` seconds of asynchronous communication and
    ``compute_s[g][s]`` seconds of compute it may hide under; ``edges[(a, b)][s, t]`` the
    asynchronous seconds of a group edge (the pairs ``Reduced.edges`` holds, where nonzero);
    ``rho``: the mesh's ``comm_overlap``. The reduced model's step is its summed objective less
    ``hidden_seconds(rho, A, W)``."""

    rho: float
    async_s: tuple[np.ndarray, ...]
    compute_s: tuple[np.ndarray, ...]
    edges: dict = field(default_factory=dict)

    def totals(self, group_choice) -> tuple[float, float]:
        """``(A, W)`` of a group choice."""
        a = sum(float(v[s]) for v, s in zip(self.async_s, group_choice))
        a += sum(float(m[group_choice[g1], group_choice[g2]]) for (g1, g2), m in self.edges.items())
        w = sum(float(v[s]) for v, s in zip(self.compute_s, group_choice))
        return a, w

    def hidden(self, group_choice) -> float:
        return hidden_seconds(self.rho, *self.totals(group_choice))
