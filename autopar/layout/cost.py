"""The cost model, in seconds. Device-free; no torch import.

Compute: roofline ``max(flops / peak, bytes / mem_bandwidth)`` with a per-kernel floor, where
``peak`` is the mesh's peak at the op's compute precision (``MeshSpec.flops_at(itemsize)``: the
bf16/fp16 peak for 2-byte floats, the fp32 peak otherwise).

Communication over mesh axes ``axes`` of a tensor whose *full* size (over those axes) is
``nbytes``, with ``n`` the product of the axis sizes, ``alpha``/``beta`` the slowest of the
axes (a collective over several axes is one ring through the whole group, bottlenecked by its
slowest link):

=================  ======================================================
all-gather         ``alpha + beta * nbytes * (n-1)/n``  (``nbytes`` = gathered output)
reduce-scatter     ``alpha + beta * nbytes * (n-1)/n``  (``nbytes`` = unreduced input)
all-reduce         ``alpha + beta * nbytes * 2(n-1)/n``
all-to-all         ``alpha + beta * nbytes * (n-1)/n**2``
split (local)      ``2 * (nbytes / n) / mem_bandwidth``  (a copy of the local piece; no link)
=================  ======================================================

A collective over a single device (``n == 1``) costs nothing.
"""

from __future__ import annotations

import math
from typing import Iterable

from autopar.layout.mesh import MeshSpec

__all__ = ["KERNEL_FLOOR_S", "COLLECTIVES", "compute_seconds", "collective_seconds", "copy_seconds", "ring_seconds"]

# Launch overhead of one kernel: a node never costs less than this, however small.
KERNEL_FLOOR_S = 2e-6

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "split")


def compute_seconds(flops: float, nbytes: float, mesh: MeshSpec, *, itemsize: int = 4) -> float:
    """Roofline time of one kernel moving ``nbytes`` and doing ``flops`` on one device, computing
    in ``itemsize``-byte floats (2: bf16/fp16, at the half-precision peak)."""
    if flops < 0 or nbytes < 0:
        raise ValueError(f"flops and bytes must be >= 0, got {flops}, {nbytes}")
    return max(flops / mesh.flops_at(itemsize), nbytes / mesh.mem_bandwidth, KERNEL_FLOOR_S)


def copy_seconds(nbytes: float, mesh: MeshSpec) -> float:
    """A local copy: read and write ``nbytes``."""
    return 2.0 * nbytes / mesh.mem_bandwidth if nbytes else 0.0


def _group(mesh: MeshSpec, axes: Iterable[int]) -> tuple[int, float, float]:
    axes = tuple(axes)
    if not axes:
        raise ValueError("a collective needs at least one mesh axis")
    for a in axes:
        if not 0 <= a < mesh.ndim:
            raise ValueError(f"mesh axis {a} out of range for mesh {mesh.shape}")
    n = math.prod(mesh.shape[a] for a in axes)
    return n, max(mesh.alpha[a] for a in axes), max(mesh.beta[a] for a in axes)


def collective_seconds(kind: str, nbytes: float, mesh: MeshSpec, axes: Iterable[int] | int) -> float:
    """Time of collective ``kind`` over mesh ``axes`` for a tensor of ``nbytes`` full size."""
    if isinstance(axes, int):
        axes = (axes,)
    n, alpha, beta = _group(mesh, axes)
    if n == 1:
        return 0.0
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
