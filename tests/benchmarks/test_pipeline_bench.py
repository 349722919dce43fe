"""Smoke run of ``benchmarks/pipeline.py`` at toy size (2 ranks, 1 step, 1f1b): the mesh profile,
the plan, autopar's pipeline and the hand-written ``torch.distributed.pipelining`` split all run,
and their losses equal the single-device loss. Timings are not checked (benchmarks hold numbers)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "pipeline.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_pipeline", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pipeline_benchmark_runs_and_losses_agree(tmp_path, capsys):
    bench = _load()
    out = tmp_path / "pipeline.jsonl"
    record = bench.main(["--hidden", "64", "--layers", "4", "--heads", "2", "--vocab", "128", "--seq", "16",
                         "--batch", "8", "--microbatches", "4", "--schedules", "1f1b", "--world", "2",
                         "--steps", "1", "--warmup", "0", "--profile-sizes", "65536,262144",
                         "--profile-repeats", "1", "--timeout", "120", "--out", str(out)])
    row = record["rows"]["1f1b"]
    assert row["losses_agree"], row["loss"]
    assert row["autopar_s"] > 0 and row["hand_s"] > 0 and row["estimate_s"] > 0
    assert len(row["cut"]) == 2 and row["cut"][0][0] == 0 and row["cut"][-1][1] == 4
    assert out.read_text().count("\n") == 1
    assert "autopar/hand" in capsys.readouterr().out


def test_pipeline_benchmark_refuses_bad_arguments():
    bench = _load()
    with pytest.raises(ValueError, match="--schedules takes gpipe and/or 1f1b"):
        bench.main(["--schedules", "zero-bubble"])
    with pytest.raises(ValueError, match="--microbatches 3 does not divide --batch 16"):
        bench.main(["--microbatches", "3"])
