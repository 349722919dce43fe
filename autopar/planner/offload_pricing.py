"""Offload pricing: parameters and optimizer state on the mesh's host tier (issue 16, planned half).

Offload is a decision of the ILP, made as ZeRO's is (``zero_pricing``): extra options of each
trainable parameter node, so the ILP itself is unchanged. Per layout and ZeRO stage a parameter
may keep, besides everything on the device (the plain option):

========= =========================== ============================= ===============================
suffix    device bytes per local byte host bytes per local byte     host-link traffic per step
========= =========================== ============================= ===============================
``off:o`` parameter + gradient (ZeRO-2 ``(2 + m) / d``: fp32 master,  gradient down, updated
          shards it: ``1 + 1/d``)     gradient landing buffer,      parameter up (``1/d`` each)
                                      optimizer state
``off:po``0 (streamed in per use)     ``2 + m`` (stage 0 only)      parameter up twice (forward
                                                                    and backward) in the compute
                                                                    dtype, gradient down
========= =========================== ============================= ===============================

``m``: the optimizer multiplier; ``d``: the size of the axes ZeRO-1/2 shards over (1 at stage 0):
under ZeRO-Offload each rank's host holds and updates its own piece. Every host-tier optimizer
state is updated by a CPU optimizer, priced at the host memory roofline: Adam reads parameter,
gradient and state and writes parameter and state, ``(3 + 2m)`` bytes per local byte over
``mesh.host_mem_bandwidth``. Link time and CPU time are added to the option's ``comm_s`` and are
not overlapped with compute (Gemini prefetches, so this is an upper bound).

Device room the options do not carry, added after the solve (``offload_summary``) and fitted
into the budget: the chunk runtime (``autopar.runtime.gemini``) holds a streamed (``off:po``)
parameter on the device, in the compute dtype, from just before its first reader to just after
its last, and a recomputed region's call and its re-run in backward read every parameter the
region takes at once; a ZeRO-2 parameter's whole gradient waits for its reduce-scatter (the
options price its 1/dp shard). So ``stream_buffer_bytes`` is the larger of the two largest
streamed parameters (one in use, one prefetched) and the most streamed bytes pinned at once
(``pinned_room``: spans over the graph, a region one position), and ``grad_wait_bytes`` the
largest ZeRO-2 parameter's local bytes; ``device_model_bytes`` (what the runtime's ledger
measures) includes both. The room depends on the solution (which parameters stream, which
regions recompute) as a max over sums, which the ILP's per-node memory rows cannot express
without new variables and rows in the solver's formulation; so ``fit_device_room`` re-solves
instead, under the budget less the room, a few times at most (each re-solve is a progress stage
``offload refit N``), and refuses with a ValueError when no plan fits. ``check_host_capacity``
checks the host tier's capacity after the solve (the ILP has no host row).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from autopar.layout.mesh import MeshSpec
from autopar.layout.placement import zero_split
from autopar.solver.problem import StrategyOption
from autopar.tracer.graph import may_alias

__all__ = ["OffloadPolicy", "OffloadCost", "OFFLOAD_TIERS", "offload_cost", "offload_option", "offload_tier", "option_name",
           "runtime_options", "static_tiers", "offload_tiers", "tiers_of", "check_offload", "offload_summary", "check_host_capacity", "with_offload", "zero_dp",
           "pinned_room", "fit_device_room", "replace_budget",
           "dtype_fraction"]

# Tier keys: "device" (nothing offloaded), "o" (optimizer state on host), "po" (parameter too).
OFFLOAD_TIERS = ("device", "o", "po")
_SUFFIX = " off:"


@dataclass(frozen=True, slots=True)
class OffloadPolicy:
    """A static offload policy with Gemini's fractions (``GeminiPlugin(placement_policy="static")``):
    ``offload_optim_frac`` of the trainable parameter bytes keep their optimizer state on the host,
    ``offload_param_frac`` keep the parameter there too (which needs ``offload_optim_frac == 1``,
    as in Gemini, where a host parameter is updated by the CPU optimizer). Parameters are taken in
    graph order (the model's first parameters first, as Gemini walks its chunks); layouts and
    ZeRO stages are still the solver's."""

    offload_optim_frac: float = 0.0
    offload_param_frac: float = 0.0

    def __post_init__(self) -> None:
        for name in ("offload_optim_frac", "offload_param_frac"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise ValueError(f"OffloadPolicy.{name} must be a fraction in [0, 1], got {v!r}")
        if self.offload_param_frac > 0 and self.offload_optim_frac != 1.0:
            raise ValueError(f"offload_param_frac={self.offload_param_frac} needs offload_optim_frac=1.0 (a host "
                             f"parameter is updated on the host), got {self.offload_optim_frac}")


def runtime_options(options: dict, *, plan_given: bool) -> dict:
    """``autoparallelize``'s planning ``options`` (a dict with ``offload``, ``zero_stage``,
    ``checkpoint``) for a run with offload: the chunk runtime (``autopar.runtime.gemini``) holds
    ZeRO-1/2 (optimizer state, and the gradient under stage 2, sharded in the chunks) and
    activation recompute (a recomputed region re-fetches its chunks) as the plan chooses them:
    ``zero_stage`` and ``checkpoint`` as given, ZeRO stage 0 when left out."""
    offload = check_offload(options.get("offload", "none"))
    if offload == "none":
        return options
    if plan_given:
        raise ValueError(f"offload={offload!r} with a given plan: the plan brings its own offload decisions "
                         f"(Plan.offload, made by autopar.plan(..., offload=...)); leave offload out")
    return {**options, "zero_stage": 0 if options.get("zero_stage") is None else options["zero_stage"]}


def check_offload(value) -> "str | OffloadPolicy":
    """``"auto"``, ``"none"`` or an ``OffloadPolicy``; ValueError otherwise."""
    if isinstance(value, OffloadPolicy) or value in ("auto", "none"):
        return value
    raise ValueError(f"offload must be 'auto', 'none' or an OffloadPolicy(...), got {value!r}")


@dataclass(frozen=True, slots=True)
class OffloadCost:
    """One offloaded option, per local parameter byte and per step."""

    device_per_byte: float
    host_per_byte: float
    link_s: float  # host<->device transfer seconds per step
    cpu_s: float  # CPU optimizer step seconds


def offload_cost(tier: str, local: int, mesh: MeshSpec, *, stage: int, dp: int, optimizer_multiplier: float,
                 compute_frac: float = 1.0, reduce_frac: float = 1.0) -> OffloadCost:
    """The cost of keeping a parameter of ``local`` bytes per device in ``tier`` (``"o"`` or
    ``"po"``; module docstring) under ZeRO ``stage`` over ``dp`` devices. ``compute_frac`` /
    ``reduce_frac``: bytes of the compute / gradient-reduction dtype per parameter-dtype byte
    (what crosses the link for streamed parameters and gradients)."""
    if not mesh.has_host_tier:
        raise ValueError(f"mesh {mesh} has no host tier: offload needs MeshSpec.host_capacity (a preset, or "
                         f"MeshSpec.with_host(...))")
    m = optimizer_multiplier
    piece = dp if stage >= 1 else 1  # the optimizer's piece on this rank's host
    cpu_s = (3 + 2 * m) * local / piece / mesh.host_mem_bandwidth
    if tier == "o":
        grad_dev = 1.0 / dp if stage == 2 else 1.0
        link_s = 2 * mesh.host_alpha + (reduce_frac + 1.0) * local / piece * mesh.host_beta
        return OffloadCost(1.0 + grad_dev, (2.0 + m) / piece, link_s, cpu_s)
    if tier == "po":
        assert stage == 0, stage  # a streamed parameter holds nothing on the device to shard
        link_s = 3 * mesh.host_alpha + (2 * compute_frac + reduce_frac) * local * mesh.host_beta
        return OffloadCost(0.0, 2.0 + m, link_s, cpu_s)
    raise ValueError(f"unknown offload tier {tier!r}; expected 'o' or 'po'")


def offload_option(spec, local: int, tier: str, base: str, *, mesh: MeshSpec, stage: int, comm_s: float, ndim: int,
                   itemsize: int, options) -> StrategyOption:
    """The parameter option ``base`` (``"RR"``, ``"RR z1"``: ZeRO's ``comm_s`` already priced) in
    host tier ``tier``: its device bytes, with the host-link and CPU optimizer seconds added to
    its communication (``offload_cost``)."""
    cost = offload_cost(tier, local, mesh, stage=stage, dp=zero_dp(spec, mesh, ndim) if stage else 1,
                        optimizer_multiplier=options.optimizer_multiplier,
                        compute_frac=dtype_fraction(options.precision, itemsize),
                        reduce_frac=dtype_fraction(options.reduce_dtype, itemsize))
    return StrategyOption(option_name(base, tier), compute_s=0.0, comm_s=comm_s + cost.link_s + cost.cpu_s,
                          param_bytes=int(round(local * cost.device_per_byte)))


def option_name(base: str, tier: str) -> str:
    """The option name of ``base`` (``"RR"``, ``"RR z1"``) in ``tier``."""
    return base if tier == "device" else f"{base}{_SUFFIX}{tier}"


def offload_tier(name: str) -> str:
    """The tier an option name keeps (``"device"`` without the suffix)."""
    head, sep, tier = name.rpartition(_SUFFIX)
    return tier if sep and tier in OFFLOAD_TIERS else "device"


def tiers_of(tier: str) -> tuple[str, str]:
    """(parameter tier, optimizer-state tier) of a tier key, as ``Plan.offload`` records them."""
    return {"device": ("device", "device"), "o": ("device", "host"), "po": ("host", "host")}[tier]


def static_tiers(params: Iterable[tuple[str, int]], policy: OffloadPolicy) -> dict[str, str]:
    """Parameter name -> the one tier ``policy`` gives it, from (name, bytes) in graph order: the
    first ``offload_param_frac`` of the bytes ``"po"``, then up to ``offload_optim_frac`` ``"o"``.
    A parameter goes to a tier while the bytes before it are under the fraction (so a fraction
    of 1 takes them all and 0 none)."""
    params = list(params)
    total = sum(b for _, b in params) or 1
    out, before = {}, 0
    for name, nbytes in params:
        frac = before / total
        if frac < policy.offload_param_frac:
            out[name] = "po"
        elif frac < policy.offload_optim_frac:
            out[name] = "o"
        else:
            out[name] = "device"
        before += nbytes
    return out


def offload_tiers(traced, mesh: MeshSpec, options) -> dict[str, tuple[str, ...]] | None:
    """Parameter node -> the offload tiers its options may take: None with ``offload="none"``
    (the problem is as without offload), empty with ``"auto"`` (every trainable parameter: all
    three), one tier each under an ``OffloadPolicy`` (``offload_pricing.static_tiers``)."""
    if options.offload == "none":
        return None
    if not mesh.has_host_tier:
        raise ValueError(f"offload={options.offload!r} needs a mesh with a host tier; mesh {mesh} has none "
                         f"(use a preset, or MeshSpec.with_host(capacity=..., beta=..., mem_bandwidth=...))")
    if options.offload == "auto":
        return {}
    from autopar.plans import NodeKind
    from autopar.tracer.graph import PLACEHOLDER_KEY

    params = []
    for node in traced.nodes:
        ph = node.meta.get(PLACEHOLDER_KEY)
        val = node.meta.get("val")
        if (node.op == "placeholder" and ph is not None and ph.kind == NodeKind.PARAMETER and ph.requires_grad
                and hasattr(val, "numel") and val.dim()):
            params.append((node.name, val.numel() * val.dtype.itemsize))
    return {name: (tier,) for name, tier in static_tiers(params, options.offload).items()}


# ------------------------------------------------------------------------- after the solve
def offload_summary(traced, built, choice: dict[str, str], *, options, regions=()) -> tuple[dict, dict]:
    """(``Plan.offload``: parameter FQN -> (parameter tier, optimizer tier) for every trainable
    parameter, ``Plan.offload_info``: policy, host bytes per device, host-link and CPU optimizer
    seconds per step, the unpriced stream buffer, and ``device_model_bytes``: the model states
    the plan keeps on the device tier -- the trainable parameters' chosen options' device bytes
    plus the stream buffer -- which the chunk runtime's ledger measures) of a solved ``choice``."""
    from autopar.plans import NodeKind

    mesh = built.mesh
    placement, host_bytes, link_s, cpu_s, streamed, device_bytes, grad_wait = {}, 0, 0.0, 0.0, {}, 0, 0
    for node in built.problem.nodes:
        decision = built.decision(node.name)
        if decision.kind != NodeKind.PARAMETER or not _trainable(traced, node.name):
            continue
        c = built.choice_of(node.name, choice[node.name])
        tier = offload_tier(c.name)
        placement[decision.module] = tiers_of(tier)
        device_bytes += node.options[node.option_index(choice[node.name])].param_bytes
        val = traced.node(node.name).meta["val"]
        local = math.prod(c.output_specs[0].local_shape(tuple(val.shape), mesh.shape)) * val.dtype.itemsize
        if c.zero_stage == 2:  # the whole gradient waits for its reduce-scatter (priced: its shard)
            grad_wait = max(grad_wait, local)
        if tier == "device":
            continue
        cost = _cost_of(tier, local, c, mesh, options, val.dtype.itemsize, tuple(val.shape))
        host_bytes += int(round(cost.host_per_byte * local))
        link_s, cpu_s = link_s + cost.link_s, cpu_s + cost.cpu_s
        if tier == "po":
            streamed[node.name] = int(local * dtype_fraction(options.precision, val.dtype.itemsize))
    # One streamed parameter in use and the next prefetched, or all a span / region pins at once.
    room = max(sum(sorted(streamed.values())[-2:]), pinned_room(traced, regions, streamed))
    info = {"policy": _policy_str(options.offload), "host_bytes": host_bytes, "host_capacity": mesh.host_capacity,
            "host_link_s": link_s, "cpu_optimizer_s": cpu_s,
            "stream_buffer_bytes": room, "grad_wait_bytes": grad_wait,
            # Model states on the device tier: the trainable parameters' options' device bytes
            # (parameter, gradient and optimizer state as their tiers keep them) + the stream
            # buffer + the largest ZeRO-2 gradient waiting whole for its reduce-scatter.
            "device_model_bytes": device_bytes + room + grad_wait,
            "num_offloaded": sum(1 for t in placement.values() if t != ("device", "device"))}
    return placement, info


def pinned_room(traced, regions, streamed: dict[str, int]) -> int:
    """The most bytes of ``streamed`` parameters (node name -> device bytes) the chunk runtime
    pins on the device at once: each from just before its first reader to just after its last
    (a reader of any view of it counts), the ops of a recompute region (``regions``) being one
    reader -- the region's call, whose backward re-fetches that whole set together."""
    region_of = {name: i for i, r in enumerate(regions) for name in r.nodes}
    position, pos_of_region = {}, {}
    for i, node in enumerate(traced.nodes):
        r = region_of.get(node.name)
        position[node.name] = pos_of_region.setdefault(r, i) if r is not None else i
    events = []
    for name, nbytes in streamed.items():
        frontier, seen, lo, hi = [traced.node(name)], set(), None, None
        while frontier:
            node = frontier.pop()
            for u in node.users:
                p = position[u.name]
                lo, hi = (p, p) if lo is None else (min(lo, p), max(hi, p))
                if u.name not in seen and may_alias(u):
                    seen.add(u.name)
                    frontier.append(u)
        if lo is not None:
            events += [(lo, 0, nbytes), (hi, 1, -nbytes)]
    best = now = 0
    for _, _, delta in sorted(events):  # at one position a span starts (0) before another ends (1)
        now += delta
        best = max(best, now)
    return best

def check_host_capacity(info: dict, mesh: MeshSpec) -> None:
    """ValueError when the plan's host bytes per device exceed the mesh's host tier."""
    if info["host_bytes"] and info["host_bytes"] > (mesh.host_capacity or 0):
        raise ValueError(f"the plan keeps {info['host_bytes'] / 1e9:.1f} GB per device on the host but the mesh's "
                         f"host tier holds {(mesh.host_capacity or 0) / 1e9:.1f} GB: give more host memory "
                         f"(MeshSpec.with_host(capacity=...), cluster(host_memory=...)) or offload less")


def _cost_of(tier: str, local: int, c, mesh: MeshSpec, options, itemsize: int, shape: tuple) -> OffloadCost:
    dp = zero_dp(c.output_specs[0], mesh, len(shape)) if c.zero_stage else 1
    return offload_cost(tier, local, mesh, stage=c.zero_stage, dp=dp,
                        optimizer_multiplier=options.optimizer_multiplier,
                        compute_frac=dtype_fraction(options.precision, itemsize),
                        reduce_frac=dtype_fraction(options.reduce_dtype, itemsize))


def zero_dp(spec, mesh: MeshSpec, ndim: int) -> int:
    """The number of devices ZeRO shards an ``ndim``-dim parameter laid out ``spec`` over (its
    replicated axes, ``zero_split``; 1 where it cannot)."""
    split = zero_split(spec, ndim, mesh.shape)
    return 1 if split is None else math.prod(mesh.shape[a] for a in split[1])


def dtype_fraction(dtype_name: str, itemsize: int) -> float:
    """Bytes of ``dtype_name`` per parameter byte (a bf16 copy of an fp32 parameter: 0.5)."""
    return min((2 if dtype_name in ("bf16", "fp16") else 4) / itemsize, 1.0)


def _trainable(traced, name: str) -> bool:
    from autopar.tracer.graph import PLACEHOLDER_KEY

    ph = traced.node(name).meta.get(PLACEHOLDER_KEY)
    return ph is not None and ph.requires_grad and bool(tuple(traced.node(name).meta["val"].shape))


def _policy_str(policy) -> str:
    if isinstance(policy, OffloadPolicy):
        return f"static (optim {policy.offload_optim_frac:g}, param {policy.offload_param_frac:g})"
    return str(policy)


def with_offload(plan, traced, built, choice: dict[str, str], *, options):
    """``plan`` with its offload placement and figures (``offload_summary``), the host-link time
    in its estimate; ValueError when the host tier cannot hold what the plan puts there."""
    from dataclasses import replace

    placement, info = offload_summary(traced, built, choice, options=options, regions=plan.recompute)
    check_host_capacity(info, built.mesh)
    return replace(plan, offload=placement, offload_info=info,
                   estimate=replace(plan.estimate, host_link_s=info["host_link_s"]))


MAX_REFITS = 5  # re-solves under a lowered budget before giving up


def fit_device_room(traced, built, rc, *, options, replan, progress=None):
    """``rc`` (``plan_recompute``'s outcome on ``built``) or a re-plan that fits ``built``'s
    budget with the device room the ILP does not price (``offload_summary``: the stream buffer
    and the ZeRO-2 gradient wait); ``rc`` itself without offload. While the solved peak plus that room exceeds the budget,
    ``replan`` (a ``built`` -> outcome function) runs again under a lower budget: the budget less
    the room (then at least 1/64 of it lower each time), or halfway back up towards the last
    budget whose plan did not fit when that was infeasible, at most ``MAX_REFITS`` times.
    ValueError when none fits. ``progress``: an ``api.Progress``; each re-solve is a stage."""
    budget = built.problem.budget_bytes
    if budget is None or options.offload == "none":
        return rc
    over, infeasible, failure = budget, None, None  # solved budgets: last too big; largest infeasible
    for attempt in range(MAX_REFITS + 1):
        if rc is not None:
            _, info = offload_summary(traced, built, rc.choice, options=options, regions=rc.regions)
            room = info["stream_buffer_bytes"] + info["grad_wait_bytes"]
            excess = rc.evaluation.peak_bytes + room - budget
            if excess <= 0:
                return rc
            detail = f"peak {rc.evaluation.peak_bytes} B + {room} B of device room over the budget {budget} B by {excess} B"
        if attempt == MAX_REFITS:
            break
        # The ILP's peak must leave the room: solve under the budget less the room; a lower
        # budget tends to stream more (more room), so after the first re-solve each one is at
        # least 1/64 of the budget lower than the last (plans change in steps: no creeping).
        target = budget - room if rc is not None else None
        if target is not None and over < budget:
            target = min(target, over - budget // 64)
        solved = target if target is not None and (infeasible is None or target > infeasible) else None
        if solved is None:
            if infeasible is None or over - infeasible < 2:
                break
            solved = (over + infeasible) // 2
        try:
            with (progress.stage(f"offload refit {attempt + 1}", f"{detail}: re-solving under {solved} B")
                  if progress is not None else _nothing()):
                rc = replan(replace_budget(built, solved))
            over = solved
        except ValueError as exc:  # no plan under ``solved``: try between it and ``over``
            rc, infeasible, failure = None, solved, exc
    raise ValueError(f"offload: no plan fits the budget {budget} B with the device room the ILP does not price "
                     f"(streamed parameters an op or a recomputed region pins at once, ZeRO-2 gradients awaiting "
                     f"their reduce-scatter) after {MAX_REFITS} re-solves under lower budgets; last: {detail}"
                     + (f"; under {infeasible} B: {failure}" if failure is not None else "")
                     + ". Give a larger budget.")


def _nothing():
    from contextlib import nullcontext

    return nullcontext()


def replace_budget(built, budget_bytes: int):
    """``built`` with its problem's budget set to ``budget_bytes`` (nodes and edges shared)."""
    from dataclasses import replace

    return replace(built, problem=built.problem.with_budget(int(budget_bytes)))
