"""Solver benchmark: planning time and plan quality over models x meshes x budgets x backends.

Usage:
  python benchmarks/solver.py --suite quick                 # smoke run (about a minute)
  python benchmarks/solver.py --suite targets --repeat 3    # the acceptance targets
  python benchmarks/solver.py --suite depth --jsonl out.jsonl
  python benchmarks/solver.py --suite benchmarks/suites/zoo.json --only gpt2

Suites are JSON files in ``benchmarks/suites/`` (format: ``benchmarks/README.md``). Every case
runs the real pipeline in stages, timed apart: build the model on meta, trace, profile, strategy
enumeration + problem build (``build_problem``), ILP build (simplify + pulp model) and solve (LP
relaxation + MIP). An ``end_to_end`` suite instead times one ``autopar.plan`` call per case (no
baselines, no plan cache, checkpoint planning as the user gets it), its stages read off the
call's progress timings. One JSONL record per case and repeat; a table on stdout. Cases of an
``isolate`` suite each run in a fresh interpreter (no warm caches: honest end-to-end figures);
otherwise traced graphs are shared between cases of the same model shape within one repeat.
A suite's ``targets`` (max plan seconds per case) and ``ratios`` (max plan-time ratio between two
cases) are checked at the end: one line each, met or not.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from statistics import median

HERE = os.path.dirname(os.path.abspath(__file__))
SUITES = os.path.join(HERE, "suites")
CASE_KEYS = ("model", "batch", "seq", "layers", "mesh", "device", "budget", "backend", "checkpoint")


# ------------------------------------------------------------------------------------ suites
def load_suite(name: str) -> dict:
    path = name if os.path.isfile(name) else os.path.join(SUITES, f"{name}.json")
    if not os.path.isfile(path):
        known = sorted(f[:-5] for f in os.listdir(SUITES) if f.endswith(".json"))
        raise SystemExit(f"solver.py: error: no suite {name!r}; known: {', '.join(known)}")
    with open(path) as f:
        suite = json.load(f)
    suite.setdefault("name", os.path.basename(path)[:-5])
    suite["cases"] = expand_cases(suite)
    return suite


def expand_cases(suite: dict) -> list[dict]:
    """Explicit ``cases`` plus the cartesian product of every ``matrices`` entry, with ``defaults``."""
    defaults = {"batch": None, "seq": None, "layers": None, "device": "a100-80gb", "budget": None,
                "backend": "highs", **suite.get("defaults", {})}
    cases = [dict(defaults, **c) for c in suite.get("cases", [])]
    for matrix in suite.get("matrices", []):
        keys = list(matrix)
        for values in itertools.product(*(matrix[k] for k in keys)):
            cases.append(dict(defaults, **dict(zip(keys, values))))
    for c in cases:
        unknown = set(c) - set(CASE_KEYS)
        if unknown:
            raise SystemExit(f"solver.py: error: unknown case keys {sorted(unknown)} in suite {suite.get('name')}")
    return cases


def case_id(c: dict) -> str:
    parts = [c["model"] + (f"/L{c['layers']}" if c.get("layers") else ""), c["mesh"], c.get("budget") or "cap",
             c["backend"]] + ([c["checkpoint"]] if c.get("checkpoint") else [])
    return " ".join(str(p) for p in parts)


# ------------------------------------------------------------------------------ environment
def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "load_1m": round(load[0], 2),
            "python": platform.python_version()}


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("torch", "transformers", "pulp", "highspy", "autopar"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    try:
        out["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                                    text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["git"] = None
    return out


# ---------------------------------------------------------------------------------- one case
_TRACE_CACHE: dict[tuple, tuple] = {}


def _traced(c: dict, *, reuse: bool) -> tuple:
    """(traced, profile, timings, reused) for the case's model shape."""
    from autopar import zoo
    from autopar.strategies import needs_decomposition
    from autopar.tracer import profile, trace

    key = (c["model"], c.get("batch"), c.get("seq"), c.get("layers"))
    if reuse and key in _TRACE_CACHE:
        traced, prof, t = _TRACE_CACHE[key]
        return traced, prof, t, True
    t0 = time.perf_counter()
    model, inputs = zoo.build(c["model"], batch=c.get("batch"), seq=c.get("seq"), num_layers=c.get("layers"))
    t1 = time.perf_counter()
    traced = trace(model, inputs, name=c["model"], decompose_if=needs_decomposition)
    t2 = time.perf_counter()
    prof = profile(traced)
    t3 = time.perf_counter()
    t = {"model_s": t1 - t0, "trace_s": t2 - t1, "profile_s": t3 - t2}
    if reuse:
        _TRACE_CACHE[key] = (traced, prof, t)
    return traced, prof, t, False


def run_case(c: dict, *, reuse: bool = True, time_limit: float = 120.0, allow_fallback: bool = True) -> dict:
    from autopar.planner.builder import build_problem
    from autopar.planner.options import PlanOptions
    from autopar.solver.driver import solve

    rec: dict = {"case": case_id(c), **{k: c.get(k) for k in CASE_KEYS}}
    try:
        # A suite's "device" is the mesh preset (the data format keeps its key).
        options = PlanOptions(memory_budget=c.get("budget") or None, solver=c["backend"], time_limit=time_limit,
                              preset=c["device"], allow_replicate_fallback=allow_fallback)
        mesh = options.mesh(c["mesh"])
        budget = options.budget_bytes(mesh)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="no sharding rule")
            traced, prof, t, reused = _traced(c, reuse=reuse)
            t0 = time.perf_counter()
            built = build_problem(traced, prof, mesh, budget_bytes=budget, options=options)
        t1 = time.perf_counter()
        sol = solve(built.problem, solver=options.solver, time_limit=options.time_limit)
        t2 = time.perf_counter()
    except (ValueError, RuntimeError, LookupError) as exc:
        rec.update(ok=False, error=" ".join(str(exc).split())[:400])
        return rec
    st = sol.timings
    timings = dict(t, strategy_s=t1 - t0, simplify_s=st["simplify_s"], ilp_build_s=st["simplify_s"] + st["build_s"],
                   lp_s=st["lp_s"], mip_s=st["solve_s"], solve_s=st["lp_s"] + st["solve_s"], solver_stage_s=t2 - t1)
    timings["plan_s"] = timings["trace_s"] + timings["profile_s"] + timings["strategy_s"] + timings["solver_stage_s"]
    rec.update(
        ok=True, trace_reused=reused, budget_bytes=budget, timings={k: round(v, 4) for k, v in timings.items()},
        num_ops=sum(1 for _ in traced.compute_nodes()), num_decisions=built.problem.num_nodes,
        num_edges=built.problem.num_edges, num_variables=sol.num_variables, num_constraints=sol.num_constraints,
        objective_s=sol.objective, lp_bound_s=sol.lp_bound, dual_bound_s=sol.dual_bound, gap=sol.gap,
        status=sol.status, backend=sol.backend, peak_bytes=sol.peak_bytes, fallbacks=len(built.fallbacks),
        simplify_stats=dict(sol.stats),
    )
    return rec


def run_plan_case(c: dict, *, time_limit: float = 120.0, allow_fallback: bool = True) -> dict:
    """The case through ``autopar.plan`` end to end (no baselines, no plan cache): the figure a
    user waits for. Stages from the call's progress timings; ``other_s`` is what lies between
    them (recompute planning, assembling the plan)."""
    import autopar
    from autopar import zoo
    from autopar.api import Progress

    rec: dict = {"case": case_id(c), "end_to_end": True, **{k: c.get(k) for k in CASE_KEYS}}
    t0 = time.perf_counter()
    model, inputs = zoo.build(c["model"], batch=c.get("batch"), seq=c.get("seq"), num_layers=c.get("layers"))
    progress = Progress()
    t1 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="no sharding rule")
            plan = autopar.plan(model, inputs, mesh=c["mesh"], memory_budget=c.get("budget") or None,
                                solver=c["backend"], time_limit=time_limit, preset=c["device"], baselines=False,
                                allow_replicate_fallback=allow_fallback, cache=False, progress=progress,
                                checkpoint=c.get("checkpoint") or "auto")
    except (ValueError, RuntimeError, LookupError) as exc:
        rec.update(ok=False, error=" ".join(str(exc).split())[:400])
        return rec
    t2 = time.perf_counter()
    stages = progress.timings
    known = {name: stages.get(name, 0.0) for name in ("trace", "profile", "strategies", "solve")}
    sol = plan.solver
    st = sol.get("timings", {})
    timings = {"model_s": t1 - t0, "trace_s": known["trace"], "profile_s": known["profile"],
               "strategy_s": known["strategies"], "simplify_s": st.get("simplify_s", 0.0),
               "ilp_build_s": st.get("simplify_s", 0.0) + st.get("build_s", 0.0), "lp_s": st.get("lp_s", 0.0),
               "mip_s": st.get("solve_s", 0.0), "solve_s": st.get("lp_s", 0.0) + st.get("solve_s", 0.0),
               "solver_stage_s": known["solve"], "other_s": (t2 - t1) - sum(known.values()), "plan_s": t2 - t1}
    rec.update(
        ok=True, trace_reused=False, budget_bytes=plan.budget_bytes,
        timings={k: round(v, 4) for k, v in timings.items()}, stages={k: round(v, 4) for k, v in stages.items()},
        num_decisions=len(plan.nodes), num_variables=sol.get("num_variables"),
        num_constraints=sol.get("num_constraints"), objective_s=sol.get("objective"), lp_bound_s=sol.get("lp_bound"),
        gap=sol.get("gap"), status=sol.get("status"), backend=sol.get("backend"), step_s=plan.estimate.step_s,
        peak_bytes=plan.estimate.peak_bytes, fallbacks=len(plan.fallbacks),
        checkpoint=plan.checkpoint.get("method"),
    )
    return rec


def run_isolated(c: dict, *, time_limit: float, end_to_end: bool = False) -> dict:
    """The case in a fresh interpreter: cold caches, as a user's first `autopar inspect` sees it."""
    cmd = [sys.executable, os.path.abspath(__file__), "--case-json", json.dumps(c), "--time-limit", str(time_limit)]
    if end_to_end:
        cmd.append("--end-to-end")
    out = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return {"case": case_id(c), **{k: c.get(k) for k in CASE_KEYS}, "ok": False, "error": tail}
    return json.loads(lines[-1])


# ------------------------------------------------------------------------------------ output
_COLS = (("case", 30), ("trace", 6), ("prof", 6), ("strat", 6), ("ilp", 6), ("solve", 6), ("total", 6),
         ("vars", 7), ("rows", 7), ("step ms", 9), ("LP ms", 9), ("gap", 6), ("status", 8))


def table_row(r: dict) -> str:
    if not r.get("ok"):
        return f"{r['case']:<30} {'error: ' + r.get('error', '')[:110]}"
    t = r["timings"]
    cells = [r["case"], f"{t['trace_s']:.2f}", f"{t['profile_s']:.2f}", f"{t['strategy_s']:.2f}",
             f"{t['ilp_build_s']:.2f}", f"{t['solve_s']:.2f}", f"{t['plan_s']:.2f}", str(r["num_variables"]),
             str(r["num_constraints"]), f"{r['objective_s'] * 1e3:.3f}", f"{r['lp_bound_s'] * 1e3:.3f}",
             f"{r['gap']:.2%}", r["status"]]
    return " ".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, (_, w)) in enumerate(zip(cells, _COLS)))


def header() -> str:
    head = " ".join(f"{n:<{w}}" if i == 0 else f"{n:>{w}}" for i, (n, w) in enumerate(_COLS))
    return head + "\n" + "-" * len(head)


def _median_records(records: list[dict]) -> list[dict]:
    """One record per case: the median timings over repeats (other fields from the first)."""
    by_case: dict[str, list[dict]] = {}
    for r in records:
        by_case.setdefault(r["case"], []).append(r)
    out = []
    for case, rs in by_case.items():
        ok = [r for r in rs if r.get("ok")]
        if not ok:
            out.append(rs[0])
            continue
        merged = dict(ok[0])
        merged["timings"] = {k: median(r["timings"][k] for r in ok) for k in ok[0]["timings"]}
        out.append(merged)
    return out


def depth_summary(records: list[dict]) -> list[str]:
    """Plan- and solve-time growth with depth for each (model, mesh, budget, backend) swept over layers."""
    groups: dict[tuple, dict[int, dict]] = {}
    for r in records:
        if r.get("ok") and r.get("layers"):
            groups.setdefault((r["model"], r["mesh"], r.get("budget"), r["backend"]), {})[r["layers"]] = r
    lines = []
    for key, by_depth in groups.items():
        if len(by_depth) < 2:
            continue
        base_depth = min(by_depth)
        base = by_depth[base_depth]["timings"]
        parts = []
        for d in sorted(by_depth)[1:]:
            t = by_depth[d]["timings"]
            parts.append(f"{d}/{base_depth}: plan {t['plan_s'] / base['plan_s']:.2f}x, "
                         f"solve {t['solve_s'] / base['solve_s']:.2f}x, solver stage "
                         f"{t['solver_stage_s'] / base['solver_stage_s']:.2f}x, variables "
                         f"{by_depth[d]['num_variables']}/{by_depth[base_depth]['num_variables']}")
        lines.append(f"depth sweep {' '.join(str(k) for k in key)}: " + "; ".join(parts))
    return lines


# -------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default="quick", help="suite name in benchmarks/suites/ or a JSON path")
    ap.add_argument("--repeat", type=int, default=1, help="run every case N times; the table shows medians")
    ap.add_argument("--jsonl", help="append one JSON record per case and repeat to this file")
    ap.add_argument("--only", help="run only cases whose id contains this text")
    ap.add_argument("--time-limit", type=float, default=120.0, help="seconds per ILP solve")
    ap.add_argument("--isolate", action="store_true", help="every case in a fresh interpreter")
    ap.add_argument("--end-to-end", action="store_true",
                    help="time each case as one autopar.plan call (suites may ask for it: \"end_to_end\")")
    ap.add_argument("--case-json", help=argparse.SUPPRESS)  # internal: one isolated case
    args = ap.parse_args(argv)
    if args.case_json:
        case = json.loads(args.case_json)
        rec = (run_plan_case(case, time_limit=args.time_limit) if args.end_to_end
               else run_case(case, reuse=False, time_limit=args.time_limit))
        print(json.dumps(rec))
        return 0
    if args.repeat < 1:
        raise SystemExit("solver.py: error: --repeat must be >= 1")
    suite = load_suite(args.suite)
    cases = [c for c in suite["cases"] if not args.only or args.only in case_id(c)]
    isolate = args.isolate or suite.get("isolate", False)
    end_to_end = args.end_to_end or suite.get("end_to_end", False)
    env = {"machine": machine(), "versions": versions()}
    print(f"suite {suite['name']}: {len(cases)} cases x {args.repeat} repeats"
          f"{' (each in a fresh interpreter)' if isolate else ''}"
          f"{', autopar.plan end to end' if end_to_end else ''}; {env['machine']['cpu']}, "
          f"{env['machine']['cores']} cores, load {env['machine']['load_1m']}", flush=True)
    print(header(), flush=True)
    records = []
    for rep in range(args.repeat):
        _TRACE_CACHE.clear()
        for c in cases:
            if isolate:
                rec = run_isolated(c, time_limit=args.time_limit, end_to_end=end_to_end)
            elif end_to_end:
                rec = run_plan_case(c, time_limit=args.time_limit)
            else:
                rec = run_case(c, time_limit=args.time_limit)
            rec.update(suite=suite["name"], repeat=rep, **env)
            rec["machine"] = dict(env["machine"], load_1m=round(os.getloadavg()[0], 2))
            records.append(rec)
            print(table_row(rec), flush=True)
            if args.jsonl:
                with open(args.jsonl, "a") as f:
                    f.write(json.dumps(rec) + "\n")
    summary = _median_records(records)
    if args.repeat > 1:
        print(f"\nmedians over {args.repeat} repeats\n" + header())
        for r in summary:
            print(table_row(r))
    for line in depth_summary(summary) + target_summary(suite, summary):
        print(line)
    return 0 if all(r.get("ok") or suite.get("expect_errors") for r in records) else 1


def target_summary(suite: dict, records: list[dict]) -> list[str]:
    """``targets``: {case id substring: max plan seconds}; ``ratios``: [{"case": id substring,
    "over": id substring, "max": ratio}] of plan seconds. One line per target, met or not."""
    lines = []
    for needle, limit in suite.get("targets", {}).items():
        hits = [r for r in records if needle in r["case"] and r.get("ok")]
        for r in hits:
            t = r["timings"]
            lines.append(f"target {r['case']}: planned end to end in {t['plan_s']:.1f}s "
                         f"({_stage_text(t)}) -- target < {limit}s: {'met' if t['plan_s'] < limit else 'NOT met'}")
        if not hits:
            lines.append(f"target {needle}: no successful run")
    for ratio in suite.get("ratios", []):
        num = [r for r in records if ratio["case"] in r["case"] and r.get("ok")]
        den = [r for r in records if ratio["over"] in r["case"] and r.get("ok")]
        if len(num) != 1 or len(den) != 1:
            lines.append(f"target ratio {ratio['case']} / {ratio['over']}: no single successful run of each")
            continue
        a, b = num[0]["timings"]["plan_s"], den[0]["timings"]["plan_s"]
        met = a / b <= ratio["max"]
        lines.append(f"target ratio {num[0]['case']} / {den[0]['case']}: {a:.1f}s / {b:.1f}s = {a / b:.2f}x "
                     f"-- target <= {ratio['max']}x: {'met' if met else 'NOT met'}")
    return lines


def _stage_text(t: dict) -> str:
    text = (f"trace {t['trace_s']:.1f} + profile {t['profile_s']:.1f} + strategies {t['strategy_s']:.1f} + "
            f"solver {t['solver_stage_s']:.1f}")
    return text + (f" + other {t['other_s']:.1f}" if "other_s" in t else "")


if __name__ == "__main__":
    sys.exit(main())
