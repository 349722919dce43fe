"""A plan proves itself: the emitted module against the all-replicated run, one step each.

``verify_module(module, inputs)`` runs one forward and backward of an ``AutoParallelModule``
and one of the all-replicated plan -- the traced graph itself on full tensors, computed whole on
every rank -- on the same weights (the module's own, gathered) and the same inputs, and compares
the loss and every parameter gradient under a dtype-aware tolerance (``tolerance``). The module
is left as it was: its buffers (batch-norm statistics) and ``.grad`` are restored.

On a mismatch it runs both again recording every traced node (``_Recorder``): the module's
local values are gathered to full tensors under the plan's layout of each value (a ``P`` value
summed, its gradient replicated: the runtime's gradient-layout invariant), the reference's are
kept whole, and ``PlanVerificationError`` names the first node in execution order whose VALUE
differs, or -- when every value agrees -- the gradient that diverges first in backward order
(the latest such node in forward order: the op that computed it is one of its consumers).
Nodes inside recompute regions are recorded too: the region's body is interpreted under the
same non-reentrant checkpoint the runtime uses, so the backward replays it as in training.

Every rank must call (collectives); every rank reaches the same verdict (the reference is
computed identically everywhere and the mismatch flag is all-reduced), so all raise or none.
"""

from __future__ import annotations

import contextlib
import math
import operator
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.utils.checkpoint import checkpoint

from autopar.layout.placement import Partial, Replicate, TensorSpec
from autopar.runtime.collectives import gather_full
from autopar.runtime.dtensors import local_of
from autopar.runtime.passes import TRACED_NAME_KEY
from autopar.runtime.recompute import CheckpointRegion, redrawing
from autopar.strategies import rng
from autopar.strategies.check import run_whole, whole_kernel
from autopar.strategies.registry import OpInfo, bind
from autopar.tracer.graph import BUFFER, INPUT, MODULE_KEY, PARAMETER
from autopar.tracer.precision import compute_dtype

__all__ = ["PlanVerificationError", "Divergence", "VerifyReport", "verify_module", "verify_inputs", "tolerance"]

# rtol per compute dtype: fp32 sums in a different order on shards (a few ulps per op, grown over
# a deep graph); half types carry 8 (bf16) or 11 (fp16) mantissa bits.
_RTOL = {torch.float64: 1e-7, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


def tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance for values computed in ``dtype`` (exact for integers and booleans)."""
    return _RTOL.get(dtype, 0.0) if dtype.is_floating_point else 0.0


@dataclass(frozen=True)
class Divergence:
    """The first traced node whose value (or gradient) differs from the all-replicated run."""

    node: str
    what: str  # "value" | "gradient"
    op: str
    module: str
    strategy: str
    input_specs: tuple[str | None, ...]
    output_specs: tuple[str | None, ...]
    error: float  # max |got - want|
    scale: float  # max |want|
    consumers: tuple[str, ...] = ()  # for a gradient: the ops whose backward produced it

    def __str__(self) -> str:
        where = f" (module {self.module})" if self.module else ""
        text = (f"the {self.what} of node {self.node!r} [{self.op}]{where} diverges first: max abs error "
                f"{self.error:.3g} against max |reference| {self.scale:.3g}; strategy {self.strategy!r}, "
                f"inputs {list(self.input_specs)} -> outputs {list(self.output_specs)}")
        if self.consumers:
            text += f"; its gradient comes from the backward of {', '.join(self.consumers)}"
        return text


class PlanVerificationError(ValueError):
    """The plan's module does not compute what the model computes (see ``verify_module``)."""

    def __init__(self, message: str, *, mismatches: tuple[str, ...], divergence: Divergence | None) -> None:
        super().__init__(message)
        self.mismatches = mismatches
        self.divergence = divergence


@dataclass(frozen=True)
class VerifyReport:
    """What a passing check compared."""

    loss: float
    reference_loss: float
    gradients: int  # parameter gradients compared
    max_error: float  # the largest error relative to its tensor's tolerance scale (<= 1 passes)
    seconds: float
    mismatches: tuple[str, ...] = field(default=())

    def __str__(self) -> str:
        return (f"verified: loss {self.loss:.6g} (all-replicated {self.reference_loss:.6g}), {self.gradients} "
                f"gradients, worst error {self.max_error:.2g} of tolerance, {self.seconds:.1f}s")


# A tensor's errors are also allowed this fraction of rtol times the largest magnitude among all
# tensors of its kind (all parameter gradients, say): a gradient that is zero in exact arithmetic
# (a bias whose effect a softmax cancels) is rounding noise at 1e-10 whatever the plan.
_GLOBAL_FLOOR = 1e-3


def _floor(tensors, rtol: float) -> float:
    scales = [float(t.detach().double().abs().nan_to_num(0.0, 0.0, 0.0).max()) for t in tensors
              if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
    return _GLOBAL_FLOOR * rtol * max(scales, default=0.0)


def _error(got: torch.Tensor, want: torch.Tensor, rtol: float, floor: float = 0.0) -> tuple[float, float, float]:
    """(max abs error, max |want|, error / tolerance): within tolerance when the last is <= 1.

    The tolerance of an element is ``rtol * (|want| + max |want|) + floor``: relative where values
    are large, scaled by the tensor's magnitude where they cancel to near zero, and never below
    ``floor`` (``_floor``: rounding noise of a value that is zero in exact arithmetic)."""
    if tuple(got.shape) != tuple(want.shape):
        return math.inf, math.inf, math.inf
    if not want.is_floating_point():
        bad = not torch.equal(got.to(want.dtype), want)
        return float(bad), 1.0, math.inf if bad else 0.0
    g, w = got.detach().double(), want.detach().double()
    finite = torch.isfinite(w)
    if not torch.equal(finite, torch.isfinite(g)) or not torch.equal(g[~finite], w[~finite]):
        return math.inf, math.inf, math.inf  # a NaN/inf where the reference has none, or elsewhere
    if not bool(finite.any()):
        return 0.0, 0.0, 0.0
    diff = (g - w)[finite].abs()
    scale = float(w[finite].abs().max())
    bound = rtol * (w[finite].abs() + scale) + floor + 1e-30
    return float(diff.max()), scale, float((diff / bound).max()) if rtol > 0 else float(diff.max() > 0) * math.inf


def verify_module(module, inputs: tuple | dict, *, rtol: float | None = None) -> VerifyReport:
    """Check ``module`` (an ``AutoParallelModule``) on ``inputs`` (the full batch, as ``forward``
    takes it); ``PlanVerificationError`` on a mismatch. ``rtol``: None for ``tolerance`` of the
    plan's compute dtype. Every rank must call."""
    from autopar.runtime.module import AutoParallelModule

    if not isinstance(module, AutoParallelModule):
        raise NotImplementedError(f"verify checks an AutoParallelModule; got a {type(module).__name__} "
                                  f"(pipelined and offloaded modules are not verified yet)")
    if getattr(module, "gemini", None) is not None:
        raise NotImplementedError("verify: plans that offload parameters or optimizer state (the chunk runtime) "
                                  "are not verified yet; verify the plan with offload='none'")
    if module._zero2:
        raise NotImplementedError(
            f"verify: the plan shards the gradients of {len(module._zero2)} parameters (ZeRO-2), whose .grad then "
            f"holds only this rank's piece; verify the same plan with zero_stage=0 or 1 (same layouts)")
    traced = module._traced
    if module.local_inputs:
        raise ValueError("verify runs the full batch: build the module with local_inputs=False to verify it")
    if traced.loss_node is None:
        raise ValueError(f"{traced.model_name} returns no scalar loss: verify compares one forward and backward "
                         f"of the loss (pass labels, or wrap the model so that it returns its loss)")
    # Random draws (dropout ...) are functions of the draw and each element's global index
    # (``strategies/rng.py``): both runs make the SAME draw, so they draw the same numbers.
    draw = rng.next_draw(advance=False) if rng.graph_draws(traced.gm.graph) else None
    rtol = tolerance(compute_dtype(module.plan.precision)) if rtol is None else rtol
    args, kwargs = (inputs, {}) if isinstance(inputs, (tuple, list)) else ((), dict(inputs))
    started = time.perf_counter()
    with _restored(module):
        full_state = module.full_placeholder_values()
        ref = _Run.reference(module, full_state, args, kwargs, record=False, draw=draw)
        got = _Run.planned(module, args, kwargs, record=False, draw=draw)
        mismatches, worst = _compare_ends(got, ref, rtol)
        flag = torch.tensor([1.0 if mismatches else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() == 0:
            return VerifyReport(float(got.loss), float(ref.loss), len(ref.grads), worst,
                                time.perf_counter() - started)
        ref = _Run.reference(module, full_state, args, kwargs, record=True, draw=draw)
        got = _Run.planned(module, args, kwargs, record=True, draw=draw)
        divergence = _first_divergence(module, got, ref, rtol)
    shown = "; ".join(mismatches[:6]) + (f"; ... ({len(mismatches)} in all)" if len(mismatches) > 6 else "")
    where = str(divergence) if divergence is not None else "no single node was found to diverge"
    raise PlanVerificationError(
        f"the plan for {traced.model_name} on mesh {module.plan.mesh.shape} does not match the all-replicated run: "
        f"{shown or 'the ranks disagree'}. {where}", mismatches=tuple(mismatches), divergence=divergence)


def _drawing(draw: rng.Draw | None):
    return rng.drawing(draw) if draw is not None else contextlib.nullcontext()


class _restored:
    """Leaves the module's buffers and gradients as they were before the check."""

    def __init__(self, module) -> None:
        self.module = module

    def __enter__(self) -> None:
        self.buffers = [(b, local_of(b).clone()) for b in self.module.buffers()]
        self.grads = [(p, p.grad) for p in self.module.parameters()]
        for p in self.module.parameters():
            p.grad = None

    def __exit__(self, *exc: Any) -> None:
        with torch.no_grad():
            for b, saved in self.buffers:
                local_of(b).copy_(saved)
        for p, grad in self.grads:
            p.grad = grad


@dataclass
class _Run:
    """One forward and backward: the loss, the parameter gradients by FQN and, when recorded,
    every traced node's value and output gradient (full tensors)."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None]
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    out_grads: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def reference(cls, module, full_state: dict, args: tuple, kwargs: dict, *, record: bool,
                  draw: rng.Draw | None = None) -> "_Run":
        """The all-replicated run: the traced graph on full tensors (the module's weights, gathered)."""
        traced = module._traced
        inputs = iter(module.flat_inputs(args, kwargs))
        values, params = [], []
        for ph in traced.placeholders:
            if ph.kind in (PARAMETER, BUFFER):
                value = full_state[ph.name].clone()
                if ph.kind == PARAMETER and value.is_floating_point():
                    params.append((ph, value.requires_grad_(True)))
                values.append(value)
            elif ph.kind == INPUT:
                values.append(next(inputs))
            else:  # a lifted constant or a non-tensor input: its traced value
                values.append(traced.constants.get(ph.fqn, traced.node(ph.name).meta.get("val")))
        recorder = _Recorder(traced.gm, record=record, key=lambda n: n.name, whole=True)
        with _drawing(draw):
            loss = _loss_of(traced, recorder.run(*values))
            loss.backward()
        grads = {alias: value.grad for ph, value in params for alias in ph.aliases}
        return cls(loss.detach(), grads, recorder.values, recorder.grads)

    @classmethod
    def planned(cls, module, args: tuple, kwargs: dict, *, record: bool, draw: rng.Draw | None = None) -> "_Run":
        values = module.graph_arguments(args, kwargs)
        recorder = _Recorder(module.graph_module, record=record, key=lambda n: n.meta.get(TRACED_NAME_KEY))
        with _drawing(draw):
            flat = recorder.run(*values)
            loss = _loss_of(module._traced, flat)
            loss.backward()
        grads = module.full_gradients()
        for p in module.parameters():
            p.grad = None
        full_values = {k: _gather(module, k, v, gradient=False) for k, v in recorder.values.items()}
        full_grads = {k: _gather(module, k, v, gradient=True) for k, v in recorder.grads.items()}
        return cls(loss.detach(), grads, full_values, full_grads)


def _loss_of(traced, flat: Any) -> torch.Tensor:
    outputs = traced.flat_outputs
    loss_name = traced.loss_node.name
    k = next(i for i, n in enumerate(outputs) if isinstance(n, fx.Node) and n.name == loss_name)
    return list(flat)[k]


class _Recorder(fx.Interpreter):
    """Runs a graph module, recording (when asked) each traced node's output and, through a hook,
    its gradient; ``key(node)`` is the traced name a node stands for (None: not recorded).
    Recompute regions run their body through this recorder under the runtime's checkpoint."""

    def __init__(self, gm: fx.GraphModule, *, record: bool, key: Callable[[fx.Node], str | None],
                 sink: "_Recorder | None" = None, whole: bool = False) -> None:
        super().__init__(gm)
        self.record, self.key = record, key
        # The traced graph's calls whose every strategy runs a kernel (random draws): the
        # reference runs that kernel on whole tensors, as mesh (1,) does (``check.run_whole``).
        self.whole: dict[fx.Node, str] = {}
        if whole:
            for n in gm.graph.nodes:
                if n.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()):
                    name = whole_kernel(n.target, OpInfo.from_node(n))
                    if name is not None:
                        self.whole[n] = name
        self.values: dict[str, torch.Tensor] = {} if sink is None else sink.values
        self.grads: dict[str, torch.Tensor] = {} if sink is None else sink.grads

    def run_node(self, n: fx.Node) -> Any:
        if n in self.whole:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            out = run_whole(self.whole[n], OpInfo.from_node(n), bind(n.target, args, kwargs))
        else:
            out = super().run_node(n)
        name = self.key(n)
        if self.record and name is not None and n.op not in ("output", "placeholder") \
                and isinstance(out, torch.Tensor) and name not in self.values:
            self.values[name] = out.detach().clone()
            if out.requires_grad:
                out.register_hook(lambda g, name=name: None if g is None else
                                  self.grads.__setitem__(name, g.detach().clone()))
        return out

    def call_module(self, target: str, args: tuple, kwargs: dict) -> Any:
        mod = self.fetch_attr(target)
        if not isinstance(mod, CheckpointRegion) or not torch.is_grad_enabled():
            return super().call_module(target, args, kwargs)
        first = [True]

        def body(*inner: Any) -> Any:
            # The backward replays the body: record only its first (forward) run.
            rec = _Recorder(mod.body, record=self.record and first[0], key=self.key, sink=self)
            first[0] = False
            return rec.run(*inner)

        return checkpoint(redrawing(body), *args, use_reentrant=False, preserve_rng_state=True)


def _value_spec(module, name: str) -> TensorSpec | None:
    """The plan's layout of traced value ``name`` (a ``getitem`` reads its producer's k-th)."""
    traced, plan = module._traced, module.plan
    node = traced.node(name)
    k = 0
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        node, k = node.args[0], node.args[1]
    try:
        specs = plan.node(node.name).output_specs
    except KeyError:
        return None
    return TensorSpec.parse(specs[k]) if k < len(specs) and specs[k] else None


def _gather(module, name: str, local: torch.Tensor, *, gradient: bool) -> torch.Tensor | None:
    spec = _value_spec(module, name)
    if spec is None:
        return None
    if gradient:  # the gradient of a partial value is replicated (collectives' invariant)
        spec = TensorSpec(tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements))
    is_bool = local.dtype == torch.bool
    with torch.no_grad():
        full = gather_full(local.to(torch.uint8) if is_bool else local, spec, module.pmesh)
    return full.bool() if is_bool else full


def _compare_ends(got: _Run, ref: _Run, rtol: float) -> tuple[list[str], float]:
    """The loss and every parameter gradient: (mismatch lines, worst error / tolerance)."""
    mismatches, worst = [], 0.0
    pairs = [("loss", got.loss, ref.loss)] + [(f"grad {k}", got.grads.get(k), w) for k, w in ref.grads.items()]
    floor = _floor(ref.grads.values(), rtol)
    for what, g, w in pairs:
        if w is None:
            if g is not None and bool(g.abs().max() > 0):
                mismatches.append(f"{what} should be None (unused) but is nonzero")
            continue
        if g is None:
            mismatches.append(f"{what} is missing")
            continue
        err, scale, ratio = _error(g, w, rtol, 0.0 if what == "loss" else floor)
        worst = max(worst, ratio)
        if ratio > 1:
            mismatches.append(f"{what} differs by {err:.3g} (max |reference| {scale:.3g})")
    return mismatches, worst


def _first_divergence(module, got: _Run, ref: _Run, rtol: float) -> Divergence | None:
    order = [n.name for n in module._traced.nodes]
    floor = _floor(ref.values.values(), rtol)
    for name in order:
        if name in got.values and name in ref.values and got.values[name] is not None:
            err, scale, ratio = _error(got.values[name], ref.values[name], rtol, floor)
            if ratio > 1:
                return _divergence(module, name, "value", err, scale)
    floor = _floor(ref.out_grads.values(), rtol)
    for name in reversed(order):
        if name in got.out_grads and name in ref.out_grads and got.out_grads[name] is not None:
            err, scale, ratio = _error(got.out_grads[name], ref.out_grads[name], rtol, floor)
            if ratio > 1:
                return _divergence(module, name, "gradient", err, scale)
    return None


def _divergence(module, name: str, what: str, err: float, scale: float) -> Divergence:
    node = module._traced.node(name)
    try:
        decision = module.plan.node(name)
        strategy, ins, outs = decision.strategy, decision.input_specs, decision.output_specs
    except KeyError:
        strategy, ins, outs = "(no decision)", (), ()
    consumers = ()
    if what == "gradient":
        consumers = tuple(f"{u.name} [{_op(u)}: {_strategy_of(module, u.name)}]" for u in node.users)
    return Divergence(name, what, _op(node), node.meta.get(MODULE_KEY, "") or "", strategy, tuple(ins),
                      tuple(outs), err, scale, consumers)


def _op(node: fx.Node) -> str:
    return str(node.target) if node.op == "call_function" else node.op


def _strategy_of(module, name: str) -> str:
    try:
        return module.plan.node(name).strategy
    except KeyError:
        return "-"


# --------------------------------------------------------------------------- example inputs
_INDEX_OPS = {"aten.embedding.default": (1, 0, 0), "aten.cross_entropy_loss.default": (1, 0, 1),
              "aten.nll_loss.default": (1, 0, 1), "aten.nll_loss_forward.default": (1, 0, 1),
              "aten.one_hot.default": (0, None, None), "aten._embedding_bag.default": (1, 0, 0)}


def verify_inputs(traced, inputs: Any, *, seed: int = 0) -> Any:
    """``inputs`` with every tensor that holds no values (on ``meta``, or fake) replaced by one
    that does: floats standard normal; integer and boolean inputs in the range the graph reads
    them in -- an embedding's rows, a loss's classes -- or ones (attention masks: attend to all).
    ``ValueError`` for anything but a tuple or dict of inputs. Same ``seed``, same values."""
    import torch.utils._pytree as pytree

    if inputs is True or not isinstance(inputs, (tuple, list, dict)):
        raise ValueError(f"verify= takes True or the inputs to check on (a tuple or dict), got {type(inputs).__name__}")
    generator = torch.Generator().manual_seed(seed)
    bounds = _index_bounds(traced)
    flat, spec = pytree.tree_flatten_with_path(inputs if isinstance(inputs, dict) else tuple(inputs))
    names = [p.fqn for p in traced.inputs]
    out = []
    for k, (path, leaf) in enumerate(flat):
        if isinstance(leaf, torch.Tensor) and (leaf.is_meta or _is_fake(leaf)):
            key = _leaf_name(path, names, k, isinstance(inputs, dict))
            leaf = _example(leaf, bounds.get(key), generator)
        out.append(leaf)
    made = pytree.tree_unflatten(out, spec)
    return made if isinstance(inputs, dict) else tuple(made)


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _leaf_name(path, names: list[str], k: int, keyed: bool) -> str:
    from autopar.tracer.graph import keyword_path

    return keyword_path(path) if keyed else (names[k] if k < len(names) else "")


def _example(like: torch.Tensor, bound: int | None, generator: torch.Generator) -> torch.Tensor:
    shape = tuple(like.shape)
    if like.dtype.is_floating_point or like.dtype.is_complex:
        return torch.randn(shape, generator=generator).to(like.dtype)
    if like.dtype == torch.bool or bound is None:
        return torch.ones(shape, dtype=like.dtype)
    return torch.randint(0, max(bound, 1), shape, generator=generator).to(like.dtype)


def _index_bounds(traced) -> dict[str, int]:
    """Input FQN -> the exclusive upper bound of the values the graph indexes with it."""
    inputs = {p.name: p.fqn for p in traced.inputs}
    bounds: dict[str, int] = {}
    for node in traced.compute_nodes():
        entry = _INDEX_OPS.get(str(node.target))
        if entry is None:
            continue
        index_arg, table_arg, table_dim = entry
        source = _source_input(node.args[index_arg] if len(node.args) > index_arg else None, inputs)
        if source is None:
            continue
        if table_arg is None:
            bound = node.args[1] if len(node.args) > 1 and isinstance(node.args[1], int) and node.args[1] > 0 else None
        else:
            table = node.args[table_arg].meta.get("val")
            bound = int(table.shape[table_dim]) if table is not None and table.dim() > table_dim else None
        if bound is not None:
            bounds[source] = min(bounds.get(source, bound), bound)
    return bounds


def _source_input(value: Any, inputs: dict[str, str]) -> str | None:
    """The user input an index tensor is (through views and casts), or None."""
    while isinstance(value, fx.Node):
        if value.op == "placeholder":
            return inputs.get(value.name)
        tensors = [a for a in value.all_input_nodes]
        if value.op != "call_function" or len(tensors) != 1:
            return None
        value = tensors[0]
    return None
