"""Calibration's pipeline stage (``runtime/calibrate_pipeline.py``) on real gloo ranks: torch's 1F1B
over trivial stages, timed at two micro-batch counts, gives a positive per-micro-batch time, and
the action's overhead is that time less the transfers, per action."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from autopar.runtime.calibrate_pipeline import action_seconds, measure_pipeline_action, pipeline_bytes
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
    action = action_seconds(per_microbatch, p2p_s=p2p)
    assert action > 0 and action == pytest.approx((per_microbatch - p2p) / 2)


def test_the_action_is_what_the_transfers_leave_never_negative():
    assert action_seconds(3e-3, p2p_s=1e-3) == pytest.approx(1e-3)
    assert action_seconds(1e-3, p2p_s=2e-3) == 0.0
    assert pipeline_bytes() == 2 * 16 * 4


def test_one_rank_is_no_pipeline():
    assert "a pipeline needs 2 stages or more" in run_local(_alone, 1, timeout=60)[0]
