"""Scaled dot-product attention. Local op: the same op on local shards.

Dims of ``query`` (..., L, E), ``key`` (..., S, E), ``value`` (..., S, Ev), ``attn_mask``
broadcastable to (..., L, S); output (..., L, Ev). Single-axis options:

- split a leading dim (batch, heads): query, key, value and the mask (where it has that dim at
  full size; broadcast dims stay replicated) are sharded on it. With ``enable_gqa`` the query
  heads and the fewer key/value heads are split into the same number of contiguous chunks,
  which keeps every query head with its key/value head;
- split the query length L when ``is_causal`` is False: key and value are replicated (their
  gradients become partial), the mask is split on L. Causal, this plain op would mask with the
  local block's own diagonal, so it is offered only non-causal;
- ring attention (``_ring_attention.py``, kernel ``ring_attention``): query, key, value and the
  output split on the sequence, the key/value blocks passed around the axis with online-softmax
  merging, causal or not, with a mask (split on its query rows, or replicated where it
  broadcasts over them; every key column) and GQA; load-balanced (zig-zag, permuted inside the
  kernel) when causal or under a row-varying mask. Not offered with attention dropout (every
  strategy then runs ``sdpa_dropout``, which holds every key).
- Ulysses (the all-to-all sequence/head exchange) is no option of its own: it is the head split
  above with its inputs converted ``S(seq) -> S(heads)`` and its output back, each one
  all-to-all on the edge (``layout.conversion``), so the solver prices and picks it there.

The embedding dim is never split: the softmax between the two contractions is not linear.
``dropout_p > 0`` in training (GPT-2's and BERT's attention dropout): every strategy runs the
``sdpa_dropout`` kernel, attention written out (scores, mask, softmax, dropout, values) with
the dropout mask of the attention weights (..., L, S) drawn by the counter-based generator at
their GLOBAL indices (``rng.py``): the same mask on any mesh, as on mesh (1,). Like torch's
math path it keeps the weights and the mask for backward; ``tracer.profile`` prices attention
dropout as the fused GPU kernels run it (they keep only the RNG state), so on CPU this op saves
more than its estimate.
"""

from __future__ import annotations

import torch

import math

from autopar.layout.placement import Replicate, Shard
from autopar.strategies import rng
from autopar.strategies._ring_attention import (RING_KERNEL, ring_attention, ring_comm_cost, ring_saved_bytes,
                                                ring_work_share)
from autopar.strategies.kernel_context import KernelContext
from autopar.strategies.registry import AxisOption, OpInfo, Sample, draws_random, register, register_kernel
from autopar.strategies.samples import rand, randbool

aten = torch.ops.aten
R = Replicate()


def _mask_placement(info: OpInfo, out_dim: int, out_ndim: int, size: int):
    mask = info.input("attn_mask")
    if mask is None:
        return {}
    j = out_dim - (out_ndim - mask.ndim)
    return {"attn_mask": Shard(j) if j >= 0 and mask.shape[j] == size else R}


def _sdpa_samples() -> list[Sample]:
    q, k, v = rand(4, 4, 8, 4), rand(4, 4, 8, 4), rand(4, 4, 8, 4)
    return [
        Sample((q, k, v), {"is_causal": True}, "causal"),
        Sample((q, k, v, rand(4, 1, 8, 8)), {"scale": 0.3}, "float-mask-4d"),
        Sample((q, k, v, randbool(8, 8) | torch.eye(8, dtype=torch.bool)), label="bool-mask-2d"),
        Sample((rand(4, 4, 8, 4), rand(4, 2, 8, 4), rand(4, 2, 8, 4)), {"enable_gqa": True}, "gqa"),
        # HF's 4-D causal+padding mask (bool, (B, 1, L, S)) with GQA: rows 0-1 of batch 0 see no key.
        Sample((rand(4, 4, 8, 4), rand(4, 2, 8, 4), rand(4, 2, 8, 4), _padded_causal(4, 8)),
               {"enable_gqa": True}, "gqa-padding-causal-mask"),
        # A float padding mask that broadcasts over heads and query rows (its gradient partial).
        Sample((q, k, v, rand(4, 1, 1, 8)), label="row-broadcast-mask"),
        # Cross-attention lengths (L 4, S 8): the causal mask is top-left aligned on global positions.
        Sample((rand(4, 4, 4, 4), k, v), {"is_causal": True}, "causal-cross-lengths"),
        Sample((rand(4, 4, 4, 4), k, v, rand(4, 1, 4, 8)), label="cross-lengths-mask"),
        Sample((q, k, v, rand(4, 1, 8, 8)), {"dropout_p": 0.3}, "dropout-mask"),
        Sample((rand(4, 4, 8, 4), rand(4, 2, 8, 4), rand(4, 2, 8, 4)),
               {"dropout_p": 0.5, "is_causal": True, "enable_gqa": True}, "dropout-causal-gqa"),
    ]


def _padded_causal(batch: int, seq: int) -> torch.Tensor:
    """A causal mask with left padding of ``b`` tokens in batch row ``b`` (a padded query row sees
    no key at all, as in a left-padded batch whose first rows are all masked)."""
    mask = torch.ones(seq, seq, dtype=torch.bool).tril().expand(batch, 1, seq, seq).clone()
    for b in range(batch):
        mask[b, :, :, :2 * b] = False
    return mask


def _no_comm(info, input_specs, output_specs, mesh) -> tuple[float, float]:
    return 0.0, 0.0


@register_kernel("sdpa_dropout", comm_cost=_no_comm)
def sdpa_dropout(ctx: KernelContext, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                 scale=None, enable_gqa=False):
    """Attention with dropout on this rank's piece: the math of torch's reference implementation,
    the dropout mask from the global indices of the attention weights (..., L, S)."""
    L, S = query.shape[-2], key.shape[-2]
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        reps = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(reps, -3), value.repeat_interleave(reps, -3)
    factor = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = (query * factor) @ key.transpose(-2, -1)
    if is_causal:
        scores = scores.masked_fill(~torch.ones(L, S, dtype=torch.bool, device=scores.device).tril(), float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    weights = torch.softmax(scores, dim=-1)
    draw = rng.current()
    out_meta = ctx.info.output
    full = (*out_meta.shape[:-1], S)  # the weights' global shape: the output's, S for the last dim
    slices = list(ctx.output_specs[0].local_slices(out_meta.shape, ctx.mesh_shape, ctx.coords()))[:-1]
    idx = rng.element_indices(full, slices + [slice(0, S)], draw=draw, device=weights.device)
    keep = rng.uniform(draw.key(ctx.info.node_name), idx) >= dropout_p
    weights = weights * (keep.to(weights.dtype) * (1.0 / (1.0 - dropout_p))) if dropout_p < 1 else weights * 0
    return weights @ value


register_kernel(RING_KERNEL, comm_cost=ring_comm_cost, work_share=ring_work_share,
                saved_bytes=ring_saved_bytes)(ring_attention)


def _ring_option(info: OpInfo, n: int) -> AxisOption:
    """Query, key, value and output split on the sequence (dim ``n - 2``); the mask on its rows."""
    seq = Shard(n - 2)
    return info.option(seq, query=seq, key=seq, value=seq, kernel=RING_KERNEL,
                       **_mask_placement(info, n - 2, n, info.input("query").shape[n - 2]))


def _sdpa_kernel(info: OpInfo) -> str | None:
    return "sdpa_dropout" if draws_random(info.target, info.bound) else None


@register(aten.scaled_dot_product_attention.default, has_flops=True, samples=_sdpa_samples,
          kernel_for=_sdpa_kernel)
def _sdpa(info: OpInfo) -> list[AxisOption]:
    q = info.input("query")
    n = q.ndim
    options = []
    for d in range(n - 2):
        # Key/value may have fewer heads (GQA); they are split into as many chunks as the query.
        options.append(info.option(Shard(d), query=Shard(d), key=Shard(d), value=Shard(d),
                                   **_mask_placement(info, d, n, q.shape[d])))
    if not info.arg("is_causal"):
        options.append(info.option(Shard(n - 2), query=Shard(n - 2),
                                   **_mask_placement(info, n - 2, n, q.shape[n - 2])))
    # The ring kernel takes as many key heads as query heads, or fewer under enable_gqa; key heads
    # broadcast without it (multi-query attention traced so: Falcon's one key head) are not its.
    heads_ok = n < 3 or info.input("key").shape[n - 3] == q.shape[n - 3] or bool(info.arg("enable_gqa"))
    if not draws_random(info.target, info.bound) and heads_ok:
        options.append(_ring_option(info, n))
    return options
