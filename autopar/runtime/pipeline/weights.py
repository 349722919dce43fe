"""How much each micro-batch's loss weighs in the full batch's loss.

A pipeline runs the model on M micro-batches and adds their losses. A sum-reduced loss adds up
as is (weight 1). A mean over samples weighs each equal micro-batch 1/M. But the loss language
models train on -- cross entropy averaged over the tokens whose label is not ``ignore_index`` --
divides by a count that depends on the data: with padding (``-100`` labels) one micro-batch may
count 100 tokens and the next 10, and the mean of their means is not the full batch's mean. The
exact weight of micro-batch ``k`` is ``n_k / sum(n)``, ``n_k`` its counted targets.

``n_k`` is read off the data before the step, so every micro-batch's backward (which 1F1B starts
before the last forward) already has its weight: the traced graph's ops from the inputs to the
loss's target (Hugging Face shifts and pads the labels inside the forward) are copied into a small
graph and run on each micro-batch's inputs. Losses this cannot see through raise
``NotImplementedError`` naming the node, rather than train with the wrong weights.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.tracer.graph import INPUT, TracedGraph
from autopar.tracer.microbatch import COUNTED_LOSSES, loss_op, microbatch_hazard

__all__ = ["LossWeights"]

_TARGET = 1
_ARGS = {"weight": (2, None), "reduction": (3, 1), "ignore_index": (4, -100)}  # position, default (1 = mean)
_SUM, _MEAN = 2, 1


def _arg(node: fx.Node, name: str):
    index, default = _ARGS[name]
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


class LossWeights:
    """The weight of each micro-batch's loss in the full batch's (module docstring)."""

    def __init__(self, traced: TracedGraph, num_microbatches: int) -> None:
        self.m = num_microbatches
        self.reduction, self.target_graph, self.ignore_index = _MEAN, None, -100
        hazard = microbatch_hazard(traced)
        if hazard is not None:
            raise NotImplementedError(f"{traced.model_name} cannot run as a pipeline: {hazard}; plan without a "
                                      f"pipeline (pipeline=1)")
        loss = traced.loss_node
        op = None if loss is None else loss_op(loss)
        if op is None or op.op != "call_function" or op.target not in COUNTED_LOSSES:
            return  # a mean over every element (microbatch_hazard let it through): equal micro-batches weigh 1/M
        self.reduction = _arg(op, "reduction")
        target = op.args[_TARGET]
        if self.reduction != _MEAN or not isinstance(target, fx.Node) or target.meta["val"].is_floating_point():
            return  # a sum, or class probabilities (every row counts): no data-dependent denominator
        if _arg(op, "weight") is not None:
            raise NotImplementedError(f"node {op.name!r} ({op.target}): a pipeline weighs micro-batches by their "
                                      f"counted targets, and per-class loss weights are not supported there; "
                                      f"plan without a pipeline (pipeline=1)")
        self.ignore_index = _arg(op, "ignore_index")
        self.target_graph, self.input_names = _target_graph(traced, target, op)

    def weights(self, inputs: dict[str, torch.Tensor], whole: frozenset[str]) -> torch.Tensor:
        """Float64 weights of the M micro-batches from the call's inputs (placeholder name ->
        full-batch tensor; ``whole``: those every micro-batch gets whole)."""
        if self.reduction == _SUM:
            return torch.ones(self.m, dtype=torch.float64)
        if self.target_graph is None:
            return torch.full((self.m,), 1.0 / self.m, dtype=torch.float64)
        counts = []
        for k in range(self.m):
            args = [inputs[n] if n in whole else inputs[n].tensor_split(self.m)[k] for n in self.input_names]
            target = self.target_graph(*args)
            counts.append(float((target != self.ignore_index).sum()))
        total = sum(counts)
        if total == 0:  # nothing counted: the full batch's loss is 0/0 as well; keep the plain mean
            return torch.full((self.m,), 1.0 / self.m, dtype=torch.float64)
        return torch.tensor(counts, dtype=torch.float64) / total


def _target_graph(traced: TracedGraph, target: fx.Node, op: fx.Node) -> tuple[fx.GraphModule, list[str]]:
    """The traced ops from the inputs to ``target``, as a graph of the inputs it reads (their
    placeholder names, in its argument order)."""
    kinds = {p.name: p.kind for p in traced.placeholders}
    needed: set[fx.Node] = set()
    stack = [target]
    while stack:
        node = stack.pop()
        if node in needed:
            continue
        needed.add(node)
        if node.op == "placeholder" and kinds.get(node.name) != INPUT:
            raise NotImplementedError(f"node {op.name!r} ({op.target}): its target depends on {node.name!r}, not "
                                      f"only on the inputs, so a pipeline cannot weigh micro-batches by their "
                                      f"counted targets; plan without a pipeline (pipeline=1)")
        stack.extend(node.all_input_nodes)
    graph, env, names = fx.Graph(), {}, []
    for node in traced.gm.graph.nodes:  # graph order is a topological order
        if node in needed:
            env[node] = graph.node_copy(node, lambda n: env[n])
            if node.op == "placeholder":
                names.append(node.name)
    graph.output(env[target])
    return fx.GraphModule(traced.gm, graph), names
