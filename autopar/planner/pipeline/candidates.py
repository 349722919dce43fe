"""Whether pipelines are candidates of a default (``pipeline="auto"``) plan, cheaply, before any
micro-batch graph is traced.

``plan_auto`` (:mod:`autopar.planner.orchestrate`) plans without a pipeline first; a pipelined
search costs a trace per micro-batch count and tens of stage solves, so two checks come before it:

- ``blocker``: why no pipeline over mesh axis 0 can be planned at all (axis 0 of size 1, no
  repeated-block container with a block per stage, no micro-batch count, options the pipeline
  planner does not plan with, a model that micro-batches change: ``strategies.batch_flow.pipeline_hazard``, a
  model that returns no loss: ``without_loss``); read off the full-batch trace already made;
- ``work_floor``: a lower bound on every pipelined step from the plan without a pipeline's own
  problem, below which no pipeline of that count and schedule is traced or searched.

The work floor. ``S`` ranks (axis 0), ``D`` devices, ``v`` chunks per rank (``K = S v`` stages),
``M`` micro-batches, ``W`` the full batch's one-device op seconds. The search prices every step as
``factor * max_k t_k + max_k sync_k`` (``schedule.step_time``; ``factor = M v + bubble``, bubble
scaled by the machine's ``idle_speedup`` as ``step_factor`` does) with each stage (chunk) time
``t_k = ops_k + reshard_k + p2p_k + O`` (``costs.StageCost.time_s``), where ``O =
STAGE_ACTIONS x pipeline_action_s`` (``schedule.action_overhead_s``) is the SAME for every chunk of
every schedule: zero-bubble's split backward adds a weight-gradient action that is not counted
(``schedule.STAGE_ACTIONS``), so it pays ``O`` as the others do. Then:

- each op's priced time does not fall as its work grows and does not fall faster than linearly
  when split (the roofline with its kernel floor: a split's seconds, times the ranks sharing the
  work, are at least the whole op's), so every option's ``compute_s`` of an op is at most the op's
  seconds on one device, a micro-batch's op at least ``1 / M`` of the full batch's, and chunk
  ``k``'s ops on its ``D / S`` devices take ``ops_k >= W_k S / (M D)`` with ``sum_k W_k = W``;
- ``max_k t_k >= max_k ops_k + O >= (1 / K) sum_k ops_k + O >= W / (M v D) + O`` (resharding,
  point-to-point and syncs are >= 0), hence

      step >= factor * (W / (M v D) + O) = (factor / (M v)) W / D + factor O.

  The point-to-point is left out: it is ``2 (alpha_0 + beta_0 bytes)`` only at a cut that some
  value crosses, which is known from the micro-batch trace this floor exists to avoid.

The floor is a minimum over the given counts and schedules of the whole expression (a schedule
with a smaller ``factor / (M v)`` may pay more ``factor O``). When the plan without a pipeline is
already as fast, none is traced: on the cpu preset (``O`` = 2 x 1.7 ms) a tiny model's step leaves
no room for a pipeline's ``(M v + bubble) O``.
"""

from __future__ import annotations

from typing import Any

from autopar.layout.mesh import MeshSpec
from autopar.planner.pipeline.geometry import batch_size, block_container, microbatch_counts
from autopar.planner.pipeline.schedule import (SCHEDULE_VIRTUAL_STAGES, action_overhead_s, idle_speedup,
                                              step_factor)
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
    ranks) with these micro-batch counts and schedules (module docstring): the least, over them,
    of ``factor / (M v)`` times the full batch's one-device op seconds ``built`` prices over the
    mesh's devices, plus ``factor`` times the schedule actions' overhead every stage's
    micro-batch pays."""
    problem = built.problem
    single = sum(max((o.compute_s for o in node.options), default=0.0) for node in problem.nodes
                 if built.decision(node.name).kind == NodeKind.OP)
    work, overhead, speedup = single / built.mesh.num_devices, action_overhead_s(built.mesh), idle_speedup(built.mesh)

    def floor(schedule: str, m: int) -> float:
        v = SCHEDULE_VIRTUAL_STAGES[schedule]
        factor = step_factor(schedule, num_stages=num_stages, virtual_stages=v, num_microbatches=m,
                             idle_speedup=speedup)
        return factor * (work / (m * v) + overhead)

    return min(floor(s, m) for s in schedules for m in num_microbatches)
