"""The user's optimizer, rebuilt over the boosted model's shards, and the wrapper ``boost`` returns.

``rebuild_optimizer`` makes an optimizer of the same class over the ``AutoParallelModule``'s
DTensor parameters: the original's ``defaults`` (those its constructor takes) and each param
group's hyper-parameters as they are, with the group's parameters matched by NAME (a parameter
of the original model -> its FQNs -> the boosted parameter of that FQN; tied aliases are one
parameter). ``torch.optim.Adafactor`` becomes ``autopar.optim.Adafactor``: torch's refuses
DTensor shards, and per-shard row/column statistics would be wrong. The original's state (if
it already stepped) is not carried over: resume with ``Booster.load_optimizer``.

``BoostedOptimizer`` wraps the rebuilt optimizer: ``step()`` unscales (fp16), clips to
``max_norm`` (the true global norm over all shards and stages, by the module's
``clip_grad_norm_``) and steps; ``backward(loss)`` scales the
loss for fp16; ``zero_grad``, ``param_groups``, ``state``, ``state_dict`` pass through.
``clip_grad_by_norm`` / ``clip_grad_by_value`` called by the user before ``step()`` unscale
first (torch's AMP recipe: ``scaler.unscale_(opt)`` then clip), once per step: a threshold is
about the true gradient, and clipping the scaled one would shrink the update by the scale.
"""

from __future__ import annotations

import inspect
import weakref
from functools import wraps
from typing import Any, Callable

import torch
from torch import nn

from autopar.runtime.amp import GradScaler
from autopar.runtime.bucketing import GradBucketer
from autopar.runtime.local_step import elementwise, stepping_locally
from autopar.runtime.parallel_module import ParallelModule, clip_grad_norm

__all__ = ["BoostedOptimizer", "rebuild_optimizer", "repoint_scheduler", "foreach_over_dtensors"]



def _target_class(cls: type) -> type:
    if cls is torch.optim.Adafactor:
        try:
            from autopar.optim import Adafactor
        except ImportError as exc:
            raise ValueError(f"torch.optim.Adafactor computes per-shard statistics on sharded parameters; "
                             f"its distributed replacement autopar.optim.Adafactor could not be imported "
                             f"({exc})") from exc
        return Adafactor
    return cls


def rebuild_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module,
                      by_fqn: dict[str, nn.Parameter], *, build: Callable[..., torch.optim.Optimizer] | None = None
                      ) -> torch.optim.Optimizer:
    """``optimizer`` (built over ``model``'s parameters) rebuilt over ``by_fqn``'s parameters
    (FQN -> boosted parameter, tied aliases included). A parameter the boosted model does not
    have (the traced forward never uses it, so it never has a gradient) is left out.
    ``build(cls, groups, **defaults)`` makes the new optimizer (default: ``cls(groups, ...)``;
    the booster's builds it through ``AutoParallelModule.optimizer`` for ZeRO pieces)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        params, seen = [], set()
        for param in group["params"]:
            if id(param) not in names:
                raise ValueError(f"param group {i} of the optimizer holds a tensor of shape {list(param.shape)} "
                                 f"that is not a parameter of the model being boosted")
            found = next((by_fqn[n] for n in names[id(param)] if n in by_fqn), None)
            if found is not None and id(found) not in seen:
                seen.add(id(found))
                params.append(found)
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    if not any(g["params"] for g in groups):
        raise ValueError("none of the optimizer's parameters is a parameter of the boosted model")
    cls = _target_class(type(optimizer))
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}
    rebuilt = (build or (lambda c, g, **kw: c(g, **kw)))(cls, groups, **kwargs)
    if cls is not type(optimizer):  # hyper-parameters the new class does not know (torch's foreach)
        for group in rebuilt.param_groups:
            for key in set(group) - set(rebuilt.defaults) - {"params", "initial_lr"}:
                del group[key]
    return rebuilt


def foreach_over_dtensors(cls: type, groups: list[dict], kwargs: dict) -> tuple[list[dict], dict]:
    """``groups`` and ``kwargs`` for an optimizer over the boosted module's DTensor parameters
    with torch's ``foreach`` implementation where it was left to torch (``foreach=None``, the
    default), for torch's elementwise optimizers (``runtime.local_step.ELEMENTWISE_OPTIMIZERS``).
    Why: torch picks the per-tensor loop on the CPU, and each DTensor op there costs its Python
    dispatch (~0.3 ms under load) per parameter per op: AdamW over a Qwen2-style decoder's 51
    tensors took 325 ms of CPU a step on 4 gloo ranks against DDP's 128 ms on plain tensors; the
    foreach kernels dispatch once per op for all parameters (and ``BoostedOptimizer.step`` runs
    them on the local tensors: ``runtime.local_step``). Same algorithm and arithmetic; an
    explicit ``foreach=False`` (in the defaults or a group) is kept."""
    if not elementwise(cls) or kwargs.get("foreach") is not None:
        return groups, kwargs
    groups = [{**g, "foreach": True} if g.get("foreach", None) is None else g for g in groups]
    return groups, {**kwargs, "foreach": True}


def _track_steps(opt: torch.optim.Optimizer) -> None:
    """Mark ``opt.step`` the way ``torch.optim.lr_scheduler.LRScheduler`` does when it is
    built, so a re-pointed scheduler knows when the optimizer stepped (no false warning)."""
    if hasattr(opt.step, "_wrapped_by_lr_sched"):
        return
    ref = weakref.ref(opt)  # the wrapper lives on opt: a strong reference would be a cycle
    func = type(opt).step

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        this = ref()
        this._opt_called = True
        return func(this, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True
    opt.step = wrapper


def repoint_scheduler(scheduler: Any, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
    """Make ``scheduler`` (built over ``old``) drive ``new``: its ``optimizer`` becomes ``new``
    (chained and sequential schedulers: each of theirs too); base learning rates and the
    epoch count stay, so ``scheduler.step()`` changes ``new``'s learning rates."""
    if not hasattr(scheduler, "optimizer"):
        raise ValueError(f"lr_scheduler must be a torch.optim.lr_scheduler scheduler, got {type(scheduler).__name__}")
    if scheduler.optimizer is not old:
        raise ValueError(f"lr_scheduler {type(scheduler).__name__} drives another optimizer than the one boosted")
    scheduler.optimizer = new
    for inner in getattr(scheduler, "_schedulers", ()):  # SequentialLR, ChainedScheduler
        repoint_scheduler(inner, old, new)
    _track_steps(new)


class BoostedOptimizer:
    """What ``Booster.boost`` returns for the user's optimizer (``optim``: the rebuilt one)."""

    def __init__(self, optim: torch.optim.Optimizer, module: ParallelModule, *, max_norm: float = 0.0,
                 scaler: GradScaler | None = None, zero=None, norm_type: float = 2.0) -> None:
        self.optim = optim
        self.module = module
        self.max_norm = float(max_norm)
        self.norm_type = float(norm_type)  # the norm step() clips max_norm by
        self.scaler = scaler
        self.zero = zero  # the ZeroOptimizer whose inner optimizer ``optim`` is (ZeRO pieces), if any
        # True once this step's gradients are in the pieces and unscaled (by a user's clip call
        # before step()): step() must then neither unscale again nor re-add ZeRO-2 contributions.
        self._ready = False

    # ------------------------------------------------------------------------ pass through
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    @property
    def state(self) -> Any:
        return self.optim.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optim.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        (self.zero or self.optim).zero_grad(set_to_none=set_to_none)
        for m in self.module.modules():  # no_sync micro-steps' unreduced gradients are gradients too
            if isinstance(m, GradBucketer):
                m.drop_unsynced()
        if self.scaler is None:  # with a scaler, an unscale_ stands until step() updates the scale
            self._ready = False

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    def unwrap(self) -> torch.optim.Optimizer:
        """The rebuilt torch optimizer (give it to a scheduler made after ``boost``)."""
        return self.optim

    def __repr__(self) -> str:
        extra = f", max_norm={self.max_norm:g}" if self.max_norm else ""
        return f"BoostedOptimizer({type(self.optim).__name__}{extra}{', fp16 loss scaling' if self.scaler else ''})"

    # ---------------------------------------------------------------------------- training
    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of the optimizer's parameters (ZeRO pieces where it holds them) to
        the global ``norm_type`` norm ``max_norm``; returns the norm before clipping (of the
        true, unscaled gradients) as a plain tensor. Under fp16 the gradients are unscaled first
        (once; ``step()`` does not unscale again). The module clips
        (``ParallelModule.clip_grad_norm_``): the norm spans every rank of it (DTensor shards,
        ZeRO pieces, a pipeline's stages). Every rank must call."""
        self._unscale_once()
        shards = self._sharded_grads()
        if shards is None:
            return self.module.clip_grad_norm_(max_norm, norm_type, parameters=self._grads_params())
        # Sharded chunks: their gradients are this rank's pieces of the chunk shards, not .grad;
        # the norm adds every rank's pieces (an all-reduce of their powers) to the rest's.
        device = next(iter(self.module.parameters())).device
        return clip_grad_norm(self._grads_params(), max_norm, norm_type, shards=shards, device=device)

    @torch.no_grad()
    def clip_grad_by_value(self, clip_value: float) -> None:
        """Clamp every element of the (true, unscaled: fp16 unscales first, once) gradients of the
        optimizer's parameters to ``[-clip_value, clip_value]``. Elementwise, so each rank clamps
        its own shard or ZeRO piece: exact, and no communication. Every rank must call (the
        fp16 unscale checks overflow across ranks)."""
        clip_value = float(clip_value)
        if not clip_value > 0:
            raise ValueError(f"clip_value must be > 0, got {clip_value!r}")
        self._unscale_once()
        from autopar.runtime.dtensors import local_of

        # An overflowed (inf) element would become finite here; the scaler has already
        # recorded the overflow in unscale_, so step() still skips.
        for local in [local_of(p.grad) for p in self._grads_params()] + (self._sharded_grads() or []):
            local.clamp_(-clip_value, clip_value)

    def _grads_params(self) -> list[torch.Tensor]:
        return [p for g in self.optim.param_groups for p in g["params"] if p.grad is not None]

    def _sharded_grads(self) -> list[torch.Tensor] | None:
        """The chunk optimizer's gradients kept as chunk shards (``GeminiOptimizer.sharded_grads``:
        sharded chunks, the plan's ZeRO-2 chunks), or None when it keeps them all in ``.grad``.
        The same answer on every rank (every rank has the same chunks), so the collective the
        shards' norm needs is joined by all."""
        gemini = getattr(self.optim, "gemini", None)  # the chunk optimizer (placement_policy)
        if gemini is None or not any(c.scatters for c in gemini.manager.chunks):
            return None
        return self.optim.sharded_grads()

    def _unscale_once(self) -> None:
        """This step's gradients into the ZeRO pieces and unscaled (fp16), at most once per step."""
        if self._ready:
            return
        self._prepare()
        if self.scaler is not None:
            self.scaler.unscale_(self.optim)
        self._ready = True

    def step(self, closure: Any = None) -> Any:
        """Unscale (fp16; unless a clip call already did), clip to ``max_norm`` (when > 0) and
        step. With fp16 the step is skipped on every rank when any rank's gradients
        overflowed, and the scale is updated."""
        if self.scaler is None:
            loss = None
            if closure is not None:  # it computes the gradients: they must exist before clipping
                with torch.enable_grad():
                    loss = closure()
                self._ready = False  # fresh gradients: the pieces must take them
            self._unscale_once()
            if self.max_norm > 0:
                self.clip_grad_by_norm(self.max_norm, self.norm_type)
            with stepping_locally(self.optim):  # same values, no DTensor dispatch (runtime.local_step)
                self.optim.step()
            self._ready = False
            self._gather()
            return loss
        if closure is not None:
            raise ValueError("a closure cannot be used with fp16 loss scaling (torch's GradScaler refuses it too)")
        self._unscale_once()
        if self.max_norm > 0:
            self.clip_grad_by_norm(self.max_norm, self.norm_type)
        with stepping_locally(self.optim):  # the scaler has unscaled: its step only reads found_inf
            result = self.scaler.step(self.optim)
        self.scaler.update()
        self._ready = False
        self._gather()
        return result

    def _prepare(self) -> None:
        """ZeRO: the pieces' gradients, before they are unscaled and clipped."""
        if self.zero is not None:
            self.zero.prepare_grads()

    def _gather(self) -> None:
        """ZeRO: the updated pieces back into the replicated parameters."""
        if self.zero is not None:
            self.zero.all_gather()
