"""Text and HTML rendering of a plain plan (no recompute): every section is there, the tables
agree with the plan, the HTML is well formed and self-contained."""

from html.parser import HTMLParser

import pytest
import torch
from torch import nn

from autopar.api import PlanOptions, plan_model
from autopar.report import build_report, render_html, render_text
from autopar.report.text import fmt_bytes, fmt_ms


class Mlp(nn.Module):
    def __init__(self, d: int, num_blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(num_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.sum()


@pytest.fixture(scope="module")
def result():
    with torch.device("meta"):
        model = Mlp(1024, 2)
    return plan_model(model, (torch.empty(64, 1024, device="meta"),), mesh=(2, 2),
                      options=PlanOptions(memory_budget="1GiB", baselines=True, checkpoint="none"))


class Elements(HTMLParser):
    VOID = ("meta", "line", "rect", "circle", "polygon", "polyline")

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.open: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        if tag not in self.VOID:
            self.open.append(tag)

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        assert self.open and self.open[-1] == tag, f"unbalanced </{tag}>, open: {self.open[-5:]}"
        self.open.pop()


def test_plain_plan_report(result):
    plan = result.plan
    assert not plan.recompute
    report = build_report(plan, result)
    assert report.timeline.evaluation.peak_bytes == plan.estimate.peak_bytes
    assert report.timeline.forward_points * 2 == len(report.timeline.evaluation.activations)
    # The communication table adds up to the plan's communication (in ops + resharding).
    assert sum(r.seconds for r in report.comm) == pytest.approx(plan.estimate.communication_s, rel=1e-9)
    assert {r.module for r in report.layers} >= {"blocks.*.0", "blocks.*.2"}

    text = render_text(report)
    assert f"step time      {fmt_ms(plan.estimate.step_s)}" in text
    assert f"peak memory    {fmt_bytes(plan.estimate.peak_bytes)} of 1.00 GiB budget" in text
    for heading in ("communication per collective and mesh axis", "per-layer strategies", "baselines"):
        assert heading in text
    assert "\n  recompute " not in text  # no recompute line in the summary
    assert "per-layer strategies" not in render_text(report, layers=False)

    page = render_html(report)
    parser = Elements()
    parser.feed(page)
    parser.close()
    assert parser.open == []
    assert {"memory-chart", "strategy-map", "communication", "baselines"} <= parser.ids
    assert f"peak {fmt_bytes(plan.estimate.peak_bytes)}" in page and "budget 1.00 GiB" in page
    assert "<script" not in page


def test_one_line_per_embedding_table():
    from autopar import zoo

    model, inputs = zoo.build("dlrm", tiny=True)
    res = plan_model(model, inputs, mesh=(2, 2), options=PlanOptions(checkpoint="none"))
    report = build_report(res.plan, res)
    assert [t.module for t in report.tables] == [f"tables.{i}" for i in range(4)]
    assert [(t.rows, t.dim, t.mode) for t in report.tables] == [(32, 8, "sum"), (64, 8, "mean"), (16, 8, "max"),
                                                               (48, 8, "sum")]
    text = render_text(report)
    assert "embedding tables (one line per table" in text
    for t in report.tables:
        line = next(x for x in text.splitlines() if x.strip().startswith(t.module + " "))
        assert t.weight_spec in line and t.placement in line
    assert "embedding tables" not in render_text(build_report(*_mlp_plan()))


def _mlp_plan():
    with torch.device("meta"):
        model = Mlp(64, 1)
    res = plan_model(model, (torch.empty(8, 64, device="meta"),), mesh=(2,), options=PlanOptions(checkpoint="none"))
    return res.plan, res
