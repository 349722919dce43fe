"""``autoparallelize(..., refine=True)``: time the first training steps, refit, re-plan once.

The module ``autoparallelize`` returns carries a ``Refiner`` (``AutoParallelModule.step_hook``),
called at the start of every forward call made with gradients enabled (a training step):

1. after ``RefineOptions.warmup`` steps it starts torch's profiler
   (``autopar.runtime.refine.StepTimer``) and times the next ``RefineOptions.steps`` whole steps
   (forward, backward, the optimizer step), per op class and for the collectives, on every rank;
2. at the start of the forward call after them -- a step boundary: the optimizer has stepped and no
   gradient is held (while some rank holds one, e.g. accumulating, it waits for the next call) --
   the ranks agree on the figures (the maximum over ranks), rank 0 refits the mesh's profile to
   them, plans again on it and prices the current plan there (``autopar.planner.refit.replan``)
   and broadcasts its verdict: the new plan when it is predicted faster by more than
   ``RefineOptions.threshold`` (5%), else none;
3. on a new plan every rank rebuilds the module under it and carries the training state over
   exactly: the parameters and buffers (full values, re-sliced into the new layouts), the optimizer
   built by ``module.optimizer(...)`` (its state, e.g. AdamW's ``exp_avg``/``exp_avg_sq``/``step``,
   gathered whole and re-sharded into the new layout and ZeRO pieces; its param groups'
   hyper-parameters as they are now, e.g. a scheduler's learning rate). Random draws are keyed by
   (seed, step, op, global index) (``strategies/rng.py``), independent of the layout, so they
   continue as they would have.

Contract: the module object and the optimizer object the caller holds stay valid. The module swaps
its internals (graph, parameters, plan: ``module.plan`` is the new plan, ``module.parameters()`` the
new DTensors); the optimizer returned by ``module.optimizer(...)`` is rebuilt in place (the same
``ZeroOptimizer`` and the same inner ``torch.optim`` object, whose ``param_groups`` and ``state``
now hold the new parameters), so a Booster's optimizer and an LR scheduler keep working.
Parameters taken from the module before the swap are stale afterwards: build the optimizer with
``module.optimizer(...)`` (a refinement without one raises ``ValueError``).

One log line (logger ``autopar.refine``, rank 0) says what was done; ``module.refinement`` holds
it as a ``Refinement`` record.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autopar.planner.options import PlanOptions
from autopar.plans import Plan

if TYPE_CHECKING:
    import torch
    from torch import nn

    from autopar.runtime.module import AutoParallelModule
    from autopar.runtime.refine import StepTimes
    from autopar.tracer.graph import TracedGraph

__all__ = ["RefineOptions", "Refinement", "Refiner", "attach_refiner"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RefineOptions:
    """``autoparallelize(refine=...)``: ``True`` means ``RefineOptions()``."""

    warmup: int = 1  # training steps run before timing (first calls allocate and fill caches)
    steps: int = 2  # training steps timed (the profiler runs until the next training forward call)
    threshold: float = 0.05  # re-plan when the new plan is predicted faster by more than this share

    def __post_init__(self) -> None:
        for name, low in (("warmup", 0), ("steps", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"RefineOptions.{name} must be an int >= {low}, got {value!r}")
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and 0 <= t < 1):
            raise ValueError(f"RefineOptions.threshold must be a share in [0, 1), got {t!r}")

    @classmethod
    def coerce(cls, value: Any) -> RefineOptions | None:
        """``refine=``'s value as a record (None: off)."""
        if value is False or value is None:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        raise ValueError(f"refine must be a bool or a RefineOptions, got {value!r}")


@dataclass(frozen=True, slots=True)
class Refinement:
    """What the refinement did: ``replaced`` the plan or kept it, at which training step (the
    forward call it ran before, counted from 0), the predicted steps of the current and the
    best plan under the refit profile, the measured / priced ratios it refit by."""

    replaced: bool
    step: int
    current_s: float
    best_s: float
    ratios: dict[str, float] = field(default_factory=dict)

    @property
    def gain(self) -> float:
        return (self.current_s - self.best_s) / self.current_s if self.current_s > 0 else 0.0

    def __str__(self) -> str:
        what = "replaced the plan" if self.replaced else "kept the plan"
        ratios = ", ".join(f"{k} x{v:.3g}" for k, v in self.ratios.items()) or "nothing measured"
        return (f"autopar refine at step {self.step}: {what} (predicted step {self.current_s * 1e3:.3f} ms -> "
                f"{self.best_s * 1e3:.3f} ms, gain {self.gain:.1%}; measured/priced {ratios})")


class Refiner:
    """The step hook of a module built with ``refine`` (module docstring)."""

    def __init__(self, opts: RefineOptions, *, model: nn.Module, traced: TracedGraph, options: PlanOptions,
                 device: torch.device, seed: int) -> None:
        from autopar.runtime.refine import StepTimer

        self.opts, self.model, self.traced, self.options = opts, model, traced, options
        self.device, self.seed = device, seed
        self.calls = 0  # training forward calls seen
        self.timer = StepTimer(device=device)
        self.result: Refinement | None = None
        self.finished = False  # refined, or failed trying: once either way

    def __call__(self, module: AutoParallelModule) -> None:
        if self.finished:
            return
        start, stop = self.opts.warmup, self.opts.warmup + self.opts.steps
        if self.calls == start:
            self.timer.start()
        if self.calls >= stop and not _any_rank_holds_gradients(module, self.device):
            self.finished = True
            self.refine(module, self.timer.stop(steps=self.calls - start))
        self.calls += 1

    def refine(self, module: AutoParallelModule, times: StepTimes) -> None:
        if getattr(module, "_zero", None) is None:
            raise ValueError("refine=True: build the optimizer with module.optimizer(torch.optim.AdamW, ...) (the "
                             "optimizer refinement rebuilds in place when it replaces the plan)")
        agreed = times.agreed(device=self.device)
        verdict = self._verdict(module.plan, agreed)
        replaced, current_s, best_s, ratios, text = verdict
        if text is not None:
            _swap(module, Plan.from_json(text), model=self.model, traced=self.traced, device=self.device,
                  seed=self.seed)
        self.result = module.refinement = Refinement(replaced, self.calls, current_s, best_s, ratios)
        self.model = self.traced = None  # done: the model and its trace need not be kept alive
        import torch.distributed as dist

        if dist.get_rank() == 0:
            log.info("%s", self.result)

    def _verdict(self, plan: Plan, times: StepTimes) -> tuple[bool, float, float, dict, str | None]:
        """Rank 0 refits and re-plans; every rank gets (replaced, current s, best s, ratios, new
        plan JSON or None), or rank 0's error."""
        import torch.distributed as dist

        payload: list[Any] = [None]
        error = None
        if dist.get_rank() == 0:
            try:
                from autopar.planner.refit import replan
                from autopar.tracer import profile as profile_graph

                refit = replan(self.traced, profile_graph(self.traced), plan, options=self.options,
                               measured=times.by_class(), measured_comm=times.comm)
                better = refit.plan is not plan and refit.gain > self.opts.threshold
                payload[0] = ("ok", (better, refit.current_s, refit.best_s, dict(refit.ratios),
                                     refit.plan.to_json() if better else None))
            except Exception as exc:  # noqa: BLE001 -- re-raised on every rank below
                payload[0], error = (type(exc).__name__, str(exc)), exc
        if self.device.type == "cuda" and dist.get_backend() == "nccl":
            dist.broadcast_object_list(payload, src=0, device=self.device)
        else:
            dist.broadcast_object_list(payload, src=0)
        status, value = payload[0]
        if error is not None:
            raise error
        if status != "ok":
            raise ValueError(f"refine failed on rank 0: {status}: {value}")
        return value


def attach_refiner(module: AutoParallelModule, opts: RefineOptions, **kwargs: Any) -> None:
    """Make ``module`` refine itself (``Refiner``'s keywords)."""
    module.step_hook = Refiner(opts, **kwargs)
    module.refinement = None


def _any_rank_holds_gradients(module: AutoParallelModule, device) -> bool:
    """Whether some rank's parameters (or ZeRO pieces) hold a gradient: not a step boundary."""
    import torch
    import torch.distributed as dist

    from autopar.runtime.dtensors import local_of

    zero = getattr(module, "_zero", None)
    tensors = list(module.parameters()) + ([t for p in zero.pieces for t in (p.param, p.master)] if zero else [])
    # Local pieces: a DTensor's comparison would be a collective of its own, per parameter.
    held = any(t.grad is not None and bool(local_of(t.grad).count_nonzero()) for t in tensors)
    flag = torch.tensor([float(held)], device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _swap(module: AutoParallelModule, plan: Plan, *, model, traced, device, seed: int) -> None:
    """Rebuild ``module`` under ``plan`` in place, carrying its state and its optimizer's over.
    A failure on any rank fails every rank before anything is changed."""
    from autopar.agreement import _all_gather, _raise_failures, _status
    from autopar.runtime.build import build_module

    full = module.full_state_dict()  # collectives: every rank, before anything can fail alone
    old_zero = module._zero
    old_holder = old_zero.state_module()
    state = _full_optimizer_state(old_holder, old_zero.optimizer)  # collectives likewise
    try:
        new: Any = build_module(model, traced, plan, device=device, seed=seed, init_weights=True)
        new.load_full_state_dict(full)
        new.train(module.training)
        new_zero = _rebuilt_optimizer(new, old_zero, old_holder)
    except Exception as exc:  # noqa: BLE001 -- every rank learns of it below
        new = exc
    _raise_failures(_all_gather(_status(new), device=device), new, when="while rebuilding the refined module")
    _load_optimizer_state(new_zero, state)
    inner = old_zero.optimizer
    inner.param_groups, inner.state = new_zero.optimizer.param_groups, new_zero.optimizer.state
    keep = ("training", "step_hook", "refinement")
    vars(module).update({k: v for k, v in vars(new).items() if "hook" not in k and k not in keep})
    vars(old_zero).update({k: v for k, v in vars(new_zero).items() if k not in ("optimizer", "module")})
    old_zero._state_module = None
    module.attach_zero(old_zero)


def _full_optimizer_state(holder, optimizer) -> dict:
    """The optimizer's state dict keyed by parameter name, every tensor full (a collective each)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from autopar.booster.checkpoint_io import _gathered, _lifted

    return _gathered(_lifted(get_optimizer_state_dict(holder, optimizer), holder))


def _rebuilt_optimizer(new: AutoParallelModule, old_zero, old_holder):
    """A ``ZeroOptimizer`` over ``new`` of the old one's class, param groups (by parameter name,
    hyper-parameters as they are now) and defaults."""
    from autopar.runtime.zero import ZeroOptimizer

    inner = old_zero.optimizer
    name_of = {id(p): n for n, p in old_holder.named_parameters()}
    params = dict(new.named_parameters())
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [params[name_of[id(p)]] for p in g["params"]]}
              for g in inner.param_groups]
    rebuilt = ZeroOptimizer(new, type(inner), groups)
    rebuilt.optimizer.defaults = dict(inner.defaults)
    return rebuilt


def _load_optimizer_state(zero, full: dict) -> None:
    """``full`` (``_full_optimizer_state``'s) sliced into ``zero``'s parameters and pieces."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from autopar.booster.checkpoint_io import _lifted, _placed, _unlifted

    holder = zero.state_module()
    own = get_optimizer_state_dict(holder, zero.optimizer)  # fills missing state: a layout to load into
    placed = _placed(_lifted(own, holder), full, "optimizer state")
    groups = [{**saved, "params": mine["params"]} for mine, saved in zip(own["param_groups"], full["param_groups"])]
    set_optimizer_state_dict(holder, zero.optimizer, optim_state_dict=_unlifted({**placed, "param_groups": groups},
                                                                                 own["state"]))
