"""The chunk manager: where each chunk's bytes are, exact per-tier accounting, fetch / evict / prefetch.

Forward: the emitted graph is instrumented (``hooks.instrument``) so that every parameter of a
host-home chunk is read through ``access`` just before its first reader and released after its
last (aliases such as views and the gradient-bucket identity count as readers): the chunk is
``COMPUTE`` in between and never evicted then. Backward: tensors autograd saves from a chunk's
device buffer are packed with the set of chunks in ``COMPUTE`` when they were saved; unpacking
fetches that set again (an op's saved parameters come back together), the previous set becomes
``HOLD``. Eviction (when a fetch would exceed the device budget) drops the ``HOLD`` chunk whose
next use, by the order recorded in the previous step, is furthest away (Gemini's OPT policy);
payloads are read-only during a step, so evicting frees the device buffer without a copy.
After each fetch the next chunk in the recorded order is prefetched when it fits without
evicting anything (a side stream on CUDA; synchronous on CPU, same code path).

Sharded chunks (``Chunk.sharded``) are streamed the same way: their fetch is an all-gather of
the ranks' shards into the device working copy (``shards.gather_into``, synchronous: collectives
keep one order on every rank, which the shared access order and byte counts guarantee), their
eviction drops it; ``replace`` shards (keeps this rank's slice) and unshards (all-gathers).

ZeRO chunks (``Chunk.zero``) keep their payload whole, their optimizer state as this rank's shard
(``mine`` cuts it); after the optimizer steps the shard, ``gather_payload`` all-gathers the whole
payload through a transient device buffer (``alloc_gather`` / ``free_gather`` in the ledger).

Recompute regions re-run in backward fetch their streamed chunks again (``recompute_access``,
from the region's input gates, ``hooks.gate_regions``), pinned until the region's backward is
done with them (``recompute_release``).

``ledger``: bytes per tier, allocated and freed through it only, so the figures are exact: the
device tier holds device-home payloads, resident host-home payloads, device optimizer state
(2 moments, the fp32 master unless it is the payload, a landing buffer for a host payload's
gradients) and the gradient chunks of device-home chunks (from the backward that makes them
to ``zero_grad``, ``grads``), sharded chunks' gathered copies and whole-gradient
accumulators while they exist; the host tier the rest. These are the model states the planner
prices per parameter (``offload_info["device_model_bytes"]``). Every move (alloc, free, fetch,
prefetch, evict, alloc_grad, free_grad) is logged with the device bytes after it; ``peak`` per tier.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from autopar.runtime.dtensors import local_of
from autopar.runtime.gemini.chunk import COMPUTE, DEVICE, FREE, HOLD, HOST, Chunk, Slot, pack, search_chunk_size
from autopar.runtime.gemini.grads import GradChunks
from autopar.runtime.gemini.shards import gather_into

__all__ = ["Ledger", "Move", "ChunkManager", "ChunkRange"]


@dataclass(frozen=True, slots=True)
class Move:
    event: str  # alloc | free | fetch | evict | prefetch
    chunk: int
    tier: str
    nbytes: int
    device_bytes: int  # device-tier bytes after the move
    host_bytes: int


@dataclass
class Ledger:
    budget: int | None = None
    bytes: dict = field(default_factory=lambda: {DEVICE: 0, HOST: 0})
    peak: dict = field(default_factory=lambda: {DEVICE: 0, HOST: 0})
    log: list = field(default_factory=list)

    def add(self, event: str, chunk: int, tier: str, nbytes: int) -> None:
        self.bytes[tier] += nbytes
        assert self.bytes[tier] >= 0, (event, chunk, tier, nbytes)
        self.peak[tier] = max(self.peak[tier], self.bytes[tier])
        self.log.append(Move(event, chunk, tier, nbytes, self.bytes[DEVICE], self.bytes[HOST]))
        if tier == DEVICE and self.budget is not None and self.bytes[DEVICE] > self.budget:
            raise RuntimeError(f"gemini: chunk {chunk} ({event}, {nbytes} B) brings the device tier to "
                               f"{self.bytes[DEVICE]} B, over its budget of {self.budget} B (the chunks one op "
                               f"needs at once do not fit: raise the budget or lower the chunk size)")


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkRange:
    """Chunk-size search range in elements (Gemini's ``search_range_m`` / ``min_chunk_size_m``)."""

    min_elems: int = 1024
    max_elems: int = 64 * 1024 * 1024
    step: int = 1024

    def __post_init__(self) -> None:
        for name in ("min_elems", "max_elems", "step"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise ValueError(f"chunk range {name} must be a positive int, got {v!r}")
        if self.max_elems < self.min_elems:
            raise ValueError(f"chunk range max_elems={self.max_elems} < min_elems={self.min_elems}")


class ChunkManager:
    """``stream_bytes``: the most bytes of host-home payloads resident on the device at once
    (``None``: bounded by ``budget`` only); chunks beyond it are evicted by next use, as for the
    budget, except those an op is using (``COMPUTE``), so it is a target, not a limit.
    Planned groups are packed without padding, host-home ones one parameter per chunk, the
    granularity the planner streams at (``_build``)."""

    def __init__(self, params: list[tuple[str, torch.nn.Parameter]], *, device: torch.device,
                 tiers_of, chunk_range: ChunkRange, pin_memory: bool, budget: int | None,
                 group_of=None, stream_bytes: int | None = None, dp_of=None, pmesh=None, zero_of=None) -> None:
        self.device = torch.device(device)
        self.pmesh = pmesh  # per-axis process groups, for sharded chunks' collectives
        self.pin = bool(pin_memory) and self.device.type == "cuda"
        self.ledger = Ledger(budget=budget)
        self.params = dict(params)
        self.chunks: list[Chunk] = []
        self.chunk_of: dict[str, Chunk] = {}
        self._build(params, chunk_range, group_of or (lambda name: None), dp_of or (lambda name: ((), (), ())),
                    zero_of or (lambda name: 0))
        for chunk, (home, optim) in zip(self.chunks, tiers_of([c.payload_bytes for c in self.chunks],
                                                              [c.optim_bytes for c in self.chunks], self.chunks)):
            self._place_initial(chunk, home, optim)
        self.padding = sum(c.capacity for c in self.chunks) - sum(s.numel for c in self.chunks for s in c.slots)
        self.stream_bytes = stream_bytes
        self.grads = GradChunks(self)
        self.streamed = 0  # bytes of host-home payloads resident on the device now
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._events: dict[int, object] = {}
        self.order: list[int] = []  # chunk accesses of the last complete step
        self._uses: dict[int, list[int]] = {}
        self.trace: list[int] = []
        self.backward_group: frozenset = frozenset()
        self.non_model_samples: list[int] = []
        self.saved: dict[int, int] = {}  # storage pointer -> bytes autograd saved (non-model data, CPU)
        self.recompute_pins: dict[int, list[list[Chunk]]] = {}  # region input gate -> chunks it pinned
        self._recompute_queued = False
        self.regathered = 0  # chunk accesses by recomputed regions (statistics)

    # ------------------------------------------------------------------------------ building
    def _build(self, params, chunk_range: ChunkRange, group_of, dp_of, zero_of) -> None:
        """Chunks per (dtype, group, data-parallel axes, ZeRO stage) in parameter order;
        ``group_of(name)``: the planned tiers; ``dp_of(name)``: (axes, their sizes, this rank's
        coordinates) the parameter is replicated over (so a chunk can be sharded over them:
        static policies; or its optimizer state: ``zero_of(name)``, the plan's ZeRO stage).
        A planned host-home group streams one parameter per chunk: the planner prices the
        device room per parameter (two in flight, or all that an op or a recomputed region pins
        at once), so a chunk shared with a neighbour would hold more on the device than it
        planned; a planned device-home group is packed in runs of at most its largest parameter;
        each such chunk is as large as what it holds (planned chunks need no common size), so
        they carry no padding the plan would not know of."""
        runs: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
        for name, p in params:
            dp = dp_of(name)
            zero = zero_of(name) if dp[0] else 0  # nothing to shard the state over: whole
            runs.setdefault((p.dtype, group_of(name), dp, zero), []).append((name, local_of(p)))
        for (dtype, group, dp, zero), items in runs.items():
            sizes = [t.numel() for _, t in items]
            # As the planner prices them: a planned group, and a ZeRO group (its whole gradient in
            # backward, its gathered payload after the step are per chunk), hold what they hold
            # without padding, in runs of at most their largest parameter; a planned host-home
            # group streams one parameter per chunk (a recomputed region pins every chunk it
            # reads at once: a neighbour packed with one of them would be pinned too).
            per_param = group is not None or zero > 0
            if per_param:
                capacity = max(sizes)
                runs_of = ([[i] for i in range(len(sizes))] if group is not None and group[0] == HOST
                           else pack(sizes, capacity))
            else:
                capacity, _ = search_chunk_size(sizes, min_elems=chunk_range.min_elems,
                                                max_elems=chunk_range.max_elems, step=chunk_range.step)
                runs_of = pack(sizes, capacity)
            for members in runs_of:
                if per_param:  # no padding to stream or hold (a ZeRO chunk's: only its shards')
                    capacity = sum(sizes[i] for i in members)
                slots, offset = [], 0
                for i in members:
                    name, t = items[i]
                    slots.append(Slot(name, offset, t.numel(), tuple(t.shape)))
                    offset += t.numel()
                chunk = Chunk(len(self.chunks), slots, capacity, dtype, group=group, dp_axes=dp[0], dp_sizes=dp[1],
                              dp_coords=dp[2], zero=zero)
                self.chunks.append(chunk)
                for s in slots:
                    self.chunk_of[s.name] = chunk

    def _buffer(self, n: int, dtype: torch.dtype, tier: str, *, zero: bool = False) -> torch.Tensor:
        device = self.device if tier == DEVICE else torch.device("cpu")
        pin = self.pin and tier == HOST
        return (torch.zeros if zero else torch.empty)(n, dtype=dtype, device=device, pin_memory=pin)

    @torch.no_grad()
    def _place_initial(self, chunk: Chunk, home: str, optim: str) -> None:
        buf = self._buffer(chunk.capacity, chunk.dtype, home, zero=True)
        self.ledger.add("alloc", chunk.index, home, chunk.payload_bytes)
        for s in chunk.slots:
            chunk.view(buf, s.name).copy_(local_of(self.params[s.name]))
        self._set_optim(chunk, home, optim, payload=buf, master=self.mine(chunk, buf) if chunk.zero else buf,
                        moments=None)
        self._set_home(chunk, home, buf)

    @torch.no_grad()
    def _set_optim(self, chunk: Chunk, home: str, optim: str, *, payload: torch.Tensor, master: torch.Tensor,
                   moments: tuple | None) -> None:
        """The optimizer state of ``chunk`` on tier ``optim`` with its payload ``payload`` on
        ``home``: master (``payload`` itself when both are fp32 on one tier, else a copy of
        ``master``, ``state_elems`` long), the moments (``moments`` moved there, or zeros) and the
        landing buffer."""
        n = chunk.state_elems
        if chunk.master_is_payload(home, optim):
            chunk.master = payload
        else:
            chunk.master = self._buffer(n, torch.float32, optim)
            chunk.master.copy_(master)
        for attr, value in zip(("exp_avg", "exp_avg_sq"), moments or (None, None)):
            buf = self._buffer(n, torch.float32, optim, zero=value is None)
            if value is not None:
                buf.copy_(value)
            setattr(chunk, attr, buf)
        chunk.landing = None if home == optim else self._buffer(n, torch.float32, optim, zero=True)
        self.ledger.add("alloc", chunk.index, optim, chunk.state_bytes(home, optim))
        chunk.optim_tier = optim

    def _set_home(self, chunk: Chunk, home: str, buf: torch.Tensor) -> None:
        """``buf`` becomes ``chunk``'s payload on tier ``home`` (a host chunk keeps an empty
        device buffer to fetch into) and its parameters view it."""
        chunk.home = home
        if chunk.sharded:  # the parameters view the working copy, gathered on use
            chunk.shard_buf, chunk.host_buf, chunk.state = buf, None, FREE
            chunk.device_buf = torch.empty(chunk.work_elems, dtype=chunk.dtype, device=self.device)
            self._point_params(chunk, chunk.device_buf)  # while the storage has its size (set_ checks it)
            chunk.device_buf.untyped_storage().resize_(0)
            self.mark_synced(chunk)
            return
        chunk.shard_buf = None
        if home == DEVICE:
            chunk.device_buf, chunk.host_buf, chunk.state = buf, None, HOLD
        else:
            chunk.host_buf, chunk.state = buf, FREE
            chunk.device_buf = torch.empty(chunk.capacity, dtype=chunk.dtype, device=self.device)
            chunk.device_buf.untyped_storage().resize_(0)
        self._point_params(chunk, buf)
        self.mark_synced(chunk)

    def _tier_device(self, tier: str) -> torch.device:
        return self.device if tier == DEVICE else torch.device("cpu")

    @torch.no_grad()
    def _point_params(self, chunk: Chunk, buf: torch.Tensor) -> None:
        """Each parameter's local tensor becomes a view of ``buf`` (same storage)."""
        for s in chunk.slots:
            local = _own_local(self.params[s.name])
            local.set_(buf.untyped_storage(), buf.storage_offset() + s.offset, s.shape, _stride(s.shape))

    @torch.no_grad()
    def replace(self, chunk: Chunk, home: str, optim: str, sharded: bool | None = None) -> None:
        """Move ``chunk``'s payload home and optimizer state to new tiers (after a warm-up, or
        a new policy), and shard or unshard it (``sharded``; None: as it is); a live gradient
        chunk moves with the payload. Unsharding all-gathers (every rank of the chunk's
        data-parallel group must re-place it alike); sharding keeps this rank's slice."""
        sharded = chunk.sharded if sharded is None else bool(sharded)
        if (home, optim, sharded) == (chunk.home, chunk.optim_tier, chunk.sharded):
            return
        reshard = sharded != chunk.sharded
        if reshard and chunk.zero:
            raise ValueError(f"gemini: chunk {chunk.index} shards its optimizer state by the plan's ZeRO-{chunk.zero}; "
                             f"it cannot be sharded ZeRO-3 style (shard_param_frac) too")
        if reshard and (chunk.grad is not None or chunk.acc):
            raise ValueError(f"gemini: chunk {chunk.index} holds gradients; call optimizer.zero_grad() before "
                             f"changing shard_param_frac")
        if sharded and chunk.num_shards < 2:
            raise ValueError(f"gemini: chunk {chunk.index} has no data-parallel axis to shard over (its parameters "
                             f"are replicated on no mesh axis of size > 1)")
        if chunk.resident and chunk.streamed:
            self.evict(chunk)
        old_home, old_optim, old_buf = chunk.home, chunk.optim_tier, self.home_buf(chunk)
        self.ledger.add("free", chunk.index, old_optim, -chunk.state_bytes(old_home, old_optim))
        buf, master, moments = old_buf, chunk.master, (chunk.exp_avg, chunk.exp_avg_sq)
        if home != old_home or reshard:
            self.ledger.add("free", chunk.index, old_home, -chunk.payload_bytes)
            if reshard:
                old_buf, master, *moments = [self._reshard(chunk, t, sharded) for t in (old_buf, master, *moments)]
                chunk.sharded = sharded
            buf = self._buffer(chunk.elems, chunk.dtype, home)
            buf.copy_(old_buf)
            self.ledger.add("alloc", chunk.index, home, chunk.payload_bytes)
        self._set_optim(chunk, home, optim, payload=buf, master=master, moments=moments)
        if home != old_home or reshard:
            self._set_home(chunk, home, buf)
            self.grads.move(chunk, old_home, home)

    @torch.no_grad()
    def make_zero(self, chunk: Chunk, stage: int) -> None:
        """An unsharded chunk becomes a ZeRO-``stage`` chunk (1 or 2): its payload stays whole, its
        fp32 master and moments (and under stage 2 its gradient) become this rank's shard over its
        data-parallel group. Gemini's rule for the chunks ``shard_param_frac`` leaves whole."""
        if stage not in (1, 2) or chunk.zero or chunk.sharded or chunk.num_shards < 2:
            raise ValueError(f"gemini: chunk {chunk.index} cannot become ZeRO-{stage} (zero={chunk.zero}, "
                             f"sharded={chunk.sharded}, {chunk.num_shards} data-parallel ranks)")
        if chunk.grad is not None or chunk.acc:
            raise ValueError(f"gemini: chunk {chunk.index} holds gradients; call optimizer.zero_grad() first")
        home, optim = chunk.home, chunk.optim_tier
        self.ledger.add("free", chunk.index, optim, -chunk.state_bytes(home, optim))
        master, *moments = [self.mine(chunk, t) for t in (chunk.master, chunk.exp_avg, chunk.exp_avg_sq)]
        chunk.zero = stage
        self._set_optim(chunk, home, optim, payload=self.home_buf(chunk), master=master, moments=tuple(moments))

    def _reshard(self, chunk: Chunk, t: torch.Tensor, sharded: bool) -> torch.Tensor:
        """``t`` (a whole-chunk buffer, or this rank's shard of one) as the other: this rank's
        slice of the zero-padded buffer, or all shards gathered (the padding dropped)."""
        size = chunk.shard_elems
        if sharded:
            padded = torch.zeros(size * chunk.num_shards, dtype=t.dtype, device=t.device)
            padded[:chunk.capacity].copy_(t)
            return padded[chunk.shard_index * size:(chunk.shard_index + 1) * size].clone()
        out = torch.empty(size * chunk.num_shards, dtype=t.dtype, device=self.device)
        gather_into(out, t.to(self.device), chunk, self.pmesh)
        return out[:chunk.capacity]

    @staticmethod
    def mine(chunk: Chunk, whole: torch.Tensor) -> torch.Tensor:
        """This rank's shard (``shard_elems``, zero-padded) of a whole-chunk buffer ``whole``."""
        n, base = chunk.shard_elems, chunk.shard_index * chunk.shard_elems
        out = torch.zeros(n, dtype=whole.dtype, device=whole.device)
        stop = min(base + n, chunk.capacity)
        if stop > base:
            out[:stop - base].copy_(whole[base:stop])
        return out

    @torch.no_grad()
    def gather_payload(self, chunk: Chunk) -> None:
        """A ZeRO chunk's whole payload from every rank's updated master shard (an all-gather
        over its data-parallel axes, on the device; every rank of the group must call it)."""
        self._make_room(chunk.padded_bytes)
        self.ledger.add("alloc_gather", chunk.index, DEVICE, chunk.padded_bytes)
        shard = chunk.master.to(device=self.device, dtype=chunk.dtype)
        whole = torch.empty(chunk.padded_elems, dtype=chunk.dtype, device=self.device)
        gather_into(whole, shard, chunk, self.pmesh)
        self.home_buf(chunk).copy_(whole[:chunk.capacity])
        if chunk.resident and chunk.streamed:  # a host-home payload's device copy is stale now
            chunk.device_buf.copy_(whole[:chunk.capacity])
        del whole, shard
        self.ledger.add("free_gather", chunk.index, DEVICE, -chunk.padded_bytes)

    @staticmethod
    def home_buf(chunk: Chunk) -> torch.Tensor:
        if chunk.sharded:
            return chunk.shard_buf
        return chunk.host_buf if chunk.home == HOST else chunk.device_buf

    def _versions(self, chunk: Chunk) -> int:
        """In-place writes through the parameters' own local tensors (``load_full_state_dict``);
        the manager writes through its buffers, which do not count here."""
        return sum(_own_local(self.params[s.name])._version for s in chunk.slots)

    def mark_synced(self, chunk: Chunk) -> None:
        """The master and the payload agree now."""
        chunk.synced_version = self._versions(chunk)

    @torch.no_grad()
    def sync_masters(self, *, force: bool = False) -> None:
        """fp32 masters re-read from payloads written since the last sync. A sharded chunk's
        parameters view its working copy, written only by ``Gemini``'s state loading, which
        brings the shards and masters up to date itself: they are re-read here when forced."""
        for chunk in self.chunks:
            home = self.home_buf(chunk)
            if force or (not chunk.sharded and self._versions(chunk) != chunk.synced_version):
                if chunk.zero:
                    chunk.master.copy_(self.mine(chunk, home))
                elif chunk.master is not home:
                    chunk.master.copy_(home)
                if chunk.resident and chunk.streamed and chunk.pins == 0:
                    self.evict(chunk)  # its device copy is stale
                self.mark_synced(chunk)

    # ----------------------------------------------------------------------------- fetching
    def start_pass(self) -> None:
        self._pos = 0
        self.trace = []
        self.saved = {}

    def end_step(self) -> None:
        """The accesses of a complete step become the order eviction and prefetch follow."""
        if self.trace:
            self.order = list(self.trace)
            self._uses = {}
            for i, c in enumerate(self.order):
                self._uses.setdefault(c, []).append(i)
        self.trace = []

    def access(self, chunk: Chunk) -> None:
        """``chunk`` on the device and pinned (``COMPUTE``); prefetch the next one."""
        self.trace.append(chunk.index)
        self._pos = len(self.trace)
        if chunk.streamed and not chunk.resident:
            self._fetch(chunk, event="fetch")
        event = self._events.pop(chunk.index, None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        chunk.pins += 1
        chunk.state = COMPUTE
        self._prefetch()

    def hold(self, chunk: Chunk) -> None:
        """``chunk`` on the device and pinned, outside the step's access order (state I/O)."""
        if chunk.streamed and not chunk.resident:
            self._fetch(chunk, event="fetch")
        chunk.pins += 1
        chunk.state = COMPUTE

    def release(self, chunk: Chunk) -> None:
        assert chunk.pins > 0, chunk.index
        chunk.pins -= 1
        if chunk.pins == 0:
            chunk.state = HOLD

    def recompute_access(self, gate: int, x: torch.Tensor, names: tuple[str, ...]) -> None:
        """A recompute region re-runs in backward and reads ``x``, which may view the device
        copy of one of ``names``' streamed chunks: fetch and pin that chunk until the gate's
        backward (``recompute_release``) or the end of backward."""
        storage = x.untyped_storage()._cdata
        chunks = []
        for name in names:
            chunk = self.chunk_of[name]
            if chunk.streamed and chunk not in chunks and chunk.device_buf.untyped_storage()._cdata == storage:
                self.access(chunk)
                chunks.append(chunk)
                self.regathered += 1
        self.recompute_pins.setdefault(gate, []).append(chunks)
        if not self._recompute_queued:
            self._recompute_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_recompute)

    def recompute_release(self, gate: int) -> None:
        stack = self.recompute_pins.get(gate)
        if stack:
            for chunk in stack.pop():
                self.release(chunk)

    def _end_recompute(self) -> None:
        self._recompute_queued = False
        for stack in self.recompute_pins.values():
            while stack:
                for chunk in stack.pop():
                    self.release(chunk)

    def _fetch(self, chunk: Chunk, *, event: str) -> None:
        self._make_room(chunk.work_bytes, keep=chunk)
        self._sample_non_model()
        chunk.device_buf.untyped_storage().resize_(chunk.work_bytes)
        self.streamed += chunk.work_bytes
        self.ledger.add(event, chunk.index, DEVICE, chunk.work_bytes)
        if chunk.sharded:  # an all-gather: on the compute stream (collectives keep their own order)
            shard = chunk.shard_buf.to(self.device, non_blocking=self.pin)
            gather_into(chunk.device_buf, shard, chunk, self.pmesh)
        elif self.stream is not None and event == "prefetch":
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                chunk.device_buf.copy_(chunk.host_buf, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.stream)
            self._events[chunk.index] = ev
        else:
            chunk.device_buf.copy_(chunk.host_buf, non_blocking=self.pin)
        if chunk.state == FREE:
            chunk.state = HOLD

    def evict(self, chunk: Chunk) -> None:
        assert chunk.streamed and chunk.pins == 0 and chunk.resident, chunk.index
        event = self._events.pop(chunk.index, None)
        if event is not None:
            event.synchronize()
        chunk.device_buf.untyped_storage().resize_(0)
        self.streamed -= chunk.work_bytes
        self.ledger.add("evict", chunk.index, DEVICE, -chunk.work_bytes)
        chunk.state = FREE

    def evict_all(self) -> None:
        for c in self.chunks:
            if c.streamed and c.resident and c.pins == 0:
                self.evict(c)

    def _next_use(self, chunk: Chunk) -> float:
        uses = self._uses.get(chunk.index, [])
        k = bisect.bisect_left(uses, self._pos)
        return uses[k] if k < len(uses) else float("inf")

    def _over(self, nbytes: int) -> bool:
        """Would ``nbytes`` more of streamed payload exceed the budget or the stream room?"""
        budget = self.ledger.budget
        return ((budget is not None and self.ledger.bytes[DEVICE] + nbytes > budget)
                or (self.stream_bytes is not None and self.streamed + nbytes > self.stream_bytes))

    def _make_room(self, nbytes: int, *, keep: Chunk | None = None) -> None:
        while self._over(nbytes):
            victims = [c for c in self.chunks if c.streamed and c.resident and c.pins == 0 and c is not keep]
            if not victims:
                return  # the ledger raises on the move that exceeds the budget; the stream room may stretch
            self.evict(max(victims, key=self._next_use))

    def _prefetch(self) -> None:
        if not self.order or self._pos >= len(self.order):
            return
        nxt = self.chunks[self.order[self._pos]]
        if not nxt.streamed or nxt.resident or self._over(nxt.work_bytes):
            return  # prefetch never evicts
        self._fetch(nxt, event="prefetch")

    # -------------------------------------------------------------------------- statistics
    def _sample_non_model(self) -> None:
        if self.device.type == "cuda":
            used = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.non_model_samples.append(max(0, used - self.ledger.bytes[DEVICE]))
        else:  # both tiers are host memory: non-model data = what autograd holds for backward
            self.non_model_samples.append(sum(self.saved.values()))

    def summary(self) -> dict:
        return {"num_chunks": len(self.chunks), "chunk_elems": sorted({c.capacity for c in self.chunks}),
                "padding_elems": self.padding, "device_bytes": self.ledger.bytes[DEVICE],
                "host_bytes": self.ledger.bytes[HOST], "peak_device_bytes": self.ledger.peak[DEVICE],
                "peak_host_bytes": self.ledger.peak[HOST], "num_moves": len(self.ledger.log),
                "tiers": [(c.home, c.optim_tier) for c in self.chunks],
                "sharded": [c.index for c in self.chunks if c.sharded], "regathered": self.regathered,
                "zero": {c.index: c.zero for c in self.chunks if c.zero}}


def _own_local(param) -> torch.Tensor:
    """The DTensor's own local tensor: ``to_local()`` of a parameter may hand out a fresh view."""
    return param._local_tensor if hasattr(param, "_local_tensor") else param.data


def _stride(shape) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(out))
