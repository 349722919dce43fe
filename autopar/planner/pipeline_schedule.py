"""The pipeline schedules' cost formulas and the stage-cut dynamic program (torch-free, numpy-free).

Notation: ``S`` pipeline ranks (mesh axis 0), ``v`` virtual stages per rank (K = S * v stages in
pipeline order, stage k on rank ``k % S``), ``M`` micro-batches, ``t_k`` stage k's time for ONE
micro-batch (forward + backward, its sharded ops on the stage sub-mesh, plus sending its output
forward and receiving its gradient back over axis 0's link), ``sync_k`` its once-per-step
gradient synchronisation over the sub-mesh.

Step time (``step_time``) = ``(M * v + bubble) * max_k t_k + max_k sync_k`` with

- GPipe, 1F1B: ``bubble = S - 1`` (``(M + S - 1) * t``: the classic fill and drain);
- interleaved 1F1B: ``bubble = S - 1`` in units of a chunk: ``(M + (S - 1) / v) * (v * t)``,
  Megatron's bubble divided by ``v``;
- zero-bubble (torch's interleaved zero-bubble schedule, ZB-H1 of Qi et al. 2023): the
  weight-gradient passes fill about two thirds of the 1F1B bubble when forward, input-gradient
  and weight-gradient passes take a third of ``t`` each: ``bubble = (S - 1) / 3``.

Balanced chunks are assumed for interleaving (a rank's time per micro-batch is ``v`` times the
slowest chunk's): the DP bounds the slowest chunk, which bounds every rank's sum.

In-flight micro-batches (``in_flight``), whose saved activations stage k holds at its peak:

- GPipe: ``M`` (every forward runs before the first backward);
- 1F1B: ``min(S - r, M)`` on rank ``r`` (its warm-up forwards plus the one in flight);
- interleaved 1F1B: Megatron's warm-up on rank ``r`` is ``2 (S - r - 1) + (v - 1) S`` chunk
  forwards, plus one in flight, capped at ``M v``; spread over the rank's ``v`` chunks:
  ``ceil(min(2 (S - r - 1) + (v - 1) S + 1, M v) / v)`` per chunk;
- zero-bubble: as interleaved 1F1B (ZB-H1 keeps 1F1B's activation peak; the deferred
  weight-gradient passes hold only their inputs' gradients, which this count ignores).

``best_cuts`` finds the contiguous cut of ``B`` blocks into ``K`` stages minimising
``factor * max_k t_k + max_k sync_k`` exactly: for each candidate bottleneck T (every stage time,
ascending) a DP over cut points minimises the largest sync among cuts whose stages all take at
most T; it stops once ``factor * T`` alone cannot beat the best found.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from autopar.plans import PIPELINE_SCHEDULES

__all__ = ["SCHEDULE_VIRTUAL_STAGES", "bubble", "step_factor", "in_flight", "step_time", "Cuts", "best_cuts"]

# Virtual stages per rank each schedule is planned with (the runtime's torch schedules run
# gpipe/1f1b with one stage per rank; the interleaved ones with two or more).
SCHEDULE_VIRTUAL_STAGES = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zero-bubble": 2}


def _check(schedule: str) -> None:
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r} is not one of {PIPELINE_SCHEDULES}")


def bubble(schedule: str, *, num_stages: int) -> float:
    """Idle slots, in units of the slowest stage's time per micro-batch (module docstring)."""
    _check(schedule)
    return (num_stages - 1) / 3 if schedule == "zero-bubble" else float(num_stages - 1)


def step_factor(schedule: str, *, num_stages: int, virtual_stages: int, num_microbatches: int) -> float:
    """How many times the slowest stage's per-micro-batch time the step takes: ``M v + bubble``."""
    return num_microbatches * virtual_stages + bubble(schedule, num_stages=num_stages)


def in_flight(schedule: str, *, index: int, num_stages: int, virtual_stages: int, num_microbatches: int) -> int:
    """Micro-batches whose saved activations stage ``index`` holds at its peak (module docstring)."""
    _check(schedule)
    rank, m = index % num_stages, num_microbatches
    if schedule == "gpipe":
        return m
    if virtual_stages == 1:
        return min(num_stages - rank, m)
    warmup = 2 * (num_stages - rank - 1) + (virtual_stages - 1) * num_stages
    return math.ceil(min(warmup + 1, m * virtual_stages) / virtual_stages)


def step_time(schedule: str, *, times, syncs, num_stages: int, virtual_stages: int, num_microbatches: int) -> float:
    """The step's seconds for per-stage micro-batch ``times`` and gradient ``syncs``."""
    factor = step_factor(schedule, num_stages=num_stages, virtual_stages=virtual_stages,
                         num_microbatches=num_microbatches)
    return factor * max(times) + max(syncs, default=0.0)


@dataclass(frozen=True, slots=True)
class Cuts:
    """Stage k holds blocks ``[bounds[k], bounds[k + 1])`` and runs its option ``picks[k]`` (of
    those ``cost`` gave it); ``objective`` = factor * max time + max sync."""

    bounds: tuple[int, ...]
    objective: float
    max_time: float
    max_sync: float
    picks: tuple[int, ...] = ()


Option = tuple[float, float]  # (time per micro-batch, gradient sync per step)


def best_cuts(num_blocks: int, num_parts: int,
              cost: Callable[[int, int, int], Option | list[Option] | None], *, factor: float) -> Cuts | None:
    """The best contiguous cut of ``num_blocks`` blocks into ``num_parts`` non-empty stages, or
    None when no cut has every stage feasible. ``cost(k, a, b)``: (time, sync) of stage k
    holding blocks ``[a, b)``, or a list of such options (e.g. with and without activation
    recompute: the DP picks one per stage), or None when it does not fit.

    Exact: for a bottleneck ``T`` every stage takes, among its options no slower than ``T``, the
    one of least sync (the objective only grows with a stage's sync once ``T`` is fixed), so the
    threshold sweep over every option's time finds the optimum over cuts and options together."""
    if num_parts < 1 or num_blocks < num_parts:
        raise ValueError(f"cannot cut {num_blocks} blocks into {num_parts} non-empty stages")
    table: dict[tuple[int, int, int], tuple[Option, ...]] = {}
    for k in range(num_parts):
        for a in range(k, num_blocks - num_parts + k + 1):
            for b in range(a + 1, num_blocks - num_parts + k + 2):
                c = cost(k, a, b)
                if c is None:
                    continue
                opts = tuple(c) if isinstance(c, list) else (c,)
                if opts:
                    table[k, a, b] = opts
    best: Cuts | None = None
    for limit in sorted({t for opts in table.values() for t, _ in opts}):
        if best is not None and factor * limit >= best.objective:
            break  # syncs are >= 0: no larger bottleneck can win
        found = _min_sync(num_blocks, num_parts, table, limit)
        if found is None:
            continue
        sync, bounds = found
        picks = tuple(_pick(table[k, bounds[k], bounds[k + 1]], limit) for k in range(num_parts))
        time = max(table[k, bounds[k], bounds[k + 1]][i][0] for k, i in enumerate(picks))
        if best is None or factor * time + sync < best.objective:
            best = Cuts(bounds, factor * time + sync, time, sync, picks)
    return best


def _pick(opts: tuple[Option, ...], limit: float) -> int | None:
    """The option of least sync (then least time) no slower than ``limit``; None: none is."""
    fit = [i for i, (t, _) in enumerate(opts) if t <= limit]
    return min(fit, key=lambda i: (opts[i][1], opts[i][0])) if fit else None


def _min_sync(num_blocks: int, num_parts: int, table, limit: float) -> tuple[float, tuple[int, ...]] | None:
    """Cut points minimising the largest sync with every stage time <= ``limit``."""
    inf = math.inf
    # f[k][b]: least max-sync of stages 0..k-1 covering blocks [0, b); back[k][b]: stage k-1's start.
    f = [[inf] * (num_blocks + 1) for _ in range(num_parts + 1)]
    back = [[-1] * (num_blocks + 1) for _ in range(num_parts + 1)]
    f[0][0] = 0.0
    for k in range(num_parts):
        for a in range(num_blocks):
            if f[k][a] == inf:
                continue
            for b in range(a + 1, num_blocks + 1):
                opts = table.get((k, a, b))
                i = None if opts is None else _pick(opts, limit)
                if i is None:
                    continue
                v = max(f[k][a], opts[i][1])
                if v < f[k + 1][b]:
                    f[k + 1][b], back[k + 1][b] = v, a
    if f[num_parts][num_blocks] == inf:
        return None
    bounds = [num_blocks]
    for k in range(num_parts, 0, -1):
        bounds.append(back[k][bounds[-1]])
    return f[num_parts][num_blocks], tuple(reversed(bounds))
