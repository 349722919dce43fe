"""Plan cache benchmark: ``autopar.plan`` of GPT-2 XL (48 layers, batch 8, seq 1024) on a 2x4
A100 mesh at 40 GiB, in a fresh interpreter each time, with an empty cache (a miss: trace, profile,
strategies, solve, store) and then again (a hit: the structural key and one file read).

Usage:
  python benchmarks/cache.py                   # miss, then hits (--repeat of them)
  python benchmarks/cache.py --model gpt2 --repeat 5

The figure is the ``autopar.plan(...)`` call alone; importing torch and building the model on
meta happen before it (they are the same with or without a cache). The cache directory is a
temporary one, never the user's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from statistics import median


def child(model_name: str) -> dict:
    """One plan in this (fresh) interpreter; its seconds and what it returned."""
    import autopar
    from autopar import zoo
    from autopar.api import Progress

    model, inputs = zoo.build(model_name, device="meta", batch=8, seq=1024)
    mesh = autopar.MeshSpec.preset("a100-80gb", (2, 4))
    lines: list[str] = []
    progress = Progress(verbose=True, sink=lines.append)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="no sharding rule")
        t0 = time.perf_counter()
        plan = autopar.plan(model, inputs, mesh=mesh, memory_budget="40GiB", progress=progress)
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "hit": any("plan cache hit" in line for line in lines),
            "step_ms": plan.estimate.step_s * 1e3, "graph_hash": plan.graph_hash}


def run_child(model_name: str, cache_dir: str) -> dict:
    env = {**os.environ, "AUTOPAR_CACHE_DIR": cache_dir}
    env.pop("AUTOPAR_CACHE", None)
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--model", model_name],
                         capture_output=True, text=True, env=env)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"child failed: {(out.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-xl", help="a zoo GPT-2 name (default gpt2-xl)")
    parser.add_argument("--repeat", type=int, default=3, help="hits to time (default 3)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.model)))
        return 0
    label = {"gpt2-xl": "GPT-2 XL", "gpt2": "GPT-2", "gpt2-medium": "GPT-2 medium"}.get(args.model, args.model)
    with tempfile.TemporaryDirectory(prefix="autopar-cache-bench-") as cache_dir:
        miss = run_child(args.model, cache_dir)
        hits = [run_child(args.model, cache_dir) for _ in range(args.repeat)]
    if miss["hit"] or not all(h["hit"] for h in hits):
        raise SystemExit(f"expected a miss then hits, got {miss['hit']} then {[h['hit'] for h in hits]}")
    if any(h["graph_hash"] != miss["graph_hash"] or h["step_ms"] != miss["step_ms"] for h in hits):
        raise SystemExit("a hit returned a different plan than the miss solved")
    print(f"cache miss: {label} 2x4 40GiB planned in {miss['seconds']:.2f} s")
    each = ", ".join(f"{h['seconds']:.3f}" for h in hits)
    print(f"cache hit: {label} 2x4 40GiB planned in {median(h['seconds'] for h in hits):.3f} s "
          f"(median of {len(hits)}: {each})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
