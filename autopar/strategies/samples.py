"""Helpers for rule samples (concrete inputs of the numerical check): small float64 tensors.

Sizes should divide by 4 (and by 2x2) wherever a rule shards, so that every strategy of the rule
is exercised on meshes (4,) and (2, 2); use size 1 for broadcast dims.
"""

from __future__ import annotations

import torch

__all__ = ["rand", "ints", "randbool"]

_GEN = torch.Generator().manual_seed(1234)


def rand(*shape: int, positive: bool = False) -> torch.Tensor:
    t = torch.randn(shape, dtype=torch.float64, generator=_GEN)
    return t.abs() + 0.5 if positive else t


def ints(high: int, *shape: int, low: int = 0) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=_GEN)


def randbool(*shape: int) -> torch.Tensor:
    return torch.rand(shape, generator=_GEN) > 0.5
