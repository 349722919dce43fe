"""The micro-batch rule: which inputs a pipeline cuts into micro-batches, shared by planner and runtime.

The planner traces ONE micro-batch (``micro_batch``: the graph every stage is planned on) and the
runtime runs ``num`` of them per step (``split_micro_batches``, and the chunk specs it gives
torch's schedule). Both must cut the same inputs, or the graph run is not the graph planned: an
input cut at run time but traced whole (or the reverse) has another shape than its placeholder.
So there is one rule, here:

- the batch is dim 0 of the first tensor input that has a dim, in the inputs' pytree order (the
  positional tuple's order, or the keyword dict's);
- an input is *batch-major* when it is a tensor with a dim whose dim 0 is that batch; it is cut
  along dim 0 into ``num`` equal micro-batches;
- every other input -- a scalar tensor, a ``(seq,)`` positions tensor, a mask all samples share,
  a non-tensor -- goes WHOLE into every micro-batch (traced whole, run whole).

A tensor whose dim 0 happens to equal the batch is batch-major by this rule whatever it means;
the runtime checks every input against the traced shapes, so a disagreement is an error, never a
silent mis-split.

Cutting the batch must not change what the step computes (``microbatch_hazard``): a batch norm
in training mode normalises each micro-batch by its own statistics (and updates its running ones
once per micro-batch), and the micro-batch losses add up to the full batch's only for the losses
whose weights the runtime knows (``autopar.runtime.pipeline.weights``: a counted cross entropy or
nll loss, a sum, or a mean over equal micro-batches); and a user autograd.Function that draws
random numbers (``drawing_function``) draws from torch's generator by position in the tensor it
fills, so a micro-batch would not draw its rows of the full batch's numbers. Anything else would
train silently on other gradients, so the planner plans no pipeline for it and the runtime
refuses one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from autopar.tracer.functions import autograd_function, function_call, function_draws

__all__ = ["COUNTED_LOSSES", "batch_size", "drawing_function", "is_batch_major", "known_weights", "loss_op",
           "micro_batch", "microbatch_hazard", "split_micro_batches"]

aten = torch.ops.aten
# The losses with a data-dependent mean (counted targets); all take (self, target, weight, reduction, ignore_index).
COUNTED_LOSSES = {aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_forward.default,
                  aten.nll_loss2d.default}
# Elementwise losses reduced over every element: their mean over equal micro-batches is the full batch's.
_ELEMENT_MEAN_LOSSES = {aten.mse_loss.default, aten.l1_loss.default, aten.smooth_l1_loss.default,
                        aten.huber_loss.default, aten.binary_cross_entropy.default,
                        aten.binary_cross_entropy_with_logits.default, aten.soft_margin_loss.default}
# ops that pass the loss on unchanged on its way to the output
_TRANSPARENT = {aten.to.dtype, aten._to_copy.default, aten.alias.default, aten.clone.default, aten.view.default,
                aten.reshape.default}
_MEAN = 1  # aten's reduction enum: 0 none, 1 mean, 2 sum


def loss_op(loss: Any) -> Any:
    """The op that computes the loss node ``loss``: past casts, views and copies, and past the
    ``getitem`` of ``nll_loss_forward``'s (loss, total_weight)."""
    node = loss
    while node.op == "call_function" and node.target in _TRANSPARENT:
        node = node.args[0]
    if (node.op == "call_function" and getattr(node.target, "__name__", "") == "getitem" and node.args[1] == 0
            and node.args[0].op == "call_function" and node.args[0].target in COUNTED_LOSSES):
        node = node.args[0]
    return node


def _arg(node: Any, name: str, default: Any) -> Any:
    """Argument ``name`` of an aten op node, positional or keyword (its schema gives the position)."""
    for i, a in enumerate(node.target._schema.arguments):
        if a.name == name:
            return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)
    return default


def _batch_statistics(node: Any) -> bool:
    """Whether ``node`` normalises with statistics of its batch (batch norm in training mode or
    without running statistics)."""
    if node.op != "call_function" or "batch_norm" not in str(node.target):
        return False
    if node.target is aten.batch_norm.default:
        return bool(_arg(node, "training", False)) or _arg(node, "running_mean", None) is None
    return "no_training" not in str(node.target) and "no_update" not in str(node.target)


def drawing_function(traced: Any, node: Any) -> str | None:
    """Why ``node``, a user autograd.Function call whose forward or backward draws random numbers
    (``tracer.functions``), cannot run on micro-batches; None for any other node."""
    if not (node.op == "call_function" and node.target is autograd_function._opoverload
            and function_draws(node.args[0])):
        return None
    return (f"node {node.name!r} (autograd.Function {function_call(node.args[0]).name}, module "
            f"{traced.module_path(node) or '<root>'}) draws random numbers from torch's generator, by position in "
            f"the tensor it fills: a micro-batch would draw the full batch's first numbers, not its own rows")


def known_weights(op: Any) -> bool:
    """Whether the loss ``op`` (``loss_op``'s) has micro-batch weights known from the data: a cross
    entropy or nll loss (counted targets, or a sum), a mean-reduced element loss or a mean."""
    if op.op != "call_function":
        return False
    return (op.target in COUNTED_LOSSES or op.target is aten.mean.default
            or (op.target in _ELEMENT_MEAN_LOSSES and _arg(op, "reduction", _MEAN) == _MEAN))


def microbatch_hazard(traced: Any) -> str | None:
    """Why running ``traced`` (a ``TracedGraph``) on micro-batches would compute another step than
    the full batch does (module docstring, and a user autograd.Function that draws random numbers,
    ``tracer.functions``); None when it computes the same."""
    for node in traced.gm.graph.nodes:
        if _batch_statistics(node) and "chunked_batch_norm" in str(node.target):
            return (f"node {node.name!r} (module {traced.module_path(node) or '<root>'}) normalises each rank's "
                    f"chunk of the batch by its own statistics (batch_norm_stats='per_rank'): micro-batches would "
                    f"cut those chunks")
        if _batch_statistics(node):
            return (f"node {node.name!r} ({node.target}, module {traced.module_path(node) or '<root>'}) normalises "
                    f"with its batch's statistics (batch norm in training mode): each micro-batch would use its own")
        if (why := drawing_function(traced, node)) is not None:
            return why
    loss = traced.loss_node
    if loss is None:
        return None  # no loss: the pipeline module refuses the model itself
    op = loss_op(loss)
    if known_weights(op):
        return None
    what = op.target if op.op == "call_function" else op.op
    return (f"the loss {op.name!r} ({what}, module {traced.module_path(op) or '<root>'}) is not one whose "
            f"micro-batch weights are known (a cross entropy or nll loss, or a mean over every element): "
            f"the micro-batch losses would not add up to the full batch's")


def batch_size(inputs: Any) -> int:
    """Dim 0 of the first tensor input that has a dim (the batch every batch-major input shares)."""
    for leaf in pytree.tree_leaves(inputs):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise ValueError("pipelining splits the batch along dim 0, but the inputs hold no tensor with a batch dim")


def is_batch_major(value: Any, batch: int) -> bool:
    """Whether ``value`` is cut into micro-batches (a tensor whose dim 0 is the batch)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and int(value.shape[0]) == batch


def _checked_batch(inputs: Any, num: int) -> int:
    batch = batch_size(inputs)
    if batch % num:
        raise ValueError(f"microbatches={num} does not divide the batch of {batch}")
    return batch


def micro_batch(inputs: Any, num: int) -> Any:
    """``inputs`` with every batch-major tensor cut to one micro-batch (its first rows), the rest
    whole: what the planner traces."""
    batch = _checked_batch(inputs, num)
    micro = batch // num
    return pytree.tree_map(lambda x: x[:micro] if is_batch_major(x, batch) else x, inputs)


def split_micro_batches(inputs: Any, num: int) -> list[Any]:
    """``inputs`` as ``num`` micro-batches of the same structure: each batch-major tensor cut along
    dim 0 into equal pieces (views), everything else the same object in every micro-batch."""
    batch = _checked_batch(inputs, num)
    leaves, spec = pytree.tree_flatten(inputs)
    pieces = [x.chunk(num) if is_batch_major(x, batch) else None for x in leaves]
    return [pytree.tree_unflatten([p[i] if p is not None else x for x, p in zip(leaves, pieces)], spec)
            for i in range(num)]
