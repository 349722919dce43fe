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
    assert lines == ["depth sweep gpt2 2x4 40GiB highs: 48/12: solve 1.50x, solver stage 1.25x, variables 100/100; "
                     "96/12: solve 2.00x, solver stage 1.50x, variables 100/100"]
    assert "optimal" in solver.table_row(rec(12, 1.0))
    assert "error: boom" in solver.table_row({"case": "x", "ok": False, "error": "boom"})
