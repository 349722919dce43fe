"""benchmarks/runtime.py runs end to end on a small GPT-2 (the figures themselves are quoted in the
README, not asserted: speed is measured in benchmarks, not timed in tests)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

pytestmark = pytest.mark.slow


def test_runtime_benchmark_times_autopar_plain_megatron_and_ddp(capsys):
    import runtime  # benchmarks/runtime.py

    record = runtime.main(["--hidden", "64", "--layers", "1", "--heads", "2", "--seq", "32", "--batch", "4",
                           "--steps", "2", "--warmup", "1"])
    out = capsys.readouterr().out
    assert set(record["median_s"]) == {"autopar", "plain", "megatron", "ddp", "zero2", "fsdp2"}
    # The same graph and weights: DTensor parameters and plain tensors compute the same loss.
    assert record["first_loss"]["autopar"] == record["first_loss"]["plain"]
    assert abs(record["first_loss"]["zero2"] - record["first_loss"]["fsdp2"]) < 1e-4
    assert "ZeRO-2: autopar zero2 / fsdp2 = " in out
    assert "DTensor parameters: autopar / plain = " in out and "optimizer: AdamW(foreach)" in out
    assert record["dtensor_ratio"] > 0


def test_runtime_benchmark_forced_data_parallel_plan(capsys):
    import runtime  # benchmarks/runtime.py

    record = runtime.main(["--hidden", "64", "--layers", "1", "--heads", "2", "--seq", "32", "--batch", "4",
                           "--steps", "2", "--warmup", "1", "--plan", "data-parallel"])
    out = capsys.readouterr().out
    # The data-parallel family: batch splits, replicas' gradients all-reduced (bucketed), no
    # tensor-parallel collective (an all-gather of the batch-split logits before a replicated
    # loss, where the shifted labels are replicated, is the family's own resharding).
    comm = out.split("autopar graph communication:")[1].split(";")[0]
    assert "grad_bucket" in comm, comm
    for kind in ("reduce_scatter", "all_to_all"):
        assert kind not in comm, comm
    assert abs(record["first_loss"]["autopar"] - record["first_loss"]["ddp"]) < 1e-4
    assert record["first_loss"]["autopar"] == record["first_loss"]["plain"]
