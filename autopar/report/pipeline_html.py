"""Self-contained HTML of a pipelined plan: summary, stage table and the schedule timeline (SVG).

The timeline is ``autopar.planner.pipeline.timeline.simulate`` over the plan's per-stage figures
(one row per pipeline rank, one box per pass: forward, backward, zero-bubble's weight-gradient
pass, the step's gradient sync). The simulated step time is printed beside the plan's formula
estimate; they agree for gpipe/1f1b and, with at least as many micro-batches as ranks, for the
interleaved schedules.
"""

from __future__ import annotations

from html import escape

from autopar.planner.pipeline.timeline import Timeline, simulate
from autopar.report.html import _CSS
from autopar.report.text import fmt_bytes, fmt_ms

__all__ = ["render_pipeline", "schedule_svg", "plan_timeline"]

_W, _ROW, _PAD_L, _PAD_T = 1100, 34, 90, 24
_COLOURS = {"F": "#4a7fc1", "B": "#2e9c57", "W": "#e8a33d", "S": "#9a9a9a"}
_NAMES = {"F": "forward", "B": "backward", "W": "weight gradient (zero-bubble)", "S": "gradient sync"}


def _figures(plan) -> list[dict]:
    figures = plan.solver.get("pipeline", {}).get("stages", ())
    if len(figures) != len(plan.pipeline.stages):
        raise ValueError(f"plan {plan.model!r} has no per-stage figures (solver['pipeline']['stages']): it was not "
                         f"made by the pipeline stage search")
    return list(figures)


def plan_timeline(plan) -> Timeline:
    """The simulated schedule of a pipelined ``plan`` (``Plan.pipeline`` must be set)."""
    if plan.pipeline is None:
        raise ValueError(f"plan {plan.model!r} has no pipeline")
    pipe, figures = plan.pipeline, _figures(plan)
    return simulate(pipe.schedule, times=[f["time_s"] for f in figures], syncs=[f["sync_s"] for f in figures],
                    num_ranks=pipe.num_stages, virtual_stages=pipe.virtual_stages,
                    num_microbatches=pipe.num_microbatches)


def schedule_svg(timeline: Timeline) -> str:
    """One row per pipeline rank; boxes coloured by pass kind, labelled with the micro-batch
    (and the stage, when a rank holds several); a time axis in ms."""
    height = _PAD_T + timeline.num_ranks * _ROW + 30
    scale = (_W - _PAD_L - 10) / (timeline.step_s or 1.0)
    parts = [f'<svg id="schedule" width="{_W}" height="{height}" viewBox="0 0 {_W} {height}" role="img" '
             f'aria-label="pipeline schedule">']
    multi = len({p.stage for p in timeline.passes if p.kind != "S"}) > timeline.num_ranks
    for r in range(timeline.num_ranks):
        y = _PAD_T + r * _ROW
        parts.append(f'<text x="4" y="{y + _ROW / 2 + 4:.1f}" font-size="12">rank {r}</text>')
    for p in timeline.passes:
        x, w = _PAD_L + p.start * scale, max((p.end - p.start) * scale, 0.5)
        y = _PAD_T + p.rank * _ROW + 3
        what = "gradient sync" if p.kind == "S" else f"{_NAMES[p.kind]}, stage {p.stage}, micro-batch {p.micro}"
        parts.append(f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{_ROW - 6}" fill="{_COLOURS[p.kind]}" '
                     f'stroke="#fff" stroke-width="0.5"><title>{escape(what)}: {fmt_ms(p.start)} .. '
                     f'{fmt_ms(p.end)}</title></rect>')
        label = "" if p.kind == "S" else (f"{p.stage}:{p.micro}" if multi else str(p.micro))
        if label and w >= 7 * len(label):
            parts.append(f'<text x="{x + w / 2:.2f}" y="{y + (_ROW - 6) / 2 + 4:.1f}" font-size="11" fill="#fff" '
                         f'text-anchor="middle">{label}</text>')
    axis_y = _PAD_T + timeline.num_ranks * _ROW + 14
    for i in range(6):
        t = timeline.step_s * i / 5
        parts.append(f'<text x="{_PAD_L + t * scale:.1f}" y="{axis_y}" font-size="11" text-anchor="middle">'
                     f'{fmt_ms(t)}</text>')
    parts.append("</svg>")
    legend = " ".join(f'<span class="spec" style="background:{c};color:#fff">{escape(_NAMES[k])}</span>'
                      for k, c in _COLOURS.items() if any(p.kind == k for p in timeline.passes))
    return "".join(parts) + f"<p>{legend}</p>"


def _stage_table(plan) -> str:
    rows = []
    for st, f in zip(plan.pipeline.stages, _figures(plan)):
        rows.append(f"<tr><td class=num>{st.index}</td><td class=num>{st.rank}</td>"
                    f"<td>{st.layers[0]}..{st.layers[1] - 1}</td><td class=num>{len(st.nodes)}</td>"
                    f"<td class=num>{fmt_ms(f['time_s'])}</td><td class=num>{fmt_ms(f['p2p_s'])}</td>"
                    f"<td class=num>{fmt_ms(f.get('overhead_s', 0.0))}</td>"
                    f"<td class=num>{fmt_ms(f['sync_s'])}</td><td class=num>{f['in_flight']}</td>"
                    f"<td class=num>{fmt_bytes(f['peak_bytes'])}</td></tr>")
    return ('<table id="stages"><tr><th>stage</th><th>rank</th><th>blocks</th><th>nodes</th><th>per micro-batch</th>'
            '<th>p2p</th><th>schedule actions</th><th>gradient sync</th><th>in flight</th><th>peak</th></tr>'
            + "".join(rows) + "</table>")


def render_pipeline(plan, *, candidates=None) -> str:
    """The whole page for a plan from the pipeline search: a pipelined ``plan``, or the plan
    without a pipeline that ``pipeline="auto"`` found faster (its summary and the candidates).
    ``candidates``: the search's lines (default: those the plan records)."""
    title = f"autopar pipelined plan: {plan.model} on {plan.mesh}"
    if candidates is None:
        candidates = plan.solver.get("pipeline", {}).get("candidates", ())
    sections = [f"<h1>{escape(title)}</h1>", f"<pre>{escape(plan.summary())}</pre>"]
    if plan.pipeline is None:
        sections.append("<p>No pipeline: planning without one was faster than every pipelined candidate "
                        "(below). <code>autopar inspect</code> without <code>--pipeline</code> reports that plan "
                        "in full.</p>")
    else:
        timeline = plan_timeline(plan)
        pipe, est = plan.pipeline, plan.estimate
        sections += [
            "<h2>Stages</h2>", _stage_table(plan),
            f"<h2>Schedule: {escape(pipe.schedule)}, {pipe.num_microbatches} micro-batches, {pipe.num_stages} ranks "
            f"x {pipe.virtual_stages} stages</h2>",
            f"<p>Simulated step {fmt_ms(timeline.step_s)} (idle {timeline.bubble_fraction():.0%} of rank time); the "
            f"plan's estimate {fmt_ms(est.step_s)}. Each stage's time per micro-batch is split 1:2 between forward "
            f"and backward (zero-bubble: forward, input gradient and weight gradient a third each).</p>",
            schedule_svg(timeline),
        ]
    if candidates:
        sections += ["<h2>Candidates</h2>", "<ul>" + "".join(f"<li><code>{escape(c)}</code></li>" for c in candidates)
                     + "</ul>"]
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f"<style>{_CSS}</style></head><body>\n" + "\n".join(sections) + "\n</body></html>\n")
