"""``AutoParallelModule``: the emitted local graph as an ``nn.Module`` each rank trains.

Contract:

- ``forward`` takes the original model's inputs (positional or keyword; the FULL global batch,
  identical on every rank) and returns the original output structure (tuple, dict or HF
  ``ModelOutput``) with full, replicated values on every rank; an output summed over ranks by one
  all-reduce (a data-parallel loss) is a ``runtime.pending.PendingTensor`` whose all-reduce is
  still in flight, waited on at its first read (backward does not wait). With ``local_inputs=True``
  (see :func:`autopar.api.autoparallelize`), each rank passes only its own piece of
  every input, as laid out by ``input_specs``.
- Evaluation mode: where the model tells the modes apart (batch norm, dropout, random ops), a
  module traced in training mode and called after ``.eval()`` runs the original model in eval
  mode on the full parameters and buffers gathered onto every rank
  (:mod:`autopar.runtime.eval_replica`): same inputs (pieces under ``local_inputs`` are
  gathered; whole global batches are taken too), the model's own output structure with full
  values on every rank, no gradient; any batch size. ``.train()`` drops that copy and runs the
  training graph again.
- ``parameters()`` / ``named_parameters()`` and the buffers are ``DTensor``s on
  ``device_mesh`` (a torch ``DeviceMesh`` whose dim names are the ``MeshSpec`` axis names),
  named ``graph_module.<canonical FQN>``, with the plan's layouts as placements
  (:mod:`autopar.runtime.dtensors`). The emitted graph runs on local tensors: ``forward``
  passes their local tensors in (as persistent autograd leaves, ``dtensors.LocalLeaf``), so no
  DTensor dispatch happens inside forward or backward, and each gradient lands in ``.grad`` as
  a DTensor with the
  parameter's placements (replicated parameters receive the reduced gradient, identical on
  every replica; gradients come through ``loss.backward()``, not ``torch.autograd.grad``).
  torch's tools work unchanged on them: any ``torch.optim`` optimizer,
  ``torch.nn.utils.clip_grad_norm_`` (the true global norm, as a replicated DTensor),
  ``state_dict()`` / ``torch.distributed.checkpoint``.
- It implements :class:`autopar.runtime.parallel_module.ParallelModule` (optimizer and ZeRO
  hooks, ``clip_grad_norm_``, full state), as ``PipelineModule`` does.
- ``full_state_dict()``: original FQNs (tied aliases all present, persistent buffers included)
  -> full tensors, gathered (a collective: every rank must call). ``load_full_state_dict(sd)``
  slices a full state dict into the local shards (no communication). ``full_gradients()``:
  FQN -> full gradient (or None), gathered.
- ``code`` is the emitted graph's Python code: the inserted collectives appear by name.

:func:`clip_grad_norm_` is ``model.clip_grad_norm_`` (the ``ParallelModule`` protocol's clipping,
:mod:`autopar.runtime.parallel_module`), kept for code written against earlier versions.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Iterable, Iterator

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from autopar.plans import Plan
from autopar.runtime.bucketing import GradBucketer
from autopar.runtime.collectives import gather_full
from autopar.runtime.dtensors import LocalLeaf, local_of
from autopar.runtime.eval_replica import EvalReplica, mesh_device
from autopar.runtime import table_wise
from autopar.runtime.materialize import slice_local
from autopar.runtime.modes import TracedMode
from autopar.runtime.table_wise import owners_of
from autopar.runtime.parallel_module import ParallelModule, clip_grad_norm
from autopar.runtime.passes import STATE_KEY
from autopar.runtime.process_mesh import ProcessMesh
from autopar.layout.placement import TensorSpec
from autopar.strategies import rng
from autopar.tracer.graph import BUFFER, INPUT, PARAMETER, TracedGraph, keyword_path

__all__ = ["AutoParallelModule", "clip_grad_norm_"]


class AutoParallelModule(nn.Module):
    def __init__(self, graph_module: fx.GraphModule, *, traced: TracedGraph, plan: Plan, pmesh: ProcessMesh,
                 specs: dict[str, TensorSpec], attr_of: dict[str, str], signature: inspect.Signature,
                 state_keys: tuple[str, ...], local_inputs: bool = False, mode: TracedMode | None = None,
                 evaluator: EvalReplica | None = None) -> None:
        super().__init__()
        self.graph_module = graph_module
        self.plan = plan
        self.pmesh = pmesh
        self.local_inputs = local_inputs
        self._traced = traced
        self._signature = signature
        self._specs = dict(specs)  # placeholder name -> layout
        self._attr_of = dict(attr_of)  # placeholder name -> graph_module attribute path
        self._placeholders = {p.name: p for p in traced.placeholders}
        self._inputs = [p for p in traced.placeholders if p.kind == INPUT]
        self._state_keys = state_keys
        self._state_at: dict[str, tuple[nn.Module, str, str]] = {}  # see _state
        # The graph's placeholders in order: a parameter/buffer name, or None for the next user input.
        self._arg_state = tuple(n.name if n.meta.get(STATE_KEY) else None
                                for n in graph_module.graph.nodes if n.op == "placeholder")
        for m in graph_module.modules():
            if isinstance(m, GradBucketer):  # reduced gradients land in the DTensor parameters' .grad
                m.deliver_to(self._state)
        self._leaves: dict[str, LocalLeaf] = {}  # trained parameter -> the leaf the graph reads (_argument)
        self._bucket_of = _sole_buckets(graph_module)
        self.input_specs = {p.fqn: TensorSpec.parse(plan.node(p.name).output_specs[0]) for p in self._inputs
                            if _has_decision(plan, p.name)}
        self._zero = None  # the ZeroOptimizer built by ``optimizer``
        self._zero2 = [n.name for n in plan.nodes if n.zero_stage == 2]
        self._draws = rng.graph_draws(traced.gm.graph)  # each forward takes the next draw (rng.py)
        # Called with this module at the start of each training forward call (``autopar.refine``:
        # ``refine=True`` times the first steps there and may rebuild the module in place).
        self.step_hook = None
        # The mode the graph was traced in (modes.py): where the model tells the modes apart, a
        # training-traced module evaluates on a gathered replica (eval_replica.py); an eval-traced
        # one refuses training.
        self._mode = mode or TracedMode(True, None)
        self._evaluator = evaluator
        self.train(self._mode.training)

    # ------------------------------------------------------------------------------ running
    @property
    def code(self) -> str:
        return self.graph_module.code

    @property
    def device_mesh(self):
        """The torch ``DeviceMesh`` the parameters and buffers live on."""
        return self.pmesh.device_mesh

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._mode.replicated(self.training):
            return self._evaluate(args, kwargs)
        self._mode.check(self._traced.model_name, self.training)
        if self.step_hook is not None and torch.is_grad_enabled():
            self.step_hook(self)
        if self._zero is None and torch.is_grad_enabled() and self._zero2:
            raise ValueError(
                f"the plan shards the gradients of {len(self._zero2)} parameters (ZeRO-2, e.g. "
                f"{self._placeholders[self._zero2[0]].fqn!r}): their .grad would hold only what is not "
                f"reduce-scattered. Build the optimizer with model.optimizer(torch.optim.AdamW, lr=...) "
                f"(or plan with zero_stage=0 or 1)")
        with rng.module_call(self._draws):
            return self._traced.unflatten_outputs(list(self.graph_module(*self.graph_arguments(args, kwargs))))

    def train(self, mode: bool = True) -> "AutoParallelModule":
        if self._evaluator is not None:  # the eval replica's gathered state is not kept while training
            self._evaluator.forget()
        return super().train(mode)

    def _evaluate(self, args: tuple, kwargs: dict) -> Any:
        """An eval-mode call of a module traced in training mode: the original model in eval mode
        on the full parameters and buffers, on every rank (``eval_replica.py``)."""
        if self._evaluator is None:
            raise NotImplementedError(
                f"{self._traced.model_name} is in evaluation mode and its {self._mode.sensitive} behaves differently "
                f"there, but this module was built without an evaluation replica (build_module makes one): call "
                f".train(), or build it with autopar.runtime.build.build_module")
        args, kwargs = self._full_call(args, kwargs)
        # The chunk runtime's optimizer writes its chunks, not the parameters' tensors: gather each call.
        return self._evaluator.run(self, args, kwargs, plan=self.plan, device=mesh_device(self.device_mesh),
                                   gather=self._full_values_by_fqn, sensitive=self._mode.sensitive,
                                   always=getattr(self, "gemini", None) is not None)

    def _full_call(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call's arguments with full inputs: under ``local_inputs`` each rank's pieces are
        gathered (every rank calls, the same inputs in the same order), unless every input has
        its whole traced shape (a validation loader's global batches: a piece of a split input
        never has it); otherwise as given."""
        if not self.local_inputs or self._whole_inputs(args, kwargs):
            return args, kwargs
        self.flat_inputs(args, kwargs)  # the pieces' shapes and dtypes, as a training call checks them
        bound = self._signature.bind(*args, **kwargs)
        arguments = dict(bound.arguments)
        var_kw = next((n for n, p in self._signature.parameters.items()
                       if p.kind is inspect.Parameter.VAR_KEYWORD and n in arguments), None)
        spread = arguments.pop(var_kw) if var_kw is not None else {}
        arguments.update(spread)  # named as ``input_leaves`` names them

        def full(path: tuple, value: Any) -> Any:
            spec = self.input_specs.get(keyword_path(path))
            if spec is None or not isinstance(value, torch.Tensor):
                return value
            with torch.no_grad():
                return gather_full(value, spec, self.pmesh)

        gathered = pytree.tree_map_with_path(full, arguments)
        if var_kw is not None:
            bound.arguments[var_kw] = {k: gathered.pop(k) for k in spread}
        bound.arguments.update(gathered)
        return bound.args, bound.kwargs

    def _whole_inputs(self, args: tuple, kwargs: dict) -> bool:
        leaves = input_leaves(self._signature, self._traced.model_name, args, kwargs)
        return all(isinstance(leaves.get(p.fqn), torch.Tensor) and tuple(leaves[p.fqn].shape) == tuple(p.shape)
                   for p in self._inputs)

    def _full_values_by_fqn(self) -> dict[str, torch.Tensor]:
        """Original FQN (every alias) -> full tensor of every parameter and buffer (a collective).
        Through ``full_state_items``, which the chunk runtime replaces (its parameters view working
        copies that exist only while gathered); then the non-persistent buffers."""
        out = collect_full_state(self.full_state_items(), self._state_keys)
        listed = {name for name, *_ in self._state_order()}
        for name, ph, local in self._tensors():
            if name not in listed:
                value = self._full(name, local.detach())
                out.update({alias: value for alias in ph.aliases})
        return out

    def graph_arguments(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The emitted graph's arguments for a call ``forward(*args, **kwargs)``: the inputs and
        the local views of the parameters and buffers, in placeholder order."""
        inputs = iter(self.flat_inputs(args, kwargs))
        return [next(inputs) if name is None else self._argument(name) for name in self._arg_state]

    def _argument(self, name: str) -> torch.Tensor:
        """The local tensor of parameter or buffer ``name`` for the graph: a trained parameter's
        ``LocalLeaf`` under grad mode (made once; remade when the parameter or its local tensor
        was replaced), whose gradient its sole gradient bucket takes, if it has one, or lands in
        the DTensor's ``.grad``."""
        t = self._state(name)
        if not (t.requires_grad and torch.is_grad_enabled()):
            return local_of(t)
        leaf = self._leaves.get(name)
        if leaf is None or not leaf.current(t):
            bucket = self._bucket_of.get(name)
            leaf = self._leaves[name] = LocalLeaf(t)
            if bucket is not None:
                bucketer, slot = bucket
                leaf.sink = functools.partial(bucketer.leaf_arrived, slot, leaf.leaf)
                bucketer.use_leaf(slot, leaf.leaf)
        return leaf.leaf

    def flat_inputs(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The call's tensor inputs in traced order, checked against the traced shapes."""
        leaves = input_leaves(self._signature, self._traced.model_name, args, kwargs)
        values = []
        for p in self._inputs:
            if p.fqn not in leaves:
                raise ValueError(f"input {p.fqn!r} of {self._traced.model_name} is missing; given: {sorted(leaves)}")
            value = leaves[p.fqn]
            want = p.shape
            if self.local_inputs and p.fqn in self.input_specs:
                want = self.input_specs[p.fqn].local_shape(p.shape, self.pmesh.shape)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(want) or value.dtype != p.dtype:
                got = (f"{value.dtype}{list(value.shape)}" if isinstance(value, torch.Tensor)
                       else type(value).__name__)
                raise ValueError(f"input {p.fqn!r}: expected {p.dtype}{list(want)} "
                                 f"({'local piece' if self.local_inputs else 'global value'}), got {got}: the "
                                 f"plan is made for the traced shapes and dtypes; a short last batch: drop it "
                                 f"(DataLoader(drop_last=True)) or pad it, another shape: autoparallelize for it")
            values.append(value)
        return values

    # ------------------------------------------------------------------------ state and grads
    def _state(self, name: str) -> torch.Tensor:
        """The DTensor parameter or buffer of placeholder ``name``.

        Read every step for every parameter (forward's local views, each bucketed gradient's
        delivery): the owning submodule is found once (``get_parameter`` walks the dotted path,
        about 80 us a call under load) and its ``_parameters``/``_buffers`` entry is read each
        time, so a tensor replaced in place (``load_state_dict(assign=True)``, ``.to()``) is seen."""
        found = self._state_at.get(name)
        if found is None:
            owner_path, _, leaf = self._attr_of[name].rpartition(".")
            table = "_parameters" if self._placeholders[name].kind == PARAMETER else "_buffers"
            found = self._state_at[name] = (self.graph_module.get_submodule(owner_path), table, leaf)
        owner, table, leaf = found
        return getattr(owner, table)[leaf]

    def _tensors(self) -> Iterable[tuple[str, Any, torch.Tensor]]:
        """(placeholder name, Placeholder, local tensor) for every parameter and buffer."""
        for name, ph in self._placeholders.items():
            if ph.kind in (PARAMETER, BUFFER) and name in self._specs:
                yield name, ph, local_of(self._state(name))

    def local_specs(self) -> dict[str, TensorSpec]:
        """Canonical FQN -> layout of every parameter and buffer."""
        return {ph.fqn: self._specs[name] for name, ph, _ in self._tensors()}

    # ------------------------------------------------------------------------------- ZeRO
    def optimizer(self, optimizer_class: type, /, params=None, **kwargs: Any):
        """``optimizer_class(params, **kwargs)`` over this module's parameters (``params``: None
        for all, or some of ``self.parameters()`` or param-group dicts of them), the ones the
        plan shards with ZeRO replaced by this device's pieces (``autopar.runtime.zero``). Works
        for every plan (ZeRO or not); required when the plan has ZeRO-2 parameters. A module whose
        parameters are in chunks (``autopar.runtime.gemini``: a plan with offload) gets the chunk
        optimizer (Adam/AdamW) instead."""
        from autopar.runtime.zero import ZeroOptimizer

        if getattr(self, "gemini", None) is not None:
            return self.gemini.module_optimizer(optimizer_class, params, **kwargs)
        return ZeroOptimizer(self, optimizer_class, params, **kwargs)

    def zero_parameters(self) -> list[tuple[str, nn.Parameter, int, TensorSpec]]:
        """(placeholder name, DTensor parameter, ZeRO stage, layout) of every parameter, in plan order."""
        out = []
        for n in self.plan.nodes:
            if n.kind == PARAMETER and n.name in self._specs:
                out.append((n.name, self._state(n.name), n.zero_stage, self._specs[n.name]))
        return out

    def attach_zero(self, optimizer) -> None:
        """Record the ZeRO optimizer whose pieces receive the reduce-scattered gradients."""
        self._zero = optimizer
        pieces = {p.name: p for p in optimizer.pieces}
        scratch = getattr(optimizer, "scratch", None)  # (one for all bucketers: disjoint ranges)
        for m in self.graph_module.modules():
            if isinstance(m, GradBucketer):
                m.deliver_shards_to(lambda name: pieces.get(name), mesh=self.plan.mesh, scratch=scratch)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        parameters: Iterable[torch.Tensor] | None = None) -> torch.Tensor:
        """Clip the gradients of ``parameters`` (default: ``self.parameters()``; the Booster passes
        its optimizer's, ZeRO pieces included) to the global ``norm_type`` norm ``max_norm``; returns
        the norm before clipping as a plain tensor (``autopar.runtime.parallel_module.clip_grad_norm``:
        ``torch.nn.utils.clip_grad_norm_``'s result; DTensor gradients count globally). Every rank
        must call."""
        return clip_grad_norm(self.parameters() if parameters is None else parameters, max_norm, norm_type)

    def parameters_by_fqn(self) -> dict[str, nn.Parameter]:
        """Original FQN -> DTensor parameter, every tied alias included (so an optimizer built
        over the original model can be matched to these parameters by name)."""
        return {alias: self._state(name) for name, ph, _ in self._tensors() if ph.kind == PARAMETER
                for alias in ph.aliases}

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return collect_full_state(self.full_state_items(), self._state_keys)

    def full_placeholder_values(self) -> dict[str, torch.Tensor]:
        """Traced placeholder name -> full tensor of every parameter and buffer, non-persistent
        buffers included (what the traced graph itself runs on). A collective."""
        return {name: self._full(name, local.detach()) for name, _, local in self._tensors()}

    def full_state_entries(self) -> list[tuple[tuple[str, ...], torch.Size, torch.dtype]]:
        """(state-dict names, full shape, dtype) of each parameter and buffer, in state-dict
        order of its first name (tied weights: one entry, several names). No collective."""
        return [(names, ph.shape, local.dtype) for _, names, ph, local in self._state_order()]

    def full_state_items(self) -> Iterator[tuple[tuple[str, ...], torch.Tensor]]:
        """Each parameter and buffer gathered whole, one at a time, in ``full_state_entries``
        order: (its state-dict names, a full tensor the caller owns). Every rank must consume
        all of it (one collective per tensor); only one full tensor needs to be held at a time,
        so a checkpoint writer streams a model larger than one device's memory."""
        for name, names, _, local in self._state_order():
            yield names, self._full(name, local.detach())

    def _state_order(self) -> list[tuple[str, tuple[str, ...], Any, torch.Tensor]]:
        pos = {k: i for i, k in enumerate(self._state_keys)}
        out = []
        for name, ph, local in self._tensors():
            names = tuple(sorted((a for a in ph.aliases if a in pos), key=pos.__getitem__))
            if names:
                out.append((name, names, ph, local))
        return sorted(out, key=lambda item: pos[item[1][0]])

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> None:
        owners = owners_of(self.plan)
        load_full_tensors(((ph, None if name in owners else local, self._specs[name])
                           for name, ph, local in self._tensors()), state_dict,
                          state_keys=self._state_keys, pmesh=self.pmesh, strict=strict)
        for name, ph, local in self._tensors():  # table-wise tables: the owner takes the whole table
            key = next((a for a in ph.aliases if a in state_dict), None)
            if name in owners and key is not None:
                local.copy_(table_wise.cut(state_dict[key], self._specs[name], owners[name], self.pmesh)
                            .to(local.device, local.dtype))

    def _full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The full tensor of placeholder ``name`` from this rank's ``local`` (a collective)."""
        owner = owners_of(self.plan).get(name)
        if owner is None:
            return _snapshot(local, self._specs[name], self.pmesh)
        value = table_wise.gather(local, self._specs[name], owner, self.pmesh, self._placeholders[name].shape)
        same = value.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
        return value.clone() if same else value

    @torch.no_grad()
    def full_gradients(self) -> dict[str, torch.Tensor | None]:
        # A ZeRO-2 parameter's reduce-scattered gradient is its piece's (the bucketer delivers it
        # there); .grad holds only the contributions that were not partial, until the optimizer
        # folds them into the piece: the full gradient is the sum of both.
        pieces = {} if self._zero is None else {p.name: p for p in self._zero.pieces if p.stage == 2}
        out: dict[str, torch.Tensor | None] = {}
        for name, ph, local in self._tensors():
            if ph.kind != PARAMETER:
                continue
            grad = self._state(name).grad
            grad = None if grad is None else self._full(name, local_of(grad))
            piece = pieces.get(name)
            if piece is not None and piece.master.grad is not None:
                shard = piece.master.grad.full_tensor()
                grad = shard if grad is None else grad + shard
            for alias in ph.aliases:
                out[alias] = grad
        return out

    def local_parameter_bytes(self) -> int:
        return sum(local_of(p).numel() * p.element_size() for p in self.parameters())


def _sole_buckets(gm: fx.GraphModule) -> dict[str, tuple[GradBucketer, int]]:
    """Parameter placeholder -> (its gradient bucketer, slot) where that bucket node reading it
    is its only user: the parameter's whole gradient is the slot's."""
    out = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder" or not node.meta.get(STATE_KEY) or len(node.users) != 1:
            continue
        user = next(iter(node.users))
        if user.op == "call_module" and user.args and user.args[0] is node:
            mod = gm.get_submodule(user.target)
            if isinstance(mod, GradBucketer):
                out[node.name] = (mod, user.kwargs["slot"])
    return out


def _has_decision(plan: Plan, name: str) -> bool:
    try:
        plan.node(name)
    except KeyError:
        return False
    return True


def load_full_tensors(entries: Iterable[tuple[Any, torch.Tensor | None, TensorSpec | None]],
                      state_dict: dict[str, torch.Tensor], *, state_keys: Iterable[str], pmesh,
                      strict: bool) -> None:
    """Copy full tensors (original names; a tied weight under any of its names) into local pieces.
    ``entries``: (placeholder, its local tensor or None where this rank holds none, its layout)
    for every parameter and buffer of the model. No collective. ``strict``: every one in the
    state dict's keys must be there, and nothing else."""
    keys = set(state_keys)
    known, missing = set(), []
    for ph, local, spec in entries:
        known.update(ph.aliases)
        key = next((a for a in ph.aliases if a in state_dict), None)
        if key is None:
            if ph.fqn in keys:
                missing.append(ph.fqn)
            continue
        value = state_dict[key]
        if tuple(value.shape) != tuple(ph.shape):
            raise ValueError(f"load_full_state_dict: {key!r} has shape {tuple(value.shape)}, "
                             f"the model's is {tuple(ph.shape)}")
        if local is not None:
            local.copy_(slice_local(value, spec, pmesh).to(local.device, local.dtype))
    unexpected = sorted(set(state_dict) - known)
    if strict and (missing or unexpected):
        raise ValueError(f"load_full_state_dict: missing keys {missing}, unexpected keys {unexpected}")


def collect_full_state(items: Iterable[tuple[tuple[str, ...], torch.Tensor]],
                       state_keys: Iterable[str]) -> dict[str, torch.Tensor]:
    """``full_state_items()`` as a state dict: every name of each tensor (tied aliases), in
    the original ``state_keys`` order."""
    full: dict[str, torch.Tensor] = {}
    for names, value in items:
        for alias in names:
            full[alias] = value
    return {k: full[k] for k in state_keys if k in full}


@torch.no_grad()
def _snapshot(local: torch.Tensor, spec: TensorSpec, pmesh) -> torch.Tensor:
    """The full tensor, never the live shard: a replicated local would otherwise be returned
    itself and change under the caller with the next optimizer step."""
    value = gather_full(local, spec, pmesh)
    same = value.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
    return value.clone() if same else value


# ------------------------------------------------------------------------------ clip_grad_norm_
def clip_grad_norm_(model: ParallelModule, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``model.clip_grad_norm_(max_norm, norm_type)``: clips by the TRUE global norm over every
    rank (as ``torch.nn.utils.clip_grad_norm_`` over the single-device model) and returns it as
    a plain tensor. Every rank must call."""
    if not isinstance(model, ParallelModule):
        raise ValueError(f"clip_grad_norm_ needs an AutoParallelModule (or another parallel module), "
                         f"got {type(model).__name__}")
    return model.clip_grad_norm_(max_norm, norm_type)


def input_leaves(signature: inspect.Signature, model_name: str, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments bound to ``signature`` and flattened: input FQN (as the trace names
    placeholders) -> value. ``ValueError`` when they do not bind."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as err:
        raise ValueError(f"inputs do not fit {model_name}.forward{signature}: {err}") from None
    arguments = dict(bound.arguments)
    for name, param in signature.parameters.items():
        # ``forward(self, **inputs)``: the trace names those inputs by their keys, not under ``inputs``
        if param.kind is inspect.Parameter.VAR_KEYWORD and name in arguments:
            arguments.update(arguments.pop(name))
    return {keyword_path(path): v for path, v in pytree.tree_flatten_with_path(arguments)[0]}
