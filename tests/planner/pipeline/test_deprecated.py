"""The module paths the README named before the ``autopar.planner.pipeline`` package keep working:
importing one warns (``DeprecationWarning``) and gives the package's own objects."""

import importlib
import sys

import pytest

MOVED = {
    "autopar.planner.pipeline_search": {
        "search_stages": "autopar.planner.pipeline.search", "PipelineSearch": "autopar.planner.pipeline.search",
        "StageCosts": "autopar.planner.pipeline.costs", "StageCost": "autopar.planner.pipeline.costs",
        "stage_costs": "autopar.planner.pipeline.costs", "HELD": "autopar.planner.pipeline.costs",
        "PipelineCandidate": "autopar.planner.pipeline.schedule", "schedule_cuts": "autopar.planner.pipeline.schedule",
        "schedules_for": "autopar.planner.pipeline.schedule",
        "check_pipeline_zero": "autopar.planner.pipeline.schedule"},
    "autopar.planner.pipeline_bounds": {
        name: "autopar.planner.pipeline.bounds" for name in ("block_floor", "step_floor", "config_floors",
                                                             "in_bound_order")},
    "autopar.planner.pipeline_timeline": {
        name: "autopar.planner.pipeline.timeline" for name in ("Pass", "Timeline", "simulate", "rank_order")},
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_module_path_warns_and_gives_the_moved_objects(old, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)  # imported fresh: the warning is at import
    with pytest.warns(DeprecationWarning, match=old.replace(".", r"\.") + " is deprecated"):
        alias = importlib.import_module(old)
    assert sorted(alias.__all__) == sorted(MOVED[old])
    for name, home in MOVED[old].items():
        assert getattr(alias, name) is getattr(importlib.import_module(home), name), name
