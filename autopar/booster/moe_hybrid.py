"""``MoeHybridParallelPlugin``: ``HybridParallelPlugin`` with expert parallelism (``ep_size``).

The name and the ``ep_size`` argument are those of the product's later releases: the hybrid
plugin's TP x PP x DP mesh (``autopar.booster.hybrid``), where the data-parallel axis is also the
expert-parallel one -- each MoE block's experts (``autopar::moe_experts``) split by expert over
it, every (token, expert) pair sent to its expert's rank by all-to-all and back
(``strategies/_experts.py``) -- as a restricted plan of autopar's planner: the ``ep`` families of
``autopar.planner.baselines`` with the degree pinned by ``ep_size`` (``autopar.planner.pins``).
"""

from __future__ import annotations

from typing import Any

from autopar.booster.hybrid import HybridParallelPlugin
from autopar.planner.options import check_count

__all__ = ["MoeHybridParallelPlugin"]


class MoeHybridParallelPlugin(HybridParallelPlugin):
    """Tensor x pipeline x data x expert parallelism.

    Args:
        tp_size, pp_size: as ``HybridParallelPlugin``'s (the mesh (pp, dp, tp)).
        ep_size: the experts of every MoE block split this many ways over the data-parallel
            ranks, tokens dispatched to them by all-to-all (no capacity limit: nothing is dropped,
            so training equals one device's). 1: experts whole on every rank. Expert parallelism
            over part of the data-parallel ranks (``ep_size`` between 1 and
            ``world / (tp_size * pp_size)``) raises ``NotImplementedError``.
        *args, **kwargs: ``HybridParallelPlugin``'s other arguments, in its order after ``pp_size``,
            its sequence parallelism included (``enable_sequence_parallelism=True, sp_size=...,
            sequence_parallelism_mode=...``, the later releases' keywords: the sp axis comes after
            tp, and the data-parallel -- expert-parallel -- size is ``world / (pp * tp * sp)``).
    """

    def __init__(self, tp_size: int, pp_size: int, ep_size: int = 1, *args: Any, **kwargs: Any) -> None:
        check_count(ep_size, name="ep_size")
        object.__setattr__(self, "ep_size", None if ep_size == 1 else ep_size)  # read by layout() below
        super().__init__(tp_size, pp_size, *args, **kwargs)
        object.__setattr__(self, "ep_size", None if ep_size == 1 else ep_size)  # the dataclass init reset it

    def __repr__(self) -> str:
        return (f"MoeHybridParallelPlugin(tp_size={self.tp_size}, pp_size={self.hybrid_pp_size}, "
                f"ep_size={self.ep_size or 1}, zero_stage={self.zero_stage}, precision={self.precision!r})")

    def layout(self, world: int):
        """``HybridParallelPlugin.layout`` with the data-parallel axis an expert-parallel one;
        ``ep_size`` must be 1 or the data-parallel size."""
        layout = super().layout(world)
        dp = world // (self.tp_size * self.hybrid_pp_size * self.hybrid_sp_size)
        if self.ep_size is not None and self.ep_size != dp:
            raise NotImplementedError(
                f"ep_size={self.ep_size}: expert parallelism over part of the {dp} data-parallel ranks is not "
                f"planned yet; use ep_size={dp} (every data-parallel rank) or 1")
        return layout
