import json

import pytest

from autopar.layout.cost import collective_seconds, compute_seconds, KERNEL_FLOOR_S
from autopar.layout.mesh import MeshSpec, parse_bytes, parse_mesh_shape


def test_json_round_trip(any_mesh):
    assert MeshSpec.from_json(any_mesh.to_json()) == any_mesh


def test_preset_links_intra_vs_inter_node():
    m = MeshSpec.preset("a100-80gb", (2, 8))
    assert m.beta[1] < m.beta[0]  # axis 1 inside a node (NVLink), axis 0 across (IB)
    single = MeshSpec.preset("a100-80gb", (2, 4))
    assert single.beta[0] == single.beta[1]  # all 8 in one node
    assert MeshSpec.preset("h100-80gb", (4, 4)).alpha[0] > MeshSpec.preset("h100-80gb", (4, 4)).alpha[1]
    with pytest.raises(ValueError, match="not a multiple of the 8"):
        MeshSpec.preset("h100-80gb", (3, 4))
    with pytest.raises(ValueError, match="unknown device preset 'tpu'"):
        MeshSpec.preset("tpu", (2,))


def test_presets_carry_an_fp32_and_a_half_precision_peak():
    a100, h100, cpu = (MeshSpec.preset(n, (8,)) for n in ("a100-80gb", "h100-80gb", "cpu"))
    assert (a100.peak_flops, a100.half_peak_flops) == (19.5e12, 312e12)
    assert (h100.peak_flops, h100.half_peak_flops) == (67e12, 989e12)
    assert (cpu.peak_flops, cpu.half_peak_flops) == (50e9, 1e9)
    assert (a100.flops_at(4), a100.flops_at(2), a100.flops_at(8)) == (19.5e12, 312e12, 19.5e12)
    assert h100.flops_at(2) == 989e12
    assert (cpu.flops_at(2), cpu.flops_at(4)) == (1e9, 50e9)  # bf16 emulated on this kind of CPU


def test_half_peak_is_validated_and_optional():
    base = dict(shape=(2,), axis_names=("dp",), alpha=(1e-5,), beta=(1e-9,), peak_flops=1e12,
                mem_bandwidth=1e12, mem_capacity=2**30)
    assert MeshSpec(**base).half_peak_flops is None  # existing keyword callers keep working
    assert MeshSpec((2,), ("dp",), (1e-5,), (1e-9,), 1e12, 1e12, 2**30, "lab").name == "lab"
    assert MeshSpec(**base, half_peak_flops=8e12).flops_at(2) == 8e12
    for bad in (0.0, -1e12):
        with pytest.raises(ValueError, match=f"half_peak_flops must be positive.*{bad}"):
            MeshSpec(**base, half_peak_flops=bad)


def test_json_round_trips_both_peaks():
    mesh = MeshSpec.preset("h100-80gb", (2, 8))
    data = json.loads(mesh.to_json())
    assert data["version"] == 9 and data["half_peak_flops"] == 989e12 and data["peak_flops"] == 67e12
    assert MeshSpec.from_json(mesh.to_json()) == mesh
    cpu = MeshSpec.preset("cpu", (2,))
    assert json.loads(cpu.to_json())["half_peak_flops"] == 1e9
    assert MeshSpec.from_json(cpu.to_json()) == cpu


def test_json_version_1_prices_as_before():
    # A v1 file has one peak, "at training precision" (a profiled GPU's was a bf16 matmul):
    # both precisions get it, so an old file's plans do not change.
    v1 = {"version": 1, "shape": [8], "axis_names": ["dp"], "alpha": [1e-5], "beta": [1 / 100e9],
          "peak_flops": 300e12, "mem_bandwidth": 1e12, "mem_capacity": 16 * 2**30, "name": "lab"}
    mesh = MeshSpec.from_json(json.dumps(v1))
    assert mesh.peak_flops == mesh.half_peak_flops == 300e12
    assert mesh.flops_at(4) == mesh.flops_at(2) == 300e12
    assert MeshSpec.from_json(mesh.to_json()) == mesh  # re-saved as version 9
    unversioned = dict(v1)
    del unversioned["version"]
    assert MeshSpec.from_json(json.dumps(unversioned)) == mesh
    with pytest.raises(ValueError, match="version 1 has no half_peak_flops"):
        MeshSpec.from_json(json.dumps({**v1, "half_peak_flops": 1e12}))
    with pytest.raises(ValueError, match="version 10 is not supported"):
        MeshSpec.from_json(json.dumps({**v1, "version": 10}))
    assert mesh.host_capacity is None  # no host tier before version 3


def test_host_tier_presets_from_spec_sheets():
    h100 = MeshSpec.cluster(nodes=1, devices_per_node=8)
    a100 = MeshSpec.preset("a100-80gb", (8,))
    # PCIe 5.0 x16 ~50 GB/s achieved (63 theoretical), PCIe 4.0 x16 ~25 (31.5); 2 TB per DGX / 8 GPUs.
    assert h100.host_beta == pytest.approx(1 / 50e9) and a100.host_beta == pytest.approx(1 / 25e9)
    assert h100.host_capacity == a100.host_capacity == 256 * 10**9
    assert h100.host_mem_bandwidth > a100.host_mem_bandwidth > 0
    assert "host 256 GB/device, link 50 GB/s" in h100.host_str()
    small = MeshSpec.cluster(nodes=2, devices_per_node=8, host_memory="64GB")
    assert small.host_capacity == 64 * 10**9 and small.host_beta == h100.host_beta
    assert MeshSpec.preset("cpu", (1,), host_memory=2**30).host_capacity == 2**30


def test_host_tier_json_round_trip_and_checks():
    mesh = MeshSpec.preset("h100-80gb", (2, 4)).with_host(capacity="100GB", beta=1 / 20e9)
    data = json.loads(mesh.to_json())
    assert data["host_capacity"] == 100 * 10**9 and data["host_beta"] == pytest.approx(1 / 20e9)
    assert MeshSpec.from_json(mesh.to_json()) == mesh
    v2 = {**data, "version": 2}
    with pytest.raises(ValueError, match="version 2 has no host tier"):
        MeshSpec.from_json(json.dumps(v2))
    v2 = {k: v for k, v in v2.items() if not k.startswith("host_")}
    assert MeshSpec.from_json(json.dumps(v2)).host_capacity is None
    bare = MeshSpec.from_json(json.dumps(v2))
    assert not bare.has_host_tier and bare.host_str() == "no host tier"
    with pytest.raises(ValueError, match="host_capacity must be positive bytes.*-5"):
        MeshSpec(**{k: v for k, v in v2.items() if k != "version"}, host_capacity=-5)
    with pytest.raises(ValueError, match="a host tier needs host_alpha >= 0, host_beta > 0"):
        bare.with_host(capacity=2**30)  # no link figures


def test_parsers():
    assert parse_mesh_shape("2x4") == (2, 4) and parse_mesh_shape(8) == (8,)
    assert parse_bytes("16GiB") == 16 * 1024**3 and parse_bytes("40 GB") == 40 * 10**9
    for bad in ["abc", "-3GiB", "0"]:
        with pytest.raises(ValueError, match="memory size"):
            parse_bytes(bad)
    with pytest.raises(ValueError, match="mesh shape"):
        parse_mesh_shape("2xq")


def test_ring_factors():
    m = MeshSpec.preset("cpu", (4, 2))
    b = 1e6
    ag = collective_seconds("all_gather", b, m, 0)
    assert ag == pytest.approx(m.alpha[0] + m.beta[0] * b * 3 / 4)
    ar = collective_seconds("all_reduce", b, m, 0)
    assert ar - m.alpha[0] == pytest.approx(2 * (ag - m.alpha[0]))
    a2a = collective_seconds("all_to_all", b, m, 0)
    assert a2a == pytest.approx(m.alpha[0] + m.beta[0] * b * 3 / 16)
    both = collective_seconds("all_gather", b, m, (0, 1))
    assert both == pytest.approx(max(m.alpha) + max(m.beta) * b * 7 / 8)
    assert collective_seconds("all_reduce", b, MeshSpec.preset("cpu", (1, 2)), 0) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        collective_seconds("broadcast", b, m, 0)


def test_roofline():
    m = MeshSpec.preset("a100-80gb", (8,))
    assert compute_seconds(0, 0, m) == KERNEL_FLOOR_S
    assert compute_seconds(19.5e12, 0, m) == pytest.approx(1.0)  # fp32 peak by default
    assert compute_seconds(1, 2.039e12, m) == pytest.approx(1.0)


def test_coerce_takes_a_preset_and_device_as_its_deprecated_name():
    assert MeshSpec.coerce((2, 4), preset="h100-80gb") == MeshSpec.preset("h100-80gb", (2, 4))
    assert MeshSpec.coerce("2x4") == MeshSpec.preset("cpu", (2, 4))
    spec = MeshSpec.preset("a100-80gb", (8,))
    assert MeshSpec.coerce(spec, preset="cpu") is spec  # a MeshSpec keeps its own costs
    with pytest.warns(FutureWarning, match="pass preset='h100-80gb'"):
        assert MeshSpec.coerce((2,), device="h100-80gb") == MeshSpec.preset("h100-80gb", (2,))
    with pytest.raises(ValueError, match="preset='cpu' and device='h100-80gb'"):
        MeshSpec.coerce((2,), preset="cpu", device="h100-80gb")
