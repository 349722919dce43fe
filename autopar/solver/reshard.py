"""Layout conversion (the "shape-consistency manager"): from one ``TensorSpec`` to another.

A conversion is a sequence of ``ReshardStep``s, each acting on exactly one mesh axis. This
module is plain data and search: no torch import. ``autopar.runtime.comm`` executes the steps
as autograd-aware collectives.

Step kinds (``axis`` is the mesh axis; dims are tensor dims):

===============  ===========================  ==============================================
kind             layout change on ``axis``    forward / backward (the gradient layout rule)
===============  ===========================  ==============================================
all_gather       S(src_dim) -> R              all-gather  / local split
split            R -> S(dst_dim)              local split / all-gather
all_to_all       S(src_dim) -> S(dst_dim)     all-to-all  / reverse all-to-all
all_reduce       P -> R                       all-reduce  / identity
reduce_scatter   P -> S(dst_dim)              reduce-scatter / all-gather
to_partial       R -> P                       keep on coordinate 0, zeros elsewhere / identity
===============  ===========================  ==============================================

Gradient layout invariant (DESIGN.md decision 8): the gradient of a value arrives in the same
layout as the value, except that the gradient of a ``P`` value is replicated (each summand's
gradient is the full gradient).

Local consistency: when several mesh axes shard one dim, the lower axis index is the major
digit of the shard index. A step may only add or remove the *minor-most* (highest-index) axis
sharding a dim, so every intermediate layout is an ordinary ``TensorSpec``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ReshardStep", "STEP_KINDS"]

STEP_KINDS = ("all_gather", "split", "all_to_all", "all_reduce", "reduce_scatter", "to_partial")


@dataclass(frozen=True, slots=True)
class ReshardStep:
    kind: str
    axis: int
    src_dim: int | None = None  # all_gather, all_to_all
    dst_dim: int | None = None  # split, all_to_all, reduce_scatter

    def __post_init__(self) -> None:
        assert self.kind in STEP_KINDS, self.kind
        needs_src = self.kind in ("all_gather", "all_to_all")
        needs_dst = self.kind in ("split", "all_to_all", "reduce_scatter")
        assert (self.src_dim is not None) == needs_src, self
        assert (self.dst_dim is not None) == needs_dst, self

    def __str__(self) -> str:
        dims = ""
        if self.kind == "all_to_all":
            dims = f" S{self.src_dim}->S{self.dst_dim}"
        elif self.src_dim is not None:
            dims = f" S{self.src_dim}"
        elif self.dst_dim is not None:
            dims = f" S{self.dst_dim}"
        return f"{self.kind}[axis{self.axis}]{dims}"
