"""Pipeline parallelism on ``torch.distributed.pipelining``: ``build_pipeline(model, traced, plan)``.

The plan (``Plan.pipeline``) cuts the traced MICRO-batch graph into stages
(:mod:`autopar.runtime.pipeline.split`); mesh axis 0 is the pipeline axis, and every stage runs
on the sub-mesh without it (a torch ``DeviceMesh`` slice of ``init_device_mesh`` over the full
shape; a 1-D mesh of S devices is laid out as (S, 1): each stage on one device) with the plan's
per-node strategies. On each rank, for each stage it holds (rank r holds stages r, r + S, ...):

- the stage's ops are emitted as a local graph on the stage sub-mesh (``emit_local_graph`` on
  the stage's graph, in-graph gradient all-reduces: plain autograd, so the zero-bubble schedule's
  split input/weight backward sees every weight gradient); a parameter's data-parallel gradient
  sum is then taken out of the graph and run once per step on the gradient accumulated over the
  micro-batches (DDP's ``no_sync``: 1/M of the collectives);
- values crossing a cut are sent in their producer's layout over the stage sub-mesh (each rank
  sends its piece to the same sub-mesh coordinate of the next stage; ``boundary_layouts``);
- ONLY the parameters and buffers the rank's stages read are materialised
  (``materialize.local_shards``), as local leaf parameters the stage modules share (one leaf per
  parameter per rank, even when two of its stages read it), wrapped in ``PipelineStage`` with the
  pipeline-axis process group; the schedule is torch's (``SCHEDULES``).

``PipelineModule`` contract:

- ``step(*args, **kwargs) -> loss``: the FULL batch, identical on every rank, split into
  ``num_microbatches`` micro-batches by the rule the planner traced one by
  (:mod:`autopar.tracer.microbatch`: batch-major inputs along dim 0, the others whole);
  forward and backward under the schedule; returns the loss on EVERY rank (broadcast over the
  pipeline axis from the last stage). Gradients land in ``.grad`` of ``parameters()`` (DTensors
  on the stage sub-mesh with the plan's placements, like ``AutoParallelModule``) and accumulate
  over calls until zeroed (``optimizer.zero_grad()``).
- Micro-batch loss weights. The schedule runs with ``scale_grads=False`` and a loss function
  that returns micro-batch ``k``'s loss times its weight ``w_k`` (``weights.py``), so the
  gradient and the returned loss are those of ONE full-batch backward: ``w_k = 1`` for a
  sum-reduced loss; for a token mean (cross entropy / NLL averaged over the targets not
  ``ignore_index``, Hugging Face's causal-LM loss) ``n_k / sum(n)``, ``n_k`` the micro-batch's
  counted targets, read off the inputs before the step by the traced ops that make the target
  (the label shift included); otherwise ``1/M``, exact for a mean over equal micro-batches.
  Per-class loss weights, or a target that depends on parameters, raise ``NotImplementedError``.
  A ``step_with`` criterion (``Booster.execute_pipeline``'s) is traced once on meta tensors and
  weighted the same way; one that cannot be traced (it reads values) keeps ``1/M`` with a warning.
- Tied weights read by stages on different pipeline ranks (GPT-2's ``wte``: the embedding in the
  first stage, the LM head in the last) live on each of those ranks; their gradients are summed
  over a process group of exactly those ranks (one group per sub-mesh coordinate) before
  ``step`` returns, so the copies get equal gradients and stay equal under any optimizer.
- ``pm(*args, **kwargs)``: forward only (``schedule.eval``), returns the model's output
  structure on every rank: batch-major outputs concatenated over micro-batches, scalar outputs
  (the loss) averaged. In evaluation mode, where the model tells the modes apart (dropout) and
  the stages were traced in training mode, the model's eval-mode outputs from a replica on the
  gathered full state (:mod:`autopar.runtime.eval_replica`); ``step`` refuses evaluation mode.
- ``full_state_dict()`` / ``full_gradients()``: EVERY rank returns the full dict (gathered over
  each stage's sub-mesh, then broadcast over the pipeline axis from the lowest pipeline rank that
  holds each tensor); every rank must call. ``load_full_state_dict(sd)`` slices a full state
  dict into what this rank's stages hold (no collective); with ``full_state_entries`` /
  ``full_state_items`` (one tensor at a time) ``Booster.save_model`` / ``load_model`` take a
  pipelined model as they take an ``AutoParallelModule`` (:mod:`autopar.runtime.pipeline.state`).

- ``step_with(criterion, ...)``: ``step`` with the loss from ``criterion(outputs, micro_batch)``
  on the last stage, optionally returning the full-batch outputs (``Booster.execute_pipeline``).

Composition. Activation recompute regions (``Plan.recompute``) run inside their stage (a region
spanning a cut is refused; so is recompute under the zero-bubble schedule). bf16 plans run as traced
(fp32 masters, bf16 stage graphs and boundary values); fp16 alike, its loss scaled by
``PipelineModule.loss_scaler`` (a ``GradScaler``: the Booster attaches the optimizer's) on the last
stage, so every stage's gradients are scaled; the scaler's step unscales them and skips the step on
every rank when any rank's gradients overflowed (its verdict is reduced over the world). ZeRO-1:
``pm.optimizer(cls, zero_stage=1, ...)`` shards the optimizer state of each parameter over the
stage's replicated axes (:mod:`autopar.runtime.zero`); ZeRO-2 is refused (gradients accumulate over
the micro-batches before the once-per-step sum). ``clip_grad_norm_`` clips by the norm over EVERY
stage (tied copies counted once). DCP: ``pm.state_dict()`` holds this rank's DTensors
(``stage_state.<FQN>``, tied copies under one name on several ranks, deduplicated by DCP's planner),
so ``torch.distributed.checkpoint.save/load`` and ``get/set_optimizer_state_dict(pm, opt)`` work
across stages; a load writes into the live parameters.

Modules: :mod:`~autopar.runtime.pipeline.split` cuts the traced graph into stage graphs,
:mod:`~autopar.runtime.pipeline.build` emits and materialises this rank's stages,
:mod:`~autopar.runtime.pipeline.module` runs them (``PipelineModule``) and
:mod:`~autopar.runtime.pipeline.state` gathers and loads whole-model state.
"""

from autopar.runtime.pipeline.build import build_pipeline, pipeline_device_mesh
from autopar.runtime.pipeline.module import SCHEDULES, PipelineModule

__all__ = ["SCHEDULES", "PipelineModule", "build_pipeline", "pipeline_device_mesh"]
