"""Mesh profiler: real gloo timings on local processes, the alpha/beta fit, the entry points.

What the fit check asserts (gloo, 2 processes, 16 KiB .. 4 MiB): alpha > 0 and beta > 0; over
the *bandwidth-dominated* points (``beta * nbytes * f >= alpha`` under the fitted model), the
median of predicted/measured lies within a factor of 2; and per collective, the median ratio
over those points lies within a factor of 4. The looser per-collective bound is deliberate:
gloo's reduce-scatter costs about an all-reduce (the ring model says half) and its all-to-all
has a lower latency than the others, so one alpha/beta per axis cannot sit within 2x of every
collective (``benchmarks/comm.py`` prints the full table).
"""

from __future__ import annotations

import math
import os
import statistics

import pytest

from autopar.layout.cost import collective_seconds
from autopar.layout.mesh import MeshSpec
from autopar.runtime.launch import run_local
from autopar.runtime.mesh_profile import (
    KINDS,
    fit_alpha_beta,
    profile_mesh,
    profile_mesh_detailed,
    ring_factor,
)

KiB, MiB = 1024, 1024**2
SIZES = [16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB]


def test_ring_factor_matches_cost_model():
    assert ring_factor("all_reduce", 2) == pytest.approx(1.0)
    assert ring_factor("all_gather", 4) == pytest.approx(0.75)
    assert ring_factor("reduce_scatter", 4) == pytest.approx(0.75)
    assert ring_factor("all_to_all", 4) == pytest.approx(3 / 16)


def test_fit_recovers_a_known_mesh_from_model_timings():
    truth = MeshSpec.preset("cpu", (4,))
    points = [
        (nbytes * ring_factor(kind, 4), collective_seconds(kind, nbytes, truth, 0))
        for kind in KINDS
        for nbytes in SIZES
    ]
    alpha, beta = fit_alpha_beta(points)
    assert alpha == pytest.approx(truth.alpha[0], rel=1e-6)
    assert beta == pytest.approx(truth.beta[0], rel=1e-6)


def test_fit_is_symmetric_in_log_space_and_rejects_bad_input():
    # Two equal-size points 2x apart: the log fit predicts their geometric mean.
    x = [1e3, 1e7]
    points = [(x[0], 1e-4), (x[1], 2e-2), (x[1], 0.5e-2)]
    alpha, beta = fit_alpha_beta(points)
    assert alpha + beta * x[1] == pytest.approx(1e-2, rel=1e-3)
    with pytest.raises(ValueError, match="t > 0"):
        fit_alpha_beta([(1.0, 0.0), (2.0, 1.0)])
    with pytest.raises(ValueError, match="distinct sizes"):
        fit_alpha_beta([(5.0, 1.0), (5.0, 2.0)])
    # Times that do not grow with size (noise at tiny sizes) cannot determine beta.
    with pytest.raises(ValueError, match="do not grow with size"):
        fit_alpha_beta([(1e3, 1e-3), (1e4, 0.9e-3), (1e5, 1e-3)])


@pytest.mark.full_sweep  # the deprecated alias of `autopar calibrate` (tests/runtime/test_calibrate.py)
def test_profile_two_gloo_processes_fits_its_timings():
    profile = profile_mesh_detailed((2,), local=2, sizes=SIZES, repeats=5)
    mesh = profile.mesh
    alpha, beta = mesh.alpha[0], mesh.beta[0]
    assert alpha > 0 and beta > 0
    assert mesh.shape == (2,) and mesh.name == "profiled-cpu"
    assert mesh.peak_flops > 1e8 and mesh.mem_bandwidth > 1e8
    assert mesh.half_peak_flops > 1e6  # measured in bf16 (emulated on most CPUs)
    assert mesh.mem_capacity == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert sorted((t.kind, t.nbytes) for t in profile.timings) == sorted(
        (k, s) for k in KINDS for s in SIZES)
    assert all(t.seconds > 0 for t in profile.timings)
    big = [t for t in profile.timings if beta * t.nbytes * ring_factor(t.kind, 2) >= alpha]
    # Bandwidth-bound points (the largest sizes) that pin beta; under heavy load the fitted alpha
    # grows and fewer points clear it, so two are asked for, not every large size.
    assert len(big) >= 2, [str(t) for t in profile.timings]
    ratios = {t: profile.predicted(t) / t.seconds for t in big}
    report = "\n".join(f"{t}  ratio {r:.2f}" for t, r in ratios.items())
    assert 0.5 <= statistics.median(ratios.values()) <= 2.0, report
    for kind in KINDS:
        mine = [r for t, r in ratios.items() if t.kind == kind]
        if mine:
            assert 0.25 <= statistics.median(mine) <= 4.0, report
    assert MeshSpec.from_json(mesh.to_json()) == mesh


@pytest.mark.full_sweep  # the deprecated alias of `autopar calibrate` (tests/runtime/test_calibrate.py)
def test_profile_inside_an_existing_group_on_a_2x2_mesh():
    # run_local initialises the default group, as torchrun would: profile_mesh must reuse it.
    def worker(rank, world_size):
        return profile_mesh((2, 2), sizes=[64 * KiB, 4 * MiB], repeats=3)

    meshes = run_local(worker, 4)
    assert all(m == meshes[0] for m in meshes)  # every rank returns the same fit
    mesh = meshes[0]
    assert mesh.shape == (2, 2)
    assert all(a > 0 for a in mesh.alpha) and all(b > 0 for b in mesh.beta)
    assert math.isfinite(mesh.peak_flops)
    # Beside each axis's fits, every kind fitted on the 4-rank group spanning both axes (the
    # group a gradient bucket's sum over both runs on), and it is what prices that collective.
    assert {(f.kind, f.axes) for f in mesh.machine.links if len(f.axes) > 1} == {(k, (0, 1)) for k in KINDS}
    assert {(f.kind, f.axes) for f in mesh.machine.links if len(f.axes) == 1} <= {(k, (a,)) for k in KINDS
                                                                                 for a in (0, 1)}
    spanning = mesh.machine.link_over("all_reduce", (0, 1))
    assert collective_seconds("all_reduce", MiB, mesh, (0, 1), blocking=False) == pytest.approx(
        spanning.alpha + spanning.beta * MiB * 2 * 3 / 4)
    # And a blocking sum over both axes, timed as the runtime chains it.
    assert [axes for axes, _ in mesh.machine.blocking_over] == [(0, 1)]
    assert 0.0 <= mesh.machine.blocking_of((0, 1)) < 0.1
    assert MeshSpec.from_json(mesh.to_json()) == mesh


def test_profile_rejects_bad_arguments():
    import autopar  # the public entry point (lazy: autopar.runtime.mesh_profile)

    with pytest.raises(ValueError, match=r"local=3.*\(2, 2\)"):
        autopar.profile_mesh((2, 2), local=3)
    with pytest.raises(ValueError, match="sizes"):
        profile_mesh((2,), local=2, sizes=[1024])
    with pytest.raises(ValueError, match="repeats"):
        profile_mesh((2,), local=2, repeats=0)
    with pytest.raises(ValueError, match="device"):
        profile_mesh((2,), device="mps", local=2)
    env = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE") if k in os.environ}
    try:
        with pytest.raises(ValueError, match="torchrun"):
            profile_mesh((2,))
    finally:
        os.environ.update(env)

    def wrong_world(rank, world_size):
        with pytest.raises(ValueError, match=r"needs 4 ranks.*has 2"):
            profile_mesh((4,))
        return True

    assert run_local(wrong_world, 2) == [True, True]


def test_fit_survives_noisy_timings():
    """Noisy, non-monotone timings (tiny calls on a loaded host) either fit to a positive
    (alpha, beta) or are refused with ValueError: never an OverflowError from a wild step, never
    a beta of 0 slipping past the bandwidth check."""
    import random

    from autopar.runtime.mesh_profile import fit_alpha_beta

    rng = random.Random(0)
    fitted = 0
    for _ in range(400):
        xs = [0, 2 ** rng.randint(0, 6), 2 ** rng.randint(6, 12), 2 ** rng.randint(12, 20)]
        points = [(x, rng.uniform(1e-5, 1e-3)) for x in xs]
        try:
            alpha, beta = fit_alpha_beta(points)
        except ValueError:
            continue
        fitted += 1
        assert alpha > 0 and beta > 0, (points, alpha, beta)
    assert fitted > 50


def test_fit_weighs_a_point_far_off_the_rest_less():
    # A 2-rank all-reduce's lockstep medians: 0.6 ms latency, 1.25 GB/s, but a 256 KiB point caught
    # in a slow state of the host at 3.5 ms. Least squares would pull the latency towards it; the
    # robust fit keeps it near what the small calls took.
    alpha, beta = 0.6e-3, 0.8e-9
    sizes = [4096, 65536, 262144, 1 << 20, 1 << 22, 1 << 24]
    points = [(x, alpha + beta * x) for x in sizes]
    points[2] = (262144, 3.5e-3)
    fitted_alpha, fitted_beta = fit_alpha_beta(points)
    # (least squares of the log residuals, every point weighing in full: 0.92 ms)
    assert fitted_alpha == pytest.approx(alpha, rel=0.2) and fitted_beta == pytest.approx(beta, rel=0.05)
