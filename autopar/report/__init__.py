"""The inspect report: a solved plan plus what its choices imply, as text and as HTML.

``build_report(plan, context)`` takes the ``Plan`` and the ``context`` dict that
``autopar.plan(..., context=...)`` filled (traced graph, built problem, solution).
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.plans import Plan
from autopar.report.analysis import CommRow, LayerRow, Timeline, comm_breakdown, layer_rows, memory_timeline

__all__ = ["Report", "build_report", "render_text", "render_html"]


@dataclass
class Report:
    plan: Plan
    comm: list[CommRow]
    timeline: Timeline
    layers: list[LayerRow]
    wall_s: float = 0.0  # end-to-end seconds of the command (set by the CLI)


def build_report(plan: Plan, context: dict) -> Report:
    built, solution = context["built"], context["solution"]
    return Report(
        plan=plan,
        comm=comm_breakdown(built, solution.choice, plan.mesh),
        timeline=memory_timeline(built.problem, solution.choice),
        layers=layer_rows(plan, built, solution.choice),
    )


def render_text(report: Report, **kwargs) -> str:
    from autopar.report.text import render

    return render(report, **kwargs)


def render_html(report: Report) -> str:
    from autopar.report.html import render

    return render(report)
