"""``Progress``: the planner's stage timer and its progress lines (a leaf module: the API, the
planner's long searches and the CLI's redrawing sink share it)."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Callable

__all__ = ["Progress"]


class Progress:
    """Stage lines with elapsed time (``verbose``), or silence; the seconds per stage either way.
    ``sink`` receives each line: ``"<prefix> <stage> ..."`` when a stage starts, ``"<prefix>
    <stage> done in <s>s"`` when it ends (the CLI's ``StageSink`` redraws the former in place)."""

    def __init__(self, verbose: bool = False, sink: Callable[[str], None] | None = None) -> None:
        self.verbose = verbose
        self.sink = sink or (lambda line: print(line, file=sys.stderr, flush=True))
        self.timings: dict[str, float] = {}
        self._start = time.perf_counter()

    @contextmanager
    def stage(self, name: str, detail: str = ""):
        if self.verbose:
            self.sink(f"[autopar {time.perf_counter() - self._start:6.1f}s] {name}{' ' + detail if detail else ''} ...")
        t0 = time.perf_counter()
        yield
        self.timings[name] = self.timings.get(name, 0.0) + (spent := time.perf_counter() - t0)  # repeats add up
        if self.verbose:
            self.sink(f"[autopar {time.perf_counter() - self._start:6.1f}s] {name} done in {spent:.2f}s")
