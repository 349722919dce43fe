"""Compute throughput as a training step gets it: the compute half of ``autopar.runtime.calibrate``.

Every rank runs the same grid of kernels at once (so the ranks contend for cores and memory
exactly as they do in a step), each timed repetition starting after a barrier, and the figure of
a kernel is the median over repetitions of the slowest rank's time (``links.lockstep_medians``).
A repetition runs a kernel ``inner`` times back to back (agreed by all ranks), enough for about
``MIN_REPETITION_S``: a 10-microsecond product is not lost in the timer's noise, and on a shared
host a repetition spans several scheduler time slices, as a step does (a 1 ms burst can run
between preemptions at a speed no step sees). A repetition holds every call's output until it
ends (up to ``HOLD_BYTES``: ``_repeated``), so that each call writes where a step's ops write.
Per (class, dtype) the points are probed smallest first, and once one call takes longer than
``SLOW_CALLS`` repetitions the larger points are left out (``_inner_counts``): CPU fp16
convolutions' backward, at 0.14 GFLOP/s, held a (2, 2) calibration over a minute.

The grid, per dtype (fp32, bf16, fp16):

- ``matmul``: the three products of a linear layer's training step at a few (tokens, in, out) --
  forward ``x @ w.T``, input gradient ``dy @ w``, weight gradient ``dy.T @ x``, all of one FLOP
  count, so one size's rate is their mean: the products a step runs, not square ones, whose rate
  they do not share (in one run on this 2-core host, 512 tokens of a 256 -> 1024 layer's forward
  ran at 80 GFLOP/s and its input gradient at 106, a 512-cube at 95; the rate at 67 MFLOP was a
  lone K=64 ``bmm``'s, 25% below the 512 x 256 x 256 products it priced) -- plus a few skinny
  ``mm`` (M, N, K) and ``bmm`` batches, keyed by the FLOPs of one call (``2 M N K``, times the
  batch);
- ``attention``: ``scaled_dot_product_attention`` at a few (sequence, head dim), keyed by torch's
  own FLOP count (``torch.utils.flop_counter.sdpa_flop_count``);
- ``conv``: ``conv2d`` at a few (batch, channels, image size, kernel), keyed by its FLOPs, and
  ``conv_backward``: the same convolution's input and weight gradients, keyed by their FLOPs
  (both counted by ``torch.utils.flop_counter``, as the tracer's profile counts them);
- ``elementwise``: ``add`` of two tensors, keyed by the bytes one call reads and writes, each call
  on inputs no recent call read (``_cold_copies``: past the last-level cache, as a step's
  elementwise ops read activations written a while ago);
- ``norm``: ``layer_norm`` over rows of 1024, keyed likewise;
- ``batch_norm``: training-mode ``batch_norm`` of an NCHW tensor, keyed by the bytes of its
  tensor arguments and output (what ``strategies.combine`` charges an op), and
  ``batch_norm_backward``: its input and affine gradients, keyed by twice those;
- ``pool``: ``max_pool2d`` (3x3, stride 2: a ResNet stem's) keyed by its input and output bytes,
  and ``pool_backward``: its input gradient, keyed by twice those (what the cost model charges a
  backward: ``strategies.combine``);
- ``optimizer`` (fp32 only): one ``AdamW(foreach=True)`` step over 16 parameters of one size,
  keyed by one parameter's bytes, rate in parameter bytes per second (``layout.cost.optimizer_seconds``),
  every 4x from 1 KiB: the step's time per parameter is flat up to a few KiB (its per-tensor work),
  which a grid 16x apart blurred into a slope that made a ZeRO shard of a bias look cheaper.

Only ``conv``, ``pool`` and ``batch_norm`` have backward tables (``layout.machine.BACKWARD_CLASSES``): the cost
model prices other classes' backward FLOPs (or bytes) at the forward rate for that size.

Apart from the grid, ``measure_kernel_floor`` times what an op costs however small (its dispatch
and launch: ``MachineProfile.kernel_floor_s``), which the grid's smallest calls do not show -- a
size below them takes their rate -- and which sets a small model's step on a GPU.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from autopar.layout.machine import DTYPES, POINTWISE_MEASURED, ComputeProfile, RateTable
from autopar.runtime.links import lockstep_medians, ranks_reduce, sync_device

__all__ = ["Grid", "Kernel", "GRID", "QUICK_GRID", "kernels", "measure_compute", "measure_pointwise", "device_figures"]

MIN_REPETITION_S = 10e-3
QUICK_REPETITION_S = 2e-3
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, slots=True)
class Grid:
    """What to measure: linear layers (tokens, in, out), each as its three products of a step, mm
    (M, N, K), bmm (B, M, N, K), attention (sequence, head dim) at batch 1
    and 4 heads, conv2d (batch, channels in = out, image side, kernel side; stride 1, same
    padding), elementwise numels, layer-norm rows of ``NORM_WIDTH``, max-pool inputs (batch,
    channels, image side), batch-norm inputs (batch, channels, image side), optimizer parameter
    numels (16 parameters each)."""

    linear: tuple[tuple[int, int, int], ...]
    mm: tuple[tuple[int, int, int], ...]
    bmm: tuple[tuple[int, int, int, int], ...]
    attention: tuple[tuple[int, int], ...]
    conv: tuple[tuple[int, int, int, int], ...]
    elementwise: tuple[int, ...]
    norm_rows: tuple[int, ...]
    pool: tuple[tuple[int, int, int], ...]
    batch_norm: tuple[tuple[int, int, int], ...]
    optimizer: tuple[int, ...]


NORM_WIDTH = 1024
GRID = Grid(linear=((64, 64, 64), (256, 256, 256), (512, 256, 256), (512, 256, 1024), (1024, 1024, 1024)),
            mm=((16, 1024, 1024), (1024, 16, 1024), (2048, 64, 2048)),
            bmm=((8, 64, 64, 64), (8, 256, 256, 64)),
            attention=((128, 32), (128, 64), (512, 64), (1024, 64)),
            conv=((2, 16, 16, 3), (4, 32, 32, 3), (4, 64, 16, 3), (4, 128, 8, 3), (8, 64, 32, 3), (4, 64, 16, 1)),
            elementwise=(1 << 14, 1 << 17, 1 << 20, 1 << 22),
            norm_rows=(16, 256, 4096),
            pool=((2, 16, 16), (4, 32, 32), (8, 64, 32)),
            batch_norm=((2, 16, 16), (4, 32, 32), (4, 128, 16), (8, 64, 32)),
            optimizer=(1 << 8, 1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18))
QUICK_GRID = Grid(linear=((64, 64, 64), (256, 256, 256)), mm=((16, 512, 512),), bmm=((4, 64, 64, 64),),
                  attention=((128, 64), (256, 64)), conv=((2, 16, 16, 3), (4, 32, 16, 3)),
                  elementwise=(1 << 14, 1 << 20), norm_rows=(16, 1024), pool=((2, 16, 16), (4, 32, 16)),
                  batch_norm=((2, 16, 16), (4, 32, 16)),
                  optimizer=(1 << 8, 1 << 14))


@dataclass(frozen=True, slots=True)
class Kernel:
    """One grid point: ``run()`` makes ``count`` calls of ``size`` FLOPs (compute-bound classes)
    or bytes (memory-bound ones) each (an optimizer step: ``count`` parameters)."""

    op_class: str
    dtype: str
    size: float
    label: str
    run: Callable[[], object]
    count: int = 1


def _matmuls(grid: Grid, dtype: str, device: torch.device) -> list[Kernel]:
    dt = TORCH_DTYPES[dtype]
    out = []
    for tokens, d_in, d_out in grid.linear:
        x, w = torch.randn(tokens, d_in, dtype=dt, device=device), torch.randn(d_out, d_in, dtype=dt, device=device)
        dy, flops = torch.randn(tokens, d_out, dtype=dt, device=device), 2.0 * tokens * d_in * d_out
        label = f"linear {tokens}x{d_in}->{d_out}"
        out += [Kernel("matmul", dtype, flops, f"{label} forward", lambda x=x, w=w: F.linear(x, w)),
                Kernel("matmul", dtype, flops, f"{label} input grad", lambda dy=dy, w=w: torch.mm(dy, w)),
                Kernel("matmul", dtype, flops, f"{label} weight grad", lambda dy=dy, x=x: torch.mm(dy.t(), x))]
    for m, n, k in grid.mm:
        a, b = torch.randn(m, k, dtype=dt, device=device), torch.randn(k, n, dtype=dt, device=device)
        out.append(Kernel("matmul", dtype, 2.0 * m * n * k, f"mm {m}x{n}x{k}", lambda a=a, b=b: torch.mm(a, b)))
    for bs, m, n, k in grid.bmm:
        a, b = torch.randn(bs, m, k, dtype=dt, device=device), torch.randn(bs, k, n, dtype=dt, device=device)
        out.append(Kernel("matmul", dtype, 2.0 * bs * m * n * k, f"bmm {bs}x{m}x{n}x{k}",
                          lambda a=a, b=b: torch.bmm(a, b)))
    return out


def _attention(grid: Grid, dtype: str, device: torch.device) -> list[Kernel]:
    out = []
    for seq, head_dim in grid.attention:
        q = torch.randn(1, 4, seq, head_dim, dtype=TORCH_DTYPES[dtype], device=device)
        flops = sdpa_flop_count(q.shape, q.shape, q.shape)
        out.append(Kernel("attention", dtype, float(flops), f"sdpa seq {seq} head_dim {head_dim}",
                          lambda q=q: F.scaled_dot_product_attention(q, q, q)))
    return out


# Bytes of inputs an elementwise kernel cycles through (``_cold_copies``): past a CPU's last-level
# cache, so each call reads memory no recent call touched.
COLD_BYTES = 64 << 20


def _cold_copies(make: Callable[[], object], nbytes: int, device: torch.device):
    """An endless cycle over copies of ``make()``'s inputs (``nbytes`` each), as many as fill
    ``COLD_BYTES`` on a CPU (one on a GPU, whose kernels stream from memory anyway): a step's
    elementwise op reads an activation some other op wrote a while ago, or one saved in forward,
    not the tensor its own previous call read, which a loop over one input finds in cache. On
    this project's 2-core host one rank's fp32 ``add`` ran at 56-90 GB/s over one input pair and
    23-33 GB/s cycling through 96 MiB of pairs, and a GPT-2 step's ``mul``/``add``/``pow`` took
    1.6-2.8 times what the one-pair rate priced them at."""
    count = max(1, COLD_BYTES // max(nbytes, 1)) if device.type == "cpu" else 1
    copies = [make() for _ in range(min(count, 4096))]
    return itertools.cycle(copies)


def _cold_add(numel: int, dtype: str, device: torch.device, label: str) -> Kernel:
    """The ``elementwise`` class's kernel: ``add`` of two ``numel`` tensors read cold (``_cold_copies``),
    keyed by the bytes the cost model charges an elementwise op (two read, one written)."""
    dt = TORCH_DTYPES[dtype]
    item = torch.empty((), dtype=dt).element_size()
    pairs = _cold_copies(lambda: (torch.randn(numel, dtype=dt, device=device),
                                  torch.randn(numel, dtype=dt, device=device)), 2 * numel * item, device)
    return Kernel("elementwise", dtype, 3.0 * numel * item, label, lambda: torch.add(*next(pairs)))


def _memory_bound(grid: Grid, dtype: str, device: torch.device) -> list[Kernel]:
    dt = TORCH_DTYPES[dtype]
    item = torch.empty((), dtype=dt).element_size()
    out = [_cold_add(numel, dtype, device, f"add {numel:,}") for numel in grid.elementwise]
    for rows in grid.norm_rows:
        x = torch.randn(rows, NORM_WIDTH, dtype=dt, device=device)
        out.append(Kernel("norm", dtype, 2.0 * x.numel() * item, f"layer_norm {rows}x{NORM_WIDTH}",
                          lambda x=x: F.layer_norm(x, (NORM_WIDTH,))))
    return out


def _flops(fn: Callable[[], object]) -> float:
    """FLOPs of one call as ``torch.utils.flop_counter`` counts them (the tracer's profile does)."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return float(counter.get_total_flops())


def _gradient(out: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> Callable[[], object]:
    """The backward kernels alone: the forward's graph kept, its gradients computed again each call."""
    grad = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True)


def _convolutions(grid: Grid, dtype: str, device: torch.device) -> list[Kernel]:
    dt = TORCH_DTYPES[dtype]
    out = []
    for batch, channels, side, k in grid.conv:
        x = torch.randn(batch, channels, side, side, dtype=dt, device=device, requires_grad=True)
        w = torch.randn(channels, channels, k, k, dtype=dt, device=device, requires_grad=True)

        def forward(x=x, w=w, k=k):
            return F.conv2d(x, w, padding=k // 2)

        label = f"conv2d {batch}x{channels}x{side}x{side} k{k}"
        out.append(Kernel("conv", dtype, _flops(forward), label, forward))
        backward = _gradient(forward(), (x, w))
        out.append(Kernel("conv_backward", dtype, _flops(backward), f"{label} backward", backward))
    return out


def _pools(grid: Grid, dtype: str, device: torch.device) -> list[Kernel]:
    dt = TORCH_DTYPES[dtype]
    out = []
    for batch, channels, side in grid.pool:
        x = torch.randn(batch, channels, side, side, dtype=dt, device=device, requires_grad=True)

        def forward(x=x):
            return F.max_pool2d(x, 3, 2, 1)

        y = forward()
        moved = float(x.numel() * x.element_size() + y.numel() * y.element_size())
        label = f"max_pool2d {batch}x{channels}x{side}x{side}"
        out.append(Kernel("pool", dtype, moved, label, forward))
        out.append(Kernel("pool_backward", dtype, 2.0 * moved, f"{label} backward", _gradient(y, (x,))))
    return out


def _batch_norms(grid: Grid, dtype: str, device: torch.device) -> list[Kernel]:
    dt = TORCH_DTYPES[dtype]
    out = []
    for batch, channels, side in grid.batch_norm:
        x = torch.randn(batch, channels, side, side, dtype=dt, device=device, requires_grad=True)
        stats = [torch.zeros(channels, dtype=dt, device=device), torch.ones(channels, dtype=dt, device=device)]
        affine = [torch.ones(channels, dtype=dt, device=device, requires_grad=True),
                  torch.zeros(channels, dtype=dt, device=device, requires_grad=True)]
        moved = float(2 * x.numel() * x.element_size() + sum(t.numel() * t.element_size() for t in stats + affine))

        def run(x=x, stats=stats, affine=affine):
            return F.batch_norm(x, *stats, *affine, training=True)

        label = f"batch_norm {batch}x{channels}x{side}x{side}"
        out.append(Kernel("batch_norm", dtype, moved, label, run))
        # Input and affine gradients, keyed by twice the forward's bytes (what the cost model
        # charges a backward: ``strategies.combine``).
        out.append(Kernel("batch_norm_backward", dtype, 2.0 * moved, f"{label} backward",
                          _gradient(run(), (x, *affine))))
    return out


OPTIMIZER_PARAMETERS = 16  # parameters per measured step: a foreach step's per-tensor share


def _optimizers(grid: Grid, device: torch.device) -> list[Kernel]:
    out = []
    for numel in grid.optimizer:
        params = [torch.zeros(numel, device=device, requires_grad=True) for _ in range(OPTIMIZER_PARAMETERS)]
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=True)
        # Keyed by ONE parameter's bytes: the cost model prices each parameter's share of the step.
        out.append(Kernel("optimizer", "fp32", float(numel * 4), f"AdamW {OPTIMIZER_PARAMETERS} x {numel:,}",
                          optimizer.step, count=OPTIMIZER_PARAMETERS))
    return out


def kernels(grid: Grid, device: torch.device) -> list[Kernel]:
    """Every grid point in every dtype (the optimizer's in fp32: it updates fp32 masters)."""
    out: list[Kernel] = []
    for dtype in DTYPES:
        out += (_matmuls(grid, dtype, device) + _attention(grid, dtype, device) + _convolutions(grid, dtype, device)
                + _memory_bound(grid, dtype, device) + _batch_norms(grid, dtype, device) + _pools(grid, dtype, device))
    return out + _optimizers(grid, device)


# Per (class, dtype), once a grid point's one call takes longer than this many repetitions
# (``MIN_REPETITION_S``), the larger points are not timed: a kernel far slower than the rest would
# hold every rank that long per call. On the 2-core host fp16 convolutions' backward ran at
# 0.13-0.15 GFLOP/s at every grid size (torch's CPU path without a fast kernel): 12 s of each
# 19 s round, the larger points 1-9 s per call.
SLOW_CALLS = 10


def _inner_counts(points: list[Kernel], device: torch.device,
                  min_repetition_s: float) -> tuple[list[Kernel], list[int]]:
    """The points worth timing and their calls per timed repetition, the same on every rank (the
    largest count any rank asks for). Per (class, dtype), smallest first, each point is probed
    with one call after a warm-up, until one's call (its slowest rank's) takes longer than
    ``SLOW_CALLS`` repetitions: that point is timed, the larger ones are left out, and the table
    ends there (beyond its last size a table holds its last rate: ``RateTable.at``)."""
    kept, want = [], []
    slow: set[tuple[str, str]] = set()
    for k in sorted(points, key=lambda k: (k.op_class, k.dtype, k.size)):
        table = (k.op_class, k.dtype)
        if table in slow:
            continue
        k.run()  # warm-up (kernel selection, first-touch pages) before the probe
        sync_device(device)
        t0 = time.perf_counter()
        k.run()
        sync_device(device)
        one = max(time.perf_counter() - t0, 1e-7)
        # Both agreed at once: the slowest rank's call (which decides, on every rank alike, whether
        # the next point is timed) and the most calls any rank asks for.
        slowest, calls = ranks_reduce([one, float(min(1000, max(1, math.ceil(min_repetition_s / one))))], device)
        if slowest > SLOW_CALLS * min_repetition_s:
            slow.add(table)
        kept.append(k)
        want.append(int(calls))
    return kept, want


# Bytes of outputs a repetition holds at most before letting them go (``_repeated``). 16 MiB: on
# this project's 2-core host, two ranks' fp32 ``add`` ran at 15-31 GB/s holding nothing, 15-23
# holding 16 MiB, and 4-8 holding 64 or 256 MiB (every call faulting in fresh pages, memory the
# allocator had returned to the OS between repetitions), while the elementwise ops of GPT-2's and
# a Qwen2 decoder's data-parallel steps, profiled (``benchmarks/fidelity.py --parts``), ran at
# ~13-15 GB/s: the priced 256 MiB figure put them at 2.5-3x their measured time. A layer norm
# gained 1.5x from it, a linear layer's products 10-15%, AdamW nothing.
HOLD_BYTES = 16 << 20


def _output_bytes(out: object) -> int:
    if isinstance(out, torch.Tensor):
        return out.untyped_storage().nbytes()
    if isinstance(out, (tuple, list)):
        return sum(_output_bytes(o) for o in out)
    return 0


def _repeated(run: Callable[[], object], inner: int) -> Callable[[], None]:
    """``inner`` calls of ``run``, each output held until the repetition ends (or ``HOLD_BYTES``
    are held), then all freed at once. A training step runs its kernels so: a forward keeps what
    it computes for backward and backward frees it, so an op writes into memory other ops wrote
    and freed a little earlier, not into the block the same op freed a call ago -- a loop
    rewriting that block (the same cache-warm pages each call) ran a GPT-2 step's elementwise ops
    2-4x faster than the step -- nor, mostly, into pages fresh from the OS, whose first write
    costs a fault each (more than a memory-bound kernel of a few MiB): held past the allocator's
    trim threshold (tens of MiB), every call paid them and ran 2.5-3x slower than the step
    (``HOLD_BYTES`` says which figures)."""
    def call() -> None:
        held: list[object] = []
        nbytes = 0
        for _ in range(inner):
            held.append(run())
            nbytes += _output_bytes(held[-1])
            if nbytes > HOLD_BYTES:
                held.clear()
                nbytes = 0
    return call


def measure_compute(grid: Grid, *, repeats: int, device: torch.device | str = "cpu",
                    progress: Callable[[str], None] | None = None, min_repetition_s: float = MIN_REPETITION_S,
                    ) -> tuple[ComputeProfile, list[tuple[Kernel, float]]]:
    """The ``ComputeProfile`` of this machine over ``grid`` and each kernel's achieved rate, each
    repetition about ``min_repetition_s`` long. Collective over every rank; every rank returns
    the same figures."""
    device = torch.device(device)
    points, inner = _inner_counts(kernels(grid, device), device, min_repetition_s)

    def on_round(r: int) -> None:
        if progress is not None:
            progress(f"round {r + 1}/{repeats} of {len(points)} kernels")

    # The probe for ``inner`` warmed every kernel up already.
    seconds = lockstep_medians([_repeated(k.run, c) for k, c in zip(points, inner)], repeats=repeats, device=device,
                               on_round=on_round, warm_up=False)
    measured = [(k, k.size * k.count * c / t) for k, c, t in zip(points, inner, seconds)]
    tables: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for k, rate in measured:
        tables.setdefault((k.op_class, k.dtype), []).append((k.size, rate))
    profile = ComputeProfile(tuple((c, d, RateTable.of(pts)) for (c, d), pts in tables.items()))
    return profile, measured


FLOOR_CHAIN = 64  # ops per chain: the barrier and the final gradient's accumulation are a small share


def measure_kernel_floor(*, repeats: int, device: torch.device | str = "cpu",
                         min_repetition_s: float = MIN_REPETITION_S) -> float:
    """Seconds one op costs however small, as a training step runs ops: a chain of
    ``FLOOR_CHAIN`` multiplications of a 0-dim tensor, forward (one Python dispatch per op, as the
    emitted graph calls them) and backward (the autograd engine's node per op), timed in lockstep
    on every rank; the median over its ``2 x FLOOR_CHAIN`` kernels. On a GPU that is the launch
    rate of back-to-back kernels; on a CPU the dispatcher's cost per call. Collective over every
    rank; every rank returns the same figure."""
    device = torch.device(device)
    x = torch.ones((), device=device, requires_grad=True)

    def chain() -> None:
        y = x
        for _ in range(FLOOR_CHAIN):
            y = y * 1.0
        y.backward()
        x.grad = None

    _, (inner,) = _inner_counts([Kernel("other", "fp32", 1.0, "kernel floor", chain)], device, min_repetition_s)
    (seconds,) = lockstep_medians([_repeated(chain, inner)], repeats=repeats, device=device, warm_up=False)
    return seconds / (inner * 2 * FLOOR_CHAIN)


POINTWISE_NUMEL = 1 << 18  # elements per call of ``measure_pointwise``: 1 MiB of fp32, a mid-size activation


def measure_pointwise(*, repeats: int, device: torch.device | str = "cpu", numel: int = POINTWISE_NUMEL,
                      min_repetition_s: float = MIN_REPETITION_S) -> tuple[tuple[str, float, float], ...]:
    """``MachineProfile.pointwise``: for each op of ``POINTWISE_MEASURED``, its forward kernel's
    and its backward's seconds on ``numel`` fp32 elements over what ``add``'s rate gives their
    bytes as the cost model counts them (forward: input and output; backward: twice that, the
    default of ``strategies.combine``), ``add`` timed at the same size in the same lockstep rounds
    (a ratio within one run: load drifting between rounds cancels), forward inputs cycled through
    cold copies as the ``elementwise`` class's are (``_cold_copies``); each factor at least 1. The
    backward is autograd's (``torch.autograd.grad`` through the op's one node), as a step runs it. fp32 only: the
    factors are applied to every dtype's elementwise rate. Collective over every rank; every rank
    returns the same figures."""
    device = torch.device(device)
    positive = _cold_copies(lambda: torch.rand(numel, device=device) + 0.5, numel * 4, device)  # every domain
    grad = torch.randn(numel, device=device)
    kernels_ = [_cold_add(numel, "fp32", device, "add")]
    for op in POINTWISE_MEASURED:
        fn = getattr(torch.ops.aten, op).default
        x = next(positive).clone().requires_grad_(True)
        y = fn(x)
        kernels_.append(Kernel("elementwise", "fp32", 2.0 * numel * 4, op, lambda fn=fn: fn(next(positive))))
        kernels_.append(Kernel("elementwise", "fp32", 4.0 * numel * 4, f"{op} backward",
                               lambda x=x, y=y: torch.autograd.grad(y, x, grad, retain_graph=True)[0]))
    points, inner = _inner_counts(kernels_, device, min_repetition_s)
    if len(points) != len(kernels_):  # left out past a call of SLOW_CALLS repetitions: none at 1 MiB
        untimed = sorted({k.label for k in kernels_} - {k.label for k in points})
        raise RuntimeError(f"calibration: pointwise kernels {untimed} took too long to time")
    seconds = lockstep_medians([_repeated(k.run, c) for k, c in zip(points, inner)], repeats=repeats, device=device,
                               warm_up=False)
    per_byte = {k.label: t / (c * k.size) for k, c, t in zip(points, inner, seconds)}
    add = per_byte["add"]
    # At least 1: no such kernel moves fewer bytes than ``add`` charges it. The backward's graph is
    # one (its saved tensors in cache, where ``add`` cycles through cold inputs): tanh's, a
    # multiply-add, came out 0.7.
    return tuple((op, max(per_byte[op] / add, 1.0), max(per_byte[f"{op} backward"] / add, 1.0))
                 for op in POINTWISE_MEASURED)


def device_figures(profile: ComputeProfile) -> tuple[float, float | None, float]:
    """(fp32 peak FLOP/s, bf16 peak FLOP/s, memory bandwidth bytes/s) for the mesh's roofline
    (what ops outside the measured classes are priced at): the largest fp32 and bf16 matmuls'
    rates and the largest fp32 elementwise call's, the steady states the tables end in."""
    fp32 = profile.table("matmul", "fp32")
    bf16 = profile.table("matmul", "bf16")
    memory = profile.table("elementwise", "fp32")
    if fp32 is None or memory is None:
        raise ValueError("a compute profile needs fp32 matmul and fp32 elementwise tables for the roofline")
    return fp32.rates[-1], None if bf16 is None else bf16.rates[-1], memory.rates[-1]

