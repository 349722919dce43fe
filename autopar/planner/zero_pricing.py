"""ZeRO pricing of one parameter layout: bytes held and communication per step by stage."""

from __future__ import annotations

import math
from typing import Iterable

from autopar.layout.buckets import bucket_cap_bytes
from autopar.layout.cost import collective_seconds, compute_seconds, copy_seconds, optimizer_seconds
from autopar.layout.mesh import MeshSpec
from autopar.layout.placement import TensorSpec, zero_split
from autopar.strategies import Strategy
from autopar.strategies.grad_sums import grad_sync_seconds

__all__ = ["ZERO2_PIECE_OPS", "zero_cost", "zero_gather_cap", "zero_gather_seconds", "zero2_copy_seconds",
           "zero2_extra_s", "zero2_priced_rs"]


def zero_gather_cap(params: Iterable) -> int:
    """Bytes per ZeRO all-gather bucket as priced for a model with placeholders ``params``
    (``tracer.graph.Placeholder``): the runtime's cap (``layout.buckets.bucket_cap_bytes``; 0:
    one collective per piece), or the model's trainable parameter bytes where they are fewer --
    then every piece fits one collective per axis, which pays a whole latency, and each piece's
    share is of the bytes there are to gather, not of a cap no bucket reaches."""
    cap = bucket_cap_bytes()
    total = sum(p.numel * p.dtype.itemsize for p in params if p.requires_grad)
    return min(cap, total) if cap else 0


def zero_gather_seconds(local_bytes: float, mesh: MeshSpec, axes: tuple[int, ...], *, cap: int) -> float:
    """ZeRO's all-gather of a parameter's ``local_bytes`` over its ZeRO ``axes`` after the step,
    as ``runtime.zero.comm.GatherPlan`` runs it: one collective per axis, from the last to the
    first, each gathering the block the axes before it leave (``local_bytes`` over their sizes);
    pieces share a collective up to ``cap`` gathered bytes (``layout.buckets``: the gradient
    buckets' cap; 0: one each), so a piece pays its share of a bucket's latency
    (``collective_seconds``' ``bucket_cap``); and the copies around it: this device's piece
    into the send buffer, its peers' pieces out of the receive buffer into the parameter --
    ``local_bytes`` read and written in all. Synchronous: the runtime waits for it in ``step``."""
    seconds, block = copy_seconds(local_bytes, mesh), float(local_bytes)
    for a in axes:
        seconds += collective_seconds("all_gather", block, mesh, a, bucket_cap=cap)
        block /= mesh.shape[a]
    return seconds


# Tensor ops a ZeRO-2 piece's gradient runs each step beyond a data-parallel slot's one copy:
# as_strided, narrow and unflatten into the send buffer, the slice and view of its summed piece.
ZERO2_PIECE_OPS = 5


def zero2_copy_seconds(local_bytes: float, mesh: MeshSpec, axes: tuple[int, ...], *, fresh: float = 1.0) -> float:
    """What ZeRO-2's gradient path costs a parameter of ``local_bytes`` beyond data parallelism's
    bucket, as ``runtime.zero.comm.ScatterPlan`` runs it: where the links price the all-reduce of
    a gradient bucket (``layout.buckets``' cap) below its reduce-scatter over the first ZeRO axis
    (the runtime's choice, ``_all_reduce_cheaper``), this device's summed piece is copied out of
    it (``local_bytes / dp``); and the ``fresh`` share of its send buffer is new memory every
    step -- page faults on a CPU host, priced as one write of those bytes (a data-parallel bucket
    is kept). The send buffers borrow the gather's receive buffer (``runtime.zero.comm.Scratch``,
    at most the buckets' cap): ``zero_cost`` prices none fresh where the model's trainable bytes
    fit it (``zero_gather_cap`` below the cap), all of them otherwise (an over-estimate by the
    cap's share). Measured on 4 gloo ranks (GPT-2-style decoder, session 23):
    1,400 page faults a step a rank when every send buffer was fresh, none in data parallelism.
    And the piece's own small ops each step, ``ZERO2_PIECE_OPS`` beyond a bucket slot's one copy
    (its views into the send and receive buffers), each at least a kernel's floor
    (``compute_seconds`` of nothing: the calibrated ``kernel_floor_s``)."""
    if not axes or not local_bytes:
        return 0.0
    seconds = fresh * local_bytes / mesh.mem_bandwidth + ZERO2_PIECE_OPS * compute_seconds(0.0, 0.0, mesh)
    first, bucket = axes[0], bucket_cap_bytes() or local_bytes
    if collective_seconds("all_reduce", bucket, mesh, first) < collective_seconds("reduce_scatter", bucket, mesh,
                                                                                  first):
        seconds += copy_seconds(local_bytes / math.prod(mesh.shape[a] for a in axes), mesh)
    return seconds


def zero_cost(spec: TensorSpec, mesh: MeshSpec, local_bytes: int, *, stage: int, ndim: int,
              optimizer_multiplier: float, gather_cap: int | None = None,
              trainable: bool = True) -> tuple[float, float, int, float]:
    """(bytes held per parameter byte, extra communication seconds per step, effective stage,
    optimizer step seconds) of an ``ndim``-dim parameter laid out ``spec`` under ZeRO ``stage``
    over the axes ``spec`` replicates it on (``layout.placement.zero_split``; ``dp``: their size
    product; none: stage 0). A frozen parameter (``trainable=False``) is stage 0 and not stepped;
    a trainable one's step updates its ``local_bytes``, a ZeRO rank's ``1/dp`` of them
    (``layout.cost.optimizer_seconds``). The all-gather after the step is ``zero_gather_seconds``
    with buckets of ``gather_cap`` bytes (None: ``layout.buckets.bucket_cap_bytes()``, the cap
    ``runtime.zero.ZeroOptimizer`` gathers with -- also where gradients are summed in-graph, as
    in a pipeline stage's problem).

    ====== ===================================== =====================================================
    stage  held: parameter + gradient + state    communication beyond stage 0
    ====== ===================================== =====================================================
    0      ``2 + m``                             --
    1      ``2 + m/dp``                          all-gather of the updated parameter
    2      ``1 + (1 + m)/dp``                    the same all-gather and ``zero2_copy_seconds``; a
                                                 consumer's partial gradient is reduce-scattered
                                                 instead of all-reduced
                                                 (the consumer is priced with the cheaper of
                                                 reduce-scatter and all-reduce, its edge with what
                                                 the runtime's sum costs beyond: ``zero2_extra_s``)
    ====== ===================================== =====================================================

    A mixed-precision cast between the parameter and its consumer hides the consumer from the
    parameter's edges: there stage 2 is priced with the full all-reduce (an over-estimate).
    """
    split = zero_split(spec, ndim, mesh.shape) if trainable else None
    m = optimizer_multiplier
    if stage == 0 or split is None:
        step_s = optimizer_seconds(local_bytes, mesh, optimizer_multiplier=m) if trainable else 0.0
        return 2.0 + m, 0.0, 0, step_s
    axes = split[1]
    dp = math.prod(mesh.shape[a] for a in axes)
    cap = bucket_cap_bytes() if gather_cap is None else gather_cap
    gather_s = zero_gather_seconds(local_bytes, mesh, axes, cap=cap)
    step_s = optimizer_seconds(local_bytes / dp, mesh, optimizer_multiplier=m)
    if stage == 1:
        return 2.0 + m / dp, gather_s, 1, step_s
    fresh = 0.0 if 0 < cap < bucket_cap_bytes() else 1.0  # (the whole model fits the borrowed buffer)
    return 1.0 + (1.0 + m) / dp, gather_s + zero2_copy_seconds(local_bytes, mesh, axes, fresh=fresh), 2, step_s


def zero2_priced_rs(strategy: Strategy, slot: int, mesh: MeshSpec, *, bucket_cap: int = 0) -> bool:
    """Is input ``slot``'s partial gradient priced in the consumer's option as a reduce-scatter
    (the cheaper of the two; else as an all-reduce)? The edge charges the rest (``zero2_extra_s``).
    ``bucket_cap``: the option prices the parameter's sum as a gradient-bucket member (it reads
    the parameter directly, ``Decision.bucketed``), 0 when the runtime buckets nothing."""
    return (grad_sync_seconds(strategy, slot, mesh, "reduce_scatter", bucket_cap=bucket_cap)
            <= grad_sync_seconds(strategy, slot, mesh, bucket_cap=bucket_cap))


def zero2_extra_s(strategy: Strategy, slot: int, mesh: MeshSpec, *, reduce_scatter: bool, bucketed: bool = False,
                  bucket_cap: int = 0) -> float:
    """Seconds the gradient sum the runtime runs for input ``slot`` (into ZeRO-2 pieces when
    ``reduce_scatter``: the cheaper of a reduce-scatter and an all-reduce that keeps this
    device's piece, ``runtime.zero.comm.ScatterPlan`` choosing by the same links; else an
    all-reduce: in a ``bucket_cap``-byte gradient bucket when ``bucketed``, the parameter read in
    its own layout; in-graph, one latency, otherwise) takes beyond what the consumer's option
    priced (``zero2_priced_rs``: the cheaper of the two bucketed sums) -- 0, or the larger less
    the smaller. Calibrated per-kind links may make either one the cheaper, so neither is assumed."""
    rs = grad_sync_seconds(strategy, slot, mesh, "reduce_scatter", bucket_cap=bucket_cap)
    ar = grad_sync_seconds(strategy, slot, mesh, bucket_cap=bucket_cap)
    priced = min(rs, ar)
    runs = priced if reduce_scatter else ar if bucketed else grad_sync_seconds(strategy, slot, mesh)
    return runs - priced if runs > priced else 0.0
