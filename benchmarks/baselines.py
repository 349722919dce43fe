"""autopar vs hand-written-style baselines, every zoo model at its published size.

For each model (traced once), each mesh ((8,), (2,4), (4,4) by default) and two budgets -- the
device capacity ("ample") and half of the peak of autopar's unconstrained plan ("tight",
raised to the smallest feasible budget when that is higher) -- it solves autopar's plan and the
baselines (data parallel, ZeRO-1, ZeRO-2, ZeRO-3, Megatron TP, DP x TP) in the same cost model
(``--zero-stage auto``, the default: autopar picks ZeRO stages per parameter too), and prints one
row per case: autopar's estimated step time and peak memory, each baseline's step time (or
"infeasible"), and autopar's speed-up over the best feasible baseline. It checks, for every
case, that autopar's objective is <= every feasible baseline's, that its peak fits the budget and
that it is feasible wherever any baseline is.

    python benchmarks/baselines.py                       # the whole zoo (about 10-15 min here)
    python benchmarks/baselines.py --models gpt2 resnet50 --meshes 8 2x4
    python benchmarks/baselines.py --jsonl results.jsonl

Exit status 1 when any check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

from autopar import zoo
from autopar.api import PlanOptions, plan_traced
from autopar.planner.baselines import BASELINES
from autopar.layout.mesh import MeshSpec
from autopar.strategies import needs_decomposition
from autopar.tracer import profile, trace

GiB = 2**30
TOLERANCE = 1e-9  # relative: the same ILP restricted can only be as fast or slower


def _plan(traced, prof, mesh: MeshSpec, **options):
    return plan_traced(traced, prof, mesh=mesh, options=PlanOptions(**options)).plan


def _tight_budget(traced, prof, mesh, zero_stage) -> int:
    ample = _plan(traced, prof, mesh, zero_stage=zero_stage)
    tight = ample.estimate.peak_bytes // 2
    try:
        _plan(traced, prof, mesh, memory_budget=tight, zero_stage=zero_stage)
        return tight
    except ValueError as exc:  # below the smallest feasible budget: use that (the message says it)
        words = str(exc).split("the smallest budget any plan meets is ")[-1].split()
        return int(words[2] if words[0] == "between" else words[0]) + 1


def run_case(traced, prof, model: str, mesh: MeshSpec, budget_name: str, budget: int, zero_stage="auto") -> dict:
    t0 = time.perf_counter()
    p = _plan(traced, prof, mesh, memory_budget=budget, baselines=True, zero_stage=zero_stage)
    record = {
        "model": model, "mesh": "x".join(map(str, mesh.shape)), "budget": budget_name,
        "budget_bytes": budget, "step_ms": p.estimate.step_s * 1e3, "peak_bytes": p.estimate.peak_bytes,
        "status": p.solver["status"], "seconds": time.perf_counter() - t0, "baselines": {},
    }
    ok = p.estimate.peak_bytes <= budget
    for b in p.baselines:
        record["baselines"][b.name] = b.estimate.step_s * 1e3 if b.feasible else None
        if b.feasible and p.estimate.step_s > b.estimate.step_s * (1 + TOLERANCE):
            ok = False
    best = p.best_baseline()
    record["speedup"] = best.estimate.step_s / p.estimate.step_s if best else None
    record["ok"] = ok
    return record


def _row(r: dict) -> str:
    cells = [f"{r['model']:<11}", f"{r['mesh']:>4}", f"{r['budget']:<5}", f"{r['budget_bytes'] / GiB:7.2f}",
             f"{r['step_ms']:10.3f}", f"{r['peak_bytes'] / GiB:7.2f}"]
    for name in BASELINES:
        v = r["baselines"].get(name, "n/a")
        cells.append(f"{'n/a' if v == 'n/a' else ('infeas.' if v is None else f'{v:.3f}'):>12}")
    cells.append(f"{r['speedup']:6.2f}x" if r["speedup"] else "      -")
    cells.append("ok" if r["ok"] else "FAIL")
    return " ".join(cells)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(zoo.NAMES))
    ap.add_argument("--meshes", nargs="+", default=["8", "2x4", "4x4"])
    ap.add_argument("--preset", "--device", dest="preset", default="a100-80gb",
                    help="mesh device preset (--device: its old name)")
    ap.add_argument("--zero-stage", default="auto", type=lambda v: v if v == "auto" else int(v),
                    help="autopar's ZeRO stages (auto: per parameter, with zero1/zero2 baselines; 0, 1, 2)")
    ap.add_argument("--jsonl", default=None)
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    head = (f"{'model':<11} {'mesh':>4} {'bud.':<5} {'GiB':>7} {'autopar ms':>10} {'peakGiB':>7} "
            + " ".join(f"{n:>12}" for n in BASELINES) + "  speedup")
    print(head)
    print("-" * len(head))
    records, failed = [], 0
    for model in args.models:
        m, inputs = zoo.build(model)
        traced = trace(m, inputs, decompose_if=needs_decomposition)
        prof = profile(traced)
        for shape in args.meshes:
            mesh = MeshSpec.preset(args.preset, shape)
            tight = _tight_budget(traced, prof, mesh, args.zero_stage)
            for name, budget in (("ample", mesh.mem_capacity), ("tight", tight)):
                r = run_case(traced, prof, model, mesh, name, budget, args.zero_stage)
                records.append(r)
                failed += not r["ok"]
                print(_row(r), flush=True)
    if args.jsonl:
        with open(args.jsonl, "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    print(f"\n{len(records)} cases, {failed} failed: autopar <= every feasible baseline and peak <= budget")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
