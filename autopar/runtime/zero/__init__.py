"""ZeRO-1/2 over the plan's replicated axes: ``model.optimizer(torch.optim.AdamW, lr=...)``.

A parameter the plan lays out replicated over some mesh axes (``dp`` devices in all) is, under
``zero_stage`` 1 or 2, updated by ONE of those devices per piece: its optimizer state lives only
for this device's piece. The piece is a DTensor **view** into the parameter's local tensor, with
the replicated axes turned into ``Shard(d)`` (``layout.placement.zero_split`` picks ``d``;
DTensor's own chunking, so uneven and nested pieces agree with ``distribute_tensor``); the inner
optimizer -- any ``torch.optim`` optimizer, or
``autopar.optim``'s layer-wise ones, which are correct on any placements -- updates it in place,
and the updated pieces are all-gathered back into the replicated parameter after the step.

- stage 1: the gradient is all-reduced as without ZeRO (``.grad`` is whole); the piece's
  gradient is a view of it. A plain optimizer over ``model.parameters()`` would still be correct
  (it just keeps all of its state).
- stage 2: data-parallel gradients are reduce-scattered in the backward pass
  (:mod:`autopar.runtime.bucketing`, sharded buckets) straight into the pieces; only gradient
  contributions that are not partial (an op computed whole on every device) reach ``.grad``, and
  ``step`` folds this device's part of them in. ``.grad`` of such a parameter is therefore not
  its gradient: the module refuses to run backward for an optimizer it does not know of.

Every rank must call ``step`` (it ends in collectives). The all-gathers after the step and the
ZeRO-2 reduce-scatters during backward are batched: one collective per bucket (the gradient
buckets' cap, ``layout.buckets``), mesh axis and dtype, laid out once with their buffers kept
(:mod:`autopar.runtime.zero.comm`).

Modules: :mod:`~autopar.runtime.zero.pieces` (a parameter's piece on this device),
:mod:`~autopar.runtime.zero.optimizer` (``ZeroOptimizer``, the inner optimizer over the pieces)
and :mod:`~autopar.runtime.zero.comm` (the batched collectives).
"""

from autopar.runtime.zero.optimizer import ZeroOptimizer
from autopar.runtime.zero.pieces import Piece, piece_of

__all__ = ["ZeroOptimizer", "Piece", "piece_of"]
