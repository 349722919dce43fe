"""`make demo` at reduced size (2 of its 4 layers, 3 steps, sequence 32): 4 gloo processes, the
Booster's (2, 2) plan with ZeRO under the demo's budget, the first-loss check, training.

Also: the first-loss check fails loudly when the losses differ, and the script runs as the ranks
of a real ``torchrun`` job (the path documented for GPUs; gloo here).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from autopar.cli import demo
from autopar.runtime.launch import run_local

pytestmark = pytest.mark.slow


def test_demo_trains_and_first_loss_matches_single_process(capfd):
    result = demo.main(["--steps", "3", "--seq", "32", "--layers", "2"])
    out = capfd.readouterr().out
    assert result["mesh"] == (2, 2)
    assert result["reference_loss"] is not None
    assert abs(result["first_loss"] - result["reference_loss"]) <= demo.RTOL_CPU * result["reference_loss"]
    losses = result["losses"]
    assert len(losses) == 3 and all(a > b for a, b in zip(losses, losses[1:])), losses
    # No rank holds the whole model: (2, 2) shards the big matrices.
    assert result["local_parameter_bytes"] < 0.75 * result["full_parameter_bytes"]
    # The budget (halfway between the peaks without ZeRO and with ZeRO-2 everywhere) makes
    # zero_stage="auto" shard some optimizer state, and rank 0 really holds less of it (measured
    # after the steps).
    assert result["zero2_peak_bytes"] < result["budget_bytes"] < result["no_zero_peak_bytes"]
    assert result["zero_stages"].get(0, 0) > 0 and sum(n for s, n in result["zero_stages"].items() if s) > 0, \
        result["zero_stages"]
    assert result["state_bytes"] == result["planned_state_bytes"] < result["no_zero_state_bytes"]
    assert result["lrs"][0] < result["lrs"][2] == pytest.approx(demo.LR)  # the warm-up schedule drove the steps
    for text in ("plan for LossOnly on mesh cpu:2x2", "first loss: sharded", "time per step: median",
                 "communication in the emitted graph:", "grad_bucket", "memory budget", "ZeRO stage 0:",
                 "AdamW state per rank (rank 0):"):
        assert text in out, text
    zero_line = next(line for line in out.splitlines() if line.strip().startswith("ZeRO stage 2:")
                     or line.strip().startswith("ZeRO stage 1:"))
    assert "e.g. transformer." in zero_line, zero_line


def test_first_loss_check_fails_loudly(monkeypatch):
    real = demo._reference_loss

    def off_by_one_percent(*args, **kwargs):
        value = real(*args, **kwargs)
        return None if value is None else value * 1.01

    monkeypatch.setattr(demo, "_reference_loss", off_by_one_percent)  # forked ranks inherit it
    with pytest.raises(RuntimeError, match="FirstLossMismatch"):
        run_local(demo.train, 2, steps=1, batch=2, seq=16, memory_budget=None, layers=2)  # no budget plans: faster


# A second training run, launched by torchrun (19 s): with the whole sweeps; the demo's own run stays.
@pytest.mark.full_sweep
def test_runs_under_torchrun():
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    assert torchrun is not None, "torchrun ships with torch"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "autopar.cli.demo",
                           "--steps", "3", "--batch", "4", "--seq", "16", "--memory-budget", "200MiB"],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 ranks (gloo, cpu), mesh (2,)" in proc.stdout
    for text in ("first loss: sharded", "time per step: median", "memory budget 200MiB per device",
                 "budget 0.20 GiB", "ZeRO stage 0:", "AdamW state per rank"):
        assert text in proc.stdout, text
