"""After the solve: what a plan offloads, and the device room its options do not carry.

What a solved plan offloads (``offload_summary``: ``Plan.offload`` and ``Plan.offload_info``) is
read from the chosen options, priced as ``offload_pricing`` priced them.

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
checks the host tier's capacity after the solve (the ILP has no host row). ``autopar.api``
calls ``with_offload`` on the assembled plan and ``fit_device_room`` around the solve.
"""

from __future__ import annotations

import math

from autopar.layout.mesh import MeshSpec
from autopar.offload import OffloadPolicy
from autopar.planner.offload_pricing import OffloadCost, dtype_fraction, offload_cost, offload_tier, tiers_of, zero_dp
from autopar.tracer.graph import may_alias

__all__ = ["offload_summary", "pinned_room", "check_host_capacity", "with_offload", "MAX_REFITS", "fit_device_room",
           "lower_budget", "replace_budget"]


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


def lower_budget(target: int | None, *, over: int, infeasible: int | None) -> int | None:
    """The budget a refit solves under next: ``target`` unless it is not above the largest budget
    found ``infeasible``, else halfway between that and ``over`` (the last budget solved whose
    plan did not fit); None when no budget is left between them."""
    if target is not None and (infeasible is None or target > infeasible):
        return target
    if infeasible is None or over - infeasible < 2:
        return None
    return (over + infeasible) // 2


def fit_device_room(traced, built, rc, *, options, replan, progress=None):
    """``rc`` (``plan_recompute``'s outcome on ``built``) or a re-plan that fits ``built``'s
    budget with the device room the ILP does not price (``offload_summary``: the stream buffer
    and the ZeRO-2 gradient wait); ``rc`` itself without offload. While the solved peak plus that
    room exceeds the budget, ``replan`` (a ``built`` -> outcome function) runs again under a lower
    budget: the budget less the room (then at least 1/64 of it lower each time), or halfway back
    up towards the last budget whose plan did not fit when that was infeasible, at most
    ``MAX_REFITS`` times.
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
            detail = (f"peak {rc.evaluation.peak_bytes} B + {room} B of device room over the budget {budget} B "
                      f"by {excess} B")
        if attempt == MAX_REFITS:
            break
        # The ILP's peak must leave the room: solve under the budget less the room; a lower
        # budget tends to stream more (more room), so after the first re-solve each one is at
        # least 1/64 of the budget lower than the last (plans change in steps: no creeping).
        target = budget - room if rc is not None else None
        if target is not None and over < budget:
            target = min(target, over - budget // 64)
        solved = lower_budget(target, over=over, infeasible=infeasible)
        if solved is None:
            break
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
