"""Issue 31 point 6: saved-activation bytes of a sequence-split (ring) plan, measured on gloo
ranks vs the plan's estimate, for Llama-tiny (hidden 64) at batch 1 and long sequences.

    python benchmarks/ring_memory.py                      # 1024/2048/4096 tokens on 2 and 4 ranks
    python benchmarks/ring_memory.py --seq 2048 --ranks 4

Each case plans with ``sequence_parallel="ring"`` and no recompute, runs one forward per rank
under ``saved_tensors_hooks`` (``tests/runtime/test_ring_memory.saved_per_rank``: each storage
once, parameters, buffers and inputs left out; loss and gradients checked against one device) and
prints the estimate, every rank's measured bytes when its forward ended and the ratio.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.runtime.test_ring_memory import saved_per_rank  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="*", default=[1024, 2048, 4096])
    parser.add_argument("--ranks", type=int, nargs="*", default=[2, 4])
    args = parser.parse_args()
    print(f"{'seq':>6} {'ranks':>5} {'est MiB':>8} {'measured MiB (per rank)':<32} {'meas/est':>8}  load")
    for seq in args.seq:
        for ranks in args.ranks:
            est, held = saved_per_rank(seq, ranks)
            worst = max(held, key=lambda b: abs(b - est))
            per_rank = " ".join(f"{b / 2**20:.2f}" for b in held)
            print(f"{seq:>6} {ranks:>5} {est / 2**20:8.2f} {per_rank:<32} {worst / est:8.3f}  {os.getloadavg()[0]:.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
