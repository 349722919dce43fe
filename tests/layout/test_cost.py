"""Compute pricing: the roofline at the peak of the precision an op computes in."""

import pytest

from autopar.layout.cost import KERNEL_FLOOR_S, compute_seconds
from autopar.layout.mesh import MeshSpec


def test_half_precision_runs_at_the_half_peak():
    m = MeshSpec.preset("a100-80gb", (8,))
    flops = 312e12
    fp32 = compute_seconds(flops, 0, m)
    assert fp32 == compute_seconds(flops, 0, m, itemsize=4) == pytest.approx(flops / 19.5e12)
    assert compute_seconds(flops, 0, m, itemsize=2) == pytest.approx(1.0)
    assert fp32 / compute_seconds(flops, 0, m, itemsize=2) == pytest.approx(312 / 19.5)
    assert compute_seconds(flops, 0, m, itemsize=8) == fp32  # fp64 is priced at the fp32 peak


def test_memory_bound_and_tiny_kernels_do_not_depend_on_precision():
    m = MeshSpec.preset("h100-80gb", (8,))
    nbytes = 3.35e12  # one second of memory traffic, far more than the FLOPs take
    assert compute_seconds(1e9, nbytes, m, itemsize=2) == compute_seconds(1e9, nbytes, m) == pytest.approx(1.0)
    assert compute_seconds(10, 10, m, itemsize=2) == compute_seconds(10, 10, m) == KERNEL_FLOOR_S


def test_a_mesh_without_a_half_peak_prices_both_precisions_alike():
    cpu = MeshSpec.preset("cpu", (2,))
    plain = MeshSpec(**{**{f: getattr(cpu, f) for f in cpu.__dataclass_fields__}, "half_peak_flops": None})
    assert compute_seconds(50e9, 0, plain, itemsize=2) == compute_seconds(50e9, 0, plain) == pytest.approx(1.0)
    # The cpu preset: bf16 is emulated on this kind of CPU, 50x slower than fp32.
    assert compute_seconds(1e9, 0, cpu, itemsize=2) == pytest.approx(1.0)


def test_bad_inputs_are_rejected():
    m = MeshSpec.preset("cpu", (2,))
    with pytest.raises(ValueError, match="-1"):
        compute_seconds(-1, 0, m, itemsize=2)
