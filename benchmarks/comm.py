"""Measured vs predicted collective times on this machine (gloo, local processes).

Each run calibrates a fresh ``MeshSpec`` (``autopar.calibrate`` on a 1-D mesh of ``--procs``
processes, quick compute grid), then times every collective again, independently of the
calibration, over the sizes (64 KiB .. 16 MiB by default) and prints measured vs predicted
(``autopar.layout.cost`` with the fitted alpha/beta: per kind where calibration fitted one) per
collective and size, the median ratio per collective and overall.

    .venv/bin/python benchmarks/comm.py [--procs 2] [--repeats 7] [--jsonl out.jsonl]

ratio = predicted / measured: > 1 means the model over-estimates.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autopar.layout.cost import collective_seconds  # noqa: E402
from autopar.runtime.launch import run_local  # noqa: E402
from autopar.runtime.calibrate import _in_group  # noqa: E402
from autopar.runtime.links import KINDS, measure_axis  # noqa: E402

KiB, MiB = 1024, 1024**2
SIZES = [64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB]


def _worker(rank, world_size, sizes, repeats):
    from torch.distributed.device_mesh import init_device_mesh

    profile = _in_group((world_size,), "cpu", sizes, repeats, True, False)
    device_mesh = init_device_mesh("cpu", (world_size,))
    held_out = measure_axis(device_mesh, 0, sizes, device="cpu", repeats=repeats)
    in_sample = [profile.predicted(t) / t.seconds for t in profile.timings]
    return profile.mesh, held_out, statistics.median(in_sample)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=SIZES,
                        help="comma-separated full-tensor sizes in bytes")
    parser.add_argument("--jsonl", type=Path, default=None, help="append one JSON row per point")
    args = parser.parse_args(argv)
    if args.procs < 2:
        raise ValueError(f"--procs must be >= 2 to communicate, got {args.procs}")

    start = time.perf_counter()
    mesh, timings, in_sample = run_local(_worker, args.procs, args.sizes, args.repeats)[0]
    elapsed = time.perf_counter() - start
    print(f"fresh profile ({args.procs} gloo processes): alpha {mesh.alpha[0] * 1e6:.1f} us, "
          f"beta {mesh.beta[0] * 1e9:.3f} ns/B ({1 / mesh.beta[0] / 1e9:.2f} GB/s), "
          f"{mesh.peak_flops / 1e9:.1f} GFLOP/s, {mesh.mem_bandwidth / 1e9:.2f} GB/s copy "
          f"[profile + measurement {elapsed:.1f} s]")
    print(f"{'collective':<15}{'bytes':>12}{'measured ms':>14}{'predicted ms':>14}{'ratio':>8}")
    ratios: dict[str, list[float]] = {k: [] for k in KINDS}
    rows = []
    for t in timings:
        predicted = collective_seconds(t.kind, t.nbytes, mesh, 0)
        ratio = predicted / t.seconds
        ratios[t.kind].append(ratio)
        print(f"{t.kind:<15}{t.nbytes:>12,d}{t.seconds * 1e3:>14.3f}{predicted * 1e3:>14.3f}{ratio:>8.2f}")
        rows.append({"bench": "comm", "procs": args.procs, "kind": t.kind, "nbytes": t.nbytes,
                     "measured_s": t.seconds, "predicted_s": predicted, "ratio": ratio})
    for kind, values in ratios.items():
        print(f"median ratio {kind:<15}{statistics.median(values):6.2f}")
    overall = statistics.median(r for values in ratios.values() for r in values)
    print(f"median ratio (all collectives, predicted/measured): {overall:.2f} held out; "
          f"{in_sample:.2f} on the points the fit came from")
    if args.jsonl:
        with args.jsonl.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
