"""``Booster``: model, optimizer, criterion, data loader and scheduler in, their parallel versions out.

The product notes' training loop, with autopar deciding the parallelism::

    plugin = AutoParallelPlugin(precision="bf16", max_norm=1.0)
    booster = Booster(plugin=plugin)
    loader = plugin.prepare_dataloader(dataset, batch_size=8, shuffle=True, drop_last=True)  # 8 per rank
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 100))
    model, optimizer, criterion, loader, scheduler = booster.boost(
        model, optimizer, criterion, loader, scheduler)
    for batch in loader:
        loss = criterion(model(**batch), batch)
        booster.backward(loss, optimizer)
        optimizer.step()                  # clips to max_norm (the global norm), then steps
        optimizer.zero_grad()
        scheduler.step()
    booster.save_model(model, "ckpt/model", shard=True)   # HF layout: from_pretrained loads it
    booster.save_optimizer(optimizer, "ckpt/optim")       # reloads under another mesh

Every rank runs the same calls (``boost`` and the checkpoint methods are collective), after
``torch.distributed.init_process_group``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import weakref
from dataclasses import dataclass, fields
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch import nn

from autopar.booster import checkpoint_io
from autopar.booster.mixed_precision import FP16TorchMixedPrecision
from autopar.booster.dataloader import GlobalBatchSampler, configure_for, first_batch_inputs, input_shapes
from autopar.booster.optimizer import BoostedOptimizer, foreach_over_dtensors, rebuild_optimizer, repoint_scheduler
from autopar.booster.plugin import AutoParallelPlugin
from autopar.booster.torch_plugins import Autocast, TorchDDPPlugin, TorchFSDPPlugin, TorchParallelModule
from autopar.runtime.parallel_module import ParallelModule

__all__ = ["Booster"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Origin:
    """What ``save_model`` needs of the model a boosted module came from."""

    config: Any  # its Hugging Face config, or None
    class_name: str


class Booster:
    """Boosts a model and its training objects with ``plugin`` (default: ``AutoParallelPlugin()``)."""

    def __init__(self, plugin: AutoParallelPlugin | TorchDDPPlugin | TorchFSDPPlugin | None = None, *,
                 mixed_precision: Any = None) -> None:
        if plugin is None:
            plugin = AutoParallelPlugin()
        if not isinstance(plugin, (AutoParallelPlugin, TorchDDPPlugin, TorchFSDPPlugin)):
            raise ValueError(f"plugin must be an AutoParallelPlugin, TorchDDPPlugin or TorchFSDPPlugin, got {plugin!r}")
        # torch's engines: the notes' torch AMP (autocast around forward and criterion, a loss scaler)
        self._autocast: torch.dtype | None = None
        self._loss_scale: FP16TorchMixedPrecision | None = None
        if mixed_precision is not None and not isinstance(plugin, AutoParallelPlugin):
            self._autocast, self._loss_scale = _torch_amp(plugin, mixed_precision)
        self.plugin = _with_precision(plugin, mixed_precision) if isinstance(plugin, AutoParallelPlugin) else plugin
        self._origins: weakref.WeakKeyDictionary[ParallelModule, _Origin] = weakref.WeakKeyDictionary()

    # ------------------------------------------------------------------------------ boost
    def boost(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
              criterion: Callable | None = None, dataloader: Any = None, lr_scheduler: Any = None,
              meta_inputs: tuple | dict | None = None) -> tuple[ParallelModule, BoostedOptimizer | None,
                                                                  Callable | None, Any, Any]:
        """``(model, optimizer, criterion, dataloader, lr_scheduler)``, boosted.

        - ``model`` becomes an ``AutoParallelModule`` (``autopar.autoparallelize`` with the
          plugin's options; meta inputs from ``dataloader``'s first batch unless given). Its
          outputs are full on every rank, so ``criterion`` is returned as it is.
        - ``optimizer`` (built over ``model``'s parameters) is rebuilt over the shards -- same
          class, defaults and param groups matched by parameter name, each group's
          hyper-parameters kept; ``torch.optim.Adafactor`` becomes ``autopar.optim.Adafactor``
          -- and wrapped in a :class:`~autopar.booster.optimizer.BoostedOptimizer` (clipping
          to ``max_norm``, fp16 loss scaling). Its state is not carried over.
        - ``lr_scheduler`` (built over ``optimizer``) is re-pointed at the rebuilt optimizer.
        - with ``TorchDDPPlugin`` / ``TorchFSDPPlugin`` the plugin boosts instead
          (``plugin.boost``): torch's DDP or FSDP2 engine in a ``TorchParallelModule``, no plan,
          no meta inputs, ``dataloader`` returned as it is.
        - batches: a dict is the model's keyword arguments; a tuple/list with a ``criterion`` is
          the notes' ``(img, label)``: the model takes the leading elements its forward requires
          (``model(img)``), the criterion the rest (``criterion(output, label)``), outside the
          plan, on the full outputs every rank holds (``dataloader.model_inputs``).
        - ``Booster(mixed_precision="fp16"|"bf16")`` with a torch plugin: the notes' torch AMP --
          forward and ``criterion`` under ``torch.autocast``; fp16 adds a loss scaler
          (``init_scale=2**16``, ``growth_interval=2000``: the notes' ``FP16TorchMixedPrecision``).
        - Neither ``dataloader`` nor ``meta_inputs``: the model is planned at its first forward,
          from that call's inputs (:mod:`autopar.booster.deferred`; not for pipelines).
        - ``dataloader``: one from ``plugin.prepare_dataloader`` is configured so each rank loads
          only its piece of every global batch when the plan splits the batch dim of every
          input the same way (the model then takes those pieces); any other loader is returned
          as it is, and the model takes full global batches from it.
        """
        from autopar.api import autoparallelize

        if isinstance(model, ParallelModule):
            raise ValueError(f"this model is already boosted (a {type(model).__name__}); boost the original model")
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if lr_scheduler is not None and optimizer is None:
            raise ValueError("an lr_scheduler needs the optimizer it drives: pass the optimizer too")
        _check_order(criterion, dataloader)
        if isinstance(self.plugin, (TorchDDPPlugin, TorchFSDPPlugin)):
            # Torch's own engines: no plan, so no meta inputs or loader configuration either.
            boosted = self.plugin.boost(model, optimizer, criterion, dataloader, lr_scheduler,
                                        autocast=self._autocast, loss_scale=self._loss_scale)
            config = getattr(model, "config", None)
            self._origins[boosted[0]] = _Origin(config if hasattr(config, "save_pretrained") else None,
                                                type(model).__name__)
            return boosted
        if criterion is not None and self.plugin.precision in ("fp16", "bf16") and not isinstance(criterion, Autocast):
            # the criterion runs outside the plan: under autocast, as torch AMP runs it (losses in fp32)
            criterion = Autocast(criterion, torch.float16 if self.plugin.precision == "fp16" else torch.bfloat16)
        ours = dataloader is not None and isinstance(getattr(dataloader, "batch_sampler", None), GlobalBatchSampler)
        if ours:
            dataloader.batch_sampler.piece = None  # global batches again (a loader boosted before)
        if meta_inputs is None:
            if dataloader is None:  # the notes' boost(model, optimizer, criterion, lr_scheduler=...)
                from autopar.booster.deferred import boost_deferred

                return boost_deferred(self, model, optimizer, criterion, lr_scheduler)
            meta_inputs, targets = first_batch_inputs(dataloader, None if criterion is None else model.forward)
            if targets:  # the criterion's targets come from the same batch: the loader keeps whole batches
                ours = False
        options = self.plugin.autoparallelize_kwargs()
        fixed = self.plugin.family_plan(model, meta_inputs) if self.plugin.plan is None else None
        if fixed is not None:  # a fixed configuration is a restricted plan of the planner's
            options = {**{k: v for k, v in options.items() if k != "offload"}, "plan": fixed, "zero_stage": None}
        pipeline_zero = 0
        if self.plugin.pipeline is not None:
            options, pipeline_zero = _pipeline_options(self.plugin, options)
        module: ParallelModule = autoparallelize(model, meta_inputs, **options)
        if module.plan.pipeline is not None:  # a PipelineModule: full batches, step_with, ZeRO-1 at most
            return self._boost_pipeline(model, module, optimizer, criterion, dataloader, lr_scheduler,
                                        zero_stage=pipeline_zero)
        if ours and not self.plugin.refine:  # refine may re-plan: the module keeps taking whole batches
            args, kwargs = (meta_inputs, {}) if isinstance(meta_inputs, tuple) else ((), meta_inputs)
            if configure_for(dataloader, module, input_shapes(model.forward, args, kwargs)):
                # The plan splits every input's batch dim alike: the module is built again (same
                # plan, no new solve) to take each rank's piece. Only then: the planner often
                # leaves inputs replicated (splitting one locally costs nothing), and a module
                # taking the full batch serves every other layout.
                if dataloader.batch_sampler.piece is not None:
                    module = autoparallelize(model, meta_inputs, local_inputs=True, **{**options, "plan": module.plan})
        config = getattr(model, "config", None)
        self._origins[module] = _Origin(config if hasattr(config, "save_pretrained") else None, type(model).__name__)
        boosted = None
        if optimizer is not None:
            zero = []

            def build(cls, groups, **kwargs):  # ZeRO pieces replace the parameters the plan shards
                if self.plugin.placement_policy is not None:  # chunked device/host memory (Gemini)
                    zero.append(None)
                    return self.plugin.wrap_gemini(module, cls, groups, kwargs)
                groups, kwargs = foreach_over_dtensors(cls, groups, kwargs)
                zero.append(module.optimizer(cls, groups, **kwargs))
                return zero[0].optimizer

            rebuilt = rebuild_optimizer(optimizer, model, module.parameters_by_fqn(), build=build)
            boosted = BoostedOptimizer(rebuilt, module, max_norm=self.plugin.max_norm, scaler=self._scaler(module),
                                       zero=zero[0], norm_type=self.plugin.norm_type)
            if lr_scheduler is not None:
                repoint_scheduler(lr_scheduler, optimizer, rebuilt)
        return module, boosted, criterion, dataloader, lr_scheduler

    def _boost_pipeline(self, model: nn.Module, module: ParallelModule, optimizer: torch.optim.Optimizer | None,
                        criterion: Callable | None, dataloader: Any, lr_scheduler: Any, *, zero_stage: int) -> tuple:
        """``boost`` for a pipelined plan: ``module`` is a ``PipelineModule`` taking full global
        batches (a loader from ``prepare_dataloader`` keeps giving them); the optimizer is rebuilt
        over this rank's stage parameters (ZeRO-1 over each stage's data-parallel axes when
        ``zero_stage`` is 1), and ``optimizer.step()`` clips to ``max_norm`` by the norm over
        every stage. Train with :meth:`execute_pipeline`."""
        config = getattr(model, "config", None)
        self._origins[module] = _Origin(config if hasattr(config, "save_pretrained") else None, type(model).__name__)
        boosted = None
        if optimizer is not None:
            if getattr(self.plugin, "placement_policy", None) is not None:
                raise ValueError("chunked host offload (placement_policy) does not run inside pipelined stages")
            rebuilt = rebuild_optimizer(optimizer, model, module.parameters_by_fqn(),
                                        build=lambda cls, groups, **kw: module.optimizer(cls, groups,
                                                                                        zero_stage=zero_stage, **kw))
            zero = rebuilt
            scaler = module.loss_scaler = self._scaler(module)  # fp16: the stages scale their losses by it
            boosted = BoostedOptimizer(zero.optimizer, module, max_norm=self.plugin.max_norm, scaler=scaler, zero=zero,
                                       norm_type=self.plugin.norm_type)
            if lr_scheduler is not None:
                repoint_scheduler(lr_scheduler, optimizer, zero.optimizer)
        return module, boosted, criterion, dataloader, lr_scheduler

    def execute_pipeline(self, data_iter: Iterator, model: nn.Module, criterion: Callable | None = None,
                         optimizer: BoostedOptimizer | None = None, return_loss: bool = True,
                         return_outputs: bool = False) -> dict[str, Any]:
        """Forward and backward of the next batch of ``data_iter`` through the pipelined
        ``model`` (the product notes' signature): the batch is split into the plan's
        micro-batches and run under its schedule; gradients land in the parameters' ``.grad``
        (accumulating until ``optimizer.zero_grad()``), then ``optimizer.step()`` as usual.

        ``criterion(outputs, inputs) -> loss`` runs on the last stage for every micro-batch
        (``outputs``: the model's output structure, ``inputs``: that micro-batch, a dict when the
        loader gives dicts); ``None`` trains on the model's own loss. Per-micro-batch losses are
        averaged: gradients equal one full-batch backward when the loss is a mean over equally
        weighted micro-batches. Returns ``{"loss": ..., "outputs": ...}`` on EVERY rank (the loss
        when ``return_loss``, the full-batch outputs when ``return_outputs``; else None). Every
        rank calls, with the same batch."""
        # A torch plugin's module has no plan (``plan`` is None): not pipelined either.
        if not isinstance(model, ParallelModule) or getattr(model.plan, "pipeline", None) is None:
            raise ValueError(f"execute_pipeline needs a model boosted with a pipeline (AutoParallelPlugin(pp_size=N)), "
                             f"got {type(model).__name__}; call model(...) and booster.backward otherwise")
        if optimizer is not None:
            _check_optimizer(optimizer)
            if optimizer.module is not model:
                raise ValueError("the optimizer was boosted with another model")
        try:
            batch = next(data_iter)
        except TypeError:
            raise ValueError(f"data_iter must be an iterator (iter(dataloader) or iter([batch])), "
                             f"got {type(data_iter).__name__}") from None
        if isinstance(batch, dict):
            args, kwargs = (), dict(batch)
        elif isinstance(batch, (tuple, list)):
            args, kwargs = tuple(batch), {}
        else:
            args, kwargs = (batch,), {}
        loss, outputs = model.step_with(criterion, *args, return_outputs=return_outputs, **kwargs)
        return {"loss": loss if return_loss else None, "outputs": outputs}

    def _scaler(self, module: ParallelModule):
        if self.plugin.precision != "fp16":
            return None
        from autopar.runtime.amp import GradScaler

        p = self.plugin
        return GradScaler(module.device_mesh.device_type, init_scale=p.initial_scale, growth_factor=p.growth_factor,
                          backoff_factor=p.backoff_factor, growth_interval=p.growth_interval,
                          min_scale=p.min_scale, max_scale=p.max_scale, hysteresis=p.hysteresis)

    def backward(self, loss: torch.Tensor, optimizer: BoostedOptimizer) -> None:
        """``loss.backward()``, the loss scaled first under fp16."""
        _check_optimizer(optimizer)
        optimizer.backward(loss)

    def no_sync(self, model: ParallelModule, optimizer: BoostedOptimizer | None = None) -> ContextManager[None]:
        """Gradient accumulation (DDP's ``no_sync``): forwards run inside the returned context
        keep their data-parallel gradient sums local; the next forward outside it, once its
        backward runs, reduces every accumulated micro-step's gradient together with its own,
        in one all-reduce (reduce-scatter for ZeRO-2) per bucket. The gradients then equal the
        synced sum of every micro-step's, as if each had been reduced: step after that backward.
        The flag is read at forward, so ``booster.backward`` may run inside or after the block.
        Gradients that no data-parallel sum produces (sharded parameters) and those of a module
        built without buckets (``AUTOPAR_BUCKET_CAP_MB=0``) or pipelined stages are reduced in
        every backward as before -- still exact, just without the saving. ``optimizer`` is
        accepted for the product notes' signature."""
        _check_module(model)
        if optimizer is not None:
            _check_optimizer(optimizer)
        from autopar.runtime.bucketing import GradBucketer

        if isinstance(model, TorchParallelModule):  # torch's engine accumulates by itself
            return model.no_sync()

        bucketers = [m for m in model.modules() if isinstance(m, GradBucketer)]

        @contextlib.contextmanager
        def context() -> Iterator[None]:  # entered lazily: the notes build it before `with`
            with contextlib.ExitStack() as stack:
                for bucketer in bucketers:
                    stack.enter_context(bucketer.no_sync())
                yield

        return context()

    # ------------------------------------------------------------------------ checkpoints
    def save_model(self, model: ParallelModule, checkpoint: str | os.PathLike, shard: bool = False,
                   gather_dtensor: bool = True, prefix: str | None = None, size_per_shard: float = 1024,
                   use_safetensors: bool = False) -> None:
        """Write ``model``'s full tensors under the original names (the notes' signature and
        order; rank 0 writes; a collective: every rank calls).

        - ``shard=False``: one file at ``checkpoint`` (safetensors with ``use_safetensors``, else
          ``torch.save``); an existing directory gets ``model.safetensors`` / ``pytorch_model.bin``
          inside (Hugging Face's single-file layout) and the HF config.
        - ``shard=True``: the directory ``checkpoint`` in Hugging Face's sharded layout: files of
          at most ``size_per_shard`` MiB (``model-00001-of-0000N.safetensors`` or
          ``pytorch_model-...bin``) and their index json (``weight_map``: name -> file), plus the
          model's HF config when it has one, so ``from_pretrained(checkpoint)`` loads it. The
          tensors are gathered one file at a time: no rank holds more than ``size_per_shard`` MiB
          of full tensors.
        - ``prefix``: put before every file name in a directory
          (``{prefix}-model-00001-of-00002.safetensors``; ``None``/``""``: none); ``load_model``
          finds them, ``from_pretrained`` does not. One file is named by ``checkpoint`` alone.
        - ``gather_dtensor=False`` (save each rank's shards instead) logs that full tensors are
          written anyway: they are streamed as above, and they load under any plan and mesh.

        Tied weights are written once; a pipelined model's tensors come from their stages."""
        origin = self._origin(model)
        if prefix and not shard and not os.path.isdir(checkpoint):
            _log_once("save_model: prefix names the files of a checkpoint directory; shard=False writes the one "
                      "file named by checkpoint")
        if gather_dtensor is not True:
            _log_once("save_model(gather_dtensor=False): full tensors are written (gathered one shard file "
                      "at a time), which every plan, mesh and plain module loads")
        checkpoint_io.save_model(model, checkpoint, config=origin.config, shard=shard, size_per_shard=size_per_shard,
                                 use_safetensors=use_safetensors, architectures=[origin.class_name], prefix=prefix)

    def load_model(self, model: nn.Module, checkpoint: str | os.PathLike, strict: bool = True) -> None:
        """Load a checkpoint of ``save_model`` (or of HF's ``save_pretrained``): a single file, or
        a directory (sharded with its index, or one file), the format detected. ``model`` is a
        boosted model (under whatever plan and mesh it has: every rank reads the full tensors and
        keeps its slices) or a plain ``nn.Module`` (``load_state_dict``; tied weights written
        once are filled under every name). ``strict``: every parameter and persistent buffer
        must be there and nothing else."""
        if not isinstance(model, nn.Module):
            raise ValueError(f"load_model: model must be a torch.nn.Module, got {type(model).__name__}")
        checkpoint_io.load_model(model, checkpoint, strict=strict)

    def save_optimizer(self, optimizer: BoostedOptimizer, checkpoint: str | os.PathLike, shard: bool = False,
                       gather_dtensor: bool = True, prefix: str | None = None, size_per_shard: int = 1024) -> None:
        """The optimizer's state (and the fp16 loss scaler's), the notes' signature and order (a
        collective: every rank calls). ``shard=True``: a ``torch.distributed.checkpoint``
        directory, each rank writing its own shards (no gather); ``shard=False``: one file at
        ``checkpoint`` (``torch.save`` of the full state keyed by parameter name, gathered and
        written by rank 0). Both reload under another plan, mesh or world size.
        ``size_per_shard``, ``prefix`` and ``gather_dtensor`` have no meaning for these formats
        (DCP writes one file per rank) and log one line when set."""
        _check_optimizer(optimizer)
        if size_per_shard != 1024 or prefix or gather_dtensor is not True:
            _log_once("save_optimizer: size_per_shard, prefix and gather_dtensor are not used (a DCP directory "
                      "holds one file per rank; a single file holds the gathered state)")
        checkpoint_io.save_optimizer(optimizer, checkpoint, shard=shard)

    def load_optimizer(self, optimizer: BoostedOptimizer, checkpoint: str | os.PathLike) -> None:
        """Load ``save_optimizer``'s file or directory (detected), resharded to this optimizer's
        module (any plan, mesh or world size; the same parameter names and param groups)."""
        _check_optimizer(optimizer)
        checkpoint_io.load_optimizer(optimizer, checkpoint)

    def save_lr_scheduler(self, lr_scheduler: Any, checkpoint: str | os.PathLike) -> None:
        """``lr_scheduler.state_dict()`` into the file ``checkpoint`` (rank 0 writes)."""
        checkpoint_io.save_lr_scheduler(lr_scheduler, checkpoint)

    def load_lr_scheduler(self, lr_scheduler: Any, checkpoint: str | os.PathLike) -> None:
        """``lr_scheduler.load_state_dict`` of ``save_lr_scheduler``'s file."""
        checkpoint_io.load_lr_scheduler(lr_scheduler, checkpoint)

    def _origin(self, model: ParallelModule) -> _Origin:
        _check_module(model)
        origin = self._origins.get(model)
        # A module boosted elsewhere (or built by autoparallelize): no HF config to write.
        return origin if origin is not None else _Origin(None, "")


_PRECISIONS = {"fp16": "fp16", "bf16": "bf16", "fp32": "fp32", "float16": "fp16", "bfloat16": "bf16",
               "float32": "fp32"}


def _with_precision(plugin: AutoParallelPlugin, mixed_precision: Any) -> AutoParallelPlugin:
    """The product notes' ``Booster(mixed_precision="fp16", plugin=...)``: the plugin with that
    precision (an ``FP16TorchMixedPrecision``: fp16 and its loss-scaler settings). The plugin
    owns precision here (it plans fp16/bf16 compute and makes the loss scaler from its
    ``initial_scale`` and friends), so the Booster's keyword maps onto it; a plugin already set
    to ANOTHER non-default value is a contradiction, refused rather than one side silently
    winning. (``"fp32"`` is the plugin's default, so it cannot conflict.)"""
    if mixed_precision is None:
        return plugin
    scale = mixed_precision if isinstance(mixed_precision, FP16TorchMixedPrecision) else None
    wanted = "fp16" if scale is not None else _precision_name(mixed_precision)
    if plugin.precision not in ("fp32", wanted):
        raise ValueError(f"Booster(mixed_precision={mixed_precision!r}) conflicts with the plugin's "
                         f"precision={plugin.precision!r}: give one of them")
    changes = {} if plugin.precision == wanted else {"precision": wanted}
    if scale is not None:
        # the defaults of the plugin's own constructor (LowLevelZeroPlugin's scale is 2**32)
        defaults = {p.name: p.default for p in inspect.signature(type(plugin)).parameters.values()}
        for name, value in (("initial_scale", scale.init_scale), ("growth_factor", scale.growth_factor),
                            ("backoff_factor", scale.backoff_factor), ("growth_interval", scale.growth_interval)):
            mine = getattr(plugin, name)
            if mine != value and mine != defaults.get(name, mine):
                raise ValueError(f"Booster(mixed_precision={mixed_precision!r}) conflicts with the plugin's "
                                 f"{name}={mine!r}: give one of them")
            if mine != value:
                changes[name] = value
    return _copy_plugin(type(plugin), plugin, changes) if changes else plugin


def _copy_plugin(cls: type, plugin: AutoParallelPlugin, changes: dict[str, Any]) -> AutoParallelPlugin:
    """``plugin`` with ``changes``, checked again. Not ``dataclasses.replace``: a subclass with its
    own constructor (``LowLevelZeroPlugin``) does not take the fields as arguments; the
    attributes it keeps beside them (``stage``) come along."""
    new = object.__new__(cls)
    for field in fields(AutoParallelPlugin):
        object.__setattr__(new, field.name, changes.get(field.name, getattr(plugin, field.name)))
    for key, value in getattr(plugin, "__dict__", {}).items():
        object.__setattr__(new, key, value)
    new.__post_init__()
    return new


def _pipeline_options(plugin: AutoParallelPlugin, options: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The ``autoparallelize`` options for a pipelined plan and the ZeRO stage the optimizer
    runs inside the stages (``PipelineModule.optimizer``): with ZeRO-1 the stages are planned
    with it too, so each stage's memory holds only its share of the optimizer state and the
    step pays the all-gather of the updated parameters."""
    zero = plugin.zero_stage
    if zero == 2:
        raise ValueError("zero_stage=2 does not compose with a pipeline (gradients accumulate over the micro-batches "
                         "before the data-parallel sum): use zero_stage=1 or 0 with pp_size")
    stage = 1 if zero == 1 else 0
    return {**options, "zero_stage": None if options.get("zero_stage") is None else stage}, stage


def _torch_amp(plugin: TorchDDPPlugin | TorchFSDPPlugin,
               mixed_precision: Any) -> tuple[torch.dtype | None, FP16TorchMixedPrecision | None]:
    """The autocast dtype (None for fp32) and the fp16 loss scaler's settings of the notes'
    ``Booster(mixed_precision=..., plugin=TorchDDPPlugin())``: ``"fp16"`` is
    ``FP16TorchMixedPrecision()``'s. A ``TorchFSDPPlugin`` with its own ``mixed_precision``
    policy is refused: two sources of the precision, one of them silently second."""
    if isinstance(mixed_precision, FP16TorchMixedPrecision):
        dtype, scale = torch.float16, mixed_precision
    else:
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": None}[_precision_name(mixed_precision)]
        scale = FP16TorchMixedPrecision() if dtype is torch.float16 else None
    if dtype is not None and getattr(plugin, "mixed_precision", None) is not None:
        raise ValueError(f"Booster(mixed_precision={mixed_precision!r}) conflicts with TorchFSDPPlugin's own "
                         f"mixed_precision={plugin.mixed_precision!r}: give one of them")
    return dtype, scale


def _precision_name(mixed_precision: Any) -> str:
    key = str(mixed_precision).removeprefix("torch.") if isinstance(mixed_precision, (str, torch.dtype)) else None
    if key not in _PRECISIONS:
        raise ValueError(f"mixed_precision must be one of 'fp16', 'bf16', 'fp32' (or the torch dtype) or an "
                         f"FP16TorchMixedPrecision, got {mixed_precision!r}")
    return _PRECISIONS[key]


def _check_order(criterion: Any, dataloader: Any) -> None:
    """``boost``'s order is (model, optimizer, criterion, dataloader, lr_scheduler); the notes'
    plugin examples pass ``(train_dataloader, criterion)`` the other way round."""
    if criterion is not None and not callable(criterion):
        swapped = callable(dataloader) and not isinstance(dataloader, torch.utils.data.DataLoader)
        raise ValueError(f"boost: criterion must be callable, got {type(criterion).__name__}"
                         + ("; the arguments are (model, optimizer, criterion, dataloader, lr_scheduler): "
                            "pass them by keyword" if swapped else ""))


_LOGGED: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        log.info(message)


def _check_module(model: Any) -> None:
    if not isinstance(model, ParallelModule):
        raise ValueError(f"expected the boosted model (an AutoParallelModule or a PipelineModule), "
                         f"got {type(model).__name__}")


def _check_optimizer(optimizer: Any) -> None:
    if not isinstance(optimizer, BoostedOptimizer):
        raise ValueError(f"expected the optimizer returned by Booster.boost, got {type(optimizer).__name__}")
