"""benchmarks/solver.py: suites are data; every shipped suite expands into valid cases."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import solver  # noqa: E402

from autopar import zoo  # noqa: E402
from autopar.layout.mesh import MeshSpec, parse_bytes  # noqa: E402


@pytest.mark.parametrize("name", ["quick", "targets", "depth", "zoo"])
def test_shipped_suites_expand_to_valid_cases(name):
    suite = solver.load_suite(name)
    assert suite["cases"]
    for c in suite["cases"]:
        assert c["model"] in zoo.NAMES and c["backend"] in ("highs", "cbc")
        MeshSpec.preset(c["device"], c["mesh"])  # raises on a mesh that does not tile the nodes
        if c.get("budget"):
            parse_bytes(c["budget"])
    ids = [solver.case_id(c) for c in suite["cases"]]
    assert len(ids) == len(set(ids))


def test_zoo_suite_is_the_full_matrix():
    cases = solver.load_suite("zoo")["cases"]
    assert len(cases) == len(zoo.NAMES) * 4 * 2 * 2
    assert {c["mesh"] for c in cases} == {"8", "2x4", "4x4", "8x8"}


def test_depth_suite_sweeps_12_to_96_layers():
    cases = solver.load_suite("depth")["cases"]
    assert sorted({c["layers"] for c in cases}) == [12, 24, 48, 96]


def test_unknown_case_key_is_refused():
    with pytest.raises(SystemExit, match="unknown case keys"):
        solver.expand_cases({"name": "x", "cases": [{"model": "gpt2", "mesh": "8", "layer": 3}]})


def test_depth_summary_and_table_from_records():
    def rec(layers, solve):
        return {"case": f"gpt2/L{layers} 2x4 40GiB highs", "ok": True, "model": "gpt2", "mesh": "2x4",
                "budget": "40GiB", "backend": "highs", "layers": layers, "num_variables": 100, "num_constraints": 10,
                "objective_s": 0.1, "lp_bound_s": 0.1, "gap": 0.0, "status": "optimal",
                "timings": {"trace_s": 1, "profile_s": 1, "strategy_s": 1, "ilp_build_s": 1, "solve_s": solve,
                            "solver_stage_s": solve + 1, "plan_s": solve + 4}}
    lines = solver.depth_summary([rec(12, 1.0), rec(48, 1.5), rec(96, 2.0)])
    assert lines == ["depth sweep gpt2 2x4 40GiB highs: 48/12: plan 1.10x, solve 1.50x, solver stage 1.25x, "
                     "variables 100/100; 96/12: plan 1.20x, solve 2.00x, solver stage 1.50x, variables 100/100"]
    assert "optimal" in solver.table_row(rec(12, 1.0))
    assert "error: boom" in solver.table_row({"case": "x", "ok": False, "error": "boom"})


def _timed(case: str, plan_s: float) -> dict:
    return {"case": case, "ok": True, "timings": {"trace_s": 1.0, "profile_s": 0.5, "strategy_s": 0.5,
                                                   "solver_stage_s": 1.0, "other_s": 0.2, "plan_s": plan_s}}


def test_targets_and_ratios_say_met_or_not():
    suite = {"targets": {"gpt2-xl 2x4": 6, "llama-8b 8x8": 8},
             "ratios": [{"case": "gpt2/L96", "over": "gpt2/L12", "max": 1.3}]}
    records = [_timed("gpt2-xl 2x4 40GiB highs", 5.5), _timed("llama-8b 8x8 80GiB highs", 9.0),
               _timed("gpt2/L12 2x4 40GiB highs", 4.0), _timed("gpt2/L96 2x4 40GiB highs", 5.0)]
    lines = solver.target_summary(suite, records)
    assert lines[0].startswith("target gpt2-xl 2x4 40GiB highs: planned end to end in 5.5s (trace 1.0 + profile 0.5")
    assert lines[0].endswith("+ other 0.2) -- target < 6s: met")
    assert lines[1].endswith("target < 8s: NOT met")
    assert lines[2] == ("target ratio gpt2/L96 2x4 40GiB highs / gpt2/L12 2x4 40GiB highs: 5.0s / 4.0s = 1.25x "
                        "-- target <= 1.3x: met")
    records[3] = _timed("gpt2/L96 2x4 40GiB highs", 5.4)
    assert solver.target_summary(suite, records)[2].endswith("1.35x -- target <= 1.3x: NOT met")
    assert solver.target_summary(suite, records[:3])[2].endswith("no single successful run of each")


def test_targets_suite_plans_its_cases_end_to_end():
    suite = solver.load_suite("targets")
    assert suite["end_to_end"] and suite["isolate"]
    assert suite["targets"] == {"gpt2-xl 2x4": 6, "llama-8b 8x8": 8, "llama-70b 16x8 80GiB highs none": 20,
                                "llama-70b 16x8 80GiB highs auto": 20}
    ids = [solver.case_id(c) for c in suite["cases"]]
    for needle in suite["targets"]:  # each target names exactly one case
        assert sum(needle in i for i in ids) == 1, needle
    for ratio in suite["ratios"]:
        assert sum(ratio["case"] in i for i in ids) == 1 and sum(ratio["over"] in i for i in ids) == 1


def test_an_end_to_end_case_is_one_autopar_plan_call():
    rec = solver.run_plan_case({"model": "mlp", "batch": 4, "seq": None, "layers": None, "mesh": "2",
                                "device": "a100-80gb", "budget": None, "backend": "highs"}, time_limit=30)
    assert rec["ok"] and rec["end_to_end"], rec
    t = rec["timings"]
    assert t["plan_s"] >= t["trace_s"] + t["profile_s"] + t["strategy_s"] + t["solver_stage_s"] > 0
    assert t["other_s"] == pytest.approx(t["plan_s"] - t["trace_s"] - t["profile_s"] - t["strategy_s"]
                                         - t["solver_stage_s"], abs=1e-3)
    assert rec["status"] == "optimal" and rec["objective_s"] == rec["step_s"] > 0 and rec["num_variables"] >= 0
    assert "total" in solver.header() and rec["case"] in solver.table_row(rec)
