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


def test_ring_steps_pay_latency_each_and_move_the_block_once():
    import dataclasses

    from autopar.layout.cost import collective_seconds, ring_seconds

    m = dataclasses.replace(MeshSpec.preset("cpu", (4,)), alpha=(1e-5,), beta=(1e-9,))
    block = 1e6
    # An open turn (forward): 3 steps; closed (the gradients home): 4.
    assert ring_seconds(block, m, (0,), closed=False) == pytest.approx(3 * (1e-5 + 1e-3))
    assert ring_seconds(block, m, (0,), closed=True) == pytest.approx(4 * (1e-5 + 1e-3))
    # The same bytes as an all-gather of the whole tensor, with one latency per step.
    assert ring_seconds(block, m, (0,), closed=False) - collective_seconds("all_gather", 4 * block, m, 0) == \
        pytest.approx(2e-5)
    # An odometer over (2, 2): axis 1 turns 4 times (3 open), axis 0 twice (once open).
    m2 = dataclasses.replace(MeshSpec.preset("cpu", (2, 2)), alpha=(1e-5, 1e-6), beta=(1e-9, 1e-10))
    assert ring_seconds(block, m2, (0, 1), closed=True) == pytest.approx(2 * (1e-5 + 1e-3) + 4 * (1e-6 + 1e-4))
    assert ring_seconds(block, m2, (0, 1), closed=False) == pytest.approx(1 * (1e-5 + 1e-3) + 3 * (1e-6 + 1e-4))
    assert ring_seconds(block, MeshSpec.preset("cpu", (1, 4)), (0,), closed=True) == 0.0
