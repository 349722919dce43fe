"""Pinned degrees of parallelism (``ParallelismOptions``): strategy filters the builder applies.

A pin keeps, for the ops it concerns, only the strategies that place their tensors as asked; every
other decision stays the planner's. It is a filter on the op's strategy list, applied before the
problem is built, so the ILP, recompute, ZeRO and the communication around the pinned ops all see
the restricted options. Each pinned op carries a ``Pin`` (a frozen record): ops pinned alike share
one filtered list (the builder keys its strategy cache and its repeated-block stamps on it), so
repeated blocks stay alike. One mechanism serves every option:

- ``ep_size=N`` (N > 1): each MoE experts op (``autopar::moe_experts``) splits its experts over
  mesh axes whose sizes multiply to N, and its tokens over the same axes (the all-to-all
  dispatch: ``strategies/_experts.py``). ``ep_size=1``: the experts are never split.
- ``sequence_parallel`` (sequence and context parallelism are op strategies, priced by the same
  ILP as every layout: ``strategies/_attention.py``; ``"auto"`` pins nothing). The pinned modes
  split over the *sequence axes*: the innermost mesh axes whose sizes multiply to ``sp_size``
  (default: the last axis of size > 1) -- innermost, where the ring's point-to-point steps and
  the all-to-alls are cheapest:

  - ``"ring"`` (context parallelism): every ``scaled_dot_product_attention``'s query, key, value
    and output split on the sequence over exactly those axes -- the ring attention kernel;
  - ``"all_to_all"`` (Ulysses): the attention split on its heads over those axes (and its
    sequence not), the nodes producing query, key and value sequence-split over them, so each
    input crosses an all-to-all ``S(seq) -> S(heads)`` on its edge;
  - ``"split_gather"`` (Megatron's sequence parallelism): every op inside a normalization module
    (a module class named ``...Norm``: LayerNorm, RMSNorm) outputs its (batch, sequence, ...)
    value split on the sequence over those axes; with the column/row-parallel matmuls of a
    Megatron family on the same axes, the conversions the solver prices around them are the
    all-gather before a column-parallel matmul and the reduce-scatter after a row-parallel one;
  - ``"off"``: no attention splits its query on the sequence over any axis (no ring, no query
    split): the plan without context parallelism. The heads may still split.

  Everything not pinned (the MLP, rotary, residual adds) keeps its own options: their rules offer
  ``Shard(seq)``, and the solver keeps the sequence split where that is cheapest or converts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.fx as fx

from autopar.layout.mesh import MeshSpec
from autopar.planner.options import PlanOptions
from autopar.strategies import Strategy, input_nodes
from autopar.strategies.registry import OpInfo, draws_random

__all__ = ["Pin", "Pins", "pins_of", "sequence_axes"]

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_QKV = ("query", "key", "value")
PinKind = Literal["experts", "ring", "heads", "unsplit_sequence", "output"]


@dataclass(frozen=True, slots=True)
class Pin:
    """What an op's kept strategies place. ``kind``: ``experts`` (experts and tokens split
    ``degree`` ways together), ``ring`` (query, key, value and output split on ``dim`` over exactly
    ``axes``), ``heads`` (those split on ``dim``, the heads, over at least ``axes``, and on
    ``seq`` over none of them), ``unsplit_sequence`` (query and output not split on ``dim`` over
    any axis), ``output`` (the op's one output split on ``dim`` over exactly ``axes``).
    ``option``: the option and value asking for it, as messages name them."""

    kind: PinKind
    option: str
    axes: tuple[int, ...] = ()
    dim: int = 0
    seq: int = 0
    degree: int = 0

    def keeps(self, strategy: Strategy, slots: tuple[str, ...], mesh: MeshSpec) -> bool:
        if self.kind == "experts":
            return _expert_degree(strategy, mesh) == self.degree
        if self.kind == "output":
            spec = strategy.output_specs[0]
            return spec is not None and spec.shard_axes(self.dim) == self.axes
        specs = [spec for arg, spec in zip(slots, strategy.input_specs) if arg in _QKV] + [strategy.output_specs[0]]
        if self.kind == "ring":
            return all(spec.shard_axes(self.dim) == self.axes for spec in specs)
        if self.kind == "heads":
            return all(set(self.axes) <= set(spec.shard_axes(self.dim))
                       and not set(self.axes) & set(spec.shard_axes(self.seq)) for spec in specs)
        return not (specs[0].shard_axes(self.dim) or specs[-1].shard_axes(self.dim))  # unsplit_sequence


class Pins:
    """The filter of one planning call: node name -> its ``Pin``."""

    def __init__(self, pins: dict[str, Pin], mesh: MeshSpec) -> None:
        self.pins, self.mesh = pins, mesh

    def key(self, node: fx.Node) -> Pin | None:
        """``node``'s pin (None: its strategies are not filtered)."""
        return self.pins.get(node.name)

    def keep(self, node: fx.Node, strategies: list[Strategy]) -> list[Strategy]:
        """The strategies of ``node`` its pin keeps; ``ValueError`` naming the option, the node and
        its module when none does."""
        pin = self.pins[node.name]
        slots = tuple(s.arg for s in OpInfo.from_node(node).slots)
        kept = [s for s in strategies if pin.keeps(s, slots, self.mesh)]
        if not kept:
            raise ValueError(f"{pin.option}: no strategy of {OpInfo.from_node(node).where()} places it as pinned "
                             f"({pin.kind} on mesh axes {pin.axes} of mesh {self.mesh.shape}: the sizes must divide "
                             f"over those axes)")
        return kept


def pins_of(traced, options: PlanOptions, mesh: MeshSpec) -> Pins | None:
    """The strategy filter ``options`` asks for on ``mesh`` (None: nothing pinned)."""
    pins = {**_sequence_pins(traced, options, tuple(mesh.shape)), **_expert_pins(traced, options, mesh)}
    return Pins(pins, mesh) if pins else None


# ------------------------------------------------------------------------------- experts
def _expert_pins(traced, options: PlanOptions, mesh: MeshSpec) -> dict[str, Pin]:
    ep = options.ep_size
    if ep is None:
        return {}
    if ep > 1 and not _has_axes_of_size(mesh.shape, ep):
        raise ValueError(f"ep_size={ep}: no mesh axes of mesh {mesh.shape} multiply to {ep}")
    experts_op = torch.ops.autopar.moe_experts.default
    return {n.name: Pin("experts", f"ep_size={ep}", degree=ep) for n in traced.compute_nodes()
            if n.target is experts_op}


def _expert_degree(strategy: Strategy, mesh: MeshSpec) -> int:
    """How many ways the strategy splits the experts with their tokens sent to them (1: not split;
    0: split over an axis where the tokens are not, which is no expert parallelism of degree N)."""
    hidden, gate_up = strategy.input_specs[0], strategy.input_specs[3]
    expert_axes = gate_up.shard_axes(0)
    if not set(expert_axes) <= set(hidden.shard_axes(0)):
        return 0
    return math.prod(mesh.shape[a] for a in expert_axes)


def _has_axes_of_size(shape: tuple[int, ...], size: int) -> bool:
    sizes = list(shape)
    return any(math.prod(sizes[i] for i in range(len(sizes)) if mask >> i & 1) == size
               for mask in range(1, 1 << len(sizes)))


# ------------------------------------------------------------------------------ sequence
def sequence_axes(mesh_shape: tuple[int, ...], sp_size: int | None) -> tuple[int, ...]:
    """The mesh axes a pinned ``sequence_parallel`` mode splits over, major first: the innermost
    axes of size > 1 whose sizes multiply to ``sp_size`` (None: the last axis of size > 1; ``()``
    on a single device). ``ValueError`` naming ``sp_size`` when no such run of axes exists."""
    axes = [a for a, n in enumerate(mesh_shape) if n > 1]
    if sp_size is None:
        return tuple(axes[-1:])
    run, size = [], 1
    for a in reversed(axes):
        if size >= sp_size:
            break
        run.insert(0, a)
        size *= mesh_shape[a]
    if size != sp_size:
        raise ValueError(f"sp_size={sp_size}: the innermost axes of mesh {mesh_shape} do not multiply to {sp_size} "
                         f"(the sequence splits over the last axes of size > 1: give their product)")
    return tuple(run)


def _sequence_pins(traced, options: PlanOptions, mesh_shape: tuple[int, ...]) -> dict[str, Pin]:
    mode = options.sequence_parallel
    if mode == "auto":
        return {}
    option = f"sequence_parallel={mode!r}" + (f", sp_size={options.sp_size}" if options.sp_size is not None else "")
    axes = () if mode == "off" else sequence_axes(mesh_shape, options.sp_size)
    if mode != "off" and not axes:
        return {}  # one device: nothing to split
    attention = [n for n in traced.compute_nodes() if n.target is _SDPA]
    if not attention and mode != "off":
        raise ValueError(f"{option}: {traced.model_name} has no scaled_dot_product_attention to split on the sequence")
    degree = math.prod(mesh_shape[a] for a in axes)
    pins: dict[str, Pin] = {}
    for node in attention:
        info = OpInfo.from_node(node)
        where = f"{info.where()}, {option}"
        n = info.input("query").ndim
        seq, heads = n - 2, n - 3
        if mode == "off":
            pins[node.name] = Pin("unsplit_sequence", option, dim=seq)
            continue
        if mode == "ring" and draws_random(info.target, info.bound):
            raise ValueError(f"{where}: ring attention is not offered with attention dropout (its mask is drawn "
                             f"whole by every strategy); trace in eval mode or with dropout 0")
        if mode == "split_gather":
            continue  # the attention stays the Megatron family's (or the solver's): heads split
        dim = seq if mode == "ring" else heads
        for arg in _QKV:
            size = info.input(arg).shape[dim]
            if size % degree:
                raise ValueError(f"{where}: the {arg}'s {'sequence' if mode == 'ring' else 'heads'} (dim {dim}, "
                                 f"size {size}) does not split evenly over mesh axes {axes} of size {degree}")
        pins[node.name] = Pin("ring", option, axes, seq) if mode == "ring" else Pin("heads", option, axes, heads, seq)
        if mode == "all_to_all":
            _pin_producers(node, info, Pin("output", option, axes, seq), pins, where)
    if mode == "split_gather":
        _pin_norms(traced, attention, Pin("output", option, axes, 1), degree, pins, option)
    return pins


def _pin_producers(node: fx.Node, info: OpInfo, pin: Pin, pins: dict, where: str) -> None:
    """The nodes producing query, key and value: their (single) output ``Shard(seq)`` on the axes."""
    for slot, src in zip(info.slots, input_nodes(node)):
        if slot.arg not in _QKV:
            continue
        if src.op != "call_function" or isinstance(src.meta.get("val"), (list, tuple)):
            raise ValueError(f"{where}: the {slot.arg} comes from {src.op} {src.name!r}, whose output "
                             f"cannot be pinned sequence-split (an op with one tensor output can)")
        if pins.get(src.name, pin) != pin:
            raise ValueError(f"{where}: node {src.name!r} is pinned two ways")
        pins[src.name] = pin


def _pin_norms(traced, attention: list[fx.Node], pin: Pin, degree: int, pins: dict, option: str) -> None:
    """Megatron's sequence parallelism: every op of a normalization module whose output is a
    (batch, sequence, ...) value -- the sequence length read off the attention's query -- split
    on the sequence (dim 1) over the pin's axes."""
    lengths = {OpInfo.from_node(n).input("query").shape[-2] for n in attention}
    for node in traced.compute_nodes():
        val = node.meta.get("val")
        if not (_in_norm(node) and isinstance(val, torch.Tensor) and val.ndim >= 2 and val.shape[1] in lengths):
            continue
        if val.shape[1] % degree:
            raise ValueError(f"{option}: {OpInfo.from_node(node).where()}: the sequence (dim 1, size "
                             f"{val.shape[1]}) does not split evenly over mesh axes {pin.axes} of size {degree}")
        pins[node.name] = pin
    if not pins:
        raise ValueError(f"{option}: {traced.model_name} has no normalization module (a LayerNorm or RMSNorm "
                         f"class) whose (batch, sequence, ...) values Megatron's sequence parallelism splits")


def _in_norm(node: fx.Node) -> bool:
    """Whether ``node`` runs inside a normalization module (its innermost module's class name ends
    in ``Norm``: ``LayerNorm``, ``LlamaRMSNorm``)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return False
    _, cls = list(stack.values())[-1]
    return str(getattr(cls, "__name__", cls)).rsplit(".", 1)[-1].endswith("Norm")
