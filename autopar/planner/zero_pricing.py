"""ZeRO pricing of one parameter layout: bytes held and communication per step by stage."""

from __future__ import annotations

import math

from autopar.layout.cost import collective_seconds
from autopar.layout.mesh import MeshSpec
from autopar.layout.placement import TensorSpec, zero_split
from autopar.strategies import Strategy

__all__ = ["zero_cost", "zero2_extra_s"]


def zero_cost(spec: TensorSpec, mesh: MeshSpec, local_bytes: int, *, stage: int, ndim: int,
              optimizer_multiplier: float) -> tuple[float, float, int]:
    """(bytes held per parameter byte, extra communication seconds per step, effective stage) of a
    trainable ``ndim``-dim parameter laid out ``spec`` under ZeRO ``stage`` over the axes ``spec``
    replicates it on (``layout.placement.zero_split``; ``dp``: their size product; none: stage 0).

    ====== ===================================== =====================================================
    stage  held: parameter + gradient + state    communication beyond stage 0
    ====== ===================================== =====================================================
    0      ``2 + m``                             --
    1      ``2 + m/dp``                          all-gather of the updated parameter
    2      ``1 + (1 + m)/dp``                    the same all-gather; a consumer's partial gradient
                                                 is reduce-scattered instead of all-reduced
                                                 (``zero2_extra_s``: the consumer is priced with
                                                 the reduce-scatter, its edge with the difference
                                                 unless the parameter is ZeRO-2 in that layout)
    ====== ===================================== =====================================================

    A mixed-precision cast between the parameter and its consumer hides the consumer from the
    parameter's edges: there stage 2 is priced with the full all-reduce (an over-estimate).
    """
    split = zero_split(spec, ndim, mesh.shape)
    m = optimizer_multiplier
    if stage == 0 or split is None:
        return 2.0 + m, 0.0, 0
    axes = split[1]
    dp = math.prod(mesh.shape[a] for a in axes)
    gather_s = collective_seconds("all_gather", local_bytes, mesh, axes)
    if stage == 1:
        return 2.0 + m / dp, gather_s, 1
    return 1.0 + (1.0 + m) / dp, gather_s, 2


def zero2_extra_s(strategy: Strategy, slot: int, mesh: MeshSpec) -> float:
    """Seconds an all-reduce of input ``slot``'s partial gradient takes beyond a reduce-scatter
    of it (0 when the gradient is not partial): what ZeRO-2 saves on a parameter read there."""
    # A difference, yet never below 0: the all-reduce's bandwidth term is exactly twice the
    # reduce-scatter's (same bytes, same alpha), and rounding is monotone, so AR >= RS as floats.
    return strategy.grad_sync_s(slot, mesh) - strategy.grad_sync_s(slot, mesh, "reduce_scatter")
