"""autopar.optim.GaLoreAdamW: the paper's projected AdamW (projector from the SVD of the full
gradient every update_proj_gap steps, on the smaller side), plain AdamW elsewhere; on DTensors
the full-tensor result with one batched all-reduce round per step and gradient all-gathers
only on projector refresh steps."""

from __future__ import annotations

import functools

import pytest
import torch

from autopar.optim import GaLoreAdamW

from .harness import SPECS_1D, SPECS_2D, all_reduces, run_distributed, run_single

SHAPES = [(7,), (8, 5), (4, 9), (6, 6), (3, 4, 5)]
KW = dict(lr=0.02, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.1, rank=2, update_proj_gap=2, scale=0.5)


def _reference(params, grads, state, t, *, lr, betas, eps, weight_decay, rank, update_proj_gap, scale):
    """Zhao et al. 2024, Algorithm 2: for a 2-D W (m x n) with G = grad, every T steps
    P = U[:, :r] (m < n: R = P^T G) or P = V[:, :r] (m >= n: R = G P), Adam on R, W -= lr *
    scale * (P N  or  N P^T); torch.optim.AdamW arithmetic; other tensors plain AdamW."""
    b1, b2 = betas
    for i, (x, g) in enumerate(zip(params, grads)):
        s = state.setdefault(i, {})
        low_rank = x.dim() == 2
        if low_rank:
            if (t - 1) % update_proj_gap == 0:
                u_, _, vh = torch.linalg.svd(g, full_matrices=False)
                s["P"] = vh[:rank].T if x.shape[0] >= x.shape[1] else u_[:, :rank]
            r = g @ s["P"] if x.shape[0] >= x.shape[1] else s["P"].T @ g
        else:
            r = g
        s["m"] = b1 * s.get("m", 0.0) + (1 - b1) * r
        s["v"] = b2 * s.get("v", 0.0) + (1 - b2) * r * r
        n = (s["m"] / (1 - b1 ** t)) / ((s["v"] / (1 - b2 ** t)).sqrt() + eps)
        x *= 1 - lr * weight_decay
        if low_rank:
            x -= lr * scale * (n @ s["P"].T if x.shape[0] >= x.shape[1] else s["P"] @ n)
        else:
            x -= lr * n


def test_matches_the_paper_on_one_device():
    run_single(lambda ps: GaLoreAdamW(ps, **KW), functools.partial(_reference, **KW), SHAPES)


def test_the_projection_is_low_rank_and_on_the_smaller_side():
    gen = torch.Generator().manual_seed(3)
    for shape, side in (((8, 5), "right"), ((4, 9), "left")):
        w0 = torch.randn(shape, generator=gen)
        p = torch.nn.Parameter(w0.clone())
        opt = GaLoreAdamW([p], lr=0.1, weight_decay=0.0, rank=2)
        p.grad = torch.randn(shape, generator=gen)
        opt.step()
        state = opt.state[p]
        assert state["right"] == (side == "right")
        assert state["exp_avg"].shape == ((shape[0], 2) if side == "right" else (2, shape[1]))
        # the step has rank r (up to the rounding of p - w0)
        assert torch.linalg.matrix_rank(p.detach() - w0, rtol=1e-4).item() == 2


def test_without_rank_it_is_torch_adamw():
    params = [torch.nn.Parameter(t) for t in (torch.randn(5, 3), torch.randn(4))]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = GaLoreAdamW(params, lr=0.01, weight_decay=0.1, rank=None)
    ref_opt = torch.optim.AdamW(ref, lr=0.01, weight_decay=0.1)
    for _ in range(5):
        for p, q in zip(params, ref):
            p.grad = torch.randn(p.shape)
            q.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
    for p, q in zip(params, ref):
        assert torch.equal(p, q)


@pytest.mark.parametrize(("mesh", "specs"), [((2,), SPECS_1D), ((2, 2), SPECS_2D)], ids=["2", "2x2"])
def test_dtensor_matches_full_tensors_with_batched_collectives(mesh, specs):
    counts = run_distributed(lambda ps: GaLoreAdamW(ps, **KW), mesh, specs)
    sharded_2d = sum(1 for shape, pl in specs if len(shape) == 2 and any(n != "R" for n in pl))
    for t, (one, two) in enumerate(counts, start=1):
        assert all_reduces(one) == all_reduces(two), (t, one, two)
        refresh = (t - 1) % KW["update_proj_gap"] == 0
        gathers = sum(v for k, v in one.items() if "all_gather" in k)
        if refresh:  # one gather (per sharded mesh dim) of each sharded matrix's gradient
            assert gathers >= sharded_2d, (t, one)
            assert sum(v for k, v in two.items() if "all_gather" in k) == 2 * gathers
        else:
            assert one == two and gathers == 0, (t, one, two)
    # one round: the projections summed over the mesh dims sharding the projected dim.
    # (2,): {0}. 2x2: {1} (6x5 S0,S1 and 7x5 R,S1: right), {0} (5x8 S0,S1: left; 8x3 S1,R:
    # right), {0,1} (4x9 S0,S0: left) -> 1 + 1 + 2 calls
    expected = 1 if mesh == (2,) else 4
    assert all(all_reduces(one) == expected for one, _ in counts), counts


@pytest.mark.parametrize(("kwargs", "echo"), [
    ({"lr": -1.0}, "-1.0"), ({"betas": (1.0, 0.9)}, "1.0"), ({"eps": -1.0}, "-1.0"),
    ({"weight_decay": -0.01}, "-0.01"), ({"rank": 0}, "0"), ({"rank": 2.5}, "2.5"),
    ({"update_proj_gap": 0}, "0"), ({"scale": 0.0}, "0.0"),
])
def test_bad_hyper_parameters_raise_value_error(kwargs, echo):
    with pytest.raises(ValueError, match=echo):
        GaLoreAdamW([torch.nn.Parameter(torch.ones(2, 2))], **kwargs)
