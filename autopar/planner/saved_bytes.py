"""Bytes an op's saved activations take per device under one of its strategies.

The builder names each saved storage relative to the op (``SELF``: the op's own outputs and
temporaries; else the input slots whose value lives in that storage) and prices it here, once per
distinct (strategy list, relative parts). A strategy whose local kernel saves other tensors than
the op the profile ran declares its bytes (``LocalKernel.saved_bytes``: the zig-zag ring's own
copies); they replace the parts. No process groups; torch only for the traced values.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx

from autopar.planner.segments import node_vals
from autopar.strategies import Strategy
from autopar.strategies.registry import OpInfo, get_kernel

__all__ = ["SELF", "global_bytes", "activation_bytes"]

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
