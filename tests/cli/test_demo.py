"""`make demo` at reduced size: 4 gloo processes, the (2, 2) plan, the first-loss check, training.

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
    result = demo.main(["--steps", "4", "--seq", "32"])
    out = capfd.readouterr().out
    assert result["mesh"] == (2, 2)
    assert result["reference_loss"] is not None
    assert abs(result["first_loss"] - result["reference_loss"]) <= demo.RTOL_CPU * result["reference_loss"]
    losses = result["losses"]
    assert len(losses) == 4 and all(a > b for a, b in zip(losses, losses[1:])), losses
    # No rank holds the whole model: (2, 2) shards the big matrices.
    assert result["local_parameter_bytes"] < 0.75 * result["full_parameter_bytes"]
    for text in ("plan for LossOnly on mesh cpu:2x2", "first loss: sharded", "time per step: median",
                 "communication in the emitted graph:", "grad_bucket"):
        assert text in out, text


def test_first_loss_check_fails_loudly(monkeypatch):
    real = demo._reference_loss

    def off_by_one_percent(*args, **kwargs):
        value = real(*args, **kwargs)
        return None if value is None else value * 1.01

    monkeypatch.setattr(demo, "_reference_loss", off_by_one_percent)  # forked ranks inherit it
    with pytest.raises(RuntimeError, match="FirstLossMismatch"):
        run_local(demo.train, 2, steps=1, batch=2, seq=16)


def test_runs_under_torchrun():
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    assert torchrun is not None, "torchrun ships with torch"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "autopar.cli.demo",
                           "--steps", "3", "--batch", "4", "--seq", "16"],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 ranks (gloo, cpu), mesh (2,)" in proc.stdout
    assert "first loss: sharded" in proc.stdout and "time per step: median" in proc.stdout
