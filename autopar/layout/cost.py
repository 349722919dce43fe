"""The cost model, in seconds. Device-free; no torch import.

Compute: roofline ``max(flops / peak, bytes / mem_bandwidth)`` with a per-kernel floor, where
``peak`` is the mesh's peak at the op's compute precision (``MeshSpec.flops_at(itemsize)``: the
bf16/fp16 peak for 2-byte floats, the fp32 peak otherwise).

Communication over mesh axes ``axes`` of a tensor whose *full* size (over those axes) is
``nbytes``, with ``n`` the product of the axis sizes and ``alpha``/``beta`` the group's link
(below); a collective over several axes is one ring through the whole group:

=================  ======================================================
all-gather         ``alpha + beta * nbytes * (n-1)/n``  (``nbytes`` = gathered output)
reduce-scatter     ``alpha + beta * nbytes * (n-1)/n``  (``nbytes`` = unreduced input)
all-reduce         ``alpha + beta * nbytes * 2(n-1)/n``
all-to-all         ``alpha + beta * nbytes * (n-1)/n**2``
split (local)      ``2 * (nbytes / n) / mem_bandwidth``  (a copy of the local piece; no link)
=================  ======================================================

A collective over a single device (``n == 1``) costs nothing.

The group's ``alpha``/``beta``: over one axis (of size > 1), that axis's. Over several, the fit
measured on exactly the group they span (``MachineProfile.link_over``: calibration times each
kind on every set of two or more axes of size > 1, flattened into one group as the runtime's
gradient buckets issue their sums, ``ProcessMesh.group_over``), so the same ranks doing the same
collective cost the same whichever mesh names them: a (2, 2) mesh's 4-rank all-reduce is priced
as the (4,) mesh's, not at a 2-rank latency. Where the profile has no such fit (a preset, a
profile written before them, JSON version 6 or before, or a set calibration did not measure) the
fallback is the slowest of the axes' own links, a ring bottlenecked by its slowest hop: the best
the per-axis figures say, though it under-prices the latency of a bigger group (an all-reduce's
ring over ``n`` ranks takes ``2(n-1)`` steps; a 2-rank fit's alpha covers 2). Either way a
collective over several axes is priced as one collective on their group, as the runtime issues
a gradient bucket's sum; an in-graph sum over several axes runs as a chain of per-axis
collectives (``runtime.kernels.all_reduce_axes``), which one group's price only approximates.

A **synchronous** collective (``blocking=True``, the default: a conversion, an op's in-graph sum,
a gradient summed in backward without a bucket -- the runtime's autograd functions wait for it
before the next op runs) adds, on a calibrated mesh, its axes' ``MachineProfile.blocking_s``
(the largest of them): what a blocking collective pays inside a step beyond the lockstep time
the links were fitted on -- the ranks arrive apart and the waiting thread is woken late. An
asynchronous one (``blocking=False``; every bucketed one, ``bucket_cap > 0``: gradient buckets,
ZeRO's batched collectives) does not: it is waited on where backward or the step ends, and its
exposure is the overlap model's (``MeshSpec.comm_overlap``, ``solver/overlap.py``). Over several
axes (of size > 1) it is the figure measured on exactly that set (``MachineProfile.blocking_of``:
``blocking_over``, timed on what the runtime issues for it -- a chain of per-axis all-reduces,
``runtime.kernels.all_reduce_axes``; only bucketed, asynchronous sums use the spanning group --
beyond the group fit's lockstep price), else the largest of its axes' ``blocking_s``: a (2, 2)
mesh's blocking sum over both axes waits as its 4 ranks do, not as a 2-rank axis does.

On a calibrated mesh (``MeshSpec.machine``, ``autopar.layout.machine``) the same formulas take
measured figures: a collective the per-(kind, axes) ``alpha``/``beta`` where that kind was fitted
on that group (above; else, per axis, the axis's all-kind fit); a kernel of a measured op class
its achieved rate at its size and dtype instead of the peak: ``flops / rate(flops)`` for matmul and attention,
``nbytes / rate(nbytes)`` for elementwise, normalisation and pooling ops, each still no less than
its other roofline term and the kernel floor -- an elementwise math function (``tanh``,
``exp``, ``sqrt`` ...) its ``MachineProfile.pointwise`` factor times the class's (``add``'s)
time at its bytes, forward and backward apart; a convolution's or pool's backward at its own
measured backward rate; the optimizer step (``optimizer_seconds``) at the measured AdamW rate;
each times the profile's ``time_scale`` factor of the class where a model's timed steps refit it
(``refine=True``). Other ops, unmeasured dtypes and uncalibrated meshes get the roofline as above,
so a preset prices exactly as before.

A pipeline schedule's action (a stage's forward or backward of one micro-batch under torch's
schedules) costs ``pipeline_action_seconds(mesh)`` beyond its ops and transfers: the calibrated
``MachineProfile.pipeline_action_s`` where measured, else the preset's default
(``layout.mesh.preset_pipeline_action_s``); the pipeline cost model counts the actions
(``planner.pipeline.schedule.action_overhead_s``). Its point-to-point transfer of ``nbytes`` over
mesh axis 0 costs ``pipeline_transfer_seconds(mesh, nbytes)``: ``alpha + beta * nbytes`` of the
axis, with the calibrated ``MachineProfile.pipeline_transfer_s`` for ``alpha`` where the probe of
torch's schedule measured its transfers below the axis's fit (a send/receive pair waits on one
peer, not on a lockstep group).
"""

from __future__ import annotations

import math
from typing import Iterable

from autopar.layout.machine import COMPUTE_BOUND, MEMORY_BOUND, OP_CLASSES, OPTIMIZER, dtype_name
from autopar.layout.mesh import MeshSpec, preset_pipeline_action_s

__all__ = ["KERNEL_FLOOR_S", "COLLECTIVES", "compute_seconds", "collective_seconds", "copy_seconds", "ring_seconds",
           "optimizer_bytes_per_byte", "optimizer_seconds", "pipeline_action_seconds",
           "pipeline_transfer_seconds"]

# Launch overhead of one kernel: a node never costs less than this, however small -- unless the
# mesh's calibration measured the floor (``MachineProfile.kernel_floor_s``).
KERNEL_FLOOR_S = 2e-6

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "split")


def compute_seconds(flops: float, nbytes: float, mesh: MeshSpec, *, itemsize: int = 4, op_class: str = "other",
                    dtype: str | None = None, backward: bool = False, op: str | None = None) -> float:
    """Time of one kernel moving ``nbytes`` and doing ``flops`` on one device, computing in
    ``itemsize``-byte floats (2: bf16/fp16, at the half-precision peak). ``op_class`` (one of
    ``OP_CLASSES``) and ``dtype`` (``"fp32"``, ``"bf16"``, ``"fp16"``; None: from ``itemsize``)
    pick the measured rate on a calibrated mesh, ``backward`` the class's backward rate where it
    has its own (``machine.BACKWARD_CLASSES``); ``op``: the ATen op's name (``"tanh"``), whose
    measured ``MachineProfile.pointwise`` factor scales an elementwise kernel's rate; see the
    module docstring."""
    if flops < 0 or nbytes < 0:
        raise ValueError(f"flops and bytes must be >= 0, got {flops}, {nbytes}")
    if op_class not in OP_CLASSES:
        raise ValueError(f"unknown op class {op_class!r}; expected one of {OP_CLASSES}")
    flop_s, byte_s = flops / mesh.flops_at(itemsize), nbytes / mesh.mem_bandwidth
    if mesh.machine is None:
        return max(flop_s, byte_s, KERNEL_FLOOR_S)
    dtype = dtype or dtype_name(itemsize)
    floor = KERNEL_FLOOR_S if mesh.machine.kernel_floor_s is None else mesh.machine.kernel_floor_s
    if op_class in COMPUTE_BOUND and flops > 0:
        rate = mesh.machine.compute.rate(op_class, dtype, flops, backward=backward)
        flop_s = flop_s if rate is None else flops / rate
    elif op_class in MEMORY_BOUND and nbytes > 0:
        rate = mesh.machine.compute.rate(op_class, dtype, nbytes, backward=backward)
        byte_s = byte_s if rate is None else nbytes / rate
        if op_class == "elementwise" and op is not None:
            byte_s *= mesh.machine.pointwise_factor(op, backward=backward)
    return max(flop_s, byte_s, floor) * mesh.machine.scale_of(op_class)


# Bytes an Adam-style step moves per parameter byte: reads parameter, gradient and the ``m``
# states, writes parameter and states (``3 + 2m``; offload prices the host's step so too).
def optimizer_bytes_per_byte(optimizer_multiplier: float) -> float:
    return 3.0 + 2.0 * optimizer_multiplier


def optimizer_seconds(param_bytes: float, mesh: MeshSpec, *, optimizer_multiplier: float) -> float:
    """The optimizer step's seconds for ``param_bytes`` of parameters updated on one device, on a
    mesh whose calibration measured the step (``machine.OPTIMIZER``: AdamW, ``m = 2``, rate in
    parameter bytes per second; another ``m`` scaled by the bytes its step moves); 0 elsewhere:
    a spec sheet says nothing of the optimizer's many small passes, and presets price as before."""
    if param_bytes < 0:
        raise ValueError(f"parameter bytes must be >= 0, got {param_bytes}")
    table = None if mesh.machine is None or not param_bytes else mesh.machine.compute.table(OPTIMIZER, "fp32")
    if table is None:
        return 0.0
    # Below the smallest parameter measured its time holds, not its rate: a foreach step's work per
    # tensor is flat there (54-60 us per parameter from 128 B to 4 KiB on a 2-core host), so a
    # ZeRO shard of a small parameter costs its step what the whole one did.
    size = max(param_bytes, table.sizes[0])
    scale = optimizer_bytes_per_byte(optimizer_multiplier) / optimizer_bytes_per_byte(2.0)
    return size * scale / table.at(size)


def copy_seconds(nbytes: float, mesh: MeshSpec) -> float:
    """A local copy: read and write ``nbytes``."""
    return 2.0 * nbytes / mesh.mem_bandwidth if nbytes else 0.0


def _group(mesh: MeshSpec, axes: Iterable[int], kind: str) -> tuple[int, float, float]:
    """(ranks, alpha, beta) of ``kind`` over mesh ``axes``: the fit measured on exactly the
    group they span where the profile has one, else the slowest axis's (module docstring)."""
    axes = tuple(axes)
    if not axes:
        raise ValueError("a collective needs at least one mesh axis")
    for a in axes:
        if not 0 <= a < mesh.ndim:
            raise ValueError(f"mesh axis {a} out of range for mesh {mesh.shape}")
    n = math.prod(mesh.shape[a] for a in axes)
    # An axis of size 1 adds no rank: the group over (0, 1, 2) of a 2x2x1 mesh is (0, 1)'s.
    spanning = sorted({a for a in axes if mesh.shape[a] > 1})
    fit = mesh.machine.link_over(kind, spanning) if mesh.machine is not None and len(spanning) > 1 else None
    if fit is not None:
        return n, fit.alpha, fit.beta
    links = [_link(mesh, kind, a) for a in axes]
    return n, max(alpha for alpha, _ in links), max(beta for _, beta in links)


def _link(mesh: MeshSpec, kind: str, axis: int) -> tuple[float, float]:
    """(alpha, beta) of ``kind`` on ``axis``: the calibrated per-kind fit, else the axis's."""
    fit = None if mesh.machine is None else mesh.machine.link(kind, axis)
    return (mesh.alpha[axis], mesh.beta[axis]) if fit is None else (fit.alpha, fit.beta)


def collective_seconds(kind: str, nbytes: float, mesh: MeshSpec, axes: Iterable[int] | int, *,
                       bucket_cap: int = 0, blocking: bool = True) -> float:
    """Time of collective ``kind`` over mesh ``axes`` for a tensor of ``nbytes`` full size;
    ``blocking``: issued synchronously inside the step (module docstring; a bucketed one never is).

    ``bucket_cap`` > 0: the tensor is one among others in a bucket of at most ``bucket_cap``
    bytes (``layout.buckets``; ``runtime.bucketing`` issues one collective per bucket of
    gradients, ``runtime.zero.comm.GatherPlan`` one per bucket of ZeRO pieces), so it pays its
    bandwidth term and its share of the bucket's latency::

        alpha * min(1, nbytes / bucket_cap) + beta * nbytes * f(n)

    Linear in the tensors a plan buckets (the ILP cannot know which land together: that depends
    on the solution), exact for a full bucket and for a tensor of ``bucket_cap`` bytes or more
    (alone in its bucket, one latency). The runtime's first bucket (1 MiB) and each group's last,
    partly filled one pay a whole latency for less: a plan's bucketed sums are under-estimated by
    less than two latencies per (mesh axes, dtype) group."""
    axes = (axes,) if isinstance(axes, int) else tuple(axes)
    n, alpha, beta = _group(mesh, axes, kind)
    if n == 1:
        return 0.0
    if bucket_cap < 0:
        raise ValueError(f"bucket cap must be >= 0 bytes, got {bucket_cap}")
    if bucket_cap and kind in ("all_reduce", "reduce_scatter", "all_gather"):
        alpha *= min(1.0, nbytes / bucket_cap)
    if blocking and not bucket_cap and kind != "split" and mesh.machine is not None:
        alpha += mesh.machine.blocking_of([a for a in axes if mesh.shape[a] > 1])
    if kind in ("all_gather", "reduce_scatter"):
        return alpha + beta * nbytes * (n - 1) / n
    if kind == "all_reduce":
        return alpha + beta * nbytes * 2 * (n - 1) / n
    if kind == "all_to_all":
        return alpha + beta * nbytes * (n - 1) / (n * n)
    if kind == "split":
        return copy_seconds(nbytes / n, mesh)
    raise ValueError(f"unknown collective {kind!r}; expected one of {COLLECTIVES}")


def ring_seconds(block_bytes: float, mesh: MeshSpec, axes: Iterable[int], *, closed: bool) -> float:
    """A block of ``block_bytes`` per device passed around the ring of mesh ``axes`` (ring
    attention's key/value blocks): one point-to-point step per shift, each paying its axis's
    latency and moving the block once. Several axes turn as an odometer (the last fastest, an
    outer one when the inner wraps), so axis ``axes[i]`` shifts ``prod(sizes[:i + 1])`` times for a
    ``closed`` turn (every block back home) and once less per axis when the last shift is left out."""
    total, turns = 0.0, 1
    for a in axes:
        turns *= mesh.shape[a]
        if mesh.shape[a] == 1:
            continue
        steps = turns if closed else turns - 1
        total += steps * (mesh.alpha[a] + mesh.beta[a] * block_bytes)
    return total


def pipeline_action_seconds(mesh: MeshSpec) -> float:
    """Seconds one pipeline schedule action costs on ``mesh`` beyond its ops and transfers: the
    calibrated figure where the profile has one, else the preset's (module docstring)."""
    measured = None if mesh.machine is None else mesh.machine.pipeline_action_s
    return preset_pipeline_action_s(mesh.name) if measured is None else measured


def pipeline_transfer_seconds(mesh: MeshSpec, nbytes: float) -> float:
    """Seconds one point-to-point transfer of ``nbytes`` between pipeline stages (over mesh axis 0)
    costs on ``mesh`` (module docstring)."""
    measured = None if mesh.machine is None else mesh.machine.pipeline_transfer_s
    return (mesh.alpha[0] if measured is None else measured) + mesh.beta[0] * nbytes
