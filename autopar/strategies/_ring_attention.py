"""Ring attention: scaled dot-product attention with query, key, value and output split on the
sequence, exact forward and backward (the kernel behind ``_attention.py``'s ring option).

Each rank holds a block of query rows and a block of key/value rows. The key/value blocks travel
around the ring of the mesh axes splitting the key sequence (``Comm.shift``: each rank sends its
block to the next coordinate and receives the previous one's), and every rank attends its queries
to each block as it passes, merging the partial results by their log-sum-exp (online softmax):

    lse_t = logaddexp(lse_{t-1}, logsumexp(s_t)),   out_t = out_{t-1} e^{lse_{t-1} - lse_t} + e^{s_t - lse_t} v_t

so after the last block ``out`` is the softmax-weighted sum over every key, whatever the order.
The backward (``_Ring.backward``) recomputes each block's probabilities from the saved ``lse``
and passes the blocks around again, the key/value gradients travelling with their blocks; one
more shift brings each rank's ``dk``/``dv`` home. A sequence split over several mesh axes is an
odometer of rings: the innermost axis turns every step, an outer one when the inner wraps.

Masks: the causal mask is evaluated on global positions (query row ``i`` sees key ``j <= i``,
torch's top-left alignment), and a block a rank's queries cannot see at all is skipped (no
compute; it still passes on). ``attn_mask`` (bool or additive float, broadcastable to
``(..., L, S)``, e.g. HF's 4-D causal+padding mask) is read with its query rows split like the
query (or replicated where it broadcasts over rows) and every key column; each block reads its
columns. A row that sees no key at all comes out 0 with zero gradients, as torch's kernels give.
A float mask gets its gradient (the scores' gradient, summed over its broadcast dims).

GQA (``enable_gqa``, fewer key/value heads): the blocks travel with their own heads and are
expanded per block, so the ring moves the smaller tensors.

Load balance: a per-axis placement is an even, contiguous split, so the zig-zag layout (rank ``i``
holding chunks ``i`` and ``2n-1-i``) is not expressible; under a causal mask rank ``i`` computes
``i + 1`` of the ``n`` blocks. The cost model prices the op's FLOPs as the unmasked product
(the fused kernels' count), divided by the ranks: exactly the last rank's share, which the step
waits for; the others idle for the blocks they skip.
"""

from __future__ import annotations

import itertools
import math

import torch

from autopar.layout.cost import ring_seconds
from autopar.strategies.kernel_context import KernelContext

__all__ = ["ring_attention", "ring_comm_cost", "RING_KERNEL"]

RING_KERNEL = "ring_attention"


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
    """What every block's scores need: the local query rows, their global offset, the mask."""

    def __init__(self, ctx: KernelContext, query, key, attn_mask, is_causal: bool, scale) -> None:
        self.ctx, self.seq_dim = ctx, query.ndim - 2
        self.q0 = ctx.local_range("query", self.seq_dim)[0]
        self.rows = query.shape[-2]
        self.mask, self.is_causal = attn_mask, is_causal
        self.scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
        self.reps = query.shape[-3] // key.shape[-3]  # query heads per key/value head (GQA)
        # Half-precision inputs are accumulated in fp32 (scores, log-sum-exp, output and the
        # travelling gradients), as the fused kernels do; the results are cast back.
        half = query.dtype in (torch.float16, torch.bfloat16)
        self.acc = torch.float32 if half else query.dtype
        self.out_dtype = query.dtype

    def key_range(self, source: tuple[int, ...]) -> tuple[int, int]:
        meta = self.ctx.info.input("key")
        sl = self.ctx.spec("key").local_slices(meta.shape, self.ctx.mesh_shape, source)[self.seq_dim]
        return sl.start, sl.stop

    def visible(self, k0: int) -> bool:
        """Whether any local query row sees a key of the block starting at ``k0`` (causal)."""
        return not self.is_causal or k0 <= self.q0 + self.rows - 1

    def expand(self, t: torch.Tensor, *, acc: bool = False) -> torch.Tensor:
        """A key/value block with its heads repeated to the query's (GQA); ``acc``: in the
        accumulation dtype (blocks travel in their own, smaller one)."""
        t = t.to(self.acc) if acc else t
        return t if self.reps == 1 else t.repeat_interleave(self.reps, -3)

    def fold(self, t: torch.Tensor) -> torch.Tensor:
        """A gradient w.r.t. the expanded heads -> w.r.t. the block's own heads."""
        return t if self.reps == 1 else t.unflatten(-3, (t.shape[-3] // self.reps, self.reps)).sum(-3)

    def scores(self, q, k, k0: int, k1: int) -> torch.Tensor:
        s = (q * self.scale) @ self.expand(k, acc=True).transpose(-2, -1)
        if self.is_causal:
            rows = torch.arange(self.q0, self.q0 + self.rows, device=s.device).unsqueeze(-1)
            cols = torch.arange(k0, k1, device=s.device)
            s = s.masked_fill(cols > rows, float("-inf"))
        if self.mask is not None:
            m = self.mask[..., k0:k1] if self.mask.shape[-1] > 1 else self.mask
            s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m
        return s


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
            k0, k1 = problem.key_range(ring.source(offsets))
            if problem.visible(k0):
                k, v = blocks
                s = problem.scores(q, k, k0, k1)
                new = torch.logaddexp(lse, torch.logsumexp(s, -1))
                m = _safe(new)
                p = torch.exp(s - m.unsqueeze(-1))
                out = out * torch.exp(lse - m).unsqueeze(-1) + p @ problem.expand(v, acc=True)
                lse = new
            if offsets != tuple(n - 1 for n in ring.sizes):  # the last block needs no passing on
                blocks = ring.pass_on(blocks, offsets)
        autograd_ctx.save_for_backward(q, key.detach(), value.detach(), out, lse)
        autograd_ctx.problem, autograd_ctx.ring = problem, ring
        autograd_ctx.mask_grad = attn_mask is not None and attn_mask.requires_grad
        return out.to(query.dtype)

    @staticmethod
    def backward(autograd_ctx, grad_out):
        q, key, value, out, lse = autograd_ctx.saved_tensors
        problem, ring = autograd_ctx.problem, autograd_ctx.ring
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
            k0, k1 = problem.key_range(ring.source(offsets))
            if problem.visible(k0):
                k, v, dk, dv = travelling
                s = problem.scores(q, k, k0, k1)
                p = torch.exp(s - m)
                dv = dv + problem.fold(p.transpose(-2, -1) @ grad_out)
                ds = p * (grad_out @ problem.expand(v, acc=True).transpose(-2, -1) - delta)
                dq = dq + ds @ problem.expand(k, acc=True) * problem.scale
                dk = dk + problem.fold(ds.transpose(-2, -1) @ q) * problem.scale
                travelling = [k, v, dk, dv]
                if dmask is not None:
                    _add_mask_grad(dmask, ds, k0, k1)
            if offsets == tuple(n - 1 for n in ring.sizes):
                # After the last visit only the gradients move on (home): the blocks are done.
                travelling = travelling[:2] + ring.pass_on(travelling[2:], offsets)
            else:
                travelling = ring.pass_on(travelling, offsets)
        dk, dv = travelling[-2:]
        dmask = None if dmask is None else dmask.to(problem.mask.dtype)
        return dq.to(problem.out_dtype), dk.to(key.dtype), dv.to(value.dtype), dmask, None, None


def _add_mask_grad(dmask: torch.Tensor, ds: torch.Tensor, k0: int, k1: int) -> None:
    """``dmask[..., k0:k1] += ds`` summed over the dims the mask broadcasts (size 1: the kernel
    gives the mask the query's number of dims)."""
    dims = tuple(d for d in range(dmask.ndim - 1) if dmask.shape[d] == 1 and ds.shape[d] != 1)
    g = ds.sum(dims, keepdim=True) if dims else ds
    if dmask.shape[-1] == 1:
        dmask += g.sum(-1, keepdim=True)
    else:
        dmask[..., k0:k1] += g


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
    problem = _Problem(ctx, query, key, mask, bool(is_causal), scale)
    ring = _Ring(ctx, ctx.axes_sharding("key", problem.seq_dim))
    return _RingAttention.apply(query, key, value, mask, problem, ring)


def ring_comm_cost(info, input_specs, output_specs, mesh) -> tuple[float, float]:
    """Forward: the key and value blocks passed around the ring (one shift short of a full turn);
    backward: the same pass again, plus their gradients carried a full turn home (in fp32 for
    half-precision blocks: they accumulate there)."""
    seq_dim = info.input("query").ndim - 2
    k_slot, v_slot = info.slot_index("key"), info.slot_index("value")
    axes = input_specs[k_slot].shard_axes(seq_dim)
    if not axes:
        return 0.0, 0.0
    block = (info.input("key").local_nbytes(input_specs[k_slot], mesh.shape)
             + info.input("value").local_nbytes(input_specs[v_slot], mesh.shape))
    widen = max(1, 4 // info.input("key").itemsize)
    forward = ring_seconds(block, mesh, axes, closed=False)
    return forward, forward + ring_seconds(block * widen, mesh, axes, closed=True)
