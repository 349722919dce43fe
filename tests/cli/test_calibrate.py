"""``autopar calibrate``: a quick 2-rank run prints its stages and writes a profile that
``autopar inspect --preset`` plans with, for the mesh it was measured on only. The calibration runs
in a fresh interpreter as a user's would; the checks of what ``inspect`` and the refusals say run
through ``main(argv)`` in this process (a fresh interpreter per check only adds its imports)."""

from __future__ import annotations

from autopar.layout.mesh import MeshSpec
from autopar.plans import Plan
from tests.cli.test_main import assert_one_line_error, run_cli, run_cli_here


def test_calibrate_writes_a_profile_inspect_plans_with(tmp_path):
    path = tmp_path / "machine.json"
    out = run_cli("calibrate", "--local", "2", "--mesh", "2", "--quick", "--out", str(path))
    assert out.returncode == 0, out.stderr[-3000:]
    for stage in ("stage 1/3 compute: round 1/3", "stage 2/3 collectives: axis 0 (n=2) all kinds",
                  "stage 3/3 overlap, blocking and pipeline: all-reduce", "more per blocking collective",
                  "per schedule action"):
        assert stage in out.stdout, out.stdout[-3000:]
    assert f"wrote {path}" in out.stdout and "of a collective hidden under compute" in out.stdout
    spec = MeshSpec.load(str(path))
    assert spec.shape == (2,) and spec.machine is not None

    plan_path = tmp_path / "plan.json"
    out = run_cli_here("inspect", "mlp", "--preset", str(path), "--mesh", "2", "--no-baselines",
                       "--allow-fallback", "--json", str(plan_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert Plan.load(str(plan_path)).mesh == spec
    wrong = run_cli_here("inspect", "mlp", "--preset", str(path), "--mesh", "2x2", "--no-baselines")
    assert_one_line_error(wrong, "measured on mesh (2,), not the 2x2 mesh", "autopar calibrate --mesh 2x2")


def test_calibrate_needs_processes_and_an_existing_profile(tmp_path):
    assert_one_line_error(run_cli_here("calibrate", "--mesh", "2", "--out", str(tmp_path / "m.json")),
                          "--local N", "torchrun")
    missing = str(tmp_path / "absent.json")
    assert_one_line_error(run_cli_here("inspect", "mlp", "--preset", missing, "--mesh", "2"),
                          f"mesh profile '{missing}' not found")
