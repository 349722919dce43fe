"""Placement policies: which tier each chunk's parameters and optimizer state live on.

``StaticPolicy`` is Gemini's ``placement_policy="static"``: the offload record
(``autopar.offload.StaticOffload``, which the planner's ``OffloadPolicy`` is too) read per chunk,
plus the chunk runtime's own knobs:
- ``offload_param_frac``: the fraction of chunks (the first ones in order, by bytes, as Gemini
  and the planner's ``OffloadPolicy`` walk them) whose
  parameter payload lives on the host and is fetched to the device when an op uses it;
- ``offload_optim_frac``: the fraction of chunks (the first ones, by bytes) whose fp32 master
  weights and optimizer state live on the host and are updated there by the CPU optimizer.
  Gemini ignores ``offload_param_frac`` unless this is 1; here any mix runs (a host payload
  with device optimizer state is updated on the device and copied back), so the runtime takes
  the record without the planner's rule;
- ``shard_param_frac``: the fraction of chunks (the first ones, by bytes) sharded ZeRO-3 style
  over their data-parallel group: the mesh axes (of size > 1) on which the plan keeps every
  parameter of the chunk replicated (chunks are built per such axis set). Each rank keeps 1/dp
  of the payload, of the fp32 master and moments and of the gradient; the chunk is all-gathered
  when an op uses it (forward and backward) and dropped after, its gradient reduce-scattered into
  the shard at the end of backward (``chunk``, ``shards``, ``grads``). A chunk whose parameters are
  replicated on no such axis (the plan shards them everywhere already) stays whole. Composes with
  the offload fractions: a sharded chunk's shard lives on the host or the device like any payload;
- ``unsharded_zero``: the ZeRO stage (0, 1 or 2) of the chunks that have a data-parallel group but
  ``shard_param_frac`` leaves whole: 2 (``GeminiPlugin``'s, as Gemini's) keeps their payload whole
  and makes their fp32 master, moments and gradient this rank's shard (``ChunkManager.make_zero``);
- ``pin_memory``: host buffers in pinned memory (CUDA only; ignored on a CPU device).
- ``device_budget``: bytes of model data (chunk payloads, master weights, optimizer state,
  gradient chunks from backward to ``zero_grad``) the device tier may hold; ``None`` = unbounded.

``AutoPolicy(device_budget)`` decides from a warm-up step's memory statistics: the first step
runs with every payload and all optimizer state on the host while the manager samples
non-model memory at each chunk move; after it, the device keeps as many chunks (payload, then
optimizer state) as fit in ``device_budget`` minus the non-model peak, the rest stay on the host.
``sharded=True`` (Gemini's auto placement, which is ZeRO-3) shards every chunk that has a
data-parallel group from the start, so the warm-up and the placement move shards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.offload import StaticOffload, fraction
from autopar.runtime.gemini.chunk import DEVICE, HOST

__all__ = ["StaticPolicy", "AutoPolicy", "PlannedPolicy", "policy_from_plan", "static_tiers", "static_shards",
           "auto_tiers", "make_policy"]


def _budget(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"device_budget must be None or a positive int of bytes, got {value!r}")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class StaticPolicy(StaticOffload):
    """The offload fractions (``StaticOffload``, checked there) with the chunk runtime's knobs."""

    shard_param_frac: float = 0.0
    """fraction of the chunks, leading ones by bytes, sharded ZeRO-3 style over their data-parallel axes"""
    unsharded_zero: int = 0
    """ZeRO stage (0, 1 or 2) of the shardable chunks left whole: Gemini's are ZeRO-2"""
    pin_memory: bool = False
    """host buffers in pinned memory (CUDA only)"""
    device_budget: int | None = None
    """bytes of model data the device tier may hold; None: unbounded"""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shard_param_frac", fraction(self.shard_param_frac, "shard_param_frac"))
        if isinstance(self.unsharded_zero, bool) or self.unsharded_zero not in (0, 1, 2):
            raise ValueError(f"unsharded_zero must be 0, 1 or 2, got {self.unsharded_zero!r}")
        StaticOffload.__post_init__(self)  # slots dataclasses cannot use zero-argument super()
        if not isinstance(self.pin_memory, bool):
            raise ValueError(f"pin_memory must be a bool, got {self.pin_memory!r}")
        object.__setattr__(self, "device_budget", _budget(self.device_budget))

    def __str__(self) -> str:  # the record's compact ``static:OPTIM,PARAM`` would hide the runtime's knobs
        return repr(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class AutoPolicy:
    device_budget: int
    pin_memory: bool = False
    warmup_steps: int = 1
    sharded: bool = False
    """every chunk with a data-parallel group sharded ZeRO-3 style (as ``shard_param_frac=1``)"""

    def __post_init__(self) -> None:
        object.__setattr__(self, "device_budget", _budget(self.device_budget))
        if self.device_budget is None:
            raise ValueError("the auto placement policy needs a device_budget in bytes")
        if not isinstance(self.pin_memory, bool):
            raise ValueError(f"pin_memory must be a bool, got {self.pin_memory!r}")
        if type(self.warmup_steps) is not int or self.warmup_steps < 1:
            raise ValueError(f"warmup_steps must be an int >= 1, got {self.warmup_steps!r}")
        if not isinstance(self.sharded, bool):
            raise ValueError(f"sharded must be a bool, got {self.sharded!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannedPolicy:
    """The planner's decision per parameter: FQN -> (parameter tier, optimizer tier), each
    ``"device"`` or ``"host"`` (``Plan.offload``). Parameters are chunked within groups of equal
    tiers, so every chunk takes its parameters' tiers exactly; an FQN not named stays on the device."""

    tiers: dict
    device_budget: int | None = None
    pin_memory: bool = False

    def __post_init__(self) -> None:
        for fqn, pair in self.tiers.items():
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(t in (DEVICE, HOST) for t in pair)):
                raise ValueError(f"tiers[{fqn!r}] must be ('device'|'host', 'device'|'host'), got {pair!r}")
        object.__setattr__(self, "tiers", {k: tuple(v) for k, v in self.tiers.items()})
        object.__setattr__(self, "device_budget", _budget(self.device_budget))
        if not isinstance(self.pin_memory, bool):
            raise ValueError(f"pin_memory must be a bool, got {self.pin_memory!r}")


def policy_from_plan(plan, *, device_budget: int | None = None, pin_memory: bool = False) -> PlannedPolicy:
    """``plan.offload`` as a policy; the device budget defaults to the plan's memory budget."""
    tiers = dict(getattr(plan, "offload", {}) or {})
    if device_budget is None:
        device_budget = getattr(plan, "budget_bytes", None) or None
    return PlannedPolicy(tiers=tiers, device_budget=device_budget, pin_memory=pin_memory)


def make_policy(placement_policy: str = "static", **knobs) -> StaticPolicy | AutoPolicy:
    """The policy named ``placement_policy`` ('static' | 'auto') with Gemini's knobs."""
    if placement_policy == "static":
        return StaticPolicy(**knobs)
    if placement_policy == "auto":
        knobs = {k: v for k, v in knobs.items() if k in ("device_budget", "pin_memory", "warmup_steps", "sharded")}
        return AutoPolicy(**knobs)
    raise ValueError(f"placement_policy must be 'static' or 'auto', got {placement_policy!r}")


def _first_fraction(sizes: list[int], frac: float) -> set[int]:
    """Indices of the leading chunks holding ``frac`` of the bytes (rounded up to whole chunks)."""
    want = math.ceil(frac * sum(sizes) - 1e-9)
    out, acc = set(), 0
    for i in range(len(sizes)):
        if acc >= want:
            break
        out.add(i)
        acc += sizes[i]
    return out


def static_tiers(payload: list[int], policy: StaticPolicy) -> list[tuple[str, str]]:
    """(payload tier, optimizer tier) per chunk."""
    params = _first_fraction(payload, policy.offload_param_frac)
    optim = _first_fraction(payload, policy.offload_optim_frac)
    return [(HOST if i in params else DEVICE, HOST if i in optim else DEVICE) for i in range(len(payload))]


def static_shards(payload: list[int], policy: StaticPolicy, shardable: list[bool]) -> list[bool]:
    """Per chunk: sharded? The leading chunks holding ``shard_param_frac`` of the (whole) payload
    bytes, those of them that have a data-parallel group (``shardable``)."""
    first = _first_fraction(payload, policy.shard_param_frac)
    return [i in first and ok for i, ok in enumerate(shardable)]


def auto_tiers(payload: list[int], optim: list[int], *, grads: list[int], budget: int, non_model_peak: int,
               order: list[int]) -> list[tuple[str, str]]:
    """Chunks kept on the device, first used first, while payloads and their gradient chunks
    (a device-home chunk's gradient lives on the device too: ``grads``) fit in ``budget`` minus
    the non-model peak (a fetched chunk needs room too: the largest payload stays free); then
    their optimizer state while it fits. Everything else on the host."""
    room = budget - non_model_peak - (max(payload) if payload else 0)
    first = order + [i for i in range(len(payload)) if i not in order]
    tiers = [[HOST, HOST] for _ in payload]
    for i in first:
        if payload[i] + grads[i] <= room:
            tiers[i][0] = DEVICE
            room -= payload[i] + grads[i]
    for i in first:
        if tiers[i][0] == DEVICE and optim[i] <= room:
            tiers[i][1] = DEVICE
            room -= optim[i]
    return [(a, b) for a, b in tiers]
