"""Parameters gathered for a reader that saves them for backward: bytes the memory timeline misses.

A parameter stored split (a ZeRO-3 layout, or a split its reader does not compute on) reaches a
reader wanting more of it through a conversion on the edge (an all-gather). When the reader's
backward needs that input -- a matmul's weight -- autograd keeps the converted copy from the
reader's forward to its backward, beside the stored shard. The ``Problem`` prices the edge's
seconds but gives an edge no bytes, so a plan's peak missed them: GPT-2 on a (2, 2) mesh at a
tight budget stored each ``c_attn`` weight split on axis 1 and gathered it for its ``addmm``,
and measured 2.2 MiB per rank above its estimate -- above the budget it was planned for.

``gathered_bytes`` sums those copies for a choice (every one is alive at the end of forward, where
the saved activations peak; a reader inside a recompute region keeps none: the region re-runs the
conversion in backward). Which inputs an op keeps is read off torch itself: the op runs once on
``meta`` tensors under ``saved_tensors_hooks`` (``saved_slots``).

The planner does not add them yet. Added after the solve, with re-solves under lower budgets, they
made the ILP's reported smallest budget unmeetable (GPT-2 tiny on (2, 2): the copies are 28% of it)
and planning near it 20x slower; they belong in the ILP as an edge's bytes, alive from the reader's
forward to its backward, so that the smallest budget includes them.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from autopar.plans import NodeKind
from autopar.strategies import input_nodes

__all__ = ["saved_slots", "gathered_bytes", "with_gathered"]



def _meta(value, *, grad: bool) -> torch.Tensor:
    t = torch.empty_strided(tuple(value.shape), tuple(value.stride()), dtype=value.dtype, device="meta")
    return t.requires_grad_(grad and t.is_floating_point())


def saved_slots(node: torch.fx.Node) -> frozenset[int]:
    """The input slots (``input_nodes(node)`` order) whose tensor ``node``'s op saves for backward,
    every floating input requiring grad. An op that does not run on ``meta`` counts every slot
    (an upper bound: bytes not to miss)."""
    slots = input_nodes(node)
    vals = [s.meta.get("val") for s in slots]
    key = (node.target, tuple((tuple(v.shape), tuple(v.stride()), v.dtype) if isinstance(v, torch.Tensor) else None
                              for v in vals), _shape_free(node.args), _shape_free(node.kwargs))
    return _cached_slots(key, node)


# (op, input shapes/strides/dtypes, the other arguments) -> saved slots: a repeated block asks once.
_SLOTS: dict[tuple, frozenset[int]] = {}


def _cached_slots(key: tuple, node: torch.fx.Node) -> frozenset[int]:
    if key not in _SLOTS:
        _SLOTS[key] = _run_saved(node)
    return _SLOTS[key]


def _shape_free(value):
    """The non-tensor part of an op's arguments (fx nodes as their position marker), hashable."""
    if isinstance(value, torch.fx.Node):
        return "<tensor>"
    if isinstance(value, (list, tuple)):
        return tuple(_shape_free(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _shape_free(v)) for k, v in value.items()))
    return value if isinstance(value, (int, float, bool, str, type(None), torch.dtype)) else repr(value)


def _run_saved(node: torch.fx.Node) -> frozenset[int]:
    slots = input_nodes(node)
    tensors: dict[torch.fx.Node, torch.Tensor] = {}
    for s in slots:
        val = s.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return frozenset(range(len(slots)))
        tensors.setdefault(s, _meta(val, grad=True))

    def sub(value):
        if isinstance(value, torch.fx.Node):
            return tensors[value]
        if isinstance(value, (list, tuple)):
            return type(value)(sub(v) for v in value)
        return value

    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            node.target(*sub(node.args), **{k: sub(v) for k, v in node.kwargs.items()})
    except Exception:  # noqa: BLE001 -- an op meta cannot run: assume it keeps every input
        return frozenset(range(len(slots)))
    return frozenset(i for i, s in enumerate(slots) if any(t is tensors[s] for t in saved))


def gathered_bytes(traced, built, choice: dict[str, str], *, regions=()) -> int:
    """Bytes per device of the converted parameter copies that readers of ``choice`` keep for
    backward (module docstring): a reader whose input layout of a parameter holds more of it per
    device than the parameter's stored layout, and whose op saves that input."""
    recomputed = {name for region in regions for name in region.nodes}
    mesh_shape = tuple(built.mesh.shape)
    fx_nodes = {n.name: n for n in traced.nodes}
    total = 0
    for node in built.problem.nodes:
        decision = built.decision(node.name)
        if decision.kind != NodeKind.OP or node.name in recomputed:
            continue
        want_specs = built.choice_of(node.name, choice[node.name]).input_specs
        for slot, value in enumerate(decision.inputs):
            if value is None or slot >= len(want_specs) or want_specs[slot] is None:
                continue
            if built.decision(value.producer).kind != NodeKind.PARAMETER:
                continue
            have = built.choice_of(value.producer, choice[value.producer]).output_specs[value.index]
            want = value.local_bytes(want_specs[slot], mesh_shape)
            if have is None or want <= value.local_bytes(have, mesh_shape):
                continue
            if slot in saved_slots(fx_nodes[node.name]):
                total += want
    return total


def with_gathered(evaluation, extra: int):
    """``evaluation`` with ``extra`` bytes live at its activation peak (the end of forward, where
    every kept copy is alive: the peak rises by exactly ``extra``)."""
    if not extra:
        return evaluation
    acts = list(evaluation.activations) or [0]
    at = acts.index(max(acts))
    acts[at] += extra
    return replace(evaluation, activations=tuple(acts))
