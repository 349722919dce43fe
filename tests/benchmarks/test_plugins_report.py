"""benchmarks/plugins.py's table: on a batch-norm model torch's engines are marked as training with
per-rank batch statistics, and the auto plan is also set against the fastest configuration that
keeps the global batch's statistics."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))


def _results(times: dict[str, float]) -> list[dict]:
    return [{"times": {n: [t] * 3 for n, t in times.items()}, "memory": {n: 10 * 2**20 for n in times},
             "allocated": {n: None for n in times}, "estimate": {n: (t, 10 * 2**20) for n, t in times.items()},
             "refused": {}, "chosen": {"auto": "2x2"}, "device": "cpu"}]


def test_per_rank_statistics_are_marked_and_compared_apart(capsys):
    import plugins  # benchmarks/plugins.py

    cnn = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    assert plugins.trains_batch_norm(cnn) and not plugins.trains_batch_norm(cnn.eval())
    record = plugins.report("cnn", "ample", None, _results({"torch-ddp": 0.100, "zero1": 0.200, "auto": 0.110}), {},
                            per_rank=plugins.PER_RANK_STATISTICS)
    out = capsys.readouterr().out
    assert abs(record["auto_ratio"] - 1.1) < 1e-9  # the target's ratio counts torch DDP all the same
    ddp_row = next(line for line in out.splitlines() if line.startswith("torch-ddp"))
    assert ddp_row.endswith("per-rank batch statistics")
    assert "auto / fastest fitting with the global batch's statistics, as one device (zero1) = 0.550" in out
