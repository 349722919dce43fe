"""Autograd collectives on real gloo processes (fork): forward layouts, gradients, counts.

Each multi-process test runs many conversions inside ONE ``run_local`` call: launching per
case is too slow with 4 ranks on 2 cores. Ranks never raise mid-loop (a rank that stops would
leave its peers hanging in a collective); they collect failure messages and return them.

Reference semantics (single-device identity): the forward output must be exactly ``dst``'s
local piece of the global tensor X (for partial axes: the pieces sum to it); feeding the global
upstream gradient G in ``dst``'s gradient layout, the input gradient must be G in ``src``'s
gradient layout. The gradient layout of a spec is its own layout with ``P`` read as ``R``
(docs/architecture.md, Invariants), i.e. ``G[spec.local_slices(...)]`` on every rank (``take_local``:
a segmented shard's piece of every segment).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from autopar.layout.mesh import MeshSpec
from autopar.runtime import collectives as comm
from autopar.runtime.launch import run_local
from autopar.runtime.process_mesh import ProcessMesh
from autopar.layout.conversion import ReshardStep, plan_conversion
from autopar.layout.placement import TensorSpec
from autopar.strategies.fused import take_local

# The collectives each step kind must issue, forward and backward (the table in comm.py).
FORWARD = {"all_gather": "all_gather", "all_to_all": "all_to_all", "all_reduce": "all_reduce",
           "reduce_scatter": "reduce_scatter", "split": None, "to_partial": None}
BACKWARD = {"all_gather": None, "split": "all_gather", "all_to_all": "all_to_all",
            "all_reduce": None, "reduce_scatter": "all_gather", "to_partial": None}

SHAPES = ((4, 8), (8, 6, 2))  # 2-D and 3-D; dim 1 of the 3-D tensor is uneven on 4 shards


def _expected_counts(steps, table) -> Counter:
    return Counter(table[s.kind] for s in steps if table[s.kind] is not None)


def _tensors(shape):
    """Small-integer float64 values: every sum is exact, so comparisons are exact."""
    gen = torch.Generator().manual_seed(sum(shape) * 31 + len(shape))
    x = torch.randint(-9, 10, shape, generator=gen).double()
    g = torch.randint(-9, 10, shape, generator=gen).double()
    return x, g


def _check_case(pm: ProcessMesh, shape, src, dst, steps, conv=None) -> tuple[list[str], Counter, Counter]:
    """Run one conversion on this rank -- ``comm.convert(conv)`` for a planned ``Conversion``,
    else ``apply_steps`` -- and return (failures, forward counts, backward counts)."""
    src, dst = TensorSpec.parse(src), TensorSpec.parse(dst)
    x_full, g_full = _tensors(shape)
    where = f"{src}->{dst} shape={shape} steps={[str(s) for s in steps]} coord={pm.coordinate}"
    x = comm.distribute(x_full, src, pm).requires_grad_()
    with comm.count_collectives() as fwd:
        y = comm.convert(x, conv, pm) if conv is not None else comm.apply_steps(x, steps, pm, src=src)
    failures = []
    want_shape = dst.local_shape(shape, pm.shape)
    if tuple(y.shape) != want_shape:
        failures.append(f"{where}: local shape {tuple(y.shape)}, want {want_shape}")
    else:
        total = y.detach().clone()
        for axis in dst.partial_axes():  # raw dist calls: not counted, not part of the plan
            dist.all_reduce(total, group=pm.group(axis))
        if not torch.equal(total, take_local(x_full, dst, pm.shape, pm.coordinate)):
            failures.append(f"{where}: forward value differs from dst's piece of X")
    with comm.count_collectives() as bwd:
        y.backward(take_local(g_full, dst, pm.shape, pm.coordinate))
    if x.grad is None or not torch.equal(x.grad, take_local(g_full, src, pm.shape, pm.coordinate)):
        failures.append(f"{where}: input gradient differs from src's gradient layout of G")
    return failures, fwd, bwd


def _run_cases(rank, world_size, mesh_shape, cases):
    """Rank body: every case on this rank; failures and (rank 0's) counts come back."""
    pm = ProcessMesh.create(mesh_shape)
    failures, counts = [], []
    for shape, src, dst, steps, *conv in cases:
        try:
            bad, fwd, bwd = _check_case(pm, shape, src, dst, steps, *conv)
        except Exception as exc:  # noqa: BLE001 -- keep going so peers do not hang
            bad, fwd, bwd = [f"{src}->{dst} shape={shape}: {type(exc).__name__}: {exc}"], {}, {}
        failures.extend(bad)
        counts.append((dict(fwd), dict(bwd)))
    return failures, counts if rank == 0 else None


def _run_and_check(mesh_shape, cases):
    results = run_local(_run_cases, math.prod(mesh_shape),
                        mesh_shape, cases, timeout=120)
    failures = [f for rank_failures, _ in results for f in rank_failures]
    assert not failures, f"{len(failures)} failures, first ones:\n" + "\n".join(failures[:10])
    counts = results[0][1]
    for (shape, src, dst, steps, *_), (fwd, bwd) in zip(cases, counts):
        assert Counter(fwd) == _expected_counts(steps, FORWARD), (src, dst, shape, steps, fwd)
        assert Counter(bwd) == _expected_counts(steps, BACKWARD), (src, dst, shape, steps, bwd)
    return counts


def _step(kind, axis, src=None, dst=None):
    return ReshardStep(kind, axis, src_dim=src, dst_dim=dst)


# ------------------------------------------------------------------- hand-built step lists
HAND_CASES_2x2 = [
    # every kind on axis 1 and on axis 0, dims other than 0, 2-D and 3-D tensors
    ((4, 8), "RS1", "RR", [_step("all_gather", 1, src=1)]),
    ((8, 6, 2), "S1R", "RR", [_step("all_gather", 0, src=1)]),
    ((8, 6, 2), "RR", "RS2", [_step("split", 1, dst=2)]),
    ((4, 8), "RR", "S1R", [_step("split", 0, dst=1)]),
    ((4, 8), "S0R", "S1R", [_step("all_to_all", 0, src=0, dst=1)]),
    ((8, 6, 2), "RS2", "RS1", [_step("all_to_all", 1, src=2, dst=1)]),
    ((8, 6, 2), "S0S1", "S0S0", [_step("all_to_all", 1, src=1, dst=0)]),
    ((4, 8), "PR", "RR", [_step("all_reduce", 0)]),
    ((4, 8), "PP", "RR", [_step("all_reduce", 1), _step("all_reduce", 0)]),
    ((4, 8), "S1P", "S1S1", [_step("reduce_scatter", 1, dst=1)]),
    ((8, 6, 2), "PR", "S2R", [_step("reduce_scatter", 0, dst=2)]),
    ((4, 8), "RS0", "PS0", [_step("to_partial", 0)]),
    ((8, 6, 2), "RR", "PP", [_step("to_partial", 0), _step("to_partial", 1)]),
    # multi-step chains: the naive route and a P -> S -> S chain
    ((8, 6, 2), "S0S0", "S1S2",
     [_step("all_gather", 1, src=0), _step("all_gather", 0, src=0),
      _step("split", 0, dst=1), _step("split", 1, dst=2)]),
    ((4, 8), "PP", "S1S0",
     [_step("reduce_scatter", 0, dst=0), _step("all_to_all", 0, src=0, dst=1),
      _step("reduce_scatter", 1, dst=0)]),
]


def test_hand_built_steps_on_2x2_mesh():
    _run_and_check((2, 2), HAND_CASES_2x2)


def test_hand_built_steps_on_1d_mesh_of_4():
    cases = [
        ((4, 8), "S0", "S1", [_step("all_to_all", 0, src=0, dst=1)]),
        ((8, 4, 2), "S1", "S0", [_step("all_to_all", 0, src=1, dst=0)]),
        ((4, 8), "P", "S1", [_step("reduce_scatter", 0, dst=1)]),
        ((8, 4, 2), "S1", "R", [_step("all_gather", 0, src=1)]),
        ((8, 4, 2), "R", "P", [_step("to_partial", 0)]),
    ]
    _run_and_check((4,), cases)


# ------------------------------------------------------------------------- device-free checks
def test_next_spec_tracks_layouts():
    assert comm.next_spec("S0S1", _step("all_to_all", 1, src=1, dst=0)) == TensorSpec.parse("S0S0")
    assert comm.next_spec("PR", _step("reduce_scatter", 0, dst=1)) == TensorSpec.parse("S1R")
    assert comm.next_spec("RR", _step("to_partial", 1)) == TensorSpec.parse("RP")
    assert comm.next_spec("S0S0", _step("all_gather", 1, src=0)) == TensorSpec.parse("S0R")


@pytest.mark.parametrize("spec, step, match", [
    ("S0R", _step("all_gather", 0, src=1), r"needs S1 on axis 0, spec is S0R"),
    ("RR", _step("all_reduce", 1), r"needs P on axis 1"),
    ("S0S0", _step("all_gather", 0, src=0), r"axis 0 is not the minor-most axis sharding dim 0"),
    ("RS0", _step("split", 0, dst=0), r"axis 0 would not be the minor-most.*\[1\]"),
    ("RS1", _step("all_to_all", 2, src=1, dst=0), r"names mesh axis 2.*2 axes"),
])
def test_next_spec_rejects_steps_that_do_not_apply(spec, step, match):
    with pytest.raises(ValueError, match=match):
        comm.next_spec(spec, step)


def test_convert_refuses_steps_that_do_not_end_in_dst():
    conv = plan_conversion("S0", "S1", (4, 8), 8, MeshSpec.preset("cpu", (2,)))
    wrong = dataclasses.replace(conv, dst=TensorSpec.parse("R"))
    # The check runs before any collective, so no process group is needed to see it fail.
    with pytest.raises(ValueError, match=r"conversion S0 -> R: its steps .* end in S1"):
        comm.convert(torch.zeros(2, 8), wrong, pmesh=None)


def test_replicate_steps_remove_minor_axes_first():
    steps = comm.replicate_steps("S0PS0")
    assert [str(s) for s in steps] == ["all_gather[axis2] S0", "all_reduce[axis1]",
                                      "all_gather[axis0] S0"]
    assert comm.replicate_steps("RR") == ()


def test_count_collectives_nests_and_ignores_local_steps():
    # split and to_partial are local: a 1-rank group is enough to run them without peers.
    def body(rank, world_size):
        pm = ProcessMesh.create((1,))
        x = torch.arange(6.0).reshape(2, 3)
        with comm.count_collectives() as outer:
            with comm.count_collectives() as inner:
                y = comm.apply_steps(x, [_step("split", 0, dst=1), _step("all_gather", 0, src=1)],
                                     pm, src="R")
            z = comm.apply_steps(y, [_step("to_partial", 0), _step("all_reduce", 0)], pm)
        return dict(outer), dict(inner), torch.equal(z, x)

    outer, inner, same = run_local(body, 1)[0]
    assert outer == {"all_gather": 1, "all_reduce": 1}
    assert inner == {"all_gather": 1}
    assert same


# ------------------------------------------------------------------------ process mesh + errors
def test_process_mesh_coordinates_groups_and_errors():
    def body(rank, world_size):
        out = {}
        for bad in ((3,), (2, 2)):
            try:
                ProcessMesh.create(bad)
            except ValueError as exc:
                out[bad] = str(exc)
        pm = ProcessMesh.from_spec(MeshSpec.preset("cpu", (2,), axis_names=("dp",)))
        out["mesh"] = (pm.shape, pm.axis_names, pm.coordinate, pm.axis_size(0),
                       dist.get_process_group_ranks(pm.group(0)))
        try:
            pm.group(1)
        except ValueError as exc:
            out["axis"] = str(exc)
        x = torch.arange(8.0).reshape(2, 4)
        try:
            comm.apply_steps(x[:1], [_step("split", 0, dst=0)], pm, src="R")
        except ValueError as exc:
            out["split"] = str(exc)
        return out

    results = run_local(body, 2)
    for rank, out in enumerate(results):
        assert "mesh (3,) has 3 devices but the process group has 2 ranks" in out[(3,)]
        assert "mesh (2, 2) has 4 devices" in out[(2, 2)]
        assert out["mesh"] == ((2,), ("dp",), (rank,), 2, [0, 1])
        assert "mesh axis 1 out of range for process mesh (2,)" in out["axis"]
        assert "dim 0 of local shape (1, 4) has size 1, not divisible by the axis size 2" in out["split"]


def test_distribute_and_gather_full_round_trip_every_spec():
    shape = (4, 8, 2)
    specs = ["".join(p) for p in itertools.product(["R", "S0", "S1", "P"], repeat=2)]

    def body(rank, world_size):
        pm = ProcessMesh.create((2, 2))
        x, _ = _tensors(shape)
        bad = []
        for spec in specs:
            local = comm.distribute(x, spec, pm)
            if not torch.equal(comm.gather_full(local, spec, pm), x):
                bad.append(spec)
        return bad

    assert run_local(body, 4) == [[]] * 4


# ------------------------------------------------------- acceptance: every planned conversion
SPEC_TOKENS = ("R", "S0", "S1", "P")


def _planned_cases(mesh_shape):
    """Every ordered pair over R, S0, S1, P per axis, both shapes, uneven layouts excluded."""
    mesh = MeshSpec.preset("cpu", mesh_shape)
    cases = []
    for shape in SHAPES:
        specs = [s for s in ("".join(t) for t in itertools.product(SPEC_TOKENS, repeat=len(mesh_shape)))
                 if TensorSpec.parse(s).is_valid(shape, mesh_shape)]
        for src, dst in itertools.product(specs, repeat=2):
            conv = plan_conversion(src, dst, shape, 8, mesh)  # float64 tensors
            cases.append((shape, str(conv.src), str(conv.dst), list(conv.steps), conv))
    return cases


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=["2", "4", "2x2"])
def test_every_planned_conversion_on_gloo(mesh_shape):
    cases = _planned_cases(mesh_shape)
    expected_pairs = {(2,): 32, (4,): 16 + 9, (2, 2): 256 + 225}[mesh_shape]
    assert len(cases) == expected_pairs  # (8, 6, 2) has no S1 over 4 shards
    counts = _run_and_check(mesh_shape, cases)
    by_pair = {(shape, src, dst): c for (shape, src, dst, *_), c in zip(cases, counts)}
    if len(mesh_shape) == 1:
        # The cheap routes the planner must find, as real collectives, forward and backward.
        assert by_pair[((4, 8), "S0", "S1")] == ({"all_to_all": 1}, {"all_to_all": 1})
        assert by_pair[((4, 8), "P", "S1")] == ({"reduce_scatter": 1}, {"all_gather": 1})
        assert by_pair[((4, 8), "P", "R")] == ({"all_reduce": 1}, {})
        assert by_pair[((4, 8), "R", "S0")] == ({}, {"all_gather": 1})
    else:
        assert by_pair[((4, 8), "S0R", "S1R")] == ({"all_to_all": 1}, {"all_to_all": 1})
        assert by_pair[((4, 8), "RS1", "RS0")] == ({"all_to_all": 1}, {"all_to_all": 1})
        assert by_pair[((4, 8), "PR", "S0R")] == ({"reduce_scatter": 1}, {"all_gather": 1})


SEGMENTED_TOKENS = ("R", "S0", "S1", "S(1/3)", "P")


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["2", "2x2"])
def test_planned_conversions_of_a_segmented_shard_on_gloo(mesh_shape):
    """A fused projection's ``S(1/3)`` (q|k|v in the columns, each third split) to and from every
    other layout, as planned, forward and backward; a segmented all-gather is ONE all-gather and
    the split to it none (its backward one), as for a plain shard."""
    mesh, shape = MeshSpec.preset("cpu", mesh_shape), (4, 12)
    specs = [s for s in ("".join(t) for t in itertools.product(SEGMENTED_TOKENS, repeat=len(mesh_shape)))
             if TensorSpec.parse(s).is_valid(shape, mesh_shape)]
    cases = []
    for src, dst in itertools.product(specs, repeat=2):
        if "/" in src + dst:
            conv = plan_conversion(src, dst, shape, 8, mesh)
            cases.append((shape, str(conv.src), str(conv.dst), list(conv.steps), conv))
    counts = _run_and_check(mesh_shape, cases)
    by_pair = {(src, dst): c for (_, src, dst, *_), c in zip(cases, counts)}
    if len(mesh_shape) == 1:
        assert by_pair[("S(1/3)", "R")] == ({"all_gather": 1}, {})
        assert by_pair[("R", "S(1/3)")] == ({}, {"all_gather": 1})
        assert plan_conversion("S(1/3)", "R", shape, 8, mesh).total_s == plan_conversion("S1", "R", shape, 8,
                                                                                         mesh).total_s
    else:
        assert by_pair[("S0S(1/3)", "S0R")] == ({"all_gather": 1}, {})


def test_segmented_dtensor_is_a_strided_shard():
    """A parameter laid out ``S(1/3)`` is the DTensor of ``_StridedShard(1, split_factor=3)``:
    ``distribute_tensor`` gives every rank the piece autopar materialises, and ``full_tensor``
    (checkpoints) reorders the pieces back."""
    from torch.distributed.tensor import distribute_tensor

    from autopar.runtime.dtensors import dtensor_placements, to_dtensor
    from autopar.runtime.materialize import slice_local

    def body(rank, world):
        pm = ProcessMesh.create((2, 2))
        full = torch.arange(4 * 12, dtype=torch.float64).reshape(4, 12)
        out = []
        for text in ("RS(1/3)", "S(1/3)S0", "S0S(1/3)"):
            spec = TensorSpec.parse(text)
            local = slice_local(full, spec, pm)
            theirs = distribute_tensor(full, pm.device_mesh, dtensor_placements(spec)).to_local()
            mine = to_dtensor(local, spec, pm, full.shape)
            out.append((text, torch.equal(local, theirs), torch.equal(mine.full_tensor(), full)))
        return out

    for rank_out in run_local(body, 4, timeout=120):
        assert all(same and whole for _, same, whole in rank_out), rank_out


def test_all_to_all_of_a_channels_last_shard():
    """A channels-last activation (ConvNext, GPT-J's rotary interleave) reaches the all-to-all with
    non-contiguous strides; torch.stack keeps that memory format and gloo refuses it."""
    def body(rank, world):
        pm = ProcessMesh.from_spec(MeshSpec.preset("cpu", (2,)), device_type="cpu")
        full = torch.arange(4 * 4 * 2 * 2, dtype=torch.float64).reshape(4, 4, 2, 2)
        x = comm.distribute(full, TensorSpec.parse("S0"), pm).contiguous(memory_format=torch.channels_last)
        x.requires_grad_()
        y = comm.apply_steps(x, [_step("all_to_all", 0, src=0, dst=1)], pm, src=TensorSpec.parse("S0"))
        y.backward(torch.ones_like(y))
        want = full[:, rank * 2:(rank + 1) * 2]
        return torch.equal(y.detach(), want) and torch.equal(x.grad, torch.ones_like(x))

    assert run_local(body, 2, timeout=120) == [True, True]
