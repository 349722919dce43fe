"""Problem/Solution records: validation with readable errors, evaluation, JSON round trips."""

from dataclasses import replace

import pytest

from autopar.solver.problem import Edge, Node, Problem, Solution, StrategyOption


def _opt(name, compute, comm=0.0, param=0, act=0, fwd=0.0):
    return StrategyOption(name, compute, comm, param, act, fwd)


def _two_nodes(**kw) -> Problem:
    a = Node("a", (_opt("S0", 1.0, 0.5, 10, 100), _opt("R", 2.0, 0.0, 40, 400)), live=(0, 3), block="h.0",
             signature="mm[4,4]", segment="seg0")
    b = Node("b", (_opt("S0", 1.0), _opt("R", 0.25, act=7)), live=(1, 2))
    e = Edge("a", "b", ((0.0, 3.0), (1.5, 0.0)))
    return Problem((a, b), (e,), timeline_length=4, mesh_shape=(2, 2), meta={"model": "toy", "layers": 2}, **kw)


def test_evaluate_splits_time_and_takes_the_peak_not_the_sum():
    p = _two_nodes()
    ev = p.evaluate({"a": "S0", "b": "R"})
    assert ev.compute_s == pytest.approx(1.25)
    assert ev.comm_s == pytest.approx(0.5)
    assert ev.reshard_s == pytest.approx(3.0)
    assert ev.objective == pytest.approx(4.75)
    assert ev.param_bytes == 10
    assert (ev.peak_bytes, ev.peak_time) == (10 + 100 + 7, 1)
    disjoint = Problem((p.nodes[0], Node("b", p.nodes[1].options, live=(4, 5))), p.edges, timeline_length=6)
    assert disjoint.evaluate({"a": "R", "b": "R"}).peak_bytes == 40 + 400


def test_replace_derives_a_checked_copy():
    p = _two_nodes(budget_bytes=500)
    q = replace(p, nodes=(p.nodes[0], replace(p.nodes[1], live=(1, 3))))
    assert (q.budget_bytes, q.meta, q.edges) == (500, p.meta, p.edges)
    assert q.evaluate({"a": "S0", "b": "R"}).activations == (100, 107, 107, 107)
    assert p.with_budget(None) == replace(p, budget_bytes=None)
    with pytest.raises(ValueError, match="outside the timeline"):
        replace(p, timeline_length=3)


def test_problem_json_round_trip_keeps_everything():
    p = _two_nodes(budget_bytes=1 << 30)
    q = Problem.from_json(p.to_json())
    assert q == p
    assert q.meta_dict == {"model": "toy", "layers": 2}
    assert q.node("a").options[0] == _opt("S0", 1.0, 0.5, 10, 100)
    assert q.node("a").segment == "seg0" and q.node("a").block == "h.0"


def test_solution_json_round_trip():
    s = Solution(choice={"a": "S0", "b": "R"}, objective=4.75, lp_bound=4.5, dual_bound=4.6, gap=0.03,
                 status="feasible", backend="cbc", timings={"build_s": 0.1, "solve_s": 2.0}, peak_bytes=117,
                 num_variables=8, num_constraints=5, recompute=("seg0",), stats={"num_groups": 2})
    assert Solution.from_json(s.to_json()) == s
    assert "feasible (cbc)" in str(s)


@pytest.mark.parametrize("make, needle", [
    (lambda: _opt("x", -1.0), "compute_s must be a finite number >= 0, got -1.0"),
    (lambda: _opt("x", float("nan")), "got nan"),
    (lambda: _opt("x", 1.0, param=1.5), "param_bytes must be an int >= 0, got 1.5"),
    (lambda: Node("n", ()), "node 'n' has no options"),
    (lambda: Node("n", (_opt("a", 1), _opt("a", 2))), "duplicate option names ['a', 'a']"),
    (lambda: Node("n", (_opt("a", 1, act=5),)), "has act_bytes but no live interval"),
    (lambda: Node("n", (_opt("a", 1),), live=(3, 2)), "got (3, 2)"),
    (lambda: Edge("a", "a", ((0.0,),)), "self-loop"),
    (lambda: Edge("a", "b", ((0.0, 1.0), (0.0,))), "row lengths [2, 1]"),
])
def test_bad_records_are_rejected_with_the_values(make, needle):
    with pytest.raises(ValueError) as info:
        make()
    assert needle in str(info.value)


def test_bad_problems_are_rejected_with_the_values():
    p = _two_nodes()
    a, b = p.nodes
    with pytest.raises(ValueError, match="duplicate node name 'a'"):
        Problem((a, a))
    with pytest.raises(ValueError, match="unknown node 'c'"):
        Problem((a, b), (Edge("a", "c", ((0.0,),)),), timeline_length=4)
    with pytest.raises(ValueError, match="cost matrix is 1x2, nodes have 2x2 options"):
        Problem((a, b), (Edge("a", "b", ((0.0, 1.0),)),), timeline_length=4)
    with pytest.raises(ValueError, match="duplicate edge 'a' -> 'b'"):
        Problem((a, b), (p.edges[0], p.edges[0]), timeline_length=4)
    with pytest.raises(ValueError, match=r"live \(0, 3\) outside the timeline 0..2"):
        Problem((a, b), timeline_length=3)
    with pytest.raises(ValueError, match="budget_bytes must be an int >= 0, got -5"):
        Problem((a, b), timeline_length=4, budget_bytes=-5)
    with pytest.raises(ValueError, match=r"missing \['b'\]"):
        p.evaluate({"a": "S0"})
    with pytest.raises(ValueError, match="node 'b' has no option 'S1'"):
        p.evaluate({"a": "S0", "b": "S1"})
    with pytest.raises(ValueError, match="version 7 is not supported"):
        Problem.from_json('{"version": 7}')
    with pytest.raises(ValueError, match="status must be one of"):
        Solution({}, 0.0, 0.0, 0.0, 0.0, "infeasible", "cbc", {}, 0, 0, 0)
