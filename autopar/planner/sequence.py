"""Pinning sequence-split attention (``PlanOptions.sequence_parallel``).

Sequence and context parallelism are op strategies, priced and chosen by the same ILP as every
other layout (``strategies/_attention.py``); ``"auto"`` leaves the choice there. The other modes
pin every ``scaled_dot_product_attention`` on the last mesh axis of size > 1 (the innermost, where
the ring's point-to-point steps are cheapest), through ``build_problem``'s ``fixed`` (the
strategies placing the tensors so on that axis, every other axis free):

- ``"ring"``: query, key, value and output ``Shard(seq)`` -- the ring attention kernel;
- ``"all_to_all"`` (Ulysses): the attention split on its heads and the values it reads (the
  nodes producing query, key and value) ``Shard(seq)``, so each input crosses an all-to-all
  ``S(seq) -> S(heads)`` on its edge (and the output's consumer converts back as it prefers).

Everything around the attention (norms, the MLP, elementwise ops) keeps its own options: their
rules offer ``Shard(seq)``, and the solver keeps the sequence split where that is cheapest
(Megatron's sequence parallelism) or converts.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx

from autopar.layout.placement import Shard
from autopar.strategies import FixedAxis, input_nodes
from autopar.strategies.registry import OpInfo, draws_random

__all__ = ["sequence_pins", "with_sequence_pins"]

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_QKV = ("query", "key", "value")


def sequence_pins(traced, mesh_shape: tuple[int, ...], mode: str) -> dict[str, FixedAxis]:
    """Node name -> the placements ``mode`` pins on one mesh axis; {} for ``"auto"`` or a mesh of
    one device. ValueError (naming the node and module) when a model cannot be pinned so."""
    axes = [a for a, n in enumerate(mesh_shape) if n > 1]
    if mode == "auto" or not axes:
        return {}
    axis = axes[-1]
    attention = [n for n in traced.compute_nodes() if n.target is _SDPA]
    if not attention:
        raise ValueError(f"sequence_parallel={mode!r}: {traced.model_name} has no scaled_dot_product_attention "
                         f"to split on the sequence")
    pins: dict[str, FixedAxis] = {}
    for node in attention:
        info = OpInfo.from_node(node)
        where = f"{info.where()}, sequence_parallel={mode!r}"
        if mode == "ring" and draws_random(info.target, info.bound):
            raise ValueError(f"{where}: ring attention is not offered with attention dropout (its mask is drawn "
                             f"whole by every strategy); trace in eval mode or with dropout 0")
        n = info.input("query").ndim
        dim = n - 2 if mode == "ring" else n - 3
        for arg in _QKV:
            size = info.input(arg).shape[dim]
            if size % mesh_shape[axis]:
                raise ValueError(f"{where}: the {arg}'s {'sequence' if mode == 'ring' else 'heads'} (dim {dim}, "
                                 f"size {size}) does not split evenly over mesh axis {axis} of size {mesh_shape[axis]}")
        ins = tuple(Shard(dim) if s.arg in _QKV else None for s in info.slots)
        pins[node.name] = (axis, ins, (Shard(dim),))
        if mode == "all_to_all":
            _pin_producers(node, info, axis, n - 2, pins, where)
    return pins


def _pin_producers(node: fx.Node, info: OpInfo, axis: int, seq: int, pins: dict, where: str) -> None:
    """The nodes producing query, key and value: their (single) output ``Shard(seq)`` on ``axis``."""
    for slot, src in zip(info.slots, input_nodes(node)):
        if slot.arg not in _QKV:
            continue
        if src.op != "call_function" or isinstance(src.meta.get("val"), (list, tuple)):
            raise ValueError(f"{where}: the {slot.arg} comes from {src.op} {src.name!r}, whose output "
                             f"cannot be pinned sequence-split (an op with one tensor output can)")
        want = (axis, (None,) * len(OpInfo.from_node(src).slots), (Shard(seq),))
        if pins.get(src.name, want) != want:
            raise ValueError(f"{where}: node {src.name!r} is pinned two ways")
        pins[src.name] = want


def with_sequence_pins(traced, mesh_shape: tuple[int, ...], mode: str,
                       fixed: Callable[[fx.Node], FixedAxis | None] | None) -> Callable | None:
    """``fixed`` (``build_problem``'s) with ``mode``'s pins added; a node pinned by both is refused."""
    pins = sequence_pins(traced, mesh_shape, mode)
    if not pins:
        return fixed

    def pinned(node: fx.Node) -> FixedAxis | None:
        other = None if fixed is None else fixed(node)
        mine = pins.get(node.name)
        if mine is not None and other is not None and other != mine:
            raise NotImplementedError(f"node {node.name!r} is pinned by sequence_parallel and by a restricted mesh "
                                      f"search at once ({mine} and {other})")
        return mine or other

    return pinned
