"""Calibration: measure this machine the way a training step uses it, into a ``MeshSpec``.

``calibrate(shape, ...)`` runs inside an existing process group (``torchrun``; the default group
is initialised from the environment when it is not yet) or on ``local=N`` forked gloo/NCCL
processes (``autopar.runtime.launch.run_local``). Every rank is busy at once, every timed
repetition starts in lockstep (a barrier), and every figure is the median over repetitions of
the slowest rank's time in each (``links.lockstep_medians``), never a best-of: a lucky
repetition that had the machine to itself is not what a step gets. Three stages, each printing
its progress with ``verbose``:

1. **compute** (``calibrate_compute``): achieved FLOP/s of matmul/bmm and attention and bytes/s
   of elementwise and normalisation ops over a grid of sizes, in fp32, bf16 and fp16 -> a
   ``ComputeProfile``; the mesh's roofline peaks are its steady states; and the cost of one
   op however small (a chain of 0-dim ops forward and backward: ``kernel_floor_s``); and how many
   times ``add``'s time per byte math functions take, forward and backward (``tanh``, ``exp``,
   ``sqrt`` ...: ``MachineProfile.pointwise``, ``measure_pointwise``).
2. **collectives** (``links.measure_axis``): all-reduce, all-gather, reduce-scatter and
   all-to-all over a range of sizes on every mesh axis of size > 1 -> one alpha/beta per axis
   over all kinds (``MeshSpec.alpha``/``beta``) and one per kind and axis (``LinkFit``); then
   the same on the group spanning each set of two or more such axes (``links.measure_group``,
   ``spanned_axis_sets``: the mesh flattened over them, as a gradient bucket's sum over several
   axes runs) -> one ``LinkFit`` per kind and set: a 4-rank group's latency is not its 2-rank
   axes' (``layout.cost``).
3. **overlap**: an asynchronous all-reduce alone (``t_comm``), a matmul loop of about the same
   length alone (``t_comp``) and both at once (``t_both``), over every rank:
   ``comm_overlap = (t_comm + t_comp - t_both) / min(t_comm, t_comp)`` clamped to [0, 1]; and
   an MLP stack's forward on every rank against the same on half of them while the rest wait:
   ``MachineProfile.idle_speedup`` (what a pipeline bubble's busy ranks gain where ranks share
   cores; 1 without measuring where every rank computes on cores of its own, ``shares_cores``);
   and per mesh axis, what a blocking collective costs mid-step beyond its lockstep time
   (``measure_blocking``: ``MachineProfile.blocking_s``), and per set of several axes what a
   blocking sum over them -- the runtime's chain of per-axis all-reduces -- costs beyond its
   group's lockstep price (``MachineProfile.blocking_over``); and, where mesh axis 0 can form a
   pipeline of 2 stages or more, what one action of torch's pipeline schedule costs beyond its
   transfers (``calibrate_pipeline``: ``MachineProfile.pipeline_action_s``; None elsewhere), or,
   where the links' fit prices its transfers above the whole micro-batch, a transfer's latency
   (``MachineProfile.pipeline_transfer_s``).

All ranks return the same ``MeshSpec`` (with its ``MachineProfile``); ``out=`` writes it (rank 0).
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
import time
from dataclasses import replace
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.layout.cost import collective_seconds, pipeline_transfer_seconds
from autopar.layout.machine import FLOP_KEYED, LinkFit, MachineProfile, overlap_fraction
from autopar.layout.mesh import MeshSpec, default_axis_names, parse_mesh_shape
from autopar.runtime.dist_ops import blocking, issue, wait
from autopar.runtime.seats import configure_waits, ranks_share_cores, shares_cores
from autopar.runtime.calibrate_pipeline import measure_pipeline_action, pipeline_bytes, split_microbatch
from autopar.runtime.calibrate_compute import (GRID, MIN_REPETITION_S, QUICK_GRID, QUICK_REPETITION_S, device_figures,
                                               measure_compute, measure_kernel_floor, measure_pointwise)
from autopar.runtime.links import (DEFAULT_SIZES, KINDS, MeshProfile, Timing, default_device, fit_alpha_beta,
                                   lockstep_median, lockstep_medians, measure_axis, measure_group, rank_device,
                                   ranks_reduce, ring_factor)

__all__ = ["calibrate", "calibrate_detailed", "measure_blocking", "measure_overlap", "ranks_share_cores",
           "shares_cores", "spanned_axis_sets", "QUICK_SIZES"]

KiB, MiB = 1024, 1024**2
QUICK_SIZES = {"cpu": [64 * KiB, 1 * MiB, 4 * MiB], "cuda": [1 * MiB, 8 * MiB, 64 * MiB]}
OVERLAP_BYTES = {"cpu": 4 * MiB, "cuda": 256 * MiB}
_PROBE = 8  # products in the first guess of the overlap stage's compute loop
# The idle-speedup burst: the forward of an MLP stack of this many layers on 1024 tokens of
# width 256 (~45 ms on half of 4 ranks sharing 2 cores; long beside a scheduler's time slice).
_IDLE_LAYERS = 4
# The blocking stage: a small all-reduce (a batch norm's statistics, a loss term) after each of
# ``_BLOCKING_CALLS`` compute bursts of about ``_BURST_S``, as a step's in-graph collectives come
# between its ops; ``_BLOCKING_ROUNDS`` rounds at least (the figure is a median of differences).
# The burst is as long as the compute between a step's blocking collectives: what one holds grows
# with it (2 ranks on 2 cores: 1.1 ms after 0.25 ms bursts, 1.3-1.8 after 1 ms, 3.0-3.3 after
# 4 ms), and a ResNet's channel-split convolutions or a decoder's Megatron sums run 3-15 ms
# apart (a 1 ms burst priced the ResNet's 12 blocking sums 1.1 ms each; they held 2-4 ms).
BLOCKING_BYTES = 4 * KiB
_BLOCKING_CALLS = 16
_BURST_S = 4e-3
_BLOCKING_ROUNDS = 31


class _Stages:
    """Progress lines on rank 0: ``[calibrate 12.3s] stage 2/3 collectives: ...``."""

    def __init__(self, verbose: bool) -> None:
        self.verbose = verbose and dist.get_rank() == 0
        self.start = time.perf_counter()
        self.stage = ""

    def __call__(self, text: str) -> None:
        if self.verbose:
            print(f"[calibrate {time.perf_counter() - self.start:6.1f}s] {self.stage}{text}", flush=True)


# ----------------------------------------------------------------------------------- overlap
def measure_overlap(*, nbytes: int, repeats: int, device: torch.device) -> tuple[float, dict[str, float]]:
    """Fraction of an asynchronous all-reduce of ``nbytes`` over every rank that runs hidden under
    a concurrent matmul loop of about its length, and the three times it comes from."""
    full = torch.ones(max(1, nbytes // 4), device=device)
    a = torch.randn(256, 256, device=device)

    def comm() -> None:
        blocking(dist.all_reduce, full)

    def matmuls(count: int) -> Callable[[], None]:
        def run() -> None:
            for _ in range(count):
                torch.mm(a, a)
        return run

    t_comm = lockstep_median(comm, repeats=repeats, device=device)
    # The loop is sized to about t_comm (the fraction is of the shorter one; a loop far longer
    # or shorter measures little): a first guess from a probe of a few products, rescaled while
    # it misses by more than 2x (load changes between the probe and the loop). Every rank runs
    # the same count, so no rank's compute outlasts the others'.
    loops, t_comp = _PROBE, lockstep_median(matmuls(_PROBE), repeats=repeats, device=device)
    for _ in range(3):
        if 0.5 <= t_comm / t_comp <= 2.0:
            break
        loops = int(ranks_reduce([float(max(1, round(loops * t_comm / t_comp)))], device)[0])
        t_comp = lockstep_median(matmuls(loops), repeats=repeats, device=device)
    compute = matmuls(loops)

    def both() -> None:
        work = issue(dist.all_reduce, full)  # waited for as the runtime waits for a gradient bucket
        compute()
        wait(work)

    # The three figures come from the same rounds (comm, compute, both back to back in each):
    # the fraction is a difference of them, and timed one after another a change of outside
    # load between them swung it from 0 to 0.9 on a shared host.
    t_comm, t_comp, t_both = lockstep_medians([comm, compute, both], repeats=repeats, device=device)
    return overlap_fraction(t_comm, t_comp, t_both), {"comm": t_comm, "compute": t_comp, "both": t_both}


def measure_idle_speedup(*, repeats: int, device: torch.device,
                         layers: int = _IDLE_LAYERS) -> tuple[float, dict[str, float]]:
    """How much faster the lower half of the ranks run a step-like burst while the upper half waits
    (at the next barrier, as a pipeline rank in its bubble waits on a receive) than while every
    rank runs it: ``t_all / t_half``, at least 1, at most the world size. 1 on a GPU per rank.

    The burst is an MLP stack's forward (linear layers, GELU, layer norm), its activations held
    as a forward holds them for backward: the work a pipeline's busy ranks do. What the waiting
    ranks lend depends on the work. On 4 gloo ranks sharing 2 cores, measured back to back: a
    loop of 256^3 products ran 1.5-1.6x faster on half the ranks, a memory-bound elementwise loop
    2.3x, this burst 1.9x -- and a two-stage, two-micro-batch 1F1B pipeline of GPT-2 and of a
    Qwen2 decoder measured 13% faster than data parallelism, which only a bubble of nearly no cost
    explains (a product loop's 1.5 priced it 10% slower). ``planner.pipeline.schedule.bubble``
    turns the figure into what the waiting half of the ranks costs a pipeline's step. ``layers``:
    the stack's depth (one in a quick calibration: a noisier figure, a quarter of the time)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    x = torch.randn(1024, 256, device=device)
    up, down = torch.randn(1024, 256, device=device), torch.randn(256, 1024, device=device)

    def burst() -> None:
        held, h = [], x
        for _ in range(layers):
            u = F.linear(h, up)
            g = F.gelu(u)
            h = F.layer_norm(F.linear(g, down) + h, (h.shape[-1],))
            held += [u, g, h]

    def half() -> None:
        if rank < max(1, world // 2):
            burst()

    t_all, t_half = lockstep_medians([burst, half], repeats=repeats, device=device)
    return min(max(t_all / t_half, 1.0), float(world)), {"all": t_all, "half": t_half}


def measure_blocking(groups, *, rounds: int, device: torch.device, nbytes: int = BLOCKING_BYTES,
                     calls: int = _BLOCKING_CALLS) -> tuple[float, dict[str, float]]:
    """The seconds a synchronous all-reduce of ``nbytes`` over ``groups`` holds a step, per call,
    where it comes between compute as a step's in-graph collectives do; and the figures beside it.
    ``groups``: one process group, or a sequence of them summed over one after another -- a sum
    over several mesh axes as the runtime issues it, a chain of per-axis all-reduces
    (``runtime.kernels.all_reduce_axes``).

    Two callables, timed in lockstep (``links.lockstep_medians``) in each of ``rounds`` rounds,
    interleaved: ``calls`` compute bursts of about ``_BURST_S`` each (``bursts``), and the same
    bursts each followed by a blocking all-reduce with no barrier between them (``chain``: the
    ranks reach each all-reduce apart, by what their bursts' times differ, and wait in it asleep,
    as in a step). Per round ``(chain - bursts) / calls``; the figure is the median over rounds, a
    difference taken within each round so that load changing between rounds cancels. Beside it:
    its quartiles over rounds (``low``, ``high``: the spread) and the median burst (``burst``).
    Calibration subtracts the lockstep price of the same all-reduce (the links' fit) to get
    ``MachineProfile.blocking_s``."""
    chain_of = list(groups) if isinstance(groups, (list, tuple)) else [groups]
    x = torch.ones(max(1, nbytes // 4), device=device)
    a = torch.randn(128, 128, device=device)

    def burst(count: int) -> Callable[[], None]:
        def run() -> None:
            for _ in range(count):
                torch.mm(a, a).relu()  # a fresh output per product, as a step's ops allocate theirs
        return run

    # Every rank runs the same burst: sized on the slowest rank's probe of a few products.
    t_probe = lockstep_median(burst(_PROBE), repeats=5, device=device)
    count = int(ranks_reduce([float(max(1, round(_PROBE * _BURST_S / t_probe)))], device)[0])
    one = burst(count)

    def bursts() -> None:
        for _ in range(calls):
            one()

    def chain() -> None:
        for _ in range(calls):
            one()
            for group in chain_of:
                blocking(dist.all_reduce, x, group=group)

    held, lengths = [], []
    for r in range(rounds):
        t_bursts, t_chain = lockstep_medians([bursts, chain], repeats=1, device=device, warm_up=r == 0)
        held.append((t_chain - t_bursts) / calls)
        lengths.append(t_bursts / calls)
    low, mid, high = statistics.quantiles(held, n=4) if len(held) > 1 else held * 3
    return mid, {"low": low, "high": high, "burst": statistics.median(lengths)}


# ------------------------------------------------------------------------------- collectives
def _fit_links(axes: tuple[int, ...], n: int, measured: list[Timing],
               say: Callable[[str], None]) -> tuple[float, float, list]:
    """The group's all-kind (alpha, beta) and its per-kind ``LinkFit``s. A kind whose timings do
    not grow with size gets no fit of its own: on one axis the axis's all-kind figures price it
    (``MeshSpec.alpha``/``beta``); over several axes, where no mesh field holds them, the group's
    all-kind fit is recorded as that kind's."""
    where = f"axis {axes[0]}" if len(axes) == 1 else f"axes {axes}"
    alpha, beta = fit_alpha_beta([(t.nbytes * ring_factor(t.kind, n), t.seconds) for t in measured])
    say(f"{where} (n={n}) all kinds: alpha {alpha * 1e6:.1f} us, beta {beta * 1e9:.3f} ns/B "
        f"({1 / beta / 1e9:.2f} GB/s)")
    fits = []
    for kind in KINDS:
        mine = [(t.nbytes * ring_factor(kind, n), t.seconds) for t in measured if t.kind == kind]
        if len(mine) < 2:
            continue
        try:
            a, b = fit_alpha_beta(mine)
        except ValueError as exc:
            if len(axes) == 1:
                say(f"{where} {kind}: no fit of its own ({exc}); it is priced by the all-kind fit")
                continue
            say(f"{where} {kind}: no fit of its own ({exc}); the group's all-kind fit is recorded as its own")
            a, b = alpha, beta
        fits.append(LinkFit.over(kind, axes, a, b))
        say(f"{where} (n={n}) {kind}: alpha {a * 1e6:.1f} us, beta {b * 1e9:.3f} ns/B ({1 / b / 1e9:.2f} GB/s)")
    return alpha, beta, fits


def spanned_axis_sets(shape: Sequence[int]) -> list[tuple[int, ...]]:
    """Every set of two or more mesh axes of size > 1: the groups a collective over several axes
    runs on (a gradient bucket's sum, ``ProcessMesh.group_over``), each priced by its own fit
    (``layout.cost``). One on a 2-D mesh, four on a 3-D one of three such axes."""
    wide = [a for a, n in enumerate(shape) if n > 1]
    return [c for k in range(2, len(wide) + 1) for c in itertools.combinations(wide, k)]


def _collectives(device_mesh, shape: tuple[int, ...], sizes: Sequence[int], repeats: int, device: torch.device,
                 say: Callable[[str], None]) -> tuple[list[float], list[float], list[LinkFit], list[Timing]]:
    """Per axis: the all-kind alpha and beta (0 on an axis of size 1); the per-kind fits of each
    axis and of each set of several axes (``spanned_axis_sets``); the timings."""
    timings: list[Timing] = []
    alpha, beta, links = [], [], []
    for axis, n in enumerate(shape):
        if n == 1:
            alpha.append(0.0)
            beta.append(0.0)
            continue
        measured = measure_axis(device_mesh, axis, sizes, device=device, repeats=repeats)
        timings += measured
        a, b, fits = _fit_links((axis,), n, measured, say)
        alpha.append(a)
        beta.append(b)
        links += fits
    for axes in spanned_axis_sets(shape):
        measured = measure_group(device_mesh, axes, sizes, device=device, repeats=repeats)
        timings += measured
        links += _fit_links(axes, math.prod(shape[a] for a in axes), measured, say)[2]
    return alpha, beta, links, timings


# ------------------------------------------------------------------------------------ driver
def _in_group(shape: tuple[int, ...], device_type: str, sizes: Sequence[int], repeats: int, quick: bool,
              verbose: bool) -> MeshProfile:
    from torch.distributed.device_mesh import init_device_mesh

    device = rank_device(device_type)
    load = os.getloadavg()[0]
    names = default_axis_names(len(shape))
    device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    say = _Stages(verbose)
    # Collectives are timed waited for as the runtime will wait for them on these ranks.
    polled = configure_waits(device)
    say.stage = "stage 1/3 compute: "
    compute, measured = measure_compute(QUICK_GRID if quick else GRID, repeats=repeats, device=device, progress=say,
                                        min_repetition_s=QUICK_REPETITION_S if quick else MIN_REPETITION_S)
    for kernel, rate in measured:
        unit = "GFLOP/s" if kernel.op_class in FLOP_KEYED else "GB/s"
        say(f"{kernel.dtype} {kernel.label}: {rate / 1e9:.2f} {unit}")
    floor = measure_kernel_floor(repeats=max(repeats, 9), device=device,
                                 min_repetition_s=QUICK_REPETITION_S if quick else MIN_REPETITION_S)
    say(f"kernel floor (one small op, forward and backward): {floor * 1e6:.1f} us")
    pointwise = measure_pointwise(repeats=repeats, device=device,
                                  min_repetition_s=QUICK_REPETITION_S if quick else MIN_REPETITION_S)
    say("pointwise math over add's rate per byte, forward/backward: "
        + ", ".join(f"{op} {f:.1f}/{b:.1f}" for op, f, b in pointwise))
    say.stage = "stage 2/3 collectives: "
    say("ranks poll their collectives (each has cores of its own)" if polled else "ranks sleep in their collectives")
    alpha, beta, links, timings = _collectives(device_mesh, shape, sizes, repeats, device, say)
    say.stage = "stage 3/3 overlap, blocking and pipeline: "
    overlap = 0.0
    if math.prod(shape) > 1:
        # A difference of three noisy times: more repetitions than elsewhere (it is one point).
        overlap, parts = measure_overlap(nbytes=OVERLAP_BYTES[device_type], repeats=max(repeats, 9), device=device)
        say(f"all-reduce {parts['comm'] * 1e3:.2f} ms, compute {parts['compute'] * 1e3:.2f} ms, both "
            f"{parts['both'] * 1e3:.2f} ms: {overlap:.0%} of the collective hidden")
    rounds = max(repeats, 5 if quick else _BLOCKING_ROUNDS)
    held = [measure_blocking(device_mesh.get_group(axis), rounds=rounds, device=device) if n > 1 else None
            for axis, n in enumerate(shape)]
    # A blocking sum over several axes runs as a chain of per-axis all-reduces: timed so.
    held_over = {axes: measure_blocking([device_mesh.get_group(a) for a in axes], rounds=rounds, device=device)
                 for axes in spanned_axis_sets(shape)}
    speedup = 1.0
    if math.prod(shape) > 1:
        if ranks_share_cores(device):
            speedup, parts = measure_idle_speedup(repeats=max(repeats, 5 if quick else 9), device=device,
                                                  layers=1 if quick else _IDLE_LAYERS)
            say(f"an MLP stack's forward {parts['all'] * 1e3:.2f} ms on every rank, {parts['half'] * 1e3:.2f} ms "
                f"on half of them: {speedup:.2f}x while the other half waits")
        else:
            # Where every rank has cores (or a device) of its own, a waiting rank lends the busy ones
            # nothing. The burst still ran 1.33x faster on one of 2 ranks on 2 cores (memory
            # bandwidth), but GPT-2's 1F1B over those 2 ranks measured 259-265 ms against 225 priced
            # with a full bubble, and 203 with the burst's figure: the bubble cost all of it.
            say("every rank computes on cores of its own: a pipeline's waiting ranks lend the others nothing "
                "(idle speedup 1)")
    # A pipeline runs over mesh axis 0 (``planner.pipeline``): its groups run one each, at once.
    pipelined = measure_pipeline_action(device_mesh.get_group(0), repeats=max(repeats, 5 if quick else 11),
                                        device=device) if shape[0] > 1 else None
    note = (f"{'quick ' if quick else ''}calibration of {shape} on {os.uname().nodename}, {device_type}, "
            f"{repeats} repetitions, load {load:.2f} at the start, "
            f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}")
    machine = MachineProfile(compute=compute, links=tuple(links), measured_shape=shape, measured_axis_names=names,
                             note=note, idle_speedup=speedup, kernel_floor_s=floor, pointwise=pointwise)
    flops, half, bandwidth = device_figures(compute)
    mesh = MeshSpec(shape=shape, axis_names=names, alpha=tuple(alpha), beta=tuple(beta), peak_flops=flops,
                    mem_bandwidth=bandwidth, mem_capacity=_mem_capacity(device), name=f"profiled-{device_type}",
                    half_peak_flops=half, comm_overlap=overlap, machine=machine)
    # What a blocking collective holds a step for beyond the lockstep price the fits give it.
    blocking = []
    for axis, measured in enumerate(held):
        if measured is None:
            blocking.append(0.0)
            continue
        seconds, parts = measured
        lockstep = collective_seconds("all_reduce", BLOCKING_BYTES, mesh, axis)
        blocking.append(max(seconds - lockstep, 0.0))
        say(f"axis {axis}: a blocking {BLOCKING_BYTES // KiB} KiB all-reduce after each {parts['burst'] * 1e3:.2f} ms "
            f"burst holds the step {seconds * 1e6:.0f} us (quartiles over rounds {parts['low'] * 1e6:.0f} to "
            f"{parts['high'] * 1e6:.0f} us), priced {lockstep * 1e6:.0f} us in lockstep: "
            f"{blocking[-1] * 1e6:.0f} us more per blocking collective")
    blocking_over = []
    for axes, (seconds, parts) in held_over.items():
        lockstep = collective_seconds("all_reduce", BLOCKING_BYTES, mesh, axes, blocking=False)
        blocking_over.append((axes, max(seconds - lockstep, 0.0)))
        say(f"axes {axes}: a blocking {BLOCKING_BYTES // KiB} KiB sum over them (a chain of per-axis all-reduces) "
            f"holds the step {seconds * 1e6:.0f} us (quartiles {parts['low'] * 1e6:.0f} to {parts['high'] * 1e6:.0f} "
            f"us), priced {lockstep * 1e6:.0f} us in lockstep on their group: {blocking_over[-1][1] * 1e6:.0f} us more")
    action = transfer = None
    if pipelined is not None:
        per_microbatch, parts = pipelined
        # The links' price of what a stage's micro-batch sends: its activation forward, its
        # gradient back (``planner.pipeline.costs.StageCosts.p2p_s``; no transfer latency measured yet).
        p2p = 2 * pipeline_transfer_seconds(mesh, pipeline_bytes())
        transfer, action = split_microbatch(per_microbatch, alpha=mesh.alpha[0], beta=mesh.beta[0])
        lower = "" if transfer is None else f"; a transfer's latency {transfer * 1e3:.3f} ms, not the links' alpha"
        say(f"1F1B over axis 0 (trivial stages): {parts['lo'] * 1e3:.2f} ms at {parts['m_lo']:.0f} micro-batches, "
            f"{parts['hi'] * 1e3:.2f} ms at {parts['m_hi']:.0f}: {per_microbatch * 1e3:.3f} ms per micro-batch, "
            f"{p2p * 1e3:.3f} ms of it priced as transfers: {action * 1e3:.3f} ms per schedule action{lower}")
    mesh = replace(mesh, machine=replace(machine, blocking_s=tuple(blocking), blocking_over=tuple(blocking_over),
                                         pipeline_action_s=action, pipeline_transfer_s=transfer))
    say.stage = ""
    say(f"done: fp32 matmul {flops / 1e9:.1f} GFLOP/s, bf16 {half / 1e9 if half else math.nan:.1f} GFLOP/s, "
        f"memory {bandwidth / 1e9:.2f} GB/s, overlap {overlap:.0%}")
    return MeshProfile(mesh=mesh, timings=tuple(timings))


def _mem_capacity(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _local_worker(rank: int, world_size: int, *args) -> MeshProfile:
    return _in_group(*args)


def _checked(shape, device: str | None, sizes, repeats, quick: bool) -> tuple[tuple[int, ...], str, list[int], int]:
    shape = parse_mesh_shape(shape)
    device_type = default_device()[0] if device is None else torch.device(device).type
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"calibrate supports device 'cpu' or 'cuda', got {device!r}")
    if not isinstance(quick, bool):
        raise ValueError(f"quick must be a bool, got {quick!r}")
    sizes = list((QUICK_SIZES if quick else DEFAULT_SIZES)[device_type] if sizes is None else sizes)
    if len(sizes) < 2 or any(isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in sizes):
        raise ValueError(f"sizes must be >= 2 positive byte counts, got {sizes!r}")
    repeats = (3 if quick else 5) if repeats is None else repeats
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    return shape, device_type, sizes, repeats


def calibrate_detailed(shape: Sequence[int] | str, *, local: int | None = None, quick: bool = False,
                       device: str | None = None, sizes: list[int] | None = None, repeats: int | None = None,
                       backend: str | None = None, verbose: bool = False) -> MeshProfile:
    """Like ``calibrate`` but also returns the collective timings the link fits came from."""
    shape, device_type, sizes, repeats = _checked(shape, device, sizes, repeats, quick)
    backend = backend or ("nccl" if device_type == "cuda" else "gloo")
    world = math.prod(shape)
    args = (shape, device_type, sizes, repeats, quick, verbose)
    if local is not None:
        if local != world:
            raise ValueError(f"local={local} processes cannot form mesh {shape} of {world} devices")
        from autopar.runtime.launch import run_local

        return run_local(_local_worker, local, *args, backend=backend, timeout=900)[0]
    created = False
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise ValueError("calibrate needs a process group: run it under torchrun, or pass local=N to start N "
                             "local processes")
        dist.init_process_group(backend)
        created = True
    try:
        if dist.get_world_size() != world:
            raise ValueError(f"mesh {shape} needs {world} ranks, the process group has {dist.get_world_size()}")
        return _in_group(*args)
    finally:
        if created:
            dist.destroy_process_group()


def calibrate(shape: Sequence[int] | str, *, local: int | None = None, quick: bool = False,
              out: str | os.PathLike | None = None, device: str | None = None, sizes: list[int] | None = None,
              repeats: int | None = None, backend: str | None = None, verbose: bool = False) -> MeshSpec:
    """Measure this machine for a ``shape`` mesh (module docstring); returns the ``MeshSpec``
    carrying its ``MachineProfile`` and ``comm_overlap``, and writes it to ``out`` (rank 0) when
    given: pass that path wherever a preset name goes (``plan(..., preset=path)``, ``autopar
    inspect --preset path``). ``device``: ``"cpu"`` or ``"cuda"``; None: CUDA where it is
    available (``links.default_device``), each rank on GPU ``LOCAL_RANK``, NCCL unless ``backend``
    says otherwise. ``local=N``: start N gloo (NCCL on CUDA) processes (else run under
    ``torchrun`` on every rank). ``quick``: a smaller grid and fewer sizes and repetitions (tests).
    ``sizes``: collective full-tensor bytes; ``repeats``: timed repetitions (default 5, quick 3)."""
    spec = calibrate_detailed(shape, local=local, quick=quick, device=device, sizes=sizes, repeats=repeats,
                              backend=backend, verbose=verbose).mesh
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if out is not None and (local is not None or rank == 0):
        spec.save(os.fspath(out))
    return spec

