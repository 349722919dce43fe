"""The price of a strategy's gradient sums as the planner runs them.

``combine._strategy`` prices a candidate's ``comm_s`` with every partial input gradient
all-reduced inside the op. The planner re-prices those sums per decision: a slot whose sum is
charged elsewhere (a shared parameter's edge) is skipped, a ZeRO-2 parameter's is a
reduce-scatter, a parameter read directly is a member of a gradient bucket paying its share of
the bucket's latency (``layout.cost.collective_seconds``' ``bucket_cap``), and a slot no
trainable parameter feeds takes no gradient at all. The strategy record
(``registry.Strategy``) holds the bytes and axes; this module holds the one way to price them.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from autopar.layout.cost import collective_seconds
from autopar.strategies.registry import Strategy

__all__ = ["grad_sync_seconds", "comm_seconds", "without_gradients"]


def grad_sync_seconds(strategy: Strategy, slot: int, mesh, kind: str = "all_reduce", *, bucket_cap: int = 0) -> float:
    """Seconds to sum input ``slot``'s partial gradient over its ``grad_partial_axes`` with
    collective ``kind`` (the op prices an all-reduce; ZeRO-2 reduce-scatters parameters');
    ``bucket_cap`` > 0: summed in a gradient bucket of that many bytes, paying its share of
    the bucket's latency (``layout.cost.collective_seconds``)."""
    axes = strategy.grad_partial_axes[slot]
    return collective_seconds(kind, strategy.grad_sync_bytes[slot], mesh, axes,
                              bucket_cap=bucket_cap) if axes else 0.0


def comm_seconds(strategy: Strategy, mesh, *, skip: Iterable[int] = (), reduce_scatter: Iterable[int] = (),
                 bucketed: Iterable[int] = (), bucket_cap: int = 0) -> float:
    """``strategy.comm_s`` with the gradient sums of input slots ``skip`` left out (priced
    elsewhere), those of ``reduce_scatter`` priced as reduce-scatters (ZeRO-2) and those of
    ``bucketed`` as gradient-bucket members of a ``bucket_cap``-byte bucket
    (``grad_sync_seconds``); nothing given: ``comm_s`` itself, bit for bit (the terms are added in
    ``combine._strategy``'s order).

    Summed from its terms, never subtracted from ``comm_s``: ``(a + b) - b`` in floats need not
    be ``a``, and where every term is left out it came out a hair below zero (a negative cost
    the solver's records reject)."""
    skip, reduce_scatter, bucketed = set(skip), set(reduce_scatter), set(bucketed)
    if skip & reduce_scatter:
        raise ValueError(f"slots {sorted(skip & reduce_scatter)} both skipped and reduce-scattered")
    grads = sum(grad_sync_seconds(strategy, i, mesh, "reduce_scatter" if i in reduce_scatter else "all_reduce",
                                  bucket_cap=bucket_cap if i in bucketed else 0)
                for i, axes in enumerate(strategy.grad_partial_axes) if axes and i not in skip)
    return strategy.forward_comm_s + (grads + strategy.kernel_bwd_comm_s)


def without_gradients(strategy: Strategy, slots: Iterable[int], mesh) -> Strategy:
    """``strategy`` where input ``slots`` take no gradient (a value no trainable parameter
    feeds): nothing to sum there, so neither its axes nor its all-reduce's cost remain."""
    slots = [i for i in slots if strategy.grad_partial_axes[i]]
    if not slots:
        return strategy
    axes = tuple(() if i in slots else a for i, a in enumerate(strategy.grad_partial_axes))
    wire = tuple(0 if i in slots else b for i, b in enumerate(strategy.grad_sync_bytes))
    kept = dataclasses.replace(strategy, grad_partial_axes=axes, grad_sync_bytes=wire)
    return dataclasses.replace(kept, comm_s=comm_seconds(kept, mesh))
