"""Plain-text rendering of the inspect report (fixed-width tables, no colour codes)."""

from __future__ import annotations

from collections import Counter
from typing import Sequence

__all__ = ["render", "fmt_bytes", "fmt_ms", "table", "baseline_rows", "recompute_note", "block_groups"]


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def fmt_ms(seconds: float | None) -> str:
    return "unknown" if seconds is None else f"{seconds * 1e3:.3f} ms"  # None: an unknown solver bound


def fmt_gap(share: float | None) -> str:
    return "unknown" if share is None else f"{share:.2%}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]], *, right: Sequence[int] = ()) -> list[str]:
    """Fixed-width columns; column indices in ``right`` are right-aligned."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]

    def line(cells):
        out = [f"{str(c):>{w}}" if i in right else f"{str(c):<{w}}" for i, (c, w) in enumerate(zip(cells, widths))]
        return "  " + "  ".join(out).rstrip()

    return [line(header), "  " + "  ".join("-" * w for w in widths)] + [line(r) for r in rows]


def baseline_rows(plan) -> list[tuple[str, bool, object, str]]:
    """(name, feasible, estimate, note) with autopar first."""
    return [("autopar", True, plan.estimate, "")] + [(b.name, b.feasible, b.estimate, b.note) for b in plan.baselines]


def recompute_note(plan) -> str:
    """The recomputed regions of ``plan`` in one line: how many, the method, their names."""
    names = ", ".join(r.name for r in plan.recompute)
    return f"{len(plan.recompute)} regions by {plan.checkpoint.get('method', '?')}: {names}"


def block_groups(layers) -> list[tuple[str | None, list]]:
    """Consecutive layer rows grouped by collapsed block (None: top-level rows)."""
    groups: list[tuple[str | None, list]] = []
    for row in layers:
        key = row.block
        if groups and groups[-1][0] == key and key is not None:
            groups[-1][1].append(row)
        else:
            groups.append((key, [row]))
    return groups


# ---------------------------------------------------------------------------------- sections
def _summary(report) -> list[str]:
    p = report.plan
    est, solver = p.estimate, p.solver
    in_op = est.comm_s
    lines = [f"autopar plan: {p.model} on mesh {p.mesh} ({p.mesh.num_devices} devices, axes "
             f"{', '.join(f'{n}={s}' for n, s in zip(p.mesh.axis_names, p.mesh.shape))})"]
    lines.append(f"  precision      {p.precision} compute, fp32 master weights, gradients summed in {p.reduce_dtype}"
                 if p.precision != "fp32" else "  precision      fp32")
    params = [n for n in p.nodes if n.kind == "parameter"]
    staged = Counter(n.zero_stage for n in params)
    if any(stage for stage in staged):
        lines.append("  ZeRO           " + ", ".join(f"stage {s}: {staged[s]} parameters" for s in sorted(staged)))
    if p.offload:
        lines += _offload(p)
    budget = p.budget_bytes
    if budget:
        used = f"{fmt_bytes(est.peak_bytes)} of {fmt_bytes(budget)} budget ({est.peak_bytes / budget:.0%})"
    else:
        used = fmt_bytes(est.peak_bytes)
    hidden = (f" - hidden under compute {fmt_ms(est.hidden_s)} (of {fmt_ms(est.async_s)} issued asynchronously, "
              f"overlap {p.mesh.comm_overlap:.2f})") if est.hidden_s else ""
    lines += [
        f"  step time      {fmt_ms(est.step_s)} = compute {fmt_ms(est.compute_s)} + communication "
        f"{fmt_ms(est.communication_s)} (in ops {fmt_ms(in_op)}, resharding {fmt_ms(est.reshard_s)}){hidden}",
        f"  peak memory    {used} per device; parameters + gradients + optimizer state "
        f"{fmt_bytes(est.param_bytes)}" + (f"; parameter copies readers gathered and keep for backward "
                                           f"{fmt_bytes(report.timeline.copies)}" if report.timeline.copies else ""),
        f"  solver         {solver.get('backend')} {solver.get('status')}: objective "
        f"{fmt_ms(solver.get('objective', 0.0))}, LP bound {fmt_ms(solver.get('lp_bound', 0.0))}, gap "
        f"{fmt_gap(solver.get('gap', 0.0))}; {solver.get('num_variables')} variables, "
        f"{solver.get('num_constraints')} constraints",
    ]
    if p.recompute:
        lines.append(f"  recompute      {recompute_note(p)}")
    if p.timings:
        stages = ", ".join(f"{k} {v:.2f}s" for k, v in p.timings.items() if not k.startswith("baseline"))
        base = sum(v for k, v in p.timings.items() if k.startswith("baseline"))
        lines.append(f"  planning time  {stages}" + (f", baselines {base:.2f}s" if base else "")
                     + (f"; total {report.wall_s:.1f}s" if report.wall_s else ""))
    if p.fallbacks:
        lines.append(f"  fallbacks      {len(p.fallbacks)} ops replicated without a sharding rule "
                     f"(--allow-fallback): {_fallback_ops(report)}")
    return lines


def _offload(plan, *, shown: int = 4) -> list[str]:
    """What the plan keeps on the host tier and what moving it costs per step."""
    info, tiers = plan.offload_info, plan.offload
    host = [fqn for fqn, t in tiers.items() if t == ("host", "host")]
    optim = [fqn for fqn, t in tiers.items() if t == ("device", "host")]
    lines = [f"  offload        {info.get('policy', '?')}: {len(host)} parameters (with their optimizer state) and "
             f"{len(optim)} more optimizer states on the host, of {len(tiers)} trainable parameters; host "
             f"{fmt_bytes(info.get('host_bytes', 0))} of {fmt_bytes(info.get('host_capacity') or 0)} per device",
             f"  host link      {fmt_ms(info.get('host_link_s', 0.0))} transfers + CPU optimizer "
             f"{fmt_ms(info.get('cpu_optimizer_s', 0.0))} per step (in the step time, not overlapped)"]
    for what, names in (("parameters on host", host), ("optimizer state on host", optim)):
        if names:
            more = f", ... (+{len(names) - shown})" if len(names) > shown else ""
            lines.append(f"    {what}: {', '.join(names[:shown])}{more}")
    if info.get("stream_buffer_bytes"):
        lines.append(f"    streamed parameters need ~{fmt_bytes(info['stream_buffer_bytes'])} of device buffer "
                     f"beyond the planned peak")
    return lines


def _fallback_ops(report) -> str:
    ops = Counter(report.plan.node(n).op for n in report.plan.fallbacks)
    return ", ".join(f"{op} x{c}" for op, c in ops.most_common())


def _comm(report) -> list[str]:
    if not report.comm:
        return ["communication: none (every device computes independently)"]
    rows = [(r.kind, r.axes, r.source, str(r.count), fmt_bytes(r.payload_bytes) if r.payload_bytes else "-",
             fmt_ms(r.seconds), fmt_ms(r.exposed_s), fmt_ms(r.hidden_s)) for r in report.comm]
    total = sum(r.seconds for r in report.comm)
    hidden = sum(r.hidden_s for r in report.comm)
    return (["communication per collective and mesh axis (one step, forward + backward; "
             "volume = full tensor bytes per collective, summed; hidden = under compute, not in the step time)"]
            + table(("collective", "axes", "where", "count", "volume", "time", "exposed", "hidden"), rows,
                    right=(3, 4, 5, 6, 7))
            + [f"  total {fmt_ms(total)}: exposed {fmt_ms(total - hidden)}, hidden {fmt_ms(hidden)}"])


def _layers(report) -> list[str]:
    rows = []
    for block, group in block_groups(report.layers):
        if block is not None:
            count = max(r.count for r in group)
            rows.append((f"{block} x{count}", "", "", "", "", fmt_ms(sum(r.compute_s for r in group)),
                         fmt_ms(sum(r.comm_s for r in group)), ""))
        for r in group:
            name = "  " + (r.module[len(block):] or "(the block's own ops)") if block is not None else r.module
            if block is not None and r.count != count:
                name += f" ({', '.join(i.rsplit('.', 1)[-1] for i in r.instances)})"
            rows.append((name, str(r.count), r.params or "-", f"{r.main_op}: {r.strategy}" if r.main_op else "-",
                         r.output or "-", fmt_ms(r.compute_s), fmt_ms(r.comm_s), fmt_bytes(r.act_bytes)))
    return (["per-layer strategies (repeated blocks collapsed; times summed over instances)"]
            + table(("module", "n", "parameters", "main op: strategy", "output", "compute", "comm", "act/inst"),
                    rows, right=(1, 5, 6, 7)))


def _baselines(report) -> list[str]:
    p = report.plan
    if not p.baselines:
        return []
    rows = []
    for name, ok, est, note in baseline_rows(p):
        if not ok:
            rows.append((name, "infeasible", "", "", "", note))
            continue
        ratio = est.step_s / p.estimate.step_s
        rows.append((name, fmt_ms(est.step_s), fmt_ms(est.compute_s), fmt_ms(est.communication_s),
                     fmt_bytes(est.peak_bytes), "-" if name == "autopar" else f"autopar {ratio:.2f}x faster"))
    out = ["baselines (same cost model and budget)"]
    out += table(("plan", "step", "compute", "communication", "peak", "vs autopar"), rows, right=(1, 2, 3, 4))
    best = p.best_baseline()
    if best is not None:
        out.append(f"  autopar speed-up over the best baseline ({best.name}): "
                   f"{best.estimate.step_s / p.estimate.step_s:.2f}x")
    else:
        out.append("  no baseline fits the budget")
    return out


def _tables(report) -> list[str]:
    return render_tables(getattr(report, "tables", []))


def render_tables(rows) -> list[str]:
    """One line per embedding table (``autopar.report.tables.TableRow``); nothing without tables."""
    if not rows:
        return []
    body = [(r.module, f"{r.rows:,} x {r.dim}", r.mode, r.weight_spec, r.placement, r.owner or "-") for r in rows]
    return (["embedding tables (one line per table: its placement per mesh axis; a table-wise table is whole "
             "on its owner, the device at that coordinate of its table-wise axes)"]
            + table(("table", "rows x dim", "pool", "layout", "placement", "owner"), body, right=(1,)))


def render(report, *, layers: bool = True) -> str:
    sections = [_summary(report), _comm(report)]
    if layers:
        sections.append(_layers(report))
    sections.append(_tables(report))
    sections.append(_baselines(report))
    return "\n\n".join("\n".join(s) for s in sections if s)
