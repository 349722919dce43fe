"""The report and the plan split communication into exposed and hidden (``MeshSpec.comm_overlap``)."""

import json
from dataclasses import replace

import pytest
import torch
from torch import nn

from autopar.api import PlanOptions, plan_model
from autopar.layout.mesh import MeshSpec
from autopar.plans import Plan
from autopar.report import build_report, render_html, render_text
from autopar.report.text import fmt_ms


class Mlp(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # tanh needs the row-parallel output whole: tensor parallelism pays an all-reduce for it
        return torch.tanh(self.down(torch.relu(self.up(x)))).sum()


@pytest.fixture(scope="module")
def result():
    with torch.device("meta"):
        model = Mlp(256)
    mesh = replace(MeshSpec.preset("cpu", (2,)), comm_overlap=0.75)
    return plan_model(model, (torch.empty(2048, 256, device="meta"),), mesh=mesh,
                      options=PlanOptions(checkpoint="none"))


def test_the_report_splits_each_collective_and_the_totals(result):
    plan, est = result.plan, result.plan.estimate
    assert est.async_s > 0 and 0 < est.hidden_s <= 0.75 * est.async_s
    assert est.step_s == pytest.approx(est.compute_s + est.communication_s - est.hidden_s, rel=1e-9)
    report = build_report(plan, result)
    buckets = [r for r in report.comm if r.source == "bucket"]
    assert buckets and all(0 < r.hidden_s <= r.seconds for r in buckets)
    assert all(r.hidden_s == 0.0 for r in report.comm if r.source != "bucket")
    assert sum(r.hidden_s for r in report.comm) == pytest.approx(est.hidden_s, rel=1e-9)
    assert sum(r.seconds for r in report.comm) == pytest.approx(est.communication_s, rel=1e-9)
    text = render_text(report)
    total = sum(r.seconds for r in report.comm)
    assert f"total {fmt_ms(total)}: exposed {fmt_ms(total - est.hidden_s)}, hidden {fmt_ms(est.hidden_s)}" in text
    assert f"hidden under compute {fmt_ms(est.hidden_s)} (of {fmt_ms(est.async_s)} issued asynchronously, " \
           f"overlap 0.75)" in text
    header = next(line for line in text.splitlines() if line.strip().startswith("collective"))
    assert "exposed" in header and "hidden" in header
    page = render_html(report)
    assert "<th>exposed</th><th>hidden</th>" in page and f"hidden under compute {fmt_ms(est.hidden_s)}" in page


def test_the_plan_carries_the_split_and_old_plans_still_load(result):
    plan = result.plan
    back = Plan.from_json(plan.to_json())
    assert back.estimate == plan.estimate and back.estimate.hidden_s == plan.estimate.hidden_s > 0
    assert back.mesh.comm_overlap == 0.75
    data = json.loads(plan.to_json())
    for key in ("async_s", "hidden_s"):
        del data["estimate"][key]
    del data["mesh"]["comm_overlap"]
    old = Plan.from_json(json.dumps(data))
    assert old.estimate.async_s == old.estimate.hidden_s == 0.0 and old.mesh.comm_overlap == 0.0
