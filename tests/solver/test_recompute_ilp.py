"""The joint sharding + recompute ILP: known answers on small problems, exact agreement with
``Problem.evaluate(..., recompute=...)`` on every feasible choice, and GPT-2-tiny planning across
budgets."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from autopar.solver.problem import Node, Problem, StrategyOption
from autopar.solver.driver import minimum_budget, solve
from autopar.solver.timeline import SegmentInput, segment_geometry


def chain_problem(budget: int | None) -> tuple[Problem, dict]:
    """Two blocks of two ops each (fine segments a/b inside blocks blk.0/blk.1) and a loss op.
    Each op has a cheap (big activation) and an expensive (small activation) option."""
    N = 5
    nodes = []
    for i in range(N - 1):
        blk = f"blk.{i // 2}"
        seg = f"{blk}.{'ab'[i % 2]}"
        nodes.append(Node(f"op{i}", (StrategyOption("fast", 1.0, act_bytes=100, forward_s=0.3),
                                     StrategyOption("slow", 3.0, act_bytes=40, forward_s=1.0)),
                          live=(i, 2 * N - 1 - i), block=blk, signature=f"op{i % 2}", segment=seg))
    nodes.append(Node("loss", (StrategyOption("only", 0.5, act_bytes=10, forward_s=0.1),), live=(N - 1, N)))
    inputs = {"blk.0.a": (), "blk.0.b": (SegmentInput("op0", (20, 20)),),
              "blk.1.a": (SegmentInput("op1", (20, 20)),), "blk.1.b": (SegmentInput("op2", (20, 20)),),
              "blk.0": (), "blk.1": (SegmentInput("op1", (20, 20)),)}
    return Problem(tuple(nodes), (), budget, 2 * N), inputs


def brute_force(problem: Problem, inputs: dict):
    geo = segment_geometry(problem)
    units = sorted(geo)
    best = None
    for picks in itertools.product(*[range(n.num_options) for n in problem.nodes]):
        choice = {n.name: n.options[k].name for n, k in zip(problem.nodes, picks)}
        for mask in itertools.product((0, 1), repeat=len(units)):
            chosen = [u for u, m in zip(units, mask) if m]
            if any(geo[u].parent in chosen for u in chosen):
                continue
            ev = problem.evaluate(choice, recompute=chosen, segment_inputs=inputs)
            if problem.budget_bytes is not None and ev.peak_bytes > problem.budget_bytes:
                continue
            if best is None or ev.objective < best[0] - 1e-12:
                best = (ev.objective, ev.peak_bytes)
    return best


def test_geometry_blocks_and_fine_segments():
    problem, _ = chain_problem(None)
    geo = segment_geometry(problem)
    assert set(geo) == {"blk.0", "blk.1", "blk.0.a", "blk.0.b", "blk.1.a", "blk.1.b"}
    assert geo["blk.0.a"].parent == "blk.0" and geo["blk.0"].parent is None
    assert (geo["blk.0"].start, geo["blk.0"].bwd, geo["blk.0"].end) == (0, 8, 9)
    assert (geo["blk.1.b"].start, geo["blk.1.b"].bwd, geo["blk.1.b"].end) == (3, 6, 6)


def test_evaluate_recompute_by_hand():
    problem, inputs = chain_problem(None)
    fast = {n.name: n.options[0].name for n in problem.nodes}
    base = problem.evaluate(fast)
    ev = problem.evaluate(fast, recompute=["blk.0"], segment_inputs=inputs)
    assert ev.objective == pytest.approx(base.objective + 0.6)
    # blk.0 recomputed: at t=4 (loss) only blk.1 (200) + loss (10) are held; blk.0 keeps no input
    # (its input is none); during blk.0's backward (t=8) op0, op1 are back: 100 + 100.
    assert base.peak_bytes == 410
    assert ev.peak_bytes == 210
    with pytest.raises(ValueError, match="both alone and inside"):
        problem.evaluate(fast, recompute=["blk.0", "blk.0.a"], segment_inputs=inputs)


@pytest.mark.parametrize("budget", [None, 410, 300, 250, 210, 180, 150])
def test_ilp_matches_brute_force(budget):
    problem, inputs = chain_problem(budget)
    want = brute_force(problem, inputs)
    if budget is None:
        with pytest.raises(ValueError, match="needs a memory budget"):
            solve(problem, recompute_inputs=inputs)
        return
    if want is None:
        with pytest.raises(ValueError, match="smallest budget any plan meets"):
            solve(problem, recompute_inputs=inputs)
        return
    for alias in (True, False):
        sol = solve(problem, recompute_inputs=inputs, alias=alias)
        ev = problem.evaluate(sol.choice, recompute=sol.recompute, segment_inputs=inputs)
        assert ev.peak_bytes <= budget
        if not alias:  # aliasing restricts identical blocks to one choice: never better
            assert sol.objective == pytest.approx(want[0], rel=1e-6)
        else:
            assert sol.objective >= want[0] - 1e-9


def test_minimum_budget_recompute_is_tight():
    problem, inputs = chain_problem(0)
    need, _ = minimum_budget(problem, recompute_inputs=inputs)
    solve(problem.with_budget(need), recompute_inputs=inputs)
    assert brute_force(problem.with_budget(need - 1), inputs) is None


def test_fixed_decisions():
    problem, inputs = chain_problem(400)
    sol = solve(problem, recompute_inputs=inputs, fixed={"blk.0": True, "blk.1": True})
    assert set(sol.recompute) == {"blk.0", "blk.1"}
    free = solve(problem, recompute_inputs=inputs)
    assert free.objective <= sol.objective


@pytest.mark.slow
def test_gpt2_tiny_budgets_monotone_and_no_worse_than_uniform_blocks():
    import torch

    from autopar import zoo
    from autopar.api import PlanOptions, plan_model
    from autopar.layout.blocks import block_of as block_of_segment
    from autopar.planner.orchestrate import plan_traced

    torch.manual_seed(0)
    model, inputs = zoo.build("gpt2", tiny=True, batch=8, seq=128, num_layers=4, device="cpu")
    result = plan_model(model, inputs, mesh=(2,), options=PlanOptions(checkpoint="none"))
    base = result.plan
    peak = base.estimate.peak_bytes
    times = [base.estimate.step_s]
    for frac in (0.7, 0.5, 0.35):
        budget = int(frac * peak)
        # recompute is what is tested: a pipeline would meet the budget too. The trace and profile
        # are the unbudgeted plan's (planning does not change them): what plan() would trace again.
        options = PlanOptions(memory_budget=budget, checkpoint="auto", pipeline=1)
        p = plan_traced(result.traced, result.profile, mesh=options.mesh((2,)), options=options).plan
        assert p.estimate.peak_bytes <= budget
        assert p.recompute, f"{frac}: a plan under {frac:.0%} of the no-recompute peak must recompute"
        assert p.estimate.step_s >= times[-1] - 1e-12
        times.append(p.estimate.step_s)
        if frac == 0.5:
            assert p.estimate.step_s <= 1.25 * base.estimate.step_s
            built = result.built
            blocks = sorted({block_of_segment(n.segment) for n in built.problem.nodes if n.segment})
            uniform = solve(built.problem.with_budget(budget), recompute_inputs=built.segment_inputs,
                            fixed={b: True for b in blocks})
            from autopar.planner.checkpointing import estimate

            same_model = estimate(built, built.problem, uniform.choice, uniform.recompute, built.segment_inputs)
            assert p.estimate.step_s <= same_model.objective + 1e-12


def repeated_blocks(num_blocks: int, budget: int | None) -> tuple[Problem, dict]:
    """An embedding, ``num_blocks`` blocks of two ops (fine segments a, c: a wide op and a narrow
    one) and a loss; segment a reads the previous block's output (block 0: the embedding's, so
    block 0's units are not identical to block 1's, though its sharding is aliased)."""
    ops = [("a", (StrategyOption("fast", 1.0, act_bytes=120, forward_s=0.20),
                  StrategyOption("slow", 1.6, act_bytes=60, forward_s=0.35))),
           ("c", (StrategyOption("fast", 0.8, act_bytes=70, forward_s=0.30),
                  StrategyOption("slow", 1.1, act_bytes=40, forward_s=0.40)))]
    n = 2 + 2 * num_blocks
    nodes = [Node("embed", (StrategyOption("only", 0.1, act_bytes=15, forward_s=0.05),), live=(0, 2 * n - 1))]
    inputs: dict = {}
    prev = "embed"
    for i in range(num_blocks):
        blk = f"blk.{i}"
        for k, (kind, options) in enumerate(ops):
            t = 1 + 2 * i + k
            nodes.append(Node(f"{blk}.op{kind}", options, live=(t, 2 * n - 1 - t), block=blk, signature=kind,
                              segment=f"{blk}.{kind}"))
        reads = SegmentInput(prev, (25,) if prev == "embed" else (25, 25))
        inputs.update({blk: (reads,), f"{blk}.a": (reads,),
                       f"{blk}.c": (SegmentInput(f"{blk}.opa", (20, 12)),)})
        prev = f"{blk}.opc"
    nodes.append(Node("loss", (StrategyOption("only", 0.3, act_bytes=10, forward_s=0.05),), live=(n - 1, n)))
    return Problem(tuple(nodes), (), budget, 2 * n), inputs


def brute_force_aliased(problem: Problem, inputs: dict):
    """The optimum over plans whose blocks share their choice (``solve(alias=True)``)."""
    geo = segment_geometry(problem)
    units = sorted(geo)
    masks = [m for m in itertools.product((0, 1), repeat=len(units))
             if not any(geo[u].parent is not None and m[units.index(geo[u].parent)] and bit
                        for u, bit in zip(units, m))]
    best = None
    for pick in itertools.product(("fast", "slow"), repeat=2):
        choice = {n.name: pick["ac".index(n.signature)] if n.block else n.options[0].name for n in problem.nodes}
        for m in masks:
            chosen = [u for u, bit in zip(units, m) if bit]
            ev = problem.evaluate(choice, recompute=chosen, segment_inputs=inputs)
            if ev.peak_bytes <= problem.budget_bytes and (best is None or ev.objective < best - 1e-12):
                best = ev.objective
    return best


@pytest.mark.parametrize("budget", [580, 420, 340])  # fine units only, mixed with whole blocks
def test_symmetry_rows_keep_the_optimum(budget):
    """The ordering rows between identical blocks (``recompute_ilp``, "Symmetry") never cut the
    optimum: same objective with and without them, and the brute-force optimum (four blocks:
    blocks 1-3 identical, block 0 not)."""
    problem, inputs = repeated_blocks(4, budget)
    ordered = solve(problem, recompute_inputs=inputs, symmetry=True)
    free = solve(problem, recompute_inputs=inputs, symmetry=False)
    assert ordered.stats["num_order_rows"] > 0 and free.stats["num_order_rows"] == 0
    assert ordered.objective == pytest.approx(free.objective, rel=1e-9)
    assert ordered.objective == pytest.approx(brute_force_aliased(problem, inputs), rel=1e-9)
    assert ordered.peak_bytes <= budget


def test_tied_model_shares_one_decision_per_block_class():
    """``RecomputeModel(tie=...)``: identical units of identical blocks (blocks 1-5; block 0 reads
    the embedding, so it is its own class) share one recompute column and their products and
    span variables, so the model is smaller than the untied one by the rows it reports shared."""
    from autopar.solver.driver import simplified
    from autopar.solver.recompute_ilp import RecomputeModel

    problem, inputs = repeated_blocks(6, 420)
    reduced = simplified(problem)
    untied = RecomputeModel(reduced, problem, inputs)
    untied.build_fastest(420.0)
    tied = RecomputeModel(reduced, problem, inputs, tie=len(inputs))
    tied.build_fastest(420.0)
    assert len({tied.r[f"blk.{i}.a"] for i in range(1, 6)}) == 1 and tied.r["blk.0.a"] != tied.r["blk.1.a"]
    assert len({tied.r[f"blk.{i}"] for i in range(1, 6)}) == 1 and tied.r["blk.1"] != tied.r["blk.1.a"]
    # block 0's fine segment c reads its own op a, as every block's does: one class with theirs
    assert tied.r["blk.0.c"] == tied.r["blk.5.c"]
    assert len(set(tied.r.values())) == 5 and len(set(untied.r.values())) == 18
    assert tied.shared_rows > 0 and untied.shared_rows == 0
    assert tied.lp.num_rows < untied.lp.num_rows
    runs = RecomputeModel(reduced, problem, inputs, tie=2)  # runs of two identical units: (1, 2), (3, 4), (5)
    runs.build_fastest(420.0)
    assert runs.r["blk.1.a"] == runs.r["blk.2.a"] != runs.r["blk.3.a"] == runs.r["blk.4.a"] != runs.r["blk.5.a"]


@pytest.mark.parametrize("budget", [580, 420, 340])
def test_blockwise_plan_matches_the_full_optimum(budget, monkeypatch):
    """A joint model over ``_BLOCKWISE_ROWS`` is planned from its block classes
    (``dive.blockwise``: the tied relaxation's sharding, then the exact recompute-only and
    sharding steps): a plan of the full model, exactly evaluated, within the budget, here the
    full model's optimum (six blocks: each block decides on its own in the recompute step)."""
    from autopar.solver import driver

    problem, inputs = repeated_blocks(6, budget)
    full = solve(problem, recompute_inputs=inputs)
    assert "blockwise_rounds" not in full.stats  # 18 units: below _BLOCKWISE_UNITS
    monkeypatch.setattr(driver, "_BLOCKWISE_ROWS", 0)
    monkeypatch.setattr(driver, "_BLOCKWISE_UNITS", 0)
    monkeypatch.setattr(driver, "_RSTEP_TIE", 1)  # the finest recompute step: each block on its own
    found = solve(problem, recompute_inputs=inputs)
    assert found.stats["blockwise_rounds"] >= 1 and found.status == "feasible" and found.gap is None
    assert found.objective == pytest.approx(full.objective, rel=1e-9)
    ev = problem.evaluate(found.choice, recompute=found.recompute, segment_inputs=inputs)
    assert ev.objective == pytest.approx(found.objective) and ev.peak_bytes == found.peak_bytes <= budget


def test_budget_below_the_parameters_is_reported_without_a_solve(monkeypatch):
    """A budget below every plan's parameter bytes (each node's fewest: ``parameter_floor``) is
    refused before any model is built on a large problem (``floors.FLOOR_NODES``), naming that floor;
    a small one keeps its exact smallest budget (what a 1-byte budget's error reports)."""
    from autopar.solver import driver, floors

    problem, inputs = repeated_blocks(2, None)
    heavy = tuple(replace(n, options=tuple(replace(o, param_bytes=100 * (k + 1)) for k, o in enumerate(n.options)))
                  if n.block else n for n in problem.nodes)
    problem = replace(problem, nodes=heavy, budget_bytes=300)  # four ops of at least 100 bytes each
    assert driver.parameter_floor(problem) == 400
    with pytest.raises(ValueError, match="smallest budget any plan meets is 605 bytes"):  # exact: with activations
        solve(problem, recompute_inputs=inputs)
    monkeypatch.setattr(floors, "FLOOR_NODES", 1)
    monkeypatch.setattr(driver, "simplified", lambda *a, **k: pytest.fail("solved"))
    for recompute in (inputs, None):
        with pytest.raises(ValueError, match=r"smallest budget any plan meets is at least 400 bytes .*parameters"):
            solve(problem, recompute_inputs=recompute)


def test_floor_model_bounds_the_smallest_peak_and_refuses_a_budget_below_it(monkeypatch):
    """``floor_model``'s relaxation (block classes tied, the end-of-forward row only) is a lower
    bound on the smallest peak with recompute; on the block-class path a budget below it is
    refused at once, naming it."""
    from autopar.solver import driver
    from autopar.solver.ilp import MEM_UNIT
    from autopar.solver.recompute_ilp import floor_model
    from autopar.solver.simplify import simplify

    problem, inputs = repeated_blocks(6, 1)
    model = floor_model(simplify(problem.with_budget(0)), problem, inputs)
    lp = model.run("highs", relax=True, time_limit=10)
    achieved, lower = minimum_budget(problem, recompute_inputs=inputs)
    least = int(lp.value * MEM_UNIT)
    assert 0 < least <= lower <= achieved
    monkeypatch.setattr(driver, "_BLOCKWISE_ROWS", 0)
    monkeypatch.setattr(driver, "_BLOCKWISE_UNITS", 0)
    monkeypatch.setattr(driver, "minimum_budget", lambda *a, **k: pytest.fail("searched for the minimum"))
    want = rf"even with recompute: the smallest budget any plan meets is at least {least} bytes"
    with pytest.raises(ValueError, match=want):
        solve(problem.with_budget(least - 1), recompute_inputs=inputs)
