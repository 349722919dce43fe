"""What a pipeline rank holds in flight, read off the order in which torch's schedules run it.

The runtime runs the interleaved schedules with torch's ``ScheduleInterleaved1F1B`` and
``ScheduleInterleavedZeroBubble`` (``autopar.runtime.pipeline.module``). Their action order per
rank comes from two pure functions of ``torch.distributed.pipelining.schedules``
(``_get_warmup_ops``, ``_get_1f1b_rank_ops``), called here with the arguments those classes pass
them, so the count follows torch's schedule rather than a formula for it: a closed formula
(Megatron's warm-up spread evenly over the chunks) over-counted the interleaved schedule by a
chunk and, for zero-bubble, missed that a micro-batch's activations stay saved until its deferred
weight-gradient pass (``W``), not its input-gradient pass: measured on GPT-2 (2 ranks x 2 chunks,
8 micro-batches), rank 1 held 11 chunk micro-batches where the formula said 4.

``rank_counts`` walks the order: a forward adds one micro-batch to its chunk, the pass that ends
the saved activations' life (``B``; zero-bubble's ``W``) removes it. GPipe and 1F1B (one chunk
per rank) have the closed forms of ``pipeline.schedule.in_flight``; this module serves the
schedules with ``virtual_stages > 1``.
"""

from __future__ import annotations

import functools

__all__ = ["rank_counts", "chunk_peaks"]

INTERLEAVED = ("interleaved-1f1b", "zero-bubble")


def _rank_actions(schedule: str, *, rank: int, num_stages: int, virtual_stages: int, num_microbatches: int) -> list:
    """torch's action list for ``rank`` (its ``_calculate_single_rank_operations``, same arguments)."""
    from torch.distributed.pipelining.schedules import _get_1f1b_rank_ops, _get_warmup_ops

    rounds = max(1, num_microbatches // num_stages)
    per_round = num_microbatches // rounds
    if num_microbatches % rounds:
        raise ValueError(f"schedule {schedule!r} needs the micro-batch count to be a multiple of its rounds "
                         f"({rounds}), got {num_microbatches}")
    zero_bubble = schedule == "zero-bubble"
    warmup = _get_warmup_ops(rank, virtual_stages, per_round, num_stages, num_microbatches,
                             multiply_factor=1 if zero_bubble else 2)
    total = virtual_stages * num_microbatches
    fwd_bwd = total - warmup
    cooldown = total - fwd_bwd

    def forward_stage_index(step):
        return ((step // per_round) % virtual_stages) * num_stages + rank

    def backward_stage_index(step):
        return (virtual_stages - 1 - ((step - warmup) // per_round) % virtual_stages) * num_stages + rank

    kw = dict(num_1f1b_microbatches=rank, enable_zero_bubble=True) if zero_bubble else {}
    return _get_1f1b_rank_ops(virtual_stages, num_stages, warmup, fwd_bwd, cooldown, rank, forward_stage_index,
                              backward_stage_index, **kw)


@functools.lru_cache(maxsize=256)
def rank_counts(schedule: str, *, rank: int, num_stages: int, virtual_stages: int,
                num_microbatches: int) -> tuple[tuple[int, ...], ...]:
    """Per action of ``rank``'s order, the micro-batches each of its chunks holds saved (chunk
    ``c`` is stage ``c * num_stages + rank``)."""
    if schedule not in INTERLEAVED:
        raise ValueError(f"rank_counts reads torch's order of {INTERLEAVED}, not {schedule!r}")
    from torch.distributed.pipelining.schedules import _ComputationType as Kind

    frees = Kind.BACKWARD_WEIGHT if schedule == "zero-bubble" else Kind.FULL_BACKWARD
    counts = [0] * virtual_stages
    states = []
    for action in _rank_actions(schedule, rank=rank, num_stages=num_stages, virtual_stages=virtual_stages,
                                num_microbatches=num_microbatches):
        if action is None:
            continue
        chunk = action.stage_index // num_stages
        if action.computation_type == Kind.FORWARD:
            counts[chunk] += 1
        elif action.computation_type == frees:
            counts[chunk] -= 1
        states.append(tuple(counts))
    return tuple(states)


def chunk_peaks(schedule: str, *, rank: int, num_stages: int, virtual_stages: int,
                num_microbatches: int) -> tuple[int, ...]:
    """The most micro-batches each chunk of ``rank`` holds at any point of the step."""
    states = rank_counts(schedule, rank=rank, num_stages=num_stages, virtual_stages=virtual_stages,
                         num_microbatches=num_microbatches)
    return tuple(max(s[c] for s in states) for c in range(virtual_stages))

