"""`make demo`: trace and profile the embedded default model (a small GPT-2) and print a summary.

Runs on meta/fake tensors only: no weights, no GPU, a few seconds on a laptop.
"""

from __future__ import annotations

import time


def _stage(message: str) -> float:
    print(f"[autopar] {message}", flush=True)
    return time.perf_counter()


def _size(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if num_bytes < 1024 or unit == "TiB":
            return f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def main() -> None:
    start = _stage("building the default model (GPT-2, 4 layers, hidden 256) on meta ...")
    from autopar import zoo
    from autopar.tracer import coverage, profile, trace
    from autopar.tracer.coverage import format_coverage

    model, inputs = zoo.default_demo()
    shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in inputs.items())
    t = _stage(f"tracing with torch.export on fake tensors (inputs: {shapes}) ...")
    traced = trace(model, inputs, name="gpt2-demo")
    t = _stage(f"traced in {time.perf_counter() - t:.2f} s; profiling FLOPs, bytes and saved "
               f"activations ...")
    prof = profile(traced)
    _stage(f"profiled in {time.perf_counter() - t:.2f} s")
    num_ops = sum(1 for _ in traced.compute_nodes())
    print()
    print(f"model              {traced.model_name} (graph hash {traced.graph_hash})")
    print(f"nodes              {len(traced.nodes)} ({num_ops} ops)")
    print(f"parameters         {traced.num_params:,} ({_size(prof.param_bytes)}; "
          f"tied: {', '.join(' = '.join(p.aliases) for p in traced.params if len(p.aliases) > 1)})")
    print(f"FLOPs per step     {prof.total_flops:.4g} (forward {prof.fwd_flops:.4g}, "
          f"backward {prof.bwd_flops:.4g})")
    print(f"activation bytes   {_size(prof.activation_bytes)} saved for backward")
    print(f"loss output        {traced.loss_node.name}")
    print()
    print("op coverage:")
    print(format_coverage(coverage(traced)))
    print()
    _stage(f"done in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
