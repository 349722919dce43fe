"""Repeated blocks, named by module path: the one place that parses them.

A repeated block is the shortest module-path prefix ending in an integer index
(``"transformer.h.3"`` in ``"transformer.h.3.attn.c_attn"``). The builder tags nodes with their
block, the simplifier aliases identical block instances, and the recompute ILP and the recompute
orchestration use blocks as recompute units, the report folds identical blocks into one row;
all of them go through these two functions. It lives with the layout vocabulary, the lowest
layer, so that every layer above can use it.
"""

from __future__ import annotations

import re

__all__ = ["block_of", "split_block"]

_BLOCK = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


def block_of(path: str | None) -> str | None:
    """``"transformer.h.3.attn.c_attn"`` -> ``"transformer.h.3"``; None outside any block."""
    m = _BLOCK.match(path or "")
    return f"{m.group(1)}.{m.group(2)}" if m else None


def split_block(path: str | None) -> tuple[str, int] | None:
    """``"transformer.h.3"`` (or any path inside it) -> ``("transformer.h", 3)``."""
    m = _BLOCK.match(path or "")
    return (m.group(1), int(m.group(2))) if m else None
