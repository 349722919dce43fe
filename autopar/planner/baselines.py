"""Hand-written-style baseline plans, as restricted strategy sets solved by the same code.

Each baseline gives every mesh axis a role:

- ``dp``   (data parallel): activations are replicated or split on their batch dim (dim 0) or
  partial; parameters and buffers are replicated; ops read parameters replicated.
- ``zero`` (ZeRO-3 / FSDP): activations as ``dp``; parameters may be stored sharded, but ops
  still read them replicated -- the gather before use is the edge's conversion cost.
- ``tp``   (Megatron-style tensor parallel): activations are never split on the batch dim;
  parameters and ops may shard anything else (column/row splits, partial sums).

Baselines: ``data-parallel`` (all axes dp), ``zero1`` and ``zero2`` (all axes dp, every trainable
parameter at that ZeRO stage: only when the problem has ZeRO options, ``zero_stage="auto"``),
``zero3`` (all zero), ``megatron-tp`` (all tp) and, on meshes with two or more axes, ``dp x tp``
(axis 0 dp, the others tp). The other families keep ZeRO stage 0. autopar's own plan is the
unrestricted problem, so at optimality it is never slower than any of them.
"""

from __future__ import annotations

from typing import Sequence

import torch.fx as fx

from autopar.planner.builder import Choice
from autopar.layout.placement import Partial, Replicate, Shard
from autopar.strategies import input_nodes
from autopar.tracer.graph import BUFFER, PARAMETER, PLACEHOLDER_KEY

__all__ = ["BASELINES", "ZERO_BASELINES", "baseline_roles", "make_restriction"]

BASELINES = ("data-parallel", "zero1", "zero2", "zero3", "megatron-tp", "dp x tp")
ZERO_BASELINES = {"zero1": 1, "zero2": 2}  # family -> the ZeRO stage of its trainable parameters


def baseline_roles(name: str, num_axes: int) -> tuple[str, ...] | None:
    """Per-axis roles of baseline ``name`` on a mesh of ``num_axes`` axes (None: not applicable)."""
    if name in ("data-parallel", *ZERO_BASELINES):
        return ("dp",) * num_axes
    if name == "zero3":
        return ("zero",) * num_axes
    if name == "megatron-tp":
        return ("tp",) * num_axes
    if name == "dp x tp":
        return ("dp",) + ("tp",) * (num_axes - 1) if num_axes >= 2 else None
    raise ValueError(f"unknown baseline {name!r}; known: {BASELINES}")


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
    if role in ("dp", "zero"):
        return isinstance(placement, (Replicate, Partial)) or placement == Shard(0)
    return placement != Shard(0)  # tp: never the batch dim


def make_restriction(roles: Sequence[str], *, zero_stage: int | None = None, mesh_shape: Sequence[int] = ()):
    """``allowed(kind, fx_node, choice)``: whether a decision's option keeps ``roles`` (one per mesh
    axis) and, unless ``zero_stage`` is None (a problem with one stage per layout), ZeRO stage
    ``zero_stage`` for trainable parameters (stage 0 for the others, and for all on a mesh
    without an axis to shard over); ``autopar.planner.assemble.restricted_problem`` slices the
    built problem with it."""
    roles = tuple(roles)
    shardable = any(size > 1 for size in mesh_shape)
    weight_slots: dict[fx.Node, tuple[bool, ...]] = {}  # per op: which input slots are weights
    weights: dict[fx.Node, bool] = {}  # values that are weights or made from weights only

    verdicts: dict[tuple, bool] = {}  # (kind, choice, weight slots) -> allowed

    def allowed(kind: str, node: fx.Node, choice: Choice) -> bool:
        slots = ()
        if kind == "op":
            if node not in weight_slots:  # asked once per option: bind the op's inputs once
                weight_slots[node] = tuple(_is_weight(src, weights) for src in input_nodes(node))
            slots = weight_slots[node]
        if kind == "parameter" and zero_stage is not None:
            ph = node.meta[PLACEHOLDER_KEY]
            trainable = ph.requires_grad and bool(ph.shape) and shardable
            if choice.zero_stage != (zero_stage if trainable else 0):
                return False
        # Choices are shared objects across identical repeated blocks: judge each one once.
        key = (kind, id(choice), slots)
        verdict = verdicts.get(key)
        if verdict is None:
            verdict = verdicts[key] = _judge(kind, choice, slots)
        return verdict

    def _judge(kind: str, choice: Choice, slots: tuple[bool, ...]) -> bool:
        if kind in ("parameter", "buffer"):
            spec = choice.output_specs[0]
            return all(role != "dp" or isinstance(p, Replicate) for p, role in zip(spec.placements, roles))
        # An op made from weights only (all its slots weights) outputs a weight copy.
        made_from_weights = bool(slots) and all(slots)
        specs = [] if made_from_weights else list(choice.output_specs)
        weight_specs = list(choice.output_specs) if made_from_weights else []
        for is_weight, spec in zip(slots, choice.input_specs):
            (weight_specs if is_weight else specs).append(spec)
        for spec in specs:
            if spec is not None and not all(_activation_ok(p, r) for p, r in zip(spec.placements, roles)):
                return False
        for spec in weight_specs:  # data-parallel families read weights whole
            if spec is not None and any(r in ("dp", "zero") and not isinstance(p, Replicate)
                                        for p, r in zip(spec.placements, roles)):
                return False
        return True

    return allowed
