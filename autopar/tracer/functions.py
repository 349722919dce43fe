"""Custom ``torch.autograd.Function`` classes: traced as ONE op that trains with their own backward.

torch.export (non-strict) would trace a Function's ``forward`` into the graph and drop its
``backward``; training would then differentiate the traced forward. Where the backward is
deliberately not the forward's derivative -- YOSO's ``YosoCumulation`` (an approximate gradient),
RecurrentGemma's ``SqrtBoundDerivative`` (a gradient clipped near zero), straight-through
estimators, gradient reversal -- that is a silently wrong gradient. Whether a backward "is" the
derivative cannot be decided numerically (``SqrtBoundDerivative`` differs only near 0), so no
Function is ever inlined. While tracing (``custom_functions``), every user Function's ``apply``
(a class outside ``torch.`` and ``autopar.``) becomes one call of::

    autopar::autograd_function(str key, Tensor[] tensors) -> Tensor[]

The call's arguments are flattened with pytree: the tensors are the op's list, everything else
(the class, the non-tensor leaves, the tree structure) is a ``FunctionCall`` in a process-wide
registry under ``key`` -- the class's module, qualname and source line plus a digest of the
non-tensor leaves, the structure and the tensors' shapes and dtypes, so the same call in repeated
blocks shares one key (``unroll`` expands them) and every rank computes the same key.

- forward (real kernel, fake kernel): the Function's ``apply`` under ``no_grad``. Outputs are
  flattened the same way (``OutputLayout``: tensors are the op's outputs; ``None`` and other
  constants are put back by the interception); an output aliasing an input or another output is
  cloned (a custom op cannot return aliases).
- backward: exactly the Function's own: the op saves its inputs and its backward runs ``apply``
  again on detached copies under ``enable_grad``, then ``torch.autograd.grad`` with the incoming
  gradients (``None`` for non-float inputs and unused ones), like ``torch.utils.checkpoint``.
- random draws (an op tagged ``nondeterministic_seeded`` in its forward or its backward, seen on
  the fake inputs: ``OutputLayout.draws``; SEW-D's ``XDropout``): the call runs on its own
  stream of torch's generator, forked and seeded with the call's ``seed`` (``seeded``): the
  forward draws from it and the backward reseeds it, so the recompute draws the forward's numbers
  exactly and the Function's own backward continues that stream. The seed comes from the runtime
  kernel (``function_seed``; ``autopar.strategies._functions``: the key of autopar's draw and the
  traced node, ``autopar/strategies/rng.py``, so every rank and mesh ``(1,)`` draw alike and a
  recomputed region redraws the same); a graph run by hand, with no seed set, takes one from
  torch's generator. Such a call is only ever replicated (each rank draws the whole tensor) and is
  never cut into pipeline micro-batches (``tracer.microbatch``): torch's generator draws by
  position in the drawn tensor, and a shard or micro-batch would draw the whole one's first numbers.
  Draws outside torch (Python's ``random``, numpy) are not seen and would differ in the recompute.
- refused (``FunctionRefused``, a ``NotImplementedError`` naming the class): one that writes its
  inputs in place (``ctx.mark_dirty``; the op is functional), a non-tensor argument or output
  other than a Python constant (its identity would differ across ranks; a ``torch.Generator``
  argument among them). An output computed from tensor values as a Python number, or a draw
  whose size is, fails on fake tensors already.
- cost: the forward's FLOPs are counted once per key with ``FlopCounterMode`` on the fake inputs
  (``register_flop_formula``); the backward's ops are counted as they run (the recompute and the
  Function's backward).

Sharding: ``autopar.strategies._functions`` (replicated always; sharded alike when structurally
elementwise, ``autopar.tracer.function_graphs``, and drawing nothing).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import threading
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula

__all__ = ["FunctionCall", "OutputLayout", "autograd_function", "custom_functions", "function_call",
           "call_function", "function_outputs", "function_draws", "function_seed", "seeded", "register_call",
           "unaliased", "FunctionRefused", "refused_function"]

# Functions of these packages are their own machinery (torch's checkpoint, autopar's collectives).
_OWN = ("torch.", "autopar.")
_ORIGINAL_APPLY = torch.autograd.Function.__dict__["apply"]
# Non-tensor leaves a call may carry: their repr is the same on every rank.
_CONSTANTS = (int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.layout,
              torch.memory_format, torch.Size, type(Ellipsis), slice)
_inside = threading.local()  # depth of autopar's own calls of Functions (not intercepted)


@dataclass(frozen=True)
class FunctionCall:
    """One kind of call of a user Function: what the op's ``key`` stands for."""

    key: str
    cls: type
    in_spec: pytree.TreeSpec  # of (args, kwargs)
    leaves: tuple  # every leaf, tensors as None (their place is taken from the op's list)
    tensor_at: tuple[int, ...]  # positions of the tensor leaves, in the op's list order
    shapes: tuple[tuple[int, ...], ...]  # of the traced tensors, in list order
    dtypes: tuple[torch.dtype, ...]

    @property
    def name(self) -> str:
        return f"{self.cls.__module__}.{self.cls.__qualname__}"

    def arguments(self, tensors) -> tuple[tuple, dict]:
        leaves = list(self.leaves)
        for position, tensor in zip(self.tensor_at, tensors, strict=True):
            leaves[position] = tensor
        return pytree.tree_unflatten(leaves, self.in_spec)


@dataclass(frozen=True)
class OutputLayout:
    """How the op's tensor list becomes the Function's output again."""

    spec: pytree.TreeSpec
    leaves: tuple  # constants, tensors as None
    tensor_at: tuple[int, ...]
    flops: int  # of the forward at the key's shapes
    draws: tuple[str, ...] = ()  # the random ops its forward and backward draw with (module docstring)

    def rebuild(self, tensors) -> Any:
        leaves = list(self.leaves)
        for position, tensor in zip(self.tensor_at, tensors, strict=True):
            leaves[position] = tensor
        return pytree.tree_unflatten(leaves, self.spec)


class FunctionRefused(NotImplementedError):
    """A user Function autopar cannot run as one op; the message names the class and why."""


def refused_function(err: BaseException) -> bool:
    """``err`` is, or was raised from, a ``FunctionRefused`` (export wraps it)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, FunctionRefused):
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


_CALLS: dict[str, FunctionCall] = {}
_OUTPUTS: dict[str, OutputLayout] = {}


def function_call(key: str) -> FunctionCall:
    """The registry entry of ``key`` (set when the Function's call was traced in this process)."""
    try:
        return _CALLS[key]
    except KeyError:
        raise KeyError(f"autopar::autograd_function key {key!r} is unknown in this process: the model "
                       f"applying that autograd.Function must be traced here first (autopar.tracer.trace "
                       f"registers each call)") from None


def function_draws(key: str) -> bool:
    """Whether the call ``key`` draws random numbers (False until it has run on fake tensors)."""
    layout = _OUTPUTS.get(key)
    return layout is not None and bool(layout.draws)


def function_outputs(key: str) -> OutputLayout:
    if key not in _OUTPUTS:
        raise KeyError(f"autopar::autograd_function key {key!r} has not run on fake tensors yet")
    return _OUTPUTS[key]


@contextlib.contextmanager
def _own_calls() -> Iterator[None]:
    _inside.depth = getattr(_inside, "depth", 0) + 1
    try:
        yield
    finally:
        _inside.depth -= 1


def _apply(call: FunctionCall, tensors) -> Any:
    args, kwargs = call.arguments(tensors)
    with _own_calls():
        return _ORIGINAL_APPLY.__func__(call.cls, *args, **kwargs)


def call_function(call: FunctionCall, tensors) -> list[torch.Tensor]:
    """The Function's ``apply`` on ``tensors`` (the op's list order); its output's tensor leaves."""
    return [leaf for leaf in pytree.tree_leaves(_apply(call, tensors)) if isinstance(leaf, torch.Tensor)]


# ---- registration at trace time ---------------------------------------------------------------
def register_call(cls: type, args: tuple, kwargs: dict) -> tuple[FunctionCall, list[torch.Tensor]]:
    """The registry entry of ``cls.apply(*args, **kwargs)`` and the op's tensor list."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    name = f"{cls.__module__}.{cls.__qualname__}"
    tensor_at, constants = [], []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            tensor_at.append(i)
        elif isinstance(leaf, _CONSTANTS):
            constants.append(leaf)
        else:
            raise FunctionRefused(
                f"autograd.Function {name}: argument leaf {i} is a {type(leaf).__name__}; autopar traces a "
                f"custom Function as one op whose non-tensor arguments must be Python constants (numbers, "
                f"strings, dtypes, None, in tuples/lists/dicts) so every rank keys it alike: pass tensors "
                f"and constants instead")
    tensors = [leaves[i] for i in tensor_at]
    shapes = tuple(tuple(int(s) for s in t.shape) for t in tensors)
    dtypes = tuple(t.dtype for t in tensors)
    digest = hashlib.sha1(repr((str(spec), [repr(c) for c in constants], shapes, dtypes)).encode()).hexdigest()
    key = f"{name}:{_source_line(cls)}:{digest[:16]}"
    call = FunctionCall(key, cls, spec, tuple(None if i in tensor_at else leaf for i, leaf in enumerate(leaves)),
                        tuple(tensor_at), shapes, dtypes)
    _CALLS[key] = call  # a class defined again (same code, same place) replaces its namesake
    return call, tensors


@functools.lru_cache(maxsize=None)
def _source_line(cls: type) -> int:
    try:
        return inspect.getsourcelines(cls.forward)[1]
    except (OSError, TypeError):
        return cls.forward.__code__.co_firstlineno if hasattr(cls.forward, "__code__") else 0


@contextlib.contextmanager
def custom_functions() -> Iterator[list[str]]:
    """While active, every user ``autograd.Function``'s ``apply`` runs as one
    ``autopar::autograd_function`` op (module docstring); the qualified names of the classes met
    (each once, in call order) are appended to the yielded list."""
    met: list[str] = []

    def apply(cls, *args, **kwargs):
        if cls.__module__.startswith(_OWN) or getattr(_inside, "depth", 0):
            return _ORIGINAL_APPLY.__func__(cls, *args, **kwargs)
        call, tensors = register_call(cls, args, kwargs)
        if call.name not in met:
            met.append(call.name)
        outs = autograd_function(call.key, tensors)
        return function_outputs(call.key).rebuild(outs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield met
    finally:
        torch.autograd.Function.apply = _ORIGINAL_APPLY


# ---- the op -------------------------------------------------------------------------------------
class _Watch(TorchDispatchMode):
    """Notes the random ops a Function draws with (on fake tensors: what runs is unchanged)."""

    def __init__(self) -> None:
        super().__init__()
        self.drawn: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()) and str(func) not in self.drawn:
            self.drawn.append(str(func))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def function_seed(seed: int) -> Iterator[None]:
    """``autograd_function`` calls of Functions that draw, on this thread while active, draw from a
    stream seeded with ``seed`` (the runtime kernel wraps ONE call: every rank passes the same
    seed; module docstring)."""
    previous = getattr(_inside, "seed", None)
    _inside.seed = int(seed)
    try:
        yield
    finally:
        _inside.seed = previous


@contextlib.contextmanager
def seeded(seed: int, tensors) -> Iterator[None]:
    """torch's generator forked and seeded with ``seed`` -- the CPU one and those of the CUDA
    devices of ``tensors`` and the current one -- and restored after (the caller's stream is
    left as it was: a Function's draws take nothing from it)."""
    cuda = {t.device.index for t in tensors if t.device.type == "cuda"}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda.add(torch.cuda.current_device())
    with torch.random.fork_rng(devices=sorted(cuda), device_type="cuda"):
        torch.default_generator.manual_seed(seed)
        for index in cuda:
            torch.cuda.default_generators[index].manual_seed(seed)
        yield


def _call_seed() -> int:
    """The seed of the call starting now: the kernel's (``function_seed``), else one drawn from
    torch's generator (a traced graph run by hand draws like eager code, still exactly recomputed)."""
    seed = getattr(_inside, "seed", None)
    if seed is None:
        seed = int(torch.empty((), dtype=torch.int64).random_())
    return seed


def _forward(key: str, tensors: list[torch.Tensor], *, fake: bool) -> list[torch.Tensor]:
    call = function_call(key)
    versions = [t._version for t in tensors]
    _inside.last_seed = None  # a fake run's backward draws nothing real
    with torch.no_grad():
        if fake:
            with _Watch() as watch, FlopCounterMode(display=False) as counter:
                out = _apply(call, tensors)
        elif function_draws(key):
            _inside.last_seed = seed = _call_seed()  # for ``_setup_context``, which runs next
            with seeded(seed, tensors):
                out = _apply(call, tensors)
        else:
            out = _apply(call, tensors)
    if [t._version for t in tensors] != versions:
        raise FunctionRefused(
            f"autograd.Function {call.name} writes its inputs in place (ctx.mark_dirty): autopar traces a custom "
            f"Function as one functional op; return a new tensor instead")
    if fake and call.key not in _OUTPUTS:  # the key's first run: its layout, and a look at its backward
        _record_outputs(call, out, counter.get_total_flops(), tuple(watch.drawn) + _backward_draws(call, tensors))
    outs = [leaf for leaf in pytree.tree_leaves(out) if isinstance(leaf, torch.Tensor)]
    return unaliased(outs, tensors)


def _backward_draws(call: FunctionCall, tensors: list[torch.Tensor]) -> tuple[str, ...]:
    """The random ops the Function's backward draws with, run once on the fake inputs."""
    with torch.enable_grad(), _Watch() as watch:
        xs = [t.detach().requires_grad_(t.is_floating_point() or t.is_complex()) for t in tensors]
        outs = [o for o in call_function(call, xs) if o.requires_grad]
        wrt = [x for x in xs if x.requires_grad]
        if outs and wrt:
            torch.autograd.grad(outs, wrt, [torch.zeros_like(o) for o in outs], allow_unused=True)
    return tuple(watch.drawn)


def unaliased(outs: list[torch.Tensor], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Outputs that share memory with an input or an earlier output, cloned (custom ops return
    fresh tensors)."""
    fresh: list[torch.Tensor] = []
    for out in outs:
        if any(torch._C._is_alias_of(out, other) for other in (*tensors, *fresh)):
            out = out.clone()
        fresh.append(out)
    return fresh


def _record_outputs(call: FunctionCall, out: Any, flops: int, draws: tuple[str, ...]) -> None:
    """The output layout and FLOPs of the key, from its first run on fake tensors (later runs --
    the precision pass's, the planner's -- are the same call at other dtypes)."""
    if call.key in _OUTPUTS:
        return
    leaves, spec = pytree.tree_flatten(out)
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, (torch.Tensor, *_CONSTANTS)):
            raise FunctionRefused(
                f"autograd.Function {call.name} returns a {type(leaf).__name__} (output leaf {i}): autopar traces "
                f"a custom Function as one op returning tensors and Python constants only")
    tensor_at = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
    _OUTPUTS[call.key] = (OutputLayout(
        spec, tuple(None if i in tensor_at else leaf for i, leaf in enumerate(leaves)), tensor_at, int(flops),
                                          tuple(dict.fromkeys(draws))))


@torch.library.custom_op("autopar::autograd_function", mutates_args=())
def autograd_function(key: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """A user autograd.Function's forward (module docstring)."""
    return _forward(key, tensors, fake=False)


@autograd_function.register_fake
def _autograd_function_fake(key, tensors):
    return _forward(key, tensors, fake=True)


def _setup_context(ctx, inputs, output) -> None:
    key, tensors = inputs
    ctx.save_for_backward(*tensors)
    ctx.key = key
    ctx.seed = getattr(_inside, "last_seed", None)  # the forward's, when it draws (``_forward``)


def _backward(ctx, grads):
    """The Function's own backward: ``apply`` again under autograd, then ``autograd.grad`` -- on
    the forward's seeded stream when it draws, so the recompute draws the forward's numbers."""
    call = function_call(ctx.key)
    saved = ctx.saved_tensors
    with seeded(ctx.seed, saved) if ctx.seed is not None else contextlib.nullcontext(), torch.enable_grad():
        xs = [t.detach().requires_grad_(t.is_floating_point() or t.is_complex()) for t in saved]
        outs = call_function(call, xs)
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if o.requires_grad and g is not None]
        wrt = [x for x in xs if x.requires_grad]
        got = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
                   if pairs and wrt else [None] * len(wrt))
    return None, [next(got) if x.requires_grad else None for x in xs]


autograd_function.register_autograd(_backward, setup_context=_setup_context)


@register_flop_formula(torch.ops.autopar.autograd_function)
def _flops(key, tensors, *args, **kwargs) -> int:
    """The forward's FLOPs counted on the key's shapes, scaled by the inputs' size when the op
    runs on other sizes (a shard of a structurally elementwise Function). Tensors arrive as shapes."""
    layout, call = _OUTPUTS.get(key), _CALLS.get(key)
    if layout is None or call is None:
        return 0
    traced = sum(_numel(s) for s in call.shapes)
    return layout.flops * sum(_numel(s) for s in tensors) // traced if traced else layout.flops


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
