"""Gradient chunks: each chunk's gradients packed into one buffer as backward produces them.

A chunk's gradient buffer (``Chunk.grad``, the parameters' dtype, ``capacity`` elements) lives
on the payload's home tier: on the device for a device-home chunk (the planner's ``device`` and
``off:o`` tiers keep the gradient there), on the host for a host-home chunk (``off:po``: the
gradient goes down as soon as it is produced, the device keeps none). It is allocated through
the ledger when the first of its gradients arrives and freed when none of its parameters'
``.grad`` refers to it any more (``zero_grad``, or the next forward after the user cleared them).

Gradients arrive two ways, both during backward: the parameter's ``gemini_use`` node receives
its fully accumulated local gradient (``arrive``), or -- for a parameter whose gradient is
partial and goes through the gradient bucketer (data parallelism) -- the bucketer asks for the
parameter to deliver the reduced gradient into (``target``), whose ``.grad`` then is a view of
the chunk already, so the bucketer's ``grad += reduced`` lands there. Either way each
parameter's ``.grad`` is a DTensor (its placements) over its slice of the chunk: clipping,
``full_gradients`` and the optimizer read it there, and accumulation over several backward
passes adds into it.

A sharded chunk (``Chunk.sharded``), and a ZeRO-2 chunk (``Chunk.zero == 2``: its payload
whole, its gradient not; ``Chunk.scatters`` is either), keeps only this rank's shard of its gradient (``Chunk.grad``,
``elems`` long, on the payload's home tier), and its parameters' ``.grad`` stay None: during
backward each contribution is added into a whole-chunk accumulator on the device (one per set of
mesh axes it is partial over: ``Chunk.acc``; contributions that the graph made complete go to
the ``()`` one), and each accumulator is reduce-scattered over its partial axes into the shard
(``shards.scatter_sum``) and freed as soon as every parameter of the chunk that the graph reads
has had its ``gemini_use`` backward (``done``: all of its contributions are in; known from the
first pass on), or as soon as the chunk has received as many contributions as it did in the
previous backward pass (the arrival order is the autograd engine's, the same on every rank of
the group), so about one chunk's whole gradient is alive at a time, as in ZeRO-3. Whatever is
left -- the first pass, a pass that differs -- is reduce-scattered at the end of the backward
pass (an autograd engine callback, chunks in index order); reduce-scatters are linear, so a
chunk scattered in two rounds adds up to the same shard. ``GeminiOptimizer.zero_grad`` clears
the shards (``clear_sharded``); ``module.zero_grad()`` cannot see them.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from autopar.runtime.dtensors import local_of
from autopar.runtime.gemini.chunk import DEVICE
from autopar.runtime.gemini.shards import scatter_sum

__all__ = ["GradChunks", "wrap_like"]


def wrap_like(view: torch.Tensor, p) -> torch.Tensor:
    """``view`` (a local tensor) as a tensor like ``p``: a DTensor with ``p``'s placements."""
    if isinstance(p, DTensor):
        return DTensor.from_local(view, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())
    return view


class GradChunks:
    def __init__(self, manager) -> None:
        self.manager = manager
        self._queued = False  # a sharded chunk's flush is queued for the end of this backward
        self._expected: dict[int, int] = {}  # sharded chunk -> contributions in the last backward pass
        self._arrived: dict[int, int] = {}  # ... in this one
        self.early = 0  # chunks reduce-scattered before the end of their backward pass (statistics)
        self.used: dict[int, frozenset] = {}  # chunk -> its parameters read through ``gemini_use``
        self._done: dict[int, set] = {}  # chunk -> its parameters whose gradient is complete in this pass

    def set_used(self, names) -> None:
        """The parameters the graph reads through ``gemini_use`` (``hooks.instrument``)."""
        names = set(names)
        self.used = {c.index: frozenset(s.name for s in c.slots if s.name in names) for c in self.manager.chunks}

    def done(self, name: str) -> None:
        """Parameter ``name``'s ``gemini_use`` backward ran: every contribution to its gradient
        in this pass has arrived (partial ones come from nodes after it in forward, so before
        it in backward). A chunk that scatters its gradient is reduce-scattered as soon as all
        of its used parameters are done -- known in the first pass too, unlike the counts."""
        chunk = self.manager.chunk_of[name]
        if not chunk.scatters:
            return
        if not self._queued:  # the round ends with this backward pass
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
        finished = self._done.setdefault(chunk.index, set())
        finished.add(name)
        if chunk.acc and finished >= self.used.get(chunk.index, frozenset(chunk.names)):
            self.early += 1
            self._scatter(chunk)
            finished.clear()  # a later forward's contributions (accumulation) start a new round

    def _buffer(self, chunk) -> torch.Tensor:
        if chunk.grad is None:
            if chunk.home == DEVICE:
                self.manager._make_room(chunk.grad_bytes)  # streamed chunks may have to go first
            chunk.grad = self.manager._buffer(chunk.grad_elems, chunk.dtype, chunk.home, zero=True)
            self.manager.ledger.add("alloc_grad", chunk.index, chunk.home, chunk.grad_bytes)
        return chunk.grad

    def owns(self, chunk, grad) -> bool:
        """Is ``grad`` (a parameter's ``.grad``) a view of ``chunk``'s gradient buffer?"""
        return (grad is not None and chunk.grad is not None
                and local_of(grad).untyped_storage().data_ptr() == chunk.grad.untyped_storage().data_ptr())

    @torch.no_grad()
    def slot(self, name: str) -> torch.Tensor:
        """Parameter ``name``'s gradient slice, its ``.grad`` pointing at it (a ``.grad`` from
        elsewhere is copied in; none: the slice starts at zero)."""
        manager = self.manager
        p, chunk = manager.params[name], manager.chunk_of[name]
        was = p.grad
        if self.owns(chunk, was):
            return chunk.view(chunk.grad, name)
        view = chunk.view(self._buffer(chunk), name)
        if was is None:
            view.zero_()
        else:
            view.copy_(local_of(was))
        p.grad = wrap_like(view, p)
        return view

    @torch.no_grad()
    def arrive(self, name: str, grad: torch.Tensor, partial_axes: tuple[int, ...] = ()) -> None:
        """Parameter ``name``'s local gradient from this backward pass (partial over
        ``partial_axes``: only for a sharded chunk), added to its ``.grad``."""
        manager = self.manager
        p, chunk = manager.params[name], manager.chunk_of[name]
        if chunk.scatters:
            self._accumulate(chunk, name, grad, tuple(sorted(partial_axes)))
            return
        assert not partial_axes, (name, partial_axes)
        if p.grad is None:  # the common case: copy, no zero fill first
            view = chunk.view(self._buffer(chunk), name)
            view.copy_(grad.reshape(view.shape))
            p.grad = wrap_like(view, p)
        else:
            view = self.slot(name)
            view.add_(grad.reshape(view.shape))

    def _accumulate(self, chunk, name: str, grad: torch.Tensor, axes: tuple[int, ...]) -> None:
        manager = self.manager
        acc = chunk.acc.get(axes)
        if acc is None:
            manager._make_room(chunk.padded_bytes)
            acc = chunk.acc[axes] = manager._buffer(chunk.padded_elems, chunk.dtype, DEVICE, zero=True)
            manager.ledger.add("alloc_acc", chunk.index, DEVICE, chunk.padded_bytes)
        view = chunk.view(acc, name)
        view.add_(grad.reshape(view.shape))
        chunk.grad_names.add(name)
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
        arrived = self._arrived[chunk.index] = self._arrived.get(chunk.index, 0) + 1
        if arrived == self._expected.get(chunk.index):
            self.early += 1
            self._scatter(chunk)

    @torch.no_grad()
    def _scatter(self, chunk) -> None:
        """``chunk``'s accumulators reduce-scattered into its gradient shard, and freed."""
        manager = self.manager
        for axes in sorted(chunk.acc):
            mine = scatter_sum(chunk.acc[axes], axes, chunk, manager.pmesh)
            shard = self._buffer(chunk)
            shard.add_(mine.to(shard.device))
            del mine
            chunk.acc.pop(axes)
            manager.ledger.add("free_acc", chunk.index, DEVICE, -chunk.padded_bytes)

    def flush(self) -> None:
        """End of backward: what is left of the sharded chunks' accumulators, reduce-scattered."""
        self._queued = False
        for chunk in self.manager.chunks:
            self._scatter(chunk)
        self._expected, self._arrived, self._done = self._arrived, {}, {}

    def clear_sharded(self, *, set_to_none: bool = True) -> None:
        """Sharded chunks' gradient shards freed (or zeroed)."""
        for chunk in self.manager.chunks:
            if chunk.scatters and chunk.grad is not None:
                if set_to_none:
                    chunk.grad = None
                    chunk.grad_names.clear()
                    self.manager.ledger.add("free_grad", chunk.index, chunk.home, -chunk.grad_bytes)
                else:
                    chunk.grad.zero_()

    def target(self, name: str):
        """The gradient bucketer's delivery target for ``name``: the parameter, its ``.grad``
        a view of the chunk (the bucketer adds the reduced gradient into it)."""
        assert not self.manager.chunk_of[name].scatters, name  # their slots leave the bucketer (gradsync)
        self.slot(name)
        return self.manager.params[name]

    def free_unused(self) -> None:
        """Free the gradient chunks no parameter's ``.grad`` refers to (sharded chunks' shards
        are the optimizer's to clear: no ``.grad`` refers to them)."""
        manager = self.manager
        for chunk in manager.chunks:
            if chunk.grad is not None and not chunk.scatters and not any(
                    self.owns(chunk, manager.params[s.name].grad) for s in chunk.slots):
                chunk.grad = None
                manager.ledger.add("free_grad", chunk.index, chunk.home, -chunk.grad_bytes)

    @torch.no_grad()
    def move(self, chunk, old_home: str, home: str) -> None:
        """``chunk``'s gradient buffer onto tier ``home`` (its payload moved there), the
        parameters' ``.grad`` re-pointed at the new buffer."""
        old = chunk.grad
        if old is None:
            return
        manager = self.manager
        ours = [s.name for s in chunk.slots if self.owns(chunk, manager.params[s.name].grad)]
        chunk.grad = manager._buffer(chunk.grad_elems, chunk.dtype, home)
        chunk.grad.copy_(old)
        manager.ledger.add("free_grad", chunk.index, old_home, -chunk.grad_bytes)
        manager.ledger.add("alloc_grad", chunk.index, home, chunk.grad_bytes)
        for name in ours:
            p = manager.params[name]
            p.grad = wrap_like(chunk.view(chunk.grad, name), p)

