"""``frozen_heap``: keep the cyclic garbage collector's full passes off what a stage only reads.

Tracing, profiling and the problem build allocate many small objects, so CPython's collector runs
its oldest generation a few times per stage, and each such pass walks every tracked object alive:
the interpreter's modules, the user's model, the traced graph of a deep model (millions of objects;
a full pass took about as long as the builder's work on a 96-layer GPT-2). Frozen objects
(``gc.freeze``) are skipped by those passes; what the stage allocates is collected as before, and
on exit the frozen objects return to the oldest generation, so nothing stays uncollectable.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator

__all__ = ["frozen_heap"]

_depth = 0  # nested stages: only the outermost freezes and thaws


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Objects alive at entry are left out of full collections until exit (outermost call only;
    nothing happens when the collector is off, someone else manages it then)."""
    global _depth
    if _depth or not gc.isenabled():
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
        return
    _depth += 1
    gc.freeze()
    try:
        yield
    finally:
        _depth -= 1
        gc.unfreeze()
