"""Mesh-invariant random numbers: a counter-based generator keyed by (seed, step, op, global index).

Why not torch's generator
-------------------------
Each rank of a sharded op draws only its shard. With a stateful generator (torch's Mersenne
Twister on CPU, Philox with an offset on CUDA) what a rank draws depends on how much was drawn
before it and on the shape it draws: a shard of a (2, 2)-mesh plan draws other numbers than the
same elements on one device, and replicas must be seeded alike. DTensor's CUDA RNG tracker solves
this with Philox offsets (each rank skips to its shard's offset in the full tensor's stream); it
has no CPU version. Here every element is a pure function of

    (seed, step, op, global element index)

- ``seed``: ``autopar.manual_seed(s)`` (default: ``torch.initial_seed()`` when first needed: at
  the build of the first module that draws, where the ranks check they agree, ``runtime/draws.py``);
- ``step``: a counter advanced once per forward call of an autoparallelized module (a pipeline
  advances it once per full-batch step, not per micro-batch), reset by ``manual_seed``;
- ``op``: the traced node's name (stable across plans, meshes and pipeline stages);
- the element's row-major index in the op's GLOBAL output (in a pipeline, in the full batch:
  ``Draw.micro_batch`` shifts dim 0 of a batch-major draw; see ``global_shape``).

Hash: SplitMix64 (Steele, Lea and Flood 2014; Java's ``SplittableRandom``): the element at index
``i`` of a stream with key ``k`` is ``mix(k + (i + 1) * gamma)``, a bijective 64-bit finaliser
of a Weyl sequence that passes BigCrush. It is exact (integer arithmetic: the same bits on every
rank, device and mesh), needs no state, and costs ~12 vectorised int64 ops per element, so a rank
generates exactly its shard -- O(local elements), never the whole tensor (``randperm`` is the
one exception: a permutation is not elementwise). torch's int64 multiply wraps modulo 2**64 (two's
complement), which is the arithmetic the hash is defined in; a logical right shift is an
arithmetic one masked.

Equality with one device means equality with autopar's own module on mesh ``(1,)`` (the same
kernel on the whole tensor). The plain model run eagerly draws from torch's generator and gives
other masks: that is a different, equally valid sample of the same distribution.
"""

from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

__all__ = ["Draw", "manual_seed", "initial_seed", "state", "next_draw", "current", "drawing", "uniform", "normal",
           "element_indices", "global_shape", "graph_draws", "module_call"]

_MASK = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(x: int) -> int:
    x &= _MASK
    return x - (1 << 64) if x >> 63 else x


def _mix_int(z: int) -> int:
    z &= _MASK
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _srl(z, 30)) * _signed(_M1)
    z = (z ^ _srl(z, 27)) * _signed(_M2)
    return z ^ _srl(z, 31)


@dataclass(frozen=True)
class Draw:
    """What one module call draws from: the seed and step, and for a pipeline micro-batch its
    index, the micro-batch count and the micro-batch size (dim 0 of a batch-major draw)."""

    seed: int
    step: int
    micro_batch: int = 0
    micro_batches: int = 1
    micro_batch_size: int = 0

    def key(self, op: str, stream: int = 0) -> int:
        """The 64-bit stream key of one op (and sub-stream) in this call."""
        k = _mix_int(self.seed * _GAMMA + 1)
        for part in (self.step, zlib.crc32(op.encode()), stream):
            k = _mix_int(k ^ (part & _MASK) * _GAMMA + 1)
        return k


class _State:
    seed: int | None = None  # None: torch.initial_seed() when first needed
    step: int = 0
    active: list[Draw] = []


def manual_seed(seed: int) -> None:
    """Seed autopar's random ops (dropout, ``rand`` ...) and restart their step counter.

    Also seeds torch (``torch.manual_seed``) so that one call fixes everything a training run
    draws. Every rank must call it with the same seed (as with torch)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    torch.manual_seed(seed)
    _State.seed, _State.step = seed, 0


def initial_seed() -> int:
    if _State.seed is None:
        _State.seed = int(torch.initial_seed())
    return _State.seed


def state() -> tuple[int, int]:
    """(seed, step): what the next module call draws from."""
    return initial_seed(), _State.step


def next_draw(*, advance: bool = True, **micro: int) -> Draw:
    """The draw of the next module call (advances the step counter unless ``advance`` is False:
    ``verify`` draws what the next step will, and leaves training's sequence as it was)."""
    draw = Draw(initial_seed(), _State.step, **micro)
    _State.step += advance
    return draw


def current() -> Draw:
    """The draw of the call in progress; outside any module call (the numeric check, a graph run
    by hand) step 0 of the current seed."""
    return _State.active[-1] if _State.active else Draw(initial_seed(), 0)


@contextlib.contextmanager
def drawing(draw: Draw) -> Iterator[Draw]:
    """Random ops run inside draw ``draw`` (re-entered by a recomputed region in backward)."""
    _State.active.append(draw)
    try:
        yield draw
    finally:
        _State.active.pop()


def graph_draws(graph) -> bool:
    """Whether an fx graph (a traced one) has an op that draws random numbers."""
    from autopar.strategies.registry import bind, draws_random

    return any(n.op == "call_function" and draws_random(n.target, bind(n.target, n.args, n.kwargs))
               for n in graph.nodes)


def module_call(draws: bool, **micro: int) -> contextlib.AbstractContextManager:
    """The context one forward call of a module runs in: the next draw when its graph draws."""
    return drawing(next_draw(**micro)) if draws else contextlib.nullcontext()


# ------------------------------------------------------------------------------ generation
def global_shape(shape: Sequence[int], draw: Draw) -> tuple[tuple[int, ...], int]:
    """(the shape indices are taken in, dim-0 offset): in a pipeline micro-batch a batch-major
    draw (dim 0 equal to the micro-batch size, the micro-batch rule of ``tracer.microbatch``) is
    the piece of the full batch's draw at rows ``micro_batch * size`` on."""
    shape = tuple(int(s) for s in shape)
    if draw.micro_batches > 1 and shape and shape[0] == draw.micro_batch_size:
        return (shape[0] * draw.micro_batches, *shape[1:]), draw.micro_batch * shape[0]
    return shape, 0


def element_indices(shape: Sequence[int], slices: Sequence[slice], *, draw: Draw,
                    device: torch.device | None = None) -> torch.Tensor:
    """The global row-major index of every element of the local piece ``slices`` of an op's
    output of global ``shape`` (int64, the local piece's shape)."""
    full, offset = global_shape(shape, draw)
    idx = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    strides = []
    for size in reversed(full):
        strides.append(stride)
        stride *= max(size, 1)
    strides.reverse()
    n = len(full)
    for d, (sl, st) in enumerate(zip(slices, strides)):
        start = sl.start + (offset if d == 0 else 0)
        view = [1] * n
        view[d] = -1
        idx = idx + (torch.arange(start, start + (sl.stop - sl.start), dtype=torch.int64, device=device)
                     * st).view(view)
    return idx.expand(tuple(sl.stop - sl.start for sl in slices)) if n else idx


def _bits(key: int, index: torch.Tensor) -> torch.Tensor:
    return _mix((index + 1) * _signed(_GAMMA) + _signed(key))


# Significand bits (the implicit one included): a uniform on that many bits is exact in the dtype.
_MANTISSA = {torch.float64: 53, torch.float32: 24, torch.bfloat16: 8, torch.float16: 11}


def _mantissa(dtype: torch.dtype) -> int:
    return _MANTISSA.get(dtype, 53 if not dtype.is_floating_point else 8)


def uniform(key: int, index: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """U[0, 1) per index, on as many top bits as ``dtype`` holds exactly (never rounds to 1)."""
    m = _mantissa(dtype)
    u = _srl(_bits(key, index), 64 - m).to(torch.float64) * (2.0 ** -m)
    return u.to(dtype) if dtype.is_floating_point else u


def normal(key: int, index: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """N(0, 1) per index by Box-Muller on two uniforms (sub-streams 2i, 2i+1), in float64."""
    u1 = _srl(_bits(key, 2 * index), 11).to(torch.float64) * (2.0 ** -53)
    u2 = _srl(_bits(key, 2 * index + 1), 11).to(torch.float64) * (2.0 ** -53)
    z = torch.sqrt(-2.0 * torch.log1p(-u1)) * torch.cos((2.0 * torch.pi) * u2)  # 1 - u1 in (0, 1]
    return z.to(dtype)
