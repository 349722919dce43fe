"""Cut the traced (micro-batch) graph into the pipeline's stage graphs.

``split_stages(traced, pipeline)`` gives one :class:`StageGraph` per (virtual) stage: a
``TracedGraph`` of that stage's ops alone, which ``emit_local_graph`` emits like a whole model.

Values crossing cuts. torch's pipelining sends a stage's outputs to the NEXT stage only, so a
value produced at stage i and read at stage j > i + 1 is threaded: it is an output of i, an
input and an unchanged output of every stage in between, and an input of j. The user inputs are
the first stage's inputs (in the traced placeholder order) and are threaded the same way (GPT-2's
``labels``, read only by the loss in the last stage). The last stage outputs the model's flat
outputs (its tensors; ``None`` leaves are restored by the module).

In a stage graph a received value is a user-input placeholder named like its producer, with
the producer's ``val`` (so the plan's strategies for the stage's ops are found by name and by
the same argument metadata, and :mod:`autopar.runtime.pipeline` sends and receives it in the
layout the plan's decision of that name gives: no conversion at a cut). Parameters, buffers and
constants are placeholders of every stage that reads them (a tied weight read by two stages is
in both). So are the values computed from none of those (``tracer.attention_form.input_independent``:
a causal mask built from ``arange``s): every stage reading one computes it itself, nothing sends
it, and each stage's ``runtime.fold`` folds it -- its attention runs causal, without the mask,
the form the planner priced -- where a received mask could not fold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.layout.placement import TensorSpec
from autopar.plans import NodeKind, Plan, PipelinePlan
from autopar.runtime.process_mesh import ProcessMesh
from autopar.tracer.attention_form import input_independent
from autopar.tracer.graph import INPUT, PLACEHOLDER_KEY, Placeholder, TracedGraph

__all__ = ["StageGraph", "split_stages", "stage_of_nodes", "example_values", "boundary_layouts"]


@dataclass
class StageGraph:
    index: int
    traced: TracedGraph  # this stage's ops as a graph; its placeholders named as in the full graph
    inputs: tuple[str, ...]  # traced value names received from the previous stage (stage 0: user inputs)
    outputs: tuple[str, ...]  # traced value names sent to the next stage (last stage: the model's flat outputs)
    state: tuple[str, ...]  # parameter / buffer / constant placeholders it reads


def stage_of_nodes(traced: TracedGraph, pipeline: PipelinePlan) -> dict[str, int]:
    """Op (and ``getitem``/``get_attr``) node name -> its stage; ``ValueError`` when the plan's
    stages do not cover the graph's ops exactly once or an op reads a later stage's value."""
    placeholders = {p.name for p in traced.placeholders}
    stage_of: dict[str, int] = {}
    for st in pipeline.stages:
        for name in st.nodes:
            if name in placeholders:
                continue
            if name in stage_of:
                raise ValueError(f"pipeline plan: node {name!r} is in stages {stage_of[name]} and {st.index}")
            stage_of[name] = st.index
    for node in traced.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.name not in stage_of:
            raise ValueError(f"pipeline plan: node {node.name!r} ({node.op} {node.target}) is in no stage; "
                             f"was the plan made for this graph?")
        for src in node.all_input_nodes:
            if src.name in stage_of and stage_of[src.name] > stage_of[node.name]:
                raise ValueError(f"pipeline plan: {node.name!r} (stage {stage_of[node.name]}) reads {src.name!r} "
                                 f"of the later stage {stage_of[src.name]}")
    return stage_of


def split_stages(traced: TracedGraph, pipeline: PipelinePlan) -> list[StageGraph]:
    stage_of = stage_of_nodes(traced, pipeline)
    num = len(pipeline.stages)
    last = num - 1
    ph_of = {p.name: p for p in traced.placeholders}
    user_inputs = [p.name for p in traced.placeholders
                   if p.kind == INPUT and isinstance(traced.node(p.name).meta.get("val"), torch.Tensor)]
    outputs = [a.name for a in traced.flat_outputs if isinstance(a, fx.Node)]
    # Where each carried value is made and last read: user inputs enter at stage 0.
    made: dict[str, int] = {name: 0 for name in user_inputs}
    made.update(stage_of)
    last_read: dict[str, int] = {}
    for node in traced.nodes:
        if node.op == "output":
            for name in outputs:
                last_read[name] = last
        elif node.name in stage_of:
            for src in node.all_input_nodes:
                if src.name in made:
                    last_read[src.name] = max(last_read.get(src.name, -1), stage_of[node.name])
    order = {n.name: i for i, n in enumerate(traced.nodes)}
    free = {n.name for n in input_independent(traced.gm.graph)}
    crossing = [[] for _ in range(num)]  # values sent from stage k to k + 1
    for name, k0 in made.items():
        if name in free:  # every stage reading it computes it (module docstring)
            continue
        for k in range(k0, last_read.get(name, k0)):
            crossing[k].append(name)
    for k in range(num):
        crossing[k].sort(key=order.__getitem__)
    # Parameters and buffers no op reads (a rotary embedding's unused copy of its frequencies)
    # still belong to the model's state: the first stage keeps them.
    read_anywhere = {src.name for n in traced.nodes if n.name in stage_of for src in n.all_input_nodes}
    unread = {p.name for p in traced.placeholders if p.kind in (NodeKind.PARAMETER, NodeKind.BUFFER)
              and p.name not in read_anywhere}
    stages = []
    for k in range(num):
        received = tuple(user_inputs) if k == 0 else tuple(crossing[k - 1])
        sent = tuple(outputs) if k == last else tuple(crossing[k])
        stages.append(_stage_graph(traced, k, stage_of, received, sent, ph_of, unread if k == 0 else set(), free))
    return stages


def _stage_graph(traced: TracedGraph, k: int, stage_of: dict[str, int], received: tuple[str, ...],
                 sent: tuple[str, ...], ph_of: dict[str, Placeholder], keep: set[str], free: set[str]
                 ) -> StageGraph:
    mine = _with_free_inputs(traced, [n for n in traced.nodes if stage_of.get(n.name) == k],
                             [traced.node(name) for name in sent if name in free], free)
    read = {src.name for n in mine for src in n.all_input_nodes} | keep
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    placeholders: list[Placeholder] = []
    state = []
    for node in traced.nodes:  # the stage's parameters, buffers and constants, graph order
        if node.op != "placeholder" or node.name not in read or ph_of[node.name].kind == INPUT:
            continue
        env[node.name] = graph.node_copy(node, lambda a: env[a.name])
        placeholders.append(ph_of[node.name])
        state.append(node.name)
    for name in received:
        src = traced.node(name)
        new = graph.placeholder(name)
        new.meta.update(src.meta)
        val = src.meta.get("val")
        ph = ph_of.get(name) or Placeholder(name=name, kind=NodeKind.INPUT, fqn=f"stage_input.{name}",
                                            aliases=(f"stage_input.{name}",), shape=tuple(val.shape),
                                            dtype=val.dtype)
        new.meta[PLACEHOLDER_KEY] = ph
        env[name] = new
        placeholders.append(ph)
    for node in traced.nodes:  # non-tensor user inputs the stage reads (inlined by the emitter)
        if node.op == "placeholder" and node.name in read and node.name not in env:
            env[node.name] = graph.node_copy(node, lambda a: env[a.name])
            placeholders.append(ph_of[node.name])
    for node in mine:
        env[node.name] = graph.node_copy(node, lambda a: env[a.name])
        assert env[node.name].name == node.name, (node.name, env[node.name].name)  # plans find ops by name
    graph.output(tuple(env[name] for name in sent))
    gm = fx.GraphModule(traced.gm, graph)
    loss = traced.loss_node
    sub = TracedGraph(gm, placeholders=tuple(placeholders), in_spec=None, out_spec=None,
                      constants=traced.constants,
                      loss_name=loss.name if loss is not None and loss.name in sent else None,
                      model_name=f"{traced.model_name}Stage{k}")
    sub.precision = traced.precision
    return StageGraph(index=k, traced=sub, inputs=received, outputs=sent, state=tuple(state))


def example_values(traced: TracedGraph, names: tuple[str, ...], layouts: dict[str, TensorSpec], pmesh: ProcessMesh,
              device: torch.device, *, with_grad: set[str]) -> tuple[torch.Tensor, ...]:
    """Zero tensors shaped like this rank's pieces of the micro-batch values ``names`` (static
    stage metadata; ``layouts``: the boundary layouts, replicated where absent)."""
    out = []
    for name in names:
        v = traced.node(name).meta["val"]
        shape = layouts[name].local_shape(tuple(v.shape), pmesh.shape) if name in layouts else v.shape
        # requires_grad marks what carries a gradient back: only values a trainable parameter
        # feeds (``values_needing_grad``). A received rotary table or mask marked too would make
        # the receiving stage save what the plan (and one device) does not: 1.13-1.18x its bytes.
        out.append(torch.zeros(shape, dtype=v.dtype, device=device).requires_grad_(name in with_grad))
    return tuple(out)


def _with_free_inputs(traced: TracedGraph, mine: list[fx.Node], sent: list[fx.Node], free: set[str]
                      ) -> list[fx.Node]:
    """``mine`` and the input-independent values (``free``) it reads or sends (``sent``) from
    other stages, with theirs, in graph order: computed here rather than received."""
    want = {n.name for n in mine}
    stack = [src for n in mine for src in n.all_input_nodes if src.name in free and src.name not in want]
    stack += sent
    while stack:
        n = stack.pop()
        if n.name not in want:
            want.add(n.name)
            stack.extend(n.all_input_nodes)  # all free: an input-independent node reads only such
    return [n for n in traced.nodes if n.name in want]


def boundary_layouts(stage_plan: Plan, graphs: list[StageGraph], ndim: int) -> dict[str, TensorSpec]:
    """Traced value name -> the layout it crosses a cut in: its decision's (single) output
    layout, the layout a receiving stage's emitter reads it in."""
    decisions = {n.name: n for n in stage_plan.nodes}
    out = {}
    for g in graphs[:-1]:
        for name in g.outputs:
            d = decisions.get(name)
            if d is not None and len(d.output_specs) == 1 and d.output_specs[0] is not None:
                out[name] = TensorSpec.parse(d.output_specs[0])
            else:
                out[name] = TensorSpec.replicated(ndim)
    return out
