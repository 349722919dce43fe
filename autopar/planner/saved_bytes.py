"""Bytes an op's saved activations take per device under one of its strategies.

The builder names each saved storage relative to the op (``SELF``: the op's own outputs and
temporaries; else the input slots whose value lives in that storage) and prices it here, once per
distinct (strategy list, relative parts). A strategy whose local kernel saves other tensors than
the op the profile ran declares its bytes (``LocalKernel.saved_bytes``: the zig-zag ring's own
copies); they replace the parts. No process groups; torch only for the traced values.

A parameter is not an activation, but the copy of it a reader gathers is: stored in one layout
and read in a larger one (ZeRO-3 / FSDP, or an auto plan's gathered weight), it reaches the reader
through a conversion on the parameter -> reader edge, and when the reader's backward needs that
input (a matmul's weight), autograd keeps the converted copy from the reader's forward to its
backward beside the stored piece. ``gathered_copies`` prices it per (parameter layout, reader
strategy) pair -- the ``Problem`` edge's ``mem`` -- and ``saved_slots`` says which inputs an op
saves, read off torch itself: the op once on ``meta`` tensors under ``saved_tensors_hooks``.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
import torch.fx as fx

from autopar.planner.segments import node_vals
from autopar.strategies import Strategy, input_nodes
from autopar.strategies.registry import OpInfo, get_kernel

__all__ = ["SELF", "global_bytes", "activation_bytes", "saved_slots", "gathered_copies", "edge_copies"]

SELF = "self"  # a saved storage the op made itself


def _is_float(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.dtype.is_floating_point


def global_bytes(node: fx.Node, slots: list[fx.Node], activations: list[bool]) -> int:
    """Float bytes of the node's activation inputs and outputs (parameters are counted apart)."""
    vals = [s.meta.get("val") for s, act in zip(slots, activations) if act]
    vals += list(node_vals(node))
    return sum(v.numel() * v.dtype.itemsize for v in vals if _is_float(v))


def activation_bytes(node: fx.Node, s: Strategy, slots: list[fx.Node], activations: Sequence[bool],
                      global_bytes: int, parts: tuple[tuple[Any, int], ...]) -> int:
    """Local bytes of the saved storages ``parts`` ((whose storage, global bytes), as
    ``autopar.planner.builder`` names them relative to the op) under strategy ``s``.

    Each storage scales by the local fraction of the tensor it is: one the op made itself (its
    outputs, internal temporaries such as attention's logsumexp) by the strategy's output
    fraction; one made upstream by the fraction of the (first) input slot whose value lives in
    that storage (through views and ``getitem``), under the strategy's input spec (a
    column-parallel linear keeps its replicated input whole, a row-parallel one its sharded
    input). A storage matching neither (an upstream value reached another way) takes the op's
    blended fraction: local/global bytes of all its activation inputs and outputs."""
    own = get_kernel(s.kernel).saved_bytes if s.kernel is not None else None
    own = own(OpInfo.from_node(node), s) if own is not None else None
    if own is not None:  # the kernel keeps its own tensors, not those of the op the profile ran
        return own
    blended = min(local_bytes(s, slots, activations) / global_bytes, 1.0) if global_bytes else 1.0
    out_global = sum(v.numel() * v.dtype.itemsize for v in node_vals(node)
                     if isinstance(v, torch.Tensor))
    out_frac = min(s.output_bytes / out_global, 1.0) if out_global else blended
    in_frac = input_fraction(s, slots, activations)
    total = 0.0
    for where, nbytes in parts:
        if where is not SELF:
            k = next((k for k in where if k < len(s.input_bytes)), None)
            if k is None:
                frac = blended
            else:
                val = slots[k].meta["val"]
                frac = min(s.input_bytes[k] / (val.numel() * val.dtype.itemsize), 1.0)
        elif nbytes <= out_global or in_frac is None:
            frac = out_frac
        else:
            # A temporary bigger than the output is input-sized (cross-entropy's log-softmax
            # behind a scalar loss): it is as sharded as the inputs, not as the output.
            frac = in_frac
        total += nbytes * frac
    return int(round(total))


def input_fraction(s: Strategy, slots: list[fx.Node], activations: list[bool]) -> float | None:
    """Local/global bytes of the op's floating activation inputs under ``s`` (None: none)."""
    local = full = 0
    for i, src in enumerate(slots):
        val = src.meta.get("val")
        if i < len(s.input_bytes) and activations[i] and _is_float(val):
            local += s.input_bytes[i]
            full += val.numel() * val.dtype.itemsize
    return min(local / full, 1.0) if full else None


def local_bytes(s: Strategy, slots: list[fx.Node], activations: list[bool]) -> int:
    """The same bytes per device under strategy ``s``: what its saved activations scale by."""
    total = sum(s.input_bytes[i] for i, src in enumerate(slots)
                if activations[i] and _is_float(src.meta.get("val")))
    return total + s.output_bytes


# (op, input shapes/strides/dtypes/grads, the other arguments) -> saved slots: a repeated block asks once.
_SLOTS: dict[tuple, frozenset[int]] = {}


def saved_slots(node: fx.Node, slots: list[fx.Node], needs_grad) -> frozenset[int]:
    """The input slots (``slots``: ``input_nodes(node)``) whose tensor ``node``'s op saves for
    backward, the floating inputs named in ``needs_grad`` requiring grad as in the traced step.
    An op that does not run on ``meta`` counts every tensor slot (an upper bound: bytes not to miss)."""
    vals = [src.meta.get("val") for src in slots]
    grads = tuple(src.name in needs_grad for src in slots)
    key = (node.target, tuple((tuple(v.shape), tuple(v.stride()), v.dtype) if isinstance(v, torch.Tensor) else None
                              for v in vals), grads, _shape_free(node.args), _shape_free(node.kwargs))
    if key not in _SLOTS:
        _SLOTS[key] = _run_saved(node, slots, vals, grads)
    return _SLOTS[key]


def _shape_free(value):
    """The non-tensor part of an op's arguments (fx nodes as one marker), hashable."""
    if isinstance(value, fx.Node):
        return "<tensor>"
    if isinstance(value, (list, tuple)):
        return tuple(_shape_free(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _shape_free(v)) for k, v in value.items()))
    return value if isinstance(value, (int, float, bool, str, type(None), torch.dtype)) else repr(value)


def _run_saved(node: fx.Node, slots: list[fx.Node], vals: list, grads: tuple[bool, ...]) -> frozenset[int]:
    every = frozenset(k for k, v in enumerate(vals) if isinstance(v, torch.Tensor))
    tensors: dict[str, torch.Tensor] = {}
    for src, val, grad in zip(slots, vals, grads):
        if not isinstance(val, torch.Tensor):
            return every
        t = torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device="meta")
        tensors.setdefault(src.name, t.requires_grad_(grad and t.is_floating_point()))

    def sub(value):
        if isinstance(value, fx.Node):
            return tensors[value.name] if value.name in tensors else value.meta.get("val")
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
        return every
    # A saved view of an input (a matmul's transposed weight) keeps the input's storage.
    kept = {t.untyped_storage()._cdata for t in saved if isinstance(t, torch.Tensor)}
    return frozenset(k for k, src in enumerate(slots) if tensors[src.name].untyped_storage()._cdata in kept)


def gathered_copies(src_choices, value, dst_choices, slot: int, mesh_shape: tuple[int, ...]) -> np.ndarray:
    """Bytes per device of the copy of ``value`` (a parameter, stored per ``src_choices``) that a
    reader running ``dst_choices`` converts for input ``slot`` and saves: ``[i, j]`` is the local
    bytes of the reader's input spec when it differs from the stored one and holds at least as
    much (a gather, or an all-to-all; a local slice is taken as a view and counted nowhere)."""
    out = np.zeros((len(src_choices), len(dst_choices)), dtype=np.int64)
    for j, dst in enumerate(dst_choices):
        want = dst.input_specs[slot] if slot < len(dst.input_specs) else None
        if want is None:
            continue
        size = value.local_bytes(want, mesh_shape)
        for i, src in enumerate(src_choices):
            have = src.output_specs[value.index]
            if have is not None and have != want and size >= value.local_bytes(have, mesh_shape):
                out[i, j] = size
    return out


def edge_copies(param, reader, node: fx.Node, needs_grad, mesh_shape: tuple[int, ...],
                cache: dict) -> np.ndarray | None:
    """``gathered_copies`` summed over the input slots in which ``reader`` (a ``Decision``, of fx
    ``node``) reads ``param`` (a parameter's ``Decision``) and saves it; None when it keeps none.
    ``cache``: the builder's, keyed by the choice tuples (repeated blocks share them)."""
    saved, mem = saved_slots(node, input_nodes(node), needs_grad), None
    for slot, value in enumerate(reader.inputs):
        if value is None or value.producer != param.name or slot not in saved:
            continue
        key = ("copies", tuple(map(id, param.choices)), value.index, tuple(map(id, reader.choices)), slot)
        if key not in cache:
            cache[key] = gathered_copies(param.choices, value, reader.choices, slot, mesh_shape)
        mem = cache[key] if mem is None else mem + cache[key]
    return mem
