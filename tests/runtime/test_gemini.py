"""Gemini-style chunk runtime (autopar.runtime.gemini): chunks, tiers, exact accounting, CPU Adam.

Multi-process: GPT-2 tiny and Llama tiny on meshes (2,) and (2, 2) (gloo, fork). One module per
model and mesh is wrapped once and re-placed for every (offload_optim_frac, offload_param_frac)
case; per case, 5 AdamW steps must equal single-device training (rtol 1e-4), and the device-tier
bytes after every chunk move stay within a budget that forces evictions.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import autopar
from autopar import zoo
from autopar.api import plan_model
from autopar.planner.options import PlanOptions
from autopar.runtime import gemini
from autopar.runtime.gemini.chunk import DEVICE, HOST, pack, search_chunk_size
from autopar.runtime.gemini.cpu_optim import adam_update_
from autopar.runtime.gemini.policies import AutoPolicy, StaticPolicy, auto_tiers, make_policy, static_tiers
from autopar.runtime.launch import run_local

STEPS, EPS, LR = 5, 1e-5, 1e-3
CASES = tuple((o, p) for o in (0.5, 1.0) for p in (0.0, 0.5, 1.0))
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
    payload, optim = [100, 100, 100], [300, 300, 300]
    # 1000 B budget, 300 B non-model, 100 B kept free for a fetch: 600 B -> 3 payloads + 1 optimizer state
    tiers = auto_tiers(payload, optim, budget=1000, non_model_peak=300, order=[2, 0, 1])
    assert tiers == [(DEVICE, HOST), (DEVICE, HOST), (DEVICE, DEVICE)]
    assert auto_tiers(payload, optim, budget=300, non_model_peak=300, order=[]) == [(HOST, HOST)] * 3


def test_policies_are_checked():
    with pytest.raises(ValueError, match="shard_param_frac"):
        StaticPolicy(shard_param_frac=0.5)
    with pytest.raises(ValueError, match=r"offload_optim_frac must be a number in \[0, 1\], got 1.5"):
        StaticPolicy(offload_optim_frac=1.5)
    with pytest.raises(ValueError, match="device_budget"):
        AutoPolicy(device_budget=None)
    with pytest.raises(ValueError, match="placement_policy"):
        make_policy("cuda")
    assert make_policy("auto", device_budget=10, offload_optim_frac=0.5) == AutoPolicy(device_budget=10)


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
    return {k: v.detach() for k, v in m.state_dict().items()}


def _train_cases(rank, world, jobs):
    out = []
    for name, model, inputs, plan in jobs:
        pm = autopar.autoparallelize(copy.deepcopy(model), inputs, plan=plan, init_weights=False)
        pm, _ = gemini.wrap(pm, torch.optim.AdamW, dict(lr=LR, eps=EPS), chunk_range=RANGE)
        g = pm.gemini
        chunk_bytes = max(c.payload_bytes for c in g.manager.chunks)
        for optim_frac, param_frac in CASES:
            g.apply_policy(StaticPolicy(offload_optim_frac=optim_frac, offload_param_frac=param_frac))
            # Room for the device-home chunks, their gradient chunks and 3 fetched chunks.
            budget = (g.manager.ledger.bytes[DEVICE] + 3 * chunk_bytes
                      + sum(c.grad_bytes for c in g.manager.chunks if c.home == DEVICE))
            g.set_device_budget(budget)
            pm.load_full_state_dict(model.state_dict())
            g.reload_masters()
            opt = g.optimizer(torch.optim.AdamW, dict(lr=LR, eps=EPS))
            start = len(g.manager.ledger.log)
            for _ in range(STEPS):
                pm(**inputs).loss.backward()
                opt.step()
                opt.zero_grad()
            moves = g.manager.ledger.log[start:]
            host_chunks = sum(c.home == HOST for c in g.manager.chunks)
            out.append((name, optim_frac, param_frac, pm.full_state_dict(), budget,
                        max(m.device_bytes for m in moves), sum(m.event == "evict" for m in moves), host_chunks,
                        len(g.manager.chunks), g.manager.ledger.bytes.copy(), _expected_bytes(g.manager)))
    return out


def _expected_bytes(manager) -> dict:
    """Each tier's bytes as the buffers that exist say, each storage once (an fp32 master on the
    payload's tier is the payload): the ledger must agree."""
    out, seen = {DEVICE: 0, HOST: 0}, set()
    for c in manager.chunks:
        home = c.host_buf if c.home == HOST else c.device_buf
        owned = [(c.home, home), (c.home, c.grad)] + [(c.optim_tier, getattr(c, k)) for k in
                                                      ("master", "exp_avg", "exp_avg_sq", "landing")]
        if c.home == HOST:
            owned.append((DEVICE, c.device_buf))
        for tier, t in owned:
            if t is not None and t.untyped_storage().data_ptr() not in seen:
                if t.untyped_storage().nbytes():
                    seen.add(t.untyped_storage().data_ptr())
                out[tier] += t.untyped_storage().nbytes()
    return out


@pytest.mark.parametrize("mesh", [(2,), (2, 2)])
def test_offload_trains_like_one_device_within_the_device_budget(mesh):
    jobs, want = [], {}
    for name in ("gpt2", "llama-1b"):
        model, inputs = _model(name)
        want[name] = _reference(model, inputs)
        plan = plan_model(model, inputs, mesh=mesh, options=PlanOptions(zero_stage=0, checkpoint="none")).plan
        jobs.append((name, model, inputs, plan))
    results = run_local(_train_cases, math.prod(mesh), jobs, timeout=240)
    for rank_results in results:
        assert len(rank_results) == 2 * len(CASES)
        for name, o, p, full, budget, max_dev, evictions, host_chunks, num_chunks, ledger, real in rank_results:
            where = f"{name} {mesh} optim={o} param={p}"
            for k, v in full.items():
                assert torch.allclose(v, want[name][k], rtol=1e-4, atol=1e-5), f"{where}: {k}"
            assert max_dev <= budget, (where, max_dev, budget)
            assert ledger == real, (where, ledger, real)
            assert num_chunks >= 3, (where, num_chunks)
            if p == 0.0:
                assert host_chunks == 0, where
            elif host_chunks > 3:  # more host chunks than the budget's room: some had to go
                assert evictions > 0, (where, evictions)
            if p == 1.0:
                assert host_chunks == num_chunks, where


AUTO_BUDGET = 1_300_000


def _auto_and_planned(rank, world, model, inputs, plan, tiers):
    out = {}
    for what in ("auto", "planned"):
        pm = autopar.autoparallelize(copy.deepcopy(model), inputs, plan=plan, init_weights=False)
        pm.load_full_state_dict(model.state_dict())
        if what == "auto":  # GPT-2 tiny: 12 chunks of 64 KiB, ~0.86 MB non-model: room for about half
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
    want = _reference(model, inputs)
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
