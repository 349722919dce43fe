"""Hand-written-style baseline plans, as restricted strategy sets solved by the same code.

Each baseline gives every mesh axis a role:

- ``dp``   (data parallel): activations are replicated or split on their batch dim (dim 0) or
  partial; parameters and buffers are replicated; ops read parameters replicated.
- ``zero`` (ZeRO-3 / FSDP): activations as ``dp``; parameters may be stored sharded, but ops
  still read them replicated -- the gather before use is the edge's conversion cost.
- ``tp``   (Megatron-style tensor parallel): activations are never split on the batch dim;
  parameters and ops may shard anything else (column/row splits, partial sums).
- ``megatron`` (Megatron's layout, what ``HybridParallelPlugin``'s ``tp_size`` means): ``tp``, and
  every trainable parameter of two or more dims is stored and read split on this axis (a Linear
  weight column- or row-wise, whichever the costs favour), an embedding table is read split by
  its vocabulary (``VocabParallelEmbedding``) and the cross entropy reads its logits split by
  class (vocabulary-parallel cross entropy); without that a cheap-compute cost model may keep a
  small model's weights whole and call it tensor parallel. 1-D parameters (norms, biases) and
  the activations in between follow the costs.
- ``ep`` (data parallel with expert parallelism, what ``MoeHybridParallelPlugin``'s ``ep_size``
  adds): ``dp``, except that a MoE block's experts (``autopar::moe_experts``) and their weights
  may be split by expert on this axis, tokens sent to their experts by all-to-all.
- ``sp`` (the sequence axis of ``HybridParallelPlugin``'s ``sp_size``): parameters stored and
  read whole (their gradients summed over it, as data parallelism's); activations as the costs
  choose around the attention that ``sequence_parallel`` pins on it (``autopar.planner.pins``).

Baselines: ``data-parallel`` (all axes dp), ``zero1`` and ``zero2`` (all axes dp, every trainable
parameter at that ZeRO stage: only when the problem has ZeRO options, ``zero_stage="auto"``),
``zero3`` (all zero), ``megatron-tp`` (all tp) and, on meshes with two or more axes, ``dp x tp``
(axis 0 dp, the others tp). The other families keep ZeRO stage 0. autopar's own plan is the
unrestricted problem, so at optimality it is never slower than any of them.

The fixed-configuration families (``FIXED_FAMILIES``, planned by the booster's plugins and
``autopar inspect --family``, never solved as report baselines): ``megatron`` (all axes megatron),
``dp x megatron`` (axis 0 dp, the others megatron) and its ZeRO-1/2 forms ``zero1 x megatron`` /
``zero2 x megatron``, and the same with ``ep`` in place of ``dp`` (``ep``, ``zero1 ep``, ``zero2 ep``,
``ep x megatron``, ``zero1 ep x megatron``, ``zero2 ep x megatron``), each of those and the
data-parallel ones with a last ``sp`` axis (``... x sp``; ``sp`` alone: every axis sp). ``hybrid_layout`` maps
``HybridParallelPlugin``'s (and ``MoeHybridParallelPlugin``'s) sizes onto a mesh and one of these
families.

Fixed expert-parallel configurations (``expert_layouts``): every EP x TP x DP factorisation of a
cluster -- Megatron TP inside a node, then the expert-parallel group, then plain data parallelism
-- as a mesh and per-axis roles; ``make_restriction(..., expert_parallel=True)`` makes each
``ep`` axis split every experts op's experts and tokens (all-to-all), so the degree is the
configuration's. ``benchmarks/moe.py`` plans each one beside the planner's own plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.fx as fx

from autopar.planner.builder import Choice
from autopar.layout.placement import Partial, Replicate, Shard
from autopar.strategies import input_nodes
from autopar.tracer.graph import BUFFER, PARAMETER, PLACEHOLDER_KEY

__all__ = ["BASELINES", "ZERO_BASELINES", "FIXED_FAMILIES", "FAMILY_ZERO", "ExpertLayout", "HybridLayout",
           "baseline_roles", "expert_layouts", "hybrid_layout", "make_restriction"]

BASELINES = ("data-parallel", "zero1", "zero2", "zero3", "megatron-tp", "dp x tp")
ZERO_BASELINES = {"zero1": 1, "zero2": 2}  # family -> the ZeRO stage of its trainable parameters
FIXED_FAMILIES = ("megatron", "dp x megatron", "zero1 x megatron", "zero2 x megatron",
                  "ep", "zero1 ep", "zero2 ep", "ep x megatron", "zero1 ep x megatron", "zero2 ep x megatron")
FAMILY_ZERO = {**ZERO_BASELINES, "zero1 x megatron": 1, "zero2 x megatron": 2, "zero1 ep": 1, "zero2 ep": 2,
               "zero1 ep x megatron": 1, "zero2 ep x megatron": 2}  # every family with a ZeRO stage
# The families with a sequence axis last (HybridParallelPlugin's sp_size): "<family> x sp".
_SP = " x sp"
FIXED_FAMILIES += ("sp", *(f + _SP for f in ("data-parallel", "zero1", "zero2") + FIXED_FAMILIES))
FAMILY_ZERO.update({f + _SP: stage for f, stage in FAMILY_ZERO.items()})


@dataclass(frozen=True, slots=True)
class HybridLayout:
    """A ``tp_size`` x ``pp_size`` x data-parallel configuration as a mesh and a family: ``shape``
    in axis order (pp, dp, tp) without the axes of size 1 (a single device: ``(1,)``),
    ``axis_names`` to match, ``family`` the restriction of the mesh without its pipeline axis
    (the stage sub-mesh when ``pipeline``), ``pipeline`` the stage count (None: no pipeline)."""

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    family: str
    pipeline: int | None


@dataclass(frozen=True, slots=True)
class ExpertLayout:
    """One fixed EP x TP x DP configuration of a cluster: ``tp`` devices of a node split every
    matrix (Megatron), ``ep`` data-parallel ranks split the experts (tokens sent by all-to-all),
    ``dp`` data-parallel ranks in all (the ``ep`` ones included: ``ep`` divides ``dp``).
    ``shape`` and ``roles``: its mesh, outer to inner (the rest of ``dp``, ``ep``, ``tp``; axes of
    size 1 left out) and each axis's role for ``make_restriction``."""

    ep: int
    tp: int
    dp: int
    shape: tuple[int, ...]
    roles: tuple[str, ...]

    def __str__(self) -> str:
        return f"ep {self.ep} x tp {self.tp} x dp {self.dp}"


def expert_layouts(nodes: int, devices_per_node: int, *, experts: int) -> list[ExpertLayout]:
    """Every ``ExpertLayout`` of ``nodes`` x ``devices_per_node`` devices whose ``tp`` divides a
    node (TP stays on the intra-node links) and whose ``ep`` divides both the data-parallel
    ranks and the ``experts`` count (every rank holds as many experts)."""
    world, found = nodes * devices_per_node, []
    for tp in (d for d in range(1, devices_per_node + 1) if devices_per_node % d == 0):
        dp = world // tp
        for ep in (e for e in range(1, dp + 1) if dp % e == 0 and experts % e == 0):
            axes = [(size, role) for size, role in ((dp // ep, "dp"), (ep, "ep"), (tp, "megatron")) if size > 1]
            axes = axes or [(1, "dp")]
            found.append(ExpertLayout(ep, tp, dp, tuple(a for a, _ in axes), tuple(r for _, r in axes)))
    return found


# A data-parallel family -> the same with its data-parallel axis an ``ep`` axis.
_WITH_EXPERTS = {"data-parallel": "ep", "zero1": "zero1 ep", "zero2": "zero2 ep", "dp x megatron": "ep x megatron",
                 "zero1 x megatron": "zero1 ep x megatron", "zero2 x megatron": "zero2 ep x megatron"}


def hybrid_layout(world: int, *, tp_size: int, pp_size: int, zero_stage: int, experts: bool = False,
                  sp_size: int = 1) -> HybridLayout:
    """``HybridParallelPlugin``'s mesh and family on ``world`` devices: data parallelism (or ZeRO
    ``zero_stage`` 1/2 over it) on ``world / (tp_size * pp_size * sp_size)`` devices, Megatron tensor
    parallelism on ``tp_size``, pipeline stages on ``pp_size``, a sequence axis (``sp`` role, last,
    as the product's mesh (pp, dp, tp, sp)) on ``sp_size``. A pipelined plan prices ZeRO-1 in
    its stage problem (one stage per layout), so its family names no ZeRO stage. ``experts``: the
    data-parallel axis is an ``ep`` axis (MoE experts may be split by expert over it)."""
    if world % (tp_size * pp_size * sp_size):
        raise ValueError(f"tp_size={tp_size} x pp_size={pp_size}" + (f" x sp_size={sp_size}" if sp_size > 1 else "")
                         + f" does not divide the world size {world}")
    sizes = {"pp": pp_size, "dp": world // (tp_size * pp_size * sp_size), "tp": tp_size, "sp": sp_size}
    axes = tuple(name for name, size in sizes.items() if size > 1) or ("dp",)
    dp, tp = sizes["dp"] > 1, tp_size > 1
    zero = zero_stage if pp_size == 1 and dp else 0
    if tp:
        family = (f"zero{zero} x megatron" if zero else "dp x megatron") if dp else "megatron"
    else:
        family = f"zero{zero}" if zero else "data-parallel"
    if experts and dp:
        family = _WITH_EXPERTS[family]
    if sp_size > 1:
        family = family + _SP if dp or tp else "sp"
    return HybridLayout(tuple(sizes[a] for a in axes), axes, family, pp_size if pp_size > 1 else None)


def baseline_roles(name: str, num_axes: int) -> tuple[str, ...] | None:
    """Per-axis roles of baseline ``name`` on a mesh of ``num_axes`` axes (None: not applicable)."""
    if name == "sp":
        return ("sp",) * num_axes
    if name.endswith(_SP):  # the family's roles on the axes before a last sequence axis
        roles = baseline_roles(name.removesuffix(_SP), num_axes - 1) if num_axes >= 2 else None
        return None if roles is None else (*roles, "sp")
    if name in ("data-parallel", *ZERO_BASELINES):
        return ("dp",) * num_axes
    if name == "zero3":
        return ("zero",) * num_axes
    if name == "megatron-tp":
        return ("tp",) * num_axes
    if name == "dp x tp":
        return ("dp",) + ("tp",) * (num_axes - 1) if num_axes >= 2 else None
    if name == "megatron":
        return ("megatron",) * num_axes
    if name in ("dp x megatron", "zero1 x megatron", "zero2 x megatron"):
        return ("dp",) + ("megatron",) * (num_axes - 1) if num_axes >= 2 else None
    if name in ("ep", "zero1 ep", "zero2 ep"):
        return ("ep",) * num_axes
    if name in ("ep x megatron", "zero1 ep x megatron", "zero2 ep x megatron"):
        return ("ep",) + ("megatron",) * (num_axes - 1) if num_axes >= 2 else None
    raise ValueError(f"unknown family {name!r}; known: {BASELINES + FIXED_FAMILIES}")


# Ops the megatron role reads split by a fixed dim: op -> (input slot, dim): the table of an
# embedding by its rows (vocabulary), the logits of a cross entropy by class.
_MEGATRON_READS = {torch.ops.aten.embedding.default: (0, 0), torch.ops.aten.cross_entropy_loss.default: (0, 1)}

_WEIGHT_CHAIN = 6  # ops between a weight and a copy of it that still counts as one (cast, t, view)


def _is_weight(node: fx.Node, memo: dict[fx.Node, bool], depth: int = 0) -> bool:
    """A parameter or buffer, or a value made from nothing else within a few ops (a bf16 plan's
    ``_to_copy`` of a weight, its ``t``): a Megatron column / row split shards such a copy as it
    shards the weight, so the families judge it as a weight, not as an activation whose dim 0 is
    the batch. The depth cap keeps an activation's check from walking the whole graph."""
    if node in memo:
        return memo[node]
    if node.op == "placeholder":
        ph = node.meta.get(PLACEHOLDER_KEY)
        memo[node] = ph is not None and ph.kind in (PARAMETER, BUFFER)
        return memo[node]
    if node.op != "call_function" or depth >= _WEIGHT_CHAIN:
        return False
    srcs = input_nodes(node)
    found = bool(srcs) and all(_is_weight(src, memo, depth + 1) for src in srcs)
    if found or depth == 0:  # a False deeper down may only mean the cap was reached from there
        memo[node] = found
    return found


def _activation_ok(placement, role: str) -> bool:
    if role == "sp":
        return True  # around the pinned attention, the costs choose
    if role in ("dp", "zero", "ep"):
        return isinstance(placement, (Replicate, Partial)) or placement == Shard(0)
    return placement != Shard(0)  # tp, megatron: never the batch dim


def _trains(node: fx.Node, memo: dict[fx.Node, bool], depth: int = 0) -> bool:
    """A weight value (``_is_weight``) made from at least one trainable parameter: a buffer's copy
    (a causal mask, rotary frequencies) is not one Megatron splits."""
    if node in memo:
        return memo[node]
    if node.op == "placeholder":
        ph = node.meta.get(PLACEHOLDER_KEY)
        memo[node] = ph is not None and ph.kind == PARAMETER and ph.requires_grad
    elif node.op != "call_function" or depth >= _WEIGHT_CHAIN:
        return False
    else:
        memo[node] = any(_trains(src, memo, depth + 1) for src in input_nodes(node))
    return memo[node]


def _ndim(node: fx.Node) -> int:
    val = node.meta.get("val")
    return len(val.shape) if hasattr(val, "shape") else 0


def make_restriction(roles: Sequence[str], *, zero_stage: int | None = None, mesh_shape: Sequence[int] = (),
                     expert_parallel: bool = False):
    """``allowed(kind, fx_node, choice)``: whether a decision's option keeps ``roles`` (one per mesh
    axis) and, unless ``zero_stage`` is None (a problem with one stage per layout), ZeRO stage
    ``zero_stage`` for trainable parameters (stage 0 for the others, and for all on a mesh
    without an axis to shard over); ``autopar.planner.assemble.restricted_problem`` slices the
    built problem with it. ``expert_parallel``: on every ``ep`` axis each experts op splits its
    experts and its tokens (the all-to-all dispatch), not merely may."""
    roles = tuple(roles)
    ep_axes = tuple(a for a, r in enumerate(roles) if r == "ep") if expert_parallel else ()
    shardable = any(size > 1 for size in mesh_shape)
    sizes = tuple(mesh_shape) or (2,) * len(roles)  # no shape given: every axis may split
    # Per op, what each input slot reads: 0 an activation, 1 a weight, 2 a trainable weight of two
    # or more dims (a "matrix": the megatron role splits it); and whether its output is a matrix.
    op_slots: dict[fx.Node, tuple[tuple[int, ...], bool]] = {}
    weights: dict[fx.Node, bool] = {}  # values that are weights or made from weights only
    trains: dict[fx.Node, bool] = {}  # weight values made from a trainable parameter

    def slot_of(src: fx.Node) -> int:
        if not _is_weight(src, weights):
            return 0
        return 2 if _ndim(src) >= 2 and _trains(src, trains) else 1

    verdicts: dict[tuple, bool] = {}  # (kind, choice, slots, matrix, experts) -> allowed
    expert_weights: dict[fx.Node, bool] = {}

    def allowed(kind: str, node: fx.Node, choice: Choice) -> bool:
        slots, matrix = (), False  # matrix: a trainable parameter (or copy) of two or more dims
        if kind == "op" and not _megatron_read_ok(node, choice):
            return False
        if kind == "op":
            if node not in op_slots:  # asked once per option: bind the op's inputs once
                kinds = tuple(slot_of(src) for src in input_nodes(node))
                op_slots[node] = kinds, bool(kinds) and all(kinds) and slot_of(node) == 2
            slots, matrix = op_slots[node]
        if kind == "parameter":
            ph = node.meta[PLACEHOLDER_KEY]
            matrix = ph.requires_grad and len(ph.shape) >= 2
            trainable = ph.requires_grad and bool(ph.shape) and shardable
            if zero_stage is not None and choice.zero_stage != (zero_stage if trainable else 0):
                return False
        # A MoE block's experts (``autopar::moe_experts``) and their weights may be split by expert
        # on a data-parallel axis: expert parallelism, tokens sent to their experts by all-to-all.
        experts = (node.target is _EXPERTS if kind == "op" else
                   kind == "parameter" and _feeds_experts(node, expert_weights))
        # Choices are shared objects across identical repeated blocks: judge each one once.
        key = (kind, id(choice), slots, matrix, experts)
        verdict = verdicts.get(key)
        if verdict is None:
            verdict = verdicts[key] = _judge(kind, choice, slots, matrix, experts)
        return verdict

    def _megatron_read_ok(node: fx.Node, choice: Choice) -> bool:
        read = _MEGATRON_READS.get(node.target)
        if read is None or "megatron" not in roles:
            return True
        spec = choice.input_specs[read[0]]
        return spec is None or all(r != "megatron" or size == 1 or p == Shard(read[1])
                                   for p, r, size in zip(spec.placements, roles, sizes))

    def weight_ok(spec, matrix: bool, *, whole: tuple[str, ...] = ("dp", "zero", "ep", "sp"),
                  experts: bool = False) -> bool:
        """Roles ``whole`` keep a weight whole (data-parallel families read weights whole; ZeRO-3
        stores them split but reads them whole) -- experts' weights may be split by expert on an
        ``ep`` axis; megatron splits (and reads split) a matrix, experts' aside (as the product's
        MoE plugin, which splits experts by ``ep_size`` only)."""
        return spec is None or all((r not in whole or isinstance(p, Replicate)
                                    or (experts and r == "ep" and p == Shard(0)))
                                   and (r != "megatron" or not matrix or size == 1 or isinstance(p, Shard)
                                        or experts)  # experts are split by ep, not by Megatron's tp
                                   for p, r, size in zip(spec.placements, roles, sizes))

    def _judge(kind: str, choice: Choice, slots: tuple[int, ...], matrix: bool, experts: bool) -> bool:
        if kind == "op" and experts and not all(choice.input_specs[slot].placements[a] == Shard(0)
                                                for a in ep_axes for slot in _EXPERT_SPLIT_SLOTS):
            return False
        if kind in ("parameter", "buffer"):
            return weight_ok(choice.output_specs[0], matrix, whole=("dp", "ep", "sp"), experts=experts)
        # An op made from weights only (all its slots weights) outputs a weight copy.
        made_from_weights = bool(slots) and all(slots)
        specs = [] if made_from_weights else list(choice.output_specs)
        weight_specs = [(spec, matrix) for spec in choice.output_specs] if made_from_weights else []
        for slot, spec in zip(slots, choice.input_specs):
            if slot:
                weight_specs.append((spec, slot == 2))
            else:
                specs.append(spec)
        for spec in specs:
            if spec is not None and not all(_activation_ok(p, r) for p, r in zip(spec.placements, roles)):
                return False
        return all(weight_ok(spec, m, experts=experts) for spec, m in weight_specs)

    return allowed


_EXPERTS = torch.ops.autopar.moe_experts.default
_EXPERT_SPLIT_SLOTS = (0, 3)  # ``moe_experts``' hidden (the tokens) and gate_up (the experts)


def _feeds_experts(node: fx.Node, memo: dict[fx.Node, bool], depth: int = 0) -> bool:
    """A value read by a MoE experts op, directly or through a few ops (a bf16 plan's cast)."""
    if node in memo:
        return memo[node]
    found = any(user.target is _EXPERTS or (depth < _WEIGHT_CHAIN and user.op == "call_function"
                                            and _feeds_experts(user, memo, depth + 1)) for user in node.users)
    if found or depth == 0:  # a False deeper down may only mean the cap was reached from there
        memo[node] = found
    return found
