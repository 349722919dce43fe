"""How the CLI shows stage progress: a live, self-updating line on a terminal, plain lines when piped.

Not a second progress mechanism: ``autopar.stages.Progress`` times the stages and makes the lines,
``StageSink`` is the ``sink`` it hands them to. ``Progress`` emits ``"[autopar   1.2s] trace ..."``
when a stage starts and ``"[autopar   3.4s] trace done in 2.20s"`` when it ends. On a TTY the
start line is redrawn in place with a ticking elapsed time (a daemon thread, 5 Hz) and replaced
by the done line; when stderr is not a terminal every line is printed as is, so logs stay readable.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

__all__ = ["StageSink"]


class StageSink:
    def __init__(self, stream: TextIO | None = None, *, live: bool | None = None, quiet: bool = False) -> None:
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty() if live is None else live
        self.quiet = quiet
        self._current: str | None = None
        self._started = 0.0
        self._lock = threading.Lock()
        self._ticker: threading.Thread | None = None
        self._stop = threading.Event()

    def __call__(self, line: str) -> None:
        if self.quiet:
            return
        if not self.live:
            print(line, file=self.stream, flush=True)
            return
        with self._lock:
            if line.endswith(" ..."):
                self._current, self._started = line[:-4], time.perf_counter()
                self._draw()
                self._ensure_ticker()
            else:
                self._current = None
                self.stream.write("\r\033[K" + line + "\n")
                self.stream.flush()

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=1.0)
        with self._lock:
            if self.live and self._current is not None:
                self.stream.write("\r\033[K")
                self.stream.flush()
            self._current = None

    def _draw(self) -> None:
        if self._current is not None:
            self.stream.write(f"\r\033[K{self._current} ... {time.perf_counter() - self._started:.1f}s")
            self.stream.flush()

    def _ensure_ticker(self) -> None:
        if self._ticker is None:
            self._ticker = threading.Thread(target=self._tick, name="autopar-progress", daemon=True)
            self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(0.2):
            with self._lock:
                self._draw()
