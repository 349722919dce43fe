"""Overlap through the planner: which communication the builder counts asynchronous, and how
``MeshSpec.comm_overlap`` moves a real model's plan. Models are on ``meta``: no weights."""

from dataclasses import replace

import pytest
import torch
from torch import nn

from autopar.layout.mesh import MeshSpec
from autopar.planner.assemble import baseline_problem
from autopar.planner.builder import build_problem
from autopar.planner.executed import grad_syncs
from autopar.solver.driver import solve
from autopar.tracer import profile, trace


class Mlp(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    def __init__(self, d: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Mlp(d) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.sum()


# 2 MiB buckets: each 4 MiB weight closes the bucket it joins (DDP's cut), so the first weight
# forward reads and its bias, ready just before it, make the last bucket (issued as backward
# ends: their sums hide nothing, ``executed.last_bucket_params``).
CAP = 2 * 2**20


def _built(mesh: MeshSpec, *, d: int = 512, batch: int = 128, depth: int = 1):
    with torch.device("meta"):
        model = Stack(d, depth)
    traced = trace(model, (torch.empty(batch, d, device="meta"),))
    return traced, build_problem(traced, profile(traced), mesh, budget_bytes=None, bucket_cap=CAP)


def _weights(built, choice) -> set[str]:
    return {choice[n] for n, d in built.decisions.items() if d.kind == "parameter"}


def test_presets_carry_an_overlap_and_files_without_it_read_as_none():
    assert MeshSpec.preset("h100-80gb", (8,)).comm_overlap > MeshSpec.preset("cpu", (2,)).comm_overlap > 0
    mesh = MeshSpec.preset("cpu", (2,))
    assert MeshSpec.from_json(mesh.to_json()) == mesh
    old = mesh.to_json().replace(f'"comm_overlap": {mesh.comm_overlap}', '"comm_overlap": 0.0')
    assert MeshSpec.from_json(old).comm_overlap == 0.0
    with pytest.raises(ValueError, match="comm_overlap"):
        replace(mesh, comm_overlap=1.2)


def test_only_the_parameters_gradient_sums_are_asynchronous():
    traced, built = _built(MeshSpec.preset("cpu", (2,)))
    p = built.problem
    assert p.comm_overlap == 0.5
    family = solve(baseline_problem("data-parallel", traced, built))  # a restricted problem keeps the overlap
    dp = family.choice
    syncs, _ = grad_syncs(built, dp)
    assert syncs and all(s.bucketed for s in syncs)  # every partial gradient is a weight's or bias's
    ev = p.evaluate(dp)
    exposed = [built.decisions[s.value.producer].module for s in syncs if s.exposed]
    assert sorted(exposed) == ["blocks.0.up.bias", "blocks.0.up.weight"]  # the last bucket's
    assert ev.async_s == pytest.approx(sum(s.seconds(built.mesh) for s in syncs if not s.exposed))
    backward = sum(n.options[n.option_index(dp[n.name])].overlap_s for n in p.nodes)
    assert 0 < backward < ev.compute_s
    assert ev.hidden_s == min(0.5 * ev.async_s, backward) > 0
    assert family.objective == pytest.approx(ev.objective, rel=1e-9)
    # The same plan with one weight sharded: gathered before its reader, whose gradient sum then
    # runs in-graph (runtime.passes buckets only a parameter read in its own layout).
    name = next(n for n, d in built.decisions.items() if d.kind == "parameter" and d.module.endswith("down.weight"))
    gathered = {**dp, name: "S0"}
    synced = [s for s in grad_syncs(built, gathered)[0] if s.value.producer == name]
    assert synced and not any(s.bucketed for s in synced)
    assert p.evaluate(gathered).async_s == pytest.approx(ev.async_s - sum(s.seconds(built.mesh) for s in syncs
                                                                          if s.value.producer == name))
    tp = solve(baseline_problem("megatron-tp", traced, built)).choice
    ev_tp = p.evaluate(tp)
    assert ev_tp.comm_s + ev_tp.reshard_s > 0 and ev_tp.async_s == 0.0  # its all-reduces wait on the critical path
    for n in p.nodes:
        for o in n.options:
            assert o.async_s <= o.comm_s
            if built.decisions[n.name].kind != "op":
                assert o.async_s == 0.0 and o.overlap_s == 0.0


def test_overlap_turns_megatron_into_data_parallel_when_the_all_reduce_hides():
    # Megatron's MLPs communicate little (one all-reduce per block): data parallelism wins only
    # where its gradient all-reduce (less the last bucket's, which nothing hides) hides under the
    # backward compute.
    base = MeshSpec.preset("cpu", (2,))
    out = {}
    for rho in (0.0, 1.0):
        _, built = _built(replace(base, comm_overlap=rho), batch=512, depth=3)
        sol = solve(built.problem)
        out[rho] = (_weights(built, sol.choice), built.problem.evaluate(sol.choice), sol)
    weights0, ev0, _ = out[0.0]
    weights1, ev1, _ = out[1.0]
    assert weights0 != {"R"} and ev0.hidden_s == 0.0  # the weights are split: tensor parallel
    assert weights1 == {"R"} and ev1.hidden_s > 0  # data parallel, its all-reduce hidden
    assert ev1.objective < ev0.objective
    # Priced at no overlap, data parallel is the slower plan: the choice moved because of it.
    assert built.problem.evaluate(out[1.0][2].choice).objective == ev1.objective
    no_overlap = replace(built.problem, comm_overlap=0.0)
    assert no_overlap.evaluate(out[1.0][2].choice).objective > ev0.objective
