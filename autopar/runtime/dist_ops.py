"""The flat-tensor collectives under torch 2.13's names, on older torch as well.

torch 2.13 calls them ``all_gather_single`` / ``reduce_scatter_single``; earlier releases (the
2.11 that GPU machines' images carry) only have ``all_gather_into_tensor`` /
``reduce_scatter_tensor``, the same operations under their old names. Every caller in the runtime
takes them from here, so the runtime runs on both.
"""

from __future__ import annotations

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

__all__ = ["all_gather_single", "reduce_scatter_single"]
