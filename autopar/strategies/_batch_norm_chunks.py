"""Per-rank batch norm: ``autopar::chunked_batch_norm`` (``batch_norm_stats="per_rank"``).

The op (``autopar.tracer.batch_stats``) normalises each of ``chunks`` equal contiguous pieces of
the batch (dim 0) by its own statistics, ``chunks`` the world size. A family beside ``_norm.py``'s
batch norm, whose global statistics cost two blocking collectives on a batch split; this one
splits the batch with none for the normalisation:

- channel split: exact with the plain op (statistics per channel); the per-channel tensors split
  alike, each rank updating its slice of the running statistics;
- batch split (``input`` S0 -> S0): a rank holds ``chunks / shards`` WHOLE chunks -- every mesh
  axis size divides the world size and the split is contiguous, so ``shards`` divides ``chunks``
  (``_local_chunks`` checks it and refuses otherwise) -- and runs the op on them, with no
  collective in forward or backward; the weight and bias gradients are local partial sums,
  all-reduced through the derived ``grad_partial`` like every batch-split norm's. With running
  statistics, their one update needs every chunk's: the ``chunked_batch_norm_stats`` kernel
  sums the (2, C) sums of its chunks' means and unbiased variances over the batch axes, once per
  call. The calls of one forward on one communicator share ONE ``Comm.all_reduce_async`` of their
  sums laid end to end (``_StatsBatch``: a ResNet's 16 batch norms made 16 round trips, each a
  wake-up of the collective thread on the forward's path; DDP issues none): issued when backward
  reaches the first of them, so it flies under the rest of backward, and applied when that
  backward ends; at once under ``no_grad``; or before the same buffers' next update when a
  backward never came (``_RunningUpdate``). Priced by its bytes alone (its latency is off the
  step). Without running statistics the plain op runs (``local_args``);
- no spatial split: a chunk's statistics cover its spatial positions, which would need
  all-reduced sums (what the rule avoids).
"""

from __future__ import annotations

import functools

import torch

from autopar.layout.cost import collective_seconds
from autopar.layout.placement import Shard
from autopar.strategies._norm import _AFFINE, _STATS, _batch_axes, _channel_bytes, _per_channel_splits, _stats
from autopar.strategies.kernel_context import KernelContext
from autopar.strategies.registry import AxisOption, OpInfo, Sample, register, register_kernel
from autopar.strategies.samples import rand
from autopar.tracer.batch_stats import chunk_normalise, chunked_batch_norm, update_running

__all__: list[str] = []


def _local_chunks(info: OpInfo, spec, mesh_shape) -> int:
    """The chunks a rank holds when ``spec`` splits the batch: ``chunks / shards``, refused when the
    shards would cut a chunk (they cannot on a mesh of the world whose size ``chunks`` is)."""
    chunks = info.arg("chunks")
    shards = 1 if spec is None else spec.num_shards(0, mesh_shape)
    if chunks % shards:
        raise ValueError(f"{info.where()}: the batch split over {shards} devices would cut the {chunks} "
                         f"per-rank chunks of chunked_batch_norm (the chunks are the world's ranks: plan it "
                         f"on a mesh of that many devices)")
    return chunks // shards


def _local_args(info: OpInfo, bound, input_specs, output_specs, mesh_shape):
    bound["chunks"] = _local_chunks(info, input_specs[info.slot_index("input")], mesh_shape)
    return bound


def _stats_comm(info: OpInfo, input_specs, output_specs, mesh) -> tuple[float, float]:
    # The (2, C) chunk-statistic sums, in the running statistics' dtype, ride in the forward's one
    # all-reduce of every call's (``_StatsBatch``), issued as backward starts and applied when it
    # ends: no rank waits on the others, so its latency is not on the step; each call's bytes are
    # charged (the links and the sending CPU's).
    axes, channel_bytes = _channel_bytes(info, input_specs, mesh)
    size = 2 * channel_bytes // info.input("input").itemsize * info.input("running_mean").itemsize
    latency = collective_seconds("all_reduce", 0, mesh, axes)
    return max(collective_seconds("all_reduce", size, mesh, axes) - latency, 0.0), 0.0


class _RunningUpdate:
    """One call's running-statistics update, applied once: when the backward that reached the op
    ends (its batch's sum, issued at the start of that backward, long done by then), or before the
    same buffers' next update (a forward whose backward never ran), or at once when no backward
    will come (no grad)."""

    pending: dict[int, "_RunningUpdate"] = {}  # id(running_mean) -> its update not yet applied

    def __init__(self, wait, running_mean, running_var, chunks: int, momentum: float) -> None:
        self.wait, self.running_mean, self.running_var = wait, running_mean, running_var
        self.chunks, self.momentum = chunks, momentum

    def __call__(self) -> None:
        if _RunningUpdate.pending.get(id(self.running_mean)) is self:
            del _RunningUpdate.pending[id(self.running_mean)]
        if self.wait is not None:
            wait, self.wait = self.wait, None
            update_running(self.running_mean, self.running_var, wait() / self.chunks, self.momentum)

    @classmethod
    def flush(cls, running_mean) -> None:
        earlier = cls.pending.get(id(running_mean))
        if earlier is not None:
            earlier()


class _StatsBatch:
    """The local statistic sums of one forward's calls on one communicator and set of axes,
    all-reduced as ONE flat tensor (the same elementwise sums as one all-reduce per call): it
    collects until it is issued -- by the first backward to reach one of its calls (then every
    member's update is applied when that backward ends), or by a member's update being needed
    (``_RunningUpdate.flush``); calls after that open the next batch. Every rank runs the same
    graph, so every rank issues the same batches at the same point of its collectives' order."""

    open: dict[tuple, "_StatsBatch"] = {}  # (comm, axes, dtype, device) -> the batch still collecting

    def __init__(self, comm, axes, key: tuple) -> None:
        self.comm, self.axes, self.key = comm, axes, key
        self.sums: list[torch.Tensor] = []
        self.updates: list[_RunningUpdate] = []
        self.wait = None  # the issued all-reduce's result function
        self.reduced: list[torch.Tensor] | None = None
        self.queued = False  # an end-of-backward application is queued

    @classmethod
    def join(cls, comm, axes, sums: torch.Tensor, running_mean, running_var, chunks: int,
             momentum: float) -> tuple[_RunningUpdate, "_StatsBatch"]:
        """(the update of one call whose local ``sums`` ride in the open batch of ``comm``/``axes``,
        that batch)."""
        key = (comm, axes, sums.dtype, sums.device)
        batch = cls.open.get(key)
        if batch is None:
            batch = cls.open[key] = cls(comm, axes, key)
        update = _RunningUpdate(functools.partial(batch.result, len(batch.sums)), running_mean, running_var,
                                chunks, momentum)
        batch.sums.append(sums)
        batch.updates.append(update)
        return update, batch

    def issue(self) -> None:
        if self.wait is not None:
            return
        if _StatsBatch.open.get(self.key) is self:
            del _StatsBatch.open[self.key]
        self.wait = self.comm.all_reduce_async(torch.cat([s.reshape(-1) for s in self.sums]), self.axes)

    def result(self, index: int) -> torch.Tensor:
        self.issue()
        if self.reduced is None:
            self.reduced = list(self.wait().split([s.numel() for s in self.sums]))
        return self.reduced[index].view(self.sums[index].shape)

    def reached_in_backward(self) -> None:
        """A backward reached a member: issue now (it flies under the rest of backward) and apply
        every member's update when this backward ends."""
        self.issue()
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.apply)

    def apply(self) -> None:
        """Every member's update not applied yet: the members alike (one graph's batch norms)
        together, one division and four foreach ops -- per element the arithmetic of
        ``update_running`` on each (on CPU torch's foreach ops loop over the per-tensor ones),
        without a Python call, a grad-mode switch and four op calls per batch norm at the end
        of backward."""
        alike: dict[tuple, list[int]] = {}
        for i, u in enumerate(self.updates):
            if u.wait is not None:
                alike.setdefault((u.chunks, u.momentum, u.running_var is None), []).append(i)
        for (chunks, momentum, no_var), members in alike.items():
            self.result(members[0])  # issued and waited for
            scaled = [self.reduced[i].view(self.sums[i].shape) / chunks for i in members]
            updates = [self.updates[i] for i in members]
            for u in updates:
                u.wait = None
                if _RunningUpdate.pending.get(id(u.running_mean)) is u:
                    del _RunningUpdate.pending[id(u.running_mean)]
            with torch.no_grad():
                _moving_average([u.running_mean for u in updates], [s[0] for s in scaled], momentum)
                if not no_var:
                    _moving_average([u.running_var for u in updates], [s[1] for s in scaled], momentum)


def _moving_average(running: list[torch.Tensor], stats: list[torch.Tensor], momentum: float) -> None:
    """``r.mul_(1 - momentum).add_(s, alpha=momentum)`` for each pair (``update_running``)."""
    stats = [s.to(r.dtype) for r, s in zip(running, stats)]
    torch._foreach_mul_(running, 1 - momentum)
    torch._foreach_add_(running, stats, alpha=momentum)


def _reached(batch: _StatsBatch, grad: torch.Tensor) -> None:
    """The hook on a call's output: backward reached the op (a tensor hook, not an identity
    autograd Function: no Python node per batch norm in forward)."""
    batch.reached_in_backward()


@register_kernel("chunked_batch_norm_stats", comm_cost=_stats_comm)
def chunked_batch_norm_stats(ctx: KernelContext, input, weight, bias, running_mean, running_var, momentum, eps,
                             chunks):
    spec = ctx.spec("input")
    local = _local_chunks(ctx.info, spec, ctx.mesh_shape)
    if input.shape[0] % local:
        raise ValueError(f"{ctx.info.where()}: a local batch of {input.shape[0]} cannot hold {local} equal chunks")
    _RunningUpdate.flush(running_mean)  # the previous call's, if its backward never ran: in call order
    y, sums = chunk_normalise(input, weight, bias, eps, local, stats_dtype=running_mean.dtype)
    if not (torch.is_grad_enabled() and y.requires_grad):  # no backward to come: summed and applied now
        _RunningUpdate(ctx.comm.all_reduce_async(sums, _batch_axes(spec)), running_mean, running_var, chunks,
                       momentum)()
        return y
    # The other ranks' chunks matter to the running statistics only: their sum goes with this
    # forward's other calls' when backward starts (_StatsBatch), so no rank waits for another.
    update, batch = _StatsBatch.join(ctx.comm, tuple(_batch_axes(spec)), sums, running_mean, running_var, chunks,
                                     momentum)
    _RunningUpdate.pending[id(running_mean)] = update
    y.register_hook(functools.partial(_reached, batch))
    return y


def _rule(info: OpInfo) -> list[AxisOption]:
    options = [info.option(Shard(1), input=Shard(1), **_per_channel_splits(info))]
    kernel = "chunked_batch_norm_stats" if info.input("running_mean") is not None else None
    options.append(info.option(Shard(0), input=Shard(0), kernel=kernel, grad_partial=_AFFINE))
    return options


def _samples() -> list[Sample]:
    # chunks = 4: the world of the check's meshes (4,) and (2, 2), as the trace would set it.
    return [
        Sample((rand(8, 8, 2, 2), rand(8), rand(8), *_stats(), 0.1, 1e-5, 4), label="running-stats",
               no_grad=_STATS),
        Sample((rand(8, 8, 3), None, None, None, None, 0.1, 1e-5, 4), label="no-running-stats"),
        Sample((rand(8, 4), rand(4), rand(4), None, None, 0.1, 1e-5, 4), label="2-d-affine"),
    ]


register(chunked_batch_norm, local_args=_local_args, samples=_samples)(_rule)
