"""Trace and profile time on meta for GPT-2 small, GPT-2 XL (48 layers) and a Llama-3-8B shape.

Usage: python benchmarks/trace.py [--repeat N] [--jsonl PATH] [names ...]
Prints one line per model (best of N runs, wall clock and this process's CPU time: on a shared
machine the CPU time is the fairer figure); target: GPT-2 XL traced + profiled in < 10 s.
Measured (2-core EPYC, load ~1, since the depth-independent trace and profile, issue 17): GPT-2
XL 1.17 + 0.50 s (was 4.61 + 2.71 s), Llama-3-8B shape 1.30 + 1.23 s (was 5.75 + 3.29 s); an
80-layer Llama-8B shape 1.68 + 0.80 s.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

DEFAULT = ("gpt2", "gpt2-xl", "llama-8b")


def measure(name: str) -> dict:
    from autopar import zoo
    from autopar.strategies import needs_decomposition
    from autopar.tracer import profile, trace

    model, inputs = zoo.build(name)  # published size, batch 8, seq 1024, on meta
    start, cpu_start = time.perf_counter(), time.process_time()
    traced = trace(model, inputs, name=name, decompose_if=needs_decomposition)
    traced_at, cpu_traced_at = time.perf_counter(), time.process_time()
    prof = profile(traced)
    done, cpu_done = time.perf_counter(), time.process_time()
    return {
        "model": name, "nodes": len(traced.nodes), "params": traced.num_params,
        "trace_s": round(traced_at - start, 3), "profile_s": round(done - traced_at, 3),
        "total_s": round(done - start, 3), "trace_cpu_s": round(cpu_traced_at - cpu_start, 3),
        "profile_cpu_s": round(cpu_done - cpu_traced_at, 3), "flops": prof.total_flops,
        "activation_gib": round(prof.activation_bytes / 2**30, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(DEFAULT))
    parser.add_argument("--repeat", type=int, default=1, help="runs per model; best is kept")
    parser.add_argument("--cold", action="store_true",
                        help="no warm-up: the first model also pays the one-time costs")
    parser.add_argument("--jsonl", help="append one JSON record per model to this file")
    args = parser.parse_args(argv)
    import torch  # noqa: F401 - import time is not tracing time
    import transformers  # noqa: F401


    print(f"machine: {platform.machine()}, {platform.processor() or 'cpu'}, python "
          f"{platform.python_version()}")
    if not args.cold:  # one-time costs (lazy imports inside torch.export, dispatch caches)
        from autopar import zoo
        from autopar.tracer import profile, trace

        start = time.perf_counter()
        profile(trace(*zoo.build("gpt2", tiny=True)))
        print(f"warm-up (tiny GPT-2, one-time per process): {time.perf_counter() - start:.2f} s")
    for name in args.names:
        runs = [measure(name) for _ in range(args.repeat)]
        best = min(runs, key=lambda r: r["total_s"])
        print(f"{name:10s} {best['nodes']:6d} nodes {best['params'] / 1e9:6.2f}B params  "
              f"trace {best['trace_s']:6.2f} s  profile {best['profile_s']:6.2f} s  "
              f"total {best['total_s']:6.2f} s  [CPU time: trace {best['trace_cpu_s']:.2f} s, "
              f"profile {best['profile_cpu_s']:.2f} s]  ({best['flops']:.3g} flop/step, "
              f"{best['activation_gib']} GiB saved)", flush=True)
        if args.jsonl:
            with open(args.jsonl, "a") as out:
                out.write(json.dumps(best) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
