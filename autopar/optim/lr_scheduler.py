"""Learning-rate schedulers with the product notes' signatures (``colossalai.nn.lr_scheduler``).

Each is torch's scheduler of the same schedule, constructed from the notes' arguments, so it
steps, saves and loads (``Booster.save_lr_scheduler``) as torch's does. Only the schedules the
notes' examples use are here.
"""

from __future__ import annotations

import torch

__all__ = ["CosineAnnealingLR"]


def _steps(total_steps: int, name: str) -> int:
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"{name} must be an int >= 1, got {total_steps!r}")
    return total_steps


class CosineAnnealingLR(torch.optim.lr_scheduler.CosineAnnealingLR):
    """Cosine annealing from each group's learning rate to ``eta_min`` over ``total_steps``
    steps: ``torch.optim.lr_scheduler.CosineAnnealingLR`` with ``T_max=total_steps``."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int, eta_min: float = 0,
                 last_epoch: int = -1) -> None:
        super().__init__(optimizer, T_max=_steps(total_steps, "total_steps"), eta_min=eta_min,
                         last_epoch=last_epoch)

