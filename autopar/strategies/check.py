"""Numerical check of sharding strategies: every simulated rank is a thread in this process.

``check_strategy(info, strategy, sample, mesh_shape)`` verifies one candidate against the
unsharded op, forward AND backward:

1. the reference: the op on the global inputs, a random output gradient ``G``, autograd;
2. the inputs are laid out as the strategy says: ``Shard`` -> the rank's slice, ``Replicate`` ->
   a copy, ``Partial`` -> random summands that add up to the value over the axis group;
3. every rank runs the local op (the plain op, or the strategy's custom kernel with a simulated
   ``Comm``) in its own thread, then autograd with ``G`` laid out per the gradient-layout rule
   (the gradient of an ``S``/``R`` output is sliced/copied like the output; of a ``P`` output it
   is replicated);
4. each rank's output, summed over its ``P`` axes, must equal its slice of the reference; each
   input gradient, summed over that input's ``grad_partial_axes``, must equal its slice of the
   reference gradient (the gradient of a ``P`` input is replicated, so no ``P`` summing there).

The collectives meet at a ``threading.Barrier`` per axis group; a failing rank aborts every
barrier so that the others raise instead of hanging.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from autopar.layout.placement import Replicate, TensorSpec
from autopar.strategies.kernel_context import KernelContext
from autopar.strategies.fused import take_local
from autopar.strategies.registry import (OpInfo, Sample, Strategy, bind, call_op, get_kernel, get_rule,
                                        local_arguments)

__all__ = ["SimWorld", "SimComm", "run_spmd", "check_strategy", "StrategyMismatch", "reference", "run_whole",
           "whole_kernel"]

_BARRIER_TIMEOUT_S = 30.0
# Ops whose output values are undefined (uninitialised memory): only shapes are compared.
UNINITIALIZED = frozenset({torch.ops.aten.empty_like.default, torch.ops.aten.empty.memory_format})


class StrategyMismatch(AssertionError):
    """A strategy's sharded result differs from the unsharded op."""


# ------------------------------------------------------------------------------ simulator
class _Group:
    def __init__(self, num_ranks: int) -> None:
        self.barrier = threading.Barrier(num_ranks, timeout=_BARRIER_TIMEOUT_S)
        self.slots: list[torch.Tensor | None] = [None] * num_ranks


class SimWorld:
    """Shared state of one simulated mesh: a group (barrier + slots) per (axes, other coords)."""

    def __init__(self, mesh_shape: Sequence[int]) -> None:
        self.mesh_shape = tuple(mesh_shape)
        self._groups: dict[Any, _Group] = {}
        self._lock = threading.Lock()
        self._aborted = False  # a rank failed: groups made from now on are broken at once

    def group(self, axes: tuple[int, ...], coord: tuple[int, ...]) -> tuple[_Group, int]:
        key = (axes, tuple(c for a, c in enumerate(coord) if a not in axes))
        rank = 0
        for a in axes:
            rank = rank * self.mesh_shape[a] + coord[a]
        with self._lock:
            if key not in self._groups:
                n = 1
                for a in axes:
                    n *= self.mesh_shape[a]
                self._groups[key] = _Group(n)
                if self._aborted:  # its failed peer will never arrive: do not wait for the timeout
                    self._groups[key].barrier.abort()
            return self._groups[key], rank

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            for g in self._groups.values():
                g.barrier.abort()

    def reduce(self, tensor: torch.Tensor, axes: tuple[int, ...], coord: tuple[int, ...], op: str) -> torch.Tensor:
        group, rank = self.group(axes, coord)
        group.slots[rank] = tensor
        group.barrier.wait()
        # Every rank reduces in the same order, so all get bit-identical results.
        if op == "sum":
            result = torch.stack(list(group.slots)).sum(0)
        elif op == "max":
            result = torch.stack(list(group.slots)).amax(0)
        else:
            raise ValueError(f"unsupported reduction {op!r}; expected 'sum' or 'max'")
        group.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return result

    def shift(self, tensor: torch.Tensor, axis: int, coord: tuple[int, ...]) -> torch.Tensor:
        """One ring step along ``axis``: the tensor of the previous coordinate (a copy)."""
        group, rank = self.group((axis,), coord)
        group.slots[rank] = tensor
        group.barrier.wait()
        result = group.slots[(rank - 1) % len(group.slots)].clone()
        group.barrier.wait()
        return result

    def exchange(self, blocks: list[torch.Tensor], axis: int, coord: tuple[int, ...]) -> torch.Tensor:
        """Rank ``j`` of ``axis``'s group gets ``blocks[j]`` of every rank, stacked in rank order."""
        group, rank = self.group((axis,), coord)
        group.slots[rank] = blocks
        group.barrier.wait()
        result = torch.cat([group.slots[src][rank] for src in range(len(group.slots))])
        group.barrier.wait()
        return result

    def gather_whole(self, tensor: torch.Tensor, axes: tuple[int, ...], coord: tuple[int, ...]) -> list[torch.Tensor]:
        """Every rank's ``tensor`` of the group, in rank order (an all-gather of whole tensors)."""
        group, rank = self.group(axes, coord)
        group.slots[rank] = tensor
        group.barrier.wait()
        result = [t.clone() for t in group.slots]
        group.barrier.wait()
        return result


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, world, axis, coord, send_counts, recv_counts):
        ctx.args = (world, axis, coord, send_counts, recv_counts)
        return world.exchange(list(tensor.detach().split(list(send_counts))), axis, coord)

    @staticmethod
    def backward(ctx, grad):
        world, axis, coord, send_counts, recv_counts = ctx.args
        return world.exchange(list(grad.split(list(recv_counts))), axis, coord), None, None, None, None, None


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, world, axes, coord):  # noqa: D401
        return world.reduce(tensor.detach(), axes, coord, "sum")

    @staticmethod
    def backward(ctx, grad):
        # The result is replicated, so its gradient arrives replicated: identity (the gradient-layout invariant).
        return grad, None, None, None


class _Scatter(torch.autograd.Function):
    """``Comm.scatter`` among threads; backward gathers the chunks' gradients onto ``src``."""

    @staticmethod
    def forward(ctx, tensor, world, axis, coord, src):
        ctx.world, ctx.axis, ctx.coord, ctx.src = world, axis, coord, src
        chunks = world.gather_whole(tensor.detach(), (axis,), coord)
        n = world.mesh_shape[axis]
        return chunks[src].chunk(n)[coord[axis]].clone()

    @staticmethod
    def backward(ctx, grad):
        pieces = ctx.world.gather_whole(grad.contiguous(), (ctx.axis,), ctx.coord)
        full = torch.cat(pieces)
        return (full if ctx.coord[ctx.axis] == ctx.src else torch.zeros_like(full)), None, None, None, None


class SimComm:
    """``Comm`` for one simulated rank."""

    def __init__(self, world: SimWorld, coord: tuple[int, ...]) -> None:
        self.world, self.coord = world, coord

    def all_reduce(self, tensor: torch.Tensor, axes: int | Sequence[int], op: str = "sum") -> torch.Tensor:
        axes = (axes,) if isinstance(axes, int) else tuple(sorted(axes))
        if not axes:
            return tensor
        if op == "sum":
            return _AllReduceSum.apply(tensor, self.world, axes, self.coord)
        return self.world.reduce(tensor.detach(), axes, self.coord, op)

    def all_reduce_async(self, tensor: torch.Tensor, axes: int | Sequence[int]) -> Callable[[], torch.Tensor]:
        done = self.all_reduce(tensor.detach(), axes)  # threads: issued and done here, read at wait()
        return lambda: done

    def shift(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        if self.world.mesh_shape[axis] == 1:
            return tensor
        return self.world.shift(tensor.detach(), axis, self.coord)

    def all_to_all(self, tensor: torch.Tensor, axis: int, send_counts: Sequence[int],
                   recv_counts: Sequence[int]) -> torch.Tensor:
        return _AllToAll.apply(tensor, self.world, axis, self.coord, tuple(send_counts), tuple(recv_counts))

    def exchange_counts(self, counts: Sequence[int], axis: int) -> list[int]:
        blocks = list(torch.tensor(list(counts), dtype=torch.int64).split(1))
        return self.world.exchange(blocks, axis, self.coord).tolist()

    def scatter(self, tensor: torch.Tensor, axis: int, src: int) -> torch.Tensor:
        return _Scatter.apply(tensor, self.world, axis, self.coord, src)

    def coordinate(self, axis: int) -> int:
        return self.coord[axis]

    def size(self, axis: int) -> int:
        return self.world.mesh_shape[axis]


def run_spmd(fn: Callable[[SimComm], Any], mesh_shape: Sequence[int]) -> dict[tuple[int, ...], Any]:
    """Run ``fn(comm)`` once per mesh coordinate, each in its own thread; results by coordinate."""
    world = SimWorld(mesh_shape)
    coords = list(itertools.product(*(range(n) for n in mesh_shape)))
    results: dict[tuple[int, ...], Any] = {}
    errors: dict[tuple[int, ...], BaseException] = {}

    def body(coord: tuple[int, ...]) -> None:
        try:
            results[coord] = fn(SimComm(world, coord))
        except BaseException as exc:  # re-raised below, in the caller's thread
            errors[coord] = exc
            world.abort()

    threads = [threading.Thread(target=body, args=(c,), daemon=True) for c in coords]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        # Report the root cause, not the BrokenBarrierError of the ranks it aborted.
        coord, exc = next(((c, e) for c, e in errors.items() if not isinstance(e, threading.BrokenBarrierError)),
                          next(iter(errors.items())))
        raise RuntimeError(f"simulated rank {coord} failed: {type(exc).__name__}: {exc}") from exc
    return results


# ---------------------------------------------------------------------------------- check
@dataclass
class _Reference:
    bound: dict[str, Any]
    outputs: list[torch.Tensor | None]
    out_grads: list[torch.Tensor | None]
    input_grads: list[torch.Tensor | None]  # per slot


def _slot_values(bound: dict[str, Any]) -> list[Any]:
    vals = []
    for v in bound.values():
        if isinstance(v, (list, tuple)):
            vals.extend(x for x in v if isinstance(x, torch.Tensor))
        elif isinstance(v, torch.Tensor):
            vals.append(v)
    return vals


def _slot_names(bound: dict[str, Any]) -> list[str]:
    names = []
    for k, v in bound.items():
        items = v if isinstance(v, (list, tuple)) else (v,)
        names.extend(k for x in items if isinstance(x, torch.Tensor))
    return names


def _replace_slots(bound: dict[str, Any], new: list[Any]) -> dict[str, Any]:
    it = iter(new)
    out = {}
    for k, v in bound.items():
        if isinstance(v, (list, tuple)):
            out[k] = [next(it) if isinstance(x, torch.Tensor) else x for x in v]
        elif isinstance(v, torch.Tensor):
            out[k] = next(it)
        else:
            out[k] = v
    return out


def _run_op(target: Any, bound: dict[str, Any]) -> Any:
    """``call_op``, but an argument the op writes in place (``add_``'s ``self``) is cloned first:
    in a graph it is an activation, never an autograd leaf, and the caller's tensor stays intact."""
    schema = getattr(target, "_schema", None)
    if schema is not None:
        written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        if written:
            bound = {k: v.clone() if k in written and isinstance(v, torch.Tensor) else v for k, v in bound.items()}
    return call_op(target, bound)


def _as_list(out: Any) -> list[Any]:
    return list(out) if isinstance(out, (list, tuple)) else [out]


def whole_kernel(target: Any, info: OpInfo) -> str | None:
    """The kernel every strategy of this call runs (``register(kernel_for=...)``), else None."""
    entry = get_rule(target)
    return entry.kernel_for(info) if entry is not None and entry.kernel_for is not None else None


def run_whole(name: str, info: OpInfo, bound: dict[str, Any]) -> Any:
    """Kernel ``name`` on one rank holding every tensor whole: what mesh ``(1,)`` runs, and so the
    single-device value of a call whose every strategy runs it (random draws: the plain op would
    draw other numbers from torch's generator)."""
    replicated = lambda metas: tuple(None if m is None else TensorSpec((Replicate(),)) for m in metas)  # noqa: E731
    ctx = KernelContext(SimComm(SimWorld((1,)), (0,)), info, replicated([s.meta for s in info.slots]),
                        replicated(info.outputs), (1,))
    return get_kernel(name).fn(ctx, **bound)


def _whole(target: Any, sample: Sample, bound: dict[str, Any]) -> Any:
    """The op on the whole sample: the plain op, or its ``whole_kernel`` (``run_whole``)."""
    name = whole_kernel(target, OpInfo.from_values(target, sample.args, sample.kwargs, None))
    if name is None:
        return _run_op(target, bound)
    with torch.random.fork_rng(devices=[]), torch.no_grad():  # the output's metadata only
        info = OpInfo.from_values(target, sample.args, sample.kwargs, _run_op(target, _replace_slots(
            bound, [t.detach().clone() for t in _slot_values(bound)])))
    return run_whole(name, info, bound)


def reference(target: Any, sample: Sample, *, seed: int = 0) -> tuple[OpInfo, _Reference]:
    """The unsharded op on the sample, with a random output gradient and input gradients."""
    gen = torch.Generator().manual_seed(seed)
    bound = bind(target, sample.args, sample.kwargs)
    needs_grad = [n not in sample.no_grad for n in _slot_names(bound)]
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point() and g)
              for t, g in zip(_slot_values(bound), needs_grad)]
    bound = _replace_slots(bound, leaves)
    raw = _whole(target, sample, bound)
    outs = _as_list(raw)
    grads = [torch.randn(o.shape, dtype=o.dtype, generator=gen)
             if isinstance(o, torch.Tensor) and o.requires_grad else None for o in outs]
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
    wrt = [t for t in leaves if t.requires_grad]
    in_grads: list[torch.Tensor | None] = [None] * len(leaves)
    if pairs and wrt:
        got = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
        it = iter(got)
        in_grads = [next(it) if t.requires_grad else None for t in leaves]
        in_grads = [torch.zeros_like(t) if g is None and t.requires_grad else g for g, t in zip(in_grads, leaves)]
    # The output metadata of the call above: no second call, which would mutate the sample's
    # tensors for ops that write in place (batch norm's running statistics).
    info = OpInfo.from_values(target, sample.args, sample.kwargs, raw, segments=sample.segments)
    detached = [o.detach() if isinstance(o, torch.Tensor) else o for o in outs]
    return info, _Reference(bound, detached, grads, in_grads)


def _noise_key(spec: TensorSpec, coord: tuple[int, ...]) -> tuple[int, ...]:
    # Replicas along an R axis must hold identical summands, so R coordinates do not count.
    return tuple(0 if isinstance(p, Replicate) else c for p, c in zip(spec.placements, coord))


def _local_input(value: torch.Tensor, spec: TensorSpec, mesh_shape: tuple[int, ...], coord: tuple[int, ...],
                 gen: torch.Generator, noise: dict[tuple[int, ...], torch.Tensor]) -> torch.Tensor:
    piece = take_local(value.detach(), spec, mesh_shape, coord)
    p_axes = spec.partial_axes()
    if not p_axes:
        return piece.clone()
    # Summands: piece/n + (noise - mean of the noise over the P group), so they add up exactly.
    group = [_noise_key(spec, c) for c in _group(coord, p_axes, mesh_shape)]
    for key in group:
        if key not in noise:
            noise[key] = torch.randn(piece.shape, dtype=piece.dtype, generator=gen)
    mean = torch.stack([noise[k] for k in group]).mean(0)
    return piece / len(group) + (noise[_noise_key(spec, coord)] - mean)


def check_strategy(target: Any, sample: Sample, strategy: Strategy, mesh_shape: Sequence[int], *,
                   seed: int = 0, rtol: float = 1e-7, atol: float = 1e-9,
                   ref: tuple[OpInfo, "_Reference"] | None = None) -> None:
    """Raise ``StrategyMismatch`` unless ``strategy`` reproduces the op and its gradients.

    ``ref``: ``reference(target, sample, seed=seed)``, to share it between strategies.
    """
    mesh_shape = tuple(mesh_shape)
    info, ref = ref if ref is not None else reference(target, sample, seed=seed)
    coords = list(itertools.product(*(range(n) for n in mesh_shape)))
    gen = torch.Generator().manual_seed(seed + 1)
    values = _slot_values(ref.bound)
    locals_by_coord: dict[tuple[int, ...], list[torch.Tensor]] = {c: [] for c in coords}
    for value, spec in zip(values, strategy.input_specs):
        noise: dict[tuple[int, ...], torch.Tensor] = {}
        for c in coords:
            locals_by_coord[c].append(_local_input(value, spec, mesh_shape, c, gen, noise))
    out_specs = strategy.output_specs
    kernel = get_kernel(strategy.kernel).fn if strategy.kernel else None

    def rank(comm) -> tuple[list, list]:
        coord = comm.coord
        leaves = [t.clone().requires_grad_(r.requires_grad) for t, r in zip(locals_by_coord[coord], values)]
        bound = _replace_slots(ref.bound, leaves)
        if kernel is None:
            # The runtime's rewrite of shape arguments to local sizes (view, expand ...).
            bound = local_arguments(target, info, bound, strategy.input_specs, out_specs, mesh_shape)
            outs = _as_list(_run_op(target, bound))
        else:
            ctx = KernelContext(comm, info, strategy.input_specs, out_specs, mesh_shape)
            outs = _as_list(kernel(ctx, **bound))
        pairs = []
        for o, g, spec in zip(outs, ref.out_grads, out_specs):
            if g is not None and isinstance(o, torch.Tensor) and o.requires_grad:
                pairs.append((o, take_local(g, spec, mesh_shape, coord)))
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = [t.grad if t.requires_grad else None for t in leaves]
        return [o.detach() if isinstance(o, torch.Tensor) else o for o in outs], grads

    try:
        if kernel is None:
            # The plain op never communicates: run the ranks one after the other.
            results = {c: rank(SimComm(SimWorld(mesh_shape), c)) for c in coords}
        else:
            results = run_spmd(rank, mesh_shape)
    except Exception as exc:  # the local op cannot even run on these shards
        raise StrategyMismatch(
            f"{info.target} strategy {strategy.name!r} on mesh {mesh_shape} (sample {sample.label or '-'}): "
            f"the local op failed: {type(exc).__name__}: {exc}"
        ) from exc
    problems = []
    ref_outputs = ref.outputs
    if target in UNINITIALIZED:  # undefined values: compare shapes only (every value read as 0)
        ref_outputs = [_zeroed(o) for o in ref_outputs]
        results = {c: ([_zeroed(o) for o in outs], grads) for c, (outs, grads) in results.items()}
    for j, (ref_out, spec) in enumerate(zip(ref_outputs, out_specs)):
        if not isinstance(ref_out, torch.Tensor):
            continue
        for c in coords:
            got = _group_sum([results[g][0][j] for g in _group(c, spec.partial_axes(), mesh_shape)])
            want = take_local(ref_out, spec, mesh_shape, c)
            problems += _compare(f"output {j} on rank {c}", got, want, rtol, atol)
    for i, (ref_grad, spec, axes) in enumerate(zip(ref.input_grads, strategy.input_specs, strategy.grad_partial_axes)):
        if ref_grad is None:
            continue
        for c in coords:
            pieces = [results[g][1][i] for g in _group(c, axes, mesh_shape)]
            pieces = [torch.zeros(spec.local_shape(ref_grad.shape, mesh_shape), dtype=ref_grad.dtype)
                      if p is None else p for p in pieces]
            want = take_local(ref_grad, spec, mesh_shape, c)
            problems += _compare(f"gradient of input {i} ({info.slots[i].arg}) on rank {c}",
                                 _group_sum(pieces), want, rtol, atol)
    if problems:
        raise StrategyMismatch(
            f"{info.target} strategy {strategy.name!r} on mesh {mesh_shape} (sample {sample.label or '-'}): "
            + "; ".join(problems[:4])
        )


def _zeroed(value: Any) -> Any:
    return torch.zeros_like(value) if isinstance(value, torch.Tensor) else value


def _group(coord: tuple[int, ...], axes: Sequence[int], mesh_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    ranges = [range(mesh_shape[a]) if a in axes else (coord[a],) for a in range(len(mesh_shape))]
    return list(itertools.product(*ranges))


def _group_sum(pieces: list[torch.Tensor]) -> torch.Tensor:
    return pieces[0] if len(pieces) == 1 else torch.stack(pieces).sum(0)


def _compare(what: str, got: Any, want: torch.Tensor, rtol: float, atol: float) -> list[str]:
    if not isinstance(got, torch.Tensor):
        return [f"{what}: got {type(got).__name__}, expected a tensor"]
    if got.shape != want.shape:
        return [f"{what}: shape {tuple(got.shape)} != expected {tuple(want.shape)}"]
    if want.dtype.is_floating_point or want.dtype.is_complex:
        # NaN where the unsharded op gives NaN is the same answer (a function undefined there)
        ok = torch.allclose(got.to(want.dtype), want, rtol=rtol, atol=atol, equal_nan=True)
    else:
        ok = torch.equal(got, want)
    if ok:
        return []
    wide = torch.complex128 if want.dtype.is_complex else torch.float64
    err = (got.to(wide) - want.to(wide)).abs().max().item()
    return [f"{what}: max abs error {err:.3g}"]
