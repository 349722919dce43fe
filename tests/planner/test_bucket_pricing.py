"""Gradient sums priced as the runtime issues them: a parameter's sum that ``runtime.bucketing``
packs into a bucket pays its bandwidth and its share of the bucket's one latency
(``layout.cost.collective_seconds(bucket_cap=)``); the other sums pay a latency each."""

from dataclasses import replace

import pytest
import torch
from torch import nn

from autopar.layout import buckets
from autopar.layout.cost import collective_seconds
from autopar.layout.mesh import MeshSpec
from autopar.planner.assemble import baseline_problem
from autopar.planner.builder import build_problem
from autopar.planner.executed import grad_syncs
from autopar.strategies.grad_sums import grad_sync_seconds
from autopar.solver.driver import solve
from autopar.tracer import profile, trace

ALPHA, BETA = 5e-3, 1 / 1e9  # a gloo-like calibration: latency dominates small sums
# No overlap: the objective is the plain sum, so the sums' prices read off it exactly.
MESH = replace(MeshSpec.preset("cpu", (2,)), alpha=(ALPHA,), beta=(BETA,), comm_overlap=0.0)
CAP = 25 * 2**20


class Mlp(nn.Module):
    def __init__(self, d: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.sum()


def _built(mesh: MeshSpec = MESH, *, bucket_cap: int | None = None, d: int = 256, layers: int = 6,
           batch: int = 4096):
    with torch.device("meta"):
        model = Mlp(d, layers)
    traced = trace(model, (torch.empty(batch, d, device="meta"),))
    return traced, build_problem(traced, profile(traced), mesh, budget_bytes=None, bucket_cap=bucket_cap)


def test_small_sums_in_one_bucket_pay_one_latency():
    sizes = [CAP // 8] * 8  # eight parameters filling one bucket exactly
    total = sum(collective_seconds("all_reduce", b, MESH, 0, bucket_cap=CAP) for b in sizes)
    assert total == pytest.approx(ALPHA + BETA * CAP * 2 * (2 - 1) / 2)
    unbucketed = sum(collective_seconds("all_reduce", b, MESH, 0) for b in sizes)
    assert unbucketed == pytest.approx(total + 7 * ALPHA)
    # Reduce-scatters into ZeRO-2 pieces are batched per bucket too.
    rs = sum(collective_seconds("reduce_scatter", b, MESH, 0, bucket_cap=CAP) for b in sizes)
    assert rs == pytest.approx(ALPHA + BETA * CAP / 2)


def test_a_parameter_larger_than_the_cap_pays_its_own_latency():
    for nbytes in (CAP, 3 * CAP):
        assert collective_seconds("all_reduce", nbytes, MESH, 0, bucket_cap=CAP) == \
            collective_seconds("all_reduce", nbytes, MESH, 0) == ALPHA + BETA * nbytes


def test_unbucketed_collectives_are_unchanged():
    for kind in ("all_gather", "all_to_all", "all_reduce", "reduce_scatter"):
        assert collective_seconds(kind, 4096, MESH, 0, bucket_cap=0) == collective_seconds(kind, 4096, MESH, 0)
    assert collective_seconds("all_to_all", 4096, MESH, 0, bucket_cap=CAP) == collective_seconds(
        "all_to_all", 4096, MESH, 0)  # buckets sum gradients and gather ZeRO's pieces, nothing else
    # ZeRO's parameter gathers go in buckets of the cap too (runtime/zero/comm.py): a share of one latency
    assert collective_seconds("all_gather", 4096, MESH, 0, bucket_cap=CAP) < collective_seconds(
        "all_gather", 4096, MESH, 0)
    with pytest.raises(ValueError, match="bucket cap"):
        collective_seconds("all_reduce", 4096, MESH, 0, bucket_cap=-1)


def test_runtime_and_planner_share_one_cap(monkeypatch):
    from autopar.runtime import bucketing

    assert bucketing.bucket_cap_bytes is buckets.bucket_cap_bytes
    assert buckets.bucket_cap_bytes() == CAP
    monkeypatch.setenv(buckets.ENV_VAR, "2")
    assert buckets.bucket_cap_bytes() == 2 * 2**20
    _, built = _built()
    assert built.bucket_cap == 2 * 2**20  # build_problem prices for the cap the runtime will use


def test_data_parallel_plan_priced_with_buckets_and_solver_agrees_with_evaluator():
    traced, built = _built()
    _, plain = _built(bucket_cap=0)
    assert built.bucket_cap == CAP and plain.bucket_cap == 0
    family = solve(baseline_problem("data-parallel", traced, built))
    dp = family.choice
    assert family.objective == pytest.approx(built.problem.evaluate(dp).objective, rel=1e-9)
    syncs, _ = grad_syncs(built, dp)
    assert len(syncs) == 12 and all(s.bucketed and s.bucket_cap == CAP for s in syncs)  # 6 weights, 6 biases
    wire = [s.strategy.grad_sync_bytes[s.slot] for s in syncs]
    # The same plan priced one latency per sum (bucket_cap=0: what the pipeline's runtime runs)
    # costs each sum's latency less its bucket share more: 12 sums, 12 latencies, vs a fraction of one.
    saved = plain.problem.evaluate(dp).objective - built.problem.evaluate(dp).objective
    assert saved == pytest.approx(sum(ALPHA * (1 - b / CAP) for b in wire), rel=1e-6)
    assert saved > 11 * ALPHA
    assert sum(s.seconds(built.mesh) for s in syncs) == pytest.approx(
        ALPHA * sum(wire) / CAP + BETA * sum(wire))
    # The solver, on the whole problem, now prefers data parallelism over paying 12 latencies.
    sol = solve(built.problem)
    assert sol.objective == pytest.approx(built.problem.evaluate(sol.choice).objective, rel=1e-9)
    assert sol.objective <= family.objective * (1 + 1e-9)
    # With overlap the bucketed sums are the asynchronous part, priced the same by ILP and evaluator.
    traced, built = _built(replace(MESH, comm_overlap=0.5))
    family = solve(baseline_problem("data-parallel", traced, built))
    ev = built.problem.evaluate(family.choice)
    assert family.objective == pytest.approx(ev.objective, rel=1e-9)
    syncs = grad_syncs(built, family.choice)[0]
    assert ev.async_s == pytest.approx(sum(s.async_seconds(built.mesh) for s in syncs))
    # The last bucket (the first layers' sums, ready as backward ends) hides nothing: 1.6 MB of
    # gradients, the first bucket takes layers 5-3, layer 2's bias (ready before its weight, which
    # forward reads first, through its transpose) and, as DDP cuts, the weight that takes it past
    # its 1 MiB cap (layer 2's); the rest is the last bucket.
    exposed = sorted(built.decisions[s.value.producer].module for s in syncs if s.exposed)
    assert exposed == ["layers.0.bias", "layers.0.weight", "layers.1.bias", "layers.1.weight"]
    assert all(s.async_seconds(built.mesh) == 0.0 < s.seconds(built.mesh) for s in syncs if s.exposed)


def test_the_last_bucket_is_cut_as_the_runtime_cuts_it():
    from autopar.layout.buckets import split_buckets
    from autopar.planner.executed import last_bucket_params

    # DDP's cut: a bucket closes once it holds its cap (the first its first cap), the gradient
    # crossing it included; what is left when the gradients run out is the last bucket.
    assert split_buckets([3, 3, 3, 10, 2, 2], cap=8, first_cap=4) == [[0, 1], [2, 3], [4, 5]]
    assert split_buckets([10, 1, 1], cap=8, first_cap=4) == [[0], [1, 2]]  # one larger than the cap: alone
    assert split_buckets([2, 2, 8, 8], cap=8, first_cap=0) == [[0, 1, 2], [3]]  # no first cap: all at cap
    assert split_buckets([5], cap=8, first_cap=4) == [[0]]
    assert split_buckets([], cap=8, first_cap=4) == []
    traced, built = _built()
    assert built.exposed == last_bucket_params(traced, cap=CAP)
    assert len(built.exposed) == 4 and not _built(bucket_cap=0)[1].exposed
    # One bucket holds every gradient of a model under the first bucket's cap: all of it is exposed.
    traced, built = _built(d=64)
    assert built.exposed == {p.name for p in traced.params}


def test_a_converted_read_keeps_its_own_latency():
    # A weight gathered before its reader: the runtime sums that gradient in-graph (not bucketed),
    # so the edge adds back the latency the reader's option priced as a bucket share.
    traced, built = _built()
    dp = solve(baseline_problem("data-parallel", traced, built)).choice
    name = next(n for n, d in built.decisions.items() if d.kind == "parameter" and d.module.endswith("0.weight"))
    gathered = {**dp, name: "S0"}
    sync = next(s for s in grad_syncs(built, gathered)[0] if s.value.producer == name)
    assert not sync.bucketed and sync.seconds(built.mesh) == pytest.approx(
        ALPHA + BETA * sync.strategy.grad_sync_bytes[sync.slot])
    ev, ev_dp = built.problem.evaluate(gathered), built.problem.evaluate(dp)
    bucketed = grad_sync_seconds(sync.strategy, sync.slot, built.mesh, bucket_cap=CAP)
    assert ev.comm_s + ev.reshard_s - (ev_dp.comm_s + ev_dp.reshard_s) >= sync.seconds(built.mesh) - bucketed > 0
    _, plain = _built(bucket_cap=0)
    # Gathering costs the same conversion either way; priced with buckets it also loses the
    # bucket share of its sum's latency (the whole latency is paid in-graph).
    delta = (ev.objective - ev_dp.objective) - (
        plain.problem.evaluate(gathered).objective - plain.problem.evaluate(dp).objective)
    others = sum(ALPHA * (1 - s.strategy.grad_sync_bytes[s.slot] / CAP)
                 for s in grad_syncs(built, dp)[0] if s.value.producer == name)
    assert delta == pytest.approx(others, rel=1e-6)
