"""benchmarks/_measure.py's memory definition: bytes saved for backward exclude the parameters'
storage however the runtime reaches it (a ``DTensor.to_local()`` is a non-leaf view of it)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))


def _saved(weight, params):
    from _measure import SavedBytes  # benchmarks/_measure.py

    x = torch.randn(8, 16, requires_grad=True)
    saved = SavedBytes(params)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        # A view of the parameter, as a DTensor parameter's local tensor is; tanh saves its output.
        loss = torch.tanh(x @ weight.view(16, 4)).sum()
    loss.backward()
    return saved.peak


def test_saved_bytes_skip_views_of_parameters_but_count_activations():
    weight = torch.nn.Parameter(torch.randn(16, 4))
    # matmul saves x (a leaf that requires grad: skipped as an input like a parameter) and the
    # weight's view; tanh saves its (8, 4) output: 128 bytes.
    assert _saved(weight, [weight]) == 8 * 4 * 4
    assert _saved(weight, []) == 8 * 4 * 4 + 16 * 4 * 4  # without the parameters named: counted


def test_state_bytes_count_each_storage_once_and_zero_gradient_pieces():
    from types import SimpleNamespace

    from _measure import state_bytes  # benchmarks/_measure.py

    weight = torch.nn.Parameter(torch.zeros(64, 4))  # 1 KiB
    weight.grad = torch.zeros(64, 4)
    state = {weight: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(64, 4), "exp_avg_sq": torch.zeros(64, 4)}}
    # A ZeRO-1 piece's gradient is a view of the parameter's gradient (no bytes of its own); a
    # ZeRO-2 piece's is its own reduce-scattered tensor.
    stage1 = SimpleNamespace(master=SimpleNamespace(grad=weight.grad[:32]))
    stage2 = SimpleNamespace(master=SimpleNamespace(grad=torch.zeros(32, 4)))
    plain = SimpleNamespace(state=state)
    assert state_bytes([weight], plain) == 4 * 1024  # parameter, gradient, two moments
    assert state_bytes([weight], SimpleNamespace(state=state, pieces=[stage1])) == 4 * 1024
    assert state_bytes([weight], SimpleNamespace(state=state, pieces=[stage2])) == 4 * 1024 + 512
    # The booster's optimizer holds its ZeroOptimizer as ``zero``: the pieces are counted through it.
    boosted = SimpleNamespace(state=state, zero=SimpleNamespace(state=state, pieces=[stage2]))
    assert state_bytes([weight], boosted) == 4 * 1024 + 512


def test_fidelity_and_plugins_take_the_load_of_each_round_out():
    from _measure import round_normalized  # benchmarks/_measure.py, what fidelity.py and plugins.py report

    # Round 2 ran at twice the load: every plan twice as slow. The ratio between plans holds.
    times = {"a": [1.0, 2.0, 1.0], "b": [2.0, 4.0, 2.0], "c": [4.0, 8.0, 4.0]}
    got = round_normalized(times)
    assert got == pytest.approx({"a": 1.0, "b": 2.0, "c": 4.0})
    # A plan that drew a loaded round alone does not pass a faster one.
    got = round_normalized({"fast": [1.0, 1.0, 3.0], "slow": [1.5, 1.5, 1.5]})
    assert got["fast"] < got["slow"]


def test_fidelity_summary_judges_the_choice_by_measured_bytes(capsys):
    from types import SimpleNamespace

    import fidelity  # benchmarks/fidelity.py

    mib = 2**20
    cands = [fidelity.Candidate("auto", 1.0, 100 * mib), fidelity.Candidate("auto@60%", 1.2, 60 * mib, budget=60 * mib),
             fidelity.Candidate("data-parallel", 1.0, 100 * mib), fidelity.Candidate("pipeline-2", 0.8, 40 * mib)]
    # The pipeline's estimate says 40 MiB, but it measured 80: it does not fit the 60 MiB budget.
    steps = {"auto": 1.0, "auto@60%": 1.3, "data-parallel": 1.1, "pipeline-2": 0.9}
    mem = {"auto": 100, "auto@60%": 59, "data-parallel": 100, "pipeline-2": 80}
    rank = {"times": {n: [t] * 3 for n, t in steps.items()}, "device": "cuda:0",
            "memory": {n: {"saved": 0, "state": b * mib, "allocated": (b + 10) * mib} for n, b in mem.items()}}
    record = fidelity.summarize("toy", SimpleNamespace(shape=(2,)), cands, [rank, rank])
    assert record["choice_ratio"]["auto@60%"] == pytest.approx(1.0)  # the only plan that fits
    assert record["choice_ratio"]["auto"] == pytest.approx(1.0 / 0.9)  # the pipeline fits an ample budget
    assert record["allocated_bytes"]["auto"] == 110 * mib and record["device"] == "cuda:0"
    out = capsys.readouterr().out
    assert "alloc MiB" in out and "on cuda:0" in out


def test_fidelity_judges_a_global_statistics_choice_against_its_like():
    from types import SimpleNamespace

    import fidelity  # benchmarks/fidelity.py

    mib = 2**20
    cands = [fidelity.Candidate("auto", 1.0, mib), fidelity.Candidate("data-parallel", 1.2, mib),
             fidelity.Candidate("auto-per-rank", 0.9, mib, per_rank_stats=True),
             fidelity.Candidate("torch-ddp", 0.9, mib, engine="ddp", per_rank_stats=True)]
    steps = {"auto": 1.1, "data-parallel": 1.2, "auto-per-rank": 1.0, "torch-ddp": 0.8}
    rank = {"times": {n: [t] * 3 for n, t in steps.items()}, "device": "cpu",
            "memory": {n: {"saved": 0, "state": mib, "allocated": None} for n in steps}}
    record = fidelity.summarize("cnn", SimpleNamespace(shape=(2,)), cands, [rank])
    # DDP normalises each rank's share of the batch: not the global plan's competitor, the per-rank one's.
    assert record["choice_ratio"]["auto"] == pytest.approx(1.0)
    assert record["choice_ratio"]["auto-per-rank"] == pytest.approx(1.0 / 0.8)


def test_fidelity_prices_torch_engines_on_a_batch_norm_model_with_per_rank_statistics():
    import fidelity  # benchmarks/fidelity.py
    from _measure import build_model

    import autopar

    model, inputs = build_model("cnn", batch=8)
    mesh = autopar.MeshSpec.preset("cpu", (2,))
    cands = {c.name: c for c in fidelity.candidates(model, inputs, mesh=mesh, only=frozenset(
        {"data-parallel", "data-parallel-per-rank", "torch-ddp"}))}
    assert set(cands) == {"data-parallel", "data-parallel-per-rank", "torch-ddp"}
    assert cands["torch-ddp"].per_rank_stats and cands["data-parallel-per-rank"].per_rank_stats
    assert cands["torch-ddp"].estimate_s == cands["data-parallel-per-rank"].estimate_s
    # The global plan's batch norms sum statistics over the ranks; the per-rank one's do not.
    assert cands["data-parallel"].estimate_s > cands["data-parallel-per-rank"].estimate_s
