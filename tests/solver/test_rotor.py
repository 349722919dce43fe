"""Rotor checkpointing: C/Python agreement, brute-force optimality, the simulator, plain data."""

from __future__ import annotations

import functools
import json
import math
import random
import warnings

import numpy as np
import pytest

from autopar.solver import rotor as checkpoint
from autopar.solver.rotor import (Chain, Op, Schedule, c_extension_available, min_budget,
                                       simulate, solve_rotor)


def random_chain(rng: random.Random, num_stages: int, *, scale: int = 1000) -> Chain:
    """Heterogeneous stages; some with equal times and sizes so tie-breaking is exercised."""
    def size(lo=1):
        return rng.choice([lo, rng.randint(lo, scale), rng.randint(lo, scale // 10 + lo)])

    def secs():
        return rng.choice([1e-3, 2e-3, rng.uniform(1e-5, 5e-3), rng.uniform(0, 1e-2)])

    out = [size() for _ in range(num_stages - 1)] + [rng.choice([1, 4, size()])]
    return Chain(
        fwd_time_s=[secs() for _ in range(num_stages)],
        bwd_time_s=[rng.choice([2 * f, secs()]) for f in (secs() for _ in range(num_stages))],
        input_bytes=size(), output_bytes=out,
        saved_bytes=[o + rng.choice([0, size(0), 3 * o]) for o in out],
        fwd_tmp_bytes=[rng.choice([0, size(0)]) for _ in range(num_stages)],
        bwd_tmp_bytes=[rng.choice([0, size(0)]) for _ in range(num_stages)])


def no_recompute_ops(num_stages: int) -> list[Op]:
    return ([Op("forward_save", i) for i in range(num_stages)]
            + [Op("backward", i) for i in reversed(range(num_stages))])


# ------------------------------------------------------------------------ C and Python agree

def test_c_extension_is_built():
    # The agreement test below would compare Python with itself without the extension.
    assert c_extension_available(), "autopar._rotor is missing: run `pip install -e .`"


def test_c_and_python_agree_exactly_on_60_random_chains():
    rng = random.Random(20240611)
    num_feasible = 0
    for case in range(60):
        num_stages = 2 + case % 59  # every length 2..60, some twice or more
        chain = random_chain(rng, num_stages)
        lo = min_budget(chain)
        hi = simulate(chain, no_recompute_ops(num_stages)).peak
        # Mostly feasible budgets (coarse slots lose up to a slot per live item), a few below
        # the minimum so that both implementations must refuse alike.
        budget = lo - 1 if case % 20 == 7 else lo + int(rng.uniform(0.2, 1.0) * (hi - lo))
        # Python's DP is ~L^3/6 * slots steps: fewer slots on long chains keeps this fast.
        num_slots = max(12, min(150, 2_500_000 // num_stages**3))
        results = []
        for impl in ("c", "python"):
            try:
                results.append(solve_rotor(chain, budget, num_slots=num_slots, impl=impl))
            except ValueError as err:
                results.append(str(err))
        assert results[0] == results[1], (case, chain, budget, num_slots)
        if isinstance(results[0], Schedule):
            num_feasible += 1
            assert results[0].peak_bytes <= budget
        else:
            assert "minimum budget" in results[0]
        if case % 10 == 0:  # the full tables too, bit for bit
            sz = checkpoint._slot_sizes(chain, budget, num_slots)
            mem = num_slots - sz.act[0]
            if mem >= 0:
                assert checkpoint._dp("c", sz, mem) == checkpoint._dp("python", sz, mem)
    assert num_feasible >= 45, num_feasible


# ------------------------------------------------------------------------ brute force

@functools.lru_cache(maxsize=None)
def expansions(s: int, t: int) -> tuple[tuple, ...]:
    """The three rules of the schedule space for segment s..t, as task tuples (Op or (s, t))."""
    out = [(Op("forward_save", s), Op("backward", s))] if s == t else [
        (Op("forward_save", s), (s + 1, t), Op("backward", s))]
    for j in range(s + 1, t + 1):
        advance = [Op("forward", s)]
        for i in range(s + 1, j):
            advance += [Op("forward", i), Op("discard", i - 1)]
        out.append((*advance, (j, t), Op("discard", j - 1), (s, j - 1)))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def all_schedules(s: int, t: int) -> tuple[tuple[Op, ...], ...]:
    """Every op sequence of the space for segment s..t (no memory filtering)."""
    result = []
    for tasks in expansions(s, t):
        partial = [()]
        for task in tasks:
            if isinstance(task, Op):
                partial = [p + (task,) for p in partial]
            else:
                partial = [p + q for p in partial for q in all_schedules(*task)]
        result += partial
    return tuple(result)


def brute_force_enumerate(chain: Chain, budget: int) -> tuple[float, tuple[Op, ...] | None]:
    best_time, best_ops = math.inf, None
    for ops in all_schedules(0, chain.num_stages - 1):
        sim = simulate(chain, ops)
        if sim.peak <= budget and sim.time_s < best_time:
            best_time, best_ops = sim.time_s, ops
    return best_time, best_ops


def brute_force_search(chain: Chain, budget: int, *, below: float = math.inf) -> float:
    """Least simulated time of a fitting schedule of the space that is < ``below`` (else inf).

    Depth-first over the same space, executing ops with the simulator's step rule. Pruning is
    safe: a prefix whose peak already exceeds the budget cannot fit, and a prefix whose time
    plus a lower bound on the remaining work (every stage not yet back-propagated still needs
    its backward, and its forward unless its tape is held) is >= the best so far cannot win.
    """
    sz = checkpoint._byte_sizes(chain)
    best = [below]

    def lower_bound(state) -> float:
        held, _, _, time_s = state
        done = min(k for kind, k in held if kind == "g")
        return time_s + sum(sz.bwd[i] + (0.0 if ("tape", i) in held else sz.fwd[i])
                            for i in range(done))

    def search(tasks: tuple, state) -> None:
        if state[2] > budget or lower_bound(state) >= best[0]:
            return
        if not tasks:
            assert state[0] == {("g", 0)}
            best[0] = state[3]
            return
        head, rest = tasks[0], tasks[1:]
        if isinstance(head, Op):
            search(rest, checkpoint._apply(sz, state, head))
        else:
            for expansion in expansions(*head):
                search(expansion + rest, state)

    search(((0, chain.num_stages - 1),), checkpoint._initial_state(sz))
    return best[0] if best[0] < below else math.inf


def budgets_between(chain: Chain, rng: random.Random, count: int) -> list[int]:
    lo = min_budget(chain)
    hi = simulate(chain, no_recompute_ops(chain.num_stages)).peak
    return sorted({lo, hi, *(rng.randint(lo, hi) for _ in range(count))})


def test_schedule_space_size_matches_schroeder_numbers():
    # The space's recurrence N(n) = N(n-1) + sum_k N(k) N(n-k) gives the large Schroeder numbers.
    assert [len(all_schedules(0, n - 1)) for n in range(1, 8)] == [1, 2, 6, 22, 90, 394, 1806]


def test_rotor_equals_exhaustive_enumeration_on_short_chains():
    """Brute force over the *whole* space: every op sequence that the recurrence's rules can
    generate for the chain (``all_schedules``: for a segment s..t holding x_s and g_{t+1},
    either F_s, a schedule of s+1..t, B_s — just F_s B_s when s == t — or, for any j in s+1..t,
    f_s..f_{j-1} dropping each intermediate, a schedule of j..t, D_{j-1}, a schedule of
    s..j-1), generated with no memory filtering, each executed by ``simulate`` (which knows
    nothing of the DP); the optimum is the least simulated time whose simulated peak fits.
    Budgets: the optimum only changes at peaks some schedule reaches, so the sweep takes those
    (all of them, or 30 spread out on the longer chains). Exact discretisation: integer sizes
    and ``num_slots == budget`` make one slot one byte."""
    rng = random.Random(7)
    for num_stages in range(1, 8):
        for _ in range(12 if num_stages < 6 else 2):
            chain = random_chain(rng, num_stages, scale=60)
            sims = [(simulate(chain, ops), ops) for ops in all_schedules(0, num_stages - 1)]
            peaks = sorted({sim.peak for sim, _ in sims})
            assert min_budget(chain) == peaks[0]
            step = max(1, len(peaks) // 30)
            for budget in {*peaks[::step], peaks[-1]}:
                best_time = min(sim.time_s for sim, _ in sims if sim.peak <= budget)
                sched = solve_rotor(chain, budget, num_slots=budget)
                assert sched.peak_bytes <= budget
                assert math.isclose(sched.time_s, best_time, rel_tol=1e-12), (
                    chain, budget, sched)
                assert sched.ops in all_schedules(0, num_stages - 1)
            with pytest.raises(ValueError, match=f"minimum budget {peaks[0]} bytes"):
                solve_rotor(chain, peaks[0] - 1, num_slots=peaks[0] - 1)


def test_search_agrees_with_enumeration():
    rng = random.Random(3)
    for num_stages in (5, 6):
        chain = random_chain(rng, num_stages, scale=60)
        for budget in budgets_between(chain, rng, 3):
            assert brute_force_search(chain, budget) == brute_force_enumerate(chain, budget)[0]


def test_rotor_equals_brute_force_on_12_stage_chains():
    """The same space and semantics as the enumeration test (5,293,446 schedules at 12
    stages), searched depth-first by ``brute_force_search``, seeded with Rotor's time so the
    bound prunes hard: no fitting schedule is faster than Rotor's by more than 1e-12 relative,
    and the search (which knows nothing of the DP) does reach a schedule of Rotor's time."""
    rng = random.Random(12)
    for _ in range(2):
        chain = random_chain(rng, 12, scale=60)
        lo = min_budget(chain)
        hi = simulate(chain, no_recompute_ops(12)).peak
        for budget in (lo, (3 * lo + hi) // 4, (lo + hi) // 2, hi):
            sched = solve_rotor(chain, budget, num_slots=budget)
            assert sched.peak_bytes <= budget
            assert brute_force_search(chain, budget, below=sched.time_s * (1 - 1e-12)) == math.inf
            found = brute_force_search(chain, budget, below=sched.time_s * (1 + 1e-12))
            assert math.isclose(found, sched.time_s, rel_tol=1e-12), (chain, budget, sched)


# ------------------------------------------------------------------------ properties

def small_chain() -> Chain:
    return Chain(fwd_time_s=[1e-3, 2e-3, 1e-3, 3e-3], bwd_time_s=[2e-3, 4e-3, 2e-3, 5e-3],
                 input_bytes=100, output_bytes=[100, 200, 100, 4],
                 saved_bytes=[300, 400, 300, 104], fwd_tmp_bytes=[0, 50, 0, 10],
                 bwd_tmp_bytes=[20, 0, 0, 0], names=["embed", "block0", "block1", "loss"])


def test_ample_budget_keeps_everything():
    chain = small_chain()
    sched = solve_rotor(chain, 10**6)
    assert list(sched.ops) == no_recompute_ops(4)
    assert sched.kept_stages == (0, 1, 2, 3) and sched.recomputed_stages == ()
    assert sched.num_forwards == (1, 1, 1, 1)
    assert math.isclose(sched.time_s, chain.no_recompute_time_s, rel_tol=1e-15)
    # B2's peak: input 100, tapes 0-2 (1000), g_3 (100), and the g_2 it allocates (200)
    assert sched.peak_bytes == simulate(chain, no_recompute_ops(4)).peak == 100 + 1000 + 100 + 200


def test_time_never_falls_as_the_budget_shrinks():
    rng = random.Random(11)
    chain = random_chain(rng, 9, scale=60)
    lo, previous = min_budget(chain), 0.0
    hi = simulate(chain, no_recompute_ops(9)).peak
    for budget in range(hi, lo - 1, -max(1, (hi - lo) // 12)):
        sched = solve_rotor(chain, budget, num_slots=budget)  # exact: one slot per byte
        assert sched.time_s >= previous - 1e-15 and sched.peak_bytes <= budget
        previous = sched.time_s
    assert previous > chain.no_recompute_time_s  # the tightest budget does recompute


def test_coarse_slots_round_conservatively():
    rng = random.Random(5)
    for case in range(40):
        chain = random_chain(rng, 2 + case % 15)
        lo = min_budget(chain)
        budget = lo + rng.randint(0, 3 * lo)
        try:
            sched = solve_rotor(chain, budget, num_slots=rng.choice([7, 20, 64]))
        except ValueError as err:
            assert "num_slots" in str(err)  # rounding lost too much, the budget is not < min
            continue
        assert sched.peak_bytes <= budget
        assert simulate(chain, sched.ops).peak == sched.peak_bytes


def test_infeasible_budgets_name_the_minimum():
    chain = small_chain()
    lowest = min_budget(chain)
    assert solve_rotor(chain, lowest, num_slots=lowest).peak_bytes == lowest
    with pytest.raises(ValueError, match=f"below the minimum budget {lowest} bytes"):
        solve_rotor(chain, lowest - 1)
    with pytest.raises(ValueError, match="raise num_slots"):
        solve_rotor(chain, lowest, num_slots=3)
    with pytest.raises(ValueError, match="below the minimum budget"):
        solve_rotor(chain, 50)  # smaller than the input alone


def test_schedule_str_and_json_round_trip():
    chain = small_chain()
    sched = solve_rotor(chain, 1000, num_slots=1000)
    assert sched.recomputed_stages == (0, 1)  # the budget forces recomputation
    text = str(sched)
    assert "Rotor schedule: 4 stages" in text and "of 1000 B (1000 slots)" in text
    assert "kept: 2-3" in text and "recomputed: 0-1 (2 extra forwards)" in text
    assert "ops: " + " ".join(str(op) for op in sched.ops) in text
    assert Schedule.from_json(json.loads(json.dumps(sched.to_json()))) == sched
    assert Schedule.from_json(json.dumps(sched.to_json())) == sched
    assert Chain.from_json(json.dumps(chain.to_json())) == chain
    assert "4 stages" in str(chain) and chain.stage_name(1) == "block0"
    assert [str(Op(k, 3)) for k in ("forward", "forward_save", "backward", "discard")] == [
        "f3", "F3", "B3", "D3"]


def test_bad_inputs_raise_value_errors_with_the_values():
    good = small_chain().to_json()
    for field_name, value, message in [
            ("fwd_time_s", [1e-3, float("nan"), 1e-3, 1e-3], r"fwd_time_s\[1\] = nan"),
            ("bwd_time_s", [1e-3, -1.0, 1e-3, 1e-3], r"bwd_time_s\[1\] = -1.0"),
            ("output_bytes", [100, 200, 100], "output_bytes has 3 entries, expected 4"),
            ("saved_bytes", [300, 100, 300, 104], r"saved_bytes\[1\] = 100 < output_bytes\[1\]"),
            ("fwd_tmp_bytes", [0, 1.5, 0, 0], r"fwd_tmp_bytes\[1\] = 1.5"),
            ("input_bytes", -3, r"input_bytes\[0\] = -3"),
            ("names", ["a"], "names has 1 entries")]:
        with pytest.raises(ValueError, match=message):
            Chain(**{**good, field_name: value})
    numpy_chain = Chain(**{**good, "output_bytes": np.array(good["output_bytes"]),
                           "fwd_time_s": np.array(good["fwd_time_s"], dtype=np.float32)})
    assert numpy_chain.output_bytes == small_chain().output_bytes
    assert all(type(v) is int for v in numpy_chain.output_bytes)
    assert all(type(v) is float for v in numpy_chain.fwd_time_s)
    with pytest.raises(ValueError, match="at least one stage"):
        Chain(**{k: ([] if isinstance(v, list) else v) for k, v in good.items()})
    chain = small_chain()
    with pytest.raises(ValueError, match="budget_bytes = 0"):
        solve_rotor(chain, 0)
    with pytest.raises(ValueError, match="num_slots = 2.5"):
        solve_rotor(chain, 10**6, num_slots=2.5)
    with pytest.raises(ValueError, match="impl = 'fortran'"):
        solve_rotor(chain, 10**6, impl="fortran")
    with pytest.raises(ValueError, match="op kind 'jump'"):
        Op("jump", 0)


def test_simulator_refuses_illegal_schedules():
    chain = small_chain()
    for ops, message in [
            ([Op("backward", 3)], "input x_3 of stage 3 is not in memory"),
            ([Op("forward", 0), Op("forward", 1), Op("forward", 2), Op("backward", 3)],
             "needs tape 3"),
            ([Op("forward", 1)], "input x_1 of stage 1 is not in memory"),
            ([Op("forward_save", 0), Op("forward_save", 0)], "already in memory"),
            ([Op("discard", 0)], "not held as a plain activation"),
            ([Op("forward", 7)], "outside the chain of 4 stages"),
            (no_recompute_ops(4)[:-1], "never produced"),
            ([Op("forward", 0), *no_recompute_ops(4)], r"holds \[\('x', 1\)\]")]:
        with pytest.raises(ValueError, match=message):
            simulate(chain, ops)
    # a legal schedule outside Rotor's space: recompute stage 0 while its tape is dropped
    ops = [Op("forward", 0), Op("forward_save", 1), Op("forward_save", 2), Op("forward_save", 3),
           Op("backward", 3), Op("backward", 2), Op("backward", 1), Op("discard", 0),
           Op("forward_save", 0), Op("backward", 0)]
    sim = simulate(chain, ops)
    assert math.isclose(sim.time_s, chain.no_recompute_time_s + 1e-3, rel_tol=1e-12)


def test_c_extension_validates_its_arguments():
    rotor = checkpoint._rotor_c
    args = ([1.0, 1.0], [1.0, 1.0], [1, 1, 1], [1, 1], [0, 0], [0, 0], 10, [0, 1, 2], 3)
    cost, choice = rotor.solve(*args)
    assert len(cost) == 3 * 11 * 8 and len(choice) == 3 * 11 * 4
    with pytest.raises(ValueError, match="act has 2 entries, expected 3"):
        rotor.solve(*args[:2], [1, 1], *args[3:])
    with pytest.raises(ValueError, match="is not a finite time"):
        rotor.solve([1.0, math.inf], *args[1:])
    with pytest.raises(ValueError, match=r"saved\[1\] = -1 is negative"):
        rotor.solve(*args[:3], [1, -1], *args[4:])
    with pytest.raises(ValueError, match="mem = -1 slots"):
        rotor.solve(*args[:6], -1, *args[7:])
    with pytest.raises(ValueError, match="rows has 2 entries, expected 3"):
        rotor.solve(*args[:7], [0, 1], 3)
    with pytest.raises(ValueError, match=r"rows\[2\] = 3 is not below num_rows = 3"):
        rotor.solve(*args[:7], [0, 1, 3], 3)
    with pytest.raises(ValueError, match="num_rows = 4 must be in"):
        rotor.solve(*args[:8], 4)


def periodic_chain(num_blocks: int, *, head: int = 1, tail: int = 1, seed: int = 0) -> Chain:
    """``head`` stages, ``num_blocks`` copies of one 3-stage block, ``tail`` stages: a
    transformer's shape (embedding, identical layers, loss)."""
    rng = random.Random(seed)
    block = random_chain(rng, 3)
    edge = random_chain(rng, head + tail)

    def pick(c, idx):
        return [c.fwd_time_s[idx], c.bwd_time_s[idx], c.output_bytes[idx], c.saved_bytes[idx],
                c.fwd_tmp_bytes[idx], c.bwd_tmp_bytes[idx]]

    stages = [pick(edge, i) for i in range(head)] + [pick(block, i % 3) for i in range(3 * num_blocks)] + \
        [pick(edge, head + i) for i in range(tail)]
    cols = list(zip(*stages))
    return Chain(fwd_time_s=cols[0], bwd_time_s=cols[1], input_bytes=edge.input_bytes, output_bytes=cols[2],
                 saved_bytes=cols[3], fwd_tmp_bytes=cols[4], bwd_tmp_bytes=cols[5])


def test_repeated_blocks_share_rows_and_give_the_full_tables():
    """A periodic chain stores ~period x L rows, and every subchain's row equals the row the
    DP computes when each subchain gets its own (checked against a map with no sharing)."""
    chain = periodic_chain(8)
    num_stages = chain.num_stages
    budget = (min_budget(chain) + simulate(chain, no_recompute_ops(num_stages)).peak) // 2
    sz = checkpoint._slot_sizes(chain, budget, 60)
    mem = 60 - sz.act[0]
    rows, starts = checkpoint._row_map(sz)
    num_all = num_stages * (num_stages + 1) // 2
    assert len(starts) < 5 * num_stages < num_all
    own = checkpoint.array("q", range(num_all))
    width = mem + 1
    for impl in ("c", "python"):
        cost, choice, got_rows, _ = checkpoint._dp(impl, sz, mem)
        assert got_rows == rows
        solver = checkpoint._rotor_c.solve if impl == "c" else checkpoint._dp_python
        full_cost, full_choice = solver(sz.fwd, sz.bwd, sz.act, sz.tape, sz.fwd_tmp, sz.bwd_tmp, mem, own, num_all)
        cost, choice = memoryview(cost).cast("d"), memoryview(choice).cast("i")
        full_cost, full_choice = memoryview(full_cost).cast("d"), memoryview(full_choice).cast("i")
        for t in range(num_stages):
            for s in range(t + 1):
                r, shift = rows[checkpoint._tri(s, t)], s - starts[rows[checkpoint._tri(s, t)]]
                f = checkpoint._tri(s, t)
                assert cost[r * width:(r + 1) * width].tobytes() == full_cost[f * width:(f + 1) * width].tobytes()
                assert [j + shift if j > 0 else j for j in choice[r * width:(r + 1) * width]] == \
                    list(full_choice[f * width:(f + 1) * width])
    # the schedule equals the one found by an exhaustive search on a short periodic chain
    short = periodic_chain(2, seed=3)
    lo, hi = min_budget(short), simulate(short, no_recompute_ops(short.num_stages)).peak
    for budget in (lo, (lo + hi) // 2, hi):
        got = solve_rotor(short, budget, num_slots=budget)
        assert math.isclose(got.time_s, brute_force_enumerate(short, budget)[0], rel_tol=1e-12)


def test_python_fallback_warns_once(monkeypatch):
    chain = small_chain()
    expected = solve_rotor(chain, 1000, impl="c")
    monkeypatch.setattr(checkpoint, "_rotor_c", None)
    monkeypatch.setattr(checkpoint, "_warned_fallback", False)
    assert not c_extension_available()
    with pytest.warns(RuntimeWarning, match="autopar._rotor .* is not built"):
        assert solve_rotor(chain, 1000) == expected
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert solve_rotor(chain, 1000) == expected  # no second warning
    with pytest.raises(ImportError, match="impl='c'"):
        solve_rotor(chain, 1000, impl="c")
