"""Layout conversion planner: optimality, naive-route bound, simulated execution, cache.

The simulation applies each step's *meaning* (from the step table) to per-rank numpy arrays,
independently of the runtime collectives, so a wrong step semantic or a wrong plan shows up as
wrong local pieces. Optimality is checked against Bellman-Ford over all step sequences, which
shares only the step semantics (``apply_step``/``step_seconds``) with the planner, not its search.
"""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
import time

import numpy as np
import pytest

from autopar.layout.mesh import MeshSpec
from autopar.layout.conversion import (
    STEP_KINDS,
    Conversion,
    ReshardStep,
    apply_step,
    replicate_steps,
    clear_conversion_cache,
    conversion_cache_info,
    plan_conversion,
    step_seconds,
    valid_specs,
)
from autopar.layout.placement import Partial, Replicate, Shard, TensorSpec

MESHES = [(2,), (4,), (2, 2)]
# (4, 6, 2) on a 4-mesh makes S1 uneven: those specs must be excluded, not planned.
SHAPES = [(8, 4), (4, 8, 2), (4, 6, 2)]
ITEMSIZE = 4


def _specs(shape, mesh_shape):
    """Specs from {R, S0, S1, P} per axis that divide ``shape`` evenly."""
    tokens = ["R", "S0", "S1", "P"]
    out = []
    for combo in itertools.product(tokens, repeat=len(mesh_shape)):
        spec = TensorSpec.parse("".join(combo))
        if spec.is_valid(shape, mesh_shape):
            out.append(spec)
    return out


def _cases():
    for mesh_shape in MESHES:
        for shape in SHAPES:
            yield pytest.param(mesh_shape, shape,
                               id=f"mesh{'x'.join(map(str, mesh_shape))}-shape{'x'.join(map(str, shape))}")


# ------------------------------------------------------------------------- reference routes
def _route_cost(src: TensorSpec, steps, shape, mesh) -> tuple[float, TensorSpec]:
    spec, total = src, 0.0
    for step in steps:
        fwd, bwd = step_seconds(step, spec, shape=shape, itemsize=ITEMSIZE, mesh=mesh)
        total += fwd + bwd
        spec = apply_step(spec, step)
        assert spec.is_valid(shape, mesh.shape)
    return total, spec


def _naive_steps(src: TensorSpec, dst: TensorSpec) -> list[ReshardStep]:
    """Gather/all-reduce everything to replicated (minor axes first), then split/to_partial."""
    steps = list(replicate_steps(src))
    for axis, p in enumerate(dst.placements):
        if isinstance(p, Shard):
            steps.append(ReshardStep("split", axis, dst_dim=p.dim))
        elif isinstance(p, Partial):
            steps.append(ReshardStep("to_partial", axis))
    return steps


def _bellman_ford(src: TensorSpec, shape, mesh) -> dict[TensorSpec, float]:
    """Cheapest cost to every layout, by relaxing every possible step |V| times."""
    nodes = valid_specs(shape, mesh.shape)
    all_steps = []
    for axis in range(mesh.ndim):
        all_steps += [ReshardStep("all_reduce", axis), ReshardStep("to_partial", axis)]
        for d in range(len(shape)):
            all_steps += [ReshardStep("all_gather", axis, src_dim=d), ReshardStep("split", axis, dst_dim=d),
                          ReshardStep("reduce_scatter", axis, dst_dim=d)]
            all_steps += [ReshardStep("all_to_all", axis, src_dim=d, dst_dim=e)
                          for e in range(len(shape)) if e != d]
    dist = {src: 0.0}
    for _ in range(len(nodes)):
        changed = False
        for spec in list(dist):
            for step in all_steps:
                try:
                    nxt = apply_step(spec, step)
                except ValueError:
                    continue
                if not nxt.is_valid(shape, mesh.shape):
                    continue
                fwd, bwd = step_seconds(step, spec, shape=shape, itemsize=ITEMSIZE, mesh=mesh)
                cost = dist[spec] + fwd + bwd
                if cost < dist.get(nxt, math.inf) - 1e-15:
                    dist[nxt] = cost
                    changed = True
        if not changed:
            break
    return dist


# --------------------------------------------------------------------- simulated execution
def _coords(mesh_shape):
    return list(itertools.product(*(range(n) for n in mesh_shape)))


def _make_locals(global_arr, spec: TensorSpec, mesh_shape, rng) -> dict:
    """Per-device pieces of ``global_arr`` laid out as ``spec``; P axes get random summands."""
    shape = global_arr.shape
    p_axes = spec.partial_axes()
    non_r = [a for a, p in enumerate(spec.placements) if not isinstance(p, Replicate)]
    summands: dict = {}
    out = {}
    for coord in _coords(mesh_shape):
        key = tuple(coord[a] for a in non_r)  # devices differing only on R axes hold the same
        if key not in summands:
            piece = global_arr[spec.local_slices(shape, mesh_shape, coord)].copy()
            summands[key] = piece
        out[coord] = summands[key]
    if p_axes:
        # Replace each P-group's pieces by random integers that still sum to the piece.
        groups: dict = {}
        for key in summands:
            shard_key = tuple(k for a, k in zip(non_r, key) if a not in p_axes)
            groups.setdefault(shard_key, []).append(key)
        for keys in groups.values():
            target = summands[keys[0]].copy()
            for k in keys[1:]:
                summands[k] = rng.integers(-5, 6, size=target.shape).astype(np.float64)
                target -= summands[k]
            summands[keys[0]] = target
        out = {c: summands[tuple(c[a] for a in non_r)] for c in out}
    return out


def _apply_sim(locs: dict, step: ReshardStep, mesh_shape) -> dict:
    axis, n = step.axis, mesh_shape[step.axis]
    out = {}
    for coord in locs:
        group = [locs[coord[:axis] + (k,) + coord[axis + 1:]] for k in range(n)]
        me = coord[axis]
        if step.kind == "all_gather":
            out[coord] = np.concatenate(group, axis=step.src_dim)
        elif step.kind == "split":
            out[coord] = np.split(locs[coord], n, axis=step.dst_dim)[me].copy()
        elif step.kind == "all_to_all":
            chunks = [np.split(g, n, axis=step.dst_dim)[me] for g in group]
            out[coord] = np.concatenate(chunks, axis=step.src_dim)
        elif step.kind == "all_reduce":
            out[coord] = sum(group)
        elif step.kind == "reduce_scatter":
            out[coord] = np.split(sum(group), n, axis=step.dst_dim)[me].copy()
        elif step.kind == "to_partial":
            out[coord] = locs[coord].copy() if me == 0 else np.zeros_like(locs[coord])
        else:
            raise AssertionError(step.kind)
    return out


def _check_layout(locs: dict, global_arr, spec: TensorSpec, mesh_shape) -> None:
    shape = global_arr.shape
    p_axes = spec.partial_axes()
    sums: dict = {}
    for coord, piece in locs.items():
        assert piece.shape == spec.local_shape(shape, mesh_shape), (spec, coord, piece.shape)
        # Sum over the P axes: the pieces with equal non-P coordinates.
        key = tuple(c for a, c in enumerate(coord) if a not in p_axes)
        sums[key] = sums.get(key, 0) + piece
    for coord in locs:
        key = tuple(c for a, c in enumerate(coord) if a not in p_axes)
        expect = global_arr[spec.local_slices(shape, mesh_shape, coord)]
        np.testing.assert_array_equal(sums[key], expect, err_msg=f"{spec} at {coord}")
    if not p_axes:
        return
    # Each P group is one summand per P coordinate: R axes must still agree.
    for coord, piece in locs.items():
        base = tuple(0 if isinstance(p, Replicate) else c for p, c in zip(spec.placements, coord))
        np.testing.assert_array_equal(piece, locs[base], err_msg=f"R axes differ in {spec} at {coord}")


# ----------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("mesh_shape,shape", list(_cases()))
def test_all_pairs_optimal_cheaper_than_naive_and_correct(mesh_shape, shape):
    mesh = MeshSpec.preset("cpu", mesh_shape)
    specs = _specs(shape, mesh_shape)
    rng = np.random.default_rng(0)
    global_arr = rng.integers(-9, 10, size=shape).astype(np.float64)
    num_strict = 0
    for src in specs:
        optimum = _bellman_ford(src, shape, mesh)
        for dst in specs:
            conv = plan_conversion(src, dst, shape, ITEMSIZE, mesh)
            assert (conv.src, conv.dst) == (src, dst)
            cost, end = _route_cost(src, conv.steps, shape, mesh)
            assert end == dst, conv
            assert conv.total_s == pytest.approx(cost, rel=1e-12, abs=1e-18)
            naive_cost, naive_end = _route_cost(src, _naive_steps(src, dst), shape, mesh)
            assert naive_end == dst
            assert conv.total_s <= naive_cost * (1 + 1e-12), (str(conv), naive_cost)
            # Strictly lower wherever any cheaper route exists (Bellman-Ford's optimum).
            assert conv.total_s == pytest.approx(optimum[dst], rel=1e-9, abs=1e-15), str(conv)
            if optimum[dst] < naive_cost * (1 - 1e-9):
                assert conv.total_s < naive_cost
                num_strict += 1
            # Execute the steps' meaning on per-rank pieces of a real tensor.
            locs = _make_locals(global_arr, src, mesh_shape, rng)
            for step in conv.steps:
                locs = _apply_sim(locs, step, mesh_shape)
            _check_layout(locs, global_arr, dst, mesh_shape)
    assert num_strict > 0  # every case here has an all-to-all or reduce-scatter shortcut


def test_uneven_specs_are_excluded_and_rejected():
    mesh = MeshSpec.preset("cpu", (4,))
    assert TensorSpec.parse("S1") not in valid_specs((4, 6, 2), (4,))
    with pytest.raises(ValueError, match=r"target.*S1.*\(4, 6, 2\)"):
        plan_conversion("S0", "S1", (4, 6, 2), 4, mesh)
    with pytest.raises(ValueError, match=r"source.*S2"):
        plan_conversion("S2", "R", (4, 8), 4, mesh)
    with pytest.raises(ValueError, match=r"source.*RR.*mesh \(4,\)"):
        plan_conversion("RR", "R", (4, 8), 4, mesh)
    with pytest.raises(ValueError, match="itemsize.*0"):
        plan_conversion("R", "S0", (4, 8), 0, mesh)
    with pytest.raises(ValueError, match="shape.*-4"):
        plan_conversion("R", "S0", (-4, 8), 4, mesh)


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (8,)])
def test_named_shortcuts(mesh_shape):
    mesh = MeshSpec.preset("cpu", mesh_shape)
    shape = (64, 64)
    cases = {
        ("S0", "S1"): ["all_to_all"],
        ("P", "S0"): ["reduce_scatter"],
        ("P", "R"): ["all_reduce"],
        ("S1", "R"): ["all_gather"],
        ("R", "S0"): ["split"],
        ("R", "P"): ["to_partial"],
        ("S0", "P"): ["all_gather", "to_partial"],
    }
    for (src, dst), kinds in cases.items():
        conv = plan_conversion(src, dst, shape, 2, mesh)
        assert [s.kind for s in conv.steps] == kinds, str(conv)
    a2a = plan_conversion("S0", "S1", shape, 2, mesh)
    naive = plan_conversion("S0", "R", shape, 2, mesh).total_s + plan_conversion("R", "S1", shape, 2, mesh).total_s
    assert a2a.total_s < naive
    rs = plan_conversion("P", "S0", shape, 2, mesh)
    assert rs.total_s < (plan_conversion("P", "R", shape, 2, mesh).total_s
                         + plan_conversion("R", "S0", shape, 2, mesh).total_s)


def test_costs_backward_duals_and_peak_bytes():
    mesh = MeshSpec.preset("cpu", (4,))
    shape, itemsize = (8, 4), 4  # 128 bytes in all
    from autopar.layout.cost import collective_seconds, copy_seconds

    gather = plan_conversion("S0", "R", shape, itemsize, mesh)
    assert gather.forward_s == pytest.approx(collective_seconds("all_gather", 128, mesh, 0))
    assert gather.backward_s == pytest.approx(copy_seconds(32, mesh))  # split of the gathered piece
    assert gather.peak_extra_bytes == 128
    split = plan_conversion("R", "S1", shape, itemsize, mesh)
    assert split.forward_s == pytest.approx(copy_seconds(32, mesh))
    assert split.backward_s == pytest.approx(collective_seconds("all_gather", 128, mesh, 0))
    assert split.peak_extra_bytes == 32
    reduce = plan_conversion("P", "R", shape, itemsize, mesh)
    assert reduce.backward_s == 0.0
    assert reduce.forward_s == pytest.approx(collective_seconds("all_reduce", 128, mesh, 0))
    a2a = plan_conversion("S0", "S1", shape, itemsize, mesh)
    assert a2a.forward_s == a2a.backward_s == pytest.approx(collective_seconds("all_to_all", 128, mesh, 0))
    zero = plan_conversion("R", "P", shape, itemsize, mesh)
    assert (zero.forward_s, zero.backward_s) == (pytest.approx(copy_seconds(128, mesh)), 0.0)
    scatter = plan_conversion("P", "S0", shape, itemsize, mesh)
    assert scatter.forward_s == pytest.approx(collective_seconds("reduce_scatter", 128, mesh, 0))
    assert scatter.backward_s == pytest.approx(collective_seconds("all_gather", 128, mesh, 0))
    ident = plan_conversion("S0", "S0", shape, itemsize, mesh)
    assert ident.steps == () and ident.total_s == 0.0 and ident.peak_extra_bytes == 0


def test_str_and_specs():
    mesh = MeshSpec.preset("cpu", (2, 2))
    conv = plan_conversion("S0R", "RS1", (8, 8), 4, mesh)
    assert isinstance(conv, Conversion)
    text = str(conv)
    assert text.startswith("S0R -> RS1: ")
    assert text.count(";") == len(conv.steps) - 1
    assert {str(s) for s in conv.steps} == {"all_gather[axis0] S0", "split[axis1] S1"}
    assert conv.specs[0] == TensorSpec.parse("S0R") and conv.specs[-1] == TensorSpec.parse("RS1")
    assert str(plan_conversion("RR", "RR", (8, 8), 4, mesh)) == "RR -> RR: identity"


def test_partial_source_must_reduce_first():
    with pytest.raises(ValueError, match="needs R"):
        apply_step(TensorSpec.parse("P"), ReshardStep("split", 0, dst_dim=0))
    with pytest.raises(ValueError, match="needs S0"):
        apply_step(TensorSpec.parse("P"), ReshardStep("all_gather", 0, src_dim=0))
    # Local consistency: only the minor-most axis sharding a dim may change.
    with pytest.raises(ValueError, match="minor-most"):
        apply_step(TensorSpec.parse("S0S0"), ReshardStep("all_gather", 0, src_dim=0))
    with pytest.raises(ValueError, match="minor-most"):
        apply_step(TensorSpec.parse("RS0"), ReshardStep("split", 0, dst_dim=0))
    mesh = MeshSpec.preset("cpu", (2, 2))
    for dst in valid_specs((8, 8), (2, 2)):
        conv = plan_conversion("PS1", dst, (8, 8), 4, mesh)
        for spec, step in zip(conv.specs, conv.steps):
            if isinstance(spec.placements[step.axis], Partial):
                assert step.kind in ("all_reduce", "reduce_scatter")
    assert set(STEP_KINDS) == {"all_gather", "split", "all_to_all", "all_reduce", "reduce_scatter", "to_partial"}


def test_trivial_mesh_axis_costs_nothing_and_stays_reachable():
    mesh = MeshSpec.preset("cpu", (1, 4))
    shape = (8, 8)
    conv = plan_conversion("S0S1", "RS1", shape, 4, mesh)
    assert [str(s) for s in conv.steps] == ["all_gather[axis0] S0"] and conv.total_s == 0.0
    for src in valid_specs(shape, mesh.shape):
        for dst in valid_specs(shape, mesh.shape):
            assert plan_conversion(src, dst, shape, 4, mesh).specs[-1] == dst


def test_step_records_reject_bad_fields():
    with pytest.raises(ValueError, match="'gather'"):
        ReshardStep("gather", 0, src_dim=0)
    with pytest.raises(ValueError, match="split on axis 1 got src_dim=0, dst_dim=None"):
        ReshardStep("split", 1, src_dim=0)


def test_large_mesh_all_pairs_fast_and_cached():
    mesh = MeshSpec.preset("h100-80gb", (8, 8))
    shape = (64, 128, 256)
    specs = valid_specs(shape, mesh.shape)
    assert len(specs) == 25
    clear_conversion_cache()
    start = time.perf_counter()
    plans = {(a, b): plan_conversion(a, b, shape, 2, mesh) for a in specs for b in specs}
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0, f"planning {len(plans)} pairs took {elapsed:.2f} s"
    assert conversion_cache_info() == (0, 625, 625)
    for (a, b), conv in plans.items():
        assert plan_conversion(str(a), str(b), shape, 2, mesh) is conv  # strings hit the same entry
    assert conversion_cache_info() == (625, 625, 625)
    # Another itemsize is another key.
    plan_conversion(specs[0], specs[1], shape, 4, mesh)
    assert conversion_cache_info() == (625, 626, 626)
    clear_conversion_cache()
    assert conversion_cache_info() == (0, 0, 0)


def test_solver_does_not_import_torch():
    code = "import sys, autopar.layout.conversion; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("mesh_shape,shape", [((4,), (8, 6)), ((2, 4), (8, 16, 12)), ((2, 2, 2), (12, 6))])
def test_conversion_seconds_are_plan_conversion_totals(mesh_shape, shape):
    """A cost-matrix row from one search: bit-for-bit the totals of planning each pair."""
    from autopar.layout.conversion import conversion_seconds

    mesh = MeshSpec.preset("a100-80gb", mesh_shape)
    specs = valid_specs(shape, mesh_shape)
    for src in specs[::3]:
        row = conversion_seconds(src, specs, shape, 2, mesh)
        assert row == tuple(plan_conversion(src, dst, shape, 2, mesh).total_s for dst in specs)
    assert conversion_seconds(str(specs[1]), [str(specs[2])], shape, 2, mesh) == (
        plan_conversion(specs[1], specs[2], shape, 2, mesh).total_s,)


def test_conversion_seconds_refuses_an_invalid_layout():
    from autopar.layout.conversion import conversion_seconds

    mesh = MeshSpec.preset("a100-80gb", (4,))
    with pytest.raises(ValueError, match="invalid target layout S1 for shape"):
        conversion_seconds("R", ["S0", "S1"], (8, 6), 2, mesh)
    with pytest.raises(ValueError, match="invalid source layout"):
        conversion_seconds("S1", ["S0"], (8, 6), 2, mesh)


def test_segmented_shard_conversions():
    """``S(d/k)`` leaves and enters by an all-gather / split with ``segments=k`` priced as the
    plain step, and reaches every other layout through R; the plain layout graph is unchanged."""
    mesh = MeshSpec.preset("cpu", (2, 2))
    shape = (4, 12)
    gather = plan_conversion("RS(1/3)", "RR", shape, 4, mesh)
    assert [str(s) for s in gather.steps] == ["all_gather[axis1] S(1/3)"]
    plain = plan_conversion("RS1", "RR", shape, 4, mesh)
    assert (gather.forward_s, gather.backward_s, gather.peak_extra_bytes) == (
        plain.forward_s, plain.backward_s, plain.peak_extra_bytes)
    split = plan_conversion("S0R", "S0S(1/3)", shape, 4, mesh)
    assert split.steps == (ReshardStep("split", 1, dst_dim=1, segments=3),)
    to_plain = plan_conversion("RS(1/3)", "RS1", shape, 4, mesh)
    assert to_plain.specs == (TensorSpec.parse("RS(1/3)"), TensorSpec.parse("RR"), TensorSpec.parse("RS1"))
    assert TensorSpec.parse("RS(1/3)") not in valid_specs(shape, (2, 2))
    assert TensorSpec.parse("RS(1/3)") in valid_specs(shape, (2, 2), (3,))
    with pytest.raises(ValueError, match="only all_gather and split move a segmented shard"):
        ReshardStep("all_to_all", 0, src_dim=0, dst_dim=1, segments=3)
    with pytest.raises(ValueError, match="needs S\\(1/3\\) on axis 1"):
        apply_step(TensorSpec.parse("RS1"), ReshardStep("all_gather", 1, src_dim=1, segments=3))
    with pytest.raises(ValueError, match="sharded by one mesh axis only"):
        apply_step(TensorSpec.parse("S1R"), ReshardStep("split", 1, dst_dim=1, segments=3))
