"""The measured machine: what ``autopar calibrate`` found, as device-free records (no torch).

A ``MeshSpec`` may carry a ``MachineProfile`` (``MeshSpec.machine``); the cost model
(``autopar.layout.cost``) then prices compute and collectives from it instead of the spec-sheet
roofline. Its parts:

- ``ComputeProfile``: per (op class, dtype) a ``RateTable`` of achieved rates at measured call
  sizes. The compute-bound classes (``matmul``, ``attention``, ``conv``) are keyed by the FLOPs
  of one call and rate FLOP/s; the memory-bound ones (``elementwise``, ``norm``, ``pool``...) by the
  bytes one call reads and writes and rate bytes/s (``batch_norm`` apart from ``norm``: its
  per-channel statistics over an NCHW tensor run far below a row-wise layer norm's rate on a
  CPU); ``conv`` and ``pool`` have backward tables
  of their own (``BACKWARD_CLASSES``); ``optimizer`` is the AdamW step per parameter byte.
  Between two measured sizes the rate follows the power law through them (log(rate) linear in
  log(size)): exact where the time is flat (a call's fixed work -- AdamW's step over 16 params
  took 54-60 us per param from 128 B to 4 KiB) as where the rate is, where a rate linear in
  log(size) priced the flat stretch's middle 40% low; beyond the ends the nearest measured rate
  holds (a rate is an efficiency, which flattens at both ends, unlike a time; the cost model
  floors a kernel's time, ``layout.cost``). Small and skinny products are measured, so they are
  priced at their real, lower efficiency: keying by FLOPs merges a skinny and a square product
  of equal FLOPs into one curve, which is what the grid then averages over.
- ``LinkFit``: one collective kind's ``alpha``/``beta`` on one mesh axis (the per-axis fit of
  ``MeshSpec.alpha``/``beta`` is over all kinds at once; gloo's reduce-scatter costs about an
  all-reduce, its all-to-all less, so one pair cannot fit them all), or on the group of several
  axes flattened into one (``LinkFit.axes``; calibration measures every set of two or more axes
  of size > 1, ``runtime/calibrate.py``): a collective's latency grows with the ranks of its
  group (4 gloo ranks on this 2-core host: all-reduce alpha 3.6 ms over 4 ranks, 0.45-1.1 ms over
  2), so the per-axis fits of a 2x2 mesh do not price its 4-rank group. ``link_over`` finds the
  fit of exactly a set of axes; a profile without one (JSON version 6 or before) prices as before
  (``layout.cost``).

- ``time_scale``: per op class, a model's timed steps over what the profile priced them at
  (``autoparallelize(refine=True)``): a factor on each kernel's priced seconds.
- ``idle_speedup``: a rank's compute rate while half the ranks wait over its rate while all
  compute (1 with a device or cores of its own per rank, where calibration does not measure it; up
  to 2 with twice the ranks of the host's cores): what a pipeline bubble's busy ranks gain.
- ``kernel_floor_s``: what one op costs however small -- its dispatch and launch, measured on a
  chain of one-element ops run forward and backward as a training step runs them (None: not
  measured; ``layout.cost.KERNEL_FLOOR_S`` holds). On a GPU it sets the time of the many small
  kernels a small model's step is made of.
- ``blocking_s``: per mesh axis, what a synchronous (blocking) collective costs inside a step
  beyond its lockstep ``alpha + beta * bytes``: the ranks reach it apart (the skew their compute
  since the last one left) and the issuing thread, asleep in the wait, is woken late. The links'
  fits are measured from a barrier, which takes both out; a step's in-graph collectives pay them.
  Calibration measures it (``runtime/calibrate.py``, ``measure_blocking``); the cost model adds it
  to every synchronous collective (``layout.cost.collective_seconds``). ``()``: not measured (a
  profile written before it, JSON version 4): 0, priced as before.
- ``blocking_over``: the same per set of two or more mesh axes of size > 1 (JSON version 7): what
  a blocking sum over all of them holds a step beyond its lockstep price (the fit of their
  spanning group, ``link_over``), measured on what the runtime issues for it -- a chain of
  per-axis all-reduces (``runtime.kernels.all_reduce_axes``), each axis's ranks arriving apart.
  ``blocking_of`` reads it; a set not measured: the largest of its axes' ``blocking_s``.
- ``pipeline_action_s``: what one action of torch's pipeline schedule (a stage's forward or
  backward of one micro-batch) costs beyond its ops and its point-to-point transfer's
  ``alpha + beta * bytes``: the schedule's bookkeeping, the stage's buffers, the batched
  send/receive set-up and the wake-up of a rank that slept in a receive. Calibration measures it
  on a pipeline of trivial stages over mesh axis 0 (``runtime/calibrate_pipeline.py``); the
  pipeline cost model adds it per action of each stage's micro-batch
  (``planner.pipeline.schedule.action_overhead_s``). None: not measured (one rank, axis 0 of size
  1, or a profile written before it, JSON version 5): the preset's default
  (``layout.cost.pipeline_action_seconds``).
- ``pipeline_transfer_s``: the latency of one point-to-point transfer of that schedule over mesh
  axis 0 (JSON version 8), where the same probe ran its micro-batch faster than the links' fit
  prices its two transfers: a send/receive pair is not a lockstep collective, and on 4 gloo ranks
  sharing 2 cores the 4-rank axis's fitted ``alpha`` (3.2 ms) priced a trivial 1F1B micro-batch at
  6.4 ms where it took 3.4. None: the axis's ``alpha`` prices it (the probe's micro-batch took at
  least that; what it took beyond is ``pipeline_action_s``), as in a profile written before it.
  ``layout.cost.pipeline_transfer_seconds`` reads it.
- ``pointwise``: per pointwise ATen op whose kernel computes more than it moves (``tanh``,
  ``exp``, ``sqrt``, ``erf`` ...: ``POINTWISE_MEASURED``), how many times the ``elementwise``
  class's rate at its bytes one forward call and one backward call take (JSON version 9). The
  class is timed on ``add``; on a 2-core host ``tanh`` ran 26 times slower per byte, ``sqrt`` 40,
  ``sigmoid`` 4, while their backward kernels (``tanh_backward``: a multiply-add) ran near
  ``add``'s rate -- GPT-2's ``gelu_new`` priced its ``tanh`` at a fifth of what a step measured.
  Each factor is at least 1 (a kernel that moves what ``add`` moves; measured below, a backward
  graph's saved tensors sat in cache where ``add`` read cold inputs).
  ``layout.cost.compute_seconds`` multiplies an elementwise kernel of such an op by its factor;
  an op not measured (or a profile written before it): 1, priced as before.

The fraction of asynchronously issued communication hidden under concurrent compute is
``MeshSpec.comm_overlap`` (one field of the mesh, whoever fills it), not a field here.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

__all__ = ["OP_CLASSES", "COMPUTE_BOUND", "MEMORY_BOUND", "BACKWARD_CLASSES", "OPTIMIZER", "MEASURED_CLASSES",
           "FLOP_KEYED", "DTYPES", "LINK_KINDS", "POINTWISE_MEASURED", "RateTable", "ComputeProfile",
           "LinkFit", "MachineProfile", "dtype_name", "overlap_fraction"]

OP_CLASSES = ("matmul", "attention", "conv", "elementwise", "norm", "batch_norm", "pool", "other")
COMPUTE_BOUND = ("matmul", "attention", "conv")  # keyed by FLOPs per call, rates in FLOP/s
MEMORY_BOUND = ("elementwise", "norm", "batch_norm", "pool")  # keyed by bytes per call, rates in bytes/s
# Classes whose backward kernels run at a rate of their own (measured apart, keyed by the
# backward's FLOPs or bytes): a CPU convolution's backward runs well below its forward, a max
# pool's backward (a scatter by the saved indices) well above it, and a training batch norm's
# (one pass over the saved statistics) about 2-3x above its forward's two passes. The other
# classes' backward is priced at the forward table's rate for its size.
BACKWARD_CLASSES = {"conv": "conv_backward", "pool": "pool_backward", "batch_norm": "batch_norm_backward"}
# The optimizer step (AdamW, foreach) keyed by the bytes of the parameters one step updates, rate
# in those bytes per second: not an op of the graph, priced on each trainable parameter's option.
OPTIMIZER = "optimizer"
# The tables keyed by FLOPs (the rest by bytes).
FLOP_KEYED = COMPUTE_BOUND + tuple(BACKWARD_CLASSES[c] for c in COMPUTE_BOUND if c in BACKWARD_CLASSES)
MEASURED_CLASSES = COMPUTE_BOUND + MEMORY_BOUND + tuple(BACKWARD_CLASSES.values()) + (OPTIMIZER,)
DTYPES = ("fp32", "bf16", "fp16")
# Pointwise ops calibration times against ``add`` (``MachineProfile.pointwise``): the ATen names of
# the math functions models call -- activations (GELU's erf and tanh forms, SiLU's sigmoid), RMS
# and layer norms' rsqrt, rotary embeddings' sin and cos, softmax-style exp and log.
POINTWISE_MEASURED = ("tanh", "sigmoid", "silu", "gelu", "erf", "exp", "log", "sqrt", "rsqrt", "sin", "cos")
LINK_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def overlap_fraction(t_comm: float, t_comp: float, t_both: float) -> float:
    """The share of the shorter of a collective (``t_comm`` alone) and a computation (``t_comp``
    alone) that ran hidden when both ran at once (``t_both``), clamped to [0, 1]: 1 when the
    pair took as long as the longer one, 0 when it took their sum (or longer: contention)."""
    if not (t_comm > 0 and t_comp > 0 and t_both > 0):
        raise ValueError(f"overlap needs positive times, got comm {t_comm}, compute {t_comp}, both {t_both}")
    return min(1.0, max(0.0, (t_comm + t_comp - t_both) / min(t_comm, t_comp)))


def dtype_name(itemsize: int) -> str:
    """The dtype class an op computing in ``itemsize``-byte floats is priced at (2: bf16)."""
    return "bf16" if itemsize == 2 else "fp32"


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _optional_seconds(name: str, value: Any) -> float | None:
    """``value`` as a float of seconds in [0, 1), or None; else a ``ValueError`` naming ``name``."""
    if value is None:
        return None
    if not ((_positive(value) or (isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0))
            and value < 1.0):
        raise ValueError(f"MachineProfile.{name} must be a finite number of seconds in [0, 1) or None, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class RateTable:
    """Achieved rate at measured call sizes: ``sizes`` strictly increasing, ``rates`` positive."""

    sizes: tuple[float, ...]
    rates: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", tuple(float(s) for s in self.sizes))
        object.__setattr__(self, "rates", tuple(float(r) for r in self.rates))
        if not self.sizes or len(self.sizes) != len(self.rates):
            raise ValueError(f"a RateTable needs as many rates as sizes (>= 1), got {len(self.sizes)} sizes and "
                             f"{len(self.rates)} rates")
        if not all(_positive(v) for v in self.sizes + self.rates):
            raise ValueError(f"RateTable sizes and rates must be positive and finite, got {self.sizes}, {self.rates}")
        if any(b <= a for a, b in zip(self.sizes, self.sizes[1:])):
            raise ValueError(f"RateTable sizes must be strictly increasing, got {self.sizes}")

    @classmethod
    def of(cls, points: Sequence[tuple[float, float]]) -> "RateTable":
        """From (size, rate) points in any order; points of one size are merged by their
        geometric mean (a skinny and a square product of the same FLOPs)."""
        by_size: dict[float, list[float]] = {}
        for size, rate in points:
            by_size.setdefault(float(size), []).append(float(rate))
        sizes = sorted(by_size)
        return cls(tuple(sizes), tuple(math.exp(sum(map(math.log, by_size[s])) / len(by_size[s])) for s in sizes))

    def at(self, size: float) -> float:
        """The rate at ``size`` (> 0): log(rate) linear in log(size) between measured sizes (the
        power law through them), the end rate beyond."""
        if not size > 0:
            raise ValueError(f"a call size must be positive, got {size}")
        i = bisect.bisect_left(self.sizes, size)
        if i == 0:
            return self.rates[0]
        if i == len(self.sizes):
            return self.rates[-1]
        lo, hi = math.log(self.sizes[i - 1]), math.log(self.sizes[i])
        w = (math.log(size) - lo) / (hi - lo)
        return self.rates[i - 1] ** (1.0 - w) * self.rates[i] ** w

    def to_dict(self) -> dict:
        return {"sizes": list(self.sizes), "rates": list(self.rates)}


@dataclass(frozen=True, slots=True)
class ComputeProfile:
    """``tables``: ((op class, dtype, RateTable), ...), at most one per (op class, dtype)."""

    tables: tuple[tuple[str, str, RateTable], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "tables", tuple(tuple(t) for t in self.tables))
        seen = set()
        for op_class, dtype, table in self.tables:
            if op_class not in MEASURED_CLASSES:
                raise ValueError(f"unknown op class {op_class!r} in a ComputeProfile; expected one of "
                                 f"{MEASURED_CLASSES}")
            if dtype not in DTYPES:
                raise ValueError(f"unknown dtype {dtype!r} in a ComputeProfile; expected one of {DTYPES}")
            if not isinstance(table, RateTable):
                raise ValueError(f"ComputeProfile table ({op_class}, {dtype}) is not a RateTable: {table!r}")
            if (op_class, dtype) in seen:
                raise ValueError(f"ComputeProfile has two tables for ({op_class}, {dtype})")
            seen.add((op_class, dtype))

    def table(self, op_class: str, dtype: str) -> RateTable | None:
        for c, d, t in self.tables:
            if c == op_class and d == dtype:
                return t
        return None

    def rate(self, op_class: str, dtype: str, size: float, *, backward: bool = False) -> float | None:
        """FLOP/s (compute-bound classes) or bytes/s (memory-bound) of one ``size`` call; None
        when this (op class, dtype) was not measured. ``backward``: of the class's backward
        kernels, from its own table where it has one (``BACKWARD_CLASSES``), else the forward's."""
        table = self.table(BACKWARD_CLASSES[op_class], dtype) if backward and op_class in BACKWARD_CLASSES else None
        table = table or self.table(op_class, dtype)
        return None if table is None else table.at(size)

    def to_list(self) -> list[dict]:
        return [{"op_class": c, "dtype": d, **t.to_dict()} for c, d, t in self.tables]

    @classmethod
    def from_list(cls, items: list[dict]) -> "ComputeProfile":
        return cls(tuple((i["op_class"], i["dtype"], RateTable(tuple(i["sizes"]), tuple(i["rates"]))) for i in items))


def _axis_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True, slots=True)
class LinkFit:
    """Collective ``kind`` on the group of mesh ``axes``: ``alpha`` s per call + ``beta`` s per
    byte on the cost model's ring factor (``autopar.layout.cost``) with ``n`` the group's ranks.

    ``axes`` (increasing; ``()`` given: ``(axis,)``) is the group it was timed on: one axis, or
    several flattened into one group (``LinkFit.over``), as the runtime issues a gradient bucket's
    sum over several axes (``ProcessMesh.group_over``). ``axis`` is the first of them: a one-axis
    fit reads as it did before several-axis fits existed."""

    kind: str
    axis: int
    alpha: float
    beta: float
    axes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in LINK_KINDS:
            raise ValueError(f"unknown collective kind {self.kind!r}; expected one of {LINK_KINDS}")
        if not _axis_index(self.axis):
            raise ValueError(f"LinkFit axis must be a mesh axis index >= 0, got {self.axis!r}")
        axes = tuple(self.axes) or (self.axis,)
        if not all(_axis_index(a) for a in axes) or any(b <= a for a, b in zip(axes, axes[1:])) \
                or axes[0] != self.axis:
            raise ValueError(f"LinkFit axes must be increasing mesh axis indices starting at its axis "
                             f"{self.axis!r}, got {self.axes!r}")
        object.__setattr__(self, "axes", axes)
        # A fit's latency may come out 0 (clamped: noisy small sizes); its bandwidth term may not.
        if not (_positive(self.alpha) or self.alpha == 0.0) or not _positive(self.beta):
            raise ValueError(f"LinkFit {self.kind} on axes {self.axes}: alpha must be >= 0 and beta positive, got "
                             f"{self.alpha}, {self.beta}")

    @classmethod
    def over(cls, kind: str, axes: Sequence[int], alpha: float, beta: float) -> "LinkFit":
        """The fit of ``kind`` on the group spanning mesh ``axes`` (in any order)."""
        axes = tuple(sorted(axes))
        if not axes:
            raise ValueError(f"LinkFit {kind} needs at least one mesh axis")
        return cls(kind, axes[0], alpha, beta, axes)

    def to_dict(self) -> dict:
        """Its JSON record; a one-axis fit's is the version-6 record (no ``axes``)."""
        return {"kind": self.kind, "axis": self.axis, "alpha": self.alpha, "beta": self.beta,
                **({"axes": list(self.axes)} if len(self.axes) > 1 else {})}

    @classmethod
    def from_dict(cls, data: dict) -> "LinkFit":
        unknown = set(data) - {"kind", "axis", "alpha", "beta", "axes"}
        if unknown:
            raise TypeError(f"unexpected link fit fields {sorted(unknown)}")
        return cls(data["kind"], data["axis"], data["alpha"], data["beta"], tuple(data.get("axes", ())))


def _blocking_over(items) -> tuple[tuple[tuple[int, ...], float], ...]:
    """``MachineProfile.blocking_over`` checked: distinct increasing sets of >= 2 axes, seconds >= 0."""
    out = []
    for item in items:
        try:
            axes, seconds = item
            axes = tuple(axes)
        except (TypeError, ValueError):
            axes, seconds = (), None
        if len(axes) < 2 or not all(_axis_index(a) for a in axes) or any(b <= a for a, b in zip(axes, axes[1:])) \
                or not (_positive(seconds) or (isinstance(seconds, (int, float)) and seconds == 0)):
            raise ValueError(f"MachineProfile.blocking_over needs (increasing mesh axes, two or more; seconds >= 0) "
                             f"pairs, got {item!r}")
        out.append((axes, float(seconds)))
    if len({a for a, _ in out}) != len(out):
        raise ValueError(f"MachineProfile.blocking_over has two figures for one set of axes: {items!r}")
    return tuple(out)


def _pointwise(items) -> tuple[tuple[str, float, float], ...]:
    """``MachineProfile.pointwise`` checked: distinct op names, two positive finite factors each."""
    out = []
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 3 and isinstance(item[0], str)
                and _positive(item[1]) and _positive(item[2])):
            raise ValueError(f"MachineProfile.pointwise needs (op name, forward factor, backward factor) triples "
                             f"with positive factors, got {item!r}")
        out.append((item[0], float(item[1]), float(item[2])))
    if len({op for op, _, _ in out}) != len(out):
        raise ValueError(f"MachineProfile.pointwise has two entries for one op: {items!r}")
    return tuple(out)


@dataclass(frozen=True, slots=True)
class MachineProfile:
    """What calibration measured: compute rates, per-kind link fits, and where: the mesh shape
    and axis names it ran on (provenance: a mesh derived from it, a pipeline stage's, keeps
    them) and a free-form ``note`` (host, load, date, repetitions)."""

    compute: ComputeProfile
    links: tuple[LinkFit, ...]
    measured_shape: tuple[int, ...]
    measured_axis_names: tuple[str, ...]
    note: str = ""
    # ((op class, factor), ...): a model's timed steps over what this profile priced them at
    # (``refine=True``, ``planner/refit.py``); each kernel of the class costs its priced seconds
    # times the factor, the per-kernel floor included (a rate scale would leave floor-bound kernels).
    time_scale: tuple[tuple[str, float], ...] = ()
    # How much faster a rank computes while half the ranks wait than while all compute: above 1
    # where ranks share cores (4 gloo ranks on 2 cores: an idle rank's core goes to a busy one),
    # 1 where each rank has its own device. A pipeline's bubble is such a phase
    # (``planner.pipeline.schedule.bubble``); calibration measures it (``runtime/calibrate.py``).
    idle_speedup: float = 1.0
    # Seconds one kernel costs however small (dispatch + launch; None: the cost model's default).
    kernel_floor_s: float | None = None
    # Per mesh axis (measured_shape's), seconds a blocking collective pays mid-step beyond its
    # lockstep time (module docstring); () where not measured, an axis past its end: 0.
    blocking_s: tuple[float, ...] = ()
    # ((mesh axes, seconds), ...): the same for a blocking sum over several axes (module docstring).
    blocking_over: tuple[tuple[tuple[int, ...], float], ...] = ()
    # Seconds one pipeline schedule action costs beyond its work and transfer (module docstring);
    # None: not measured, the preset's default (``layout.cost.pipeline_action_seconds``).
    pipeline_action_s: float | None = None
    # Seconds of latency one pipeline point-to-point transfer pays over mesh axis 0, where measured
    # below the links' alpha (module docstring); None: the axis's alpha.
    pipeline_transfer_s: float | None = None
    # ((ATen op name, forward factor, backward factor), ...) over the elementwise rate (module
    # docstring); () where not measured.
    pointwise: tuple[tuple[str, float, float], ...] = ()
    # A mesh is a cache key (``layout.conversion``): hashing every rate each lookup would cost
    # ten times the preset mesh's whole hash, so the profile's is computed once.
    _hash: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "links", tuple(self.links))
        object.__setattr__(self, "measured_shape", tuple(self.measured_shape))
        object.__setattr__(self, "measured_axis_names", tuple(self.measured_axis_names))
        keys = [(f.kind, f.axes) for f in self.links]
        if len(set(keys)) != len(keys):
            raise ValueError(f"MachineProfile has two link fits for one (kind, axes): {keys}")
        object.__setattr__(self, "time_scale", tuple((str(c), float(f)) for c, f in self.time_scale))
        classes = [c for c, _ in self.time_scale]
        if any(c not in OP_CLASSES for c in classes) or len(set(classes)) != len(classes) \
                or not all(_positive(f) for _, f in self.time_scale):
            raise ValueError(f"MachineProfile.time_scale needs distinct op classes of {OP_CLASSES} with positive "
                             f"factors, got {self.time_scale}")
        if not (_positive(self.idle_speedup) and self.idle_speedup >= 1):
            raise ValueError(f"MachineProfile.idle_speedup must be a finite number >= 1, got {self.idle_speedup!r}")
        object.__setattr__(self, "idle_speedup", float(self.idle_speedup))
        if self.kernel_floor_s is not None:
            if not (_positive(self.kernel_floor_s) and self.kernel_floor_s < 1.0):
                raise ValueError(f"MachineProfile.kernel_floor_s must be a positive number of seconds below 1, "
                                 f"got {self.kernel_floor_s!r}")
            object.__setattr__(self, "kernel_floor_s", float(self.kernel_floor_s))
        blocking = tuple(self.blocking_s)
        if not all(_positive(b) or (isinstance(b, (int, float)) and b == 0) for b in blocking):
            raise ValueError(f"MachineProfile.blocking_s needs one finite number of seconds >= 0 per mesh axis, "
                             f"got {self.blocking_s!r}")
        object.__setattr__(self, "blocking_s", tuple(float(b) for b in blocking))
        object.__setattr__(self, "blocking_over", _blocking_over(self.blocking_over))
        # 0 is a measurement (the transfers' price covered the whole action; a transfer took
        # nothing beyond its bytes), not a missing one: None is.
        for name in ("pipeline_action_s", "pipeline_transfer_s"):
            object.__setattr__(self, name, _optional_seconds(name, getattr(self, name)))
        object.__setattr__(self, "pointwise", _pointwise(self.pointwise))
        object.__setattr__(self, "_hash", hash((self.compute, self.links, self.measured_shape,
                                                self.measured_axis_names, self.note, self.time_scale,
                                                self.idle_speedup, self.kernel_floor_s, self.blocking_s,
                                                self.blocking_over, self.pipeline_action_s,
                                                self.pipeline_transfer_s, self.pointwise)))

    def __hash__(self) -> int:
        return self._hash

    def scale_of(self, op_class: str) -> float:
        """The ``time_scale`` factor of ``op_class`` (1: not refit)."""
        return next((f for c, f in self.time_scale if c == op_class), 1.0)

    def pointwise_factor(self, op: str, *, backward: bool = False) -> float:
        """``pointwise``'s forward (or backward) factor of ATen op ``op`` (1: not measured)."""
        found = next((f for f in self.pointwise if f[0] == op), None)
        return 1.0 if found is None else found[2 if backward else 1]

    def blocking(self, axis: int) -> float:
        """``blocking_s`` of mesh ``axis`` (0 where not measured)."""
        return self.blocking_s[axis] if axis < len(self.blocking_s) else 0.0

    def blocking_of(self, axes: Sequence[int]) -> float:
        """What a blocking collective over mesh ``axes`` (those of size > 1) holds a step beyond
        its lockstep price: the figure measured on exactly that set, else the largest of its axes'."""
        axes = tuple(sorted(axes))
        measured = next((b for a, b in self.blocking_over if a == axes), None) if len(axes) > 1 else None
        return max((self.blocking(a) for a in axes), default=0.0) if measured is None else measured

    def link(self, kind: str, axis: int) -> LinkFit | None:
        """The fit of ``kind`` on mesh ``axis`` alone."""
        return self.link_over(kind, (axis,))

    def link_over(self, kind: str, axes: Sequence[int]) -> LinkFit | None:
        """The fit of ``kind`` on the group spanning exactly mesh ``axes`` (any order), if measured."""
        axes = tuple(sorted(axes))
        return next((f for f in self.links if f.kind == kind and f.axes == axes), None)

    def select_axes(self, keep: Sequence[int]) -> "MachineProfile":
        """The profile of the sub-mesh made of axes ``keep`` (old indices, in their new order);
        a fit over several axes stays where all of them are kept (the same group of ranks)."""
        where = {old: new for new, old in enumerate(keep)}
        links = tuple(LinkFit.over(f.kind, [where[a] for a in f.axes], f.alpha, f.beta) for f in self.links
                      if all(a in where for a in f.axes))
        over = tuple((tuple(sorted(where[a] for a in axes)), b) for axes, b in self.blocking_over
                     if all(a in where for a in axes))
        return replace(self, links=links, blocking_over=over,
                       blocking_s=tuple(self.blocking(old) for old in keep) if self.blocking_s else ())

    def to_dict(self) -> dict:
        return {"compute": self.compute.to_list(),
                "links": [f.to_dict() for f in self.links],
                "measured_shape": list(self.measured_shape), "measured_axis_names": list(self.measured_axis_names),
                "note": self.note, **({"time_scale": dict(self.time_scale)} if self.time_scale else {}),
                **({"idle_speedup": self.idle_speedup} if self.idle_speedup != 1.0 else {}),
                **({"kernel_floor_s": self.kernel_floor_s} if self.kernel_floor_s is not None else {}),
                **({"blocking_s": list(self.blocking_s)} if self.blocking_s else {}),
                **({"blocking_over": [{"axes": list(a), "seconds": b} for a, b in self.blocking_over]}
                   if self.blocking_over else {}),
                **({"pipeline_action_s": self.pipeline_action_s} if self.pipeline_action_s is not None else {}),
                **({"pipeline_transfer_s": self.pipeline_transfer_s} if self.pipeline_transfer_s is not None else {}),
                **({"pointwise": {op: [f, b] for op, f, b in self.pointwise}} if self.pointwise else {})}

    @classmethod
    def from_dict(cls, data: dict) -> "MachineProfile":
        try:
            return cls(compute=ComputeProfile.from_list(data["compute"]),
                       links=tuple(LinkFit.from_dict(f) for f in data["links"]),
                       measured_shape=tuple(data["measured_shape"]),
                       measured_axis_names=tuple(data["measured_axis_names"]), note=data.get("note", ""),
                       time_scale=tuple(data.get("time_scale", {}).items()),
                       idle_speedup=data.get("idle_speedup", 1.0), kernel_floor_s=data.get("kernel_floor_s"),
                       blocking_s=tuple(data.get("blocking_s", ())),
                       blocking_over=tuple((tuple(b["axes"]), b["seconds"]) for b in data.get("blocking_over", ())),
                       pipeline_action_s=data.get("pipeline_action_s"),
                       pipeline_transfer_s=data.get("pipeline_transfer_s"),
                       pointwise=tuple((op, *fb) for op, fb in data.get("pointwise", {}).items()))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed machine profile in MeshSpec JSON: {type(exc).__name__}: {exc}") from None
