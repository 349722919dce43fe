"""The gradient bucket cap, shared by the runtime that fills buckets (``runtime.bucketing``)
and the cost model that prices their collectives (``layout.cost.collective_seconds``'s
``bucket_cap``): one place, so the planner amortises each bucket's latency over the bytes the
runtime really packs into it. Device-free; no torch import."""

from __future__ import annotations

import math
import os
from typing import Sequence

__all__ = ["DEFAULT_CAP_MB", "DEFAULT_FIRST_CAP_MB", "ENV_VAR", "FIRST_ENV_VAR", "bucket_cap_bytes",
           "first_cap_bytes_default", "split_buckets"]

DEFAULT_CAP_MB = 25.0  # DDP's default bucket_cap_mb
ENV_VAR = "AUTOPAR_BUCKET_CAP_MB"
DEFAULT_FIRST_CAP_MB = 1.0  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES, DDP's first bucket
FIRST_ENV_VAR = "AUTOPAR_FIRST_BUCKET_CAP_MB"


def bucket_cap_bytes() -> int:
    """The bucket cap for newly emitted graphs (and the plans priced for them):
    ``AUTOPAR_BUCKET_CAP_MB`` (MiB) or 25 MiB; 0 means no bucketing."""
    raw = os.environ.get(ENV_VAR)
    if raw is None or raw.strip() == "":
        return int(DEFAULT_CAP_MB * 2**20)
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV_VAR}={raw!r} is not a number of MiB") from None
    if value < 0 or math.isnan(value):
        raise ValueError(f"{ENV_VAR} must be >= 0, got {raw!r}")
    return int(value * 2**20)


def first_cap_bytes_default() -> int:
    """The first bucket's cap: ``AUTOPAR_FIRST_BUCKET_CAP_MB`` (MiB) or DDP's 1 MiB; 0 means
    no separate first cap (the first bucket is as large as the others)."""
    raw = os.environ.get(FIRST_ENV_VAR, "").strip()
    value = float(raw) if raw else DEFAULT_FIRST_CAP_MB
    if value < 0 or math.isnan(value):
        raise ValueError(f"{FIRST_ENV_VAR} must be >= 0, got {raw!r}")
    return int(value * 2**20)


def split_buckets(sizes: Sequence[int], *, cap: int, first_cap: int) -> list[list[int]]:
    """Positions ``0 .. len(sizes) - 1`` (gradient bytes, in the order the gradients become ready)
    cut into consecutive buckets as torch DDP cuts them: each gradient joins the open bucket, which
    closes once it holds its cap or more -- ``first_cap`` for the first bucket (at most ``cap``; 0:
    no separate first cap), ``cap`` for the others -- so the gradient that crosses a cap rides in
    the bucket it fills. Why DDP's cut: a large gradient right after a few small ones (a ResNet's
    last convolution after its classifier) then leaves in the first bucket, early in backward,
    instead of opening the bucket that waits for the rest. The runtime lays out its buckets so
    (``runtime.bucketing``), and the planner prices the last one -- issued only when backward
    has ended, so nothing hides it -- by the same cut (``planner.builder``)."""
    first_cap = min(cap, first_cap) if first_cap > 0 else cap
    buckets: list[list[int]] = []
    filled, closed = 0, True
    for i, size in enumerate(sizes):
        if closed:
            buckets.append([])
            filled, closed = 0, False
        buckets[-1].append(i)
        filled += size
        closed = filled >= (first_cap if len(buckets) == 1 else cap)
    return buckets
