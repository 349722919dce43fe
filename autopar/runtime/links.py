"""Collective timings and their alpha/beta fit: the link half of ``autopar.runtime.calibrate``.

``measure_axis`` times all-reduce, all-gather, reduce-scatter and all-to-all (the same
torch.distributed calls that ``autopar.runtime.collectives`` issues) over a range of full-tensor
sizes on every group of one mesh axis at once (the training pattern); ``measure_group`` the same
on the group spanning several axes (the mesh flattened over them, ``spanning_group``, as the
runtime's ``ProcessMesh.group_over`` forms it). Every timed repetition
starts in lockstep (a barrier), ends when the device is done (CUDA: timed by events, read after
synchronising: ``Stopwatch``), and runs
round-robin over all (collective, size) points so a burst of outside load spreads over every
point; the figure of a point is the median over repetitions of the slowest rank's time in that
repetition (a step waits for its slowest rank), never a best-of. ``lockstep_median`` is that
rule for any callable, and the compute measurements use it too.

The fit (``fit_alpha_beta``): one ``alpha`` and one ``beta`` by least squares against the ring
model of ``autopar.layout.cost`` (``t = alpha + beta * nbytes * f(kind, n)``) on log residuals
``log(model / t)``, so that 4 KiB calls weigh as much as 16 MiB ones and a 2x over-prediction
counts like a 2x under-prediction, a point more than 1.5x off the fit weighing less (Huber's
loss: a host state lasting seconds once tripled a few sizes' medians); both parameters come out
strictly positive. Calibration fits
it per axis over all four kinds (``MeshSpec.alpha``/``beta``) and per kind and axis -- or set of
axes -- (``MachineProfile.links``). Axes of size 1 never communicate: alpha = beta = 0 there.
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
from autopar.layout.mesh import MeshSpec
from autopar.runtime.dist_ops import all_gather_single, blocking, reduce_scatter_single

__all__ = [
    "KINDS",
    "Timing",
    "MeshProfile",
    "lockstep_median",
    "ranks_reduce",
    "sync_device",
    "default_device",
    "rank_device",
    "Stopwatch",
    "lockstep_medians",
    "slowest_medians",
    "time_collective",
    "measure_axis",
    "measure_group",
    "spanning_group",
    "fit_alpha_beta",
    "ring_factor",
]

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
KiB, MiB = 1024, 1024**2
DEFAULT_SIZES = {
    "cpu": [4 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB],
    "cuda": [1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB],
}
_ITEMSIZE = 4  # float32 buffers
# Smallest share of the largest call's fitted time that bandwidth must explain for a usable beta.
MIN_BANDWIDTH_SHARE = 0.05


@dataclass(frozen=True, slots=True)
class Timing:
    """One measured point: ``kind`` on mesh ``axis`` -- or on the group spanning mesh ``axes``
    (increasing, the first ``axis``; ``()``: ``(axis,)``) -- for a tensor of ``nbytes`` full size."""

    axis: int
    kind: str
    nbytes: int
    seconds: float  # median over repetitions of the slowest rank's time
    axes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes", tuple(self.axes) or (self.axis,))

    def __str__(self) -> str:
        where = f"axis{self.axis}" if len(self.axes) == 1 else f"axes{''.join(map(str, self.axes))}"
        return f"{where} {self.kind:<14} {self.nbytes:>11,d} B  {self.seconds * 1e3:9.3f} ms"


@dataclass(frozen=True, slots=True)
class MeshProfile:
    """The fitted ``MeshSpec`` and the measurements it was fitted from."""

    mesh: MeshSpec
    timings: tuple[Timing, ...]

    def predicted(self, timing: Timing) -> float:
        # The timings were taken from a barrier: the lockstep price, without a blocking collective's mid-step wait.
        return collective_seconds(timing.kind, timing.nbytes, self.mesh, timing.axes, blocking=False)

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


def _weighted_log_fit(pts, weights, p: float, q: float, iterations: int) -> tuple[float, float]:
    """(log alpha, log beta) minimising ``sum w (log(alpha + beta x) - log t)^2`` from (p, q)."""
    def loss(p: float, q: float) -> float:
        # A wild trial step (noisy, non-monotone timings) can leave exp's range: an infinite
        # loss rejects it, as any worse step is rejected, and the damping grows.
        try:
            a, b = math.exp(p), math.exp(q)
            return sum(w * (math.log(a + b * x) - math.log(t)) ** 2 for (x, t), w in zip(pts, weights))
        except (OverflowError, ValueError):
            return math.inf

    damping, current = 1e-3, loss(p, q)
    for _ in range(iterations):
        step = _lm_step(pts, weights, p, q, damping, current, loss)
        if step is None:  # no damping makes progress: (p, q) is as good as it gets
            break
        dp, dq, trial, damping = step
        p, q = p + dp, q + dq
        improvement, current = current - trial, trial
        damping = max(damping / 10, 1e-9)
        if improvement <= 1e-14 * max(current, 1e-30) and abs(dp) + abs(dq) < 1e-10:
            break
    return p, q


def _lm_step(pts, weights, p: float, q: float, damping: float, current: float, loss):
    """One Levenberg-Marquardt step from (log alpha, log beta) = (p, q): (dp, dq, new loss, the
    damping that gave it), or None when no damping up to 1e12 lowers the loss."""
    a, b = math.exp(p), math.exp(q)
    jtj = [[0.0, 0.0], [0.0, 0.0]]
    jtr = [0.0, 0.0]
    for (x, t), w in zip(pts, weights):
        m = a + b * x
        r = math.log(m) - math.log(t)
        j = (a / m, b * x / m)  # d r / d(log alpha), d r / d(log beta)
        for i in range(2):
            jtr[i] += w * j[i] * r
            for k in range(2):
                jtj[i][k] += w * j[i] * j[k]
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


# Huber's threshold on a point's log residual (``fit_alpha_beta``): a call within 1.5x of the fit
# weighs in full, one further off by ``HUBER_LOG / |residual|``.
HUBER_LOG = math.log(1.5)
_REWEIGHTS = 8  # rounds of reweighting at most (the weights settle in two or three)


def fit_alpha_beta(points: Sequence[tuple[float, float]], *, iterations: int = 100) -> tuple[float, float]:
    """Least squares of ``log(alpha + beta * x) - log(t)`` over ``points`` = ``(x, t)``, robust
    to a point far off the rest.

    ``x = nbytes * ring_factor(kind, n)``, ``t`` measured seconds. Log residuals weigh a 2x
    over-prediction like a 2x under-prediction and small calls like large ones; fitting
    ``log alpha`` and ``log beta`` (Levenberg-Marquardt) keeps both strictly positive. A point
    more than 1.5x off the fit weighs less (Huber's loss, by iterative reweighting): on this
    project's 2-core host a 2-rank all-reduce of 256 KiB-4 MiB once took ~3.5 ms in one pass of
    lockstep repetitions and 0.6-1.5 ms in the next, and plain least squares turned such points
    into latencies of 1-2.6 ms where 4 KiB calls took 0.5-0.7. ``ValueError`` when the sizes are
    too small for bandwidth to show (see ``MIN_BANDWIDTH_SHARE``).
    """
    pts = [(float(x), float(t)) for x, t in points]
    if len(pts) < 2 or any(not t > 0 or not x >= 0 for x, t in pts):
        raise ValueError(f"need >= 2 points with x >= 0 and t > 0 to fit alpha/beta, got {pts}")
    if len({x for x, _ in pts}) < 2:
        raise ValueError(f"need >= 2 distinct sizes to separate alpha from beta, got {pts}")
    alpha, beta = _linear_relative_fit(pts)
    p, q = math.log(alpha), math.log(beta)
    weights = [1.0] * len(pts)
    for _ in range(_REWEIGHTS):
        p, q = _weighted_log_fit(pts, weights, p, q, iterations)
        a, b = math.exp(p), math.exp(q)
        new = [min(1.0, HUBER_LOG / max(abs(math.log(a + b * x) - math.log(t)), 1e-300)) for x, t in pts]
        if max(abs(w - v) for w, v in zip(weights, new)) < 1e-6:
            break
        weights = new
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


# ------------------------------------------------------------------------------- devices
def default_device() -> tuple[str, str]:
    """(device type, process-group backend) a measurement runs on unless told: ``("cuda",
    "nccl")`` where CUDA is available, else ``("cpu", "gloo")``. Calibration and the benchmarks
    ask this one rule."""
    return ("cuda", "nccl") if cuda_present() else ("cpu", "gloo")


def cuda_present() -> bool:
    """Whether a GPU is visible, asked without initialising CUDA in this process where possible:
    ``torch.cuda.is_available()`` calls ``cuInit``, after which ranks forked from this process
    cannot use the GPU ("initialization error"); NVML's device count does not touch the driver's
    CUDA state (``torch.cuda.device_count`` falls back to the runtime only where NVML fails)."""
    if torch.cuda.is_initialized():
        return torch.cuda.is_available()
    return torch.cuda.device_count() > 0


def rank_device(device_type: str) -> torch.device:
    """This rank's device of ``device_type``: on CUDA the GPU ``LOCAL_RANK`` names (else the rank
    modulo the visible GPUs), made current so that NCCL and the allocator use it; else the CPU."""
    if device_type != "cuda":
        return torch.device("cpu")
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1))))
    return torch.device("cuda", torch.cuda.current_device())


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """Seconds of the work issued between ``start()`` and ``stop()`` on ``device``: on a GPU
    from CUDA events on the current stream (kernels run after the host returns: a host clock
    would time their launch), read once ``stop`` has synchronised the device; on the CPU from
    ``time.perf_counter``."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._begin = None

    def start(self) -> None:
        if self.device.type == "cuda":
            self._begin = torch.cuda.Event(enable_timing=True)
            self._begin.record()
        else:
            self._begin = time.perf_counter()

    def stop(self) -> float:
        if self._begin is None:
            raise RuntimeError("Stopwatch.stop() before start()")
        begin, self._begin = self._begin, None
        if self.device.type != "cuda":
            return time.perf_counter() - begin
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        torch.cuda.synchronize(self.device)
        return begin.elapsed_time(end) / 1e3  # CUDA events count milliseconds


def _op(kind: str, nbytes: int, n: int, group, device: torch.device):
    """A zero-argument callable issuing ``kind`` for a tensor of ``nbytes`` full size."""
    numel = max(n * n, (nbytes // _ITEMSIZE) // (n * n) * (n * n))  # divisible for every kind
    full = torch.ones(numel, device=device)
    piece = torch.ones(numel // n, device=device)
    if kind == "all_reduce":
        return lambda: blocking(dist.all_reduce, full, group=group)
    if kind == "all_gather":
        return lambda: blocking(all_gather_single, full, piece, group=group)
    if kind == "reduce_scatter":
        return lambda: blocking(reduce_scatter_single, piece, full, group=group)
    if kind == "all_to_all":
        recv = torch.empty_like(piece)  # each rank holds full/n and exchanges it
        return lambda: blocking(dist.all_to_all_single, recv, piece, group=group)
    raise ValueError(f"unknown collective {kind!r}; expected one of {KINDS}")


def _timed(op, group, device: torch.device) -> float:
    """One sample: ranks enter together (barrier), the clock stops when the device is done."""
    dist.barrier(group=group)
    sync_device(device)  # the barrier's own kernels (NCCL) are not this sample's
    watch = Stopwatch(device)
    watch.start()
    op()
    return watch.stop()


def time_collective(kind: str, nbytes: int, group, *, device: torch.device | str = "cpu",
                    repeats: int = 5) -> float:
    """This rank's median seconds of ``kind`` on ``group`` (one untimed warm-up call first)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    device = torch.device(device)
    op = _op(kind, nbytes, dist.get_world_size(group), group, device)
    op()
    return statistics.median(_timed(op, group, device) for _ in range(repeats))


def ranks_reduce(values: list[float], device: torch.device, op=dist.ReduceOp.MAX) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def slowest_medians(samples: list[list[float]], device: torch.device) -> list[float]:
    """Per point, the median over repetitions of the slowest rank's time in each repetition.

    ``samples[i][r]``: this rank's seconds of point ``i`` in repetition ``r`` (every rank the
    same counts). Collective over the default group; every rank gets the same list."""
    reps = len(samples[0]) if samples else 0
    flat = ranks_reduce([t for mine in samples for t in mine], device)
    return [statistics.median(flat[i * reps:(i + 1) * reps]) for i in range(len(samples))]


def lockstep_medians(fns: Sequence, *, repeats: int, device: torch.device | str = "cpu", group=None,
                     on_round=None, warm_up: bool = True) -> list[float]:
    """Seconds of each of ``fns`` as a training step sees it: every rank runs it at once, each
    repetition starts after a barrier on ``group`` (default: every rank), and the figure is the
    median over repetitions of the slowest rank's time. One untimed warm-up call of each first
    (``warm_up=False``: the caller warmed them up);
    then ``repeats`` rounds over all of them (round-robin: a burst of outside load spreads over
    every one instead of spoiling most repetitions of a few). ``on_round(r)``: called before
    round ``r`` (progress lines). Collective over all ranks; every rank gets the same list."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    device = torch.device(device)
    for fn in fns if warm_up else ():  # warm-up: connections, allocator, first-touch pages, kernel selection
        fn()
    samples: list[list[float]] = [[] for _ in fns]
    for r in range(repeats):
        if on_round is not None:
            on_round(r)
        for fn, mine in zip(fns, samples):
            mine.append(_timed(fn, group, device))
    return slowest_medians(samples, device)


def lockstep_median(fn, *, repeats: int, device: torch.device | str = "cpu", group=None) -> float:
    """``lockstep_medians`` of one callable."""
    return lockstep_medians([fn], repeats=repeats, device=device, group=group)[0]


def measure_axis(device_mesh, axis: int, sizes: Sequence[int], *, device: torch.device | str = "cpu",
                 repeats: int = 5, kinds: Sequence[str] = KINDS, verbose: bool = False) -> list[Timing]:
    """Time ``kinds`` x ``sizes`` on every group of mesh ``axis`` at once (the training pattern).

    Collective over all ranks; every rank returns the same list (per point, the median over
    repetitions of the slowest rank's time).
    """
    return measure_group(device_mesh, (axis,), sizes, device=device, repeats=repeats, kinds=kinds, verbose=verbose)


def spanning_group(device_mesh, axes: Sequence[int]):
    """This rank's process group over mesh ``axes`` together: the axis's own for one axis, else
    the mesh flattened over them, formed as the runtime forms the group a gradient bucket's sum
    over several axes runs on (``ProcessMesh.group_over``). Collective over every rank the
    first time for a set of axes."""
    axes = tuple(sorted(axes))
    if len(axes) == 1:
        return device_mesh.get_group(axes[0])
    names = device_mesh.mesh_dim_names
    if not names:
        raise ValueError(f"a group over mesh axes {axes} needs a device mesh with axis names")
    return device_mesh[tuple(names[a] for a in axes)]._flatten().get_group(0)


def measure_group(device_mesh, axes: Sequence[int], sizes: Sequence[int], *, device: torch.device | str = "cpu",
                  repeats: int = 5, kinds: Sequence[str] = KINDS, verbose: bool = False) -> list[Timing]:
    """``measure_axis`` on the group spanning mesh ``axes`` (``spanning_group``): every such
    group at once, the same points, the same lockstep medians."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    device = torch.device(device)
    axes = tuple(sorted(axes))
    group = spanning_group(device_mesh, axes)
    n = math.prod(device_mesh.shape[a] for a in axes)
    points = [(k, int(s)) for k in kinds for s in sizes]
    ops = [_op(k, s, n, group, device) for k, s in points]
    where = f"axis {axes[0]}" if len(axes) == 1 else f"axes {axes}"

    def on_round(r: int) -> None:
        if verbose and dist.get_rank() == 0:
            print(f"[calibrate] {where} (n={n}): round {r + 1}/{repeats} of {len(points)} "
                  f"collectives ({', '.join(kinds)})", flush=True)

    seconds = lockstep_medians(ops, repeats=repeats, device=device, group=group, on_round=on_round)
    out = [Timing(axes[0], k, s, t, axes) for (k, s), t in zip(points, seconds)]
    if verbose and dist.get_rank() == 0:
        for timing in out:
            print(f"[calibrate] n={n} {timing}", flush=True)
    return out
