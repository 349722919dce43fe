"""Bucketed gradient all-reduce for parameters whose gradient is partial (data parallelism).

A strategy that reads a replicated parameter but computes on a shard of the batch produces a
*partial* gradient for it; the emitted graph used to route such a parameter through
``self.grad_all_reduce(w, axes=...)``, one blocking all-reduce per parameter in backward.
Here those parameters go through ``self.grad_bucket(w, axes=..., slot=k)`` instead:

- forward is the identity (a view of ``w`` on the autograd tape, so every use of ``w`` in the
  graph -- GPT-2's tied ``wte`` is read by the embedding and the LM head -- feeds ONE node whose
  backward receives the fully accumulated local gradient of this backward pass). When ``w`` is
  a parameter's ``dtensors.LocalLeaf`` read by this slot alone (``use_leaf``), forward returns
  it as is and the leaf's accumulator hook hands its gradient over (``leaf_arrived``), as DDP's
  hooks on the parameters' accumulators do: no autograd node per parameter per step;
- its backward copies that local gradient into a flat bucket buffer and returns ``None`` (so
  autograd does not accumulate the unreduced value into ``w.grad``);
- buckets are laid out statically when the graph is emitted: slots in reverse forward order
  (roughly the order their gradients become ready), grouped by (mesh axes, dtype), cut as DDP
  cuts them (``layout.buckets.split_buckets``: a bucket closes once it holds ``cap`` bytes, 25
  MiB by default, the first of each group once it holds 1 MiB, DDP's first bucket,
  ``AUTOPAR_FIRST_BUCKET_CAP_MB``). A bucket is all-reduced asynchronously as
  soon as it is complete and every bucket before it has been issued, so every rank issues the
  same collectives in the same order and communication overlaps the rest of backward; a
  bucket summed over several mesh axes (data parallelism over both axes of a 2-D mesh) is ONE
  all-reduce on the group spanning them (``ProcessMesh.group_over``), as DDP's over the world,
  not a chain whose later axes could only run once backward has ended (a pipeline stage's
  sub-mesh still chains: its group could not be made);
- at the end of the backward pass (an autograd engine callback) the remaining buckets are
  issued, every pending all-reduce is waited on, and each slot's reduced gradient is added to
  ``w.grad`` (or becomes it: a view into the bucket, no copy). When the graph reads the local
  tensor of a DTensor parameter (``AutoParallelModule``), ``deliver_to`` names that parameter
  and the gradient lands in its ``.grad`` as a DTensor with the parameter's placements.

ZeRO-2 parameters (``add_slot(..., shard=True)``) take the same path into *shard buckets*:
each local partial gradient is copied as it arrives into the bucket's send buffer, laid out
for the reduce-scatter (``runtime.zero.comm.ScatterPlan``, built once per bucket; the send
buffer lives until its collective is done, the receive buffer is kept), and when the bucket
is complete and its turn in the static order comes it is reduce-scattered -- one collective per
mesh axis, the first left in flight while backward goes on -- straight into the optimizer
pieces' gradients (views of the receive buffer, no copy).

The result equals the per-parameter all-reduce: ``grad += sum over ranks of the local partial
gradient``, accumulation over several backward passes included (only the new contribution is
reduced). A slot whose gradient arrives again after its bucket was issued (two forwards, one
backward) is reduced in a second round at the end, so nothing is lost.

Gradient accumulation without communication (DDP's ``no_sync``, ``Booster.no_sync``): a
forward run under ``bucketer.no_sync()`` marks its backward as local; that backward adds each
slot's local partial gradient to a per-slot stash and reduces nothing. The next synced
backward adds the stash to the slot's fresh local gradient before bucketing, so one
all-reduce (or reduce-scatter) carries the sum of every accumulated micro-step: the same
``sum over ranks`` of the same local terms as reducing each step, with 1/N of the traffic.
The flag is read at forward, as DDP does, so ``backward`` may run after the ``with`` block.

``AUTOPAR_BUCKET_CAP_MB`` sets the cap when a graph is emitted; ``0`` disables bucketing (the
per-parameter in-graph ``grad_all_reduce``). Gradients reach parameters through
``loss.backward()``; ``torch.autograd.grad`` with respect to bucketed parameters is not
supported (their gradients are delivered into ``.grad``).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.layout.buckets import DEFAULT_CAP_MB, bucket_cap_bytes, first_cap_bytes_default, split_buckets
from autopar.runtime.counting import record
from autopar.runtime.dist_ops import blocking, issue, wait
from autopar.runtime.dtensors import grad_like, local_of
from autopar.runtime.process_mesh import ProcessMesh

__all__ = ["DEFAULT_CAP_MB", "GradBucketer", "bucket_cap_bytes"]

_MAX_OPEN_PASSES = 8  # nested (reentrant) backward passes open at once, at most


@dataclass(frozen=True)
class _Slot:
    name: str  # the parameter's node name, for messages
    axes: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    shard: bool = False  # ZeRO-2: reduce-scattered into this device's piece (a shard bucket)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class _Bucket:
    axes: tuple[int, ...]
    dtype: torch.dtype
    shard: bool = False  # ZeRO-2 slots: reduce-scattered into their pieces, no flat buffer
    slots: list[int] = field(default_factory=list)
    offsets: dict[int, int] = field(default_factory=dict)
    numel: int = 0


class _Pass:
    """What one backward pass has gathered so far."""

    def __init__(self, num_buckets: int) -> None:
        self.flat: list[torch.Tensor | None] = [None] * num_buckets
        self.ready: list[set[int]] = [set() for _ in range(num_buckets)]
        self.params: dict[int, torch.Tensor] = {}
        # In issue order: (bucket, flat, all-reduce work, axes left) or, for a shard bucket,
        # (bucket, its slots, ScatterWork, ()).
        self.scatters: dict[int, Any] = {}  # shard bucket -> its ScatterWork, filling (runtime.zero.comm)
        self.works: list[tuple[int, Any, Any, tuple[int, ...]]] = []
        self.next_issue = 0
        self.late: dict[int, torch.Tensor] = {}  # slot -> local gradient that came after its bucket left
        self.late_shards: dict[int, torch.Tensor] = {}  # the same, after its bucket left


class GradBucketer(nn.Module):
    """The ``grad_bucket`` module of an emitted graph (see the module docstring)."""

    def __init__(self, pmesh: ProcessMesh, cap_bytes: int, first_cap_bytes: int | None = None) -> None:
        super().__init__()
        if cap_bytes <= 0:
            raise ValueError(f"bucket cap must be positive, got {cap_bytes} bytes")
        self.pmesh = pmesh
        self.cap_bytes = int(cap_bytes)
        # The first bucket to leave (per group of axes and dtype) is small, as DDP's: its
        # gradients are ready early in backward, so its all-reduce overlaps the rest of backward
        # instead of one 25 MiB bucket waiting for the last gradient of the step.
        # (clamped to ``cap_bytes``, 0 meaning none, where the cut is made: ``split_buckets``)
        self.first_cap_bytes = int(first_cap_bytes_default() if first_cap_bytes is None else first_cap_bytes)
        self.slots: list[_Slot] = []
        self._buckets: list[_Bucket] | None = None
        self._bucket_of: dict[int, int] = {}
        # One pass per autograd graph task (a reentrant checkpoint's nested backward is its own
        # task, delivered at its own end); a task that raised never reaches its end callback,
        # and its pass cannot leak into the next backward.
        self._passes: dict[int, _Pass] = {}
        self._flats: dict[int, torch.Tensor] = {}  # bucket -> flat buffer kept for the next pass
        # bucket -> (its kept flat buffer, slot -> view of that buffer): slicing each slot's view
        # anew cost two tensor ops per parameter twice a step (copy in, deliver).
        self._views: dict[int, tuple[torch.Tensor, dict[int, torch.Tensor]]] = {}
        self._params: dict[int, torch.Tensor] = {}  # slot -> the parameter it last delivered to
        self._target: Callable[[str], torch.Tensor] | None = None  # see deliver_to
        self._piece: Callable[[str], Any] | None = None  # see deliver_shards_to
        self._scatter_plans: dict[int, Any] = {}  # shard bucket -> its ScatterPlan (for the pieces above)
        self._mesh_spec: Any = None  # see deliver_shards_to
        self._scratch: Any = None  # see deliver_shards_to
        self.stats: Counter = Counter()  # buckets / all_reduces / bytes issued (this process)
        self.sync = True  # False under no_sync(): forwards then accumulate their gradients locally
        self._stash: dict[int, torch.Tensor] = {}  # slot -> unreduced local gradient (no_sync steps)
        # slot -> the LocalLeaf tensor whose gradient arrives without an autograd node (use_leaf),
        # and whether its last forward ran synced (read when its gradient arrives, as DDP does)
        self._leaves: dict[int, torch.Tensor] = {}
        self._leaf_sync: dict[int, bool] = {}

    # ------------------------------------------------------------------------- build time
    def add_slot(self, name: str, axes: Sequence[int], shape: Sequence[int], dtype: torch.dtype, *,
                 shard: bool = False) -> int:
        """Register one bucketed parameter use (in forward order); returns its slot number.
        ``shard``: a ZeRO-2 parameter, reduce-scattered into its piece (``deliver_shards_to``)."""
        self.slots.append(_Slot(name, tuple(sorted(axes)), tuple(int(s) for s in shape), dtype, shard))
        self._buckets = None
        return len(self.slots) - 1

    @property
    def buckets(self) -> list[_Bucket]:
        if self._buckets is None:
            self._buckets, self._bucket_of = self._layout()
        return self._buckets

    def _layout(self) -> tuple[list[_Bucket], dict[int, int]]:
        # Slots in the order their gradients become ready (reverse forward), one cut per
        # (axes, dtype, shard) group (``layout.buckets.split_buckets``, the cut the planner
        # prices); buckets numbered in the order that walk opens them, the order they are issued.
        groups: dict[tuple, list[int]] = {}
        for slot in reversed(range(len(self.slots))):
            s = self.slots[slot]
            groups.setdefault((s.axes, s.dtype, s.shard), []).append(slot)
        cut = []
        for (axes, dtype, shard), slots in groups.items():
            sizes = [self.slots[i].numel * dtype.itemsize for i in slots]
            for members in split_buckets(sizes, cap=self.cap_bytes, first_cap=self.first_cap_bytes):
                cut.append((axes, dtype, shard, [slots[k] for k in members]))
        cut.sort(key=lambda b: -b[3][0])  # opened when its first (highest-numbered) slot arrives
        buckets: list[_Bucket] = []
        for axes, dtype, shard, members in cut:
            bucket = _Bucket(axes, dtype, shard)
            for slot in members:
                bucket.offsets[slot] = bucket.numel
                bucket.slots.append(slot)
                bucket.numel += self.slots[slot].numel
            buckets.append(bucket)
        return buckets, {slot: b for b, bucket in enumerate(buckets) for slot in bucket.slots}

    def extra_repr(self) -> str:
        total = sum(s.numel * s.dtype.itemsize for s in self.slots)
        return (f"{len(self.slots)} parameters, {total / 2**20:.2f} MiB in {len(self.buckets)} buckets "
                f"(cap {self.cap_bytes / 2**20:g} MiB)")

    def deliver_to(self, target: Callable[[str], torch.Tensor]) -> None:
        """Deliver each slot's reduced gradient to ``target(slot name)`` (a DTensor parameter
        whose local tensor the graph reads) instead of the tensor the graph passed in."""
        self._target = target

    def deliver_shards_to(self, piece: Callable[[str], Any], *, mesh: Any = None, scratch: Any = None) -> None:
        """ZeRO-2 slots: ``piece(slot name)`` is the parameter's ``runtime.zero.Piece``, whose
        ``master.grad`` receives this device's reduce-scattered piece of the gradient. ``mesh``:
        the plan's ``MeshSpec``, whose calibrated links say where an all-reduce sums a shard
        bucket faster than a reduce-scatter (``runtime.zero.comm.ScatterPlan``); ``scratch``: the
        optimizer's ``runtime.zero.comm.Scratch``, shared by every bucketer of the module, which
        the shard buckets' send buffers borrow."""
        self._piece, self._mesh_spec, self._scratch = piece, mesh, scratch
        self._scatter_plans.clear()  # (a new optimizer: new pieces)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forwards inside keep their parameters' gradients local (stashed, unreduced) until a
        forward outside it runs a backward, which reduces them together with its own."""
        old, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = old

    # -------------------------------------------------------------------------- run time
    def forward(self, x: torch.Tensor, *, axes: tuple[int, ...], slot: int) -> torch.Tensor:
        if not (torch.is_grad_enabled() and x.requires_grad):
            return x
        if self._leaves.get(slot) is x:  # the parameter's LocalLeaf: its gradient comes by leaf_arrived
            self._leaf_sync[slot] = self.sync
            return x
        return _BucketGrad.apply(x, self, slot, self.sync)

    def use_leaf(self, slot: int, leaf: torch.Tensor) -> None:
        """``leaf`` (a ``dtensors.LocalLeaf``'s tensor, read by this slot alone) hands its
        gradient to ``leaf_arrived`` itself: the slot passes it through with no autograd node."""
        self._leaves[slot] = leaf

    def leaf_arrived(self, slot: int, leaf: torch.Tensor, grad: torch.Tensor) -> None:
        """The gradient of ``slot``'s leaf, accumulated over this backward pass (as
        ``_BucketGrad.backward`` receives it); reduced or stashed as its last forward said."""
        if self._leaf_sync.get(slot, True):
            self._arrive(slot, leaf, grad)
        else:
            self._stash_grad(slot, grad)

    def drop_unsynced(self) -> None:
        """Forget no_sync micro-steps' stashed gradients (``zero_grad``: they are part of the
        gradients being zeroed, as DDP's accumulate in ``.grad``)."""
        self._stash.clear()

    def _stash_grad(self, slot: int, grad: torch.Tensor) -> None:
        prev = self._stash.get(slot)
        self._stash[slot] = grad.detach().clone() if prev is None else prev.add_(grad)

    def _arrive(self, slot: int, param: torch.Tensor, grad: torch.Tensor) -> None:
        stashed = self._stash.pop(slot, None)
        if stashed is not None:  # the no_sync micro-steps' local sum rides with this reduction
            grad = stashed.add_(grad)
        buckets = self.buckets
        task = torch._C._current_graph_task_id()
        st = self._passes.get(task)
        if st is None:
            if len(self._passes) >= _MAX_OPEN_PASSES:  # left behind by backward passes that raised
                del self._passes[min(self._passes)]
            st = self._passes[task] = _Pass(len(buckets))
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._finish, task))
        b = self._bucket_of[slot]
        bucket = buckets[b]
        if bucket.shard:
            if b < st.next_issue:  # its bucket already left: reduce this contribution at the end
                prev = st.late_shards.get(slot)
                st.late_shards[slot] = grad.detach().clone() if prev is None else prev + grad
                return
            work = st.scatters.get(b)
            if work is None:
                work = st.scatters[b] = self._scatter_plan(b).work()
            work.add(bucket.slots.index(slot), grad)
            st.ready[b].add(slot)
            self._issue_ready(st)
            return
        if self._target is not None:
            param = self._target(self.slots[slot].name)
        st.params[slot] = self._params[slot] = param
        if b < st.next_issue:  # its bucket already left: reduce this contribution at the end
            if slot in st.late:
                st.late[slot] = st.late[slot] + grad
            else:
                st.late[slot] = grad.detach().clone()
            return
        if st.flat[b] is None:
            st.flat[b] = self._buffer(b, bucket, grad.device)
        view = self._view(st.flat[b], bucket, slot)
        if grad.shape != view.shape:
            grad = grad.reshape(view.shape)
        if slot in st.ready[b]:
            view.add_(grad.to(view.dtype))
        else:
            view.copy_(grad)
            st.ready[b].add(slot)
        self._issue_ready(st)

    def _issue_ready(self, st: _Pass) -> None:
        """Issue buckets in their static order while the next one is complete."""
        buckets = self.buckets
        while st.next_issue < len(buckets) and len(st.ready[st.next_issue]) == len(buckets[st.next_issue].slots):
            self._issue(st, st.next_issue)

    def _buffer(self, b: int, bucket: _Bucket, device: torch.device) -> torch.Tensor:
        """Bucket ``b``'s flat buffer, reused across backward passes (a fresh allocation each
        pass costs page faults on CPU) unless a parameter's ``.grad`` still lives in it (the
        caller accumulates over passes), or another pass is using it."""
        flat = self._flats.get(b)
        if flat is not None and flat.device == device and not self._in_use(flat, bucket):
            return flat
        flat = self._flats[b] = torch.empty(bucket.numel, dtype=bucket.dtype, device=device)
        self._views[b] = flat, {slot: self._slice(flat, bucket, slot) for slot in bucket.slots}
        return flat

    def _in_use(self, flat: torch.Tensor, bucket: _Bucket) -> bool:
        ptr = flat.untyped_storage().data_ptr()
        if any(st.flat[b] is flat for st in self._passes.values() for b in range(len(st.flat))):
            return True
        for slot in bucket.slots:
            param = self._params.get(slot)
            grad = None if param is None else param.grad
            if grad is not None and local_of(grad).untyped_storage().data_ptr() == ptr:
                return True
        return False

    def _view(self, flat: torch.Tensor, bucket: _Bucket, slot: int) -> torch.Tensor:
        kept = self._views.get(self._bucket_of[slot])
        if kept is not None and kept[0] is flat:
            return kept[1][slot]
        return self._slice(flat, bucket, slot)

    def _slice(self, flat: torch.Tensor, bucket: _Bucket, slot: int) -> torch.Tensor:
        s = self.slots[slot]
        start = bucket.offsets[slot]
        return flat[start:start + s.numel].view(s.shape)

    def _issue(self, st: _Pass, b: int) -> None:
        """Start bucket ``b``'s all-reduce (asynchronously on its first mesh axis)."""
        bucket = self.buckets[b]
        st.next_issue = b + 1
        if bucket.shard:
            self._issue_shards(st, b)
            return
        flat = st.flat[b]
        if flat is None:
            return  # no slot of this bucket received a gradient in this pass (same on every rank)
        for slot in bucket.slots:
            if slot not in st.ready[b]:
                self._view(flat, bucket, slot).zero_()
        axes = tuple(a for a in bucket.axes if self.pmesh.axis_size(a) > 1)
        self.stats["buckets"] += 1
        if not axes:
            st.works.append((b, flat, None, ()))
            return
        work, rest = self._all_reduce_over(flat, axes, async_op=True)
        st.works.append((b, flat, work, rest))

    def _issue_shards(self, st: _Pass, b: int) -> None:
        """Start shard bucket ``b``'s reduce-scatter (its first mesh axis asynchronously)."""
        work = st.scatters.pop(b, None)
        if work is None:
            return  # no slot of this bucket received a gradient in this pass (same on every rank)
        self._count_scatter(self.buckets[b].slots, work)
        work.start(async_op=True)
        st.works.append((b, self.buckets[b].slots, work, ()))

    def _count_scatter(self, slots: list[int], work) -> None:
        self.stats["reduce_scatters"] += 1
        self.stats["bytes"] += sum(self.slots[slot].numel * self.slots[slot].dtype.itemsize
                                   for slot, added in zip(slots, work.added) if added)

    def _scatter_plan(self, b: int, slots: list[int] | None = None):
        """The reduce-scatter plan of shard bucket ``b`` (kept), or of ``slots`` (late
        contributions: a one-off): each slot's piece, partial axes and dtype."""
        from autopar.runtime.zero.comm import ScatterPlan  # zero.comm imports nothing of this module

        plan = self._scatter_plans.get(b) if slots is None else None
        if plan is not None:
            return plan
        items = []
        for slot in self.buckets[b].slots if slots is None else slots:
            s = self.slots[slot]
            piece = self._piece(s.name) if self._piece is not None else None
            if piece is None:
                raise RuntimeError(f"ZeRO-2 gradient of {s.name!r} has no optimizer piece to land in: build the "
                                   f"optimizer with model.optimizer(...)")
            items.append((piece, s.axes, s.dtype))
        plan = ScatterPlan(items, keep=slots is None, mesh=self._mesh_spec,
                           scratch=self._scratch if slots is None else None)
        if slots is None:
            self._scatter_plans[b] = plan
        return plan

    def _deliver_shards(self, slots: list[int], work) -> None:
        from autopar.runtime.zero.comm import deliver_grad  # zero.comm imports nothing of this module

        with torch.no_grad():
            for slot, mine in zip(slots, wait(work)):
                if mine is not None:
                    deliver_grad(self._piece(self.slots[slot].name).master, mine)

    def _all_reduce(self, flat: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool):
        self.stats["all_reduces"] += 1
        self.stats["bytes"] += flat.numel() * flat.element_size()
        record("all_reduce", flat.numel() * flat.element_size())
        return issue(dist.all_reduce, flat, group=group) if async_op else blocking(dist.all_reduce, flat, group=group)

    def _all_reduce_over(self, flat: torch.Tensor, axes: tuple[int, ...], *, async_op: bool):
        """(work, groups left): the sum over several mesh axes as ONE collective on the group
        spanning them (``ProcessMesh.groups_over``: in flight beside backward as a whole, where
        a chain would leave every axis but the first to the end of backward, synchronous), else
        the first axis's collective, the others' groups left to the caller (``_finish``), in order."""
        first, *rest = self.pmesh.groups_over(axes)
        work = self._all_reduce(flat, first, async_op=async_op)
        if not async_op:
            for group in rest:
                self._all_reduce(flat, group, async_op=False)
            return work, ()
        return work, tuple(rest)

    def _finish(self, task: int) -> None:
        """End of the backward pass: issue what is left, wait, deliver into ``.grad``."""
        st = self._passes.pop(task, None)
        if st is None:
            return
        buckets = self.buckets
        while st.next_issue < len(buckets):
            self._issue(st, st.next_issue)
        # Contributions that came after their bucket left: one more round, same static order.
        late_flats = []
        if st.late:
            for b, bucket in enumerate(buckets):
                slots = [s for s in bucket.slots if s in st.late]
                if not slots:
                    continue
                flat = torch.zeros(bucket.numel, dtype=bucket.dtype, device=st.late[slots[0]].device)
                for slot in slots:
                    self._view(flat, bucket, slot).copy_(st.late[slot].reshape(self.slots[slot].shape))
                axes = tuple(a for a in bucket.axes if self.pmesh.axis_size(a) > 1)
                if axes:
                    self._all_reduce_over(flat, axes, async_op=False)
                late_flats.append((b, flat, slots))
        late_shards = None
        if st.late_shards:  # sorted: the same slots in the same order on every rank
            slots = sorted(st.late_shards)
            work = self._scatter_plan(-1, slots).work()
            for i, slot in enumerate(slots):
                work.add(i, st.late_shards[slot])
            self._count_scatter(slots, work)
            work.start(async_op=False)
            late_shards = slots, work
        for b, flat, work, rest in st.works:
            if buckets[b].shard:
                self._deliver_shards(flat, work)
                continue
            if work is not None:
                wait(work)
            for group in rest:
                self._all_reduce(flat, group, async_op=False)
            self._deliver(st, buckets[b], flat, sorted(st.ready[b]))
        for b, flat, slots in late_flats:
            self._deliver(st, buckets[b], flat, slots)
        if late_shards is not None:
            self._deliver_shards(*late_shards)

    def _deliver(self, st: _Pass, bucket: _Bucket, flat: torch.Tensor, slots: list[int]) -> None:
        with torch.no_grad():
            for slot in slots:
                param = st.params[slot]
                reduced = self._view(flat, bucket, slot)
                if reduced.dtype != param.dtype:
                    reduced = reduced.to(param.dtype)
                if param.grad is not None:
                    local_of(param.grad).add_(reduced)
                elif isinstance(param, DTensor):
                    param.grad = grad_like(reduced, param)
                else:
                    param.grad = reduced if param.is_contiguous() else reduced.clone(
                        memory_format=torch.preserve_format)


class _BucketGrad(torch.autograd.Function):
    """Identity forward; backward hands the parameter's local gradient to the bucketer."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bucketer: GradBucketer, slot: int, sync: bool) -> torch.Tensor:
        ctx.bucketer, ctx.slot, ctx.param, ctx.sync = bucketer, slot, x, sync
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.sync:
            ctx.bucketer._arrive(ctx.slot, ctx.param, grad)
        else:
            ctx.bucketer._stash_grad(ctx.slot, grad)
        return None, None, None, None
