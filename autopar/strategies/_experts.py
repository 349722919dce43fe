"""A MoE block's experts (``autopar::moe_experts``, ``autopar.tracer.experts``): split by expert.

``moe_experts(hidden (T, H), top_k_index (T, k), top_k_weights (T, k), gate_up (E, 2I, H),
down (E, H, I), act) -> (T, H)``. Single-axis options besides replication:

- **data parallel**: the tokens (``hidden``, ``top_k_index``, ``top_k_weights``) and the output
  ``Shard(0)``, the experts whole: the plain op on each rank's tokens;
- **expert split, tokens whole**: ``gate_up`` and ``down`` ``Shard(0)`` (this rank's experts),
  the tokens replicated, the output ``Partial``: each rank runs only the (token, expert) pairs
  whose expert it holds; the others' rows are zero, so the sum over the axis is the whole;
- **expert parallel**: tokens and experts ``Shard(0)``, the output ``Shard(0)``: each rank sends
  each of its (token, expert) pairs to the rank holding the expert (the pair counts first, then
  the token rows: one all-to-all each, no capacity limit, so nothing is dropped), runs its
  experts on what arrives, and the results come back by the reverse all-to-all, where the
  routing weights and the per-token sum over ``k`` are applied as one device does.

Over several axes the kernel does one exchange per axis that splits both the tokens and the
experts, and drops at the source the pairs whose expert another rank of a token-replicated axis
holds. Pricing (``_dispatch_comm``, ``routed_pairs``): the expected volume -- with routing
balanced (each of ``E`` experts gets ``T * k / E`` pairs), a rank's ``T_local * k`` pairs go to
each expert rank alike, so ``(n-1)/n`` of them cross each exchange's axis (priced on that axis's
links), there and back in forward and again in backward, as all-to-alls of rows of ``H`` elements
of the hidden dtype; the counts and the expert ids (int64, forward only) travel too.
"""

from __future__ import annotations

import itertools
import math

import torch

from autopar.layout.cost import collective_seconds
from autopar.layout.placement import Partial, Replicate, Shard
from autopar.strategies.kernel_context import KernelContext
from autopar.strategies.registry import AxisOption, OpInfo, Sample, register, register_kernel
from autopar.strategies.samples import rand
from autopar.tracer.experts import moe_experts

__all__ = ["experts_rule", "experts_samples", "routed_pairs"]

R, P = Replicate(), Partial()
KERNEL = "moe_experts_sharded"
_TOKENS = ("hidden", "top_k_index", "top_k_weights")


def _dispatch_comm(info: OpInfo, input_specs, output_specs, mesh) -> tuple[float, float]:
    """Forward and backward seconds of the expert-parallel exchanges (module docstring): per axis
    that splits both tokens and experts, in the kernel's order, the counts, the expert ids and the
    pairs' rows there and the results back (forward), the rows' gradients back and there (backward)."""
    hidden, index = info.input("hidden"), info.input("top_k_index")
    expert_axes = input_specs[info.slot_index("gate_up")].shard_axes(0)
    token_axes = input_specs[info.slot_index("hidden")].shard_axes(0)
    axes = [a for a in expert_axes if a in token_axes]
    if not axes:
        return 0.0, 0.0
    pairs = routed_pairs(index.shape[0], index.shape[1], mesh.shape, token_axes=token_axes, expert_axes=expert_axes)
    forward = backward = 0.0
    for a in axes:
        n = mesh.shape[a]
        # ``collective_seconds`` takes the group's full size: n ranks' pairs (each sends (n-1)/n of its own)
        rows = collective_seconds("all_to_all", pairs * hidden.shape[1] * hidden.itemsize * n, mesh, a)
        ids = collective_seconds("all_to_all", pairs * index.itemsize * n, mesh, a)
        counts = collective_seconds("all_to_all", n * n * index.itemsize, mesh, a)
        forward += counts + ids + 2 * rows
        backward += 2 * rows
    return forward, backward


def routed_pairs(tokens: int, k: int, mesh_shape, *, token_axes, expert_axes) -> float:
    """Expected (token, expert) pairs one rank sends through each expert-parallel exchange, with
    routing balanced (every expert gets ``tokens * k / E`` pairs): its ``tokens * k / T`` pairs
    (``T``: the token split), less the pairs whose expert another rank of an expert-split axis
    that keeps the tokens whole runs (dropped at the source, ``1/n`` kept per such axis). Each
    exchange keeps the count: a rank sends ``(n-1)/n`` of them and receives as many."""
    split = math.prod(mesh_shape[a] for a in token_axes)
    split *= math.prod(mesh_shape[a] for a in expert_axes if a not in token_axes)
    return tokens * k / split


def experts_rule(info: OpInfo) -> list[AxisOption]:
    tokens = {name: Shard(0) for name in _TOKENS}
    experts = {"gate_up": Shard(0), "down": Shard(0)}
    return [
        info.option(Shard(0), **tokens),
        info.option(P, kernel=KERNEL, **experts),
        info.option(Shard(0), kernel=KERNEL, **tokens, **experts),
    ]


@register_kernel(KERNEL, comm_cost=_dispatch_comm)
def moe_experts_sharded(ctx: KernelContext, hidden, top_k_index, top_k_weights, gate_up, down, act):
    """One rank's share of the experts' work (module docstring): ``hidden`` etc. are this rank's
    tokens, ``gate_up``/``down`` its experts; expert ids in ``top_k_index`` are global."""
    tokens, k = top_k_index.shape
    owner = _owners(ctx)  # expert -> its holder's coordinates along the expert-split axes
    expert_axes = ctx.axes_sharding("gate_up", 0)
    token_axes = ctx.axes_sharding("hidden", 0)
    me = ctx.coords()
    experts = top_k_index.reshape(-1)
    pairs = torch.arange(tokens * k, device=experts.device)
    keep = torch.ones_like(experts, dtype=torch.bool)
    for a in expert_axes:
        if a not in token_axes:  # every rank of this axis has these tokens: run only our experts' pairs
            keep &= owner[:, expert_axes.index(a)][experts] == me[a]
    pairs, ids = pairs[keep], experts[keep]
    rows = hidden[pairs // k]
    routes = []
    for a in (a for a in expert_axes if a in token_axes):
        rows, ids, route = _send(ctx, rows, ids, owner[:, expert_axes.index(a)], a)
        routes.append(route)
    first = ctx.local_range("gate_up", 0)[0]
    local = ids.sub(first).unsqueeze(1)
    out = moe_experts(rows, local, torch.ones_like(local, dtype=rows.dtype), gate_up, down, act)
    for route in reversed(routes):
        out = _return(ctx, out, route)
    full = out.new_zeros(tokens * k, out.shape[-1]).index_copy(0, pairs, out)
    weighted = full * top_k_weights.reshape(-1, 1).to(full.dtype)
    return weighted.view(tokens, k, weighted.shape[-1]).sum(dim=1).to(hidden.dtype)


def _owners(ctx: KernelContext) -> torch.Tensor:
    """(E, number of expert-split axes) long: the coordinates of each expert's holder."""
    spec, meta = ctx.spec("gate_up"), ctx.info.input("gate_up")
    axes = spec.shard_axes(0)
    table = torch.zeros(meta.shape[0], len(axes), dtype=torch.long)
    for combo in itertools.product(*(range(ctx.mesh_shape[a]) for a in axes)):
        coord = list(ctx.coords())
        for a, c in zip(axes, combo):
            coord[a] = c
        rows = spec.local_slices(meta.shape, ctx.mesh_shape, tuple(coord))[0]
        table[rows.start:rows.stop] = torch.tensor(combo)
    return table


def _send(ctx: KernelContext, rows, ids, dest_of_expert, axis):
    """Each row to the rank of ``axis`` holding its expert; returns what arrived and the route back."""
    dest = dest_of_expert.to(ids.device)[ids]
    order = torch.argsort(dest, stable=True)
    n = ctx.comm.size(axis)
    send = torch.bincount(dest, minlength=n).tolist()
    recv = ctx.comm.exchange_counts(send, axis)
    rows = ctx.comm.all_to_all(rows[order], axis, send, recv)
    # expert ids travel as one more row block (int64, no gradient)
    ids = ctx.comm.all_to_all(ids[order].unsqueeze(1), axis, send, recv).squeeze(1)
    return rows, ids, (axis, order, send, recv)


def _return(ctx: KernelContext, out, route):
    axis, order, send, recv = route
    back = ctx.comm.all_to_all(out, axis, recv, send)
    return back.new_empty(back.shape).index_copy(0, order, back) if back.shape[0] else back


def experts_samples() -> list[Sample]:
    torch.manual_seed(0)
    tokens, k, experts, hidden, inter = 8, 2, 4, 8, 4
    index = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)])
    index[:4] = torch.tensor([0, 1])  # experts 2 and 3 get few tokens: uneven exchanges
    weights = torch.softmax(rand(tokens, k), dim=-1)
    return [Sample((rand(tokens, hidden), index, weights, rand(experts, 2 * inter, hidden),
                    rand(experts, hidden, inter), "silu"), label="top-2 of 4")]


register(torch.ops.autopar.moe_experts.default, samples=experts_samples, has_flops=True)(experts_rule)
