"""Issue 31 point 1: the causal ring's load balance, measured. One causal attention (batch 1,
4 heads, head dim 64) ring-split over ``m`` simulated ranks (``strategies.check.run_spmd``: one
thread per rank, ``torch.set_num_threads(1)``); each rank's kernel time (forward + backward) is its
thread's CPU time (``time.thread_time``), so ranks waiting in the ring's lockstep and other
processes on the machine do not count. The zig-zag layout (the kernel's) against the plain one
(the same kernel with ``zigzag_axes`` patched to ``()``), interleaved round by round; printed: each
layout's busiest and idlest rank (median over rounds) and the busiest-rank ratio, next to the
priced ratio (``causal_share`` vs ``1 / m``).

    python benchmarks/ring_balance.py --seq 4096 --ranks 4 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from autopar.layout.mesh import MeshSpec  # noqa: E402
from autopar.strategies import _ring_attention, enumerate_strategies  # noqa: E402
from autopar.strategies._zigzag import ZigZag, causal_share  # noqa: E402
from autopar.strategies.check import run_spmd  # noqa: E402
from autopar.strategies.kernel_context import KernelContext  # noqa: E402
from autopar.strategies.registry import OpInfo  # noqa: E402

SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _per_rank_seconds(info, strategy, args, m: int) -> dict:
    def body(comm):
        ctx = KernelContext(comm, info, strategy.input_specs, strategy.output_specs, (m,))
        local = [t[s.local_slices(t.shape, (m,), comm.coord)].detach().requires_grad_() for t, s in
                 zip(args, strategy.input_specs)]
        start = time.thread_time()
        out = _ring_attention.ring_attention(ctx, *local, is_causal=True)
        out.backward(torch.ones_like(out))
        return time.thread_time() - start
    return run_spmd(body, (m,))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    a = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(1, 4, a.seq, 64, generator=gen) for _ in range(3)]
    info = OpInfo.from_values(SDPA, args, {"is_causal": True}, SDPA(*args, is_causal=True))
    strategy = next(s for s in enumerate_strategies(info, MeshSpec.preset("cpu", (a.ranks,)), flops=(0.0, 0.0))
                    if s.kernel == "ring_attention")
    zigzag_axes = _ring_attention.zigzag_axes
    times: dict[str, list[dict]] = {"zig-zag": [], "plain": []}
    for _ in range(a.rounds):
        for layout in times:
            _ring_attention.zigzag_axes = zigzag_axes if layout == "zig-zag" else (lambda info, specs: ())
            try:
                times[layout].append(_per_rank_seconds(info, strategy, args, a.ranks))
            finally:
                _ring_attention.zigzag_axes = zigzag_axes
    busiest = {}
    print(f"causal attention, seq {a.seq}, {a.ranks} ranks, {a.rounds} rounds (load {os.getloadavg()[0]:.1f})")
    for layout, rounds in times.items():
        per_rank = {r: statistics.median(t[r] for t in rounds) for r in rounds[0]}
        busiest[layout] = max(per_rank.values())
        cells = " ".join(f"{per_rank[r] * 1e3:.0f}" for r in sorted(per_rank))
        print(f"{layout:>8}: per-rank ms {cells}; busiest/idlest {busiest[layout] / min(per_rank.values()):.2f}")
    priced = causal_share(ZigZag(a.seq, a.ranks), ZigZag(a.seq, a.ranks)) * a.ranks
    print(f"busiest rank, zig-zag / plain: measured {busiest['zig-zag'] / busiest['plain']:.3f}, priced {priced:.3f}")


if __name__ == "__main__":
    main()
