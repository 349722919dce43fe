"""Is a custom autograd.Function structurally elementwise? Its forward and backward as graphs.

A user Function is one op, ``autopar::autograd_function`` (``autopar.tracer.functions``), which
is always correct replicated. Sharding its tensors alike along one dim (Bloom's ``GeLUFunction``
on a tensor-parallel MLP activation) is correct only if every output element depends on the
same element of each input, in the forward AND in the Function's own backward. That is decided
from structure, never from values: both are traced with ``make_fx`` on fake tensors of the
call's global shapes -- the forward ``apply(*xs)`` and ``autograd.grad(apply(*xs), xs, g)`` --
and accepted only if

- every op is tagged ``torch.Tag.pointwise``, or is aliasing, ``detach``, ``clone``, a dtype cast
  (``_to_copy`` without a device), a scalar constant, or an ``*_like`` factory (no device);
- every tensor in both graphs (inputs, outputs, intermediates, constants) has the output's shape
  or is 0-d (a scalar: it stays replicated, and its gradient is summed over the shards).

Along a dim whose size the Function does not read (``size_free``: its graphs traced with that
dim at 1 and at half its size are the same ops with the same constants) ``apply`` itself may run
on shards -- and on a pipeline's micro-batches. Along another dim (``x / x.shape[-1]``) the graphs,
not ``apply``, run on each rank's shards (``autopar.strategies._functions``): the sizes they read
are baked in at the global shape, so a shard computes what the whole tensor computes there.
Decided once per (key, dtypes) and cached.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from autopar.tracer.functions import call_function, function_call

__all__ = ["PointwiseGraphs", "pointwise_graphs"]

aten = torch.ops.aten
_RESHAPES = frozenset({aten.view, aten._unsafe_view, aten.reshape, aten.expand})
# Besides pointwise ops: what moves no element to another position.
_HARMLESS = frozenset({aten.detach, aten.alias, aten.clone, aten._to_copy, aten.lift_fresh_copy, aten.lift_fresh,
                       aten.zeros_like, aten.ones_like, aten.empty_like, aten.full_like, aten.scalar_tensor})


@dataclass(frozen=True)
class PointwiseGraphs:
    """A structurally elementwise Function call, as graphs to run on shards.

    forward(*tensors) -> outputs; backward(*tensors, *grads of ``grad_outputs``) -> gradients of
    the ``grad_inputs`` (None where unused)."""

    forward: fx.GraphModule
    backward: fx.GraphModule
    grad_inputs: tuple[int, ...]  # input positions that take a gradient (floating point)
    grad_outputs: tuple[int, ...]  # output positions whose gradient the backward reads
    shape: tuple[int, ...]  # every output's (and every non-scalar input's) shape
    size_free: tuple[int, ...]  # dims along which the graphs are the same at other sizes (below)


_CACHE: dict[tuple[str, tuple[torch.dtype, ...]], PointwiseGraphs | None] = {}


def pointwise_graphs(key: str, dtypes: tuple[torch.dtype, ...] | None = None) -> PointwiseGraphs | None:
    """The call ``key`` as elementwise graphs at the key's global shapes and ``dtypes`` (the
    traced ones by default), or None when it is not structurally elementwise (module docstring)."""
    call = function_call(key)
    dtypes = tuple(dtypes) if dtypes is not None else call.dtypes
    if (key, dtypes) not in _CACHE:
        _CACHE[(key, dtypes)] = _analyse(call, dtypes)
    return _CACHE[(key, dtypes)]


def _analyse(call, dtypes) -> PointwiseGraphs | None:
    traced = _trace(call, call.shapes, dtypes)
    if traced is None:
        return None
    forward, backward, grad_inputs, grad_outputs, shape = traced
    if not (_elementwise(forward, shape) and _elementwise(backward, shape)):
        return None
    return PointwiseGraphs(forward, backward, grad_inputs, grad_outputs, shape,
                           tuple(d for d in range(len(shape)) if _size_free(call, dtypes, d, (forward, backward))))


def _size_free(call, dtypes, dim: int, graphs) -> bool:
    """The Function reads no size along ``dim``: traced with that dim at 1 and at half its size,
    its graphs are the ones at the global size (same ops, same constants). Then ``apply`` itself
    on a shard (or on a micro-batch) computes what the whole tensor computes there."""
    size = next(s[dim] for s in call.shapes if len(s))
    for other in {1, max(size // 2, 1)} - {size}:
        shapes = tuple(tuple(other if i == dim else n for i, n in enumerate(s)) if len(s) else s
                       for s in call.shapes)
        traced = _trace(call, shapes, dtypes)
        if traced is None or [_signature(g) for g in traced[:2]] != [_signature(g) for g in graphs]:
            return False
    return True


def _signature(gm: fx.GraphModule) -> list:
    """The graph's ops and their non-tensor arguments, sizes left out only where they are the values'
    own (the traced values' shapes differ by construction)."""
    index = {node: i for i, node in enumerate(gm.graph.nodes)}
    constants = {n.target: getattr(gm, n.target).tolist() for n in gm.graph.nodes if n.op == "get_attr"}
    return [(n.op, str(n.target), repr(fx.node.map_arg((n.args, n.kwargs), lambda a: index[a])),
             constants.get(n.target)) for n in gm.graph.nodes]


def _trace(call, shapes, dtypes):
    """(forward, backward, grad_inputs, grad_outputs, shape) traced with ``make_fx`` on fake tensors,
    or None when the outputs are not all of one non-scalar shape that every non-scalar input has."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        xs = [torch.empty(shape, dtype=dtype) for shape, dtype in zip(shapes, dtypes, strict=True)]
        with torch.no_grad():
            outs = call_function(call, xs)
        if not outs or outs[0].dim() == 0 or any(tuple(o.shape) != tuple(outs[0].shape) for o in outs):
            return None
        shape = tuple(outs[0].shape)
        if not any(x.dim() for x in xs) or any(x.dim() and tuple(x.shape) != shape for x in xs):
            return None  # an output shaped by no input, or an input of another shape
        grad_inputs = tuple(i for i, x in enumerate(xs) if x.is_floating_point())
        grad_outputs = tuple(i for i, o in enumerate(outs) if o.is_floating_point())
        forward = make_fx(torch.no_grad()(lambda *ts: call_function(call, list(ts))))(*xs)
        gs = [torch.empty(shape, dtype=outs[i].dtype) for i in grad_outputs]
        backward = make_fx(_gradients(call, len(xs), grad_inputs, grad_outputs))(*xs, *gs)
    backward.graph.eliminate_dead_code()  # the recomputed forward's unused values
    backward.recompile()
    for gm in forward, backward:
        _aliases_for_same_shape_views(gm)
    return forward, backward, grad_inputs, grad_outputs, shape


def _gradients(call, n: int, grad_inputs: tuple[int, ...], grad_outputs: tuple[int, ...]):
    def run(*args):
        xs, gs = list(args[:n]), args[n:]
        with torch.enable_grad():
            for i in grad_inputs:
                xs[i] = xs[i].detach().requires_grad_(True)
            outs = call_function(call, xs)
            pairs = [(outs[i], g) for i, g in zip(grad_outputs, gs) if outs[i].requires_grad]
            wrt = [xs[i] for i in grad_inputs]
            if not pairs or not wrt:
                return [None] * len(wrt)
            return list(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True))

    return run


def _aliases_for_same_shape_views(gm: fx.GraphModule) -> None:
    """``x.view_as(x)`` (gradient reversal's forward) and other reshapes to the shape the value
    already has are aliases: rewritten as such, since the traced size would be wrong on a shard."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or getattr(node.target, "overloadpacket", None) not in _RESHAPES:
            continue
        source = node.args[0]
        before, after = source.meta.get("val"), node.meta.get("val")
        if isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) and before.shape == after.shape:
            node.target, node.args, node.kwargs = aten.alias.default, (source,), {}
    gm.recompile()


def _elementwise(gm: fx.GraphModule, shape: tuple[int, ...]) -> bool:
    for node in gm.graph.nodes:
        if node.op == "call_function" and not _harmless(node):
            return False
        if node.op == "get_attr":
            value = getattr(gm, node.target, None)
            if isinstance(value, torch.Tensor) and value.dim():
                return False
        val = node.meta.get("val")
        values = val if isinstance(val, (list, tuple)) else (val,)
        if any(isinstance(v, torch.Tensor) and v.dim() and tuple(v.shape) != shape for v in values):
            return False
    return True


def _harmless(node: fx.Node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if node.kwargs.get("device") is not None:
        return False  # a device baked in at trace time (the ranks' may differ)
    return torch.Tag.pointwise in target.tags or target.overloadpacket in _HARMLESS
