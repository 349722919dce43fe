"""The vocabulary of the user-model probe (``user_models``): a case, the batch sizes, the loss
functions users write around a model's outputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

B, T, D, V = 8, 16, 32, 64  # batch, sequence, width, vocabulary: divisible by every mesh axis


@dataclass(frozen=True)
class Case:
    """``build()`` -> (model with real weights, positional inputs, targets or None);
    ``loss_fn(outputs, targets)`` -> the scalar loss, as the user's loop computes it."""
    name: str
    build: Callable[[], tuple[nn.Module, tuple, Any]]
    loss_fn: Callable[[Any, Any], torch.Tensor]


def inside(out: Any, _targets: Any) -> torch.Tensor:
    """The loss the model computed itself: the output, ``out["loss"]``, ``out.loss`` or ``out[0]``."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        return out["loss"]
    return out.loss if hasattr(out, "loss") else out[0]


def ids(n: int = V, shape: tuple = (B, T)) -> torch.Tensor:
    return torch.randint(0, n, shape)


def tag_loss(out, targets):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))


def mse(out, targets):
    return F.mse_loss(out, targets)


def ce(out, targets):
    return F.cross_entropy(out, targets)
