"""Scaled dot-product attention. Local op: the same op on local shards.

Dims of ``query`` (..., L, E), ``key`` (..., S, E), ``value`` (..., S, Ev), ``attn_mask``
broadcastable to (..., L, S); output (..., L, Ev). Single-axis options:

- split a leading dim (batch, heads): query, key, value and the mask (where it has that dim at
  full size; broadcast dims stay replicated) are sharded on it. With ``enable_gqa`` the query
  heads and the fewer key/value heads are split into the same number of contiguous chunks,
  which keeps every query head with its key/value head;
- split the query length L when ``is_causal`` is False: key and value are replicated (their
  gradients become partial), the mask is split on L. A causal split of L would need the
  rank's row offset in the mask, so it is not offered.

The embedding dim is never split: the softmax between the two contractions is not linear.
``dropout_p > 0`` draws a different mask per rank, as on a single device it draws a different
mask per call; the rules hold in distribution, the numerical check runs with ``dropout_p=0``.
"""

from __future__ import annotations

import torch

from autopar.layout.placement import Replicate, Shard
from autopar.strategies.registry import AxisOption, OpInfo, Sample, register
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
    ]


@register(aten.scaled_dot_product_attention.default, has_flops=True, samples=_sdpa_samples)
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
    return options
