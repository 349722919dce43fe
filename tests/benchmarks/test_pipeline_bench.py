"""Smoke run of ``benchmarks/pipeline.py`` at toy size (2 ranks, 1 step, 1f1b): the mesh profile,
the plan, autopar's pipeline and the hand-written ``torch.distributed.pipelining`` split all run,
and their losses equal the single-device loss. Timings are not checked (benchmarks hold numbers)."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks import load_script


@pytest.mark.full_sweep  # a benchmark run end to end (its planning half: test_pipeline_plan_prunes_...)
def test_pipeline_benchmark_runs_and_losses_agree(tmp_path, capsys):
    bench = load_script("pipeline")
    out = tmp_path / "pipeline.jsonl"
    record = bench.main(["--hidden", "64", "--layers", "4", "--heads", "2", "--vocab", "128", "--seq", "16",
                         "--batch", "8", "--microbatches", "4", "--schedules", "1f1b", "--world", "2",
                         "--steps", "1", "--warmup", "0", "--profile-sizes", "1048576,4194304",
                         "--profile-repeats", "3", "--timeout", "120", "--out", str(out)])
    row = record["rows"]["1f1b"]
    assert row["losses_agree"], row["loss"]
    assert row["autopar_s"] > 0 and row["hand_s"] > 0 and row["estimate_s"] > 0
    assert len(row["cut"]) == 2 and row["cut"][0][0] == 0 and row["cut"][-1][1] == 4
    assert out.read_text().count("\n") == 1
    assert "autopar/hand" in capsys.readouterr().out


def test_pipeline_benchmark_refuses_bad_arguments():
    bench = load_script("pipeline")
    with pytest.raises(ValueError, match="--schedules takes gpipe and/or 1f1b"):
        bench.main(["--schedules", "zero-bubble"])
    with pytest.raises(ValueError, match="--microbatches 3 does not divide --batch 16"):
        bench.main(["--microbatches", "3"])


def test_pipeline_plan_configs_scale_the_batch_with_the_devices():
    """Megatron's space per case: B = N sequences, M = B / (b DP) >= PP, PP <= N / 8."""
    bench = load_script("pipeline_plan")
    found = bench.configs(64, [2, 4, 8, 16], batch=64, micro_sizes=(1, 2))
    assert (16, 1, 16) not in found and all(pp <= 8 for pp, _, _ in found)  # 64 devices: 8 nodes
    for pp, tp, m in found:
        dp = 64 // (pp * tp)
        assert m >= pp and 64 % m == 0 and (64 // m) % dp == 0 and 64 // (m * dp) in (1, 2)
    assert (2, 1, 2) in found and (2, 1, 1) not in found  # b = 2 would leave M = 1 < PP
    assert (4, 8, 32) in found and (4, 8, 16) in found
    assert len(found) == 21


# Plans and runs a configuration end to end (17 s): with the whole sweeps; the floors' pruning test stays.
@pytest.mark.full_sweep
def test_pipeline_plan_runs_one_configuration_and_autopar_is_not_slower(tmp_path, capsys):
    bench = load_script("pipeline_plan")
    out = tmp_path / "plan.jsonl"
    code = bench.main(["--models", "llama-70b", "--layers", "4", "--devices", "64", "--pp", "2", "--tp", "8",
                       "--micro-sizes", "2", "--seq", "128", "--schedules", "1f1b", "--jsonl", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert code == 0 and [r["who"] for r in rows] == ["autopar", "megatron"]
    assert all(r["batch"] == 64 and (r["pp"], r["tp"], r["microbatches"]) == (2, 8, 8) for r in rows)
    assert rows[0]["step_s"] <= rows[1]["step_s"] * (1 + 1e-3)
    printed = capsys.readouterr().out
    assert "speed-up over the best Megatron-style configuration" in printed and "SLOWER" not in printed


def test_pipeline_plan_prunes_configurations_by_their_floors(tmp_path, monkeypatch):
    """Configurations are searched lowest floor first; one whose floor cannot beat the best step
    is reported as pruned (no step), and ``--exhaustive`` finds the same best step."""
    bench = load_script("pipeline_plan")
    # The two runs trace the same 4 micro-batch graphs: the exhaustive run reuses the pruned run's
    # traces and profiles (pure functions of the model shape and the inputs; half the test's time).
    real_trace, real_profile = bench.trace, bench.profile
    memo: dict = {}

    def trace_once(model, inputs, **kwargs):
        key = (type(model).__name__, tuple(inputs["input_ids"].shape))
        if key not in memo:
            memo[key] = (traced := real_trace(model, inputs, **kwargs)), real_profile(traced)
        return memo[key][0]

    monkeypatch.setattr(bench, "trace", trace_once)
    monkeypatch.setattr(bench, "profile", lambda traced: next(p for t, p in memo.values() if t is traced))
    args = ["--models", "gpt3-175b", "--layers", "4", "--devices", "64", "--pp", "2", "4", "--tp", "2", "8",
            "--micro-sizes", "1", "--seq", "128", "--schedules", "1f1b"]
    runs = {}
    for mode in ("pruned", "exhaustive"):
        out = tmp_path / f"{mode}.jsonl"
        assert bench.main(args + ["--jsonl", str(out)] + (["--exhaustive"] if mode == "exhaustive" else [])) == 0
        runs[mode] = [r for r in map(json.loads, out.read_text().splitlines()) if r["who"] == "autopar"]
    for mode, rows in runs.items():
        assert len(rows) == 4 and all(r["floor"] is not None and r["floor"] > 0 for r in rows), mode
        for r in rows:
            if r["step_s"] is not None:
                assert r["floor"] <= r["step_s"] * (1 + 1e-9), r
    best = {mode: min(r["step_s"] for r in rows if r["step_s"] is not None) for mode, rows in runs.items()}
    assert best["pruned"] == pytest.approx(best["exhaustive"], rel=1e-9)
    pruned = [r for r in runs["pruned"] if r["note"].startswith("pruned")]
    assert pruned and all(r["step_s"] is None and r["floor"] >= best["pruned"] for r in pruned)
    assert not any(r["note"].startswith("pruned") for r in runs["exhaustive"])
