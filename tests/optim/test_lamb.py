"""autopar.optim.Lamb: the paper's update on full tensors; on DTensors of any Shard/Replicate
placements the same result with one batched all-reduce round per step."""

from __future__ import annotations

import functools

import pytest
import torch

from autopar.optim import Lamb

from .harness import SPECS_1D, SPECS_2D, all_reduces, run_distributed, run_single

SHAPES = [(7,), (5, 6), (3, 4, 5), (1,)]
KW = dict(lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)


def _reference(params, grads, state, t, *, lr, betas, eps, weight_decay, clamp_value=10.0,
               bias_correction=True):
    """You et al. 2019, Algorithm 2, per layer: Adam direction plus decoupled decay, scaled by
    phi(||x||) / ||r + lambda x||."""
    b1, b2 = betas
    for i, (x, g) in enumerate(zip(params, grads)):
        m, v = state.setdefault(i, (torch.zeros_like(x), torch.zeros_like(x)))
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        state[i] = (m, v)
        mh, vh = (m / (1 - b1 ** t), v / (1 - b2 ** t)) if bias_correction else (m, v)
        r = mh / (vh.sqrt() + eps) + weight_decay * x
        phi = x.norm().item() if clamp_value is None else min(x.norm().item(), clamp_value)
        ratio = phi / r.norm().item() if phi > 0 and r.norm().item() > 0 else 1.0
        x -= lr * ratio * r


@pytest.mark.parametrize("extra", [{}, {"clamp_value": None, "bias_correction": False}, {"clamp_value": 0.5}],
                         ids=["default", "no-clamp-no-bias-correction", "tight-clamp"])
def test_matches_the_paper_on_one_device(extra):
    kw = {**KW, **extra}
    run_single(lambda ps: Lamb(ps, **kw), functools.partial(_reference, **kw), SHAPES)


def test_zero_parameter_gets_trust_ratio_one():
    p = torch.nn.Parameter(torch.zeros(3, 2))
    p.grad = torch.ones(3, 2)
    Lamb([p], lr=0.1).step()
    # Adam's first step is -lr * sign(g) (up to eps) and ||p|| = 0 leaves it unscaled
    torch.testing.assert_close(p.detach(), torch.full((3, 2), -0.1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("mesh", "specs"), [((2,), SPECS_1D), ((2, 2), SPECS_2D)], ids=["2", "2x2"])
def test_dtensor_matches_full_tensors_with_batched_collectives(mesh, specs):
    counts = run_distributed(lambda ps: Lamb(ps, **KW), mesh, specs)
    for one, two in counts:
        assert one == two, (one, two)  # twice the parameters, the same collectives
        assert set(one) == {"c10d.allreduce_"}
    # one round; one all_reduce per mesh dim of each distinct set of sharded mesh dims
    expected = 1 if mesh == (2,) else 4  # 2x2: {0,1} twice (one per mesh dim), {1}, {0}
    assert all(all_reduces(one) == expected for one, _ in counts), counts


@pytest.mark.parametrize(("kwargs", "echo"), [
    ({"lr": -1.0}, "-1.0"), ({"betas": (0.9, 1.0)}, "1.0"), ({"betas": (0.9,)}, "(0.9,)"),
    ({"eps": -1e-8}, "-1e-08"), ({"weight_decay": -0.1}, "-0.1"), ({"clamp_value": 0.0}, "0.0"),
])
def test_bad_hyper_parameters_raise_value_error(kwargs, echo):
    with pytest.raises(ValueError, match=f".*{echo}".replace("(", r"\(").replace(")", r"\)")):
        Lamb([torch.nn.Parameter(torch.ones(2))], **kwargs)
