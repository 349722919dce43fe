"""benchmarks/plugins.py's table: on a batch-norm model torch's engines are marked as training with
per-rank batch statistics, and the target is taken like for like: the auto plan (global
statistics) against the fastest configuration that keeps the global batch's statistics, the auto
plan with per-rank statistics (``batch_norm_stats="per_rank"``) against every configuration."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))


def _results(times: dict[str, float], signature: dict[str, str] | None = None) -> list[dict]:
    return [{"times": {n: [t] * 3 for n, t in times.items()}, "memory": {n: 10 * 2**20 for n in times},
             "allocated": {n: None for n in times}, "estimate": {n: (t, 10 * 2**20) for n, t in times.items()},
             "refused": {}, "chosen": {"auto": "2x2"}, "signature": signature or {}, "device": "cpu"}]


def test_per_rank_statistics_are_marked_and_compared_like_for_like(capsys):
    import plugins  # benchmarks/plugins.py

    cnn = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    assert plugins.trains_batch_norm(cnn) and not plugins.trains_batch_norm(cnn.eval())
    made = plugins.configs({"ample": None, "tight": 2**20}, profiles=[(4,), (2, 2)], batch_norm=True)
    assert made["auto-per-rank@tight"]().batch_norm_stats == "per_rank" and made["auto"]().batch_norm_stats == "global"
    assert "auto-per-rank" not in plugins.configs({"ample": None}, profiles=[(4,), (2, 2)])
    times = {"torch-ddp": 0.100, "zero1": 0.200, "auto": 0.110, "auto-per-rank": 0.104, "auto-per-rank@tight": 0.3}
    record = plugins.report("cnn", "ample", None, _results(times), {}, per_rank=plugins.PER_RANK_STATISTICS)
    out = capsys.readouterr().out
    assert abs(record["auto_ratio"] - 0.55) < 1e-9  # against zero1: DDP's statistics are another training
    assert abs(record["per_rank_ratio"] - 1.04) < 1e-9  # against torch DDP, like for like
    rows = {line.split()[0]: line for line in out.splitlines()  # the table's rows: a name, then figures
            if len(line.split()) > 1 and line.split()[0] in times and line.split()[1][0].isdigit()}
    assert rows["torch-ddp"].endswith("per-rank batch statistics")
    assert rows["auto-per-rank"].endswith("per-rank batch statistics") and "auto-per-rank@tight" not in rows
    assert not rows["auto"].endswith("statistics")
    assert "auto / fastest fitting with the global batch's statistics (zero1) = 0.550 (target <= 1.05: met)" in out
    assert "auto-per-rank / fastest fitting (torch-ddp) = 1.040 (target <= 1.05: met)" in out
    assert "auto / fastest fitting of all (torch-ddp, per-rank statistics) = 1.100" in out


def test_without_batch_norm_the_target_counts_every_configuration(capsys):
    import plugins

    record = plugins.report("gpt2", "ample", None, _results({"torch-ddp": 0.100, "zero1": 0.200, "auto": 0.110}), {})
    assert abs(record["auto_ratio"] - 1.1) < 1e-9 and record["per_rank_ratio"] is None
    assert "auto / fastest fitting (torch-ddp) = 1.100 (target <= 1.05: MISSED)" in capsys.readouterr().out


def test_a_configuration_running_the_auto_plan_is_its_twin_not_its_target(capsys):
    """pp2 and the auto plan were one program (same signature) measured 6% apart in one run: the
    target is the fastest configuration running another plan, and the twins' spread is printed."""
    import plugins

    times = {"torch-ddp": 0.2695, "pp2": 0.2579, "zero1": 0.3045, "auto": 0.2743}
    signature = {"torch-ddp": None, "pp2": "pipeline", "zero1": "zero1", "auto": "pipeline"}
    record = plugins.report("gpt2", "ample", None, _results(times, signature), {})
    out = capsys.readouterr().out
    assert "auto runs the same plan as pp2: measured 274.3, 257.9 ms" in out
    assert "auto / fastest fitting with another plan (torch-ddp) = 1.018 (target <= 1.05: met)" in out
    assert abs(record["auto_ratio"] - 0.2743 / 0.2695) < 1e-9 and "fastest fitting of all" not in out
    record = plugins.report("gpt2", "ample", None, _results({"pp2": 0.25, "auto": 0.26},
                                                             {"pp2": "p", "auto": "p"}), {})
    assert record["auto_ratio"] is None and "every fitting configuration runs auto's plan" in capsys.readouterr().out
