"""In-flight micro-batches of the interleaved schedules read off torch's action order
(``pipeline.order``), and a rank's memory with several chunks (``pipeline.assemble.rank_memory``)."""

from __future__ import annotations

import pytest

from autopar.planner.pipeline.assemble import rank_memory
from autopar.planner.pipeline.costs import StageCost
from autopar.planner.pipeline.order import chunk_peaks, rank_counts
from autopar.planner.pipeline.schedule import in_flight


def test_interleaved_counts_follow_torchs_order():
    # 2 ranks x 2 chunks, 8 micro-batches (rounds of 2): measured on GPT-2 (saved_tensors_hooks),
    # rank 0 held 17.72 MiB at 3.57 MiB per chunk micro-batch = 5, rank 1 11.06 MiB = two of
    # chunk 0 (3.57) and one of chunk 1 (4.31).
    kw = dict(num_stages=2, virtual_stages=2, num_microbatches=8)
    states0 = rank_counts("interleaved-1f1b", rank=0, **kw)
    states1 = rank_counts("interleaved-1f1b", rank=1, **kw)
    assert max(map(sum, states0)) == 5 and max(states1, key=sum) == (2, 1)
    assert states0[-1] == states1[-1] == (0, 0)  # every micro-batch released by the step's end
    assert chunk_peaks("interleaved-1f1b", rank=0, **kw) == (4, 2)  # chunks peak at different times
    # Megatron's warm-up 2 (S - r - 1) + (v - 1) S, plus one, is the rank's total peak.
    for r in range(4):
        total = max(map(sum, rank_counts("interleaved-1f1b", rank=r, num_stages=4, virtual_stages=2,
                                         num_microbatches=8)))
        assert total == 2 * (4 - r - 1) + 4 + 1


def test_zero_bubble_keeps_activations_to_the_weight_pass_and_is_priced_as_every_micro_batch():
    states = rank_counts("zero-bubble", rank=1, num_stages=2, virtual_stages=2, num_microbatches=8)
    assert states[-1] == (0, 0)
    assert [in_flight("zero-bubble", index=k, num_stages=2, virtual_stages=2, num_microbatches=8)
            for k in range(4)] == [8] * 4


def test_rank_counts_refuses_what_it_does_not_read():
    with pytest.raises(ValueError, match="not '1f1b'"):
        rank_counts("1f1b", rank=0, num_stages=2, virtual_stages=1, num_microbatches=4)
    with pytest.raises(ValueError, match="multiple of its rounds"):
        rank_counts("interleaved-1f1b", rank=0, num_stages=4, virtual_stages=2, num_microbatches=9)


def _cost(*, param, saved, in_flight, transient=0):
    return StageCost(time_s=1.0, sync_s=0.0, p2p_s=0.0, compute_s=1.0, reshard_s=0.0,
                     peak_bytes=param + in_flight * saved + transient, param_bytes=param, in_flight=in_flight,
                     saved_bytes=saved)


def test_rank_memory_adds_a_ranks_chunks():
    mib = 2**20
    # One chunk per rank: the stage's own figures.
    one = [_cost(param=10 * mib, saved=2 * mib, in_flight=2, transient=mib), _cost(param=9 * mib, saved=3 * mib,
                                                                                  in_flight=1)]
    assert rank_memory(one, schedule="1f1b", num_stages=2, num_microbatches=4) == [(4 * mib, 15 * mib),
                                                                                    (3 * mib, 12 * mib)]
    # 2 ranks x 2 chunks, 8 micro-batches: rank 0's chunks (stages 0, 2) hold (3, 2) at the
    # rank's peak, rank 1's (stages 1, 3) (2, 1) -- not each chunk's own peak (4 and 2).
    flight = [in_flight("interleaved-1f1b", index=k, num_stages=2, virtual_stages=2, num_microbatches=8)
              for k in range(4)]
    stages = [_cost(param=16 * mib, saved=4 * mib, in_flight=flight[0], transient=mib),
              _cost(param=12 * mib, saved=4 * mib, in_flight=flight[1]),
              _cost(param=12 * mib, saved=4 * mib, in_flight=flight[2], transient=2 * mib),
              _cost(param=16 * mib, saved=5 * mib, in_flight=flight[3])]
    (saved0, peak0), (saved1, peak1) = rank_memory(stages, schedule="interleaved-1f1b", num_stages=2,
                                                   num_microbatches=8)
    assert saved0 == (3 + 2) * 4 * mib and peak0 == (16 + 12) * mib + saved0 + 2 * mib
    assert saved1 == 2 * 4 * mib + 1 * 5 * mib and peak1 == (12 + 16) * mib + saved1
    # Zero-bubble: each chunk at its priced in-flight count.
    zb = [_cost(param=mib, saved=mib, in_flight=8) for _ in range(4)]
    assert rank_memory(zb, schedule="zero-bubble", num_stages=2, num_microbatches=8) == [(16 * mib, 18 * mib)] * 2
