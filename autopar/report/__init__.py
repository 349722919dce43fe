"""The inspect report: a solved plan plus what its choices imply, as text and as HTML.

``build_report(plan, result)`` takes the ``Plan`` and the ``autopar.api.PlanResult`` it came
from (``autopar.api.plan_model``: the built problem and the recompute plan behind it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.plans import Plan
from autopar.report.analysis import CommRow, LayerRow, Timeline, comm_breakdown, layer_rows, memory_timeline
from autopar.report.tables import TableRow, embedding_tables

__all__ = ["Report", "build_report", "render_text", "render_html"]


@dataclass
class Report:
    plan: Plan
    comm: list[CommRow]
    timeline: Timeline
    layers: list[LayerRow]
    wall_s: float = 0.0  # end-to-end seconds of the command (set by the CLI)
    tables: list[TableRow] = field(default_factory=list)  # embedding tables, one per _embedding_bag


def build_report(plan: Plan, result) -> Report:
    """The report of ``plan``; ``result``: the ``PlanResult`` it came from."""
    built, choice = result.built, result.recompute.choice
    est = plan.estimate
    return Report(
        plan=plan,
        comm=comm_breakdown(built, choice, plan.mesh,
                            recomputed=frozenset(n for r in result.recompute.regions for n in r.nodes),
                            hidden_share=min(est.hidden_s / est.async_s, 1.0) if est.async_s > 0 else 0.0),
        timeline=memory_timeline(result.recompute),
        layers=layer_rows(plan, built, choice),
        tables=embedding_tables(plan, result.traced),
    )


def render_text(report: Report, **kwargs) -> str:
    from autopar.report.text import render

    return render(report, **kwargs)


def render_html(report: Report) -> str:
    from autopar.report.html import render

    return render(report)
