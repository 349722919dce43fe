"""Whether pipelines are candidates of a default (``pipeline="auto"``) plan, cheaply, before any
micro-batch graph is traced.

``plan_auto`` (:mod:`autopar.planner.orchestrate`) plans without a pipeline first; a pipelined
search costs a trace per micro-batch count and tens of stage solves, so two checks come before it:

- ``blocker``: why no pipeline over mesh axis 0 can be planned at all (axis 0 of size 1, no
  repeated-block container with a block per stage, no micro-batch count, options the pipeline
  planner does not plan with, a model that micro-batches change: ``strategies.batch_flow.pipeline_hazard``, a
  model that returns no loss: ``without_loss``); read off the full-batch trace already made;
- ``work_floor``: a lower bound on every pipelined step from the plan without a pipeline's own
  problem. Each op's priced time does not fall as its work grows and does not fall faster than
  linearly when split (the roofline with its kernel floor: a split's seconds, times the ranks
  sharing the work, are at least the whole op's), so every option's ``compute_s`` of an op is at
  most the op's seconds on one device, and the pipeline's ranks, together, spend at least the sum
  of those over every op of the full batch. A schedule runs ``factor = M v + bubble`` times its
  slowest stage's per-micro-batch seconds, so its step is at least ``factor / (M v)`` times that
  sum over the ranks: when the plan without a pipeline is already as fast, none is searched.
"""

from __future__ import annotations

from typing import Any

from autopar.layout.mesh import MeshSpec
from autopar.planner.pipeline.geometry import batch_size, block_container, microbatch_counts
from autopar.planner.pipeline.schedule import SCHEDULE_VIRTUAL_STAGES, idle_speedup, step_factor
from autopar.planner.records import BuiltProblem
from autopar.plans import NodeKind
from autopar.tracer.graph import TracedGraph
from autopar.strategies.batch_flow import pipeline_hazard

__all__ = ["blocker", "without_loss", "work_floor"]


def blocker(traced: TracedGraph, meta_inputs: Any, *, mesh: MeshSpec, options) -> str | None:
    """Why ``options`` (a ``PlanOptions``) plans no pipeline over ``mesh``'s axis 0 for the
    full-batch graph ``traced``; None when one can be planned."""
    stages = mesh.shape[0]
    if stages == 1:
        return "mesh axis 0 has size 1"
    if options.offload != "none":
        return f"offload={options.offload!r} is not planned with a pipeline"
    if options.sequence_parallel != "auto":
        return f"sequence_parallel={options.sequence_parallel!r} is not pinned in pipeline stages"
    if options.checkpoint not in ("auto", "none"):
        return f"checkpoint={options.checkpoint!r}: pipelined stages decide recompute themselves (auto or none)"
    if options.ep_size not in (None, 1):  # its axes are the whole mesh's; a stage runs on the sub-mesh
        return f"ep_size={options.ep_size!r} is not pinned in pipeline stages"
    if options.zero_stage not in (0, 1):
        return f"zero_stage={options.zero_stage!r}: pipelined plans take ZeRO 0 or 1"
    hazard = pipeline_hazard(traced) or without_loss(traced)
    if hazard is not None:
        return hazard
    found = block_container(traced)
    if found is None or found[1] < stages:
        return (f"{traced.model_name} has " + ("no repeated blocks" if found is None else f"{found[1]} repeated blocks")
                + f", fewer than the {stages} stages of mesh axis 0")
    try:
        microbatch_counts(batch_size(meta_inputs), num_stages=stages, asked=options.microbatches)
    except ValueError as exc:
        return str(exc)
    return None


def without_loss(traced: TracedGraph) -> str | None:
    """Why a model whose forward returns no loss (the user's loop computes it from the outputs,
    ``criterion(model(x), y)``) cannot be pipelined; None when it returns one. A pipeline's last
    stage runs backward from the loss of each micro-batch inside the schedule, so the loss must
    be an output of the traced graph (``runtime.pipeline.module`` refuses such a plan)."""
    if traced.loss_node is not None:
        return None
    return (f"{traced.model_name} returns no loss (a loss computed outside forward): a pipeline's last stage "
            f"runs backward from the model's own loss; return the loss from forward to pipeline it")


def work_floor(built: BuiltProblem, *, num_stages: int, num_microbatches: tuple[int, ...],
               schedules: tuple[str, ...]) -> float:
    """A lower bound on the step of every pipeline over ``built``'s mesh axis 0 (``num_stages``
    ranks) with these micro-batch counts and schedules (module docstring): the full batch's
    one-device op seconds ``built`` prices, over the mesh's devices, times the least
    ``factor / (M v)``."""
    problem = built.problem
    single = sum(max((o.compute_s for o in node.options), default=0.0) for node in problem.nodes
                 if built.decision(node.name).kind == NodeKind.OP)
    ratio = min(step_factor(s, num_stages=num_stages, virtual_stages=SCHEDULE_VIRTUAL_STAGES[s], num_microbatches=m,
                            idle_speedup=idle_speedup(built.mesh))
                / (m * SCHEDULE_VIRTUAL_STAGES[s]) for s in schedules for m in num_microbatches)
    return single / built.mesh.num_devices * ratio
