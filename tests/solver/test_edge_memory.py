"""Pairwise memory (``Edge.mem``: a parameter copy a reader gathers and keeps for backward): the
evaluator holds it on the edge's interval for the chosen pair, and the ILPs (after simplification,
with or without repeated-block aliasing and recompute) count it exactly as the evaluator does."""

import itertools
import json
import random

import numpy as np
import pytest

from autopar.solver.driver import minimum_budget, solve
from autopar.solver.ilp import available_backends
from autopar.solver.problem import Edge, Node, Problem, StrategyOption
from autopar.solver.simplify import EdgeItem, settle_edge_items, simplify
from autopar.solver.timeline import edge_bytes_at

BACKENDS = available_backends()
MiB = 1 << 20


def _param(name: str, block: str | None = None) -> Node:
    # stored replicated (big, no copy for a replicated reader) or split (small, gathered)
    return Node(name, (StrategyOption("R", 0.0, param_bytes=8 * MiB), StrategyOption("S0", 0.0, param_bytes=4 * MiB)),
                block=block, signature="w")


def test_the_copy_is_held_over_the_readers_interval_for_the_chosen_pair_only():
    w = _param("w")
    mm = Node("mm", (StrategyOption("dp", 2.0, act_bytes=MiB), StrategyOption("tp", 1.0, act_bytes=MiB)), live=(1, 2))
    x = Node("x", (StrategyOption("R", 0.0, act_bytes=MiB),), live=(0, 3))
    # w stored S0 and read whole by dp: a full copy (4 MiB per rank of the 8 MiB weight) kept 1..2
    edge = Edge("w", "mm", [[0.0, 0.5], [1.0, 0.0]], mem=[[0, 0], [4 * MiB, 0]], mem_live=(1, 2))
    p = Problem((x, w, mm), (edge,), timeline_length=4)
    ev = p.evaluate({"x": "R", "w": "S0", "mm": "dp"})
    assert ev.activations == (MiB, 6 * MiB, 6 * MiB, MiB)
    assert ev.peak_bytes == 4 * MiB + 6 * MiB
    assert p.evaluate({"x": "R", "w": "R", "mm": "dp"}).activations == (MiB, 2 * MiB, 2 * MiB, MiB)
    assert p.evaluate({"x": "R", "w": "S0", "mm": "tp"}).activations == (MiB, 2 * MiB, 2 * MiB, MiB)
    # the report's share of a point held by copies (``edge_bytes_at``)
    split = {"x": "R", "w": "S0", "mm": "dp"}
    assert [edge_bytes_at(p, split, t) for t in range(4)] == [0, 4 * MiB, 4 * MiB, 0]
    assert edge_bytes_at(p, {**split, "w": "R"}, 1) == 0
    # a recomputed reader's copy counts on the whole interval too (the ILPs' rule)
    assert Problem.from_json(p.to_json()).evaluate({"x": "R", "w": "S0", "mm": "dp"}) == ev
    assert json.loads(p.to_json())["edges"][0]["mem_live"] == [1, 2]


def test_edge_memory_is_checked():
    with pytest.raises(ValueError, match="mem must be"):
        Edge("a", "b", [[0.0, 0.0]], mem=[[1]], mem_live=(0, 1))
    with pytest.raises(ValueError, match="mem must be"):
        Edge("a", "b", [[0.0]], mem=[[-1]], mem_live=(0, 1))
    with pytest.raises(ValueError, match="mem_live"):
        Edge("a", "b", [[0.0]], mem=[[3]], mem_live=(2, 1))
    with pytest.raises(ValueError, match="without mem"):
        Edge("a", "b", [[0.0]], mem_live=(0, 1))
    a, b = Node("a", (StrategyOption("o", 0.0),)), Node("b", (StrategyOption("o", 0.0),))
    with pytest.raises(ValueError, match="outside the timeline"):
        Problem((a, b), (Edge("a", "b", [[0.0]], mem=[[3]], mem_live=(0, 5)),), timeline_length=4)
    assert Edge("a", "b", [[0.0]], mem=[[0]], mem_live=(0, 1)).mem is None  # no bytes: one form


def test_settled_items_keep_their_bytes():
    sep = EdgeItem(0, 1, 2, 5, np.array([[3.0, 5.0], [4.0, 6.0]]))  # r[s] + c[t]
    items, kept = settle_edge_items([sep, EdgeItem(1, 2, 0, 1, np.array([[0.0, 7.0], [7.0, 0.0]]))], [2, 2, 2])
    assert len(kept) == 1 and kept[0].a == 1
    for s, t in itertools.product(range(2), range(2)):
        assert sum(it.bytes[s if it.group == 0 else t] for it in items) == sep.bytes[s, t]
    assert all((it.bytes >= 0).all() for it in items)
    one, none_left = settle_edge_items([EdgeItem(3, 1, 0, 1, np.array([[2.0, 9.0]]))], [2, 2, 2, 1])
    assert not none_left and one[0].group == 1 and list(one[0].bytes) == [2.0, 9.0]


def _random_problem(seed: int) -> Problem:
    """Parameters (optionally in repeated blocks) read by ops of a chain; each parameter -> reader
    edge keeps a copy on some pairs, over the reader's interval."""
    rng = random.Random(seed)
    nodes, edges, ops = [], [], 4
    for i in range(ops):
        block = f"layers.{i % 2}" if rng.random() < 0.5 else None
        w = _param(f"w{i}", block)
        opts = tuple(StrategyOption(f"o{k}", rng.uniform(0.2, 2.0), act_bytes=rng.randint(1, 4) * MiB)
                     for k in range(rng.randint(2, 3)))
        op = Node(f"op{i}", opts, live=(i, 2 * ops - 1 - i), block=block, signature=f"op{len(opts)}")
        nodes += [w, op]
        cost = [[rng.choice([0.0, rng.uniform(0.1, 1.0)]) for _ in opts] for _ in w.options]
        mem = [[0] * len(opts), [rng.choice([0, 4, 8]) * MiB for _ in opts]]
        edges.append(Edge(w.name, op.name, cost, mem=mem, mem_live=(i, 2 * ops - 1 - i)))
        if i:
            edges.append(Edge(f"op{i - 1}", op.name, [[rng.uniform(0.0, 0.5) for _ in opts]
                                                       for _ in nodes[-3].options]))
    return Problem(tuple(nodes), tuple(edges), timeline_length=2 * ops)


def _choices(problem: Problem):
    for combo in itertools.product(*[[o.name for o in n.options] for n in problem.nodes]):
        yield dict(zip((n.name for n in problem.nodes), combo))


@pytest.mark.parametrize("seed", range(5))
def test_the_ilps_count_the_copies_as_the_evaluator(seed):
    p = _random_problem(seed)
    evs = [(p.evaluate(c), c) for c in _choices(p)]
    peaks = sorted({ev.peak_bytes for ev, _ in evs})
    achieved, bound = minimum_budget(p, alias=False)
    assert achieved == bound == peaks[0]
    for backend in BACKENDS:
        # a budget that binds, half a MiB clear of every plan's peak (whole MiB)
        budget = peaks[len(peaks) // 3] + MiB // 2
        best = min(ev.objective for ev, _ in evs if ev.peak_bytes <= budget)
        sol = solve(p.with_budget(budget), solver=backend, alias=False)
        assert sol.objective == pytest.approx(best, rel=1e-6)
        assert p.evaluate(sol.choice).peak_bytes == sol.peak_bytes <= budget
        # without the copies the same budget admits a faster plan that does not fit
        blind = Problem(p.nodes, tuple(Edge(e.src, e.dst, e.costs) for e in p.edges), budget, p.timeline_length)
        fast = solve(blind, solver=backend, alias=False)
        assert fast.objective <= sol.objective + 1e-9
        if fast.objective < sol.objective - 1e-9:
            assert p.evaluate(fast.choice).peak_bytes > budget


@pytest.mark.parametrize("seed", range(5))
def test_aliased_blocks_keep_one_copy_each(seed):
    """Repeated blocks share one decision; each instance keeps its own copy on its own interval:
    the aliased ILP's optimum is the best plan whose blocks agree (enumerated on the aliased
    model without merges), and so is its minimum peak."""
    p = _random_problem(seed)
    red = simplify(p, merge=False)
    evs = [p.evaluate(red.expand(combo)) for combo in itertools.product(*[range(len(c)) for c in red.cost])]
    peaks = sorted({ev.peak_bytes for ev in evs})
    budget = peaks[len(peaks) // 2] + MiB // 2
    best = min(ev.objective for ev in evs if ev.peak_bytes <= budget)
    sol = solve(p.with_budget(budget))
    assert sol.objective == pytest.approx(best, rel=1e-6) and sol.peak_bytes <= budget
    assert minimum_budget(p)[0] == peaks[0]
