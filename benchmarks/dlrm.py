"""Offline: DLRM at MLPerf's Criteo-1TB sizes on 8 x 8 GPUs, per-table placement vs uniform families.

Usage:
  python benchmarks/dlrm.py                                   # 8x8 H100-80GB, 80 GiB, batch 65536
  python benchmarks/dlrm.py --mesh 4x8 --preset a100-80gb --memory 40GiB --json out.json

The zoo's ``dlrm`` (26 tables of dim 128 with the MLPerf cardinalities and multi-hot sizes, up to
40M rows each, ~104 GB of fp32 tables; bottom 512-256-128, top 1024-1024-512-256-1) is built on
the ``meta`` device -- no table is ever allocated -- traced, profiled and planned by the one ILP,
which places every table (its ``_embedding_bag``'s layout) jointly with the rest of the model.
Printed: the plan's seconds (trace + profile + ``plan_traced``, what one ``autopar.plan`` costs),
its estimate and one line per table, as ``autopar inspect dlrm`` prints them.

Then, in the same cost model (the same built problem, restricted: ``planner.table_families``),
the best plans with every table placed one way: row-wise, table-wise (each table whole on ONE of
the 64 devices, owners from ``planner.table_partition``, the peak that of the fullest device),
column-wise, data-parallel, dp x row-wise and column x row-wise. Row-wise and table-wise state a
table as split by rows over the devices (table-wise: the balanced share the ILP prices), which
needs its rows to divide by them, so this comparison runs on a copy whose rows are rounded up to
a multiple of the device count (at most 63 rows more per table, as a row-wise sharder pads its
last shard); autopar's own plan is shown on both.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def plan_dlrm(model, inputs, *, mesh, preset: str, memory: str, families=(), time_limit: float = 60.0) -> dict:
    """Trace, profile and plan ``model``; then the best plan of each table family in ``families``.
    Returns the seconds, autopar's plan, its tables and each family's estimate (or why not)."""
    from autopar.api import PlanOptions, plan_traced
    from autopar.planner.table_families import table_family_plan
    from autopar.report.tables import embedding_tables
    from autopar.strategies import needs_decomposition
    from autopar.tracer import profile, trace

    start = time.perf_counter()
    traced = trace(model, inputs, decompose_if=needs_decomposition)
    result = plan_traced(traced, profile(traced), mesh=mesh,
                         options=PlanOptions(memory_budget=memory, preset=preset, time_limit=time_limit))
    seconds = time.perf_counter() - start
    out = {"plan_s": seconds, "plan": result.plan, "tables": embedding_tables(result.plan, traced), "families": {}}
    for family in families:
        try:
            plan = table_family_plan(traced, result.built, family, time_limit=time_limit)
            out["families"][family] = (plan.estimate, None)
        except ValueError as exc:
            out["families"][family] = (None, str(exc).splitlines()[0])
    return out


def padded_rows(rows, multiple: int) -> tuple[int, ...]:
    return tuple(-(-r // multiple) * multiple for r in rows)


def dlrm_model(*, batch: int, rows=None):
    """The zoo's Criteo-1TB DLRM on meta (``rows``: other table sizes, same shapes otherwise)."""
    import torch

    from autopar import zoo

    with torch.device("meta"):
        model = zoo.DLRM(num_dense=13, table_rows=tuple(rows or zoo.CRITEO_1TB_ROWS), dim=128, bottom=(512, 256),
                         top=(1024, 1024, 512, 256), hotness=zoo.CRITEO_1TB_HOTNESS)
    model.train()
    return model, zoo.dlrm_inputs(model, batch=batch, device="meta")


def _row(name: str, est, note: str | None, best: float | None) -> str:
    if est is None:
        return f"  {name:<24} {'-':>10} {'-':>10} {'-':>10} {'-':>10}  {note}"
    vs = f"{est.step_s / best:.2f}x autopar's step" if best else ""
    return (f"  {name:<24} {est.step_s * 1e3:8.3f}ms {est.compute_s * 1e3:8.3f}ms {est.communication_s * 1e3:8.3f}ms "
            f"{est.peak_bytes / 2**30:7.2f}GiB  {vs}")


def main(argv=None) -> int:
    from autopar.layout.mesh import MeshSpec
    from autopar.planner.table_families import TABLE_FAMILIES
    from autopar.report.text import render_tables

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", default="8x8")
    ap.add_argument("--preset", default="h100-80gb")
    ap.add_argument("--memory", default="80GiB")
    ap.add_argument("--batch", type=int, default=65536, help="global batch (MLPerf: 65536)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    mesh = MeshSpec.preset(args.preset, args.mesh)
    devices = mesh.num_devices

    model, inputs = dlrm_model(batch=args.batch)
    exact = plan_dlrm(model, inputs, mesh=mesh, preset=args.preset, memory=args.memory)
    plan = exact["plan"]
    print(f"DLRM Criteo-1TB (published table sizes), batch {args.batch}, mesh {mesh} at {args.memory}: "
          f"planned in {exact['plan_s']:.1f}s (trace + profile + plan, tables on meta)")
    print(f"  autopar: {plan.estimate}; {len(plan.tables)} tables table-wise (whole on one device)")
    print("\n".join(render_tables(exact["tables"])))

    model, inputs = dlrm_model(batch=args.batch, rows=padded_rows([t.num_embeddings for t in model.tables], devices))
    padded = plan_dlrm(model, inputs, mesh=mesh, preset=args.preset, memory=args.memory, families=TABLE_FAMILIES)
    best = padded["plan"].estimate.step_s
    print(f"\nsame cost model, rows rounded up to a multiple of {devices} (planned in {padded['plan_s']:.1f}s):")
    print(f"  {'plan':<24} {'step':>10} {'compute':>10} {'comm':>10} {'peak':>10}")
    print(_row("autopar (per table)", padded["plan"].estimate, None, None))
    print("\n".join(f"    {line}" for line in render_tables(padded["tables"])))
    for family, (est, note) in padded["families"].items():
        print(_row(f"all tables {family}", est, note, best))
    if args.json:
        record = {
            "mesh": args.mesh, "preset": args.preset, "memory": args.memory, "batch": args.batch,
            "plan_s": exact["plan_s"], "step_s": plan.estimate.step_s, "peak_bytes": plan.estimate.peak_bytes,
            "tables": [t.__dict__ for t in exact["tables"]],
            "padded_plan_s": padded["plan_s"], "padded_tables": [t.__dict__ for t in padded["tables"]],
            "padded_peak_bytes": {"autopar": padded["plan"].estimate.peak_bytes,
                                  **{f: e.peak_bytes for f, (e, _) in padded["families"].items() if e}},
            "padded": {"autopar": padded["plan"].estimate.step_s,
                       **{f: (e.step_s if e else note) for f, (e, note) in padded["families"].items()}},
        }
        Path(args.json).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
