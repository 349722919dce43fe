"""Mesh profiler: time real collectives per mesh axis and fit the cost model's alpha/beta.

``profile_mesh(shape, ...)`` runs either inside an existing process group (``torchrun``; the
default group is initialised from the environment when it is not yet) or on ``local=N`` forked
gloo/NCCL processes (``autopar.runtime.launch.run_local``). For every mesh axis of size > 1 it
builds the per-axis groups with ``torch.distributed.device_mesh.init_device_mesh`` and times
all-reduce, all-gather, reduce-scatter and all-to-all (the same torch.distributed calls that
``autopar.runtime.collectives`` issues) over a range of full-tensor sizes: a barrier before each call,
device synchronisation after it on CUDA, ``repeats`` rounds over all (collective, size) points
(round-robin, so a burst of outside load spreads over every point), the median per point, and
the slowest rank's median (a collective finishes when its last rank does).

The fit: per axis, one ``alpha`` and one ``beta`` over *all four* collectives, by least squares
against the ring model of ``autopar.layout.cost`` (``t = alpha + beta * nbytes * f(kind, n)``) on log
residuals ``log(model / t)``, so that 64 KiB calls weigh as much as 16 MiB ones and a 2x
over-prediction counts like a 2x under-prediction; both parameters come out strictly positive.
Axes of size 1 never communicate: alpha = beta = 0 there.

Device figures: ``peak_flops`` from a timed fp32 square matmul and ``half_peak_flops``
from a bf16 one (on a CPU without bf16 instructions: emulated, far slower); memory bandwidth from a timed copy
(``2 * bytes / s``, the convention of ``cost.copy_seconds``); the best of ``repeats`` on each rank
and the slowest rank's value. Capacity is the CUDA device's total memory or the machine's
physical RAM. All ranks return the same ``MeshSpec``.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from autopar.layout.cost import collective_seconds
from autopar.layout.mesh import MeshSpec, default_axis_names, parse_mesh_shape

__all__ = [
    "KINDS",
    "Timing",
    "MeshProfile",
    "profile_mesh",
    "profile_mesh_detailed",
    "time_collective",
    "measure_axis",
    "fit_alpha_beta",
    "ring_factor",
]

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
KiB, MiB = 1024, 1024**2
DEFAULT_SIZES = {
    "cpu": [64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB],
    "cuda": [1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB],
}
_ITEMSIZE = 4  # float32 buffers
# Smallest share of the largest call's fitted time that bandwidth must explain for a usable beta.
MIN_BANDWIDTH_SHARE = 0.05


@dataclass(frozen=True, slots=True)
class Timing:
    """One measured point: ``kind`` on mesh ``axis`` for a tensor of ``nbytes`` full size."""

    axis: int
    kind: str
    nbytes: int
    seconds: float  # median over repeats, slowest rank

    def __str__(self) -> str:
        return f"axis{self.axis} {self.kind:<14} {self.nbytes:>11,d} B  {self.seconds * 1e3:9.3f} ms"


@dataclass(frozen=True, slots=True)
class MeshProfile:
    """The fitted ``MeshSpec`` and the measurements it was fitted from."""

    mesh: MeshSpec
    timings: tuple[Timing, ...]

    def predicted(self, timing: Timing) -> float:
        return collective_seconds(timing.kind, timing.nbytes, self.mesh, timing.axis)

    def __str__(self) -> str:
        return f"{self.mesh} from {len(self.timings)} timings"


# ----------------------------------------------------------------------------- the model
def ring_factor(kind: str, n: int) -> float:
    """``f(kind, n)`` of the cost model: seconds per byte of full size at beta = 1, alpha = 0.

    Read off ``autopar.layout.cost.collective_seconds`` so the fit and the planner share one model.
    """
    unit = MeshSpec(shape=(n,), axis_names=("unit",), alpha=(0.0,), beta=(1.0,),
                    peak_flops=1.0, mem_bandwidth=1.0, mem_capacity=1)
    return collective_seconds(kind, 1.0, unit, 0)


def _linear_relative_fit(pts: list[tuple[float, float]]) -> tuple[float, float]:
    """Start point: least squares on relative residuals ``(alpha + beta*x - t) / t`` (linear)."""
    u = [1.0 / t for _, t in pts]
    v = [x / t for x, t in pts]
    suu, svv = sum(a * a for a in u), sum(b * b for b in v)
    suv, su, sv = sum(a * b for a, b in zip(u, v)), sum(u), sum(v)
    det = suu * svv - suv * suv
    alpha = (su * svv - sv * suv) / det if det > 0 else 0.0
    beta = (sv * suu - su * suv) / det if det > 0 else 0.0
    # Keep the start strictly positive (log-parameters below); tiny floors only seed the search.
    t_min = min(t for _, t in pts)
    x_max = max(x for x, _ in pts)
    return max(alpha, 1e-3 * t_min), max(beta, 1e-3 * t_min / max(x_max, 1.0))


def _lm_step(pts, p: float, q: float, damping: float, current: float, loss):
    """One Levenberg-Marquardt step from (log alpha, log beta) = (p, q): (dp, dq, new loss, the
    damping that gave it), or None when no damping up to 1e12 lowers the loss."""
    a, b = math.exp(p), math.exp(q)
    jtj = [[0.0, 0.0], [0.0, 0.0]]
    jtr = [0.0, 0.0]
    for x, t in pts:
        m = a + b * x
        r = math.log(m) - math.log(t)
        j = (a / m, b * x / m)  # d r / d(log alpha), d r / d(log beta)
        for i in range(2):
            jtr[i] += j[i] * r
            for k in range(2):
                jtj[i][k] += j[i] * j[k]
    while damping <= 1e12:
        h00, h11 = jtj[0][0] * (1 + damping), jtj[1][1] * (1 + damping)
        det = h00 * h11 - jtj[0][1] * jtj[1][0]
        if det > 0:
            dp = -(h11 * jtr[0] - jtj[0][1] * jtr[1]) / det
            dq = -(h00 * jtr[1] - jtj[1][0] * jtr[0]) / det
            trial = loss(p + dp, q + dq)
            if trial <= current:
                return dp, dq, trial, damping
        damping *= 10
    return None


def fit_alpha_beta(points: Sequence[tuple[float, float]], *, iterations: int = 100) -> tuple[float, float]:
    """Least squares of ``log(alpha + beta * x) - log(t)`` over ``points`` = ``(x, t)``.

    ``x = nbytes * ring_factor(kind, n)``, ``t`` measured seconds. Log residuals weigh a 2x
    over-prediction like a 2x under-prediction and small calls like large ones; fitting
    ``log alpha`` and ``log beta`` (Levenberg-Marquardt) keeps both strictly positive.
    ``ValueError`` when the sizes are too small for bandwidth to show (see
    ``MIN_BANDWIDTH_SHARE``).
    """
    pts = [(float(x), float(t)) for x, t in points]
    if len(pts) < 2 or any(not t > 0 or not x >= 0 for x, t in pts):
        raise ValueError(f"need >= 2 points with x >= 0 and t > 0 to fit alpha/beta, got {pts}")
    if len({x for x, _ in pts}) < 2:
        raise ValueError(f"need >= 2 distinct sizes to separate alpha from beta, got {pts}")
    alpha, beta = _linear_relative_fit(pts)
    p, q = math.log(alpha), math.log(beta)

    def loss(p: float, q: float) -> float:
        # A wild trial step (noisy, non-monotone timings) can leave exp's range: an infinite
        # loss rejects it, as any worse step is rejected, and the damping grows.
        try:
            a, b = math.exp(p), math.exp(q)
            return sum((math.log(a + b * x) - math.log(t)) ** 2 for x, t in pts)
        except (OverflowError, ValueError):
            return math.inf

    damping, current = 1e-3, loss(p, q)
    for _ in range(iterations):
        step = _lm_step(pts, p, q, damping, current, loss)
        if step is None:  # no damping makes progress: (p, q) is as good as it gets
            break
        dp, dq, trial, damping = step
        p, q = p + dp, q + dq
        improvement, current = current - trial, trial
        damping = max(damping / 10, 1e-9)
        if improvement <= 1e-14 * max(current, 1e-30) and abs(dp) + abs(dq) < 1e-10:
            break
    alpha, beta = math.exp(p), math.exp(q)
    # If even the largest call is (nearly) all latency, the data do not determine beta: a tiny
    # fitted beta would tell the planner that bandwidth is free. Refuse rather than mislead.
    x_max = max(x for x, _ in pts)
    share = beta * x_max / (alpha + beta * x_max)
    if share < MIN_BANDWIDTH_SHARE:
        raise ValueError(
            f"timings do not grow with size (bandwidth is {share:.1%} of the largest call's fitted "
            f"time; alpha {alpha:.3g} s, beta {beta:.3g} s/B): profile larger sizes; points {pts}"
        )
    return alpha, beta


# --------------------------------------------------------------------------- measurement
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _op(kind: str, nbytes: int, n: int, group, device: torch.device):
    """A zero-argument callable issuing ``kind`` for a tensor of ``nbytes`` full size."""
    numel = max(n * n, (nbytes // _ITEMSIZE) // (n * n) * (n * n))  # divisible for every kind
    full = torch.ones(numel, device=device)
    piece = torch.ones(numel // n, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if kind == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(full, piece, group=group)
    if kind == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(piece, full, group=group)
    if kind == "all_to_all":
        recv = torch.empty_like(piece)  # each rank holds full/n and exchanges it
        return lambda: dist.all_to_all_single(recv, piece, group=group)
    raise ValueError(f"unknown collective {kind!r}; expected one of {KINDS}")


def _timed(op, group, device: torch.device) -> float:
    """One sample: ranks enter together (barrier), the clock stops when the device is done."""
    dist.barrier(group=group)
    _sync(device)
    start = time.perf_counter()
    op()
    _sync(device)
    return time.perf_counter() - start


def time_collective(kind: str, nbytes: int, group, *, device: torch.device | str = "cpu",
                    repeats: int = 5) -> float:
    """This rank's median seconds of ``kind`` on ``group`` (one untimed warm-up call first)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    device = torch.device(device)
    op = _op(kind, nbytes, dist.get_world_size(group), group, device)
    op()
    return statistics.median(_timed(op, group, device) for _ in range(repeats))


def _reduce_max(values: list[float], device: torch.device, op=dist.ReduceOp.MAX) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def measure_axis(device_mesh, axis: int, sizes: Sequence[int], *, device: torch.device | str = "cpu",
                 repeats: int = 5, kinds: Sequence[str] = KINDS, verbose: bool = False) -> list[Timing]:
    """Time ``kinds`` x ``sizes`` on every group of mesh ``axis`` at once (the training pattern).

    Collective over all ranks; every rank returns the same list (slowest rank's medians).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    device = torch.device(device)
    group = device_mesh.get_group(axis)
    n = device_mesh.shape[axis]
    points = [(k, int(s)) for k in kinds for s in sizes]
    ops = [_op(k, s, n, group, device) for k, s in points]
    for op in ops:  # warm-up: connections, allocator, first-touch pages
        op()
    # Round-robin over the points: a burst of load from elsewhere then spreads over all points
    # instead of spoiling most repeats of a few of them.
    samples: list[list[float]] = [[] for _ in points]
    for r in range(repeats):
        if verbose and dist.get_rank() == 0:
            print(f"[profile-mesh] axis {axis} (n={n}): round {r + 1}/{repeats} of {len(points)} "
                  f"collectives ({', '.join(kinds)})", flush=True)
        for op, mine in zip(ops, samples):
            mine.append(_timed(op, group, device))
    local = [statistics.median(mine) for mine in samples]
    slowest = _reduce_max(local, device)
    out = [Timing(axis, k, s, t) for (k, s), t in zip(points, slowest)]
    if verbose and dist.get_rank() == 0:
        for timing in out:
            print(f"[profile-mesh] n={n} {timing}", flush=True)
    return out


def _matmul_flops(device: torch.device, dtype: torch.dtype, size: int, repeats: int) -> float:
    """FLOP/s of a ``size``-square matmul in ``dtype``, best of ``repeats`` after one warm-up."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = math.inf
    for _ in range(repeats + 1):  # the first call warms up kernels and allocator
        _sync(device)
        start = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def _device_figures(device: torch.device, repeats: int) -> tuple[float, float | None, float]:
    """(fp32 matmul FLOP/s, bf16 matmul FLOP/s or None, copy bandwidth bytes/s) of this rank's
    device, best of ``repeats``. fp32 runs under the process's matmul settings (torch's default:
    no TF32), as an fp32 model would; bf16 on tensor cores (CUDA) or however this CPU runs it
    (emulated without AVX512-BF16/AMX: tens of times slower than fp32, so a smaller size)."""
    cuda = device.type == "cuda"
    size = 8192 if cuda else 512
    fp32 = _matmul_flops(device, torch.float32, size, repeats)
    half = _matmul_flops(device, torch.bfloat16, size if cuda else 128, repeats)
    numel = (1 << 28) if cuda else (1 << 24)  # 1 GiB / 64 MiB of float32
    src = torch.ones(numel, device=device)
    dst = torch.empty_like(src)
    best_copy = math.inf
    for _ in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best_copy = min(best_copy, time.perf_counter() - start)
    return fp32, half, 2.0 * numel * 4 / best_copy


def _mem_capacity(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _profile_in_group(shape: tuple[int, ...], device_type: str, sizes: Sequence[int], repeats: int,
                      verbose: bool) -> MeshProfile:
    from torch.distributed.device_mesh import init_device_mesh

    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    names = default_axis_names(len(shape))
    device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    timings: list[Timing] = []
    alpha, beta = [], []
    for axis, n in enumerate(shape):
        if n == 1:
            alpha.append(0.0)
            beta.append(0.0)
            continue
        measured = measure_axis(device_mesh, axis, sizes, device=device, repeats=repeats, verbose=verbose)
        timings += measured
        a, b = fit_alpha_beta([(t.nbytes * ring_factor(t.kind, n), t.seconds) for t in measured])
        alpha.append(a)
        beta.append(b)
        if verbose and dist.get_rank() == 0:
            print(f"[profile-mesh] axis {axis} ({names[axis]}, n={n}): alpha {a * 1e6:.1f} us, "
                  f"beta {b * 1e9:.3f} ns/B ({1 / b / 1e9 if b else math.inf:.2f} GB/s)", flush=True)
    flops, half, bandwidth = _device_figures(device, repeats)
    # Every rank has the same device type, so all or none measured bf16.
    figures = _reduce_max([flops, bandwidth] + ([] if half is None else [half]), device, op=dist.ReduceOp.MIN)
    flops, bandwidth = figures[:2]
    half = figures[2] if half is not None else None
    if verbose and dist.get_rank() == 0:
        bf16 = "" if half is None else f", {half / 1e9:.1f} GFLOP/s bf16 matmul"
        print(f"[profile-mesh] device: {flops / 1e9:.1f} GFLOP/s fp32 matmul{bf16}, "
              f"{bandwidth / 1e9:.2f} GB/s copy", flush=True)
    mesh = MeshSpec(shape=shape, axis_names=names, alpha=tuple(alpha), beta=tuple(beta),
                    peak_flops=flops, mem_bandwidth=bandwidth, mem_capacity=_mem_capacity(device),
                    name=f"profiled-{device_type}", half_peak_flops=half)
    return MeshProfile(mesh=mesh, timings=tuple(timings))


def _local_worker(rank: int, world_size: int, shape, device_type, sizes, repeats, verbose) -> MeshProfile:
    return _profile_in_group(shape, device_type, sizes, repeats, verbose)


# ---------------------------------------------------------------------------- entry points
def profile_mesh_detailed(shape: Sequence[int] | str, *, device: str = "cpu", sizes: list[int] | None = None,
                          repeats: int = 5, local: int | None = None, backend: str | None = None,
                          verbose: bool = False) -> MeshProfile:
    """Like ``profile_mesh`` but also returns the timings the fit came from."""
    shape = parse_mesh_shape(shape)
    device_type = torch.device(device).type
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"profile_mesh supports device 'cpu' or 'cuda', got {device!r}")
    sizes = list(DEFAULT_SIZES[device_type] if sizes is None else sizes)
    if len(sizes) < 2 or any(isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in sizes):
        raise ValueError(f"sizes must be >= 2 positive byte counts, got {sizes!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    backend = backend or ("nccl" if device_type == "cuda" else "gloo")
    world = math.prod(shape)
    if local is not None:
        if local != world:
            raise ValueError(f"local={local} processes cannot form mesh {shape} of {world} devices")
        from autopar.runtime.launch import run_local

        results = run_local(_local_worker, local, shape, device_type, sizes, repeats, verbose, backend=backend)
        return results[0]
    created = False
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise ValueError(
                "profile_mesh needs a process group: run it under torchrun, or pass local=N "
                "to start N local processes"
            )
        dist.init_process_group(backend)
        created = True
    try:
        if dist.get_world_size() != world:
            raise ValueError(f"mesh {shape} needs {world} ranks, the process group has {dist.get_world_size()}")
        return _profile_in_group(shape, device_type, sizes, repeats, verbose)
    finally:
        if created:
            dist.destroy_process_group()


def profile_mesh(shape: Sequence[int] | str, *, device: str = "cpu", sizes: list[int] | None = None,
                 repeats: int = 5, local: int | None = None, backend: str | None = None,
                 verbose: bool = False) -> MeshSpec:
    """Profile the links of a ``shape`` mesh and the device; returns a ``MeshSpec`` (``.save(path)``)."""
    return profile_mesh_detailed(shape, device=device, sizes=sizes, repeats=repeats, local=local,
                                 backend=backend, verbose=verbose).mesh
