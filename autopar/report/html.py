"""Self-contained HTML rendering of the inspect report: inline CSS and SVG, no scripts, no network.

Sections: summary, memory timeline (SVG chart against the budget), per-layer strategy map
(each output layout gets a colour), communication table, baseline comparison (table + bars).
"""

from __future__ import annotations

import hashlib
from html import escape

from autopar.report.text import baseline_rows, block_groups, fmt_bytes, fmt_gap, fmt_ms, recompute_note

__all__ = ["render", "memory_svg"]

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2em;color:#222;max-width:1400px}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.8em;border-bottom:1px solid #ccc}
table{border-collapse:collapse;font-size:.85em}td,th{padding:3px 8px;border-bottom:1px solid #eee;text-align:left}
th{background:#f4f4f4}td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.block td{background:#fafafa;font-weight:600}code,.spec{font-family:ui-monospace,Menlo,monospace}
.spec{padding:1px 5px;border-radius:3px;color:#111}dl{display:grid;grid-template-columns:max-content auto;gap:2px 14px}
dt{font-weight:600}dd{margin:0}.bar{fill:#4a7fc1}.bar.best{fill:#2e9c57}.bad{color:#b00}
"""

_CHART_W, _CHART_H, _PAD = 900, 300, 60
_MAX_POINTS = 1200  # the polyline is downsampled (max per bucket) beyond this


def _spec_colour(spec: str) -> str:
    if not spec or set(spec) <= {"R"}:
        return "#e8e8e8"
    hue = int(hashlib.md5(spec.encode()).hexdigest()[:4], 16) % 360
    return f"hsl({hue},65%,80%)"


def _spec(spec: str) -> str:
    return f'<span class="spec" style="background:{_spec_colour(spec)}">{escape(spec or "-")}</span>'


def _buckets(values: list[int]) -> list[tuple[int, int]]:
    """(point index, value) pairs; buckets keep their maximum so the peak is never lost."""
    if len(values) <= _MAX_POINTS:
        return list(enumerate(values))
    step = len(values) / _MAX_POINTS
    out = []
    for b in range(_MAX_POINTS):
        lo, hi = int(b * step), max(int((b + 1) * step), int(b * step) + 1)
        i = max(range(lo, min(hi, len(values))), key=values.__getitem__)
        out.append((i, values[i]))
    return out


def memory_svg(timeline) -> str:
    """Per-device memory over the step (parameters + live activations) against the budget."""
    ev = timeline.evaluation
    params = ev.param_bytes
    total = [params + a for a in ev.activations] or [params]
    top = max(max(total), timeline.budget or 0) * 1.08 or 1
    n = max(len(total) - 1, 1)
    w, h = _CHART_W - 2 * _PAD, _CHART_H - 2 * _PAD

    def x(i: float) -> float:
        return _PAD + w * i / n

    def y(v: float) -> float:
        return _PAD + h * (1 - v / top)

    pts = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in _buckets(total))
    area = f"{x(0):.1f},{y(0):.1f} {pts} {x(len(total) - 1):.1f},{y(0):.1f}"
    parts = [f'<svg id="memory-chart" xmlns="http://www.w3.org/2000/svg" width="{_CHART_W}" height="{_CHART_H}" '
             f'viewBox="0 0 {_CHART_W} {_CHART_H}" role="img" aria-label="memory timeline">',
             f'<rect x="{_PAD}" y="{_PAD}" width="{w}" height="{h}" fill="#fcfcfc" stroke="#ccc"/>']
    for k in range(5):  # y grid
        v = top * k / 4
        parts.append(f'<line x1="{_PAD}" x2="{_PAD + w}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#eee"/>'
                     f'<text x="{_PAD - 6}" y="{y(v) + 4:.1f}" font-size="10" text-anchor="end">{fmt_bytes(v)}</text>')
    fwd = x(timeline.forward_points)
    parts += [
        f'<line x1="{fwd:.1f}" x2="{fwd:.1f}" y1="{_PAD}" y2="{_PAD + h}" stroke="#999" stroke-dasharray="2,3"/>',
        f'<text x="{(_PAD + fwd) / 2:.1f}" y="{_PAD + h + 18}" font-size="11" text-anchor="middle">forward</text>',
        f'<text x="{(fwd + _PAD + w) / 2:.1f}" y="{_PAD + h + 18}" font-size="11" text-anchor="middle">backward</text>',
        f'<polygon points="{area}" fill="#4a7fc1" fill-opacity="0.25"/>',
        f'<polyline points="{pts}" fill="none" stroke="#4a7fc1" stroke-width="1.5"/>',
        f'<line x1="{_PAD}" x2="{_PAD + w}" y1="{y(params):.1f}" y2="{y(params):.1f}" '
        f'stroke="#7a5" stroke-dasharray="4,3"/><text x="{_PAD + 4}" y="{y(params) - 4:.1f}" '
        f'font-size="10" fill="#585">parameters + grads + optimizer {fmt_bytes(params)}</text>',
    ]
    if timeline.budget:
        parts.append(f'<line x1="{_PAD}" x2="{_PAD + w}" y1="{y(timeline.budget):.1f}" y2="{y(timeline.budget):.1f}" '
                     f'stroke="#c33" stroke-width="1.5" stroke-dasharray="6,3"/><text x="{_PAD + w - 4}" '
                     f'y="{y(timeline.budget) - 5:.1f}" font-size="11" fill="#c33" text-anchor="end">'
                     f'budget {fmt_bytes(timeline.budget)}</text>')
    px, peak = x(ev.peak_time or 0), ev.peak_bytes
    parts.append(f'<circle cx="{px:.1f}" cy="{y(peak):.1f}" r="3.5" fill="#c33"/><text x="{px + 6:.1f}" '
                 f'y="{y(peak) - 6:.1f}" font-size="11">peak {fmt_bytes(peak)}</text>')
    parts.append(f'<text x="{_PAD}" y="{_PAD - 12}" font-size="12">per-device memory over one training step '
                 f'({len(total)} timeline points)</text></svg>')
    return "\n".join(parts)


def _summary(report) -> str:
    p, est, s = report.plan, report.plan.estimate, report.plan.solver
    budget = f" of {fmt_bytes(p.budget_bytes)} budget ({est.peak_bytes / p.budget_bytes:.0%})" if p.budget_bytes else ""
    items = [
        ("model", escape(p.model)), ("mesh", f"{escape(str(p.mesh))} ({p.mesh.num_devices} devices)"),
        ("step time", f"{fmt_ms(est.step_s)} = compute {fmt_ms(est.compute_s)} + communication "
                      f"{fmt_ms(est.communication_s)} (in ops {fmt_ms(est.comm_s)}, "
                      f"resharding {fmt_ms(est.reshard_s)})"
                      + (f" &minus; hidden under compute {fmt_ms(est.hidden_s)} (of {fmt_ms(est.async_s)} issued "
                         f"asynchronously, overlap {p.mesh.comm_overlap:.2f})" if est.hidden_s else "")),
        ("peak memory", f"{fmt_bytes(est.peak_bytes)}{budget} per device"),
    ]
    if p.recompute:
        items.append(("recompute", escape(recompute_note(p))))
    items += [
        ("solver", f"{escape(str(s.get('backend')))} {escape(str(s.get('status')))}, LP bound "
                   f"{fmt_ms(s.get('lp_bound', 0.0))}, gap {fmt_gap(s.get('gap', 0.0))}, {s.get('num_variables')} "
                   f"variables, {s.get('num_constraints')} constraints"),
        ("planning", escape(", ".join(f"{k} {v:.2f}s" for k, v in p.timings.items()))),
    ]
    if p.fallbacks:
        items.append(("fallbacks", f'<span class="bad">{len(p.fallbacks)} ops replicated without a rule</span>'))
    return "<dl>" + "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in items) + "</dl>"


def _layers(report) -> str:
    head = ("<tr><th>module</th><th>n</th><th>parameters</th><th>main op</th><th>strategy</th><th>output</th>"
            "<th>compute</th><th>comm</th><th>activations / instance</th></tr>")
    rows = []
    for block, group in block_groups(report.layers):
        if block is not None:
            rows.append(f'<tr class="block"><td colspan="6">{escape(block)} &times;{max(r.count for r in group)}</td>'
                        f'<td class="num">{fmt_ms(sum(r.compute_s for r in group))}</td>'
                        f'<td class="num">{fmt_ms(sum(r.comm_s for r in group))}</td><td></td></tr>')
        for r in group:
            if block:
                name = "&nbsp;&nbsp;" + escape(r.module[len(block):] or "(the block's own ops)")
            else:
                name = escape(r.module)
            params = ", ".join(f"{escape(p.split(' ')[0])} {_spec(p.split(' ')[-1])}"
                               for p in r.params.split(", ") if p)
            rows.append(f"<tr><td><code>{name}</code></td><td class=num>{r.count}</td><td>{params or '-'}</td>"
                        f"<td><code>{escape(r.main_op)}</code></td><td><code>{escape(r.strategy)}</code></td>"
                        f"<td>{_spec(r.output)}</td><td class=num>{fmt_ms(r.compute_s)}</td>"
                        f"<td class=num>{fmt_ms(r.comm_s)}</td><td class=num>{fmt_bytes(r.act_bytes)}</td></tr>")
    return f'<table id="strategy-map">{head}{"".join(rows)}</table>'


def _comm(report) -> str:
    if not report.comm:
        return "<p>No communication: every device computes independently.</p>"
    rows = "".join(
        f"<tr><td><code>{escape(r.kind)}</code></td><td>{escape(r.axes)}</td><td>{r.source}</td>"
        f"<td class=num>{r.count}</td><td class=num>{fmt_bytes(r.payload_bytes) if r.payload_bytes else '-'}</td>"
        f"<td class=num>{fmt_ms(r.seconds)}</td><td class=num>{fmt_ms(r.exposed_s)}</td>"
        f"<td class=num>{fmt_ms(r.hidden_s)}</td></tr>" for r in report.comm)
    total, hidden = sum(r.seconds for r in report.comm), sum(r.hidden_s for r in report.comm)
    foot = (f'<tr class="block"><td colspan="5">total</td><td class=num>{fmt_ms(total)}</td>'
            f"<td class=num>{fmt_ms(total - hidden)}</td><td class=num>{fmt_ms(hidden)}</td></tr>")
    return ('<table id="communication"><tr><th>collective</th><th>mesh axes</th><th>where</th><th>count</th>'
            f"<th>volume</th><th>time</th><th>exposed</th><th>hidden</th></tr>{rows}{foot}</table>")


def _baselines(report) -> str:
    p = report.plan
    entries = baseline_rows(p)
    slowest = max((e.step_s for _, ok, e, _ in entries if ok), default=1.0)
    rows = []
    for name, ok, est, note in entries:
        if not ok:
            rows.append(f"<tr><td>{escape(name)}</td><td colspan=5 class=bad>infeasible: {escape(note)}</td></tr>")
            continue
        width = 260 * est.step_s / slowest
        cls = "bar best" if name == "autopar" else "bar"
        bar = f'<svg width="270" height="14"><rect class="{cls}" x="0" y="2" width="{width:.1f}" height="10"/></svg>'
        vs = "-" if name == "autopar" else f"{est.step_s / p.estimate.step_s:.2f}&times;"
        rows.append(f"<tr><td>{escape(name)}</td><td class=num>{fmt_ms(est.step_s)}</td><td class=num>"
                    f"{fmt_ms(est.compute_s)}</td><td class=num>{fmt_ms(est.communication_s)}</td><td class=num>"
                    f"{fmt_bytes(est.peak_bytes)}</td><td class=num>{vs}</td><td>{bar}</td></tr>")
    return ('<table id="baselines"><tr><th>plan</th><th>step</th><th>compute</th><th>communication</th>'
            f'<th>peak</th><th>baseline / autopar</th><th></th></tr>{"".join(rows)}</table>')


def render(report) -> str:
    p = report.plan
    title = f"autopar plan: {p.model} on {p.mesh}"
    sections = [
        f"<h1>{escape(title)}</h1>", _summary(report),
        "<h2>Memory timeline</h2>", memory_svg(report.timeline),
        "<h2>Per-layer strategy map</h2><p>Specs: one placement per mesh axis (S<i>d</i> = split on "
        "tensor dim <i>d</i>, R = replicated, P = partial sum). Repeated blocks are collapsed.</p>", _layers(report),
        "<h2>Communication per collective and mesh axis</h2>", _comm(report),
        "<h2>Baseline comparison (same cost model and budget)</h2>",
        _baselines(report) if p.baselines else "<p>Baselines were not computed (--no-baselines).</p>",
    ]
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f"<style>{_CSS}</style></head><body>\n" + "\n".join(sections) + "\n</body></html>\n")
