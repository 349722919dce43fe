"""``PipelineModule``: this rank's pipeline stages run under torch's schedule (the contract is
:mod:`autopar.runtime.pipeline`'s docstring).

The schedule is told how to cut and merge: inputs by the micro-batch rule the planner traced by
(:mod:`autopar.tracer.microbatch`: batch-major inputs along dim 0, the others whole in every
micro-batch), the last stage's outputs by ``output_merge_spec`` (batch-major outputs concatenated,
scalar ones summed and divided here into the mean). It is made at the first call, when the call's
inputs say which of them the rule keeps whole (the micro-batch trace alone cannot: a whole
``(seq,)`` input and a cut ``(batch,)`` one can have the same traced shape).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _CustomReducer, _Replicate, sum_reducer
from torch.distributed.pipelining.schedules import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                                    ScheduleInterleavedZeroBubble)

from autopar.layout.placement import TensorSpec
from autopar.plans import Plan
from autopar.runtime.build import attach_tensor
from autopar.runtime.dtensors import local_of, to_dtensor
from autopar.runtime.eval_replica import EvalReplica
from autopar.runtime.modes import TracedMode
from autopar.runtime.module import input_leaves
from autopar.runtime.parallel_module import clip_grad_norm
from autopar.runtime.passes import STATE_KEY
from autopar.runtime.pipeline.grad_sums import DeferredSums
from autopar.runtime.pipeline.split import StageGraph, example_values
from autopar.runtime.pipeline.state import PipelineState
from autopar.runtime.pipeline.weights import LossWeights
from autopar.runtime.process_mesh import ProcessMesh
from autopar.strategies import rng
from autopar.tracer.graph import BUFFER, INPUT, PARAMETER, TracedGraph, values_needing_grad
from autopar.tracer.microbatch import batch_size, is_batch_major, split_micro_batches

__all__ = ["SCHEDULES", "PipelineModule", "StageModule"]

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B,
             "zero-bubble": ScheduleInterleavedZeroBubble}


class StageModule(nn.Module):
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

        self._draw: rng.Draw | None = None  # this step's draw (``begin_step``)
        self._calls = 0  # forward calls in this step: the micro-batch index

    def begin_step(self, draw: rng.Draw | None) -> None:
        """A new step: its micro-batches run in order 0, 1, ... (every schedule runs one stage's
        forwards in micro-batch order), each drawing its rows of the full batch's draw."""
        self._draw, self._calls = draw, 0

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        it = iter(inputs)
        values = [next(it) if name is None else getattr(self, name) for name in self._arg_state]
        draw = None if self._draw is None else dataclasses.replace(self._draw, micro_batch=self._calls)
        self._calls += 1
        with rng.drawing(draw) if draw is not None else contextlib.nullcontext():
            out = self.gm(*values)
        # Point-to-point sends need dense tensors (an expanded mask is a stride-0 view), and the
        # split backward detaches outputs in place, which a view refuses: views are copied.
        return tuple(o.clone(memory_format=torch.contiguous_format) if o._is_view() or not o.is_contiguous() else o
                     for o in out)


class PipelineModule(PipelineState, nn.Module):
    """This rank's pipeline stages (the contract: :mod:`autopar.runtime.pipeline`'s docstring):
    ``step`` trains on one full batch, ``forward`` runs forward only; ``parameters()`` are the
    DTensors of the parameters this rank's stages read (``stage_state.<FQN>``); ``code`` is the
    stage graphs. It implements :class:`autopar.runtime.parallel_module.ParallelModule`."""

    def __init__(self, *, plan: Plan, traced: TracedGraph, device_mesh: DeviceMesh, pmesh: ProcessMesh,
                 stage_modules: list[StageModule], leaves: dict[str, torch.Tensor], specs: dict,
                 signature: inspect.Signature, state_keys: tuple[str, ...], device: torch.device,
                 holders: dict[str, tuple[int, ...]], deferred: dict[str, tuple[int, ...]],
                 layouts: dict[str, TensorSpec], tied_groups: dict[str, Any], mode: TracedMode | None = None,
                 evaluator: EvalReplica | None = None) -> None:
        super().__init__()
        pipe = plan.pipeline
        # The mode the stages were traced in (modes.py): where the model tells the modes apart, an
        # eval-mode forward of training-traced stages runs on a gathered replica (eval_replica.py).
        self._mode = mode or TracedMode(True, None)
        self._evaluator = evaluator
        self.train(self._mode.training)
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
        self._criterion: Any = None  # set for one ``step_with`` call
        self._micro_batches: list[Any] = []
        self._criterion_traced: tuple[Any, LossWeights] | None = None  # (criterion, its weights)
        # fp16: the GradScaler whose scale multiplies every micro-batch's loss (the Booster attaches
        # the optimizer's); its step unscales, and skips on every rank when any stage overflowed.
        self.loss_scaler: Any = None
        self._scale: torch.Tensor | None = None  # this step's scale, taken on every rank
        self.schedule: Any = None  # torch's schedule, made at the first call (``_schedule_for``)
        self._whole: frozenset[str] | None = None  # the inputs it gives every micro-batch whole
        self._zero: Any = None  # the ZeroOptimizer built by ``optimizer``
        self._last_rank = pipe.stages[-1].rank
        self._tied_groups = dict(tied_groups)  # tied parameter -> group of the pipeline ranks holding it
        self._deferred = dict(deferred)  # parameter -> mesh axes its gradient is summed over per step
        self._sums: DeferredSums | None = None  # their buckets (``grad_sums``), at the first step
        self.boundary_layouts = dict(layouts)  # value crossing a cut -> the layout it is sent in
        self._draws = rng.graph_draws(traced.gm.graph)
        # Each micro-batch's share of the full batch's loss (a token mean with ignored labels is
        # not the mean of the micro-batches' means): set per call from its inputs.
        self._loss_weights = LossWeights(traced, self.num_microbatches)
        self._weights = torch.full((self.num_microbatches,), 1.0 / self.num_microbatches, dtype=torch.float64)
        nodes = [a for a in traced.flat_outputs if isinstance(a, fx.Node)]
        self._loss_out = nodes.index(traced.loss_node) if traced.loss_node in nodes else None
        self._merged = 0  # micro-batches the weighted loss reducer has folded this call

    # ------------------------------------------------------------------------------ inputs
    def _flat_inputs(self, args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], frozenset[str]]:
        """The call's tensor inputs in traced order, each checked against its traced shape as the
        micro-batch rule splits it (batch-major: M micro-batches of the traced rows; otherwise
        whole, its traced shape), and the names of the inputs the rule keeps whole."""
        leaves = input_leaves(self._signature, self._traced.model_name, args, kwargs)
        m = self.num_microbatches
        batch = batch_size((args, kwargs))
        values, whole = [], set()
        for p in self._inputs:
            value = leaves.get(p.fqn)
            cut = not isinstance(value, torch.Tensor) or is_batch_major(value, batch)
            want = (p.shape[0] * m, *p.shape[1:]) if cut and p.shape else tuple(p.shape)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(want) or value.dtype != p.dtype:
                got = f"{value.dtype}{list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
                how = (f"the full batch {p.dtype}{list(want)} ({m} micro-batches of {p.shape[0] if p.shape else '?'})"
                       if cut else f"{p.dtype}{list(want)} (not batch-major: whole in every micro-batch)")
                raise ValueError(f"input {p.fqn!r}: expected {how}, got {got}")
            if not cut:
                whole.add(p.name)
            values.append(value.to(self._device))
        return values, frozenset(whole)

    def _schedule_for(self, whole: frozenset[str]) -> Any:
        """torch's schedule over this rank's stages, cutting the inputs as the rule does: made at
        the first call. The traced shapes fix which inputs are whole (``_flat_inputs`` checks every
        call against them), so every later call agrees."""
        if self.schedule is not None:
            if whole != self._whole:  # cannot happen: the traced shapes decide it for M > 1
                raise AssertionError(f"inputs kept whole changed from {sorted(self._whole)} to {sorted(whole)}")
            return self.schedule
        pipe = self.plan.pipeline
        # torch cuts every tensor along dim 0 unless told otherwise: an input the rule keeps whole
        # is replicated into every micro-batch (torch's own spec for what it does not cut).
        args_spec = tuple(_Replicate() if p.name in whole else TensorChunkSpec(0) for p in self._inputs)
        # The last stage's outputs: batch-major ones concatenated; the loss summed with its
        # micro-batch weights (``_weighted_sum``); other scalars summed, the sum divided by M into
        # the mean in ``_merged_outputs`` (torch's reducers only fold).
        merge_spec = tuple(self._weighted_sum() if k == self._loss_out else
                           sum_reducer if meta.dim() == 0 else TensorChunkSpec(0)
                           for k, meta in enumerate(self._last_stage_outputs()))
        stages = self._pstages[0] if pipe.schedule in ("gpipe", "1f1b") else self._pstages
        self.schedule = SCHEDULES[pipe.schedule](stages, n_microbatches=self.num_microbatches, loss_fn=self._loss,
                                                 args_chunk_spec=args_spec, output_merge_spec=merge_spec,
                                                 scale_grads=False)
        self._whole = whole
        return self.schedule

    def _weighted_sum(self) -> _CustomReducer:
        """The loss output's merge: micro-batch ``k``'s loss times its weight (torch folds the
        micro-batches in order, once per call)."""
        def fold(total: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
            weight = self._weights[self._merged].item()
            self._merged += 1
            return total + loss.detach() * weight
        return _CustomReducer(torch.tensor(0.0), fold)

    def _loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """One micro-batch's loss times its weight (``weights.py``; see the contract): the model's
        own, or ``step_with``'s criterion's."""
        out = output if isinstance(output, (tuple, list)) else (output,)
        k = int(target.reshape(-1)[0].item())  # ``_train`` passes arange(M) as the target
        loss = (out[self._loss_at] if self._criterion is None else
                self._criterion(self._structured(out), self._micro_batches[k]))
        loss = loss * self._weights[k].item()
        return loss if self._scale is None else loss * self._scale

    # ---------------------------------------------------------------------------- running
    def step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Forward and backward of one full batch; returns the loss (every rank)."""
        return self.step_with(None, *args, **kwargs)[0]

    def step_with(self, criterion: Any, *args: Any, return_outputs: bool = False,
                  **kwargs: Any) -> tuple[torch.Tensor, Any]:
        """``step`` with the loss taken from ``criterion(outputs, micro_batch)`` on the last stage
        (``None``: the model's own loss): ``outputs`` is the model's output structure for one
        micro-batch, ``micro_batch`` that micro-batch of the inputs (the kwargs dict, the single
        positional argument, or ``(args, kwargs)``; cut by the micro-batch rule); each micro-batch's
        loss is weighted as the model's own is (``weights.py``: the criterion is called once on meta tensors, traced for
        its reduction -- counted targets for a token mean, 1 for a sum, 1/M otherwise).
        Returns ``(loss, outputs)`` on every rank, ``outputs`` the full-batch output structure
        when ``return_outputs`` (else None). The product notes' ``Booster.execute_pipeline`` runs
        this."""
        self._mode.check(self._traced.model_name, self.training)
        if criterion is not None and not callable(criterion):
            raise ValueError(f"criterion must be callable (outputs, inputs) -> loss or None, got {criterion!r}")
        inputs, whole = self._flat_inputs(args, kwargs)
        self._begin_step(args, kwargs, inputs=inputs, whole=whole, own_loss=criterion is None)
        self._criterion = criterion
        # Every rank takes the scale (its scaler's state starts with the first ``scale``), though
        # only the last stage multiplies a loss by it: the gradients every stage receives are scaled.
        self._scale = None if self.loss_scaler is None else self.loss_scaler.scale(torch.ones((), device=self._device))
        if criterion is not None:
            batch: Any = kwargs if not args else args[0] if len(args) == 1 and not kwargs else (args, kwargs)
            self._micro_batches = split_micro_batches(batch, self.num_microbatches)
            self._weights = self._criterion_weights(criterion).criterion_weights(self._micro_batches)
        try:
            loss, merged = self._train(inputs, whole, return_outputs=return_outputs)
        finally:
            self._criterion, self._micro_batches, self._scale = None, [], None
        return loss, (self._merged_outputs(merged) if return_outputs else None)

    def _criterion_weights(self, criterion: Any) -> LossWeights:
        """``criterion``'s micro-batch weights, traced at its first ``step_with`` (kept while the
        same callable comes back, as in a training loop)."""
        if self._criterion_traced is None or self._criterion_traced[0] is not criterion:
            outputs = [torch.empty(a.meta["val"].shape, dtype=a.meta["val"].dtype, device="meta")
                       for a in self._traced.flat_outputs if isinstance(a, fx.Node)]
            self._criterion_traced = (criterion, LossWeights.of_criterion(
                criterion, self._structured, outputs, self._micro_batches[0], self.num_microbatches))
        return self._criterion_traced[1]

    def _begin_step(self, args: tuple, kwargs: dict, *, inputs: list[torch.Tensor], whole: frozenset[str],
                    own_loss: bool) -> None:
        """One draw per full-batch step (``strategies/rng.py``), as the unpipelined module takes
        one per call: micro-batch ``k`` draws rows ``k * micro ...`` of every batch-major draw, so
        the step draws what one call on the full batch draws. The micro-batches' loss weights
        (``weights.py``; a criterion's are set by ``step_with``)."""
        m = self.num_microbatches
        self._merged = 0
        self._weights = (self._loss_weights.weights({p.name: v for p, v in zip(self._inputs, inputs)}, whole)
                         if own_loss else torch.full((m,), 1.0 / m, dtype=torch.float64))
        draw = None
        if self._draws:
            micro = batch_size((args, kwargs)) // self.num_microbatches
            draw = rng.next_draw(micro_batches=self.num_microbatches, micro_batch_size=micro)
        for stage in self._stages:
            stage.begin_step(draw)

    def _train(self, inputs: list[torch.Tensor], whole: frozenset[str], *, return_outputs: bool,
               pending: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, Any]:
        # This step's gradients are summed (over data-parallel axes, over tied copies) on their
        # own, then added to what ``.grad`` held (gradients accumulate across steps until zeroed).
        for leaf in self._leaves.values():
            if isinstance(leaf, nn.Parameter):
                leaf.grad = None
        losses: list[torch.Tensor] = []
        # The loss lives in the graph (or in the criterion); the target is the micro-batch index.
        target = torch.arange(self.num_microbatches, dtype=torch.float32, device=self._device)
        merged = self._schedule_for(whole).step(*inputs, target=target, losses=losses, return_outputs=return_outputs)
        self._sync_gradients()
        for name, dt in self._dtensors.items():
            grad = self._leaves[name].grad
            if not isinstance(dt, nn.Parameter) or grad is None:
                continue
            if pending is not None:  # a training ``forward``: added when its loss's backward runs
                pending[name] = grad
            else:
                self._add_gradient(name, grad)
        loss = torch.stack([x.detach() for x in losses]).sum() if losses else torch.zeros((), device=self._device)
        if self._scale is not None:  # the loss as computed (the scaled one was for backward)
            loss = loss / self._scale
        return self._from_last_stage(loss.to(self._loss_dtype())), merged

    def _add_gradient(self, name: str, grad: torch.Tensor) -> None:
        """Add this rank's local ``grad`` of parameter ``name`` to its DTensor's ``.grad``."""
        dt = self._dtensors[name]
        if dt.grad is not None:
            grad = local_of(dt.grad) + grad
        dt.grad = to_dtensor(grad, self._specs[name], self.pmesh, dt.shape)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's outputs for the full batch, on every rank. In training mode with autograd
        on, the loss is differentiable: the call runs the whole pipelined step (forward and
        backward over the micro-batches) and keeps its gradients aside; ``loss.backward()`` (or
        the backward of any function of the loss, a GradScaler's scaled loss included) adds them,
        times the loss's incoming gradient, to ``.grad`` -- the plain module's training loop
        (``model(**batch).loss.backward()``) trains a pipelined plan unchanged. The other outputs
        carry no gradient. Otherwise forward only (no backward work); in evaluation mode, when the
        stages were traced in training mode and the model tells the modes apart (batch norm,
        dropout), the model's eval-mode outputs from a gathered replica (``eval_replica.py``)."""
        if self._mode.replicated(self.training):
            if self._evaluator is None:
                raise NotImplementedError(
                    f"{self._traced.model_name} is in evaluation mode and its {self._mode.sensitive} behaves "
                    f"differently there, but this module was built without an evaluation replica (build_pipeline "
                    f"makes one): call .train(), or build it with autopar.runtime.pipeline.build_pipeline")
            return self._evaluator.run(self, args, kwargs, plan=self.plan, device=self._device,
                                       gather=self._full_values_by_fqn, sensitive=self._mode.sensitive)
        self._mode.check(self._traced.model_name, self.training)
        if self.training and torch.is_grad_enabled() and self._loss_out is not None:
            return self._training_forward(args, kwargs)
        inputs, whole = self._flat_inputs(args, kwargs)
        self._begin_step(args, kwargs, inputs=inputs, whole=whole, own_loss=True)
        target = torch.zeros(self.num_microbatches, device=self._device)
        with torch.no_grad():
            merged = self._schedule_for(whole).eval(*inputs, target=target, losses=[], return_outputs=True)
        return self._merged_outputs(merged)

    def train(self, mode: bool = True) -> "PipelineModule":
        if self._evaluator is not None:  # the eval replica's gathered state is not kept while training
            self._evaluator.forget()
        return super().train(mode)

    def _training_forward(self, args: tuple, kwargs: dict) -> Any:
        inputs, whole = self._flat_inputs(args, kwargs)
        self._begin_step(args, kwargs, inputs=inputs, whole=whole, own_loss=True)
        pending: dict[str, torch.Tensor] = {}
        loss, merged = self._train(inputs, whole, return_outputs=True, pending=pending)
        anchor = torch.zeros((), device=self._device, requires_grad=True)
        return self._merged_outputs(merged, loss=_DeferredBackward.apply(anchor, loss, self, pending))

    def _structured(self, out: tuple[torch.Tensor, ...]) -> Any:
        """The model's output structure from the last stage's flat outputs (``None`` leaves back)."""
        it = iter(out)
        return self._traced.unflatten_outputs([next(it) if isinstance(a, fx.Node) else a
                                               for a in self._traced.flat_outputs])

    def _merged_outputs(self, merged: Any, *, loss: torch.Tensor | None = None) -> Any:
        """The schedule's merge of the last stage's micro-batch outputs (``merged``: None on ranks
        without the last stage) as one full-batch output structure, on every rank."""
        last = next((s for s in self._pstages if s.is_last), None)
        flat = []
        for k, meta in enumerate(self._last_stage_outputs()):
            value = None
            if last is not None:
                value = merged[k].detach()
                if k == self._loss_out:  # already weighted (``_weighted_sum``)
                    value = value.to(meta.dtype)
                elif meta.dim() == 0:  # summed over the micro-batches by ``sum_reducer``: their mean
                    value = (value / self.num_microbatches).to(meta.dtype)
            flat.append(self._from_last_stage(value, like=meta))
        if last is not None:
            last.output_chunks.clear()  # the merged copy is all that is kept
        if loss is not None:  # a training forward's differentiable loss
            flat[self._loss_out] = loss
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
        if self._sums is None:  # laid out once, at the first step, as every rank reaches it
            self._sums = DeferredSums(self._deferred, self._leaves, pmesh=self.pmesh)
        self._sums.run(self._leaves)
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
        """ZeRO-1 pieces read views of the whole gradient ``step`` leaves: nothing to deliver; the
        optimizer is kept so clipping knows which parameter each piece is."""
        stages = {p.stage for p in optimizer.pieces}
        if stages - {1}:
            raise ValueError(f"pipelined stages run ZeRO-1 only, the plan asks for ZeRO stages {sorted(stages)}")
        self._zero = optimizer

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        parameters: Iterable[torch.Tensor] | None = None) -> torch.Tensor:
        """Clip the gradients of ``parameters`` (default: every parameter of this rank's stages;
        the Booster passes its optimizer's, ZeRO pieces included) to the GLOBAL ``norm_type`` norm
        ``max_norm`` (as ``torch.nn.utils.clip_grad_norm_`` over the single-device model); returns
        the norm before clipping, a plain tensor equal on every rank. Each stage's norm comes from
        its DTensor gradients (sharded ones reduced over the stage sub-mesh); stages are combined
        over the pipeline axis, a tied weight's copies counted once (at its lowest pipeline rank).
        Every rank must call."""
        name_of = {id(dt): name for name, dt in self._dtensors.items() if isinstance(dt, nn.Parameter)}
        if self._zero is not None:
            name_of.update((id(piece.master), piece.name) for piece in self._zero.pieces)
        params = ([dt for dt in self._dtensors.values() if isinstance(dt, nn.Parameter)] if parameters is None
                  else list(parameters))
        counted = [p for p in params if id(p) not in name_of or min(self._holders[name_of[id(p)]]) == self.pp_rank]
        return clip_grad_norm(params, max_norm, norm_type, counted=counted, group=self.pp_group, device=self._device)

    @property
    def code(self) -> str:
        return "\n".join(f"# stage {m.stage.index}\n{m.gm.code}" for m in self._stages)


class _DeferredBackward(torch.autograd.Function):
    """The loss of a training ``forward`` whose step already ran: its backward adds the step's
    gradients (``pending``), times the incoming gradient, to the parameters' ``.grad``. The
    ``anchor`` (a leaf needing grad) makes autograd call it."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, loss: torch.Tensor, module: PipelineModule,
                pending: dict[str, torch.Tensor]) -> torch.Tensor:
        ctx.module, ctx.pending = module, pending
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scale = grad.to(torch.float64).item()
        for name, step in ctx.pending.items():
            ctx.module._add_gradient(name, step if scale == 1.0 else step * scale)
        ctx.pending = {}  # a second backward through the same loss adds nothing more
        return None, None, None, None
