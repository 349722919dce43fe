"""The simulated pipeline schedule: the formula's step time for equal stages, and a valid run."""

from __future__ import annotations

import itertools
import random

import pytest

from autopar.planner.pipeline.schedule import SPLIT_BACKWARD, step_time
from autopar.planner.pipeline.timeline import rank_order, simulate

CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("zero-bubble", 2)]


@pytest.mark.parametrize("schedule,virtual", CASES)
def test_equal_stages_take_the_formula_time(schedule, virtual):
    """With equal stage times and at least as many micro-batches as ranks, the simulation and
    ``pipeline.schedule.step_time`` agree exactly (the bubble formulas are about this case)."""
    for ranks, micro in itertools.product((2, 3, 4), (4, 6, 8)):
        if micro < ranks:
            continue
        k = ranks * virtual
        times, syncs = [1.5] * k, [0.25] * k
        got = simulate(schedule, times=times, syncs=syncs, num_ranks=ranks, virtual_stages=virtual,
                       num_microbatches=micro).step_s
        want = step_time(schedule, times=times, syncs=syncs, num_stages=ranks, virtual_stages=virtual,
                         num_microbatches=micro)
        assert got == pytest.approx(want, rel=1e-12), (schedule, virtual, ranks, micro)


def _check_valid(tl, *, schedule, ranks, virtual, micro, times):
    k = ranks * virtual
    passes = [p for p in tl.passes if p.kind != "S"]
    kinds = "FBW" if schedule == "zero-bubble" else "FB"
    keys = [(p.kind, p.stage, p.micro) for p in passes]
    assert sorted(keys) == sorted((c, s, m) for c in kinds for s in range(k) for m in range(micro))
    end = {(p.kind, p.stage, p.micro): p.end for p in passes}
    for p in passes:
        assert p.rank == p.stage % ranks
        dep = {"F": ("F", p.stage - 1, p.micro) if p.stage else None,
               "B": ("F", p.stage, p.micro) if p.stage == k - 1 else ("B", p.stage + 1, p.micro),
               "W": ("B", p.stage, p.micro)}[p.kind]
        assert dep is None or end[dep] <= p.start + 1e-12, (p, dep)
        share = 2 / 3 if p.kind == "B" and schedule != "zero-bubble" else 1 / 3
        split = 1 + SPLIT_BACKWARD.get(schedule, 0.0)  # the split backward's two autograd calls
        assert p.end - p.start == pytest.approx(times[p.stage] * share * split)
    for r in range(ranks):  # a rank runs one pass at a time
        mine = sorted((p.start, p.end) for p in tl.passes if p.rank == r)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(mine, mine[1:]))


@pytest.mark.parametrize("schedule,virtual", CASES)
def test_unequal_stages_run_validly_and_within_the_formula(schedule, virtual):
    rng = random.Random(7)
    for ranks, micro in ((2, 4), (4, 8), (3, 6)):
        k = ranks * virtual
        times = [rng.uniform(0.5, 2.0) for _ in range(k)]
        tl = simulate(schedule, times=times, num_ranks=ranks, virtual_stages=virtual, num_microbatches=micro)
        _check_valid(tl, schedule=schedule, ranks=ranks, virtual=virtual, micro=micro, times=times)
        bound = step_time(schedule, times=times, syncs=[0.0] * k, num_stages=ranks, virtual_stages=virtual,
                          num_microbatches=micro)
        # the formula charges every stage the slowest one's time: never below the simulation
        assert tl.step_s <= bound + 1e-12
        # and no rank can finish before doing its own work
        split = 1 + SPLIT_BACKWARD.get(schedule, 0.0)
        assert tl.step_s >= max(micro * sum(times[s] for s in range(r, k, ranks)) for r in range(ranks)) * split - 1e-12


def test_orders_are_torchs():
    # 1F1B on the first of 4 ranks with 8 micro-batches: 3 warm-up forwards, then alternating
    assert rank_order("1f1b", rank=0, num_ranks=4, virtual_stages=1, num_microbatches=8)[:6] == [
        ("F", 0, 0), ("F", 0, 1), ("F", 0, 2), ("F", 0, 3), ("B", 0, 0), ("F", 0, 4)]
    # interleaved, 2 ranks x 2 chunks, 4 micro-batches, rank 1: chunk 0 then chunk 1 per round of
    # 2, warm-up (2 - 1) * 2 = 2 forwards
    assert rank_order("interleaved-1f1b", rank=1, num_ranks=2, virtual_stages=2, num_microbatches=4)[:5] == [
        ("F", 1, 0), ("F", 1, 1), ("F", 3, 0), ("B", 3, 0), ("F", 3, 1)]


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="need 4 stage times"):
        simulate("1f1b", times=[1.0] * 3, num_ranks=4, virtual_stages=1, num_microbatches=4)
    with pytest.raises(ValueError, match="one stage per rank"):
        simulate("1f1b", times=[1.0] * 4, num_ranks=2, virtual_stages=2, num_microbatches=4)
    with pytest.raises(ValueError, match="multiple of its number of rounds"):
        simulate("interleaved-1f1b", times=[1.0] * 4, num_ranks=2, virtual_stages=2, num_microbatches=5)
    with pytest.raises(ValueError, match="not one of"):
        simulate("dualpipe", times=[1.0] * 2, num_ranks=2, virtual_stages=1, num_microbatches=2)


def test_candidate_lines_say_which_figure_they_show():
    """The chosen candidate shows its assembled plan's estimate, the others the stage search's
    objective (which can be lower): each line says which."""
    from autopar.planner.pipeline.schedule import PipelineCandidate

    searched = PipelineCandidate(8, "1f1b", 1, 0.011885, "recompute in stages [1]")
    assert str(searched) == "1f1b x1, 8 micro-batches: 11.885 ms/step (stage search), recompute in stages [1]"
    chosen = PipelineCandidate(4, "gpipe", 1, 0.012038, assembled=True)
    assert str(chosen) == "gpipe x1, 4 micro-batches: 12.038 ms/step (plan)"
    assert str(PipelineCandidate(4, "gpipe", 1, None, "no cut fits no budget")).endswith("no cut fits no budget")
