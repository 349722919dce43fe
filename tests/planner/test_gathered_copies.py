"""Parameter copies a reader gathers and keeps for backward, priced on the parameter -> reader edge
(``Edge.mem``, ``planner.saved_bytes.gathered_copies`` / ``saved_slots``): which inputs an op
saves, the bytes and interval of a ZeRO-3-style copy, and a tight plan's peak counting them."""

from __future__ import annotations

import torch
from torch import nn

from autopar.api import plan
from autopar.layout.mesh import MeshSpec
from autopar.planner.builder import build_problem
from autopar.planner.options import PlanOptions
from autopar.planner.orchestrate import plan_family
from autopar.planner.saved_bytes import saved_slots
from autopar.solver.problem import Edge, Problem
from autopar.strategies import input_nodes
from autopar.tracer import profile, trace
from autopar.tracer.graph import values_needing_grad
from tests.budgets import smallest_budget

WEIGHT = 256 * 64 * 4  # the down-projection's weight, fp32


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 256)
        self.down = nn.Linear(256, 64)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))).pow(2).mean()


def _built(budget=None):
    traced = trace(Mlp(), (torch.randn(32, 64),))
    return traced, build_problem(traced, profile(traced), MeshSpec.preset("cpu", (2,)), budget_bytes=budget)


def test_saved_slots_are_read_off_torch():
    traced, _ = _built()
    grads = values_needing_grad(traced)
    up, down = (n for n in traced.nodes if n.op == "call_function" and "linear" in str(n.target))
    names = [s.name for s in input_nodes(down)]  # input, weight, bias
    assert {names[i] for i in saved_slots(down, input_nodes(down), grads)} == {"relu", "p_down_weight"}
    # the first linear reads a user input that takes no gradient: its weight is not kept
    assert {input_nodes(up)[i].name for i in saved_slots(up, input_nodes(up), grads)} == {"x"}
    assert 1 not in saved_slots(up, input_nodes(up), grads)


def test_a_weight_stored_split_and_read_whole_keeps_a_full_copy_over_its_readers_interval():
    """ZeRO-3 on 2 ranks: the linear's weight stored Shard(0), read replicated: the copy is the
    full weight, alive from that linear's forward to its backward; stored as read: nothing."""
    traced, built = _built()
    problem = built.problem
    edges = {(e.src, e.dst): e for e in problem.edges if e.mem is not None}
    assert set(edges) == {("p_down_weight", "linear_1")}  # the first linear saves no weight
    edge = edges[("p_down_weight", "linear_1")]
    ops = [n.name for n in traced.compute_nodes()]
    i = ops.index("linear_1")
    assert edge.mem_live == (i, problem.timeline_length - 1 - i)
    weight, reader = problem.node("p_down_weight"), problem.node("linear_1")
    split, whole = weight.option_index("S0"), weight.option_index("R")
    replicated = next(j for j, o in enumerate(reader.options) if o.name.startswith("R x R x R"))
    assert edge.mem[split][replicated] == WEIGHT and edge.mem[whole][replicated] == 0
    choice = {n.name: n.options[0].name for n in problem.nodes}
    choice["linear_1"] = reader.options[replicated].name
    stored_whole = problem.evaluate({**choice, "p_down_weight": "R"})
    stored_split = problem.evaluate({**choice, "p_down_weight": "S0"})
    held = [b - a for a, b in zip(stored_whole.activations, stored_split.activations)]
    assert held == [WEIGHT if i <= t <= problem.timeline_length - 1 - i else 0 for t in range(len(held))]


def test_a_zero3_plans_peak_counts_its_copy():
    """The ZeRO-3 family on 2 ranks stores every weight split and reads it whole: the plan's peak
    is the evaluator's, which holds the down-projection's full weight (the only one a reader
    saves) beside the shards; priced without the edges' bytes the same plan peaks that much lower."""
    model, x = Mlp(), torch.randn(32, 64)
    mesh = MeshSpec.preset("cpu", (2,))

    def at(budget):  # at its smallest budget the family shards every weight
        return plan_family(model, (x,), "zero3", mesh=mesh, options=PlanOptions(memory_budget=budget))

    zero3 = at(smallest_budget(at))
    _, built = _built()
    problem = built.problem
    choice = {n.name: n.strategy for n in zero3.nodes}
    assert choice["p_down_weight"] != "R"
    ev = problem.evaluate(choice)
    assert ev.peak_bytes == zero3.estimate.peak_bytes
    blind = Problem(problem.nodes, tuple(Edge(e.src, e.dst, e.costs) for e in problem.edges), None,
                    problem.timeline_length)
    assert blind.evaluate(choice).peak_bytes == ev.peak_bytes - WEIGHT


def test_a_plan_at_its_smallest_budget_fits_it():
    model, x = Mlp(), torch.randn(32, 64)
    mesh = MeshSpec.preset("cpu", (2,))

    def at(budget):
        return plan(model, (x,), mesh=mesh, pipeline=1, memory_budget=budget, cache=False)

    smallest = smallest_budget(at)
    tight = at(smallest)
    assert not tight.recompute  # (no repeated block to recompute)
    _, built = _built(smallest)
    assert built.problem.evaluate({n.name: n.strategy for n in tight.nodes}).peak_bytes \
        == tight.estimate.peak_bytes <= smallest
