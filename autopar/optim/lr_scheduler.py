"""Learning-rate schedulers with the product notes' signatures (``colossalai.nn.lr_scheduler``).

Each is torch's scheduler of the same schedule, constructed from the notes' arguments, so it
steps, saves and loads (``Booster.save_lr_scheduler``) as torch's does. Only the schedules the
notes' examples use are here.
"""

from __future__ import annotations

import torch

__all__ = ["CosineAnnealingLR", "LinearWarmupLR"]


def _steps(total_steps: int, name: str, *, least: int = 1) -> int:
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < least:
        raise ValueError(f"{name} must be an int >= {least}, got {total_steps!r}")
    return total_steps


class CosineAnnealingLR(torch.optim.lr_scheduler.CosineAnnealingLR):
    """Cosine annealing from each group's learning rate to ``eta_min`` over ``total_steps``
    steps: ``torch.optim.lr_scheduler.CosineAnnealingLR`` with ``T_max=total_steps``."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int, eta_min: float = 0,
                 last_epoch: int = -1) -> None:
        super().__init__(optimizer, T_max=_steps(total_steps, "total_steps"), eta_min=eta_min,
                         last_epoch=last_epoch)



class LinearWarmupLR(torch.optim.lr_scheduler.LRScheduler):
    """Linear warm-up to each group's learning rate, then linear decay to 0 at ``total_steps``
    (Colossal-AI's ``colossalai.nn.lr_scheduler.LinearWarmupLR``): after ``step()`` has been
    called ``e`` times the rate is ``lr * (e + 1) / (warmup_steps + 1)`` while ``e <
    warmup_steps``, then ``lr * (total_steps - e) / (total_steps - warmup_steps)``.

    Two departures, both where Colossal-AI's formula stops being a schedule: past
    ``total_steps`` the rate stays 0 (the formula goes negative, which would step uphill), and
    when ``total_steps <= warmup_steps`` (the notes' AMP example: ``warmup_steps=50,
    total_steps=NUM_EPOCHS``) the decay has no room, so the rate is 0 once warm-up ends
    (the formula divides by zero or grows). Warm-up itself is Colossal-AI's in every case.
    Extra keyword arguments are accepted and ignored, as Colossal-AI's ``**kwargs``."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0,
                 last_epoch: int = -1, **kwargs) -> None:
        self.total_steps = _steps(total_steps, "total_steps")
        self.warmup_steps = _steps(warmup_steps, "warmup_steps", least=0)
        super().__init__(optimizer, last_epoch=last_epoch)

    def _factor(self, epoch: int) -> float:
        if epoch < self.warmup_steps:
            return (epoch + 1) / (self.warmup_steps + 1)
        if epoch >= self.total_steps:
            return 0.0
        return (self.total_steps - epoch) / (self.total_steps - self.warmup_steps)

    def get_lr(self) -> list[float]:
        # Closed form from the base rates (as Colossal-AI's), not chained from the last step's.
        return [self._factor(self.last_epoch) * lr for lr in self.base_lrs]

    _get_closed_form_lr = get_lr
