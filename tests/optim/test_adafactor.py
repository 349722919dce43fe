"""autopar.optim.Adafactor: torch.optim.Adafactor's algorithm (matched against torch itself and
against the equations written out here), and on DTensors the full-tensor result in two
batched rounds of all-reduces per step."""

from __future__ import annotations

import functools

import pytest
import torch

from autopar.optim import Adafactor

from .harness import SPECS_1D, SPECS_2D, all_reduces, run_distributed, run_single

SHAPES = [(7,), (5, 6), (3, 4, 5), (2, 3, 4, 2), ()]
CASES = {
    "weight-decay": dict(weight_decay=0.1),
    "large-lr-clip": dict(lr=0.5, weight_decay=0.01, d=1.5, eps=(1e-3, 1e-2)),
    "maximize": dict(maximize=True, beta2_decay=-0.5, weight_decay=0.05),
}


def _torch_step(kw):
    """torch.optim.Adafactor (single-tensor path) as a reference step on plain tensors."""
    def step(params, grads, state, t):
        if "opt" not in state:
            state["params"] = [torch.nn.Parameter(p.clone()) for p in params]
            state["opt"] = torch.optim.Adafactor(state["params"], **kw)
        for p, g in zip(state["params"], grads):
            p.grad = g.clone()
        state["opt"].step()
        for x, p in zip(params, state["params"]):
            x.copy_(p.detach())
    return step


def _equations(params, grads, state, t, *, lr=1e-2, beta2_decay=-0.8, eps=(None, 1e-3), d=1.0,
               weight_decay=0.0, maximize=False):
    """Shazeer & Stern 2018 (Algorithms 4/5) with torch's conventions: relative step
    min(lr, 1/sqrt(t)), parameter scale max(eps2, RMS(x)), means over the last two dims,
    eps1 at the variance estimate, lr-scaled decoupled decay."""
    beta2 = 1 - t ** beta2_decay
    rho = min(lr, t ** -0.5)
    eps1 = torch.finfo(torch.float32).eps if eps[0] is None else eps[0]
    for i, (x, g) in enumerate(zip(params, grads)):
        g = -g if maximize else g
        alpha = max(eps[1], (x.square().mean() ** 0.5).item()) * rho
        x *= 1 - lr * weight_decay
        if x.dim() >= 2:
            r, c = state.get(i, (0.0, 0.0))
            r = beta2 * r + (1 - beta2) * (g * g).mean(dim=-1, keepdim=True)
            c = beta2 * c + (1 - beta2) * (g * g).mean(dim=-2, keepdim=True)
            state[i] = (r, c)
            v = r * c / r.mean(dim=-2, keepdim=True).clamp(min=eps1)
        else:
            v = beta2 * state.get(i, 0.0) + (1 - beta2) * g * g
            state[i] = v
        u = g / v.clamp(min=eps1 * eps1).sqrt()
        x -= alpha / max(1.0, (u.square().mean() ** 0.5).item() / d) * u


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_torch_adafactor(name):
    kw = CASES[name]
    run_single(lambda ps: Adafactor(ps, **kw), _torch_step(kw), SHAPES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_the_equations(name):
    kw = CASES[name]
    run_single(lambda ps: Adafactor(ps, **kw), functools.partial(_equations, **kw), SHAPES)


@pytest.mark.parametrize(("mesh", "specs"), [((2,), SPECS_1D), ((2, 2), SPECS_2D)], ids=["2", "2x2"])
def test_dtensor_matches_full_tensors_with_batched_collectives(mesh, specs):
    kw = CASES["weight-decay"]
    counts = run_distributed(lambda ps: Adafactor(ps, **kw), mesh, specs)
    for one, two in counts:
        assert one == two, (one, two)  # twice the parameters, the same collectives
        assert set(one) == {"c10d.allreduce_"}
    # two rounds: (||p||, rows, cols, the sums for mean_{-2}(R)), RMS(U); each one all_reduce
    # per mesh dim of each distinct set of mesh dims it sums over. 2x2: {0,1} {0} {1} in both
    # rounds (4 calls each)
    expected = 2 if mesh == (2,) else 8
    assert all(all_reduces(one) == expected for one, _ in counts), counts


@pytest.mark.parametrize(("kwargs", "echo"), [
    ({"lr": -0.1}, "-0.1"), ({"beta2_decay": 0.5}, "0.5"), ({"eps": (-1.0, 1e-3)}, "-1.0"),
    ({"eps": (None, -2.0)}, "-2.0"), ({"eps": 1e-3}, "0.001"), ({"d": 0.5}, "0.5"),
    ({"weight_decay": -3.0}, "-3.0"),
])
def test_bad_hyper_parameters_raise_value_error(kwargs, echo):
    with pytest.raises(ValueError, match=echo.replace("(", r"\(").replace(".", r"\.")):
        Adafactor([torch.nn.Parameter(torch.ones(2))], **kwargs)
