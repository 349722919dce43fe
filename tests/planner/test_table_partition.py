"""Table-wise placement in the planner: the ILP picks it per table, the partition names the owners.

A DLRM on ``meta`` with many equal tables whose dim does not divide by the devices (no
column-wise) on an 8-GPU H100 axis, under a budget that cannot hold them replicated: every table
goes table-wise, one per device, and the plan's peak is the fullest device's. With one
table more than devices (pinned table-wise) the fullest device holds two: its bytes and lookups
over the balanced share are in the peak and the step; left free, the planner re-solves with that
device's lookups charged whole and keeps the faster plan; ``fit_tables`` re-solves under a lower
budget when the owners overflow the budget (or says so). Plans keep their owners through JSON,
version-1 plan files load with none, and the report prints each table's owner.
"""

from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from autopar import zoo
from autopar.api import PlanOptions, plan_traced
from autopar.planner.offload_fit import replace_budget
from autopar.planner.table_families import table_family_plan
from autopar.planner.table_partition import fit_tables, partition
from autopar.layout.placement import Shard
from autopar.plans import Plan
from autopar.report.tables import embedding_tables
from autopar.report.text import render_tables
from autopar.strategies import needs_decomposition
from autopar.tracer import profile, trace

BAG = str(torch.ops.aten._embedding_bag.default)
TABLE_WISE = "S0 x R x R -> (S0, R, R, R)"


def _all_table_wise(node):
    """``plan_traced``'s ``fixed``: every lookup table-wise on axis 0."""
    if str(node.target) != BAG:
        return None
    return 0, (Shard(0), None, None), (Shard(0), None, None, None)


def _plan(num_tables: int, memory: str, fixed=None):
    with torch.device("meta"):
        model = zoo.DLRM(num_dense=13, table_rows=(1 << 20,) * num_tables, dim=20, bottom=(64,), top=(64,),
                         hotness=(4,) * num_tables)
    inputs = zoo.dlrm_inputs(model, batch=65536, device="meta")
    traced = trace(model, inputs, decompose_if=needs_decomposition)
    result = plan_traced(traced, profile(traced), mesh=(8,), fixed=fixed,
                         options=PlanOptions(preset="h100-80gb", memory_budget=memory))
    return traced, result


@pytest.fixture(scope="module")
def eight():
    return _plan(8, "1GiB")


def test_ilp_picks_table_wise_when_it_is_cheapest(eight):
    traced, result = eight
    plan = result.plan
    assert Counter(n.strategy for n in plan.nodes if n.op == BAG) == {TABLE_WISE: 8}
    assert sorted(t.owner for t in plan.tables) == [(d,) for d in range(8)]  # one table per device
    assert plan.solver["tables"]["excess_bytes"] == 0 and plan.estimate.peak_bytes <= plan.budget_bytes
    # In the same cost model, every table row-wise is slower and replicated does not fit.
    row_wise = table_family_plan(traced, result.built, "row-wise")
    assert row_wise.estimate.step_s > plan.estimate.step_s
    with pytest.raises(ValueError):
        table_family_plan(traced, result.built, "data-parallel")


def test_owners_survive_json_and_old_plans_load(eight):
    plan = eight[1].plan
    again = Plan.from_json(plan.to_json())
    assert again.tables == plan.tables and again.version == 2
    old = json.loads(plan.to_json())
    old.pop("tables")
    old["version"] = 1
    assert Plan.from_json(json.dumps(old)).tables == ()
    assert "table-wise: 8 tables" in plan.summary()


def test_report_prints_the_owner_of_each_table(eight):
    traced, result = eight
    rows = embedding_tables(result.plan, traced)
    assert [r.placement for r in rows] == ["table-wise over ax0"] * 8
    assert sorted(r.owner for r in rows) == [f"ax0={d}" for d in range(8)]
    text = "\n".join(render_tables(rows))
    assert "owner" in text and "ax0=3" in text


def test_one_table_more_than_devices_puts_the_overflow_in_the_plan():
    # Pinned table-wise: the fullest device holds two tables where it was charged 9/8 of one, and
    # does two whole lookups: both are in the plan's peak and step.
    traced, result = _plan(9, "1GiB", fixed=_all_table_wise)
    plan = result.plan
    tables = plan.solver["tables"]
    held = Counter(t.owner for t in plan.tables)
    assert len(plan.tables) == 9 and max(held.values()) == 2 and min(held.values()) == 1
    assert tables["excess_bytes"] == tables["device_bytes_max"] - tables["charged_bytes"] > 0
    assert plan.estimate.peak_bytes == result.recompute.evaluation.peak_bytes + tables["excess_bytes"]
    assert plan.estimate.step_s == pytest.approx(result.recompute.evaluation.objective + tables["excess_lookup_s"])
    assert tables["excess_lookup_s"] > 0 and plan.estimate.peak_bytes <= plan.budget_bytes
    # Free to choose, the planner re-solves with the busiest device's lookups charged whole and
    # keeps the faster plan: no device owns two tables, and the step is no slower than pinned.
    free = _plan(9, "1GiB")[1].plan
    assert free.tables and max(Counter(t.owner for t in free.tables).values()) == 1
    assert free.estimate.step_s <= plan.estimate.step_s and free.estimate.peak_bytes <= free.budget_bytes

def test_an_overflowing_budget_is_re_solved_lower():
    traced, result = _plan(9, "1GiB", fixed=_all_table_wise)
    # Under a budget the owners overflow by one byte, the planner re-solves under a lower one.
    rc, built = result.recompute, result.built
    placed = partition(traced, built, rc.choice)
    tight = replace_budget(built, rc.evaluation.peak_bytes + placed.excess_bytes - 1)
    # (a stand-in for the re-plan: the same tables, a peak that leaves room for the owners)
    fits = SimpleNamespace(choice=rc.choice, problem=tight.problem, method="none",
                           evaluation=SimpleNamespace(peak_bytes=0, objective=1.0))
    asked = []
    got, placed = fit_tables(traced, tight, rc, replan=lambda b: asked.append(b.problem.budget_bytes) or fits)
    assert got is fits and asked and asked[0] <= tight.problem.budget_bytes - 1 and len(placed.owners) == 9
    with pytest.raises(ValueError, match="table-wise placement.*over the budget"):
        fit_tables(traced, tight, rc, replan=lambda b: rc)
