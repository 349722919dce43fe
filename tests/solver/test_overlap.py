"""Communication overlap: the ILP and the evaluator price it alike, and it moves the optimum."""

import itertools
import json
import random
from dataclasses import replace

import pytest

from autopar.solver.driver import solve
from autopar.solver.ilp import available_backends
from autopar.solver.overlap import hidden_seconds
from autopar.solver.problem import Edge, Node, Problem, StrategyOption
from autopar.solver.simplify import simplify

BACKENDS = available_backends()


def _opt(name, compute, comm=0.0, *, asy=0.0, ovl=0.0, param=0, act=0):
    return StrategyOption(name, compute, comm, param, act, async_s=asy, overlap_s=ovl)


def _random_problem(seed: int, *, rho: float, budget: bool) -> Problem:
    """A chain with a side branch; options with random async parts and backward compute, some
    blocks repeated (aliasing), memory on every node."""
    rng = random.Random(seed)
    nodes, edges = [], []
    for i in range(7):
        opts = []
        for k in range(rng.randint(1, 3)):
            comm = rng.choice([0.0, rng.uniform(0.1, 2.0)])
            compute = rng.uniform(0.2, 2.0)
            opts.append(_opt(f"o{k}", compute, comm, asy=comm * rng.choice([0.0, 0.5, 1.0]),
                             ovl=compute * rng.uniform(0.0, 0.7), act=rng.randint(1, 5) << 20))
        block = f"layers.{i % 2}" if 2 <= i <= 5 else None
        nodes.append(Node(f"n{i}", tuple(opts), live=(i, 13 - i), block=block, signature=f"s{i // 2}"))
    names = [n.name for n in nodes]
    for a, b in zip(names, names[1:]):
        ka, kb = nodes[names.index(a)].num_options, nodes[names.index(b)].num_options
        # Some edges carry asynchronous seconds on some pairs (a gradient sum read without conversion).
        asy = [[rng.choice([0.0, rng.uniform(0.2, 1.5)]) for _ in range(kb)] for _ in range(ka)] \
            if rng.random() < 0.6 else None
        edges.append(Edge(a, b, [[0.0 if i == j else rng.uniform(0.0, 1.5) for j in range(kb)] for i in range(ka)],
                          asy))
    p = Problem(tuple(nodes), tuple(edges), timeline_length=14, comm_overlap=rho)
    if not budget:
        return p
    peaks = sorted({p.evaluate(c).peak_bytes for c in _choices(p)})
    # binds (about half the plans are over it), half a MiB clear of any plan's peak (whole MiB):
    # a plan exactly at a budget is within the backends' row tolerances, admitted or not
    return p.with_budget(peaks[len(peaks) // 2] + (1 << 19))


def _choices(problem: Problem):
    for combo in itertools.product(*[[o.name for o in n.options] for n in problem.nodes]):
        yield dict(zip((n.name for n in problem.nodes), combo))


def _brute_force(problem: Problem):
    best = None
    for choice in _choices(problem):
        ev = problem.evaluate(choice)
        if problem.budget_bytes is not None and ev.peak_bytes > problem.budget_bytes:
            continue
        if best is None or ev.objective < best.objective - 1e-12:
            best = ev
    return best


def test_hidden_is_the_smaller_of_the_two_bounds():
    assert hidden_seconds(0.5, 4.0, 10.0) == 2.0  # overlap-bound
    assert hidden_seconds(1.0, 4.0, 1.5) == 1.5  # compute-bound
    assert hidden_seconds(0.0, 4.0, 10.0) == 0.0


def test_an_edges_asynchronous_seconds_count_for_the_chosen_pair_only():
    w = Node("w", (_opt("R", 0.0), _opt("S", 0.0)))
    mm = Node("mm", (_opt("dp", 4.0, 2.0, ovl=3.0), _opt("tp", 2.0, 3.0)))
    # dp reads w replicated: its 2 s gradient sum is bucketed only when w is R (no gather first)
    p = Problem((w, mm), (Edge("w", "mm", [[0.0, 0.1], [0.5, 0.0]], [[2.0, 0.0], [0.0, 0.0]]),), comm_overlap=1.0)
    assert p.evaluate({"w": "R", "mm": "dp"}).hidden_s == 2.0
    assert p.evaluate({"w": "S", "mm": "dp"}).hidden_s == 0.0
    sol = solve(p)
    assert sol.choice == {"w": "R", "mm": "dp"} and sol.objective == pytest.approx(4.0)
    assert solve(replace(p, comm_overlap=0.0)).choice == {"w": "S", "mm": "tp"}


def test_evaluator_subtracts_hidden_communication():
    a = Node("a", (_opt("dp", 3.0, 2.0, asy=2.0, ovl=2.0),))
    p = Problem((a,), comm_overlap=0.75)
    ev = p.evaluate({"a": "dp"})
    assert ev.async_s == 2.0 and ev.hidden_s == 1.5 and ev.exposed_async_s == 0.5
    assert ev.objective == pytest.approx(3.5) and ev.comm_s == 2.0
    assert replace(p, comm_overlap=0.0).evaluate({"a": "dp"}).objective == 5.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(6))
def test_ilp_optimum_equals_the_brute_force_optimum_of_the_evaluator(seed, backend):
    for rho, budget in ((0.6, False), (1.0, True)):
        p = _random_problem(seed, rho=rho, budget=budget)
        best = _brute_force(p)
        sol = solve(p, solver=backend, alias=False)  # brute force lets repeated blocks differ
        ev = p.evaluate(sol.choice)
        assert sol.objective == pytest.approx(ev.objective, rel=1e-9)  # the solver's own check
        assert sol.objective == pytest.approx(best.objective, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_simplified_objective_is_the_evaluators_for_every_group_choice(seed):
    p = _random_problem(seed, rho=0.8, budget=False)
    red = simplify(p)
    assert red.overlap is not None
    for combo in itertools.product(*[range(len(c)) for c in red.cost]):
        assert red.objective(combo) == pytest.approx(p.evaluate(red.expand(combo)).objective, rel=1e-9)


def test_zero_overlap_is_the_plain_sum_bit_for_bit():
    p = _random_problem(3, rho=0.0, budget=True)
    assert simplify(p).overlap is None
    plain = Problem(tuple(replace(n, options=tuple(replace(o, async_s=0.0, overlap_s=0.0) for o in n.options))
                          for n in p.nodes), tuple(Edge(e.src, e.dst, e.costs) for e in p.edges), p.budget_bytes,
                    p.timeline_length)
    a, b = solve(p), solve(plain)
    assert a.choice == b.choice and a.objective == b.objective and a.lp_bound == b.lp_bound
    ev = p.evaluate(a.choice)
    assert ev.hidden_s == 0.0 and ev.objective == ev.compute_s + ev.comm_s + ev.reshard_s


def test_overlap_turns_the_choice_from_model_parallel_to_data_parallel():
    # A layer either replicated (data parallel: full compute, a gradient all-reduce issued
    # asynchronously) or split (tensor parallel: half the compute, synchronous all-reduces).
    layer = (_opt("dp", 4.0, 3.0, asy=3.0, ovl=2.5), _opt("tp", 2.0, 3.2))
    nodes = tuple(Node(f"l{i}", layer, block=f"h.{i}", signature="l") for i in range(3))
    at = {rho: solve(Problem(nodes, comm_overlap=rho)) for rho in (0.0, 1.0)}
    assert set(at[0.0].choice.values()) == {"tp"} and at[0.0].objective == pytest.approx(3 * 5.2)
    assert set(at[1.0].choice.values()) == {"dp"} and at[1.0].objective == pytest.approx(3 * (7.0 - 2.5))


def test_problem_json_keeps_overlap_and_reads_files_without_it():
    p = _random_problem(1, rho=0.4, budget=True)
    back = Problem.from_json(p.to_json())
    assert back == p and back.comm_overlap == 0.4
    assert [e.async_costs for e in back.edges] == [e.async_costs for e in p.edges]
    data = json.loads(p.to_json())
    del data["comm_overlap"]
    for n in data["nodes"]:
        n["options"] = [o[:6] for o in n["options"]]
    for e in data["edges"]:
        e.pop("async_costs", None)
    old = Problem.from_json(json.dumps(data))
    assert old.comm_overlap == 0.0 and all(o.async_s == 0.0 for n in old.nodes for o in n.options)
    assert all(e.async_array is None for e in old.edges)


def test_records_refuse_bad_overlap_figures():
    with pytest.raises(ValueError, match="async_s .* cannot exceed"):
        StrategyOption("x", 1.0, 0.5, async_s=0.6)
    with pytest.raises(ValueError, match="comm_overlap"):
        Problem((Node("a", (_opt("x", 1.0),)),), comm_overlap=1.5)


@pytest.mark.parametrize("seed", range(4))
def test_a_restricted_model_keeps_every_overlap_term(seed):
    # incumbents.restrict folds edges whose ends keep one option: their async seconds too.
    import numpy as np

    from autopar.solver.incumbents import restrict

    p = _random_problem(seed, rho=1.0, budget=False)
    red = simplify(p, merge=False)
    rng = random.Random(seed)
    keep = [np.array(sorted(rng.sample(range(len(c)), rng.randint(1, len(c)))), dtype=int) for c in red.cost]
    sub = restrict(red, keep)
    for combo in itertools.product(*[range(len(c)) for c in sub.cost]):
        assert sub.objective(combo) == pytest.approx(p.evaluate(sub.expand(combo)).objective, rel=1e-9)
