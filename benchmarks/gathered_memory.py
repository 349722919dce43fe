"""Measured memory of plans whose readers gather parameter copies, against the planner's estimate.

    python benchmarks/gathered_memory.py [--zero3 gpt2,llama] [--auto gpt2] [--meshes 2,2x2]
                                         [--factors 1.0,1.05] [--batch 8]

A parameter stored sharded (ZeRO-3, or an auto plan's split weight) that a reader takes whole
is gathered on the edge into it, and autograd keeps that copy from the reader's forward to its
backward; the planner counts it on the parameter -> reader edge (``Edge.mem``). Two checks:

- ``--zero3``: the ZeRO-3 family's plan (``plan_family``, under ``_measure.sharded_state_budget``:
  every parameter sharded, as FSDP2) of each model on mesh (2,): measured bytes within 10% of
  the estimate (issue 30's memory target);
- ``--auto``: the auto plan (``autopar.plan``) of each model on each mesh at ``--factors`` x the
  smallest budget the planner reports (its refusal of a 1-byte budget): measured at or below
  that budget.

Memory per rank is ``fidelity.py``'s: the local bytes of parameters, gradients and optimizer
state after a step plus the peak of the bytes saved for backward (``SavedBytes``), the maximum
over ranks; one warm-up step first. Meshes use the ``cpu`` preset (as ``autopar.plan(model,
inputs, mesh=...)`` plans); nothing is timed.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _measure import build_model, sharded_state_budget  # noqa: E402
from fidelity import Candidate, _worker  # noqa: E402

MEMORY_TARGET = 0.10


def _smallest(model, inputs, mesh) -> int:
    import autopar
    from tests.budgets import smallest_budget

    return smallest_budget(lambda b: autopar.plan(model, inputs, mesh=mesh, memory_budget=b, cache=False))


def _measured(cands, model, inputs, world: int) -> dict[str, int]:
    from autopar.runtime.launch import run_local

    results = run_local(_worker, world, cands, model, inputs, 0, 1, "cpu", backend="gloo", timeout=1800)
    return {c.name: max(r["memory"][c.name]["saved"] + r["memory"][c.name]["state"] for r in results)
            for c in cands}


def zero3(names, batch: int) -> list[tuple]:
    from autopar.layout.mesh import MeshSpec
    from autopar.planner.options import PlanOptions
    from autopar.planner.orchestrate import plan_family

    mesh, rows = MeshSpec.preset("cpu", (2,)), []
    for name in names:
        model, inputs = build_model(name, batch=batch)
        dp = plan_family(model, inputs, "data-parallel", mesh=mesh, options=PlanOptions(zero_stage=0))
        plan = plan_family(model, inputs, "zero3", mesh=mesh,
                           options=PlanOptions(memory_budget=sharded_state_budget(dp.estimate, 2)))
        cand = Candidate(f"{name}-zero3", plan.estimate.step_s, plan.estimate.peak_bytes, plan)
        meas = _measured([cand], model, inputs, 2)[cand.name]
        ok = abs(cand.estimate_bytes / meas - 1) <= MEMORY_TARGET
        rows.append((cand.name, (2,), None, cand.estimate_bytes, meas, ok))
    return rows


def auto(names, meshes, factors, batch: int) -> list[tuple]:
    import autopar
    from autopar.layout.mesh import MeshSpec

    rows = []
    for shape in meshes:
        mesh = MeshSpec.preset("cpu", shape)
        for name in names:
            model, inputs = build_model(name, batch=batch)
            smallest = _smallest(model, inputs, mesh)
            cands = []
            for f in factors:
                budget = int(f * smallest)
                plan = autopar.plan(model, inputs, mesh=mesh, memory_budget=budget, cache=False)
                cands.append(Candidate(f"{name}-auto@{f:g}x", plan.estimate.step_s, plan.estimate.peak_bytes, plan,
                                       budget=budget))
            meas = _measured(cands, model, inputs, math.prod(shape))
            rows += [(c.name, shape, c.budget, c.estimate_bytes, meas[c.name], meas[c.name] <= c.budget) for c in cands]
    return rows


def main(argv=None) -> list[tuple]:
    from autopar.layout.mesh import parse_mesh_shape

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--zero3", default="gpt2,llama", help="models whose ZeRO-3 plan is measured on mesh (2,)")
    p.add_argument("--auto", default="gpt2", help="models whose auto plan is measured at tight budgets")
    p.add_argument("--meshes", default="2,2x2", help="the auto plans' meshes")
    p.add_argument("--factors", default="1.0,1.05", help="the auto plans' budgets, x the smallest")
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args(argv)
    rows = zero3([m for m in args.zero3.split(",") if m], args.batch)
    rows += auto([m for m in args.auto.split(",") if m], [parse_mesh_shape(m) for m in args.meshes.split(",")],
                 [float(f) for f in args.factors.split(",")], args.batch)
    print(f"\n{'plan':<20} {'mesh':<7} {'budget MiB':>10} {'est MiB':>8} {'meas MiB':>8} {'est/meas':>8}  ok"
          f"   (load {os.getloadavg()[0]:.2f})")
    for name, shape, budget, est, meas, ok in rows:
        b = "-" if budget is None else f"{budget / 2**20:.3f}"
        print(f"{name:<20} {str(shape):<7} {b:>10} {est / 2**20:8.3f} {meas / 2**20:8.3f} {est / meas:8.3f}  "
              f"{'yes' if ok else 'NO'}")
    return rows


if __name__ == "__main__":
    main()
