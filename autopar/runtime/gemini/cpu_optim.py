"""Adam / AdamW on flat fp32 slices, wherever they live (host tier: the CPU optimizer).

The update is torch.optim.Adam / AdamW's single-tensor path, op for op (``_single_tensor_adam``
with ``amsgrad=False``, ``maximize=False``): the same elementwise operations in the same order,
so a chunk updated on the host equals the device update to the last bit for the same inputs.
"""

from __future__ import annotations

import math

import torch

__all__ = ["KINDS", "adam_update_"]

KINDS = ("adamw", "adam")


@torch.no_grad()
def adam_update_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                 step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                 kind: str) -> None:
    """One step on ``param`` (in place) with its moments; ``step`` counts from 1."""
    if kind == "adamw":
        param.mul_(1 - lr * weight_decay)
    elif weight_decay != 0:
        grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
