"""Calibration's pipeline stage (``runtime/calibrate_pipeline.py``) on real gloo ranks: torch's 1F1B
over trivial stages, timed at two micro-batch counts, gives a positive per-micro-batch time, and
the action's overhead is that time less the transfers, per action."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from autopar.runtime.calibrate_pipeline import measure_pipeline_action, pipeline_bytes, split_microbatch
from autopar.runtime.launch import run_local


def _measure(rank, world):
    return measure_pipeline_action(dist.group.WORLD, repeats=5, device=torch.device("cpu"))


def _alone(rank, world):
    try:
        measure_pipeline_action(dist.group.WORLD, repeats=1, device=torch.device("cpu"))
    except ValueError as exc:
        return str(exc)
    return None


def test_two_ranks_measure_a_positive_action_overhead():
    results = run_local(_measure, 2, timeout=60)
    assert results[0] == results[1]  # every rank gets the slowest rank's medians
    per_microbatch, parts = results[0]
    assert (parts["m_lo"], parts["m_hi"]) == (2.0, 8.0) and 0 < parts["lo"] < parts["hi"]
    assert per_microbatch == pytest.approx((parts["hi"] - parts["lo"]) / 6)
    # gloo on this host: ~4 ms per micro-batch (two actions and their transfers), well under 50 ms
    assert 1e-5 < per_microbatch < 0.05
    # priced against the cpu preset's transfer (2 x 200 us), what remains is each action's share
    p2p = 2 * (200e-6 + pipeline_bytes() / 1e9)
    transfer, action = split_microbatch(per_microbatch, alpha=200e-6, beta=1e-9)
    assert transfer is None and action > 0 and action == pytest.approx((per_microbatch - p2p) / 2)


def test_a_micro_batch_is_read_apart_into_transfers_and_actions_summing_to_what_it_took():
    beta, nbytes = 1e-9, pipeline_bytes()
    assert nbytes == 2 * 16 * 4
    # Above the links' price of its two transfers: they keep the links' alpha, the rest is the actions'.
    transfer, action = split_microbatch(3e-3, alpha=0.5e-3, beta=beta)
    assert transfer is None and action == pytest.approx((3e-3 - 2 * (0.5e-3 + beta * nbytes)) / 2)
    # Below it (the 4-rank fit's alpha on a shared host): no action overhead, and each transfer's
    # latency is half the micro-batch less its bytes, so the two price it at what it took.
    transfer, action = split_microbatch(3.4e-3, alpha=3.2e-3, beta=beta)
    assert action == 0.0 and transfer == pytest.approx(1.7e-3 - beta * nbytes)
    assert 2 * (transfer + beta * nbytes) == pytest.approx(3.4e-3)
    # never a negative latency
    assert split_microbatch(0.0, alpha=1e-3, beta=beta) == (0.0, 0.0)


def test_one_rank_is_no_pipeline():
    assert "a pipeline needs 2 stages or more" in run_local(_alone, 1, timeout=60)[0]
