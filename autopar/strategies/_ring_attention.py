"""Ring attention: scaled dot-product attention with query, key, value and output split on the
sequence, exact forward and backward (the kernel behind ``_attention.py``'s ring option).

Each rank holds a block of query rows and a block of key/value rows. The key/value blocks travel
around the ring of the mesh axes splitting the key sequence (``Comm.shift``: each rank sends its
block to the next coordinate and receives the previous one's), and every rank attends its queries
to each block as it passes, merging the partial results by their log-sum-exp (online softmax):

    lse_t = logaddexp(lse_{t-1}, logsumexp(s_t)),   out_t = out_{t-1} e^{lse_{t-1} - lse_t} + e^{s_t - lse_t} v_t

so after the last block ``out`` is the softmax-weighted sum over every key, whatever the order.
The backward (``_RingAttention.backward``) recomputes each block's probabilities from the saved
``lse`` and passes the blocks around again, the key/value gradients travelling with their blocks;
one more shift brings each rank's ``dk``/``dv`` home. A sequence split over several mesh axes is
an odometer of rings: the innermost axis turns every step, an outer one when the inner wraps.

Segments: a rank's rows are one or two contiguous runs of global positions (``_Problem.queries``
and ``key_segments``); scores are computed per (query segment, key segment) pair, and a pair no
query row of which sees any key is skipped (no compute; its block still passes on): under the
causal mask from the positions, under ``attn_mask`` from its values (a block all ``False`` or all
``-inf``: exact, its probabilities are 0).

Load balance (``_zigzag.py``): a causal attention, or one with a mask that varies over the query
rows (HF's 4-D causal+padding and sliding-window masks), runs in the zig-zag layout: the kernel
moves query, key, value (and the mask's rows) from the plain ``Shard(seq)`` split to chunks ``r``
and ``2m - 1 - r`` on rank ``r`` by all-to-alls and the output back, so every rank computes the
same causal share. Priced so: ``ring_work_share`` gives the causal zig-zag's busiest rank's share
of the unmasked product, ``(2m + 1) / (2m)^2`` for equal lengths instead of the plain ring's last
rank's ``1 / m``, and ``ring_comm_cost`` adds the all-to-alls. A mask's structure is data, unknown
when planning: its work is priced as every block computed (``1 / m``, the bound), though the
kernel skips the blocks it masks whole. Without a causal mask or a row-varying one the plain
layout stays (every rank computes every block either way; a permutation would gain nothing), and
where the query is split on more axes than the key (the query-split option on another axis).
Memory: ``ring_saved_bytes`` prices what the zig-zag kernel saves (its routed copies, the output,
the log-sum-exp, the mask), not what torch's fused kernel the profile ran keeps.

Masks: the causal mask is evaluated on global positions (query row ``i`` sees key ``j <= i``,
torch's top-left alignment). ``attn_mask`` (bool or additive float, broadcastable to
``(..., L, S)``) is read with its query rows split like the query (or replicated where it
broadcasts over rows) and every key column; each block reads its columns. A row that sees no key
at all comes out 0 with zero gradients, as torch's kernels give. A float mask gets its gradient
(the scores' gradient, summed over its broadcast dims).

GQA (``enable_gqa``, fewer key/value heads): the blocks travel with their own heads and are
expanded per block, so the ring moves the smaller tensors.
"""

from __future__ import annotations

import itertools
import math

import torch

from autopar.layout.cost import collective_seconds, ring_seconds
from autopar.strategies._zigzag import ZigZag, causal_share, flat_index, route
from autopar.strategies.kernel_context import KernelContext

__all__ = ["ring_attention", "ring_comm_cost", "ring_work_share", "ring_saved_bytes", "zigzag_axes", "RING_KERNEL"]

RING_KERNEL = "ring_attention"


def _mask_rows(info) -> bool:
    """Whether the op's ``attn_mask`` differs over the query rows (its dim -2 is not broadcast)."""
    mask = info.input("attn_mask")
    return mask is not None and mask.ndim >= 2 and mask.shape[-2] > 1


def zigzag_axes(info, input_specs) -> tuple[int, ...]:
    """The mesh axes (major first) the ring runs in the zig-zag layout on, () for the plain one:
    under a causal mask, or an ``attn_mask`` whose query rows differ (whose blocks may be masked
    whole), when query and key split their sequence over the same axes (a query also split on
    an axis of the query-split option, its key whole there, keeps its plain rows)."""
    if not (info.arg("is_causal") or _mask_rows(info)):
        return ()
    seq_dim = info.input("query").ndim - 2
    axes = input_specs[info.slot_index("key")].shard_axes(seq_dim)
    return axes if axes == input_specs[info.slot_index("query")].shard_axes(seq_dim) else ()


# --------------------------------------------------------------------------------- the ring
class _Ring:
    """The visiting order of one rank's ring(s): the key block held at each step and where it
    came from. ``axes`` split the key sequence (major first); ``offsets[a]`` is how many shifts
    along ``a`` the block held now has made, so it is the block of coordinate ``coord - offset``."""

    def __init__(self, ctx: KernelContext, axes: tuple[int, ...]) -> None:
        self.ctx, self.axes = ctx, axes
        self.sizes = tuple(ctx.mesh_shape[a] for a in axes)

    def steps(self):
        """Offsets per visit, in odometer order (the last axis turning fastest)."""
        return itertools.product(*(range(n) for n in self.sizes))

    def last(self, offsets: tuple[int, ...]) -> bool:
        return offsets == tuple(n - 1 for n in self.sizes)

    def shifted_axes(self, offsets: tuple[int, ...]) -> list[int]:
        """The axes to shift after the visit at ``offsets`` (an axis turns when the ones inside it wrap)."""
        out = []
        for i in reversed(range(len(self.axes))):
            out.append(self.axes[i])
            if offsets[i] + 1 < self.sizes[i]:
                break
        return out

    def source(self, offsets: tuple[int, ...]) -> tuple[int, ...]:
        """Mesh coordinate of the rank whose block is held at ``offsets``."""
        coord = list(self.ctx.coords())
        for a, n, o in zip(self.axes, self.sizes, offsets):
            coord[a] = (coord[a] - o) % n
        return tuple(coord)

    def pass_on(self, tensors: list[torch.Tensor], offsets: tuple[int, ...]) -> list[torch.Tensor]:
        for axis in self.shifted_axes(offsets):
            tensors = [self.ctx.comm.shift(t, axis) for t in tensors]
        return tensors


# ------------------------------------------------------------------------------ block maths
class _Problem:
    """What every block's scores need: the local query segments, the key segments of each
    source rank, the mask. A segment is (global start, local start, rows)."""

    def __init__(self, ctx: KernelContext, query, key, attn_mask, is_causal: bool, scale,
                 zigzag: tuple[ZigZag, ZigZag] | None, axes: tuple[int, ...]) -> None:
        self.ctx, self.seq_dim, self.axes, self.zigzag = ctx, query.ndim - 2, axes, zigzag
        if zigzag is None:
            q0 = ctx.local_range("query", self.seq_dim)[0]
            self.queries = [(q0, 0, query.shape[-2])]
        else:
            self.queries = zigzag[0].segments(flat_index(ctx.coords(), axes, ctx.mesh_shape))
        self.mask, self.is_causal = attn_mask, is_causal
        self.mask_rows = _mask_rows(ctx.info)
        self.scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
        self.reps = query.shape[-3] // key.shape[-3]  # query heads per key/value head (GQA)
        # Half-precision inputs are accumulated in fp32 (scores, log-sum-exp, output and the
        # travelling gradients), as the fused kernels do; the results are cast back.
        half = query.dtype in (torch.float16, torch.bfloat16)
        self.acc = torch.float32 if half else query.dtype
        self.out_dtype = query.dtype

    def key_segments(self, source: tuple[int, ...]) -> list[tuple[int, int, int]]:
        if self.zigzag is not None:
            return self.zigzag[1].segments(flat_index(source, self.axes, self.ctx.mesh_shape))
        meta = self.ctx.info.input("key")
        sl = self.ctx.spec("key").local_slices(meta.shape, self.ctx.mesh_shape, source)[self.seq_dim]
        return [(sl.start, 0, sl.stop - sl.start)]

    def pairs(self, source: tuple[int, ...]):
        """(query segment, key segment) pairs with a visible key under the causal mask."""
        for q in self.queries:
            for k in self.key_segments(source):
                if q[2] and k[2] and (not self.is_causal or k[0] <= q[0] + q[2] - 1):
                    yield q, k

    def expand(self, t: torch.Tensor, *, acc: bool = False) -> torch.Tensor:
        """A key/value block with its heads repeated to the query's (GQA); ``acc``: in the
        accumulation dtype (blocks travel in their own, smaller one)."""
        t = t.to(self.acc) if acc else t
        return t if self.reps == 1 else t.repeat_interleave(self.reps, -3)

    def fold(self, t: torch.Tensor) -> torch.Tensor:
        """A gradient w.r.t. the expanded heads -> w.r.t. the block's own heads."""
        return t if self.reps == 1 else t.unflatten(-3, (t.shape[-3] // self.reps, self.reps)).sum(-3)

    def mask_block(self, qseg, kseg) -> torch.Tensor | None:
        if self.mask is None:
            return None
        m = self.mask[..., qseg[1]:qseg[1] + qseg[2], :] if self.mask_rows else self.mask
        return m[..., kseg[0]:kseg[0] + kseg[2]] if m.shape[-1] > 1 else m

    def scores(self, q, k, qseg, kseg) -> torch.Tensor | None:
        """The pair's scores, masked; None when the mask hides the whole block (skipped)."""
        m = self.mask_block(qseg, kseg)
        if m is not None and not (m.any() if m.dtype == torch.bool else (m > float("-inf")).any()):
            return None
        s = (q * self.scale) @ self.expand(k, acc=True).transpose(-2, -1)
        if self.is_causal:
            rows = torch.arange(qseg[0], qseg[0] + qseg[2], device=s.device).unsqueeze(-1)
            cols = torch.arange(kseg[0], kseg[0] + kseg[2], device=s.device)
            s = s.masked_fill(cols > rows, float("-inf"))
        if m is not None:
            s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m
        return s


def _rows(t: torch.Tensor, seg) -> torch.Tensor:
    """The rows (dim -2) of segment ``seg`` of a local tensor: a view."""
    return t[..., seg[1]:seg[1] + seg[2], :]


def _safe(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (a row that sees nothing so far) read as 0: ``e^{s - 0}`` is then 0 for
    its masked scores, and no ``-inf - -inf`` appears."""
    return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))


# ----------------------------------------------------------------------------- the function
class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(autograd_ctx, query, key, value, attn_mask, problem: _Problem, ring: _Ring):
        q = query.detach().to(problem.acc)
        out = q.new_zeros((*q.shape[:-1], value.shape[-1]))
        lse = q.new_full(q.shape[:-1], float("-inf"))
        blocks = [key.detach(), value.detach()]
        for offsets in ring.steps():
            k, v = blocks
            for qseg, kseg in problem.pairs(ring.source(offsets)):
                s = problem.scores(_rows(q, qseg), _rows(k, kseg), qseg, kseg)
                if s is None:
                    continue
                rows = slice(qseg[1], qseg[1] + qseg[2])
                new = torch.logaddexp(lse[..., rows], torch.logsumexp(s, -1))
                m = _safe(new)
                p = torch.exp(s - m.unsqueeze(-1))
                out[..., rows, :] = (out[..., rows, :] * torch.exp(lse[..., rows] - m).unsqueeze(-1)
                                     + p @ problem.expand(_rows(v, kseg), acc=True))
                lse[..., rows] = new
            if not ring.last(offsets):  # the last block needs no passing on
                blocks = ring.pass_on(blocks, offsets)
        # The mask too goes through save_for_backward (not only ``problem``): it is held for
        # backward, and what saved_tensors_hooks sees is what memory accounting measures.
        mask = () if problem.mask is None else (problem.mask.detach(),)
        autograd_ctx.save_for_backward(q, key.detach(), value.detach(), out, lse, *mask)
        problem.mask = None
        autograd_ctx.problem, autograd_ctx.ring = problem, ring
        autograd_ctx.mask_grad = attn_mask is not None and attn_mask.requires_grad
        return out.to(query.dtype)

    @staticmethod
    def backward(autograd_ctx, grad_out):
        q, key, value, out, lse, *mask = autograd_ctx.saved_tensors
        problem, ring = autograd_ctx.problem, autograd_ctx.ring
        problem.mask = mask[0] if mask else None
        m = _safe(lse).unsqueeze(-1)
        grad_out = grad_out.to(problem.acc)
        delta = (grad_out * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(q)
        dmask = (torch.zeros(problem.mask.shape, dtype=problem.acc, device=q.device)
                 if autograd_ctx.mask_grad else None)
        # The key/value gradients travel with their blocks and arrive home after the last shift.
        zeros = [torch.zeros(t.shape, dtype=problem.acc, device=t.device) for t in (key, value)]
        travelling = [key, value, *zeros]
        for offsets in ring.steps():
            k, v, dk, dv = travelling
            for qseg, kseg in problem.pairs(ring.source(offsets)):
                qs = _rows(q, qseg)
                s = problem.scores(qs, _rows(k, kseg), qseg, kseg)
                if s is None:
                    continue
                g, p = _rows(grad_out, qseg), torch.exp(s - _rows(m, qseg))
                _rows(dv, kseg).add_(problem.fold(p.transpose(-2, -1) @ g))
                ds = p * (g @ problem.expand(_rows(v, kseg), acc=True).transpose(-2, -1) - _rows(delta, qseg))
                _rows(dq, qseg).add_(ds @ problem.expand(_rows(k, kseg), acc=True) * problem.scale)
                _rows(dk, kseg).add_(problem.fold(ds.transpose(-2, -1) @ qs) * problem.scale)
                if dmask is not None:
                    _add_mask_grad(dmask, ds, qseg if problem.mask_rows else None, kseg)
            if ring.last(offsets):
                # After the last visit only the gradients move on (home): the blocks are done.
                travelling = travelling[:2] + ring.pass_on(travelling[2:], offsets)
            else:
                travelling = ring.pass_on(travelling, offsets)
        dk, dv = travelling[-2:]
        dmask = None if dmask is None else dmask.to(problem.mask.dtype)
        problem.mask = None
        return dq.to(problem.out_dtype), dk.to(key.dtype), dv.to(value.dtype), dmask, None, None


def _add_mask_grad(dmask: torch.Tensor, ds: torch.Tensor, qseg, kseg) -> None:
    """``dmask[..., rows, k0:k1] += ds`` summed over the dims the mask broadcasts (size 1: the
    kernel gives the mask the query's number of dims); ``qseg`` None: its rows broadcast."""
    target = dmask if qseg is None else _rows(dmask, qseg)
    dims = tuple(d for d in range(target.ndim - 1) if target.shape[d] == 1 and ds.shape[d] != 1)
    g = ds.sum(dims, keepdim=True) if dims else ds
    if target.shape[-1] == 1:
        target += g.sum(-1, keepdim=True)
    else:
        target[..., kseg[0]:kseg[0] + kseg[2]] += g


# ----------------------------------------------------------------------------------- kernel
def ring_attention(ctx: KernelContext, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                   scale=None, enable_gqa=False):
    """One rank's attention output rows: its query block against every key/value block of the ring."""
    if key.shape[-3] != query.shape[-3] and not enable_gqa:
        raise ValueError(f"{ctx.info.where()}: {query.shape[-3]} query heads and {key.shape[-3]} key heads "
                         f"without enable_gqa")
    mask = attn_mask
    if mask is not None and mask.ndim < query.ndim:  # leading broadcast dims made explicit (size 1)
        mask = mask.reshape((1,) * (query.ndim - mask.ndim) + tuple(mask.shape))
    seq_dim = query.ndim - 2
    axes = ctx.axes_sharding("key", seq_dim)
    zigzag = None
    if zigzag_axes(ctx.info, ctx.input_specs):
        m = math.prod(ctx.mesh_shape[a] for a in axes)
        zigzag = (ZigZag(ctx.info.input("query").shape[seq_dim], m), ZigZag(ctx.info.input("key").shape[seq_dim], m))
        me = flat_index(ctx.coords(), axes, ctx.mesh_shape)

        def move(t, layout, dim, back=False):
            return route(ctx.comm, t, dim, layout, axes, ctx.mesh_shape, me, to_zigzag=not back)

        query = move(query, zigzag[0], seq_dim)
        key, value = move(key, zigzag[1], seq_dim), move(value, zigzag[1], seq_dim)
        if _mask_rows(ctx.info):
            mask = move(mask, zigzag[0], mask.ndim - 2)
    problem = _Problem(ctx, query, key, mask, bool(is_causal), scale, zigzag, axes)
    out = _RingAttention.apply(query, key, value, mask, problem, _Ring(ctx, axes))
    return out if zigzag is None else move(out, zigzag[0], seq_dim, back=True)


def ring_comm_cost(info, input_specs, output_specs, mesh) -> tuple[float, float]:
    """Forward: the key and value blocks passed around the ring (one shift short of a full turn);
    backward: the same pass again, plus their gradients carried a full turn home (in fp32 for
    half-precision blocks: they accumulate there). Zig-zag (``zigzag_axes``): query, key, value
    and the mask's rows moved to the zig-zag layout and the output back, one all-to-all per axis
    each; in backward their gradients the other way (the mask's only when it is a float)."""
    seq_dim = info.input("query").ndim - 2
    k_slot, v_slot = info.slot_index("key"), info.slot_index("value")
    axes = input_specs[k_slot].shard_axes(seq_dim)
    if not axes:
        return 0.0, 0.0
    block = (info.input("key").local_nbytes(input_specs[k_slot], mesh.shape)
             + info.input("value").local_nbytes(input_specs[v_slot], mesh.shape))
    widen = max(1, 4 // info.input("key").itemsize)
    forward = ring_seconds(block, mesh, axes, closed=False)
    backward = forward + ring_seconds(block * widen, mesh, axes, closed=True)
    if not zigzag_axes(info, input_specs):
        return forward, backward
    moved = {name: info.input(name).local_nbytes(input_specs[info.slot_index(name)], mesh.shape)
             for name in ("query", "key", "value")}
    moved["out"] = info.outputs[0].local_nbytes(output_specs[0], mesh.shape)
    mask = info.input("attn_mask")
    mask_bytes = mask.local_nbytes(input_specs[info.slot_index("attn_mask")], mesh.shape) if _mask_rows(info) else 0
    fwd_perm = sum(_all_to_alls(b, mesh, axes) for b in (*moved.values(), mask_bytes))
    mask_grad = mask_bytes if mask_bytes and mask.is_float else 0
    bwd_perm = sum(_all_to_alls(b, mesh, axes) for b in (*moved.values(), mask_grad))
    return forward + fwd_perm, backward + bwd_perm


def _all_to_alls(local_bytes: int, mesh, axes: tuple[int, ...]) -> float:
    """``route``'s exchanges of a local piece of ``local_bytes``: one all-to-all per axis."""
    if not local_bytes:
        return 0.0
    return sum(collective_seconds("all_to_all", local_bytes * mesh.shape[a], mesh, a) for a in axes
               if mesh.shape[a] > 1)


def ring_work_share(info, input_specs, mesh_shape) -> tuple[tuple[int, ...], float] | None:
    """The causal zig-zag ring's work on its sequence axes: the busiest rank's share of the
    unmasked product (``_zigzag.causal_share``), instead of ``1 / m``. None otherwise: the plain
    ring's ``1 / m`` (every block computed, or under a mask priced as if: its structure is data)."""
    axes = zigzag_axes(info, input_specs)
    m = math.prod(mesh_shape[a] for a in axes)
    if not info.arg("is_causal") or m <= 1:
        return None
    seq_dim = info.input("query").ndim - 2
    lengths = (info.input("query").shape[seq_dim], info.input("key").shape[seq_dim])
    return axes, causal_share(ZigZag(lengths[0], m), ZigZag(lengths[1], m))


def ring_saved_bytes(info, strategy) -> int | None:
    """Bytes per device the zig-zag ring saves for backward: its own copies (``route``'s) of
    query (in the accumulation dtype), key, value and the mask, its output and log-sum-exp (in
    the accumulation dtype). Torch's fused CPU kernel, which the profile runs, keeps a float copy
    of a bool mask, whole, instead. None for the plain layout: it saves the inputs' own storages,
    which the profile's parts already name (shared with other savers)."""
    if not zigzag_axes(info, strategy.input_specs):
        return None
    local = {name: strategy.input_bytes[info.slot_index(name)] for name in ("query", "key", "value")}
    query, out = info.input("query"), info.outputs[0]
    acc = 4 if query.itemsize < 4 else query.itemsize  # half precision accumulates in fp32
    out_elements = strategy.output_bytes // out.itemsize
    lse = out_elements // out.shape[-1] * acc
    mask = strategy.input_bytes[info.slot_index("attn_mask")] if info.input("attn_mask") is not None else 0
    return (local["query"] // query.itemsize * acc + local["key"] + local["value"] + out_elements * acc + lse
            + mask)
