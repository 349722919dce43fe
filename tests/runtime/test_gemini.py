"""Gemini-style chunk runtime (autopar.runtime.gemini): chunks, tiers, exact accounting, CPU Adam.

Multi-process: GPT-2 tiny and Llama tiny on meshes (2,) and (2, 2) (gloo, fork), planned on
fast links so the plans are data-parallel (partial gradients, bucketed or reduce-scattered) with
some parameters sharded by the plan itself. One module per model and mesh is wrapped once and
re-placed for every (shard_param_frac, offload_optim_frac, offload_param_frac) case; per case, 3
AdamW steps must equal single-device training (rtol 1e-4), the device-tier bytes after every chunk
move stay within a budget that forces evictions, the ledger equals the buffers that exist, and a
sharded chunk holds 1/dp of its payload at rest (its gathered copy only while in use).
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

import autopar
from autopar import zoo
from autopar.api import plan_model
from autopar.layout.mesh import MeshSpec
from autopar.planner.options import PlanOptions
from autopar.planner.orchestrate import plan_family
from autopar.runtime import gemini
from autopar.runtime.gemini.chunk import DEVICE, HOST, Chunk, Slot, pack, search_chunk_size
from autopar.runtime.gemini.cpu_optim import adam_update_
from autopar.runtime.gemini.policies import AutoPolicy, StaticPolicy, auto_tiers, make_policy, static_tiers
from autopar.runtime.launch import run_local

# 3 steps: chunks move, evict and refetch on every step; the later steps add time, not paths.
STEPS, EPS, LR = 3, 1e-5, 1e-3
# (shard_param_frac, offload_optim_frac, offload_param_frac)
CASES = tuple((0.0, o, p) for o in (0.5, 1.0) for p in (0.0, 0.5, 1.0)) + (
    (0.5, 0.5, 0.0), (0.5, 1.0, 1.0), (1.0, 0.0, 0.0), (1.0, 1.0, 0.5))
# The smallest chunk that holds the largest parameter: many chunks even for tiny models.
RANGE = gemini.ChunkRange(min_elems=1024, max_elems=1024, step=1024)


# ------------------------------------------------------------------------------ pure pieces
def test_chunk_search_picks_least_padding():
    sizes = [300, 300, 300, 100]
    # 300, 400 and 600 elements each waste 200 (4, 3 and 2 chunks); the smallest wins the tie.
    assert search_chunk_size(sizes, min_elems=100, max_elems=800, step=100) == (300, 200)
    assert pack(sizes, 400) == [[0], [1], [2, 3]]
    assert search_chunk_size(sizes, min_elems=100, max_elems=1000, step=100) == (1000, 0)


def test_chunk_search_bounds_and_errors():
    assert search_chunk_size([700], min_elems=100, max_elems=200, step=100) == (700, 0)  # the largest wins
    assert search_chunk_size([300, 300, 400], min_elems=100, max_elems=1000, step=100) == (1000, 0)
    # a model under the minimum is one chunk of its size (Gemini's rule), not a padded minimum
    assert search_chunk_size([300, 200], min_elems=2**20, max_elems=2**21, step=1024) == (500, 0)
    with pytest.raises(ValueError, match="min <= max"):
        search_chunk_size([1], min_elems=10, max_elems=5, step=1)
    with pytest.raises(ValueError, match="below the largest"):
        pack([10, 20], 15)


def test_static_tiers_follow_gemini_fractions():
    sizes = [10, 10, 10, 10]
    assert static_tiers(sizes, StaticPolicy()) == [(DEVICE, DEVICE)] * 4
    tiers = static_tiers(sizes, StaticPolicy(offload_optim_frac=0.5, offload_param_frac=0.25))
    assert tiers == [(HOST, HOST), (DEVICE, HOST), (DEVICE, DEVICE), (DEVICE, DEVICE)]  # first chunks first
    assert static_tiers(sizes, StaticPolicy(offload_optim_frac=1.0, offload_param_frac=1.0)) == [(HOST, HOST)] * 4


def test_auto_tiers_keep_what_fits_beside_non_model_memory():
    payload, optim, none = [100, 100, 100], [300, 300, 300], [0, 0, 0]
    # 1000 B budget, 300 B non-model, 100 B kept free for a fetch: 600 B -> 3 payloads + 1 optimizer state
    tiers = auto_tiers(payload, optim, grads=none, budget=1000, non_model_peak=300, order=[2, 0, 1])
    assert tiers == [(DEVICE, HOST), (DEVICE, HOST), (DEVICE, DEVICE)]
    assert auto_tiers(payload, optim, grads=none, budget=300, non_model_peak=300, order=[]) == [(HOST, HOST)] * 3
    # A device-home chunk's gradient chunk is on the device too: 600 B hold 3 payloads + gradients
    # of 100 B each, nothing more (counting payloads alone put a 4th chunk's worth over budget).
    tiers = auto_tiers(payload + [100], optim + [300], grads=[100] * 4, budget=1000, non_model_peak=300,
                       order=[2, 0, 1, 3])
    assert tiers == [(DEVICE, HOST), (DEVICE, HOST), (DEVICE, HOST), (HOST, HOST)]


def test_shard_pieces_nest_the_axes_in_mesh_order():
    slots = [Slot("a", 0, 6, (2, 3)), Slot("b", 6, 5, (5,))]
    # 11 elements over a 2x2 group: shards of 3 (padded to 12); coordinates (1, 0) -> shard 2.
    chunk = Chunk(0, slots, 11, torch.float32, dp_axes=(0, 1), dp_sizes=(2, 2), dp_coords=(1, 0))
    assert (chunk.num_shards, chunk.shard_index, chunk.shard_elems) == (4, 2, 3)
    assert chunk.piece("a") == (0, 6, 0, 6) and chunk.piece("b") == (6, 11, 0, 5)  # unsharded: all of it
    chunk.sharded = True
    assert (chunk.elems, chunk.work_elems, chunk.payload_bytes, chunk.work_bytes) == (3, 12, 12, 48)
    assert chunk.piece("a") == (0, 0, 6, 6)  # elements 6..8 of the chunk: none of "a"
    assert chunk.piece("b") == (0, 3, 0, 3)
    last = Chunk(0, slots, 11, torch.float32, dp_axes=(0, 1), dp_sizes=(2, 2), dp_coords=(1, 1), sharded=True)
    assert last.piece("b") == (0, 2, 3, 5)  # elements 9..10, then padding


def test_policies_are_checked():
    with pytest.raises(ValueError, match=r"shard_param_frac must be a number in \[0, 1\], got 1.5"):
        StaticPolicy(shard_param_frac=1.5)
    with pytest.raises(ValueError, match=r"offload_optim_frac must be a number in \[0, 1\], got 1.5"):
        StaticPolicy(offload_optim_frac=1.5)
    with pytest.raises(ValueError, match="device_budget"):
        AutoPolicy(device_budget=None)
    with pytest.raises(ValueError, match="placement_policy"):
        make_policy("cuda")
    assert make_policy("auto", device_budget=10, offload_optim_frac=0.5) == AutoPolicy(device_budget=10)
    assert make_policy("auto", device_budget=10, sharded=True) == AutoPolicy(device_budget=10, sharded=True)
    with pytest.raises(ValueError, match="sharded must be a bool, got 1"):
        AutoPolicy(device_budget=10, sharded=1)


@pytest.mark.parametrize("kind,cls", [("adamw", torch.optim.AdamW), ("adam", torch.optim.Adam)])
def test_flat_adam_is_torch_math(kind, cls):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(257))
    flat, m, v = p.detach().clone(), torch.zeros(257), torch.zeros(257)
    opt = cls([p], lr=1e-2, eps=1e-6, weight_decay=0.1, foreach=False)
    for step in range(1, 4):
        g = torch.randn(257)
        p.grad = g.clone()
        opt.step()
        adam_update_(flat, g, m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.1,
                     kind=kind)
    assert torch.equal(flat, p.detach())
    assert torch.equal(m, opt.state[p]["exp_avg"]) and torch.equal(v, opt.state[p]["exp_avg_sq"])


# ---------------------------------------------------------------------------- on processes
def _model(name):
    torch.manual_seed(0)
    return zoo.build(name, tiny=True, batch=4, seq=16, device="cpu")


def _reference(model, inputs):
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), lr=LR, eps=EPS)
    for _ in range(STEPS):
        m(**inputs).loss.backward()
        opt.step()
        opt.zero_grad()
    m(**inputs).loss.backward()  # the gradients of one step more, for full_gradients
    grads = {k: p.grad.detach() for k, p in m.named_parameters()}
    return {k: v.detach() for k, v in m.state_dict().items()}, grads


def _fast(shape):
    """Cheap links: the planner splits the batch (data parallelism), so gradients come partial."""
    mesh = MeshSpec.preset("cpu", shape)
    return dataclasses.replace(mesh, alpha=(1e-7,) * len(shape), beta=(1e-13,) * len(shape), name="fast-links")


def _train_cases(rank, world, jobs):
    out = []
    for name, model, inputs, plan in jobs:
        pm = autopar.autoparallelize(copy.deepcopy(model), inputs, plan=plan, init_weights=False)
        pm, _ = gemini.wrap(pm, torch.optim.AdamW, dict(lr=LR, eps=EPS), chunk_range=RANGE)
        g = pm.gemini
        whole = [c.num_shards == 1 for c in g.manager.chunks]
        assert any(whole) and not all(whole), whole  # the plan shards some parameters on every axis
        with pytest.raises(ValueError, match=r"chunks \[.*\] cannot be sharded"):
            g.place([(DEVICE, DEVICE)] * len(whole), [True] * len(whole))
        for shard_frac, optim_frac, param_frac in CASES:
            g.apply_policy(StaticPolicy(shard_param_frac=shard_frac, offload_optim_frac=optim_frac,
                                        offload_param_frac=param_frac))
            chunks = g.manager.chunks
            # Room for the device-home chunks, their gradient chunks, 3 fetched (gathered) chunks
            # and the sharded chunks' whole gradients until backward's reduce-scatter.
            budget = (g.manager.ledger.bytes[DEVICE] + 3 * max(c.work_bytes for c in chunks)
                      + sum(c.grad_bytes for c in chunks if c.home == DEVICE)
                      + sum(c.work_bytes for c in chunks if c.sharded))
            g.set_device_budget(budget)
            pm.load_full_state_dict(model.state_dict())
            g.reload_masters()
            opt = g.optimizer(torch.optim.AdamW, dict(lr=LR, eps=EPS))
            start = len(g.manager.ledger.log)
            for step in range(STEPS):
                last = len(g.manager.ledger.log)
                pm(**inputs).loss.backward()
                opt.step()
                opt.zero_grad()
            grads = None
            if (shard_frac, optim_frac, param_frac) == (1.0, 0.0, 0.0):  # sharded gradients gathered on demand
                pm(**inputs).loss.backward()
                grads = pm.full_gradients()
                opt.zero_grad()
                g.manager.evict_all()  # no step follows to drop the gathered copies: at rest again
            moves = g.manager.ledger.log[start:]
            # Whole gradients of sharded chunks alive at once in the last backward (each chunk is
            # reduce-scattered once its contributions are in, as learned from the pass before).
            live = acc_peak = 0
            for m in g.manager.ledger.log[last:]:
                if m.event in ("alloc_acc", "free_acc"):
                    live += m.nbytes
                    acc_peak = max(acc_peak, live)
            host_chunks = sum(c.home == HOST for c in chunks)
            # At rest, a sharded chunk holds its shard (1/dp of the padded payload), no gathered copy.
            shards = [(c.payload_bytes, c.full_bytes, c.num_shards, c.itemsize,
                       g.manager.home_buf(c).untyped_storage().nbytes(), c.device_buf.untyped_storage().nbytes())
                      for c in chunks if c.sharded]
            resting = (sum(c.payload_bytes for c in chunks if c.home == DEVICE)
                       + sum(c.state_bytes(c.home, c.optim_tier) for c in chunks if c.optim_tier == DEVICE))
            out.append(((shard_frac, optim_frac, param_frac), name, pm.full_state_dict(), budget,
                        max(m.device_bytes for m in moves), sum(m.event == "evict" for m in moves), host_chunks,
                        len(chunks), g.manager.ledger.bytes.copy(), _expected_bytes(g.manager), shards, resting,
                        sum(whole), acc_peak, max(c.work_bytes for c in chunks), grads))
    return out


def _expected_bytes(manager) -> dict:
    """Each tier's bytes as the buffers that exist say, each storage once (an fp32 master on the
    payload's tier is the payload): the ledger must agree."""
    out, seen = {DEVICE: 0, HOST: 0}, set()
    for c in manager.chunks:
        owned = [(c.home, manager.home_buf(c)), (c.home, c.grad)] + [(c.optim_tier, getattr(c, k)) for k in
                                                                     ("master", "exp_avg", "exp_avg_sq", "landing")]
        owned += [(DEVICE, acc) for acc in c.acc.values()]
        if c.streamed:
            owned.append((DEVICE, c.device_buf))
        for tier, t in owned:
            if t is not None and t.untyped_storage().data_ptr() not in seen:
                if t.untyped_storage().nbytes():
                    seen.add(t.untyped_storage().data_ptr())
                out[tier] += t.untyped_storage().nbytes()
    return out


# the default run keeps its cheaper sibling; `pytest -m full_sweep` runs this one
@pytest.mark.parametrize("mesh", [(2,), pytest.param((2, 2), marks=pytest.mark.full_sweep)])
def test_offload_trains_like_one_device_within_the_device_budget(mesh):
    jobs, want, want_grads = [], {}, {}
    for name in ("gpt2", "llama-1b"):
        model, inputs = _model(name)
        want[name], want_grads[name] = _reference(model, inputs)
        plan = plan_model(model, inputs, mesh=_fast(mesh), options=PlanOptions(zero_stage=0, checkpoint="none")).plan
        jobs.append((name, model, inputs, plan))
    results = run_local(_train_cases, math.prod(mesh), jobs, timeout=240)
    for rank_results in results:
        assert len(rank_results) == 2 * len(CASES)
        for (s, o, p), name, full, budget, max_dev, evictions, host_chunks, num_chunks, ledger, real, shards, \
                resting, num_whole, acc_peak, max_work, grads in rank_results:
            where = f"{name} {mesh} shard={s} optim={o} param={p}"
            for k, v in full.items():
                assert torch.allclose(v, want[name][k], rtol=1e-4, atol=1e-5), f"{where}: {k}"
            if s == 1.0 and (o, p) == (0.0, 0.0):
                assert all(grads[k] is not None for k in want_grads[name]), where
                for k, v in want_grads[name].items():
                    assert torch.allclose(grads[k], v, rtol=1e-4, atol=1e-5), f"{where}: grad {k}"
            assert max_dev <= budget, (where, max_dev, budget)
            assert ledger == real, (where, ledger, real)
            assert num_chunks >= 3, (where, num_chunks)
            if p == 0.0:
                assert host_chunks == 0, where
            elif host_chunks > 3:  # more host chunks than the budget's room: some had to go
                assert evictions > 0, (where, evictions)
            if p == 1.0:
                assert host_chunks == num_chunks, where
            assert len(shards) == (0 if s == 0 else num_chunks - num_whole if s == 1 else len(shards)), where
            if s > 0:
                assert 0 < len(shards) < num_chunks - num_whole or s == 1, (where, len(shards))
            for payload, whole_bytes, num_shards, itemsize, home_bytes, gathered in shards:
                assert home_bytes == payload and gathered == 0, where
                assert 0 <= payload * num_shards - whole_bytes < num_shards * itemsize, where  # 1/dp, padded
            assert ledger[DEVICE] == resting, (where, ledger, resting)  # at rest: what the device keeps
            assert (acc_peak > 0) == (s > 0) and acc_peak <= 3 * max_work, (where, acc_peak, max_work, len(shards))


AUTO_BUDGET = 1_300_000


def _auto_and_planned(rank, world, model, inputs, plan, tiers):
    out = {}
    for what in ("auto", "planned"):
        pm = autopar.autoparallelize(copy.deepcopy(model), inputs, plan=plan, init_weights=False)
        pm.load_full_state_dict(model.state_dict())
        if what == "auto":  # GPT-2 tiny: 12 chunks of 64 KiB and their gradients: room for some
            policy = AutoPolicy(device_budget=AUTO_BUDGET)
        else:
            policy = gemini.PlannedPolicy(tiers=tiers)
        pm, opt = gemini.wrap(pm, torch.optim.AdamW, dict(lr=LR, eps=EPS), policy=policy, chunk_range=RANGE)
        placed = [[(c.home, c.optim_tier) for c in pm.gemini.manager.chunks]]
        for _ in range(STEPS):
            pm(**inputs).loss.backward()
            opt.step()
            opt.zero_grad()
            placed.append([(c.home, c.optim_tier) for c in pm.gemini.manager.chunks])
        m = pm.gemini.manager
        fqn_tiers = {pm._placeholders[s.name].fqn: (c.home, c.optim_tier) for c in m.chunks for s in c.slots}
        out[what] = (pm.full_state_dict(), placed, max(x.device_bytes for x in m.ledger.log),
                     max(m.non_model_samples, default=0), fqn_tiers)
    return out


def test_auto_policy_places_after_warmup_and_planned_tiers_are_kept():
    model, inputs = _model("gpt2")
    want, _ = _reference(model, inputs)
    plan = plan_model(model, inputs, mesh=(2,), options=PlanOptions(zero_stage=0, checkpoint="none")).plan
    names = [n for n, p in model.named_parameters()]
    tiers = {n: (HOST, HOST) if i % 3 == 0 else (HOST, DEVICE) if i % 3 == 1 else (DEVICE, DEVICE)
             for i, n in enumerate(names)}
    for result in run_local(_auto_and_planned, 2, model, inputs, plan, tiers, timeout=240):
        for what, (full, placed, max_dev, non_model, fqn_tiers) in result.items():
            for k, v in full.items():
                assert torch.allclose(v, want[k], rtol=1e-4, atol=1e-5), f"{what}: {k}"
        full, placed, max_dev, non_model, _ = result["auto"]
        assert placed[0] == [(HOST, HOST)] * len(placed[0])  # the warm-up step: everything on the host
        after = placed[-1]
        assert DEVICE in {h for h, _ in after} and HOST in {h for h, _ in after}, after
        assert placed[1:] == [after] * STEPS  # placed once, after the warm-up
        assert 0 < non_model < AUTO_BUDGET and max_dev <= AUTO_BUDGET, (non_model, max_dev)
        fqn_tiers = result["planned"][4]
        assert all(fqn_tiers[f] == tiers[f] for f in fqn_tiers if f in tiers), fqn_tiers


def _zero_chunks(rank, world, jobs):
    out = []
    for name, zero_stage, model, inputs, plan, policy in jobs:
        pm = autopar.autoparallelize(copy.deepcopy(model), inputs, plan=plan, init_weights=False)
        pm.load_full_state_dict(model.state_dict())
        pm, opt = gemini.wrap(pm, torch.optim.AdamW, dict(lr=LR, eps=EPS), policy=policy, chunk_range=RANGE)
        m = pm.gemini.manager
        for _ in range(STEPS):
            pm(**inputs).loss.backward()
            opt.step()
            opt.zero_grad()
        pm(**inputs).loss.backward()  # one backward more: ZeRO-2 gradients are shards, gathered on demand
        grads = pm.full_gradients()
        shards = [(c.zero, c.capacity, c.num_shards, c.home, c.optim_tier, c.master.numel(), c.exp_avg.numel(),
                   c.grad.numel()) for c in m.chunks if c.zero]
        ledger, real = m.ledger.bytes.copy(), _expected_bytes(m)
        opt.zero_grad()
        out.append((f"{name} {type(policy).__name__}", zero_stage, pm.full_state_dict(), grads, shards, ledger, real,
                    sum(c.sharded for c in m.chunks)))
    return out


def test_zero_chunks_train_like_one_device():
    """The plan's ZeRO-1/2 in chunks: optimizer state -- and under ZeRO-2 the gradient -- sharded
    over the data-parallel axis, on the device or the host (ZeRO-Offload), payload whole and
    all-gathered after each step; planned tiers, and Gemini's static (``shard_param_frac`` leaves
    ZeRO chunks whole; the plan's other parameters are sharded by their layouts already) and auto
    policies."""
    jobs, want = [], {}
    for name, stages in (("gpt2", (1, 2)), ("llama-1b", (2,))):
        model, inputs = _model(name)
        want[name] = _reference(model, inputs)
        names = [n for n, _ in model.named_parameters()]
        # Every third parameter streamed from the host, every third with its state on the host.
        tiers = {n: ((HOST, HOST), (DEVICE, HOST), (DEVICE, DEVICE))[i % 3] for i, n in enumerate(names)}
        for stage in stages:
            # the ZeRO family pinned: with free links a forced stage may store parameters sharded
            # instead (ZeRO then has nothing replicated to shard), which is not what this tests
            plan = plan_family(model, inputs, f"zero{stage}", mesh=_fast((2,)),
                               options=PlanOptions(zero_stage="auto", checkpoint="none"))
            jobs.append((name, stage, model, inputs, plan, gemini.PlannedPolicy(tiers=tiers)))
            if name == "gpt2" and stage == 2:
                jobs.append((name, stage, model, inputs, plan, StaticPolicy(
                    shard_param_frac=0.5, offload_optim_frac=1.0, offload_param_frac=0.5)))
                jobs.append((name, stage, model, inputs, plan, AutoPolicy(device_budget=AUTO_BUDGET)))
    for rank_results in run_local(_zero_chunks, 2, jobs, timeout=240):
        assert len(rank_results) == len(jobs)
        for name, stage, full, grads, shards, ledger, real, num_sharded in rank_results:
            where, name = f"{name} zero_stage={stage}", name.split()[0]
            for k, v in full.items():
                assert torch.allclose(v, want[name][0][k], rtol=1e-4, atol=1e-5), f"{where}: {k}"
            for k, v in want[name][1].items():
                assert torch.allclose(grads[k], v, rtol=1e-4, atol=1e-5), f"{where}: grad {k}"
            assert shards and {z for z, *_ in shards} == {stage}, (where, shards)
            assert num_sharded == 0, (where, num_sharded)  # shard_param_frac leaves ZeRO chunks whole
            if "AutoPolicy" not in where:  # ZeRO-Offload (the auto policy places by its warm-up)
                assert (DEVICE, HOST) in {(home, optim) for _, _, _, home, optim, *_ in shards}, where
            for _, capacity, num_shards, _, _, master, moment, grad in shards:
                piece = -(-capacity // num_shards)  # 1/dp of the chunk, padded
                assert num_shards == 2 and master == moment == piece, (where, shards)
                assert grad == (piece if stage == 2 else capacity), (where, shards)
            assert ledger == real, (where, ledger, real)
