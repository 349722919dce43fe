"""A hard wall-clock limit on a function: run it in a forked child, kill the child at a deadline.

Why a child process: HiGHS (through highspy) solves in-process and has been seen to loop forever
in presolve, ignoring its own ``time_limit``; a thread cannot be stopped, a process can. Why
``fork`` and not ``spawn``: the child inherits the built pulp model, so nothing is pickled on the
way in and no interpreter starts (a fork costs milliseconds, a spawned interpreter that imports
pulp and highspy a few hundred), and ``os.fork`` also works inside the daemonic processes that
``autopar.runtime.launch.run_local`` starts, where ``multiprocessing`` refuses to start children.

The child runs ``fn(report)``; ``report(message)`` streams a progress message to the parent (the
solvers send each improving solution, so a killed solve still has its best plan) and ``fn``'s
return value is the final message. The child leads its own process group, so killing the group
also ends what it started (CBC runs as a grandchild, ``pulp.COIN_CMD``). No torch import.
"""

from __future__ import annotations

import os
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


def run_in_child(fn: Callable[[Callable[[Any], None]], Any], *, deadline: float) -> ChildResult:
    """Run ``fn(report)`` in a forked child until it returns or ``time.monotonic()`` reaches
    ``deadline``, whichever is first; the child is always gone when this returns."""
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
    latest = None
    try:
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
    finally:  # also on KeyboardInterrupt: no solver outlives its caller
        recv.close()
        _end_group(pid)
