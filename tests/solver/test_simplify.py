"""Simplification: exact where it claims to be, aliasing accounts every member's cost and memory."""

import itertools
import random

import pytest

from autopar.solver.problem import Edge, Node, Problem, StrategyOption
from autopar.solver.simplify import MemItem, peak_candidates, simplify

import numpy as np


def _opt(name, compute, param=0, act=0, fwd=0.0):
    return StrategyOption(name, compute, 0.0, param, act, fwd)


def _random_problem(rng, n, *, k=3, budget_frac=None, segments=False):
    nodes, T = [], 2 * n
    for i in range(n):
        opts = tuple(_opt(f"o{j}", rng.uniform(0, 1), rng.choice([0, 100, 200]), rng.choice([0, 50, 80, 120]),
                          rng.uniform(0, 0.5)) for j in range(rng.randint(1, k)))
        nodes.append(Node(f"n{i}", opts, live=(i, T - 1 - i), segment=f"s{i % 2}" if segments else None))
    edges = []
    for i in range(1, n):
        for j in rng.sample(range(i), min(i, rng.randint(1, 2))):
            a, b = nodes[j], nodes[i]
            edges.append(Edge(a.name, b.name, [[0.0 if s == t else rng.uniform(0, 1) for t in range(b.num_options)]
                                               for s in range(a.num_options)]))
    p = Problem(tuple(nodes), tuple(edges), None, T)
    if budget_frac is not None:
        peaks = [p.evaluate(dict(zip([x.name for x in nodes], [x.options[c].name for x, c in zip(nodes, combo)])))
                 .peak_bytes for combo in itertools.product(*[range(x.num_options) for x in nodes])]
        p = p.with_budget(int(min(peaks) + budget_frac * (max(peaks) - min(peaks))))
    return p


def _best(problem, choices):
    best = None
    for choice in choices:
        ev = problem.evaluate(choice)
        if problem.budget_bytes is not None and ev.peak_bytes > problem.budget_bytes:
            continue
        best = ev.objective if best is None else min(best, ev.objective)
    return best


def _all_choices(problem):
    for combo in itertools.product(*[range(n.num_options) for n in problem.nodes]):
        yield {n.name: n.options[c].name for n, c in zip(problem.nodes, combo)}


def _all_reduced_choices(reduced):
    for combo in itertools.product(*[range(len(c)) for c in reduced.cost]):
        yield reduced.expand(combo)


@pytest.mark.parametrize("seed", range(12))
def test_merge_and_pruning_keep_the_optimum(seed):
    rng = random.Random(seed)
    p = _random_problem(rng, rng.randint(3, 7), budget_frac=rng.choice([None, 0.2, 0.6]))
    reduced = simplify(p, alias=False, merge=True)
    assert _best(p, _all_reduced_choices(reduced)) == pytest.approx(_best(p, _all_choices(p)))


@pytest.mark.parametrize("seed", range(6))
def test_reduced_objective_equals_the_problem_objective_for_every_choice(seed):
    rng = random.Random(100 + seed)
    p = _random_problem(rng, 6)
    reduced = simplify(p)
    for combo in itertools.islice(itertools.product(*[range(len(c)) for c in reduced.cost]), 200):
        assert reduced.objective(combo) == pytest.approx(p.evaluate(reduced.expand(combo)).objective)


def test_follow_merge_takes_an_elementwise_follower_and_only_when_exact():
    lin = Node("linear", (_opt("S0", 1.0, act=50), _opt("R", 1.1, act=200)), live=(0, 5))
    relu = Node("relu", (_opt("S0", 0.1, act=50), _opt("R", 0.4, act=200)), live=(1, 4))
    out = Node("out", (_opt("S0", 1.0), _opt("R", 1.0)))
    follow = Edge("linear", "relu", ((0.0, 2.0), (2.0, 0.0)))
    to_out = Edge("relu", "out", ((0.0, 0.3), (0.3, 0.0)))
    p = Problem((lin, relu, out), (follow, to_out), None, 6)
    reduced = simplify(p)
    assert reduced.stats["num_followed"] >= 1
    pairs = {(c["linear"], c["relu"]) for c in _all_reduced_choices(reduced)}
    assert pairs and pairs <= {("S0", "S0"), ("R", "R")}
    assert simplify(p, merge=False).num_groups == 3
    assert _best(p, _all_reduced_choices(reduced)) == pytest.approx(_best(p, _all_choices(p)))
    # A follower whose "other" option saves memory must stay free when memory can bind.
    relu_small = Node("relu", (_opt("S0", 0.1, act=50), _opt("R", 0.4, act=10)), live=(1, 4))
    bound = Problem((lin, relu_small, out), (follow, to_out), 60, 6)
    reduced = simplify(bound)
    assert reduced.memory_can_bind
    pairs = {(c["linear"], c["relu"]) for c in _all_reduced_choices(reduced)}
    assert pairs == {("S0", "S0"), ("S0", "R"), ("R", "S0"), ("R", "R")}
    # Without a budget the same follower is merged: memory cannot bind (chain merging).
    free = {(c["linear"], c["relu"]) for c in _all_reduced_choices(simplify(bound.with_budget(None)))}
    assert free and free <= {("S0", "S0"), ("R", "R")}


def test_separable_and_single_option_edges_are_folded():
    a = Node("a", (_opt("x", 1.0), _opt("y", 2.0)))
    b = Node("b", (_opt("x", 1.0), _opt("y", 3.0)))
    c = Node("c", (_opt("only", 0.5),))
    edges = (Edge("a", "b", ((1.0, 2.0), (3.0, 4.0))),  # = [1, 3] + [0, 1]
             Edge("b", "c", ((0.25,), (0.75,))))
    reduced = simplify(Problem((a, b, c), edges), merge=False)
    assert reduced.edges == {} and reduced.stats["num_folded_edges"] == 2
    np.testing.assert_allclose(reduced.cost[0], [2.0, 5.0])
    np.testing.assert_allclose(reduced.cost[1], [1.25, 4.75])


def _repeated(depth, *, rng, entry=True):
    template = [tuple(_opt(f"L{j}", rng.uniform(0.1, 1.0), param=rng.choice([0, 10]), act=rng.choice([5, 20]))
                      for j in range(3)) for _ in range(3)]
    nodes, edges, T = [], [], 2 * depth * 3 + 2
    for d in range(depth):
        for k, opts in enumerate(template):
            i = len(nodes)
            nodes.append(Node(f"b{d}_{k}", opts, live=(i, T - 1 - i), block=f"layers.{d}", signature=f"op{k}"))
            if i:
                edges.append(Edge(nodes[i - 1].name, nodes[i].name,
                                  [[0.0 if s == t else 0.3 for t in range(3)] for s in range(3)]))
    if entry:  # a residual stream: block d's first node feeds block d+1's first node too
        for d in range(depth - 1):
            edges.append(Edge(f"b{d}_0", f"b{d + 1}_0", [[0.0 if s == t else 0.2 for t in range(3)] for s in range(3)]))
    return Problem(tuple(nodes), tuple(edges), None, T)


def test_aliasing_shares_variables_and_accounts_every_member():
    rng = random.Random(7)
    p = _repeated(8, rng=rng)
    reduced = simplify(p, merge=False)
    assert reduced.num_groups == 3
    assert reduced.stats["num_aliased"] == 7 * 3
    assert len(reduced.mem_items) == 24  # every instance keeps its own liveness
    for combo in itertools.product(range(3), repeat=3):
        choice = reduced.expand(combo)
        assert len(choice) == 24
        assert reduced.objective(combo) == pytest.approx(p.evaluate(choice).objective)
        assert {choice[f"b{d}_1"] for d in range(8)} == {choice["b0_1"]}


def test_aliasing_needs_equal_signatures():
    rng = random.Random(8)
    p = _repeated(4, rng=rng)
    odd = Node("b2_1", p.node("b2_1").options, live=p.node("b2_1").live, block="layers.2", signature="other")
    q = Problem(tuple(odd if n.name == "b2_1" else n for n in p.nodes), p.edges, None, p.timeline_length)
    assert simplify(q, merge=False).num_groups == 3 + 3  # layers.2 is its own class


def test_peak_candidates_are_the_maximal_live_sets():
    def item(s, e):
        return MemItem(0, s, e, np.ones(1))
    # [0,9] holds everything; [1,2] and [4,6] are disjoint bumps, [5,5] nests in [4,6]
    items = [item(0, 9), item(1, 2), item(4, 6), item(5, 5)]
    assert peak_candidates(items) == [1, 5]
    assert peak_candidates([item(0, 3), item(2, 5), item(4, 8)]) == [2, 4]
    assert peak_candidates([]) == []


def test_a_recomputable_follower_keeps_its_faster_recompute_option():
    lin = Node("linear", (_opt("S0", 1.0), _opt("R", 1.1)))
    follow = Edge("linear", "relu", ((0.0, 2.0), (2.0, 0.0)))

    def relu(segment):
        return Node("relu", (_opt("S0", 0.1, fwd=0.5), _opt("R", 0.4, fwd=0.05)), segment=segment)

    # Without a segment the pair collapses to its cheapest plan; with one, R-R recomputes
    # faster, so it must survive for the recompute decision.
    free = simplify(Problem((lin, relu(None)), (follow,)), merge=True)
    assert [c["relu"] for c in _all_reduced_choices(free)] == ["S0"]
    kept = simplify(Problem((lin, relu("block0")), (follow,)), merge=True)
    assert sorted((c["linear"], c["relu"]) for c in _all_reduced_choices(kept)) == [("R", "R"), ("S0", "S0")]
    (forward,) = [f for f in kept.forward if f]
    assert sorted(forward["block0"]) == [0.05, 0.5]


def test_max_row_difference_on_distinct_rows_equals_the_full_maximum():
    from autopar.solver.simplify import _max_row_difference

    rng = np.random.default_rng(0)
    for shape in ((3, 4), (20, 30), (70, 60)):
        base = rng.uniform(0, 1, size=(5, 6))
        mat = base[rng.integers(0, 5, shape[0])][:, rng.integers(0, 6, shape[1])]  # repeated rows and columns
        full = (mat[:, None, :] - mat[None, :, :]).max(axis=2)
        assert np.array_equal(_max_row_difference(mat), full)


@pytest.mark.parametrize("seed", range(6))
def test_pruning_with_repeated_rows_keeps_the_optimum(seed):
    """Options that look alike to a neighbour (equal cost rows: the layouts that edge sees) are
    where the distinct-row regret and the vectorised dominance pass act."""
    rng = random.Random(50 + seed)
    p = _random_problem(rng, rng.randint(4, 6), k=4)
    edges = []
    for e in p.edges:
        rows = [list(r) for r in e.costs]
        for i in range(1, len(rows)):
            if rng.random() < 0.5:
                rows[i] = list(rows[rng.randrange(i)])
        edges.append(Edge(e.src, e.dst, rows))
    p = Problem(p.nodes, tuple(edges), None, p.timeline_length)
    reduced = simplify(p)
    assert _best(p, _all_reduced_choices(reduced)) == pytest.approx(_best(p, _all_choices(p)))
