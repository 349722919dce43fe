"""Planner known answers (issue 4): Megatron under a tight budget, data parallel with a large
batch, and a closed-form objective for a 2-layer MLP. Models are on ``meta``: no weights."""

import pytest
import torch
from torch import nn

from autopar.api import plan
from autopar.planner.baselines import BASELINES, ZERO_BASELINES
from autopar.planner.builder import build_problem
from autopar.layout.cost import collective_seconds
from autopar.layout.mesh import MeshSpec
from autopar.solver.driver import solve
from autopar.tracer import profile, trace

GiB = 2**30


class Blocks(nn.Module):
    """Megatron's MLP: Linear(d, 4d) -> GELU -> Linear(4d, d), repeated; loss = sum."""

    def __init__(self, d: int, num_blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(num_blocks)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.sum()


def _built(d: int, batch: int, mesh: MeshSpec, budget: int | None, num_blocks: int = 2):
    with torch.device("meta"):
        model = Blocks(d, num_blocks)
    traced = trace(model, (torch.empty(batch, d, device="meta"),))
    built = build_problem(traced, profile(traced), mesh, budget_bytes=budget)
    return traced, built, solve(built.problem)


def _layout(built, solution, fqn_suffix: str, traced) -> str:
    for name, d in built.decisions.items():
        if d.kind == "parameter" and traced.node(name).meta["autopar_placeholder"].fqn.endswith(fqn_suffix):
            return solution.choice[name]
    raise KeyError(fqn_suffix)


def _forward_all_reduces(built, solution) -> int:
    return sum(c.conversion.count("all_reduce") for c in built.conversions(solution.choice))


def test_tight_budget_gives_megatron_column_then_row():
    mesh = MeshSpec.preset("a100-80gb", (4,))
    # 2 blocks of 2 x 1 GiB weights; x4 with grads and AdamW state = 16 GiB replicated, so a
    # 6 GiB budget forces the weights to be split four ways.
    traced, built, sol = _built(8192, 8, mesh, 6 * GiB)
    assert sol.status == "optimal"
    for i in range(2):
        assert _layout(built, sol, f"blocks.{i}.0.weight", traced) == "S0"  # column parallel
        assert _layout(built, sol, f"blocks.{i}.2.weight", traced) == "S1"  # row parallel
    # exactly one forward all-reduce per block (the row-parallel partial sum)
    assert _forward_all_reduces(built, sol) == 2
    ev = built.problem.evaluate(sol.choice)
    assert ev.peak_bytes <= 6 * GiB


def test_large_batch_ample_memory_gives_data_parallel():
    mesh = MeshSpec.preset("a100-80gb", (4,))
    traced, built, sol = _built(1024, 65536, mesh, None)
    params = [n for n, d in built.decisions.items() if d.kind == "parameter"]
    assert params and all(sol.choice[n] == "R" for n in params)
    inputs = [n for n, d in built.decisions.items() if d.kind == "input"]
    assert [sol.choice[n] for n in inputs] == ["S0"]
    # every matmul runs on a batch shard: its activation input is S0
    for name, d in built.decisions.items():
        if d.kind == "op" and "addmm" in str(traced.node(name).target):
            choice = built.choice_of(name, sol.choice[name])
            assert str(choice.input_specs[1]) == "S0", (name, choice.name)
    assert _forward_all_reduces(built, sol) == 1  # only the scalar loss


@pytest.mark.parametrize("shape", [(4, 1), (1, 4)])
def test_closed_form_two_layer_mlp_data_parallel(shape):
    """Like Alpa's 2-layer MLP check: with a huge batch the plan is data parallel on whichever
    axis has 4 devices, and its communication is exactly the gradient all-reduce of every
    weight and bias (bucketed) plus the scalar loss, in closed form from the cost model."""
    mesh = MeshSpec.preset("a100-80gb", shape)
    axis = shape.index(4)
    d, batch = 1024, 65536
    traced, built, sol = _built(d, batch, mesh, None, num_blocks=1)
    ev = built.problem.evaluate(sol.choice)
    grads = [4 * d * d + 4 * d, 4 * d * d + d]  # elements of (W1, b1) and (W2, b2)
    # the weights' and biases' sums ride in gradient buckets: each pays its share of a bucket's latency
    expected = sum(collective_seconds("all_reduce", 4 * n, mesh, axis, bucket_cap=built.bucket_cap)
                   for n in [4 * d * d, 4 * d, 4 * d * d, d])
    # the loss, P -> R: left in flight by the runtime, its bytes' time (``executed.pending_output_refund``)
    expected += (collective_seconds("all_reduce", 4, mesh, axis, blocking=False)
                 - collective_seconds("all_reduce", 0, mesh, axis, blocking=False))
    assert sum(grads) == 8 * d * d + 5 * d
    assert ev.comm_s + ev.reshard_s == pytest.approx(expected, rel=1e-9)
    # the same objective on (4, 1) and (1, 4): the unit axis changes nothing
    other = MeshSpec.preset("a100-80gb", tuple(reversed(shape)))
    _, built2, sol2 = _built(d, batch, other, None, num_blocks=1)
    assert sol2.objective == pytest.approx(sol.objective, rel=1e-9)


def test_plan_beats_or_matches_every_baseline_and_round_trips(tmp_path):
    with torch.device("meta"):
        model = Blocks(1024, 2)
    mesh = MeshSpec.preset("a100-80gb", (2, 2))
    p = plan(model, (torch.empty(64, 1024, device="meta"),), mesh=mesh, memory_budget="1GiB",
             baselines=True)
    assert {b.name for b in p.baselines} == set(BASELINES) - set(ZERO_BASELINES)  # zero_stage=0: no ZeRO options
    for b in p.baselines:
        if b.feasible:
            assert p.estimate.step_s <= b.estimate.step_s * (1 + 1e-9), b
    assert p.estimate.peak_bytes <= 1 * GiB
    path = tmp_path / "plan.json"
    p.save(str(path))
    again = type(p).load(str(path))
    assert again == p
