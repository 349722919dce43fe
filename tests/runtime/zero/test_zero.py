"""ZeRO-1/2 over the plan's replicated axes (autopar.runtime.zero) on real gloo processes.

GPT-2 tiny and Llama tiny on meshes (2,), (4,) and (2, 2), stages 1 and 2, AdamW through
``model.optimizer``: the parameters after 3 steps equal single-device training; the optimizer
state held per rank is the plan's (1/dp of stage 0's), ZeRO-2's gradient pieces are 1/dp of the
parameters; the collectives one training step issues are the plan's (``autopar inspect``'s
communication rows); a plain optimizer is refused under ZeRO-2 with a clear error.
"""

from __future__ import annotations

import copy
import math
import os
from collections import Counter

import pytest
import torch

import autopar
from autopar import zoo
from autopar.layout.placement import R, TensorSpec
from autopar.planner.options import PlanOptions
from autopar.planner.orchestrate import plan_traced, trace_for_planning
from autopar.report import build_report
from autopar.runtime.counting import COLLECTIVE_KINDS, count_collectives
from autopar.runtime.dtensors import local_of
from autopar.runtime.launch import run_local
from autopar.tracer import profile

pytestmark = pytest.mark.slow

# AdamW's eps raised to 1e-5 as in test_e2e.py: a gradient that is zero up to float noise (the key
# projection's bias) would otherwise step lr * sign(noise), a coin flip between summation orders.
STEPS, EPS = 3, 1e-5  # >= 2: the second step applies moments ZeRO kept sharded
MESHES = ((2,), (4,), (2, 2))


def _model(name):
    torch.manual_seed(0)
    return zoo.build(name, tiny=True, batch=8, seq=16, device="cpu")


def _reference(model, inputs):
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, eps=EPS)
    for _ in range(STEPS):
        m(**inputs).loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in m.state_dict().items()}


def _planned_state_bytes(pm) -> tuple[int, int]:
    """(AdamW state bytes, gradient-piece bytes) per rank that the plan implies: 2 moments of
    each parameter's local shard, divided over its replicated axes under ZeRO."""
    state = grads = 0
    shape = pm.plan.mesh.shape
    for n in pm.plan.nodes:
        if n.kind != "parameter":
            continue
        spec = TensorSpec.parse(n.output_specs[0])
        ph = pm._placeholders[n.name]
        local = math.prod(spec.local_shape(ph.shape, shape)) * 4
        dp = math.prod(shape[a] for a, p in enumerate(spec.placements) if p == R) if n.zero_stage else 1
        state += 2 * local / dp
        grads += local / dp if n.zero_stage == 2 else 0
    return int(state), int(grads)


def _planned_collectives(rows, mesh_shape) -> tuple[Counter, Counter]:
    """(collectives, bytes) per kind that one step issues by the plan's communication rows, as
    the runtime issues them: a collective over several mesh axes runs as one per axis (a
    reduce-scatter's later rounds, an all-gather's earlier ones, move a 1/n-th as much per
    axis already split), except a bucketed gradient all-reduce (source ``bucket``), one
    collective on the group spanning its axes (``ProcessMesh.group_over``); ZeRO's all-gathers
    after the step are one per bucket (``_body``'s tiny cap: one per parameter) and mesh axis;
    local steps (split, to_partial) issue nothing."""
    counts, nbytes = Counter(), Counter()
    for row in rows:
        if row.kind not in COLLECTIVE_KINDS:
            assert not row.kind.startswith("kernel:"), f"a kernel's collectives are not itemised: {row}"
            continue
        axes = [int(a.split("(")[0].removeprefix("ax")) for a in row.axes.split("+")]
        split = [math.prod(mesh_shape[a] for a in axes[:k]) for k in range(len(axes))]
        spanning = row.source == "bucket" and row.kind == "all_reduce"
        per_axis = sum(1 / s for s in split) if row.kind in ("reduce_scatter", "all_gather") else \
            1 if spanning else len(axes)
        nbytes[row.kind] += row.payload_bytes * per_axis
        counts[row.kind] += row.count * (1 if spanning else len(axes))
    return +counts, +nbytes


def _body(rank, world, model, inputs, plans):
    # A bucket per gradient: the plan prices one all-reduce (or ZeRO-2 reduce-scatter) per
    # partial gradient, and ZeRO one all-gather per parameter, in the report's rows; default
    # buckets would merge them (tests/runtime/test_bucketing.py, test_gather_buckets below).
    os.environ["AUTOPAR_BUCKET_CAP_MB"] = "1e-6"
    out = []
    for stage, plan in plans:
        pm = autopar.autoparallelize(copy.deepcopy(model), inputs, plan=plan, init_weights=False)
        pm.load_full_state_dict(model.state_dict())
        if stage == 2:
            with pytest.raises(ValueError, match="ZeRO-2.*model.optimizer"):
                pm(**inputs)  # no ZeRO optimizer yet: .grad would not be the gradient
        opt = pm.optimizer(torch.optim.AdamW, lr=1e-3, eps=EPS)
        early = _reduce_scatters_before_backward_ends(pm)
        grad_bytes = 0
        for step in range(STEPS):
            with count_collectives() as counts:
                pm(**inputs).loss.backward()
                opt.prepare_grads()
                grad_bytes = sum(local_of(p.master.grad).numel() * 4 for p in opt.pieces if p.master.grad is not None)
                opt.step()
                opt.zero_grad()
            if step == 1:
                issued = (dict(counts), dict(counts.bytes))
        state = sum(local_of(v).numel() * v.element_size() for s in opt.state.values() for k, v in s.items()
                    if k != "step")
        out.append((stage, pm.full_state_dict(), state, grad_bytes, _planned_state_bytes(pm),
                    len(opt.pieces), {n.zero_stage for n in pm.plan.nodes if n.kind == "parameter"}, issued,
                    early))
    return out


def _reduce_scatters_before_backward_ends(pm) -> list[tuple[int, int]]:
    """Per backward pass: (ZeRO-2 reduce-scatters already issued when the end-of-backward
    callback starts, all issued by its end)."""
    from autopar.runtime.bucketing import GradBucketer

    seen = []
    for m in pm.modules():
        if isinstance(m, GradBucketer):
            finish = m._finish

            def spy(task, m=m, finish=finish):
                before = m.stats["reduce_scatters"]
                finish(task)
                seen.append((before, m.stats["reduce_scatters"]))

            m._finish = spy
    return seen


# the default run: gpt2
@pytest.mark.parametrize("name", ["gpt2", pytest.param("llama-1b", marks=pytest.mark.full_sweep)])
def test_zero_1_and_2_train_like_one_device(name):
    model, inputs = _model(name)
    want = _reference(model, inputs)
    # one trace and profile for the six plans (``plan_model`` would trace the same graph each time)
    traced = trace_for_planning(model, inputs, precision="fp32")
    prof = profile(traced)
    for mesh in MESHES:
        world = math.prod(mesh)
        plans, planned = [], {}
        for stage in (1, 2):
            result = plan_traced(traced, prof, mesh=mesh, options=PlanOptions(zero_stage=stage, checkpoint="none"))
            plans.append((stage, result.plan))
            planned[stage] = _planned_collectives(build_report(result.plan, result).comm, mesh)
        results = run_local(_body, world, model, inputs, plans, timeout=300)
        for rank_results in results:
            for (stage, full, state, grad_bytes, (plan_state, plan_grads), num_pieces, stages, issued,
                 early) in rank_results:
                where = f"{name} {mesh} ZeRO-{stage}"
                if stage == 2 and issued[0].get("reduce_scatter"):  # issued during backward, not at its end
                    ends = [0] + [end for _, end in early]
                    assert early and all(before > end for (before, _), end in zip(early, ends)), (where, early)
                counts, nbytes = planned[stage]
                assert issued[0] == counts, (where, issued[0], counts)
                for kind, n in nbytes.items():  # uneven pieces are padded on the wire
                    assert n <= issued[1][kind] <= 1.05 * n, (where, kind, issued[1][kind], n)
                # (a parameter the plan shards on every axis has nothing to split: stage 0)
                assert stage in stages and stages <= {0, stage} and num_pieces > 0, where
                for k, v in full.items():
                    assert torch.allclose(v, want[k], rtol=1e-4, atol=1e-5), f"{where}: {k}"
                assert abs(state - plan_state) <= 0.05 * plan_state, (where, state, plan_state)
                if stage == 2:
                    assert abs(grad_bytes - plan_grads) <= 0.05 * plan_grads, (where, grad_bytes, plan_grads)
                else:
                    assert grad_bytes > 0


def _auto_body(rank, world, model, inputs, plan):
    pm = autopar.autoparallelize(copy.deepcopy(model), inputs, plan=plan, init_weights=False)
    pm.load_full_state_dict(model.state_dict())
    # A first optimizer, dropped after one backward: its pieces must not keep receiving gradients
    # (the bucketer's reduce-scatter plans are laid out for the pieces of the latest optimizer).
    dropped = pm.optimizer(torch.optim.AdamW, lr=1e-3, eps=EPS)
    pm(**inputs).loss.backward()
    dropped.zero_grad()
    opt = pm.optimizer(torch.optim.AdamW, [{"params": list(pm.parameters()), "weight_decay": 0.05}],
                       lr=1e-3, eps=EPS)
    for _ in range(STEPS):
        pm(**inputs).loss.backward()
        opt.step()
        opt.zero_grad()
    return pm.full_state_dict(), [g["weight_decay"] for g in opt.param_groups]


def test_auto_mixes_stages_under_a_tight_budget_and_trains_like_one_device():
    model, inputs = _model("gpt2")
    free = autopar.plan(model, inputs, mesh=(2, 2), zero_stage="auto", checkpoint="none", pipeline=1)
    plan = autopar.plan(model, inputs, mesh=(2, 2), zero_stage="auto", checkpoint="none", pipeline=1,
                        memory_budget=int(0.93 * free.estimate.peak_bytes))
    stages = {n.zero_stage for n in plan.by_kind("parameter")}
    assert 2 in stages and 0 in stages, stages
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, eps=EPS, weight_decay=0.05)
    for _ in range(STEPS):
        m(**inputs).loss.backward()
        opt.step()
        opt.zero_grad()
    for full, decays in run_local(_auto_body, 4, model, inputs, plan, timeout=300):
        assert decays == [0.05]  # param groups pass through to the inner optimizer
        for k, v in full.items():
            assert torch.allclose(v, m.state_dict()[k], rtol=1e-4, atol=1e-5), k


def _pieces_body(rank, world):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.runtime.zero import piece_of

    mesh = init_device_mesh("cpu", (2, 2))
    torch.manual_seed(0)
    full = torch.randn(6, 5)
    out = {}
    for text, placements in (("RR", (Replicate(), Replicate())), ("S0R", (Shard(0), Replicate())),
                             ("RS0", (Replicate(), Shard(0))), ("RS1", (Replicate(), Shard(1)))):
        param = torch.nn.Parameter(distribute_tensor(full, mesh, placements))
        piece = piece_of("w", param, 2, TensorSpec.parse(text))
        local = local_of(param)
        mine = local_of(piece.master)
        start = local.untyped_storage().data_ptr()
        inside = start <= mine.data_ptr() < start + local.untyped_storage().nbytes()
        out[text] = (inside or mine.numel() == 0, torch.equal(piece.master.full_tensor(), full),
                     tuple(piece.master.placements))
    return out


def test_pieces_are_views_of_the_local_shard_for_any_layout():
    """(R, S0) on a 2-D mesh: axis 0 would split dim 0 before axis 1 does, so the piece is cut
    from dim 1 -- a block of the local shard (uneven: 5 columns over 2)."""
    for result in run_local(_pieces_body, 4, timeout=120):
        for text, (view, same, placements) in result.items():
            assert view and same, text
        assert result["RS0"][2][0].dim == 1


def _batched_body(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from autopar.runtime.zero import piece_of
    from dataclasses import replace

    from autopar.layout.machine import ComputeProfile, LinkFit, MachineProfile
    from autopar.layout.mesh import MeshSpec
    from autopar.runtime.zero.comm import (GatherPlan, ScatterPlan, Scratch, deliver_grad, gather_pieces,
                                          scatter_grads)

    mesh = init_device_mesh("cpu", (2, 2))
    links = [LinkFit(kind, a, alpha, beta) for a in (0, 1)
             for kind, alpha, beta in (("all_reduce", 1e-6, 1e-12), ("reduce_scatter", 1e-3, 1e-9))]
    cheap_all_reduce = replace(MeshSpec.preset("cpu", (2, 2)), machine=MachineProfile(
        ComputeProfile(()), tuple(links), (2, 2), ("a", "b"), note="all-reduce cheaper"))
    torch.manual_seed(0)
    layouts = {"RR": (Replicate(), Replicate()), "S0R": (Shard(0), Replicate()),
               "RS0": (Replicate(), Shard(0)), "RS1": (Replicate(), Shard(1))}
    fulls = {text: torch.randn(7, 5) for text in layouts}  # 7 rows, 5 columns: uneven everywhere
    pieces = []
    for text, placements in layouts.items():
        param = torch.nn.Parameter(distribute_tensor(fulls[text], mesh, placements))
        pieces.append(piece_of(text, param, 2, TensorSpec.parse(text)))
    with torch.no_grad():
        for piece in pieces:  # an "optimizer step": every piece moves by its own amount
            local_of(piece.master).add_(1.0 + rank)
    with count_collectives() as one_each:
        gather_pieces(pieces)
    # (cloned: a replicated DTensor's full tensor is its local one, which the next gather writes)
    gathered = {p.name: p.param.full_tensor().clone() for p in pieces}
    expected = {p.name: p.master.detach().full_tensor() for p in pieces}
    # In buckets: with room for all, one all-gather per mesh axis carries every piece.
    with torch.no_grad():
        for piece in pieces:
            local_of(piece.master).mul_(2.0)
    with count_collectives() as bucketed:
        GatherPlan(pieces, cap_bytes=1 << 20).run()
    in_buckets = all(torch.equal(p.param.full_tensor(), 2 * expected[p.name]) for p in pieces)
    gathers = (one_each["all_gather"], bucketed["all_gather"], in_buckets)
    # ZeRO-2: each rank's local gradient differs; partial on every ZeRO axis, or on the first only
    results = {}
    for partial_on in ("all", "first"):
        items, want = [], []
        for p in pieces:
            grad = torch.full_like(local_of(p.param), float(rank + 1)) * torch.arange(
                local_of(p.param).numel()).view_as(local_of(p.param))
            partial = p.axes if partial_on == "all" else p.axes[:1]
            items.append((p, grad, partial))
            # the replicated axes that are not partial hold the same gradient: make it so
            same = grad if partial_on == "all" else grad / (rank + 1) * (mesh.get_local_rank(p.axes[0]) + 1)
            items[-1] = (p, same, partial)
            placements = tuple(Partial() if a in partial else pl for a, pl in enumerate(p.param.placements))
            full = DTensor.from_local(same, mesh, placements, run_check=False, shape=p.param.shape,
                                      stride=p.param.stride())
            want.append(local_of(full.redistribute(mesh, p.master.placements)))
        for async_op in (False, True):
            got = scatter_grads(items, async_op=async_op).wait()
            results[partial_on, async_op] = all(torch.allclose(g, w) for g, w in zip(got, want))
        # A kept plan, two passes: the second reuses the buffers, except a receive buffer the
        # first pass's gradient still lives in (``master.grad`` kept: accumulation over steps).
        # Its send buffers borrow the gather's receive buffer, which still gathers right after.
        gather = GatherPlan(pieces, cap_bytes=1 << 20)
        plan = ScatterPlan([(p, partial, g.dtype) for p, g, partial in items], scratch=Scratch(gather))
        passes = []
        for scale in (1.0, 3.0):
            work = plan.work()
            for i, (p, g, _) in enumerate(items):
                work.add(i, g * scale)
            recv = {b.untyped_storage().data_ptr() for (role, *_), b in gather.buffers.kept.items() if role == "recv"}
            results[partial_on, "borrowed", scale] = bool(work.sends) and all(
                b.untyped_storage().data_ptr() in recv for b in work.sends.values())
            work.start(async_op=True)
            got = work.wait()
            passes.append([g.clone() for g in got])  # (the second delivery adds into the first's)
            for p, mine in zip(pieces, got):
                deliver_grad(p.master, mine)  # as the bucketer delivers them
            if scale == 1.0:  # each piece's gradient lives in a kept receive buffer, never twice
                kept = {b.untyped_storage().data_ptr() for b in plan._kept.values()}
                results[partial_on, "in place"] = all(
                    local_of(p.master.grad).untyped_storage().data_ptr() in kept for p in pieces)
        results[partial_on, "kept"] = all(torch.allclose(a, w) and torch.allclose(b, 3 * w)
                                          and torch.allclose(local_of(p.master.grad), 4 * w)
                                          for a, b, w, p in zip(*passes, want, pieces))
        gather.run()
        results[partial_on, "gathers after"] = all(torch.equal(p.param.full_tensor(), 2 * expected[p.name])
                                                   for p in pieces)
        # Links where an all-reduce is the cheaper sum: every collective all-reduces, same pieces.
        with count_collectives() as summed:
            work = ScatterPlan([(p, partial, g.dtype) for p, g, partial in items], mesh=cheap_all_reduce).work()
            for i, (p, g, _) in enumerate(items):
                work.add(i, g)
            work.start(async_op=True)
            got = work.wait()
        results[partial_on, "all-reduced"] = (all(torch.allclose(g, w) for g, w in zip(got, want))
                                              and summed["all_reduce"] > 0 and not summed["reduce_scatter"])
        for p in pieces:
            p.master.grad = None
    return ({k: torch.equal(gathered[k], expected[k]) for k in gathered}, results, gathers)


def test_batched_gather_and_reduce_scatter_match_dtensor_on_uneven_nested_pieces():
    for gathered, scattered, (one_each, bucketed, in_buckets) in run_local(_batched_body, 4, timeout=120):
        assert all(gathered.values()), gathered
        assert all(scattered.values()) and len(scattered) == 16, scattered
        # 4 pieces: RR on both axes, S0R / RS0 / RS1 on one each -- one gather per (piece, axis)
        # without buckets, one per axis with them
        assert (one_each, bucketed, in_buckets) == (5, 2, True)
