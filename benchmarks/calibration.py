"""The cost model's step estimate against the measured step: the ``cpu`` preset vs a calibration.

    python benchmarks/calibration.py [--world 2] [--profile machine.json] [--steps 8]
                                     [--hidden 256 --layers 4 --heads 4 --vocab 128 --seq 128 --batch 8]
                                     [--precision fp32] [--jsonl out.jsonl]

GPT-2-tiny (the runtime benchmark's model, wrapped to return its loss) is planned on mesh
``(world,)`` twice in this process: with ``preset="cpu"`` (the spec-sheet roofline) and with a
machine profile (``--profile``, else calibrated first: ``autopar.calibrate`` on ``world`` forked
ranks). Then ``world`` forked gloo ranks (one thread each) build both plans
(``autoparallelize(plan=...)``) and time training steps (zero_grad, forward, backward, AdamW
step) in interleaved rounds, so outside load hits both alike. Printed per cost model: the plan's
estimated step (compute + communication), the measured median step, and estimate / measured
(1.0 is a perfect estimate; the measured step includes the optimizer step and Python overhead
the estimate does not price).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _baselines import gpt2_config_model  # noqa: E402

import autopar  # noqa: E402
from autopar.runtime.launch import run_local  # noqa: E402


def _model(args):
    from autopar.cli.demo import LossOnly

    model, inputs = gpt2_config_model(hidden=args.hidden, layers=args.layers, heads=args.heads, vocab=args.vocab,
                                      seq=args.seq, batch=args.batch)
    return LossOnly(model), inputs


def _time_steps(rank, world, args, plans):
    model, inputs = _model(args)
    built = {name: autopar.autoparallelize(copy.deepcopy(model), inputs, plan=plan) for name, plan in plans.items()}
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in built.items()}

    def step(name):
        opts[name].zero_grad()
        built[name](**inputs).backward()
        opts[name].step()

    for name in built:  # warm-up
        step(name)
        step(name)
    times: dict[str, list[float]] = {name: [] for name in built}
    for r in range(args.steps):
        for name in (list(built) if r % 2 == 0 else list(reversed(built))):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            step(name)
            torch.distributed.barrier()  # a step ends when its slowest rank does
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--profile", help="a machine profile of mesh (world,) (default: calibrate one now)")
    p.add_argument("--steps", type=int, default=8)
    for name, default in (("hidden", 256), ("layers", 4), ("heads", 4), ("vocab", 128), ("seq", 128), ("batch", 8)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--jsonl", help="append one JSON row per cost model")
    args = p.parse_args(argv)
    load = os.getloadavg()[0]
    profile = args.profile
    if profile is None:
        profile = os.path.join(tempfile.mkdtemp(), "machine.json")
        t0 = time.perf_counter()
        autopar.calibrate((args.world,), local=args.world, out=profile)
        print(f"calibrated {args.world} ranks in {time.perf_counter() - t0:.1f} s -> {profile}")
    model, inputs = _model(args)
    plans = {source: autopar.plan(model, inputs, mesh=(args.world,), preset=source, precision=args.precision,
                                  cache=False)
             for source in ("cpu", profile)}
    measured = run_local(_time_steps, args.world, args, plans, timeout=1800)[0]
    print(f"GPT-2-tiny hidden {args.hidden} x {args.layers} layers, seq {args.seq}, batch {args.batch}, "
          f"{args.precision}, mesh ({args.world},); load {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
    print(f"{'cost model':<28}{'estimate ms':>12}{'compute':>10}{'comm':>10}{'measured ms':>13}{'ratio':>8}")
    for source, plan in plans.items():
        est = plan.estimate
        label = "cpu preset" if source == "cpu" else "calibrated profile"
        ratio = est.step_s / measured[source]
        print(f"{label:<28}{est.step_s * 1e3:>12.1f}{est.compute_s * 1e3:>10.1f}{est.communication_s * 1e3:>10.1f}"
              f"{measured[source] * 1e3:>13.1f}{ratio:>8.2f}")
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps({"bench": "calibration", "cost_model": label, "world": args.world,
                                    "estimate_s": est.step_s, "measured_s": measured[source], "ratio": ratio,
                                    "load": load}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
