"""Rotor: time-optimal activation checkpointing of a chain under a memory budget.

The dynamic program of Beaumont, Eyraud-Dubois, Herrmann, Joly and Shilova ("Optimal
checkpointing for heterogeneous chains", 2019). ``solve_rotor`` runs it in C (``autopar._rotor``,
built from ``csrc/rotor.c`` by ``pip install``) or in ``_dp_python`` here, its operation-for-
operation twin: same loops, same float additions in the same order, same tie-breaking, so both
give bit-identical tables. The Python twin is used, with a one-time warning, when the extension
is missing. This module never imports torch.

Model
-----
A chain of ``L`` stages; stage ``i`` (0-based) reads activation ``x_i`` and writes ``x_{i+1}``
(``x_0`` is the chain input). Per stage: forward and backward seconds, the bytes of its output
``x_{i+1}``, the bytes of its *tape* (everything its backward needs from the forward, its output
included — so a held tape also serves as ``x_{i+1}``), and transient bytes its forward /
backward allocate while running. The gradient ``g_k`` of ``x_k`` has the size of ``x_k``. The
last stage is normally the loss: the seed gradient ``g_L`` is held from the start.

Operations (``Op.kind``, printed as shown) and their memory effect:

=================  =====  =================================================================
``forward``        f<i>   needs ``x_i``; adds ``x_{i+1}``; transient peak + fwd_tmp
``forward_save``   F<i>   needs ``x_i``; adds tape ``i``; transient peak + fwd_tmp
``backward``       B<i>   needs ``x_i``, tape ``i``, ``g_{i+1}``; adds ``g_i`` (transient peak
                          + bwd_tmp), then frees tape ``i`` and ``g_{i+1}``
``discard``        D<i>   frees the plain copy of ``x_{i+1}`` (stage i's output)
=================  =====  =================================================================

``x_i`` is available when it is the input (``i = 0``), held plainly, or inside tape ``i-1``.
The memory of a state is the sum of what it holds, the input and the seed included; an
operation's peak is the state before it plus what it allocates (output + transient).
``simulate`` executes any op sequence under exactly these rules, with no reference to the DP.

Recurrence
----------
``C(s, t, m)``: least seconds to turn {``x_s`` held by the caller, ``g_{t+1}``} into {``g_s``},
running stages ``s..t`` within ``m`` memory units that count ``g_{t+1}``, everything created,
and ``g_s`` — but not ``x_s``. With ``a_k`` = size of ``x_k``, ``b_i`` = tape, ``u_i`` / ``v_i``
= forward / backward transients:

* tape s: ``F_s``, solve (s+1, t) with ``m - b_s``, ``B_s``::

      need = max(a_{t+1} + b_s + u_s,  b_s + a_{s+1} + a_s + v_s)
      cost = (fwd_s + C(s+1, t, m - b_s)) + bwd_s          (t == s: fwd_s + bwd_s)

* checkpoint x_j, for j = s+1..t: ``f_s .. f_{j-1}`` keeping only ``x_j``, solve (j, t) with
  ``m - a_j``, drop ``x_j``, solve (s, j-1) with ``m``::

      need = max(a_j, a_{t+1} + a_{s+1} + u_s,  max_{s<k<j} a_{t+1} + a_k + a_{k+1} + u_k)
      cost = (fwd_s + ... + fwd_{j-1} + C(j, t, m - a_j)) + C(s, j-1, m)

``C = inf`` when no option fits. The minimum is taken in the order [tape, j = s+1, ..., t] with
strict ``<``: ties keep the earlier option. The whole chain is ``C(0, L-1, slots - a_0)``.
More memory never removes a schedule, so each row ``C(s, t, .)`` is finite exactly from its
first finite entry on; both implementations skip the candidates below those bounds (all inf).
The schedule is rebuilt from the choice table by ``_reconstruct``, shared by both.

Repeated blocks: ``C(s, t, .)`` depends only on the stages ``s..t``, so subchains made of the same
stages (a transformer's identical blocks give a periodic chain) share one stored row
(``_row_map``), computed once. A chain of ``L`` stages with period ``p`` stores about ``p * L``
rows instead of ``L^2 / 2`` and does about ``6p / L`` of the work; the tables and schedules are
bit-identical to computing every row.

A ``Schedule`` lists the ops, the simulated time and peak, and per stage how often its forward
runs: ``kept_stages`` run once (their tape is kept from the first forward on),
``recomputed_stages`` more than once (backward recomputes them from a plain checkpoint).

Building a chain from a traced graph: every tensor counts once. ``x_{i+1}`` belongs to stage
``i``'s tape, so stage ``i+1``'s tape leaves out its input even when autograd saves it (its
backward reads ``x_{i+1}`` from memory, as modelled); ``saved_bytes[i] >= output_bytes[i]``.

Memory is discretised: ``num_slots`` slots stand for ``budget_bytes``, and every size becomes
``ceil(bytes * num_slots / budget_bytes)`` slots. Rounding every term up means a schedule that
fits in slots fits in bytes. The objective is real seconds (floats), never unit costs.
"""

from __future__ import annotations

import json
import math
import numbers
import operator
import warnings
from array import array
from collections import Counter
from dataclasses import dataclass, field

__all__ = [
    "Chain",
    "Op",
    "OP_KINDS",
    "Schedule",
    "Simulation",
    "solve_rotor",
    "simulate",
    "min_budget",
    "c_extension_available",
]

OP_KINDS = ("forward", "forward_save", "backward", "discard")
_OP_LETTER = {"forward": "f", "forward_save": "F", "backward": "B", "discard": "D"}
_IMPLS = ("auto", "c", "python")

try:  # The C twin is optional: a source checkout without a build still works.
    from autopar import _rotor as _rotor_c
except ImportError:  # pragma: no cover - depends on the build
    _rotor_c = None

_warned_fallback = False


def c_extension_available() -> bool:
    return _rotor_c is not None


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _fmt_seconds(t: float) -> str:
    if t >= 1.0:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3f} ms"
    return f"{t * 1e6:.3f} us"


def _as_bytes(name: str, values: tuple) -> tuple[int, ...]:
    """Integral values (numpy ints included) >= 0 as plain ints; ValueError otherwise."""
    out = []
    for i, v in enumerate(values):
        try:
            n = operator.index(v)
        except TypeError:
            n = -1
        if isinstance(v, bool) or n < 0:
            raise ValueError(f"{name}[{i}] = {v!r}: byte counts must be ints >= 0")
        out.append(n)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Chain:
    """A chain of stages, plain data. Stage ``i`` maps ``x_i`` to ``x_{i+1}``."""

    fwd_time_s: tuple[float, ...]
    bwd_time_s: tuple[float, ...]
    input_bytes: int  # x_0
    output_bytes: tuple[int, ...]  # x_{i+1}
    saved_bytes: tuple[int, ...]  # tape of stage i, its output included
    fwd_tmp_bytes: tuple[int, ...]
    bwd_tmp_bytes: tuple[int, ...]
    names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        per_stage = ("fwd_time_s", "bwd_time_s", "output_bytes", "saved_bytes",
                     "fwd_tmp_bytes", "bwd_tmp_bytes", "names")
        for name in per_stage:
            object.__setattr__(self, name, tuple(getattr(self, name)))
        n = len(self.fwd_time_s)
        if n < 1:
            raise ValueError("a chain needs at least one stage, got 0")
        for name in per_stage:
            got = len(getattr(self, name))
            if got != n and not (name == "names" and got == 0):
                raise ValueError(f"{name} has {got} entries, expected {n} (one per stage)")
        for name in ("fwd_time_s", "bwd_time_s"):
            for i, v in enumerate(getattr(self, name)):
                if isinstance(v, bool) or not isinstance(v, numbers.Real) or not (
                        math.isfinite(v) and v >= 0):
                    raise ValueError(f"{name}[{i}] = {v!r}: times must be finite seconds >= 0")
            object.__setattr__(self, name, tuple(float(v) for v in getattr(self, name)))
        object.__setattr__(self, "input_bytes", _as_bytes("input_bytes", (self.input_bytes,))[0])
        for name in per_stage[2:6]:
            object.__setattr__(self, name, _as_bytes(name, getattr(self, name)))
        for i, (out, tape) in enumerate(zip(self.output_bytes, self.saved_bytes)):
            if tape < out:
                raise ValueError(f"saved_bytes[{i}] = {tape} < output_bytes[{i}] = {out}: "
                                 "a stage's tape includes its output")

    @property
    def num_stages(self) -> int:
        return len(self.fwd_time_s)

    @property
    def activation_bytes(self) -> tuple[int, ...]:
        """Sizes of ``x_0 .. x_L`` (and of their gradients)."""
        return (self.input_bytes, *self.output_bytes)

    @property
    def no_recompute_time_s(self) -> float:
        return sum(self.fwd_time_s) + sum(self.bwd_time_s)

    def stage_name(self, i: int) -> str:
        return self.names[i] if self.names else f"stage {i}"

    def __str__(self) -> str:
        total = sum(self.saved_bytes)
        return (f"Chain({self.num_stages} stages, fwd+bwd {_fmt_seconds(self.no_recompute_time_s)}"
                f", input {_fmt_bytes(self.input_bytes)}, tapes {_fmt_bytes(total)})")

    def to_json(self) -> dict:
        return {name: list(getattr(self, name)) if isinstance(getattr(self, name), tuple)
                else getattr(self, name) for name in self.__slots__}

    @classmethod
    def from_json(cls, data: dict | str) -> Chain:
        if isinstance(data, str):
            data = json.loads(data)
        return cls(**data)


@dataclass(frozen=True, slots=True)
class Op:
    kind: str
    stage: int

    def __post_init__(self) -> None:
        if self.kind not in OP_KINDS:
            raise ValueError(f"op kind {self.kind!r} is not one of {OP_KINDS}")
        if isinstance(self.stage, bool) or not isinstance(self.stage, int) or self.stage < 0:
            raise ValueError(f"op stage {self.stage!r} must be an int >= 0")

    def __str__(self) -> str:
        return f"{_OP_LETTER[self.kind]}{self.stage}"


@dataclass(frozen=True, slots=True)
class Simulation:
    time_s: float
    peak: int  # in the units of the sizes simulated (bytes, or slots)


@dataclass(frozen=True, slots=True)
class Schedule:
    """A Rotor schedule; ``time_s`` and ``peak_bytes`` come from ``simulate``, not the DP."""

    ops: tuple[Op, ...]
    time_s: float
    peak_bytes: int
    dp_time_s: float  # the DP's objective: equals time_s up to float reassociation
    budget_bytes: int
    num_slots: int
    num_forwards: tuple[int, ...]  # forward executions per stage
    kept_stages: tuple[int, ...] = field(default=())  # forward run once: activations kept
    recomputed_stages: tuple[int, ...] = field(default=())  # forward run more than once

    def __str__(self) -> str:
        lines = [f"Rotor schedule: {len(self.num_forwards)} stages, time {_fmt_seconds(self.time_s)}"
                 f", peak {_fmt_bytes(self.peak_bytes)} of {_fmt_bytes(self.budget_bytes)}"
                 f" ({self.num_slots} slots)",
                 f"  kept: {_ranges(self.kept_stages)}",
                 f"  recomputed: {_ranges(self.recomputed_stages)}"
                 f" ({sum(self.num_forwards) - len(self.num_forwards)} extra forwards)",
                 "  ops: " + " ".join(str(op) for op in self.ops)]
        return "\n".join(lines)

    def to_json(self) -> dict:
        out = {name: getattr(self, name) for name in self.__slots__}
        out["ops"] = [[op.kind, op.stage] for op in self.ops]
        for name in ("num_forwards", "kept_stages", "recomputed_stages"):
            out[name] = list(out[name])
        return out

    @classmethod
    def from_json(cls, data: dict | str) -> Schedule:
        if isinstance(data, str):
            data = json.loads(data)
        data = dict(data)
        data["ops"] = tuple(Op(kind, stage) for kind, stage in data["ops"])
        for name in ("num_forwards", "kept_stages", "recomputed_stages"):
            data[name] = tuple(data[name])
        return cls(**data)


def _ranges(stages: tuple[int, ...]) -> str:
    if not stages:
        return "none"
    parts, start = [], stages[0]
    for prev, cur in zip(stages, (*stages[1:], None)):
        if cur != prev + 1:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(parts)


# ---------------------------------------------------------------- simulation (independent of DP)

@dataclass(frozen=True, slots=True)
class _Sizes:
    """Chain quantities in one memory unit (bytes or slots); ``act`` has L+1 entries."""

    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    act: tuple[int, ...]
    tape: tuple[int, ...]
    fwd_tmp: tuple[int, ...]
    bwd_tmp: tuple[int, ...]


def _byte_sizes(chain: Chain) -> _Sizes:
    return _Sizes(chain.fwd_time_s, chain.bwd_time_s, chain.activation_bytes, chain.saved_bytes,
                  chain.fwd_tmp_bytes, chain.bwd_tmp_bytes)


# A simulation state: (held items, current memory, peak, elapsed seconds). Items are
# ("x", k) plain activation, ("tape", i), ("g", k) gradient; the input x_0 is implicit.
_State = tuple[frozenset, int, int, float]


def _initial_state(sz: _Sizes) -> _State:
    num_stages = len(sz.fwd)
    start = sz.act[0] + sz.act[num_stages]  # the input and the seed gradient
    return frozenset({("g", num_stages)}), start, start, 0.0


def _has_x(held: frozenset, k: int) -> bool:
    return k == 0 or ("x", k) in held or ("tape", k - 1) in held


def _apply(sz: _Sizes, state: _State, op: Op) -> _State:
    """One operation under the module docstring's rules; ValueError when it is illegal."""
    held, cur, peak, time_s = state
    i = op.stage
    if i >= len(sz.fwd):
        raise ValueError(f"{op}: stage {i} is outside the chain of {len(sz.fwd)} stages")
    if op.kind == "discard":
        if ("x", i + 1) not in held:
            raise ValueError(f"{op}: stage {i}'s output is not held as a plain activation")
        return held - {("x", i + 1)}, cur - sz.act[i + 1], peak, time_s
    if not _has_x(held, i):
        raise ValueError(f"{op}: the input x_{i} of stage {i} is not in memory")
    if op.kind == "backward":
        if ("tape", i) not in held or ("g", i + 1) not in held:
            raise ValueError(f"{op}: needs tape {i} and gradient g_{i + 1} in memory")
        peak = max(peak, cur + sz.act[i] + sz.bwd_tmp[i])
        cur += sz.act[i] - sz.tape[i] - sz.act[i + 1]
        return held - {("tape", i), ("g", i + 1)} | {("g", i)}, cur, peak, time_s + sz.bwd[i]
    item, size = (("x", i + 1), sz.act[i + 1]) if op.kind == "forward" else (("tape", i), sz.tape[i])
    if item in held:
        raise ValueError(f"{op}: {item} is already in memory")
    peak = max(peak, cur + size + sz.fwd_tmp[i])
    return held | {item}, cur + size, peak, time_s + sz.fwd[i]


def _simulate_sizes(sz: _Sizes, ops) -> Simulation:
    state = _initial_state(sz)
    for op in ops:
        state = _apply(sz, state, op)
    held = state[0]
    if held != {("g", 0)}:
        left = sorted(item for item in held if item != ("g", 0))
        raise ValueError(f"the schedule does not end with exactly g_0 in memory: holds {left}"
                         + ("" if ("g", 0) in held else ", and g_0 was never produced"))
    return Simulation(time_s=state[3], peak=state[2])


def simulate(chain: Chain, ops) -> Simulation:
    """Execute ``ops`` on ``chain``: total seconds and peak bytes (input and seed included)."""
    return _simulate_sizes(_byte_sizes(chain), ops)


# ---------------------------------------------------------------- the dynamic program

def _tri(s: int, t: int) -> int:
    return t * (t + 1) // 2 + s


def _row_map(sz: _Sizes) -> tuple[array, array]:
    """(stored row of each subchain ``(s, t)`` at index ``_tri(s, t)``; the ``s`` each stored row
    was computed for). Subchains with identical stages (a chain of repeated blocks) share a row:
    ``C(s, t, .)`` depends only on stages ``s..t`` (times, sizes, ``x_s`` and ``x_{t+1}``), and
    both DPs compute a shared row once, at its first subchain in their order (``d`` ascending,
    then ``s``), by the very operations that would compute it for any other one."""
    num_stages = len(sz.fwd)
    stage = {}  # stage key -> id; floats by their exact bits
    sym = [stage.setdefault((sz.fwd[i].hex(), sz.bwd[i].hex(), sz.act[i], sz.act[i + 1], sz.tape[i],
                             sz.fwd_tmp[i], sz.bwd_tmp[i]), len(stage)) for i in range(num_stages)]
    rows = array("q", bytes(8 * (num_stages * (num_stages + 1) // 2)))
    starts = array("q")
    seen: dict[tuple[int, int], int] = {}  # (row of (s, t-1) or -1, stage t) -> row of (s, t)
    for d in range(num_stages):
        for s in range(num_stages - d):
            t = s + d
            key = (rows[_tri(s, t - 1)] if d else -1, sym[t])
            r = seen.get(key)
            if r is None:
                r = seen[key] = len(starts)
                starts.append(s)
            rows[_tri(s, t)] = r
    return rows, starts


def _dp_python(fwd, bwd, act, tape, fwd_tmp, bwd_tmp, mem: int, rows, num_rows: int) -> tuple[bytes, bytes]:
    """The recurrence of the module docstring over the stored rows of ``_row_map``; the C twin
    is ``rotor_dp`` in csrc/rotor.c."""
    num_stages, width, inf = len(fwd), mem + 1, math.inf
    cost: list[list[float] | None] = [None] * num_rows
    choice_rows: list[array | None] = [None] * num_rows
    first = [width] * num_rows  # first finite entry of each row: finite from there on
    for d in range(num_stages):
        for s in range(num_stages - d):
            t = s + d
            r = rows[_tri(s, t)]
            if cost[r] is not None:
                continue
            row, ch = [inf] * width, [0] * width
            need = max(act[t + 1] + tape[s] + fwd_tmp[s], tape[s] + act[s + 1] + act[s] + bwd_tmp[s])
            if d == 0:
                v = fwd[s] + bwd[s]
                for m in range(need, width):
                    row[m], ch[m] = v, -1
            else:
                sub, shift, f, b = cost[rows[_tri(s + 1, t)]], tape[s], fwd[s], bwd[s]
                for m in range(need, width):
                    v = sub[m - shift]
                    if v < inf:
                        row[m], ch[m] = (f + v) + b, -1
            acc, adv = 0.0, act[t + 1] + act[s + 1] + fwd_tmp[s]
            for j in range(s + 1, t + 1):
                acc += fwd[j - 1]
                if j - 1 > s:
                    adv = max(adv, act[t + 1] + act[j - 1] + act[j] + fwd_tmp[j - 1])
                shift, r_right, r_left = act[j], rows[_tri(j, t)], rows[_tri(s, j - 1)]
                right, left = cost[r_right], cost[r_left]
                lo = max(adv, shift, first[r_right] + shift, first[r_left])
                for m in range(lo, width):
                    v = (acc + right[m - shift]) + left[m]
                    if v < row[m]:
                        row[m], ch[m] = v, j
            cost[r] = row
            first[r] = next((m for m, v in enumerate(row) if v < inf), width)
            choice_rows[r] = array("i", ch)
    out_cost, out_choice = array("d"), array("i")
    for row, ch in zip(cost, choice_rows):
        out_cost.extend(row)
        out_choice.extend(ch)
    return out_cost.tobytes(), out_choice.tobytes()


def _dp(impl: str, sz: _Sizes, mem: int) -> tuple[bytes, bytes, array, array]:
    """(cost, choice, rows, starts): the DP's stored rows and ``_row_map``'s map to them."""
    global _warned_fallback
    if impl not in _IMPLS:
        raise ValueError(f"impl = {impl!r} is not one of {_IMPLS}")
    if impl == "c" and _rotor_c is None:
        raise ImportError("impl='c' but the extension autopar._rotor is not built; "
                          "run `pip install -e .` (needs a C compiler)")
    if impl == "auto" and _rotor_c is None and not _warned_fallback:
        _warned_fallback = True
        warnings.warn("autopar._rotor (the C Rotor solver) is not built; using the pure-Python "
                      "reference, which is ~100x slower. Run `pip install -e .` to build it.",
                      RuntimeWarning, stacklevel=3)
    use_c = impl == "c" or (impl == "auto" and _rotor_c is not None)
    solver = _rotor_c.solve if use_c else _dp_python
    rows, starts = _row_map(sz)
    cost, choice = solver(sz.fwd, sz.bwd, sz.act, sz.tape, sz.fwd_tmp, sz.bwd_tmp, mem, rows, len(starts))
    return cost, choice, rows, starts


def _reconstruct(choice, rows, starts, num_stages: int, mem: int, sz: _Sizes) -> list[Op]:
    """Walk the choice table from (0, L-1, mem); identical for both DP implementations. A shared
    row's checkpoint ``j`` is in the indices of the subchain it was computed for: shifted here."""
    width, ops = mem + 1, []
    # Explicit stack (LIFO) instead of recursion: chains may be longer than Python's stack.
    stack: list[tuple[int, int, int] | Op] = [(0, num_stages - 1, mem)]
    while stack:
        task = stack.pop()
        if isinstance(task, Op):
            ops.append(task)
            continue
        s, t, m = task
        r = rows[_tri(s, t)]
        j = choice[r * width + m]
        assert j != 0, f"reconstruction reached an infeasible cell {(s, t, m)}"
        if j == -1:
            ops.append(Op("forward_save", s))
            stack.append(Op("backward", s))
            if s < t:
                stack.append((s + 1, t, m - sz.tape[s]))
            continue
        j += s - starts[r]
        for i in range(s, j):
            ops.append(Op("forward", i))
            if i > s:
                ops.append(Op("discard", i - 1))
        stack += [(s, j - 1, m), Op("discard", j - 1), (j, t, m - sz.act[j])]
    return ops


def _slot_sizes(chain: Chain, budget_bytes: int, num_slots: int) -> _Sizes:
    def slots(values):
        return tuple(-(-v * num_slots // budget_bytes) for v in values)  # ceil, exact ints

    return _Sizes(chain.fwd_time_s, chain.bwd_time_s, slots(chain.activation_bytes),
                  slots(chain.saved_bytes), slots(chain.fwd_tmp_bytes), slots(chain.bwd_tmp_bytes))


def min_budget(chain: Chain) -> int:
    """The smallest peak bytes of any schedule in Rotor's space (exact, no discretisation).

    Same recurrence as the DP with "least peak" in place of "least time":
    ``P(s, t) = min(max(tape-s needs, b_s + P(s+1, t)),
    min_j max(checkpoint-j needs, a_j + P(j, t), P(s, j-1)))``; whole chain ``a_0 + P(0, L-1)``.
    """
    a, b = chain.activation_bytes, chain.saved_bytes
    u, v = chain.fwd_tmp_bytes, chain.bwd_tmp_bytes
    num_stages = chain.num_stages
    peak: dict[tuple[int, int], int] = {}
    for d in range(num_stages):
        for s in range(num_stages - d):
            t = s + d
            best = max(a[t + 1] + b[s] + u[s], b[s] + a[s + 1] + a[s] + v[s])
            if d:
                best = max(best, b[s] + peak[s + 1, t])
            adv = a[t + 1] + a[s + 1] + u[s]
            for j in range(s + 1, t + 1):
                if j - 1 > s and a[t + 1] + a[j - 1] + a[j] + u[j - 1] > adv:
                    adv = a[t + 1] + a[j - 1] + a[j] + u[j - 1]
                if adv < best:  # else this split cannot win: its peak is at least adv
                    best = min(best, max(adv, a[j] + peak[j, t], peak[s, j - 1]))
            peak[s, t] = best
    return a[0] + peak[0, num_stages - 1]


def _check_int(name: str, value, lowest: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        raise ValueError(f"{name} = {value!r} must be an int >= {lowest}")


def solve_rotor(chain: Chain, budget_bytes: int, *, num_slots: int = 500,
                impl: str = "auto") -> Schedule:
    """The fastest schedule of ``chain`` whose peak fits in ``budget_bytes``.

    ``impl``: "c" (the extension), "python" (the reference) or "auto" (C when built, else
    Python with a one-time warning). ValueError when no schedule fits, with the minimum budget.
    """
    if not isinstance(chain, Chain):
        raise ValueError(f"chain must be a Chain, got {type(chain).__name__}")
    _check_int("budget_bytes", budget_bytes, 1)
    _check_int("num_slots", num_slots, 1)
    if impl not in _IMPLS:
        raise ValueError(f"impl = {impl!r} is not one of {_IMPLS}")
    sz = _slot_sizes(chain, budget_bytes, num_slots)
    mem = num_slots - sz.act[0]
    dp_time = math.inf
    if mem >= 0:
        cost, choice, rows, starts = _dp(impl, sz, mem)
        dp_time = memoryview(cost).cast("d")[rows[_tri(0, chain.num_stages - 1)] * (mem + 1) + mem]
    if dp_time == math.inf:
        lowest = min_budget(chain)
        if budget_bytes < lowest:
            raise ValueError(f"budget_bytes = {budget_bytes} ({_fmt_bytes(budget_bytes)}) is below "
                             f"the minimum budget {lowest} bytes ({_fmt_bytes(lowest)}) that any "
                             f"checkpointing schedule of this {chain.num_stages}-stage chain needs")
        raise ValueError(f"budget_bytes = {budget_bytes} is at least the minimum budget {lowest} "
                         f"bytes, but rounding sizes up to num_slots = {num_slots} slots loses "
                         "too much: raise num_slots or the budget")
    ops = _reconstruct(memoryview(choice).cast("i"), rows, starts, chain.num_stages, mem, sz)
    in_slots = _simulate_sizes(sz, ops)
    assert in_slots.peak <= num_slots, (in_slots, num_slots)
    assert math.isclose(in_slots.time_s, dp_time, rel_tol=1e-9, abs_tol=1e-300), (in_slots, dp_time)
    in_bytes = simulate(chain, ops)
    assert in_bytes.peak <= budget_bytes, (in_bytes, budget_bytes)
    counts = Counter(op.stage for op in ops if op.kind in ("forward", "forward_save"))
    num_forwards = tuple(counts[i] for i in range(chain.num_stages))
    return Schedule(
        ops=tuple(ops), time_s=in_bytes.time_s, peak_bytes=in_bytes.peak, dp_time_s=dp_time,
        budget_bytes=budget_bytes, num_slots=num_slots, num_forwards=num_forwards,
        kept_stages=tuple(i for i, n in enumerate(num_forwards) if n == 1),
        recomputed_stages=tuple(i for i, n in enumerate(num_forwards) if n > 1))
