"""The report's memory timeline is the plan's own evaluation: with recompute, the HTML chart
peaks where ``Plan.estimate`` does, within the budget (GPT-2-tiny under half its peak)."""

from html.parser import HTMLParser

import pytest
import torch

from autopar import zoo
from autopar.api import PlanOptions, plan_model, plan_traced
from autopar.report import build_report, render_html, render_text
from autopar.report.text import fmt_bytes


@pytest.fixture(scope="module")
def gpt2_tiny():
    """GPT-2-tiny planned on 2 devices without recompute (its trace and profile are reused)."""
    torch.manual_seed(0)
    model, inputs = zoo.build("gpt2", tiny=True, batch=8, seq=128, num_layers=4, device="cpu")
    return plan_model(model, inputs, mesh=(2,), options=PlanOptions(checkpoint="none"))


class MemoryChart(HTMLParser):
    """The peak marker, the budget line and the curve of the ``memory-chart`` SVG."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = False
        self.peak_y: float | None = None
        self.peak_label = ""
        self.budget_y: float | None = None
        self.curve_ys: list[float] = []
        self._text = ""

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "svg":
            self.inside = attrs.get("id") == "memory-chart"
        elif self.inside and tag == "circle":
            self.peak_y = float(attrs["cy"])
        elif self.inside and tag == "line" and attrs.get("stroke") == "#c33":
            self.budget_y = float(attrs["y1"])
        elif self.inside and tag == "polyline":
            self.curve_ys = [float(p.split(",")[1]) for p in attrs["points"].split()]

    def handle_data(self, data):
        if self.inside and data.startswith("peak "):
            self.peak_label = data

    def handle_endtag(self, tag):
        if tag == "svg":
            self.inside = False


@pytest.mark.parametrize("checkpoint", ["ilp", "rotor"])
def test_recompute_plan_chart_peaks_at_the_estimate_within_budget(gpt2_tiny, checkpoint):
    budget = gpt2_tiny.plan.estimate.peak_bytes // 2
    result = plan_traced(gpt2_tiny.traced, gpt2_tiny.profile, mesh=(2,),
                         options=PlanOptions(memory_budget=budget, checkpoint=checkpoint))
    plan, rc = result.plan, result.recompute
    assert plan.recompute and rc.units, "half the no-recompute peak must force recompute"
    # Without its recompute the chosen sharding peaks over the budget: a chart that ignored
    # recompute would show that peak.
    assert rc.problem.evaluate(rc.choice).peak_bytes > budget

    report = build_report(plan, result)
    timeline = report.timeline.evaluation
    assert timeline.peak_bytes == plan.estimate.peak_bytes <= budget
    again = rc.problem.evaluate(rc.choice, recompute=rc.units, segment_inputs=rc.segment_inputs)
    assert timeline.activations == again.activations and timeline.param_bytes == again.param_bytes
    assert report.timeline.budget == budget

    chart = MemoryChart()
    chart.feed(render_html(report))
    assert chart.peak_label == f"peak {fmt_bytes(plan.estimate.peak_bytes)}"
    assert min(chart.curve_ys) == chart.peak_y  # the curve's top is the peak marker
    assert chart.peak_y >= chart.budget_y  # SVG y grows downwards: on or under the budget line

    text = render_text(report)
    assert f"peak memory    {fmt_bytes(plan.estimate.peak_bytes)} of {fmt_bytes(budget)} budget" in text
    assert f"recompute      {len(plan.recompute)} regions by {checkpoint}: {plan.recompute[0].name}" in text
