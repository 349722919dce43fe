"""Pipeline parallelism on ``torch.distributed.pipelining``: ``build_pipeline(model, traced, plan)``.

The plan (``Plan.pipeline``) cuts the traced MICRO-batch graph into stages
(:mod:`autopar.runtime.pipeline_split`); mesh axis 0 is the pipeline axis, and every stage runs
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
  ``num_microbatches`` micro-batches along dim 0; forward and backward under the schedule; returns
  the loss on EVERY rank (broadcast over the pipeline axis from the last stage). Gradients land in
  ``.grad`` of ``parameters()`` (DTensors on the stage sub-mesh with the plan's placements, like
  ``AutoParallelModule``) and accumulate over calls until zeroed (``optimizer.zero_grad()``).
- Micro-batch loss scaling. The schedule runs with ``scale_grads=False`` and a loss function
  that returns the model's loss divided by the number of micro-batches M, so the gradient is
  (1/M) * sum of the micro-batch gradients and the returned loss the mean of the micro-batch
  losses. Both equal ONE full-batch backward of the model's loss exactly when the loss is a mean
  over the batch in which every micro-batch has the same weight -- a mean over samples or tokens
  with the same number of counted tokens per micro-batch (Hugging Face's causal-LM loss without
  ``-100`` labels, or with the same number of them in every micro-batch); a sum-reduced loss
  would need no division (not supported: the division is fixed).
- Tied weights read by stages on different pipeline ranks (GPT-2's ``wte``: the embedding in the
  first stage, the LM head in the last) live on each of those ranks; their gradients are summed
  over a process group of exactly those ranks (one group per sub-mesh coordinate) before
  ``step`` returns, so the copies get equal gradients and stay equal under any optimizer.
- ``pm(*args, **kwargs)``: forward only (``schedule.eval``), returns the model's output
  structure on every rank: batch-major outputs concatenated over micro-batches, scalar outputs
  (the loss) averaged.
- ``full_state_dict()`` / ``full_gradients()``: EVERY rank returns the full dict (gathered over
  each stage's sub-mesh, then broadcast over the pipeline axis from the lowest pipeline rank that
  holds each tensor); every rank must call. ``load_full_state_dict(sd)`` slices a full state
  dict into what this rank's stages hold (no collective); with ``full_state_entries`` /
  ``full_state_items`` (one tensor at a time) ``Booster.save_model`` / ``load_model`` take a
  pipelined model as they take an ``AutoParallelModule`` (``autopar.runtime.pipeline_state``).

- ``step_with(criterion, ...)``: ``step`` with the loss from ``criterion(outputs, micro_batch)``
  on the last stage, optionally returning the full-batch outputs (``Booster.execute_pipeline``).

Composition. Activation recompute regions (``Plan.recompute``) run inside their stage (a region
spanning a cut is refused; so is recompute under the zero-bubble schedule). bf16 plans run as
traced (fp32 masters, bf16 stage graphs and boundary values); fp16 is refused (its loss scaler
would need an overflow verdict over every stage). ZeRO-1: ``pm.optimizer(cls, zero_stage=1,
...)`` shards the optimizer state of each parameter over the stage's replicated axes
(``autopar.runtime.zero``); ZeRO-2 is refused (gradients accumulate over the micro-batches before
the once-per-step sum). ``clip_grad_norm_`` clips by the norm over EVERY stage (tied copies
counted once). DCP: ``pm.state_dict()`` holds this rank's DTensors (``stage_state.<FQN>``, tied
copies under one name on several ranks, deduplicated by DCP's planner), so
``torch.distributed.checkpoint.save/load`` and ``get/set_optimizer_state_dict(pm, opt)`` work
across stages; a load writes into the live parameters.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor
from torch.distributed.pipelining.schedules import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                                    ScheduleInterleavedZeroBubble)

from autopar.layout.placement import TensorSpec
from autopar.plans import Plan
from autopar.runtime.build import attach_tensor
from autopar.runtime.dtensors import local_of, to_dtensor
from autopar.runtime.materialize import local_shards
from autopar.runtime.module import input_leaves
from autopar.runtime.nodes import GradAllReduce
from autopar.runtime.passes import STATE_KEY, emit_local_graph
from autopar.runtime.pipeline_split import StageGraph, boundary_layouts, example_values, split_batch, split_stages
from autopar.runtime.pipeline_state import PipelineState
from autopar.runtime.process_mesh import ProcessMesh
from autopar.runtime.recompute import apply_recompute
from autopar.tracer.graph import BUFFER, INPUT, PARAMETER, TracedGraph, values_needing_grad

__all__ = ["SCHEDULES", "PipelineModule", "build_pipeline", "pipeline_device_mesh"]

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B,
             "zero-bubble": ScheduleInterleavedZeroBubble}


_ZB_RECOMPUTE = ("activation recompute does not run under the zero-bubble schedule: its split backward "
                 "(input gradients, later weight gradients) unpacks a checkpoint region's saved tensors in two "
                 "autograd passes, which torch.utils.checkpoint refuses for Llama's blocks; plan with "
                 "checkpoint='none' or another schedule")


def pipeline_device_mesh(plan: Plan, *, device_type: str) -> DeviceMesh:
    """The full-shape ``DeviceMesh`` (pipeline axis first; a 1-D mesh gets a trailing axis of size 1)."""
    sub = plan.stage_mesh()
    if plan.mesh.ndim == 1:
        shape, names = (plan.mesh.shape[0], 1), (plan.mesh.axis_names[0], sub.axis_names[0])
    else:
        shape, names = plan.mesh.shape, plan.mesh.axis_names
    return init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))


class _StageModule(nn.Module):
    """One stage's emitted graph; its parameters are this rank's local leaves (shared between
    the rank's stages), passed to the graph in placeholder order."""

    def __init__(self, gm: fx.GraphModule, stage: StageGraph, leaves: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.gm = gm
        self.stage = stage
        self._arg_state = tuple(n.name if n.meta.get(STATE_KEY) else None for n in gm.graph.nodes
                                if n.op == "placeholder")
        for name in self._arg_state:
            if name is None:
                continue
            if isinstance(leaves[name], nn.Parameter):
                self.register_parameter(name, leaves[name])
            else:
                self.register_buffer(name, leaves[name])

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        it = iter(inputs)
        values = [next(it) if name is None else getattr(self, name) for name in self._arg_state]
        out = self.gm(*values)
        # Point-to-point sends need dense tensors (an expanded mask is a stride-0 view), and the
        # split backward detaches outputs in place, which a view refuses: views are copied.
        return tuple(o.clone(memory_format=torch.contiguous_format) if o._is_view() or not o.is_contiguous() else o
                     for o in out)


class PipelineModule(PipelineState, nn.Module):
    """This rank's pipeline stages (see the module docstring for the contract): ``step`` trains on
    one full batch, ``forward`` runs forward only; ``parameters()`` are the DTensors of the
    parameters this rank's stages read (``stage_state.<FQN>``); ``code`` is the stage graphs."""

    def __init__(self, *, plan: Plan, traced: TracedGraph, device_mesh: DeviceMesh, pmesh: ProcessMesh,
                 stage_modules: list[_StageModule], leaves: dict[str, torch.Tensor], specs: dict,
                 signature: inspect.Signature, state_keys: tuple[str, ...], device: torch.device,
                 holders: dict[str, tuple[int, ...]], deferred: dict[str, tuple[int, ...]],
                 layouts: dict[str, TensorSpec]) -> None:
        super().__init__()
        pipe = plan.pipeline
        self.plan, self.pmesh, self.device_mesh = plan, pmesh, device_mesh
        self._traced, self._signature, self._state_keys, self._device = traced, signature, state_keys, device
        self._stages = list(stage_modules)  # a plain list: their leaves are not this module's parameters
        self._leaves, self._specs, self._holders = leaves, specs, holders
        self.pp_group = device_mesh.get_group(0)
        self.pp_rank = dist.get_group_rank(self.pp_group, dist.get_rank())
        self.num_microbatches = pipe.num_microbatches
        self._inputs = [p for p in traced.placeholders if p.kind == INPUT
                        and isinstance(traced.node(p.name).meta.get("val"), torch.Tensor)]
        self._placeholders = {p.name: p for p in traced.placeholders}
        self.stage_state = nn.Module()  # DTensor parameters and buffers at their canonical FQNs
        self._dtensors: dict[str, torch.Tensor] = {}
        for name, leaf in leaves.items():
            if name not in specs or self._placeholders[name].kind not in (PARAMETER, BUFFER):
                continue
            ph = self._placeholders[name]
            dt = to_dtensor(local_of(leaf), specs[name], pmesh, ph.shape)
            if isinstance(leaf, nn.Parameter):
                dt = nn.Parameter(dt, requires_grad=leaf.requires_grad)
            attach_tensor(self.stage_state, ph.fqn, dt)
            self._dtensors[name] = dt
        num_stages = len(pipe.stages)
        with_grad = values_needing_grad(traced)
        self._pstages = [PipelineStage(m, m.stage.index, num_stages, device, group=self.pp_group,
                                       input_args=example_values(traced, m.stage.inputs, layouts, pmesh, device,
                                                            with_grad=with_grad),
                                       output_args=example_values(traced, m.stage.outputs,
                                                             layouts if m.stage.index < num_stages - 1 else {},
                                                             pmesh, device, with_grad=with_grad))
                         for m in stage_modules]
        last = stage_modules[-1].stage
        self._loss_at = (last.outputs.index(traced.loss_node.name)
                         if traced.loss_node is not None and traced.loss_node.name in last.outputs else None)
        if self._loss_at is None and any(m.stage.index == num_stages - 1 for m in stage_modules):
            raise ValueError(f"{traced.model_name} returns no loss: a pipeline trains on the model's own loss")
        m = self.num_microbatches
        loss_at = self._loss_at
        self._criterion: Any = None  # set for one ``step_with`` call
        self._micro_batches: list[Any] = []

        def loss_fn(output, target):
            out = output if isinstance(output, (tuple, list)) else (output,)
            if self._criterion is None:
                return out[loss_at] / m  # see the module docstring: mean losses, equal micro-batch weights
            # ``target`` is this micro-batch's index (``step_with`` passes arange(M) as the target)
            micro = self._micro_batches[int(target.reshape(-1)[0].item())]
            return self._criterion(self._structured(out), micro) / m

        cls = SCHEDULES[pipe.schedule]
        stages_arg = self._pstages[0] if pipe.schedule in ("gpipe", "1f1b") else self._pstages
        self.schedule = cls(stages_arg, n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
        # The last stage's per-micro-batch outputs are merged here (``forward``): torch's merge
        # concatenates every output along dim 0, which a scalar loss does not have.
        self.schedule._merge_outputs = lambda chunks: None
        self._last_rank = pipe.stages[-1].rank
        trained = {p.name for p in traced.params if p.requires_grad}
        self._tied_groups = _tied_groups({k: v for k, v in holders.items() if k in trained}, device_mesh)
        self._deferred = dict(deferred)  # parameter -> mesh axes its gradient is summed over per step
        self.boundary_layouts = dict(layouts)  # value crossing a cut -> the layout it is sent in

    # ------------------------------------------------------------------------------ inputs
    def _flat_inputs(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        leaves = input_leaves(self._signature, self._traced.model_name, args, kwargs)
        values = []
        for p in self._inputs:
            value = leaves.get(p.fqn)
            want = (p.shape[0] * self.num_microbatches, *p.shape[1:]) if p.shape else p.shape
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(want) or value.dtype != p.dtype:
                got = f"{value.dtype}{list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"input {p.fqn!r}: expected the full batch {p.dtype}{list(want)} "
                                 f"({self.num_microbatches} micro-batches of {p.shape[0] if p.shape else '?'}), "
                                 f"got {got}")
            values.append(value.to(self._device))
        return values

    # ---------------------------------------------------------------------------- running
    def step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Forward and backward of one full batch; returns the loss (every rank)."""
        return self.step_with(None, *args, **kwargs)[0]

    def step_with(self, criterion: Any, *args: Any, return_outputs: bool = False,
                  **kwargs: Any) -> tuple[torch.Tensor, Any]:
        """``step`` with the loss taken from ``criterion(outputs, micro_batch)`` on the last stage
        (``None``: the model's own loss): ``outputs`` is the model's output structure for one
        micro-batch, ``micro_batch`` that micro-batch of the inputs (the kwargs dict, the single
        positional argument, or ``(args, kwargs)``); it is divided by the micro-batch count like
        the model's loss (a mean over equally weighted micro-batches). Returns ``(loss, outputs)``
        on every rank, ``outputs`` the full-batch output structure when ``return_outputs`` (else
        None). The product notes' ``Booster.execute_pipeline`` runs this."""
        if criterion is not None and not callable(criterion):
            raise ValueError(f"criterion must be callable (outputs, inputs) -> loss or None, got {criterion!r}")
        inputs = self._flat_inputs(args, kwargs)
        self._criterion = criterion
        self._micro_batches = split_batch(args, kwargs, self.num_microbatches) if criterion is not None else []
        try:
            loss = self._train(inputs, return_outputs=return_outputs)
        finally:
            self._criterion, self._micro_batches = None, []
        return loss, (self._merged_outputs() if return_outputs else None)

    def _train(self, inputs: list[torch.Tensor], *, return_outputs: bool) -> torch.Tensor:
        # This step's gradients are summed (over data-parallel axes, over tied copies) on their
        # own, then added to what ``.grad`` held (gradients accumulate across steps until zeroed).
        for leaf in self._leaves.values():
            if isinstance(leaf, nn.Parameter):
                leaf.grad = None
        losses: list[torch.Tensor] = []
        # The loss lives in the graph (or in the criterion); the target is the micro-batch index.
        target = torch.arange(self.num_microbatches, dtype=torch.float32, device=self._device)
        self.schedule.step(*inputs, target=target, losses=losses, return_outputs=return_outputs)
        self._sync_gradients()
        for name, dt in self._dtensors.items():
            grad = self._leaves[name].grad
            if not isinstance(dt, nn.Parameter) or grad is None:
                continue
            if dt.grad is not None:
                grad = local_of(dt.grad) + grad
            dt.grad = to_dtensor(grad, self._specs[name], self.pmesh, dt.shape)
        loss = torch.stack([x.detach() for x in losses]).sum() if losses else torch.zeros((), device=self._device)
        return self._from_last_stage(loss.to(self._loss_dtype()))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Forward only: the model's outputs for the full batch, on every rank."""
        inputs = self._flat_inputs(args, kwargs)
        target = torch.zeros(self.num_microbatches, device=self._device)
        with torch.no_grad():
            self.schedule.eval(*inputs, target=target, losses=[], return_outputs=True)
        return self._merged_outputs()

    def _structured(self, out: tuple[torch.Tensor, ...]) -> Any:
        """The model's output structure from the last stage's flat outputs (``None`` leaves back)."""
        it = iter(out)
        return self._traced.unflatten_outputs([next(it) if isinstance(a, fx.Node) else a
                                               for a in self._traced.flat_outputs])

    def _merged_outputs(self) -> Any:
        """The last stage's saved micro-batch outputs as one full-batch output structure, every rank."""
        last = next((s for s in self._pstages if s.is_last), None)
        outs = self._last_stage_outputs()
        flat = []
        for k, meta in enumerate(outs):
            value = None
            if last is not None:
                chunks = [c[k] for c in last.output_chunks]
                value = torch.stack(chunks).mean(0) if meta.dim() == 0 else torch.cat(chunks, 0)
            flat.append(self._from_last_stage(value.detach() if value is not None else None, like=meta))
        if last is not None:
            last.output_chunks.clear()
        return self._structured(tuple(flat))

    def _last_stage_outputs(self) -> list[torch.Tensor]:
        """Fake values of the last stage's outputs, full batch (dim 0 times M for batch-major ones)."""
        out = []
        for a in self._traced.flat_outputs:
            if isinstance(a, fx.Node):
                v = a.meta["val"]
                shape = (v.shape[0] * self.num_microbatches, *v.shape[1:]) if v.dim() else ()
                out.append(torch.empty(shape, dtype=v.dtype, device="meta"))
        return out

    def _loss_dtype(self) -> torch.dtype:
        node = self._traced.loss_node
        return node.meta["val"].dtype if node is not None else torch.float32

    def _from_last_stage(self, value: torch.Tensor | None, *, like: torch.Tensor | None = None) -> torch.Tensor:
        """Broadcast over the pipeline axis from the rank holding the last stage."""
        if self.pp_rank != self._last_rank:
            ref = like if like is not None else value
            value = torch.empty(ref.shape, dtype=ref.dtype, device=self._device)
        value = value.contiguous()
        dist.broadcast(value, src=dist.get_global_rank(self.pp_group, self._last_rank), group=self.pp_group)
        return value

    def _sync_gradients(self) -> None:
        """Once per step: data-parallel sums inside the stage (taken out of the graph), then the
        sum of a tied weight's copies over the pipeline ranks holding it (sums commute). Only the
        step's gradients are in the leaves (``step`` adds them to ``.grad`` afterwards)."""
        for name, axes in self._deferred.items():
            leaf = self._leaves[name]
            if leaf.grad is None:  # every rank of the stage sees the same graph: all skip or none
                continue
            for axis in axes:
                dist.all_reduce(leaf.grad, group=self.pmesh.group(axis))
        for name, group in self._tied_groups.items():
            leaf = self._leaves.get(name)
            if group is None or leaf is None:
                continue
            if leaf.grad is None:
                leaf.grad = torch.zeros_like(leaf)
            dist.all_reduce(leaf.grad, group=group)

    # ------------------------------------------------------------------------ optimizers
    def parameters_by_fqn(self) -> dict[str, nn.Parameter]:
        """Original FQN -> this rank's DTensor parameter, every tied alias included (as
        ``AutoParallelModule.parameters_by_fqn``: an optimizer over the original model is
        matched by name; only the parameters this rank's stages read are here)."""
        return {alias: dt for name, dt in self._dtensors.items() if isinstance(dt, nn.Parameter)
                for alias in self._placeholders[name].aliases}

    def optimizer(self, optimizer_class: type, /, params=None, *, zero_stage: int | None = None, **kwargs: Any):
        """``optimizer_class(params, **kwargs)`` over this rank's parameters (``params``: None for
        all, or some of ``parameters()`` / param-group dicts of them), with ZeRO-1 inside each
        stage: a parameter replicated over the stage's data-parallel axes keeps optimizer state
        for this device's piece only, and the updated pieces are all-gathered after ``step``
        (``autopar.runtime.zero``). ``zero_stage``: None = the plan's per-parameter stages, 0 or
        1 for every parameter. ZeRO-2 is refused: the schedule accumulates each parameter's
        gradient over the micro-batches before the once-per-step data-parallel sum, so there is
        no per-micro-batch gradient to reduce-scatter (the product notes: ZeRO-2 does not
        compose with pipelines)."""
        from autopar.runtime.zero import ZeroOptimizer

        if zero_stage not in (None, 0, 1):
            raise ValueError(f"zero_stage must be None, 0 or 1 inside pipelined stages, got {zero_stage!r}")
        self._zero_stage = zero_stage
        return ZeroOptimizer(self, optimizer_class, params, **kwargs)

    def zero_parameters(self) -> list[tuple[str, nn.Parameter, int, TensorSpec]]:
        """(placeholder name, DTensor parameter, ZeRO stage, layout) of every parameter this rank
        holds, in plan order (``ZeroOptimizer``'s view of a module)."""
        asked = getattr(self, "_zero_stage", None)
        out = []
        for n in self.plan.nodes:
            dt = self._dtensors.get(n.name)
            if isinstance(dt, nn.Parameter):
                out.append((n.name, dt, n.zero_stage if asked is None else asked, self._specs[n.name]))
        return out

    def attach_zero(self, optimizer) -> None:
        """ZeRO-1 pieces read views of the whole gradient ``step`` leaves: nothing to deliver."""
        stages = {p.stage for p in optimizer.pieces}
        if stages - {1}:
            raise ValueError(f"pipelined stages run ZeRO-1 only, the plan asks for ZeRO stages {sorted(stages)}")

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every gradient of every stage to the GLOBAL ``norm_type`` norm ``max_norm`` (as
        ``torch.nn.utils.clip_grad_norm_`` over the single-device model); returns the norm before
        clipping, a plain tensor equal on every rank. Each stage's norm comes from its DTensor
        gradients (sharded ones reduced over the stage sub-mesh); stages are combined over the
        pipeline axis, a tied weight's copies counted once (at its lowest pipeline rank). Every
        rank must call."""
        norm_type = float(norm_type)
        if not norm_type > 0:
            raise ValueError(f"norm_type must be positive, got {norm_type}")
        grads = [dt.grad for name, dt in self._dtensors.items() if isinstance(dt, nn.Parameter)
                 and dt.grad is not None and min(self._holders[name]) == self.pp_rank]
        if grads:
            local = torch.nn.utils.get_total_norm(grads, norm_type)
            local = local.full_tensor() if isinstance(local, DTensor) else local
        else:
            local = torch.zeros((), device=self._device)
        local = local.to(torch.float64)
        if norm_type == float("inf"):
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.pp_group)
            total = local
        else:
            local = local ** norm_type
            dist.all_reduce(local, group=self.pp_group)
            total = local ** (1.0 / norm_type)
        coef = float(max_norm) / (float(total) + 1e-6)
        if coef < 1.0:
            for dt in self._dtensors.values():
                if isinstance(dt, nn.Parameter) and dt.grad is not None:
                    local_of(dt.grad).mul_(coef)
        return total.to(torch.float32)

    @property
    def code(self) -> str:
        return "\n".join(f"# stage {m.stage.index}\n{m.gm.code}" for m in self._stages)


def _tied_groups(holders: dict[str, tuple[int, ...]], device_mesh: DeviceMesh) -> dict[str, Any]:
    """Parameter name -> the process group of the pipeline ranks holding it at this rank's
    sub-mesh coordinate (None where this rank holds it alone). Every rank creates every group,
    in the same order (``new_group`` is collective over the default group)."""
    mesh = device_mesh.mesh.reshape(device_mesh.mesh.shape[0], -1)
    me = dist.get_rank()
    made: dict[tuple[int, ...], Any] = {}
    out: dict[str, Any] = {}
    for name, pp_ranks in holders.items():
        if len(pp_ranks) < 2:
            continue
        for col in range(mesh.shape[1]):
            ranks = tuple(int(mesh[p, col]) for p in pp_ranks)
            if ranks not in made:
                made[ranks] = dist.new_group(list(ranks))
            if me in ranks:
                out[name] = made[ranks]
    return out


def build_pipeline(model: nn.Module, traced: TracedGraph, plan: Plan, *, device: torch.device | str,
                   seed: int = 0, init_weights: bool = True) -> PipelineModule:
    """This rank's stages of ``plan`` (a plan with ``pipeline``) as a ``PipelineModule``. Every
    rank of the default process group calls it; ``traced`` is the MICRO-batch trace."""
    pipe = plan.pipeline
    if pipe is None:
        raise ValueError("build_pipeline needs a plan with a pipeline (Plan.pipeline); use build_module otherwise")
    if plan.graph_hash != traced.graph_hash:
        raise ValueError(f"stale plan for {plan.model}: made for graph {plan.graph_hash}, the micro-batch trace is "
                         f"{traced.graph_hash}")
    zero2 = [n.name for n in plan.nodes if n.zero_stage == 2]
    if zero2:
        raise ValueError(f"pipelined stages run ZeRO-1 at most; the plan shards the gradients of {len(zero2)} "
                         f"parameters (ZeRO-2, e.g. {zero2[0]!r}): plan with zero_stage 0 or 1")
    if plan.precision not in ("fp32", "bf16"):
        # fp16 needs a loss scaler whose overflow verdict spans every stage; not built yet
        raise ValueError(f"pipelined stages compute in fp32 or bf16, the plan asks for {plan.precision!r}")
    if plan.recompute and pipe.schedule == "zero-bubble":
        raise ValueError(_ZB_RECOMPUTE)
    if pipe.schedule in ("gpipe", "1f1b") and pipe.virtual_stages != 1:
        raise ValueError(f"schedule {pipe.schedule!r} runs one stage per rank, the plan has "
                         f"{pipe.virtual_stages} virtual stages")
    for st in pipe.stages:
        if st.rank != st.index % pipe.num_stages:
            raise ValueError(f"stage {st.index} is on pipeline rank {st.rank}; torch's schedules place it on "
                             f"{st.index % pipe.num_stages}")
    device = torch.device(device)
    device_mesh = pipeline_device_mesh(plan, device_type=device.type)
    sub_names = device_mesh.mesh_dim_names[1:]
    pmesh = ProcessMesh(device_mesh[sub_names[0]] if len(sub_names) == 1 else device_mesh[tuple(sub_names)])
    pp_rank = device_mesh.get_local_rank(0)
    graphs = split_stages(traced, pipe)
    holders: dict[str, set[int]] = {}
    for g in graphs:
        for name in g.state:
            holders.setdefault(name, set()).add(pipe.stages[g.index].rank)
    mine = [g for g in graphs if pipe.stages[g.index].rank == pp_rank]
    # Boundary values cross in their producer's layout (no gather before a cut, no split after):
    # a received value is a placeholder named like its producer, and with ``local_inputs`` the
    # emitter lays it out as the plan's decision of that name says; the sender converts to the
    # same. User inputs (and values without a single-output decision) cross replicated.
    user = {p.name for p in traced.placeholders if p.kind == INPUT}
    stage_plan = dataclasses.replace(plan, mesh=plan.stage_mesh(), pipeline=None,
                                     nodes=tuple(n for n in plan.nodes if n.name not in user))
    layouts = boundary_layouts(stage_plan, graphs, len(pmesh.shape))
    emitted = [emit_local_graph(g.traced, stage_plan, pmesh, device=device, bucket_cap=0, local_inputs=True,
                                output_specs=layouts if g.index < len(graphs) - 1 else None) for g in mine]
    for g, e in zip(mine, emitted):  # activation checkpointing: each region inside its stage
        ops = {n.name for n in g.traced.nodes if n.op != "placeholder"}  # received values keep producer names
        regions = [r for r in plan.recompute if ops & set(r.nodes)]
        stray = [r.name for r in regions if not set(r.nodes) <= ops]
        if stray:
            raise ValueError(f"recompute regions {stray} span pipeline stages")
        if regions:
            apply_recompute(e.graph, e.modules, regions)
    deferred: dict[str, tuple[int, ...]] = {}
    for e in emitted:
        for name, axes in _defer_gradient_sync(e).items():
            if deferred.setdefault(name, axes) != axes:  # two stages of this rank disagree: cannot happen
                raise AssertionError(f"{name}: gradient sync over {deferred[name]} and {axes}")
    specs = {name: spec for e in emitted for name, spec in e.specs.items()}
    shards, _ = local_shards(model, traced, specs, pmesh, device=device, seed=seed, init_weights=init_weights)
    modules = []
    for g, e in zip(mine, emitted):
        state_names = {n.name for n in e.graph.nodes if n.meta.get(STATE_KEY)}
        root: dict[str, Any] = dict(e.modules)
        for name, target in e.attr_of.items():
            if name not in state_names:
                root[target] = shards[name]  # lifted constants: plain local tensors
        gm = fx.GraphModule(root, e.graph, class_name=f"Pipeline{traced.model_name}Stage{g.index}")
        modules.append(_StageModule(gm, g, shards))
    state_keys = tuple(model.state_dict(keep_vars=True))
    return PipelineModule(plan=plan, traced=traced, device_mesh=device_mesh, pmesh=pmesh, stage_modules=modules,
                          layouts=layouts,
                          leaves=shards, specs=specs, signature=inspect.signature(model.forward),
                          state_keys=state_keys, device=device,
                          holders={k: tuple(sorted(v)) for k, v in holders.items()}, deferred=deferred)


def _defer_gradient_sync(emitted) -> dict[str, tuple[int, ...]]:
    """Take the parameters' gradient all-reduces out of the graph, to run once per step.

    A parameter whose every use in the stage graph goes through ``grad_all_reduce`` over the
    same mesh axes (data parallelism inside the stage) has its partial gradient summed over
    those axes in backward -- once per MICRO-batch. Summing the accumulated local gradient once
    after the last micro-batch gives the same sum with 1/M of the collectives (DDP's
    ``no_sync``): the nodes are removed here and ``PipelineModule.step`` all-reduces. Returns
    parameter placeholder name -> axes."""
    graph = emitted.graph
    reducers = {name for name, m in emitted.modules.items() if isinstance(m, GradAllReduce)}
    out = {}
    for node in list(graph.nodes):
        if node.op != "placeholder" or not node.meta.get(STATE_KEY) or not node.users:
            continue
        users = list(node.users)
        if not all(u.op == "call_module" and u.target in reducers for u in users):
            continue
        axes = {tuple(u.kwargs["axes"]) for u in users}
        if len(axes) != 1:
            continue
        for u in users:
            u.replace_all_uses_with(node)
            graph.erase_node(u)
        out[node.name] = axes.pop()
    return out
