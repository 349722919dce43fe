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

What a solved plan offloads, and fitting the device room these options do not carry, are
``offload_fit``'s. The user's configuration (``OffloadPolicy``, the ``offload`` modes) is
``autopar.offload``, which the chunk runtime reads too; it is re-exported here, where it was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from autopar.layout.cost import optimizer_bytes_per_byte
from autopar.layout.mesh import MeshSpec
from autopar.layout.placement import zero_split
from autopar.offload import OffloadPolicy, check_offload, runtime_options
from autopar.solver.problem import StrategyOption

__all__ = ["OffloadPolicy", "check_offload", "runtime_options", "OffloadCost", "OFFLOAD_TIERS", "offload_cost",
           "offload_option", "offload_tier", "option_name", "static_tiers", "offload_tiers", "tiers_of", "zero_dp",
           "dtype_fraction"]

# Tier keys: "device" (nothing offloaded), "o" (optimizer state on host), "po" (parameter too).
OFFLOAD_TIERS = ("device", "o", "po")
_SUFFIX = " off:"


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
    cpu_s = optimizer_bytes_per_byte(m) * local / piece / mesh.host_mem_bandwidth
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


def zero_dp(spec, mesh: MeshSpec, ndim: int) -> int:
    """The number of devices ZeRO shards an ``ndim``-dim parameter laid out ``spec`` over (its
    replicated axes, ``zero_split``; 1 where it cannot)."""
    split = zero_split(spec, ndim, mesh.shape)
    return 1 if split is None else math.prod(mesh.shape[a] for a in split[1])


def dtype_fraction(dtype_name: str, itemsize: int) -> float:
    """Bytes of ``dtype_name`` per parameter byte (a bf16 copy of an fp32 parameter: 0.5)."""
    return min((2 if dtype_name in ("bf16", "fp16") else 4) / itemsize, 1.0)
