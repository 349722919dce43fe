"""autopar.optim.CAME: the paper's Algorithm 1 (written here with sums, as in the paper; the
optimizer uses came_pytorch's means, the same numbers), and on DTensors the full-tensor
result in three batched rounds of all-reduces per step."""

from __future__ import annotations

import functools

import pytest
import torch

from autopar.optim import CAME

from .harness import SPECS_1D, SPECS_2D, all_reduces, run_distributed, run_single

SHAPES = [(7,), (5, 6), (3, 4, 5), (2, 3, 4, 2), (1,)]
CASES = {
    "defaults-with-decay": dict(lr=1e-2, weight_decay=0.1),
    "large-eps-clip": dict(lr=3e-2, eps=(1e-3, 1e-4), clip_threshold=0.5, betas=(0.8, 0.9, 0.95),
                           weight_decay=0.01),
}


def _algorithm_1(params, grads, state, t, *, lr, eps=(1e-30, 1e-16), clip_threshold=1.0,
                 betas=(0.9, 0.999, 0.9999), weight_decay=0.0):
    """Luo et al. 2023, Algorithm 1 (row/column SUMS r, c normalised by 1^T r), 1-D parameters
    unfactored and without the confidence term; decay p -= lr * wd * p as came_pytorch."""
    b1, b2, b3 = betas
    e1, e2 = eps
    for i, (x, g) in enumerate(zip(params, grads)):
        s = state.setdefault(i, {"m": torch.zeros_like(x)})
        sq = g * g + e1
        if x.dim() >= 2:
            s["r"] = b2 * s.get("r", 0.0) + (1 - b2) * sq.sum(dim=-1, keepdim=True)
            s["c"] = b2 * s.get("c", 0.0) + (1 - b2) * sq.sum(dim=-2, keepdim=True)
            v = s["r"] * s["c"] / s["r"].sum(dim=-2, keepdim=True)
        else:
            s["v"] = v = b2 * s.get("v", 0.0) + (1 - b2) * sq
        u = g / v.sqrt()
        u = u / max(1.0, (u.square().mean() ** 0.5).item() / clip_threshold)
        s["m"] = b1 * s["m"] + (1 - b1) * u
        if x.dim() >= 2:
            instability = (u - s["m"]) ** 2 + e2
            s["R"] = b3 * s.get("R", 0.0) + (1 - b3) * instability.sum(dim=-1, keepdim=True)
            s["C"] = b3 * s.get("C", 0.0) + (1 - b3) * instability.sum(dim=-2, keepdim=True)
            confidence = s["R"] * s["C"] / s["R"].sum(dim=-2, keepdim=True)
            step = s["m"] / confidence.sqrt()
        else:
            step = s["m"]
        x -= lr * weight_decay * x
        x -= lr * step


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_algorithm_1_on_one_device(name):
    kw = CASES[name]
    run_single(lambda ps: CAME(ps, **kw), functools.partial(_algorithm_1, **kw), SHAPES)


@pytest.mark.parametrize(("mesh", "specs"), [((2,), SPECS_1D), ((2, 2), SPECS_2D)], ids=["2", "2x2"])
def test_dtensor_matches_full_tensors_with_batched_collectives(mesh, specs):
    kw = CASES["defaults-with-decay"]
    counts = run_distributed(lambda ps: CAME(ps, **kw), mesh, specs)
    for one, two in counts:
        assert one == two, (one, two)  # twice the parameters, the same collectives
        assert set(one) == {"c10d.allreduce_"}
    # three rounds (g*g rows/cols with the sums for mean(R); RMS(u); the same for the
    # instability), each one all_reduce per mesh dim of each distinct set of mesh dims:
    # (2,): 3. 2x2: {0,1} {0} {1} in every round (4 calls each)
    expected = 3 if mesh == (2,) else 12
    assert all(all_reduces(one) == expected for one, _ in counts), counts


@pytest.mark.parametrize(("kwargs", "echo"), [
    ({"lr": 0.0}, "0.0"), ({"eps": (-1.0, 1e-16)}, "-1.0"), ({"eps": 1e-30}, "1e-30"),
    ({"clip_threshold": -1.0}, "-1.0"), ({"betas": (0.9, 0.999)}, r"\(0.9, 0.999\)"),
    ({"betas": (0.9, 0.999, 1.5)}, "1.5"), ({"weight_decay": -0.5}, "-0.5"),
])
def test_bad_hyper_parameters_raise_value_error(kwargs, echo):
    with pytest.raises(ValueError, match=echo):
        CAME([torch.nn.Parameter(torch.ones(2))], **kwargs)
