"""Rotor checkpointing: C extension vs Python reference on one long chain.

Builds a deterministic transformer-like chain (``--stages`` stages, default 100: an embedding,
alternating attention / MLP stages with heterogeneous times, activation and tape sizes, and a
loss), sets the budget to ``--fraction`` of its no-recompute peak (default 0.5; raised to the
minimum budget if that is below), solves it with ``num_slots = --slots`` (default 500) in C and
in Python, checks both return the same schedule, and prints the median wall time of each —
both for the DP tables alone and for the whole ``solve_rotor`` — and the speed-up ratio.

Then, for GPT-2-tiny (4 layers, batch 8, seq 128, the gloo recompute test's model) on a mesh of 2,
at budgets of 100/70/50/35% of the no-recompute plan's peak: autopar's plan (``checkpoint="auto"``:
sharding and recompute together) — estimated step time, overhead versus no recompute, peak, the
recomputed units — next to uniform per-block checkpointing (every transformer block recomputed,
sharding re-solved for it) in the same cost model (``autopar.planner.checkpointing.estimate``).

    .venv/bin/python benchmarks/checkpoint.py [--stages 100] [--slots 500] [--fraction 0.5]
        [--repeats 9] [--python-repeats 1] [--no-gpt2] [--jsonl out.jsonl]
    .venv/bin/python benchmarks/checkpoint.py --llama70b [--layers 80]

``--llama70b`` (issue 17): the Llama-70B shape (hidden 8192, batch 16 x seq 4096) on 16 nodes x
8 H100 80GiB planned with ``checkpoint="none"`` and ``"auto"`` from one trace and profile: wall
seconds of each (strategies + search), the seconds per planning stage, the candidates, and
whether both give the same plan. The trace and profile are timed once, apart.

On a shared 2-core machine the C timings are noisy: the median of --repeats runs is quoted.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autopar.solver import rotor as checkpoint  # noqa: E402
from autopar.solver.rotor import Chain, Op, min_budget, simulate, solve_rotor  # noqa: E402

MiB = 1024**2


def transformer_like_chain(num_stages: int, *, seed: int = 0) -> Chain:
    """Stage 0 embeds, the last is the loss, the rest alternate attention and MLP."""
    rng = random.Random(seed)
    fwd, bwd, out, tape, ftmp, btmp, names = [], [], [], [], [], [], []
    hidden = 16 * MiB
    for i in range(num_stages):
        jitter = rng.uniform(0.8, 1.25)
        if i == num_stages - 1:  # loss: logits in the tape, a scalar out
            kind, f, o, t, u, v = "loss", 4e-3, 4, 8 * hidden, 4 * hidden, 8 * hidden
        elif i == 0:
            kind, f, o, t, u, v = "embed", 5e-4, hidden, hidden, 0, hidden
        elif i % 2:
            kind, f, o, t, u, v = "attn", 6e-3, hidden, 5 * hidden, 2 * hidden, 3 * hidden
        else:
            kind, f, o, t, u, v = "mlp", 8e-3, hidden, 9 * hidden, 4 * hidden, 4 * hidden
        fwd.append(f * jitter)
        bwd.append(2 * f * jitter * rng.uniform(0.9, 1.1))
        out.append(o)
        tape.append(max(o, int(t * jitter)))
        ftmp.append(int(u * jitter))
        btmp.append(int(v * jitter))
        names.append(f"{kind}{i}")
    return Chain(fwd_time_s=fwd, bwd_time_s=bwd, input_bytes=hidden // 4, output_bytes=out,
                 saved_bytes=tape, fwd_tmp_bytes=ftmp, bwd_tmp_bytes=btmp, names=names)


def gpt2_tiny_budgets(fractions=(1.0, 0.7, 0.5, 0.35)) -> list[dict]:
    """autopar's plan vs uniform per-block checkpointing for GPT-2-tiny at each budget."""
    import torch

    from autopar import zoo
    from autopar.api import PlanOptions, plan_model
    from autopar.api import plan as make_plan
    from autopar.planner.checkpointing import estimate
    from autopar.layout.blocks import block_of as block_of_segment
    from autopar.solver.driver import solve

    torch.manual_seed(0)
    model, inputs = zoo.build("gpt2", tiny=True, batch=8, seq=128, num_layers=4, device="cpu")
    result = plan_model(model, inputs, mesh=(2,), options=PlanOptions(checkpoint="none"))
    base, built = result.plan, result.built
    blocks = sorted({block_of_segment(n.segment) for n in built.problem.nodes if n.segment})
    rows = []
    for frac in fractions:
        budget = int(frac * base.estimate.peak_bytes)
        p = make_plan(model, inputs, mesh=(2,), memory_budget=budget, checkpoint="auto")
        try:
            uni = solve(built.problem.with_budget(budget), recompute_inputs=built.segment_inputs,
                        fixed={b: True for b in blocks})
            uni_ev = estimate(built, built.problem, uni.choice, uni.recompute, built.segment_inputs)
            uniform_s, uniform_peak = uni_ev.objective, uni_ev.peak_bytes
        except ValueError:  # uniform checkpointing does not fit this budget
            uniform_s = uniform_peak = None
        rows.append({"fraction": frac, "budget_bytes": budget, "step_s": p.estimate.step_s,
                     "no_recompute_step_s": base.estimate.step_s, "peak_bytes": p.estimate.peak_bytes,
                     "activation_bytes": p.checkpoint.get("activation_bytes"),
                     "method": p.checkpoint.get("method"), "units": [r.name for r in p.recompute],
                     "uniform_step_s": uniform_s, "uniform_peak_bytes": uniform_peak})
    return rows


def print_gpt2_rows(rows: list[dict]) -> None:
    base = rows[0]["no_recompute_step_s"]
    print(f"\nGPT-2-tiny (4 layers, batch 8, seq 128) on mesh (2,): no-recompute step "
          f"{base * 1e3:.3f} ms (estimate)")
    print(f"{'budget':>7}{'MiB':>8}{'autopar ms':>12}{'overhead':>10}{'peak MiB':>10}{'uniform ms':>12}"
          f"{'overhead':>10}  method / recomputed units")
    for r in rows:
        uni = r["uniform_step_s"]
        uni_s = f"{uni * 1e3:>12.3f}{uni / base - 1:>10.1%}" if uni is not None else f"{'does not fit':>22}"
        print(f"{r['fraction']:>7.0%}{r['budget_bytes'] / MiB:>8.2f}{r['step_s'] * 1e3:>12.3f}"
              f"{r['step_s'] / base - 1:>10.1%}{r['peak_bytes'] / MiB:>10.2f}{uni_s}  "
              f"{r['method']}: {', '.join(r['units']) or '-'}")
        if uni is not None and r["step_s"] > uni + 1e-12:
            print(f"  WORSE THAN UNIFORM at {r['fraction']:.0%}", file=sys.stderr)


def llama70b_case(layers: int = 80) -> dict:
    """Issue 17's planning case (module docstring): one trace and profile, then both modes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from autopar.api import PlanOptions, Progress, plan_traced
    from autopar.layout.mesh import MeshSpec
    from autopar.tracer import profile, trace

    cfg = LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=layers,
                      num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192,
                      rope_theta=500000.0, tie_word_embeddings=False, attn_implementation="sdpa")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    ids = torch.zeros(16, 4096, dtype=torch.long, device="meta")
    mesh = MeshSpec.cluster(nodes=16, devices_per_node=8)
    start = time.perf_counter()
    traced = trace(model, {"input_ids": ids, "labels": ids})
    prof = profile(traced)
    row = {"layers": layers, "trace_profile_s": time.perf_counter() - start}
    plans = {}
    for mode in ("none", "auto"):
        progress = Progress(verbose=True)
        start = time.perf_counter()
        res = plan_traced(traced, prof, mesh=mesh, options=PlanOptions(memory_budget="80GiB", checkpoint=mode),
                          progress=progress)
        plans[mode] = res
        row[f"{mode}_s"] = time.perf_counter() - start
        row[f"{mode}_stages_s"] = dict(progress.timings)
        row[f"{mode}_step_s"] = res.recompute.evaluation.objective
        row[f"{mode}_method"] = res.recompute.method
    auto = plans["auto"].recompute
    row["auto_candidates"] = auto.info.get("candidates", {})
    row["auto_search"] = {k: auto.info[k] for k in ("rotor_solves", "region_sets_evaluated", "region_sets_pruned",
                                                     "refinements_pruned") if k in auto.info}
    row["same_plan"] = auto.choice == plans["none"].recompute.choice and not auto.units
    return row


def _timed(fn, repeats: int):
    """Median wall seconds over ``repeats`` calls, and the last call's result."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def _slotted_budget(chain: Chain, budget: int, num_slots: int, full_peak: int) -> int:
    """``budget``, or the first budget up from it (1% steps) that ``num_slots`` slots can meet.

    At exactly the chain's minimum budget, rounding sizes up to slots can lose the few bytes that
    made it feasible (short chains hit this), and ``solve_rotor`` says so; the benchmark then
    times the nearest budget it can solve and prints it."""
    start = budget
    while True:
        try:
            solve_rotor(chain, budget, num_slots=num_slots)
        except ValueError:
            if budget >= full_peak:
                raise
            budget = min(full_peak, budget + max(start // 100, 1))
            continue
        if budget != start:
            print(f"budget raised from {start / MiB:.1f} to {budget / MiB:.1f} MiB: {num_slots} slots "
                  f"cannot meet the smaller one", file=sys.stderr)
        return budget


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=100)
    parser.add_argument("--slots", type=int, default=500)
    parser.add_argument("--fraction", type=float, default=0.5,
                        help="budget as a fraction of the no-recompute peak")
    parser.add_argument("--repeats", type=int, default=9, help="timed runs of the C solver")
    parser.add_argument("--python-repeats", type=int, default=1,
                        help="timed runs of the Python reference (slow)")
    parser.add_argument("--jsonl", type=Path, default=None, help="append one JSON row")
    parser.add_argument("--no-gpt2", action="store_true", help="skip the GPT-2-tiny budget table")
    parser.add_argument("--llama70b", action="store_true", help="only the issue-17 planning case")
    parser.add_argument("--layers", type=int, default=80, help="layers of the --llama70b model")
    args = parser.parse_args(argv)
    if args.llama70b:
        row = llama70b_case(args.layers)
        print(json.dumps(row, indent=1))
        if args.jsonl:
            with args.jsonl.open("a") as fh:
                fh.write(json.dumps({"bench": "checkpoint_llama70b", **row}) + "\n")
        return 0
    if args.stages < 2 or args.slots < 1 or not 0 < args.fraction <= 1:
        raise ValueError(f"need --stages >= 2, --slots >= 1, 0 < --fraction <= 1; got "
                         f"{args.stages}, {args.slots}, {args.fraction}")
    if not checkpoint.c_extension_available():
        print("autopar._rotor is not built: run `pip install -e .` first", file=sys.stderr)
        return 1

    chain = transformer_like_chain(args.stages)
    keep_all = [Op("forward_save", i) for i in range(args.stages)] + [
        Op("backward", i) for i in reversed(range(args.stages))]
    full_peak = simulate(chain, keep_all).peak
    budget = _slotted_budget(chain, max(min_budget(chain), int(args.fraction * full_peak)), args.slots, full_peak)

    repeats = {"c": args.repeats, "python": args.python_repeats}
    solve_s, schedules = {}, {}
    for impl in ("c", "python"):
        solve_s[impl], schedules[impl] = _timed(
            lambda: solve_rotor(chain, budget, num_slots=args.slots, impl=impl), repeats[impl])
    if schedules["c"] != schedules["python"]:
        print("MISMATCH: C and Python schedules differ", file=sys.stderr)
        return 1
    sched = schedules["c"]
    sizes = checkpoint._slot_sizes(chain, budget, args.slots)
    mem = args.slots - sizes.act[0]
    dp_s = {impl: _timed(lambda: checkpoint._dp(impl, sizes, mem), repeats[impl])[0]
            for impl in ("c", "python")}

    print(f"{chain}; budget {budget / MiB:.0f} MiB = {budget / full_peak:.0%} of the "
          f"no-recompute peak {full_peak / MiB:.0f} MiB; {args.slots} slots")
    print(f"schedule: time {sched.time_s * 1e3:.1f} ms vs {chain.no_recompute_time_s * 1e3:.1f} ms"
          f" without recompute (+{sched.time_s / chain.no_recompute_time_s - 1:.1%}), peak "
          f"{sched.peak_bytes / MiB:.0f} MiB, {len(sched.recomputed_stages)} stages recomputed, "
          f"{len(sched.ops)} ops; C and Python schedules identical")
    print(f"{'':<14}{'C s':>10}{'Python s':>12}{'speed-up':>10}")
    for label, timing in (("DP tables", dp_s), ("solve_rotor", solve_s)):
        print(f"{label:<14}{timing['c']:>10.4f}{timing['python']:>12.3f}"
              f"{timing['python'] / timing['c']:>9.0f}x")
    if args.jsonl:
        row = {"bench": "checkpoint", "stages": args.stages, "slots": args.slots,
               "budget_bytes": budget, "time_s": sched.time_s,
               "no_recompute_time_s": chain.no_recompute_time_s,
               "dp_c_s": dp_s["c"], "dp_python_s": dp_s["python"],
               "solve_c_s": solve_s["c"], "solve_python_s": solve_s["python"],
               "speedup_dp": dp_s["python"] / dp_s["c"],
               "speedup_solve": solve_s["python"] / solve_s["c"]}
        with args.jsonl.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
    if not args.no_gpt2:
        rows = gpt2_tiny_budgets()
        print_gpt2_rows(rows)
        if args.jsonl:
            with args.jsonl.open("a") as fh:
                for r in rows:
                    fh.write(json.dumps({"bench": "checkpoint_gpt2_tiny", **r}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
