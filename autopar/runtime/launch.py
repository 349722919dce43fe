"""Run a function on N local processes joined in a torch.distributed process group.

Used by tests, ``make demo`` and ``calibrate --local N``. Processes start with the ``fork``
method (about 0.04 s per launch against about 4 s with ``spawn``), so ``fn`` may be a closure or
a test-local function -- except under a CUDA build of torch, which starts with ``spawn``
(``start_method``): there the parent's first backward (planning traces one) starts the autograd
engine's device threads and its first CUDA call initialises the driver, after which a forked
child can run neither autograd ("Unable to handle autograd's threading in combination with fork-
based multiprocessing", seen on an H200 machine with CUDA hidden) nor CUDA; ``fn`` and its
arguments must then pickle. ``AUTOPAR_START_METHOD`` overrides the choice. Each child
initialises the default process group (gloo on CPU), calls ``fn(rank, world_size, *args,
**kwargs)`` and sends its return value back (plain-pickled, so tensors are fine); the parent
returns the values in rank order, or raises ``RuntimeError`` carrying the first failing rank's
traceback. A child that hangs (a mismatched collective) is killed after ``timeout`` seconds in
all; one that dies without reporting (killed, a native crash) fails the run within a few
seconds. A launch whose ranks fail to join the process group -- gloo's loopback connect rarely
reports "Connection closed by peer" under load -- is made again once on a fresh port (``fn`` had
run on no rank), with a line on stderr.

``launch`` / ``launch_from_torch`` are the product notes' launchers (a training script's first
call): they join the default process group from explicit arguments or from the variables
``torchrun`` sets. ``get_default_parser`` and ``priority_execution`` are the notes' helpers
around them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as pyqueue
import socket
import sys
import argparse
import contextlib
import time
import traceback
from typing import Any, Callable, Iterator

__all__ = ["run_local", "free_port", "launch", "launch_from_torch", "get_default_parser", "priority_execution"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, world_size, listener, port, backend, fn, args, kwargs, queue, num_threads) -> None:
    import gc

    import torch
    import torch.distributed as dist

    # A forked rank inherits the parent's whole heap (a test process: millions of objects), most
    # of which it never frees. Frozen, it is skipped by the rank's full collections, which would
    # otherwise walk all of it and copy each of its pages on write (about 2 s of CPU per pass per
    # rank with the test suite's heap); what the rank allocates is collected as usual. The sweep
    # harness freezes before its forks for the same reason (tests/sweeps/harness.py).
    gc.freeze()

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
    )
    # Ranks share 2 cores here; one intra-op thread each avoids oversubscription.
    torch.set_num_threads(num_threads)
    try:
        # Rank 0 serves the store on the socket the parent bound (``run_local``), the others join it.
        if listener is not None:
            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=True, master_listen_fd=listener.detach(),
                                  wait_for_workers=False)
        else:
            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    except BaseException:  # noqa: BLE001 -- before ``fn``: the parent may launch again
        queue.put((rank, _RENDEZVOUS, traceback.format_exc()))
        return
    try:
        try:
            result = fn(rank, world_size, *args, **kwargs)
        finally:
            dist.destroy_process_group()
        # Plain pickle (bytes), not torch's shared-memory reductions: a tensor result would
        # otherwise hand the parent a file descriptor owned by a child that is about to exit.
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 -- everything goes back to the parent as text
        queue.put((rank, False, traceback.format_exc()))


_POLL_S = 0.5  # how often the parent looks for ranks that died without reporting
# A child's report that joining the process group failed, before ``fn`` ran on any rank: gloo's
# full-mesh connect on loopback was seen, about once in a few thousand launches under the test
# suite's load (sessions 28 and 29), to report "Connection closed by peer" at connectFullMesh.
_RENDEZVOUS = "rendezvous"
RENDEZVOUS_TRIES = 2  # launches at most when the ranks fail to join the group


def _check_alive(procs, results: dict, queue, deadline: float, timeout: float, world_size: int) -> None:
    """Raise when a rank exited without reporting (killed, segfault, ``os._exit``: the others
    would wait in a collective until the timeout) or when the deadline passed."""
    for rank, p in enumerate(procs):
        if rank in results or p.exitcode is None:
            continue
        try:  # a rank that reported just before exiting: its message may still be in flight
            item = queue.get(timeout=2.0)
        except pyqueue.Empty:
            raise RuntimeError(f"run_local: rank {rank} of {world_size} exited with code {p.exitcode} "
                               f"without reporting (killed, out of memory, or a crash in native code?)") from None
        queue.put(item)  # handled by the caller's next get
        return
    if time.monotonic() > deadline:
        missing = sorted(set(range(world_size)) - set(results))
        raise RuntimeError(f"run_local: ranks {missing} of {world_size} did not finish within {timeout} s "
                           f"(a collective that not every rank called?)")


def start_method() -> str:
    """``fork`` on a CPU build of torch, ``spawn`` on a CUDA/ROCm build (the module docstring says
    why); the environment variable ``AUTOPAR_START_METHOD`` (fork, spawn, forkserver) wins."""
    import torch

    chosen = os.environ.get("AUTOPAR_START_METHOD")
    if chosen is None:
        return "spawn" if (torch.version.cuda or torch.version.hip) else "fork"
    if chosen not in ("fork", "spawn", "forkserver"):
        raise ValueError(f"AUTOPAR_START_METHOD={chosen!r}: expected fork, spawn or forkserver")
    return chosen


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 240.0,
    num_threads: int = 1,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` forked processes. A launch
    whose ranks fail to join the process group (before ``fn`` ran anywhere) is made again on a
    fresh port, ``RENDEZVOUS_TRIES`` launches at most, each with its own ``timeout``."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    attempt = 1
    while True:
        try:
            return _run_once(fn, world_size, args, kwargs, backend=backend, timeout=timeout, num_threads=num_threads)
        except _RendezvousFailed as exc:
            if attempt >= RENDEZVOUS_TRIES:
                raise RuntimeError(str(exc)) from None
            print(f"run_local: the {world_size} ranks failed to join the process group "
                  f"({exc.summary}); launching again", file=sys.stderr, flush=True)
            attempt += 1


class _RendezvousFailed(Exception):
    def __init__(self, message: str, summary: str) -> None:
        super().__init__(message)
        self.summary = summary


def _run_once(fn, world_size: int, args: tuple, kwargs: dict, *, backend: str, timeout: float,
              num_threads: int) -> list[Any]:
    ctx = mp.get_context(start_method())
    queue = ctx.Queue()
    # The rendezvous port is bound here and listened on from the start, and rank 0 serves the store
    # on that very socket: a port merely found free and released could be taken before rank 0 bound
    # it (two test shards launch ranks at once; once, a rank of one joined the other's mesh:
    # "Connection closed by peer" at connectFullMesh). The store itself is not started here: its
    # server thread, busy with one rank's connection while the next rank forks, left that child a
    # locked resolver mutex (``getnameinfo``), and it hung in its own connect until the timeout.
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    procs = [
        ctx.Process(
            target=_child,
            args=(rank, world_size, listener if rank == 0 else None, port, backend, fn, args, kwargs, queue,
                  num_threads),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
    finally:
        listener.close()  # rank 0 holds its own descriptor of it now
    results: dict[int, Any] = {}
    failure: tuple[int, str] | None = None
    rendezvous = False
    finished = False
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size and failure is None:
            try:
                rank, ok, value = queue.get(timeout=_POLL_S)
            except pyqueue.Empty:
                _check_alive(procs, results, queue, deadline, timeout, world_size)
                continue
            if ok is not True:  # False: fn raised; _RENDEZVOUS: the rank could not join the group
                failure, rendezvous = (rank, value), ok == _RENDEZVOUS
                break
            results[rank] = pickle.loads(value)
        finished = failure is None
    finally:
        for p in procs:
            if not finished:
                p.kill()
            p.join(timeout=5 if finished else 1)
            if p.is_alive():
                p.kill()
                p.join(timeout=1)
    if failure is not None and rendezvous:
        rank, tb = failure
        last = tb.strip().splitlines()[-1] if tb.strip() else "no traceback"
        raise _RendezvousFailed(f"rank {rank} of {world_size} failed to join the process group:\n{tb}", last[:200])
    if failure is not None:
        rank, tb = failure
        # A rank that died silently is usually the cause of the others' collective errors.
        dead = [f"rank {r} of {world_size} exited with code {p.exitcode} without reporting; "
                for r, p in enumerate(procs) if r != rank and r not in results and p.exitcode not in (None, 0, -9)]
        raise RuntimeError(f"{''.join(dead)}rank {rank} of {world_size} failed:\n{tb}")
    return [results[r] for r in range(world_size)]


# ------------------------------------------------------------------------------- launchers
def _check_config(config: Any) -> None:
    # The notes pass ``config=dict()``; a legacy config's keys configured parallelism and AMP,
    # which are the plugin's here: dropping them silently would change training.
    if config not in (None, {}) and not (isinstance(config, dict) and not config):
        raise NotImplementedError(f"launch: config={config!r}: a legacy config's settings are not read; "
                                  f"give the parallel and precision settings to the Booster's plugin")


def launch(config: Any = None, rank: int = 0, world_size: int = 1, host: str = "localhost", port: int = 29500,
           backend: str | None = None, local_rank: int | None = None, seed: int = 1024,
           verbose: bool = True) -> None:
    """Join the default process group as ``rank`` of ``world_size`` at ``host:port`` (the notes'
    ``colossalai.launch``): ``backend`` None is NCCL when CUDA is available, else gloo; under
    NCCL the CUDA device is ``local_rank`` (default: ``rank``). ``torch.manual_seed(seed)`` on
    every rank, so a model built afterwards starts equal everywhere. A process group that
    exists already with this rank and world size (a test's ``run_local``, a caller's
    ``init_process_group``) is kept; a different one raises ``ValueError``."""
    import torch
    import torch.distributed as dist

    _check_config(config)
    for name, value in (("rank", rank), ("world_size", world_size), ("port", port)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"launch: {name} must be an int >= 0, got {value!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"launch: rank {rank} is not in range(world_size={world_size})")
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise ValueError(f"launch: this process is already rank {dist.get_rank()} of {dist.get_world_size()}, "
                             f"not rank {rank} of {world_size}")
    else:
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(rank if local_rank is None else local_rank)
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=world_size)
    torch.manual_seed(seed)
    if verbose and rank == 0:
        print(f"[autopar] launched: {world_size} rank(s), backend {dist.get_backend()}, seed {seed}", flush=True)


def launch_from_torch(config: Any = None, backend: str | None = None, seed: int = 1024, verbose: bool = True) -> None:
    """``launch`` with rank, world size, local rank and the rendezvous address from the
    environment ``torchrun`` sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT``); a missing one raises ``ValueError`` naming it."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    missing = [n for n in names if n not in os.environ]
    if missing:
        raise ValueError(f"launch_from_torch: environment variables {missing} are not set (start the script "
                         f"with torchrun, or call autopar.launch with explicit arguments)")
    env = {n: os.environ[n] for n in names}
    launch(config, rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]), host=env["MASTER_ADDR"],
           port=int(env["MASTER_PORT"]), backend=backend, local_rank=int(env["LOCAL_RANK"]), seed=seed,
           verbose=verbose)


def get_default_parser() -> argparse.ArgumentParser:
    """The notes' command-line parser of a training script: ``--config``, ``--host``, ``--port``,
    ``--world_size``, ``--rank``, ``--local_rank`` and ``--backend`` (what ``launch`` takes)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=str, help="path to a config file (not read; see launch)")
    parser.add_argument("--host", type=str, help="the master address for the process group")
    parser.add_argument("--port", type=int, help="the master port for the process group")
    parser.add_argument("--world_size", type=int, help="the number of processes")
    parser.add_argument("--rank", type=int, help="this process's rank")
    parser.add_argument("--local_rank", type=int, help="this process's rank on its machine")
    parser.add_argument("--backend", type=str, default=None, help="the torch.distributed backend")
    return parser


@contextlib.contextmanager
def priority_execution() -> Iterator[None]:
    """Rank 0 runs the block first, the other ranks after it (a dataset download or a cache
    written once, then read by everyone); without a process group the block just runs."""
    import torch.distributed as dist

    first = not dist.is_initialized() or dist.get_rank() == 0
    if not first:
        dist.barrier()
    try:
        yield
    finally:
        if first and dist.is_initialized():
            dist.barrier()
