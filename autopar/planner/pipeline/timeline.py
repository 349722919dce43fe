"""The schedule of one pipelined step, simulated: which pass runs on which pipeline rank, and when.

The plan's step time is a formula (``autopar.planner.pipeline.schedule``); this module plays the
schedule out pass by pass so a user can see it (``autopar inspect --pipeline N --html``) and so
the formula can be checked against it. Torch-free.

Model. Stage ``k`` (pipeline order, on rank ``k % S``) takes ``t_k`` per micro-batch for its
forward and backward together -- the plan's per-stage figure, point-to-point transfers included,
as in the formula. Its forward pass takes ``t_k / 3`` and its backward ``2 t_k / 3`` (a backward
computes two gradients per forward product); under zero-bubble the backward is split into an
input-gradient pass ``B`` and a weight-gradient pass ``W`` of ``t_k / 3`` each. A pass starts
when its rank is free and its input exists: ``F(k, m)`` after ``F(k - 1, m)``; ``B(k, m)`` after
``B(k + 1, m)`` (the last stage: after its own forward); ``W(k, m)`` after ``B(k, m)``. Each rank
runs its passes in the schedule's order:

- ``gpipe``: every forward, then every backward;
- ``1f1b``: ``min(S - r - 1, M)`` warm-up forwards on rank ``r``, then one forward / one
  backward alternately, then the remaining backwards;
- ``interleaved-1f1b`` (``v`` stages per rank): torch's (Megatron's) order -- the micro-batches
  in ``max(1, M // S)`` rounds of ``P = M / rounds``, each round through chunk 0, 1, ... forward
  (the reverse chunk order backward), with ``2 (S - r - 1) + (v - 1) P`` warm-up forwards;
- ``zero-bubble``: the interleaved order of ``F`` and ``B``; a rank whose next pass cannot start
  runs a pending ``W`` instead (ZB-H1's filling of the bubble), and the rest after its last ``B``.

After its last pass each rank synchronises its stages' gradients (the largest ``sync_k`` of its
stages). With equal stage times the simulated step equals the formula for gpipe, 1f1b and
interleaved 1F1B (tested); zero-bubble's formula is an estimate of the greedy filling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.planner.pipeline.schedule import SPLIT_BACKWARD
from autopar.plans import PIPELINE_SCHEDULES

__all__ = ["Pass", "Timeline", "simulate", "rank_order"]


@dataclass(frozen=True, slots=True)
class Pass:
    """One pass of one micro-batch through one stage: ``kind`` F (forward), B (backward; under
    zero-bubble the input gradient only), W (zero-bubble's weight gradient) or S (the rank's
    once-per-step gradient sync, ``stage`` and ``micro`` -1)."""

    kind: str
    stage: int
    micro: int
    rank: int
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class Timeline:
    passes: tuple[Pass, ...]
    num_ranks: int
    step_s: float  # when the last rank finishes (its gradient sync included)

    def busy_s(self, rank: int) -> float:
        return sum(p.end - p.start for p in self.passes if p.rank == rank)

    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time over the step."""
        if self.step_s <= 0:
            return 0.0
        return 1.0 - sum(self.busy_s(r) for r in range(self.num_ranks)) / (self.num_ranks * self.step_s)


def _groups(num_microbatches: int, size: int) -> list[range]:
    return [range(m, min(m + size, num_microbatches)) for m in range(0, num_microbatches, size)]


def rank_order(schedule: str, *, rank: int, num_ranks: int, virtual_stages: int,
               num_microbatches: int) -> list[tuple[str, int, int]]:
    """(kind, stage, micro-batch) of the F and B passes rank ``rank`` runs, in its schedule's
    order (module docstring); zero-bubble's W passes are placed by ``simulate``."""
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r} is not one of {PIPELINE_SCHEDULES}")
    s, v, m = num_ranks, virtual_stages, num_microbatches
    if schedule in ("gpipe", "1f1b") and v != 1:
        raise ValueError(f"schedule {schedule!r} runs one stage per rank, got {v} virtual stages")
    if v == 1:
        fwd = [("F", rank, i) for i in range(m)]
        bwd = [("B", rank, i) for i in range(m)]
        warmup = m if schedule == "gpipe" else min(s - rank - 1, m)
    else:  # torch's rounds: max(1, M // S) of them, M divided evenly between them
        rounds = max(1, m // s)
        if m % rounds:
            raise ValueError(f"{schedule} needs a micro-batch count that is a multiple of its number of rounds "
                             f"({rounds} for {m} micro-batches on {s} ranks), got {m}")
        per_round = m // rounds
        fwd = [("F", rank + j * s, i) for g in _groups(m, per_round) for j in range(v) for i in g]
        bwd = [("B", rank + j * s, i) for g in _groups(m, per_round) for j in reversed(range(v)) for i in g]
        warmup = min(2 * (s - rank - 1) + (v - 1) * per_round, m * v)
    order = fwd[:warmup]
    for i in range(len(fwd) - warmup):
        order += [fwd[warmup + i], bwd[i]]
    return order + bwd[len(fwd) - warmup:]


def simulate(schedule: str, *, times: list[float], syncs: list[float] | None = None, num_ranks: int,
             virtual_stages: int, num_microbatches: int) -> Timeline:
    """Play the schedule out for stage times ``times`` (per micro-batch, forward + backward, one
    per stage in pipeline order) and gradient ``syncs``; ``ValueError`` on bad sizes."""
    num_stages = num_ranks * virtual_stages
    if len(times) != num_stages:
        raise ValueError(f"{num_ranks} ranks x {virtual_stages} virtual stages need {num_stages} stage times, "
                         f"got {len(times)}")
    if any(not (t >= 0 and math.isfinite(t)) for t in times):
        raise ValueError(f"stage times must be finite and >= 0, got {times}")
    syncs = list(syncs) if syncs is not None else [0.0] * num_stages
    split = schedule == "zero-bubble"
    # The split backward's two autograd calls cost more than one (``schedule.SPLIT_BACKWARD``):
    # spread over the chunk's passes, as the step formula scales the whole step.
    times = [t * (1.0 + SPLIT_BACKWARD.get(schedule, 0.0)) for t in times]
    dur = {"F": [t / 3 for t in times], "B": [t / 3 if split else 2 * t / 3 for t in times],
           "W": [t / 3 for t in times]}
    orders = [rank_order(schedule, rank=r, num_ranks=num_ranks, virtual_stages=virtual_stages,
                         num_microbatches=num_microbatches) for r in range(num_ranks)]
    return _play(orders, dur, syncs, split=split, num_stages=num_stages)


def _ready(op: tuple[str, int, int], end: dict, last: int) -> float | None:
    """When ``op``'s input exists, or None while the pass producing it is not placed yet."""
    kind, k, m = op
    dep = (("F", k - 1, m) if k else None) if kind == "F" else ("F", k, m) if k == last else ("B", k + 1, m)
    if dep is None:
        return 0.0
    return end.get(dep)


def _play(orders, dur, syncs, *, split: bool, num_stages: int) -> Timeline:
    """Commit, again and again, the earliest pass any rank can start (so every pass not yet
    placed starts no earlier: a W filling an idle slot really fills it)."""
    num_ranks = len(orders)
    end: dict[tuple[str, int, int], float] = {}
    passes: list[Pass] = []
    free = [0.0] * num_ranks
    at = [0] * num_ranks
    pending: list[list[tuple[str, int, int]]] = [[] for _ in range(num_ranks)]  # W passes owed
    last = num_stages - 1
    while True:
        best = None  # (start, rank, op, is_fill)
        for r in range(num_ranks):
            cand = None
            if at[r] < len(orders[r]):
                ready = _ready(orders[r][at[r]], end, last)
                if ready is not None and (ready <= free[r] or not pending[r]):
                    cand = (max(free[r], ready), r, orders[r][at[r]], False)
                elif pending[r]:
                    cand = (free[r], r, pending[r][0], True)
            elif pending[r]:
                cand = (free[r], r, pending[r][0], True)
            if cand is not None and (best is None or cand[:2] < best[:2]):
                best = cand
        if best is None:
            break
        start, r, op, fill = best
        kind, k, m = op
        finish = start + dur[kind][k]
        end[op] = finish
        passes.append(Pass(kind, k, m, r, start, finish))
        free[r] = finish
        if fill:
            pending[r].pop(0)
        else:
            at[r] += 1
            if split and kind == "B":
                pending[r].append(("W", k, m))
    if any(at[r] < len(orders[r]) for r in range(num_ranks)):
        stuck = [(r, orders[r][at[r]]) for r in range(num_ranks) if at[r] < len(orders[r])]
        raise ValueError(f"the schedule's pass order deadlocks at {stuck}")
    step = 0.0
    for r in range(num_ranks):
        sync = max((syncs[k] for k in range(r, num_stages, num_ranks)), default=0.0)
        if sync > 0:
            passes.append(Pass("S", -1, -1, r, free[r], free[r] + sync))
        step = max(step, free[r] + sync)
    return Timeline(tuple(passes), num_ranks, step)
