"""Planning at tight memory budgets: every sweep architecture at 1.1x its smallest feasible budget.

Usage:
  python benchmarks/tight_budget.py                                  # the sweep's whole catalog
  python benchmarks/tight_budget.py --models LlamaForCausalLM,T5ForConditionalGeneration
  python benchmarks/tight_budget.py --models deepseek-v3-tiny --factor 1.2 --jsonl out.jsonl

For each architecture (``tests/sweeps/hf_catalog.py``: tiny default configs; ``deepseek-v3-tiny``
is the 2-layer DeepseekV3 of the tight-budget issue) the model is traced and profiled once, the
smallest feasible budget on the mesh is read off the ``ValueError`` the planner raises below it
(``autopar.plan`` at a 1-byte budget; ``autopar.solver.driver.minimum_budget`` when the message
names no figure), then the model is planned at ``--factor`` (1.1) x that budget. Printed per
model: the minimum budget, the plan's seconds (trace + profile + ``plan_traced``, i.e. what one
``autopar.plan`` call costs), its solver status and gap, the estimated step time and peak, the
recompute method. One JSONL record per model (``--jsonl``). Default mesh: ``(2, 2)`` on the
``cpu`` preset, as ``autopar.plan(model, inputs, mesh=(2, 2))`` plans it; ``--preset sweep`` is
the sweep harness's mesh (``tests/sweeps/harness.fast_mesh``: nearly free links, slow compute,
so that every op a rule can split is split). Ops without a sharding rule are replicated
(``allow_replicate_fallback``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

EXTRA = ("deepseek-v3-tiny",)


def build_deepseek():
    """The issue's 2-layer DeepseekV3 (one dense layer, one MoE layer), eval mode, int64 ids."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=101, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        n_shared_experts=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=64)
    ids = torch.randint(0, 101, (4, 16))
    return DeepseekV3ForCausalLM(config).eval(), {"input_ids": ids, "labels": ids}


def builders(names: list[str] | None):
    from tests.sweeps import hf_catalog

    known = {a.model: (lambda a=a: hf_catalog.build(a)) for a in hf_catalog.ARCHS}
    known["deepseek-v3-tiny"] = build_deepseek
    if names is None:
        return [(n, b) for n, b in known.items() if n not in EXTRA]
    missing = [n for n in names if n not in known]
    if missing:
        raise SystemExit(f"tight_budget.py: unknown models {missing}; known: {', '.join(known)}")
    return [(n, known[n]) for n in names]


_NEEDS = re.compile(r"smallest budget any plan meets is (?:between \d+ and )?(\d+) bytes")


def smallest_budget(traced, prof, mesh, options) -> tuple[int, str]:
    """The smallest feasible budget (bytes) and where it came from: the planner's ValueError
    below every plan (its achieved figure when it gives a range), else ``minimum_budget``."""
    from dataclasses import replace

    from autopar.api import plan_traced

    try:
        plan_traced(traced, prof, mesh=mesh, options=replace(options, memory_budget=1))
    except ValueError as exc:
        found = _NEEDS.search(str(exc))
        if found:
            return int(found.group(1)), "ValueError"
    from autopar.planner.builder import build_problem
    from autopar.solver.driver import minimum_budget

    built = build_problem(traced, prof, options.mesh(mesh), budget_bytes=1, options=options)
    achieved, _ = minimum_budget(built.problem, recompute_inputs=built.segment_inputs, solver=options.solver,
                                 time_limit=options.time_limit)
    return achieved, "minimum_budget"


def run_one(name: str, build, *, mesh, factor: float, options, preset: str) -> dict:
    from dataclasses import replace

    from autopar.api import Progress, plan_traced
    from autopar.strategies import needs_decomposition
    from autopar.tracer import profile, trace

    rec: dict = {"model": name, "mesh": list(mesh), "factor": factor, "preset": preset}
    if preset == "sweep":
        from tests.sweeps.harness import fast_mesh

        mesh = fast_mesh(mesh)
    model, inputs = build()
    t0 = time.perf_counter()
    traced = trace(model, inputs, decompose_if=needs_decomposition, precision=options.precision)
    prof = profile(traced)
    front_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    rec["min_budget"], rec["min_budget_from"] = smallest_budget(traced, prof, mesh, options)
    rec["min_budget_s"] = round(time.perf_counter() - t1, 3)
    rec["budget"] = math.ceil(factor * rec["min_budget"])
    progress = Progress()
    t2 = time.perf_counter()
    result = plan_traced(traced, prof, mesh=mesh, options=replace(options, memory_budget=rec["budget"]),
                         progress=progress)
    rec["plan_s"] = round(front_s + time.perf_counter() - t2, 3)
    rec["trace_profile_s"] = round(front_s, 3)
    plan = result.plan
    solver = plan.solver
    rec.update(status=solver.get("status"), gap=solver.get("gap"), objective_s=solver.get("objective"),
               lp_bound_s=solver.get("lp_bound"), step_s=plan.estimate.step_s, peak_bytes=plan.estimate.peak_bytes,
               method=plan.checkpoint.get("method"), recomputed=len(plan.recompute),
               num_variables=solver.get("num_variables"),
               stages={k: round(v, 3) for k, v in progress.timings.items()})
    if plan.estimate.peak_bytes > rec["budget"]:
        rec["error"] = f"plan peaks at {plan.estimate.peak_bytes} B over the budget {rec['budget']} B"
    return rec


def _fmt_gap(gap) -> str:
    return "unknown" if gap is None else f"{gap:.2%}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", help="comma-separated architecture names (default: the sweep's catalog)")
    ap.add_argument("--factor", type=float, default=1.1, help="budget = factor x the smallest feasible one")
    ap.add_argument("--mesh", default="2x2")
    ap.add_argument("--preset", default="cpu", help="a MeshSpec preset, or 'sweep' (the sweep harness's mesh)")
    ap.add_argument("--time-limit", type=float, default=60.0, help="the planner's time_limit (s)")
    ap.add_argument("--jsonl", help="append one JSON record per model to this file")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    from autopar.api import PlanOptions

    mesh = tuple(int(x) for x in args.mesh.lower().split("x"))
    # Replicate fallback: an op without a sharding rule must not hide the planning time of the rest.
    options = PlanOptions(preset="cpu" if args.preset == "sweep" else args.preset, time_limit=args.time_limit,
                          allow_replicate_fallback=True)
    names = [n.strip() for n in args.models.split(",") if n.strip()] if args.models else None
    load = os.getloadavg()[0]
    print(f"tight budgets: {args.factor:g}x the smallest feasible budget, mesh {args.mesh} ({args.preset}), "
          f"time_limit {args.time_limit:g}s; {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load {load:.2f}", flush=True)
    head = f"{'model':40s} {'min budget':>11s} {'plan s':>7s} {'status':>9s} {'gap':>8s} {'step ms':>9s} " \
           f"{'peak':>9s} {'method':>6s}"
    print(head)
    print("-" * len(head), flush=True)
    slow = 0
    for name, build in builders(names):
        try:
            rec = run_one(name, build, mesh=mesh, factor=args.factor, options=options, preset=args.preset)
        except Exception as exc:  # noqa: BLE001 -- one model's failure is its row, not the benchmark's end
            rec = {"model": name, "mesh": list(mesh), "factor": args.factor, "preset": args.preset,
                   "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]}
            if os.environ.get("TIGHT_BUDGET_TRACEBACK"):
                traceback.print_exc()
        rec["load_1m"] = round(os.getloadavg()[0], 2)
        if "plan_s" in rec:
            slow += rec["plan_s"] >= 20.0
            print(f"{name:40s} {rec['min_budget']:>11d} {rec['plan_s']:>7.1f} {rec['status']:>9s} "
                  f"{_fmt_gap(rec['gap']):>8s} {rec['step_s'] * 1e3:>9.3f} {rec['peak_bytes']:>9d} "
                  f"{rec['method']:>6s}" + (f"  ERROR {rec['error']}" if "error" in rec else ""), flush=True)
        else:
            print(f"{name:40s} ERROR {rec['error']}", flush=True)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(rec) + "\n")
    print(f"{slow} model(s) planned in 20 s or more; load now {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
