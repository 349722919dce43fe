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

import logging
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx

from autopar.tracer.graph import INPUT, TracedGraph
from autopar.strategies.batch_flow import pipeline_hazard
from autopar.tracer.microbatch import COUNTED_LOSSES, known_weights, loss_op

__all__ = ["LossWeights"]

_TARGET = 1
_ARGS = {"weight": (2, None), "reduction": (3, 1), "ignore_index": (4, -100)}  # position, default (1 = mean)
_SUM, _MEAN = 2, 1
_LOG = logging.getLogger(__name__)


def _arg(node: fx.Node, name: str):
    index, default = _ARGS[name]
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


class LossWeights:
    """The weight of each micro-batch's loss in the full batch's (module docstring)."""

    def __init__(self, traced: TracedGraph, num_microbatches: int) -> None:
        hazard = pipeline_hazard(traced)
        if hazard is not None:
            raise NotImplementedError(f"{traced.model_name} cannot run as a pipeline: {hazard}; plan without a "
                                      f"pipeline (pipeline=1)")
        inputs = {p.name for p in traced.placeholders if p.kind == INPUT}
        self._read(traced.gm, traced.loss_node, inputs, num_microbatches)

    @classmethod
    def of_criterion(cls, criterion: Callable[[Any, Any], torch.Tensor], structure: Callable[[tuple], Any],
                     outputs: list[torch.Tensor], micro_batch: Any, num_microbatches: int) -> LossWeights:
        """The weights of ``criterion(structure(outputs), micro_batch)``'s loss (``step_with``):
        the criterion is traced on meta copies of one micro-batch's last-stage ``outputs`` and of
        ``micro_batch``'s tensors. One the tracer cannot follow (it reads values: ``.item()``,
        data-dependent branches) keeps 1/M, exact only for a mean over equal micro-batches, and
        logs a warning saying so."""
        leaves, spec = pytree.tree_flatten(micro_batch)
        at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

        def call(*tensors: torch.Tensor) -> torch.Tensor:
            batch = list(leaves)
            for i, t in zip(at, tensors[len(outputs):]):
                batch[i] = t
            return criterion(structure(tensors[:len(outputs)]), pytree.tree_unflatten(batch, spec))

        metas = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in outputs]
        metas += [leaves[i].to("meta") for i in at]
        self = cls.__new__(cls)
        try:
            gm = make_fx(call)(*metas)
        except Exception as err:  # noqa: BLE001 -- any tracing failure leaves the documented fallback
            _LOG.warning("pipeline: the criterion could not be traced (%s: %s); its micro-batch losses "
                         "weigh 1/M each, exact for a mean over equal micro-batches but not for a mean "
                         "over counted targets (ignored labels)", type(err).__name__, err)
            self.m, self.reduction, self.target_graph, self.ignore_index = num_microbatches, _MEAN, None, -100
            return self
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        loss = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        self.tensor_at, self.batch_names = at, names[len(outputs):]
        loss = loss if isinstance(loss, fx.Node) else None
        if loss is not None and not known_weights(loss_op(loss)):
            # A composite (ce + aux) or hand-made reduction: the notes' execute_pipeline averages
            # the micro-batch criteria, exact for means over equal micro-batches only.
            _LOG.warning("pipeline: the criterion's loss (%s) is not a form whose micro-batch weights are known "
                         "(a cross entropy or nll loss, or a mean over every element); its micro-batch losses "
                         "weigh 1/M each", loss_op(loss).target)
        self._read(gm, loss, set(self.batch_names), num_microbatches)
        return self

    def _read(self, gm: fx.GraphModule, loss: fx.Node | None, inputs: set[str], num_microbatches: int) -> None:
        """Which reduction makes ``loss``, and for a mean over counted targets the graph of the
        ``inputs`` placeholders that computes the target."""
        self.m = num_microbatches
        self.reduction, self.target_graph, self.ignore_index = _MEAN, None, -100
        op = None if loss is None else loss_op(loss)
        if op is None or op.op != "call_function" or op.target not in COUNTED_LOSSES:
            return  # a mean over every element (or an unknown form: see the callers): equal micro-batches weigh 1/M
        self.reduction = _arg(op, "reduction")
        target = op.args[_TARGET]
        if self.reduction != _MEAN or not isinstance(target, fx.Node) or target.meta["val"].is_floating_point():
            return  # a sum, or class probabilities (every row counts): no data-dependent denominator
        if _arg(op, "weight") is not None:
            raise NotImplementedError(f"node {op.name!r} ({op.target}): a pipeline weighs micro-batches by their "
                                      f"counted targets, and per-class loss weights are not supported there; "
                                      f"plan without a pipeline (pipeline=1)")
        self.ignore_index = _arg(op, "ignore_index")
        self.target_graph, self.input_names = _target_graph(gm, target, op, inputs)

    def weights(self, inputs: dict[str, torch.Tensor], whole: frozenset[str]) -> torch.Tensor:
        """Float64 weights of the M micro-batches from the call's inputs (placeholder name ->
        full-batch tensor; ``whole``: those every micro-batch gets whole)."""
        if self.target_graph is None:
            return self._counted([])
        return self._counted([[inputs[n] if n in whole else inputs[n].tensor_split(self.m)[k]
                               for n in self.input_names] for k in range(self.m)])

    def criterion_weights(self, micro_batches: list[Any]) -> torch.Tensor:
        """Float64 weights from the ``step_with`` micro-batches (``of_criterion``'s)."""
        if self.target_graph is None:
            return self._counted([])
        args = []
        for mb in micro_batches:
            leaves = pytree.tree_leaves(mb)
            by_name = {n: leaves[i] for n, i in zip(self.batch_names, self.tensor_at)}
            args.append([by_name[n] for n in self.input_names])
        return self._counted(args)

    def _counted(self, args: list[list[torch.Tensor]]) -> torch.Tensor:
        if self.reduction == _SUM:
            return torch.ones(self.m, dtype=torch.float64)
        if self.target_graph is None:
            return torch.full((self.m,), 1.0 / self.m, dtype=torch.float64)
        counts = [float((self.target_graph(*a) != self.ignore_index).sum()) for a in args]
        total = sum(counts)
        if total == 0:  # nothing counted: the full batch's loss is 0/0 as well; keep the plain mean
            return torch.full((self.m,), 1.0 / self.m, dtype=torch.float64)
        return torch.tensor(counts, dtype=torch.float64) / total


def _target_graph(gm: fx.GraphModule, target: fx.Node, op: fx.Node,
                  inputs: set[str]) -> tuple[fx.GraphModule, list[str]]:
    """The traced ops from the ``inputs`` placeholders to ``target``, as a graph of the inputs it
    reads (their placeholder names, in its argument order)."""
    needed: set[fx.Node] = set()
    stack = [target]
    while stack:
        node = stack.pop()
        if node in needed:
            continue
        needed.add(node)
        if node.op == "placeholder" and node.name not in inputs:
            raise NotImplementedError(f"node {op.name!r} ({op.target}): its target depends on {node.name!r}, not "
                                      f"only on the inputs, so a pipeline cannot weigh micro-batches by their "
                                      f"counted targets; plan without a pipeline (pipeline=1)")
        stack.extend(node.all_input_nodes)
    graph, env, names = fx.Graph(), {}, []
    for node in gm.graph.nodes:  # graph order is a topological order
        if node in needed:
            env[node] = graph.node_copy(node, lambda n: env[n])
            if node.op == "placeholder":
                names.append(node.name)
    graph.output(env[target])
    return fx.GraphModule(gm, graph), names
