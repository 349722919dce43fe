"""The coverage sweeps of issue 11 as a table for humans: torch.nn modules and transformers models.

Usage: python benchmarks/coverage_sweep.py [--suite nn|hf|all] [--mesh 2 --mesh 2x2] [--jsonl PATH] [names ...]

For every catalog entry (tests/sweeps/nn_catalog.py, tests/sweeps/hf_catalog.py): does it trace,
does it plan without replicate fallback on each mesh, how many op nodes the fallback plan had to
replicate and which ops lack a rule, and whether the emitted module on real gloo processes
matches the single-device loss and every parameter gradient (rtol 1e-4). Then the failures
grouped by cause. The tests in tests/sweeps/ assert the same results against their thresholds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.sweeps import harness, hf_catalog, nn_catalog  # noqa: E402

SUITES = {"nn": ((2,),), "hf": ((2,), (2, 2))}


def parse_mesh(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.lower().split("x"))


def progress(line: str) -> None:
    if not line.startswith("traced "):
        print(line, flush=True)


def run_suite(suite: str, meshes, names: list[str], jsonl) -> list[harness.Result]:
    entries = nn_catalog.entries() if suite == "nn" else hf_catalog.entries()
    if names:
        entries = [e for e in entries if any(n in e.name for n in names)]
    if not entries:
        return []
    start = time.perf_counter()
    results = harness.sweep(entries, meshes or SUITES[suite], progress=progress)
    elapsed = time.perf_counter() - start
    print(f"\n== {suite}: {len(results)} entries on meshes "
          f"{', '.join(harness.mesh_label(m) for m in meshes or SUITES[suite])}")
    print(harness.format_table(results))
    strict = sum(r.strict_ok for r in results)
    loose = sum(r.fallback_ok for r in results)
    print(f"\n{suite}: {strict}/{len(results)} ({100 * strict / len(results):.1f}%) plan without fallback "
          f"and match; {loose}/{len(results)} match with fallback allowed; "
          f"{elapsed:.1f} s (prepare {sum(r.prep_s for r in results):.1f} s)")
    failures = harness.format_failures(results)
    if failures:
        print(f"\nfailures by cause:\n{failures}")
    if jsonl:
        for r in results:
            jsonl.write(json.dumps({
                "suite": suite, "model": r.name, "traced": r.traced, "strict_ok": r.strict_ok,
                "fallback_ok": r.fallback_ok, "missing_ops": sorted(r.missing_ops), "cause": r.cause(),
                "nodes": r.nodes, "prepare_s": round(r.prep_s, 3),
                "e2e_s": {k: round(m.e2e_s, 3) for k, m in r.meshes.items()}}) + "\n")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="only entries whose name contains one of these")
    parser.add_argument("--suite", choices=("nn", "hf", "all"), default="all")
    parser.add_argument("--mesh", action="append", type=parse_mesh, default=[],
                        help="mesh shape such as 2 or 2x2 (repeatable; default: nn 2, hf 2 and 2x2)")
    parser.add_argument("--jsonl", type=argparse.FileType("a"), help="append one JSON line per entry")
    args = parser.parse_args(argv)
    suites = ("nn", "hf") if args.suite == "all" else (args.suite,)
    for suite in suites:
        run_suite(suite, args.mesh, args.names, args.jsonl)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
