"""Random draws: dropout, ``bernoulli``, ``rrelu``, ``rand``/``randn`` (and ``*_like``), ``randint``,
``randperm``, ``multinomial``, and the tensor fills of torch's distributions (``uniform_``,
``normal_``, ``exponential_``, ``geometric_``, ``log_normal_``, ``cauchy_``: the functional ops the
tracer makes of them, ``normal_`` as it stays). Local op: the ``random_draw`` kernel, for EVERY
strategy.

Each element is a function of the seed, the step, the op (traced node) and its GLOBAL index in
the op's output (``autopar/strategies/rng.py``), so a rank of any plan draws exactly the numbers
one device draws for the same elements: the result depends on the seed alone, never on the mesh,
the plan or the rank count; replicas along an ``R`` axis draw the same numbers. The kernel runs
on a size-1 mesh and in the all-replicated strategy too (``register(kernel_for=...)``): a plain op
there would draw from torch's generator. A call that does not draw (dropout with ``train=False``
or ``p=0``) runs the plain op.

Single-axis options:
- elementwise draws (dropout, ``native_dropout``, ``bernoulli``, ``rrelu``): every dim maps to itself; no
  ``P`` (a mask of summands is not the mask of the sum);
- ``rand_like``/``randn_like`` and the distribution fills: the output takes the input's split
  dims; a ``P`` input gives a replicated output (only the shape is read). A fill is the inverse
  CDF of one uniform per element (``normal_``/``log_normal_``: one normal, Box-Muller), in float64
  and then rounded to the tensor's dtype: ``uniform`` ``from + (to - from) u``, ``exponential``
  ``-log(1 - u) / lambd``, ``geometric`` ``ceil(log(1 - u) / log(1 - p))`` (at least 1),
  ``cauchy`` ``median + sigma tan(pi (u - 1/2))``, ``log_normal`` ``exp(mean + std z)``;
- factories (``rand``, ``randn``, ``randint``): any output dim split;
- ``randperm``: dim 0 split (each rank sorts the whole stream's keys and keeps its slice: a
  permutation is not elementwise, and O(n log n) on an index vector is cheap);
- ``multinomial`` on (rows, categories): rows split.

Any other random op (``normal`` with tensor means, ``poisson``, ``binomial`` ...) has no rule here, and
``expand.enumerate_strategies`` refuses it with a ``NoRuleError`` even under the replicate
fallback (each rank would draw from its own generator).
"""

from __future__ import annotations

import math

import torch

from autopar.layout.placement import Partial, Replicate, Shard
from autopar.strategies import rng
from autopar.strategies.kernel_context import KernelContext
from autopar.strategies.registry import AxisOption, OpInfo, Sample, draws_random, register, register_kernel
from autopar.strategies.samples import rand

aten = torch.ops.aten
R, P = Replicate(), Partial()

__all__ = ["random_kernel"]


def _no_comm(info, input_specs, output_specs, mesh) -> tuple[float, float]:
    return 0.0, 0.0


def random_kernel(info: OpInfo) -> str | None:
    """``kernel_for``: the counter-based kernel when the call draws, else the plain op."""
    return "random_draw" if draws_random(info.target, info.bound) else None


# ------------------------------------------------------------------------------- the kernel
def _indices(ctx: KernelContext, draw: rng.Draw, device, *, k: int = 0, shape=None) -> torch.Tensor:
    """Global indices of this rank's piece of output ``k`` (or of a tensor of ``shape`` that
    has the output's leading dims, split alike, and another last dim, whole)."""
    meta = ctx.info.outputs[k]
    slices = list(ctx.output_specs[k].local_slices(meta.shape, ctx.mesh_shape, ctx.coords()))
    if shape is not None:
        shape, slices = tuple(shape), slices[:-1] + [slice(0, shape[-1])]
    return rng.element_indices(meta.shape if shape is None else shape, slices, draw=draw, device=device)


def _keep(ctx: KernelContext, like: torch.Tensor, p: float) -> torch.Tensor:
    """The dropout keep-mask of this rank's piece: u >= p, u in float64 (p compared exactly)."""
    draw = rng.current()
    u = rng.uniform(draw.key(ctx.info.node_name), _indices(ctx, draw, like.device))
    return u >= p


def _dropped(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    if p >= 1:
        return x * 0  # torch's dropout with p=1: zeros, with a zero gradient
    return x * (keep.to(x.dtype) * (1.0 / (1.0 - p)))


@register_kernel("random_draw", comm_cost=_no_comm)
def random_draw(ctx: KernelContext, **a):
    """This rank's piece of a random op's output (see the module docstring)."""
    target, draw = ctx.info.target, rng.current()
    key = draw.key(ctx.info.node_name)
    if target is aten.dropout.default:
        return _dropped(a["input"], _keep(ctx, a["input"], a["p"]), a["p"])
    if target is aten.native_dropout.default:
        keep = _keep(ctx, a["input"], a["p"])
        return _dropped(a["input"], keep, a["p"]), keep
    if target is aten.rrelu.default:  # training: a negative x is scaled by a slope ~ U(lower, upper)
        x = a["self"]
        u = rng.uniform(key, _indices(ctx, draw, x.device), x.dtype)
        slope = a["lower"] + u * (a["upper"] - a["lower"])
        return torch.where(x >= 0, x, x * slope)
    if target is aten.bernoulli.p:
        x = a["self"]
        return (rng.uniform(key, _indices(ctx, draw, x.device)) < a["p"]).to(x.dtype)
    if target is aten.bernoulli.default:
        x = a["self"].detach()
        return (rng.uniform(key, _indices(ctx, draw, x.device)) < x.double()).to(x.dtype)
    out = ctx.info.output
    dtype = out.dtype  # the traced output's: a schema default dtype binds as an enum number
    if target in _FILLS:
        x = a["self"]
        u = (rng.normal if target in _NORMAL_FILLS else rng.uniform)(key, _indices(ctx, draw, x.device))
        return _FILLS[target](u, a).to(dtype)
    if target in (aten.rand_like.default, aten.randn_like.default):
        x = a["self"]
        fn = rng.uniform if target is aten.rand_like.default else rng.normal
        return fn(key, _indices(ctx, draw, x.device), dtype)
    device = a.get("device")
    if target in (aten.rand.default, aten.randn.default):
        fn = rng.uniform if target is aten.rand.default else rng.normal
        return fn(key, _indices(ctx, draw, device), dtype)
    if target in (aten.randint.default, aten.randint.low):
        low, high = a.get("low", 0), a["high"]
        u = rng.uniform(key, _indices(ctx, draw, device))
        return (torch.floor(u * (high - low)).to(torch.int64) + low).to(dtype)
    if target is aten.randperm.default:
        n = a["n"]
        keys = rng.uniform(key, rng.element_indices((n,), (slice(0, n),), draw=draw, device=device))
        perm = torch.argsort(keys, stable=True)  # ties (2**-53 apart or less) broken by index
        sl = ctx.output_specs[0].local_slices(out.shape, ctx.mesh_shape, ctx.coords())[0]
        return perm[sl].to(dtype)
    if target is aten.multinomial.default:
        return _multinomial(ctx, draw, a["self"], a["num_samples"], a["replacement"])
    raise NotImplementedError(f"random_draw has no kernel for {ctx.info.where()}")


def _multinomial(ctx: KernelContext, draw: rng.Draw, probs: torch.Tensor, num: int, replacement: bool):
    probs = probs.detach().double()
    cats = probs.shape[-1]
    if replacement:  # inverse CDF: one uniform per output element
        u = rng.uniform(draw.key(ctx.info.node_name), _indices(ctx, draw, probs.device))
        cdf = torch.cumsum(probs / probs.sum(-1, keepdim=True), -1)
        return torch.searchsorted(cdf.contiguous(), u.contiguous(), right=True).clamp_(max=cats - 1)
    # Without replacement: an exponential race (Efraimidis-Spirakis), one uniform per category,
    # from a sub-stream over the (rows, categories) index space; the ``num`` smallest win.
    shape = (*ctx.info.output.shape[:-1], cats)
    u = rng.uniform(draw.key(ctx.info.node_name, 1), _indices(ctx, draw, probs.device, shape=shape))
    race = -torch.log1p(-u) / probs
    return torch.topk(race, num, dim=-1, largest=False, sorted=True).indices


# torch's distribution fills: their value from one float64 uniform (or normal) ``u`` per element
# and the call's arguments (by schema name; ``registry.bind`` filled in the defaults).
_FILLS = {
    aten.uniform.default: lambda u, a: a["from"] + (a["to"] - a["from"]) * u,
    aten.exponential.default: lambda u, a: -torch.log1p(-u) / a["lambd"],
    aten.geometric.default: lambda u, a: torch.ceil(torch.log1p(-u) / math.log1p(-a["p"])).clamp_(min=1),
    aten.cauchy.default: lambda u, a: a["median"] + a["sigma"] * torch.tan(torch.pi * (u - 0.5)),
    aten.log_normal.default: lambda u, a: torch.exp(a["mean"] + a["std"] * u),
    aten.normal_.default: lambda u, a: a["mean"] + a["std"] * u,
}
# The in-place overloads where a trace keeps them (the filled tensor is a fresh buffer, as for
# ``fill_``): the same values.
_FILLS.update({aten.uniform_.default: _FILLS[aten.uniform.default],
               aten.exponential_.default: _FILLS[aten.exponential.default],
               aten.geometric_.default: _FILLS[aten.geometric.default],
               aten.cauchy_.default: _FILLS[aten.cauchy.default],
               aten.log_normal_.default: _FILLS[aten.log_normal.default]})
_NORMAL_FILLS = (aten.normal_.default, aten.log_normal.default, aten.log_normal_.default)


# -------------------------------------------------------------------------------- the rules
def _elementwise(info: OpInfo) -> list[AxisOption]:
    name = info.slots[0].arg
    outs = len(info.outputs)
    return [info.option((Shard(d),) * outs, **{name: Shard(d)}) for d in range(info.slots[0].meta.ndim)]


def _like(info: OpInfo) -> list[AxisOption]:
    options = [info.option(Shard(d), self=Shard(d), grad_partial=[]) for d in range(info.input("self").ndim)]
    return options + [info.option(R, self=P, grad_partial=[], work_split=False)]


def _factory(info: OpInfo) -> list[AxisOption]:
    return [info.option(Shard(d)) for d in range(info.output.ndim)]


def _randperm(info: OpInfo) -> list[AxisOption]:
    return [info.option(Shard(0))]


def _multinomial_rule(info: OpInfo) -> list[AxisOption]:
    if info.input("self").ndim != 2:
        return []  # one distribution: its samples are drawn together
    return [info.option(Shard(0), self=Shard(0), grad_partial=[])]


_F64 = {"dtype": torch.float64}


_RANDOM = {
    aten.dropout.default: (_elementwise, lambda: [
        Sample((rand(4, 8, 4), 0.3, True), label="p=0.3"), Sample((rand(4, 8), 1.0, True), label="p=1"),
        Sample((rand(4, 8, 4), 0.5, False), label="eval")]),
    aten.native_dropout.default: (_elementwise, lambda: [
        Sample((rand(4, 8, 4), 0.25, True), label="p=0.25"), Sample((rand(4, 8), 0.0, True), label="p=0")]),
    aten.rrelu.default: (_elementwise, lambda: [Sample((rand(4, 8, 4), 0.1, 0.3, True), label="training"),
                                                Sample((rand(4, 8), 0.1, 0.3, False), label="eval")]),
    aten.bernoulli.p: (_elementwise, lambda: [Sample((rand(4, 8, 4), 0.4), label="p=0.4", no_grad=("self",))]),
    aten.bernoulli.default: (_elementwise, lambda: [
        Sample((rand(4, 8, 4).sigmoid(),), label="probabilities", no_grad=("self",))]),
    aten.rand_like.default: (_like, lambda: [Sample((rand(4, 8, 4),), no_grad=("self",))]),
    aten.randn_like.default: (_like, lambda: [Sample((rand(4, 8),), _F64, no_grad=("self",))]),
    aten.uniform.default: (_like, lambda: [Sample((rand(4, 8, 4), 0.9, 1.1), no_grad=("self",)),
                                           Sample((rand(4, 8),), label="default", no_grad=("self",))]),
    aten.exponential.default: (_like, lambda: [Sample((rand(4, 8, 4), 2.0), no_grad=("self",))]),
    aten.geometric.default: (_like, lambda: [Sample((rand(4, 8, 4), 0.3), no_grad=("self",))]),
    aten.cauchy.default: (_like, lambda: [Sample((rand(4, 8), 1.0, 0.5), no_grad=("self",))]),
    aten.log_normal.default: (_like, lambda: [Sample((rand(4, 8), 0.0, 0.25), no_grad=("self",))]),
    aten.normal_.default: (_like, lambda: [Sample((rand(4, 8, 4), 1.0, 2.0), no_grad=("self",))]),
    aten.uniform_.default: (_like, lambda: [Sample((rand(4, 8), -1.0, 3.0), no_grad=("self",))]),
    aten.exponential_.default: (_like, lambda: [Sample((rand(4, 8),), no_grad=("self",))]),
    aten.geometric_.default: (_like, lambda: [Sample((rand(4, 8), 0.6), no_grad=("self",))]),
    aten.cauchy_.default: (_like, lambda: [Sample((rand(4, 8),), no_grad=("self",))]),
    aten.log_normal_.default: (_like, lambda: [Sample((rand(4, 8),), no_grad=("self",))]),
    aten.rand.default: (_factory, lambda: [Sample(([4, 8, 4],), _F64), Sample(([8, 4],), label="float32")]),
    aten.randn.default: (_factory, lambda: [Sample(([4, 8, 4],), _F64)]),
    aten.randint.default: (_factory, lambda: [Sample((10, [4, 8]))]),
    aten.randint.low: (_factory, lambda: [Sample((-3, 1000, [8, 4]))]),
    aten.randperm.default: (_randperm, lambda: [Sample((16,)), Sample((8,), {"dtype": torch.int32}, "int32")]),
    aten.multinomial.default: (_multinomial_rule, lambda: [
        Sample((rand(8, 16, positive=True), 4, True), label="replacement", no_grad=("self",)),
        Sample((rand(8, 16, positive=True), 6, False), label="no-replacement", no_grad=("self",))]),
}
for _op, (_rule, _samples) in _RANDOM.items():
    register(_op, samples=_samples, kernel_for=random_kernel)(_rule)
