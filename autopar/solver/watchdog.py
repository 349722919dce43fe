"""A hard wall-clock limit on a function: run it in a forked child, kill the child at a deadline.

Why a child process: HiGHS (through highspy) solves in-process and has been seen to loop forever
in presolve, ignoring its own ``time_limit``; a thread cannot be stopped, a process can. Why
``fork`` and not ``spawn``: the child inherits the built model (``autopar.solver.linear``), so nothing is pickled on the
way in and no interpreter starts (a fork costs milliseconds, a spawned interpreter that imports
pulp and highspy a few hundred), and ``os.fork`` also works inside the daemonic processes that
``autopar.runtime.launch.run_local`` starts, where ``multiprocessing`` refuses to start children.

The child runs ``fn(report)``; ``report(message)`` streams a progress message to the parent (the
solvers send each improving solution, so a killed solve still has its best plan) and ``fn``'s
return value is the final message. The child leads its own process group, so killing the group
also ends what it started (CBC runs as a grandchild, through pulp's ``COIN_CMD``). No torch import.
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Pipe
from typing import Any, Callable

__all__ = ["ChildResult", "run_in_child"]


@dataclass(frozen=True, slots=True)
class ChildResult:
    """How a child run ended.

    ended:   ``"done"`` (``final`` is fn's return value), ``"error"`` (fn raised: ``detail``),
             ``"died"`` (exited without a word: crashed or killed from outside) or ``"killed"``
             (still running at the deadline).
    latest:  the last progress message, None if none came.
    seconds: wall-clock time from fork to the end.
    """

    ended: str
    final: Any = None
    latest: Any = None
    detail: str = ""
    seconds: float = 0.0


def _child_main(fn: Callable[[Callable[[Any], None]], Any], send) -> None:
    """The child's whole life; never returns into the parent's code (``os._exit``)."""
    code = 0
    try:
        os.setpgid(0, 0)
        send.send(("done", fn(lambda message: send.send(("progress", message)))))
    except BaseException as exc:  # noqa: BLE001 -- reported to the parent, which decides
        code = 1
        try:
            send.send(("error", f"{type(exc).__name__}: {exc}"))
        except BaseException:  # noqa: BLE001 -- the parent sees "died" instead
            pass
    finally:
        for stream in (sys.stdout, sys.stderr):  # the backend's log, with msg=True
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001
                pass
        os._exit(code)


def _end_group(pid: int) -> None:
    """Kill the child's process group (the child and anything it started) and reap the child."""
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            target()
            break
        except (ProcessLookupError, PermissionError):
            continue
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def run_in_child(fn: Callable[[Callable[[Any], None]], Any], *, deadline: float,
                 reuse: bool = False) -> ChildResult:
    """Run ``fn(report)`` in a child process until it returns or ``time.monotonic()`` reaches
    ``deadline``, whichever is first; a child still running then is killed.

    ``reuse``: run it in this process's long-lived worker (forked once; ``fn`` is pickled to it)
    instead of a fresh fork. A fork copies the parent's page tables -- about 40 ms for a
    600 MiB process on a small VM, twice per solve -- while a small model pickles in well under
    a millisecond; a worker that overran is killed and the next call forks a new one. A ``fn``
    that does not pickle takes the fresh fork."""
    if reuse:
        try:
            payload = pickle.dumps(fn)
        except Exception:  # noqa: BLE001 -- e.g. a closure: a fresh fork runs it
            payload = None
        if payload is not None:
            return _run_in_worker(payload, deadline=deadline)
    t0 = time.monotonic()
    recv, send = Pipe(duplex=False)
    pid = os.fork()
    if pid == 0:  # pragma: no cover -- the child; coverage tools do not follow it
        recv.close()
        _child_main(fn, send)
    send.close()
    try:
        os.setpgid(pid, pid)  # also here: killpg must find the group even if the child is slow to start
    except (ProcessLookupError, PermissionError):
        pass  # the child already set it, or already exited
    try:
        return _receive(recv, deadline, t0)
    finally:  # also on KeyboardInterrupt: no solver outlives its caller
        recv.close()
        _end_group(pid)


def _receive(recv, deadline: float, t0: float) -> ChildResult:
    """Progress messages until the final one, the child's end, or the deadline."""
    latest = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not recv.poll(left):
            return ChildResult("killed", latest=latest, seconds=time.monotonic() - t0)
        try:
            kind, payload = recv.recv()
        except (EOFError, OSError):
            return ChildResult("died", latest=latest, seconds=time.monotonic() - t0)
        if kind == "progress":
            latest = payload
        elif kind == "done":
            return ChildResult("done", final=payload, latest=latest, seconds=time.monotonic() - t0)
        else:
            return ChildResult("error", latest=latest, detail=payload, seconds=time.monotonic() - t0)


@dataclass
class _Worker:
    pid: int
    owner: int  # the process that forked it (a forked process never uses its parent's worker)
    jobs: Any  # parent -> worker: pickled functions
    results: Any  # worker -> parent: (kind, payload) messages


_worker: _Worker | None = None


def _worker_main(jobs, results) -> None:
    """The worker's whole life: run each job it is sent, answer as ``_child_main`` does."""
    code = 0
    try:
        os.setpgid(0, 0)
        while True:
            try:
                fn = pickle.loads(jobs.recv_bytes())
            except EOFError:  # the parent is gone
                break
            try:
                results.send(("done", fn(lambda message: results.send(("progress", message)))))
            except Exception as exc:  # noqa: BLE001 -- reported to the parent, which decides
                results.send(("error", f"{type(exc).__name__}: {exc}"))
    except BaseException:  # noqa: BLE001 -- the parent sees "died"
        code = 1
    finally:
        os._exit(code)


def _start_worker() -> _Worker:
    job_recv, job_send = Pipe(duplex=False)
    res_recv, res_send = Pipe(duplex=False)
    pid = os.fork()
    if pid == 0:  # pragma: no cover -- the worker
        job_send.close()
        res_recv.close()
        _worker_main(job_recv, res_send)
    job_recv.close()
    res_send.close()
    try:
        os.setpgid(pid, pid)
    except (ProcessLookupError, PermissionError):
        pass
    return _Worker(pid, os.getpid(), job_send, res_recv)


def _stop_worker() -> None:
    global _worker
    if _worker is not None and _worker.owner == os.getpid():
        for conn in (_worker.jobs, _worker.results):
            conn.close()
        _end_group(_worker.pid)
    _worker = None


def _run_in_worker(payload: bytes, *, deadline: float) -> ChildResult:
    global _worker
    t0 = time.monotonic()
    if _worker is None or _worker.owner != os.getpid():
        _worker = _start_worker()  # a parent's worker, inherited by a fork, is not ours to use
    ok = False
    try:
        try:
            _worker.jobs.send_bytes(payload)
        except OSError:
            return ChildResult("died", seconds=time.monotonic() - t0)
        res = _receive(_worker.results, deadline, t0)
        ok = res.ended in ("done", "error")
        return res
    finally:  # overran, died, or interrupted: the worker goes, the next call starts another
        if not ok:
            _stop_worker()


atexit.register(_stop_worker)
