"""Gemini-style chunked, heterogeneous (device / host) memory for an ``AutoParallelModule``.

Entry point::

    module, optimizer = autopar.runtime.gemini.wrap(
        module, torch.optim.AdamW, dict(lr=1e-3), policy=StaticPolicy(offload_optim_frac=1.0,
        offload_param_frac=0.5, device_budget=...))

``module`` is the emitted module (each rank's local shards; any plan: its ZeRO-1/2 stages run in
the chunks, and its activation recompute regions re-fetch, when backward re-runs them, the
chunks they read: ``hooks``). Its parameters are packed into chunks (``chunk``), placed on
the device or the host tier by the policy (``policies``), fetched/evicted by the ``manager``
during forward and backward, and stepped by the returned ``GeminiOptimizer`` (``gemini_optimizer``).
``module.gemini`` is the ``Gemini`` controller: ``.manager.ledger`` has the exact bytes per
tier, their peaks and the per-move log; ``.summary()`` the figures.

Planner hand-off: ``policy_from_plan(plan)`` turns ``Plan.offload`` (parameter FQN ->
(parameter tier, optimizer tier)) into a ``PlannedPolicy``: parameters are chunked within groups
of equal tiers, so each chunk takes exactly its parameters' planned tiers (host-home groups in
chunks no larger than their largest parameter, the plan's streaming granularity, with two such
chunks as the stream room); the device budget defaults to the plan's. ``attach_planned(module,
plan)`` is what ``autoparallelize`` does with a plan that offloads; ``module.optimizer(AdamW,
...)`` then returns the ``GeminiOptimizer``. ``Gemini.place(tiers)`` re-places chunks at run time
(one (payload, optimizer) tier pair per chunk); ``apply_policy`` / ``set_device_budget`` likewise.

Gradients go into gradient chunks during backward (``grads``): on the device for device-home
chunks, on the host for host-home ones; each ``.grad`` is a view of its chunk.

Sharded chunks (``StaticPolicy(shard_param_frac=...)``, ZeRO-3 style): with a static policy,
chunks are built per data-parallel axis set -- the mesh axes (size > 1) on which the plan keeps a
parameter replicated, which are the axes the bucketer sums its partial gradient over or a
superset of them -- and the leading ``shard_param_frac`` of them (by bytes) keep 1/dp of their
payload, master, moments and gradient per rank (``chunk``). They are all-gathered on use like a
host chunk is fetched (``manager``), their gradients reduce-scattered at the end of backward
(``grads``, ``gradsync``), and the module's whole-state methods gather on demand (``state``);
``Gemini.place`` / ``apply_policy`` re-shard at run time. Their parameters' ``.grad`` stay None
(the gradient is the chunk's shard): the optimizer lists each parameter's piece of it
(``GeminiOptimizer.sharded_grads``), which ``autopar.runtime.amp.GradScaler`` unscales and checks
and ``parallel_module.clip_grad_norm(shards=...)`` counts and scales (the booster passes them);
``module.zero_grad()`` does not clear them (``optimizer.zero_grad()`` does). Every rank must have
the same chunks (checked).

ZeRO-1/2 (the plan's per-parameter ``zero_stage``, under every policy): a ZeRO parameter's chunk is
built per data-parallel group; its payload stays whole, its fp32 master, moments (and under
ZeRO-2 its gradient, reduce-scattered like a sharded chunk's) are this rank's shard, on the
optimizer tier the policy gives it -- the host for ZeRO-Offload -- and the whole payload is
all-gathered from the updated shards after each step (``chunk``, ``manager.gather_payload``).

ZeRO chunks are never sharded ZeRO-3 style too (``shard_param_frac`` skips them). Under a static
policy with ``unsharded_zero`` the chunks ``shard_param_frac`` leaves whole become ZeRO chunks
of that stage after the sharding (Gemini: the rest of ZeRO-3 is ZeRO-2).

``AutoPolicy(sharded=True)`` shards every chunk that has a data-parallel group likewise (Gemini's
auto placement is ZeRO-3): the warm-up and the placement after it move shards.

Not yet: sharding under the planned policy; the CUDA path (side-stream prefetch,
pinned memory, host ``.grad`` views, all-gathers on the compute stream) has not run on a GPU.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from autopar.runtime.bucketing import GradBucketer
from autopar.runtime.gemini.chunk import DEVICE, HOST, Chunk, search_chunk_size
from autopar.runtime.gemini.cpu_optim import KINDS
from autopar.runtime.gemini.hooks import SavedHooks, gemini_use, instrument, register
from autopar.runtime.gemini.manager import ChunkManager, ChunkRange, Ledger
from autopar.runtime.gemini.gemini_optimizer import GeminiOptimizer
from autopar.runtime.gemini.gradsync import GradSync
from autopar.runtime.gemini.policies import (AutoPolicy, PlannedPolicy, StaticPolicy, auto_tiers, make_policy,
                                              policy_from_plan, static_shards, static_tiers)
from autopar.runtime.gemini.shards import check_same_chunks
from autopar.runtime.gemini.state import install as install_state

__all__ = [
    "wrap", "attach", "attach_planned", "Gemini", "GeminiOptimizer", "StaticPolicy", "AutoPolicy", "PlannedPolicy",
    "policy_from_plan", "ChunkRange", "make_policy", "search_chunk_size", "Ledger", "Chunk", "DEVICE", "HOST",
]

_KIND_OF = {torch.optim.AdamW: "adamw", torch.optim.Adam: "adam"}


class Gemini:
    """The controller attached to a wrapped module as ``module.gemini``."""

    def __init__(self, module, policy: StaticPolicy | AutoPolicy | PlannedPolicy, chunk_range: ChunkRange) -> None:
        self.module = module
        self.policy = policy
        self.steps = 0
        params = [(name, p) for name, p, stage, _ in module.zero_parameters()]
        stages = {name: stage for name, _, stage, _ in module.zero_parameters()}
        device = next(iter(module.parameters())).device
        group_of = None
        # The plan's ZeRO-1/2 parameters: chunks per data-parallel group, their state sharded over it.
        zero_of = stages.__getitem__
        dp_of = functools.partial(_zero_group, dict(params), module.pmesh, stages, ((), (), ()))
        if isinstance(policy, AutoPolicy):
            tiers = lambda payload, optim, chunks: [(HOST, HOST)] * len(payload)  # noqa: E731 -- warm-up on host
            if policy.sharded:  # Gemini's auto placement runs ZeRO-3 chunks: group them to be shardable
                dp_of = functools.partial(_dp_group, dict(params), module.pmesh)
        elif isinstance(policy, PlannedPolicy):
            planned = {}
            for name, _ in params:
                ph = module._placeholders[name]
                planned[name] = next((policy.tiers[a] for a in (ph.fqn, *ph.aliases) if a in policy.tiers),
                                     (DEVICE, DEVICE))
            group_of = planned.__getitem__
            tiers = lambda payload, optim, chunks: [c.group for c in chunks]  # noqa: E731
        else:
            tiers = lambda payload, optim, chunks: static_tiers(payload, policy)  # noqa: E731
            dp_of = functools.partial(_dp_group, dict(params), module.pmesh)  # any chunk may be sharded
        self.manager = ChunkManager(params, device=device, tiers_of=tiers, chunk_range=chunk_range,
                                    pin_memory=policy.pin_memory, budget=policy.device_budget, group_of=group_of,
                                    dp_of=dp_of, pmesh=module.pmesh, zero_of=zero_of)
        if isinstance(policy, PlannedPolicy):  # the plan's stream buffer: one chunk in use, one prefetched
            self.manager.stream_bytes = sum(sorted(c.payload_bytes for c in self.manager.chunks
                                                   if c.home == HOST)[-2:])
        for m in module.graph_module.modules():
            if isinstance(m, GradBucketer):  # reduced gradients land in the gradient chunks
                m.deliver_to(self.manager.grads.target)
        self.key = register(self.manager)
        self.manager.gradsync = None
        if any(c.num_shards > 1 for c in self.manager.chunks):  # shardable: partial gradients go by chunk
            self.manager.gradsync = GradSync(self.manager, module.graph_module)
            self.manager.gradsync.install(self.key)
            install_state(self)
        if any(c.zero for c in self.manager.chunks):
            check_same_chunks(self.manager.chunks)  # ZeRO chunks gather and scatter every step
            module._zero2 = []  # ZeRO-2 gradients land in the chunks' shards, the module need not refuse
        self.hooks = SavedHooks(self.manager)
        self.num_instrumented = instrument(module.graph_module, set(self.manager.chunk_of), self.key)
        self.manager.grads.set_used(n.kwargs["name"] for n in module.graph_module.graph.nodes
                                    if n.op == "call_function" and n.target is gemini_use)
        self._forward = module.forward
        module.forward = self.forward
        if isinstance(policy, StaticPolicy) and policy.shard_param_frac > 0:
            self.place([(c.home, c.optim_tier) for c in self.manager.chunks], self._shards(policy))
        if isinstance(policy, StaticPolicy) and policy.unsharded_zero:
            self._zero_unsharded(policy.unsharded_zero)
        elif isinstance(policy, AutoPolicy) and policy.sharded:  # the warm-up's placement keeps them sharded
            self.place([(c.home, c.optim_tier) for c in self.manager.chunks],
                       [c.num_shards > 1 and not c.zero for c in self.manager.chunks])

    def _zero_unsharded(self, stage: int) -> None:
        """The shardable chunks left whole, ZeRO-``stage`` (Gemini: the rest of ZeRO-3 is ZeRO-2)."""
        chunks = [c for c in self.manager.chunks if c.num_shards > 1 and not c.sharded and not c.zero]
        if not chunks:
            return
        check_same_chunks(self.manager.chunks)  # their state shards must line up on every rank
        for chunk in chunks:
            self.manager.make_zero(chunk, stage)
        self.manager.gradsync.rebuild()  # ZeRO-2 gradients leave the bucketer for the shards

    def _shards(self, policy: StaticPolicy) -> list[bool]:
        chunks = self.manager.chunks
        return static_shards([c.full_bytes for c in chunks], policy, [c.num_shards > 1 and not c.zero for c in chunks])

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            self.manager.grads.free_unused()  # .grad cleared by the user (model.zero_grad())
        self.manager.sync_masters()  # parameters written from outside (a loaded checkpoint) win
        self.manager.start_pass()
        with torch.autograd.graph.saved_tensors_hooks(self.hooks.pack, self.hooks.unpack):
            return self._forward(*args, **kwargs)

    def before_step(self) -> None:
        """End of a step's forward/backward: record the access order, drop stale device copies;
        after the auto policy's warm-up, place the chunks by what it measured."""
        manager = self.manager
        manager.end_step()
        manager.evict_all()
        manager.sync_masters()  # parameters written from outside (a loaded checkpoint) win
        self.steps += 1
        if isinstance(self.policy, AutoPolicy) and self.steps == self.policy.warmup_steps:
            order = list(dict.fromkeys(manager.order))
            peak = max(manager.non_model_samples, default=0)
            self.place(auto_tiers([c.payload_bytes for c in manager.chunks], [c.optim_bytes for c in manager.chunks],
                                  grads=[c.grad_bytes for c in manager.chunks], budget=self.policy.device_budget,
                                  non_model_peak=peak, order=order))

    def place(self, tiers: list[tuple[str, str]], shards: list[bool] | None = None) -> None:
        """(payload tier, optimizer tier) per chunk, ``DEVICE`` or ``HOST``; ``shards``: per
        chunk, sharded over its data-parallel group or not (None: as they are). Every rank must
        place alike (unsharding all-gathers)."""
        chunks = self.manager.chunks
        if len(tiers) != len(chunks) or any(t not in (DEVICE, HOST) for pair in tiers for t in pair):
            raise ValueError(f"place needs one ('device'|'host', 'device'|'host') per chunk "
                             f"({len(chunks)}), got {tiers!r}")
        shards = [c.sharded for c in chunks] if shards is None else list(shards)
        if len(shards) != len(chunks) or any(not isinstance(s, bool) for s in shards):
            raise ValueError(f"place needs one bool per chunk ({len(chunks)}) in shards, got {shards!r}")
        bad = [c.index for c, s in zip(chunks, shards) if s and c.num_shards < 2]
        if bad:
            raise ValueError(f"place: chunks {bad} cannot be sharded: no mesh axis of size > 1 replicates their "
                             f"parameters (chunks are built per data-parallel group under static policies only)")
        resharded = any(c.sharded != s for c, s in zip(chunks, shards))
        if any(shards) or any(c.sharded for c in chunks):
            check_same_chunks(chunks)
        # Host-bound first so the device tier never holds both copies of a chunk over budget.
        moves = sorted(zip(chunks, tiers, shards), key=lambda ct: (ct[1][0] == DEVICE, ct[1][1] == DEVICE))
        for chunk, (home, optim), sharded in moves:
            self.manager.replace(chunk, home, optim, sharded)
        if resharded:
            self.manager.gradsync.rebuild()

    @torch.no_grad()
    def reload_masters(self) -> None:
        """fp32 masters from the parameters' payloads (after loading a model state dict)."""
        self.manager.sync_masters(force=True)

    def apply_policy(self, policy: StaticPolicy) -> None:
        """Re-place every chunk by a static policy's fractions and take its device budget."""
        if not isinstance(policy, StaticPolicy):
            raise ValueError(f"apply_policy takes a StaticPolicy, got {policy!r}")
        self.manager.ledger.budget = None
        self.manager.evict_all()
        self.policy = policy
        chunks = self.manager.chunks
        self.place(static_tiers([c.full_bytes for c in chunks], policy), self._shards(policy))
        self.set_device_budget(policy.device_budget)

    def optimizer(self, optimizer_cls: type = torch.optim.AdamW, optimizer_kwargs: dict | None = None, *,
                  param_groups: list | None = None) -> GeminiOptimizer:
        """A fresh Adam/AdamW (``optimizer_cls``) over the chunks (zero moments, step 0)."""
        if optimizer_cls not in _KIND_OF:
            raise ValueError(f"gemini's chunk optimizer runs {KINDS} (torch.optim.AdamW / torch.optim.Adam), "
                             f"got {optimizer_cls!r}")
        kwargs = dict(optimizer_kwargs or {})
        for key, neutral in (("amsgrad", False), ("maximize", False), ("capturable", False),
                             ("differentiable", False), ("foreach", None), ("fused", None),
                             ("decoupled_weight_decay", optimizer_cls is torch.optim.AdamW)):
            value = kwargs.pop(key, neutral)
            if value != neutral and not (key in ("foreach", "fused") and value is False):
                raise ValueError(f"gemini's chunk optimizer does not support {key}={value!r}")
        groups = param_groups if param_groups is not None else list(self.module.parameters())
        return GeminiOptimizer(groups, gemini=self, kind=_KIND_OF[optimizer_cls], **kwargs)

    def module_optimizer(self, optimizer_class: type, /, params=None, **kwargs: Any) -> GeminiOptimizer:
        """``AutoParallelModule.optimizer``'s signature for a chunked module: an Adam/AdamW over
        the chunks (``params``: None for all, or parameters / param-group dicts of them)."""
        return self.optimizer(optimizer_class, kwargs, param_groups=None if params is None else list(params))

    def set_device_budget(self, nbytes: int | None) -> None:
        """Bound the device tier to ``nbytes`` from now on (``None``: unbounded); it must hold
        what the device tier holds already."""
        if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int)
                                   or nbytes < self.manager.ledger.bytes[DEVICE]):
            raise ValueError(f"device budget must be None or an int >= the {self.manager.ledger.bytes[DEVICE]} B "
                             f"the device tier holds now, got {nbytes!r}")
        self.manager.ledger.budget = nbytes

    def summary(self) -> dict:
        return {**self.manager.summary(), "steps": self.steps, "instrumented": self.num_instrumented}


def _dp_group(params: dict, pmesh, name: str) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(mesh axes of size > 1 the plan replicates parameter ``name`` on, their sizes, this
    rank's coordinates): the group a chunk of such parameters can be sharded over."""
    p = params[name]
    if not isinstance(p, DTensor):
        return (), (), ()
    axes = tuple(a for a, pl in enumerate(p.placements) if pl.is_replicate() and pmesh.axis_size(a) > 1)
    return axes, tuple(pmesh.axis_size(a) for a in axes), tuple(pmesh.axis_coordinate(a) for a in axes)


def _zero_group(params: dict, pmesh, stages: dict, whole: tuple, name: str) -> tuple:
    """``_dp_group`` of a parameter the plan gives a ZeRO stage, ``whole`` for the others."""
    return _dp_group(params, pmesh, name) if stages[name] else whole


def attach(module, *, policy: StaticPolicy | AutoPolicy | PlannedPolicy | None = None,
           chunk_range: ChunkRange | None = None) -> Gemini:
    """Put ``module``'s parameters into chunks placed by ``policy`` (default: everything on the
    device); returns the controller, also ``module.gemini``. ``module.optimizer(AdamW, ...)``
    then builds the chunk optimizer (``Gemini.optimizer``)."""
    from autopar.runtime.module import AutoParallelModule

    if not isinstance(module, AutoParallelModule):
        raise ValueError(f"gemini needs an AutoParallelModule, got {type(module).__name__}")
    if getattr(module, "gemini", None) is not None:
        raise ValueError("this module is already wrapped by gemini")
    gemini = Gemini(module, policy or StaticPolicy(), chunk_range or ChunkRange())
    module.gemini = gemini
    return gemini


def attach_planned(module, plan) -> Gemini | None:
    """``module``'s parameters and optimizer state on the tiers ``plan.offload`` gives them
    (``policy_from_plan``; what ``autoparallelize`` does with a plan that offloads). A plan that
    offloads nothing leaves the module as it is (None)."""
    if all(tuple(tiers) == (DEVICE, DEVICE) for tiers in plan.offload.values()):
        return None
    return attach(module, policy=policy_from_plan(plan))


def wrap(module, optimizer_cls: type = torch.optim.AdamW, optimizer_kwargs: dict | None = None, *,
         policy: StaticPolicy | AutoPolicy | None = None, chunk_range: ChunkRange | None = None,
         param_groups: list | None = None):
    """(module, GeminiOptimizer): ``module`` with its parameters in chunks placed by ``policy``
    (default: everything on the device), and an Adam/AdamW over them."""
    if optimizer_cls not in _KIND_OF:
        raise ValueError(f"gemini's chunk optimizer runs {KINDS} (torch.optim.AdamW / torch.optim.Adam), "
                         f"got {optimizer_cls!r}")
    gemini = attach(module, policy=policy, chunk_range=chunk_range)
    return module, gemini.optimizer(optimizer_cls, optimizer_kwargs, param_groups=param_groups)
