"""The product notes' ``FP16TorchMixedPrecision``: torch AMP's loss-scaler settings as one record,
given to ``Booster(mixed_precision=...)`` in place of the string ``"fp16"``.

With a torch plugin (``TorchDDPPlugin``, ``TorchFSDPPlugin``) the forward and the criterion run
under ``torch.autocast(float16)`` and the optimizer owns an ``autopar.GradScaler`` of these
settings; with a planned plugin (``AutoParallelPlugin`` and its restrictions) they are the
plugin's ``precision="fp16"`` and its ``initial_scale``, ``growth_factor``, ``backoff_factor``
and ``growth_interval``.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.planner.options import check_count, check_number

__all__ = ["FP16TorchMixedPrecision"]


@dataclass(frozen=True, slots=True)
class FP16TorchMixedPrecision:
    """fp16 autocast with a dynamic loss scale (``torch.amp.GradScaler``'s meanings): the scale
    starts at ``init_scale``, is multiplied by ``backoff_factor`` after a step whose gradients
    overflowed (that step is skipped) and by ``growth_factor`` after ``growth_interval`` steps
    without overflow."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        check_number(self.init_scale, name="init_scale", low=0, low_open=True, what="> 0")
        check_number(self.growth_factor, name="growth_factor", low=1, low_open=True, what="> 1")
        check_number(self.backoff_factor, name="backoff_factor", low=0, high=1, low_open=True, high_open=True,
                     what="in (0, 1)")
        check_count(self.growth_interval, name="growth_interval")

    def scaler_kwargs(self) -> dict[str, float]:
        """``autopar.GradScaler``'s keyword arguments."""
        return {"init_scale": self.init_scale, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval}
