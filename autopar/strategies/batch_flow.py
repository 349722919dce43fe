"""Whether a forward mixes samples across the batch: what micro-batching would silently change.

A pipeline runs the batch as micro-batches, each through the whole forward on its own. That
computes the full batch's step only when every sample's activations depend on that sample alone
up to the loss -- the loss's own reduction over the batch apart, whose micro-batch weights the
runtime knows (``tracer.microbatch.known_weights``). An in-batch contrastive loss (CLIP's
``text @ image.T`` over the batch), a batch-level softmax, ``x - x.mean(0)``, a training batch norm
(``tracer.microbatch``'s own check) all mix samples: each micro-batch would see only its own.

The op rules already know which placements an op can run on with no communication, and the
batch is a shard: ``batch_mixing`` follows the batch through the forward as one mesh axis would
carry it -- a batch-major input (``tracer.microbatch.is_batch_major``) is ``Shard(0)`` -- taking at
each op a rule option that places every batch-carrying input on its own batch dim, runs the plain
local op (no kernel: a kernel may communicate inside), and keeps the batch whole in an output
that is not partial. An op with no such option combines samples; that is allowed only where the
loss reduces (the loss op and what follows it to the output). An op with no rule cannot be
followed and counts as mixing: the planner then plans no pipeline, which costs speed, never
gradients.

A tensor no batch-major input reaches is *shared*: parameters, buffers, constants and what is
computed from them and from shapes -- a causal mask, a class token, position ids expanded to the
batch. It may be replicated or sliced along any dim, taken to be the same for every sample: the
micro-batch's own trace builds it at the micro-batch's size by the same code. One that numbers
the samples (``arange`` over the batch used as per-sample data) breaks that assumption; the one
common use, an in-batch contrastive loss's targets, comes with the ``text @ image.T`` this finds.
"""

from __future__ import annotations

import operator
from typing import Any

import torch.fx as fx

from autopar.layout.placement import Partial, Replicate, Shard
from autopar.strategies.combine import normalise_option
from autopar.strategies.derived import rule_for
from autopar.strategies.registry import OpInfo, input_nodes, needs_no_decision
from autopar.tracer.graph import INPUT
from autopar.tracer.microbatch import batch_size, drawing_function, loss_op, microbatch_hazard

__all__ = ["batch_mixing", "pipeline_hazard", "one_sample_micro_batches"]

# A tensor's state: an int is the dim that carries the batch; ``_SHARED`` marks a tensor no
# batch-major input reaches (parameters, buffers, constants, what is computed from them and from
# shapes: a causal mask, a class token or position ids expanded to the batch).
_SHARED = "shared"


def pipeline_hazard(traced: Any, meta_inputs: Any = None) -> str | None:
    """Why running ``traced`` on micro-batches would compute another step than the full batch
    (``microbatch_hazard``'s batch statistics and loss forms, then ``batch_mixing``); None when
    it computes the same. ``meta_inputs`` (the traced call's inputs) give the batch; without them
    it is read off the graph's input placeholders."""
    return microbatch_hazard(traced) or batch_mixing(traced, meta_inputs)


def one_sample_micro_batches(meta_inputs: Any, counts: Any) -> bool:
    """Whether some micro-batch count of ``counts`` cuts the batch of ``meta_inputs`` into single
    samples, whose graphs ``batch_mixing`` cannot follow: the full batch's must be checked."""
    return any(batch_size(meta_inputs) // m <= 1 for m in counts)


def _batch_of(traced: Any, meta_inputs: Any) -> int:
    if meta_inputs is not None:
        return batch_size(meta_inputs)
    inputs = [p for p in traced.placeholders if p.kind == INPUT and p.shape]
    return inputs[0].shape[0] if inputs else 0


def _batch_inputs(traced: Any, batch: int) -> set[str]:
    """Names of the input placeholders cut into micro-batches of a batch of ``batch``."""
    return {p.name for p in traced.placeholders if p.kind == INPUT and p.shape and p.shape[0] == batch}


def _loss_path(traced: Any) -> set[fx.Node]:
    """The loss op and the nodes from it to the loss output: where reducing the batch is the loss."""
    loss = traced.loss_node
    if loss is None:
        return set()
    path, node = {loss}, loss
    op = loss_op(loss)
    while node is not op and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
        path.add(node)
    path.add(op)
    return path


def _fits(placement: Any, state: Any) -> bool:
    """Whether an input in ``state`` may take ``placement`` with no communication and no change
    of meaning: the batch only as its own shard; a shared tensor replicated or sliced along any
    dim (module docstring: the micro-batch's trace builds the same slice)."""
    if isinstance(state, int):
        return placement == Shard(state)
    return isinstance(placement, Replicate) or (isinstance(placement, Shard) and placement.segments == 1)


def _options(node: fx.Node) -> tuple[OpInfo, list] | None:
    entry = rule_for(node.target)
    if entry is None:
        return None
    info = OpInfo.from_node(node)
    # a kernel may communicate inside: only the plain local op keeps samples apart for sure
    return info, [o for o in (normalise_option(info, o) for o in entry.rule(info)) if o.kernel is None]


def _follow(node: fx.Node, state: dict[fx.Node, Any]) -> tuple[Any, str | None]:
    """(the state of ``node``'s output(s), or why the batch cannot follow it)."""
    if needs_no_decision(node) and node.target is not operator.getitem:
        return _SHARED, None  # no tensor out (a metadata assert): nothing to carry
    if node.target is operator.getitem:
        src = state.get(node.args[0], _SHARED)
        return (src[node.args[1]] if isinstance(src, tuple) else src), None
    states = [state.get(n, _SHARED) for n in input_nodes(node)]
    if not any(isinstance(s, int) for s in states):
        return _SHARED, None
    found = _options(node)
    if found is None:
        return None, "has no sharding rule, so it cannot be told whether it keeps samples apart"
    info, opts = found
    partial = False
    for opt in opts:
        if not all(p is None or _fits(p, st) for p, st in zip(opt.inputs, states)):
            continue
        if any(isinstance(p, Partial) for p in opt.outputs if p is not None):
            partial = True
            continue
        outs = tuple(p.dim if isinstance(p, Shard) and p.segments == 1 else _SHARED for p in opt.outputs)
        if not any(isinstance(o, int) for o in outs):
            continue  # the batch went in and did not come out whole: not a per-sample option
        return (outs if info.multi_output else outs[0]), None
    if partial:
        return None, "reduces over the batch (a sum or mean across samples)"
    return None, "combines samples of the batch (no placement runs it on a slice of the batch alone)"


def batch_mixing(traced: Any, meta_inputs: Any = None) -> str | None:
    """The first forward op whose output mixes samples of the batch before the loss (module
    docstring), as a message naming it; None when every sample stays apart up to the loss, and
    for a graph of one sample (a micro-batch of one: the planner checks the full batch's graph,
    ``planner.orchestrate._check_full_batch``)."""
    batch = _batch_of(traced, meta_inputs)
    if batch <= 1:
        return None  # one sample: no batch to follow (views fold size-1 dims); the planner follows the full batch
    cut = _batch_inputs(traced, batch)
    loss_path = _loss_path(traced)
    state: dict[fx.Node, Any] = {}
    for node in traced.gm.graph.nodes:
        if node.op == "placeholder":
            state[node] = 0 if node.name in cut else _SHARED
            continue
        if node.op != "call_function":
            continue
        if (drawing := drawing_function(traced, node)) is not None:
            return drawing  # however it is placed: torch's generator draws by position in the tensor
        out, why = _follow(node, state)
        if why is None:
            state[node] = out
            continue
        if node in loss_path:
            state[node] = _SHARED  # the loss's own reduction: its weights are known
            continue
        return (f"node {node.name!r} ({node.target}, module {traced.module_path(node) or '<root>'}) {why}: "
                f"each micro-batch would see only its own samples")
    return None
