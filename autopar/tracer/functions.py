"""Custom ``torch.autograd.Function`` classes met while tracing.

torch.export (non-strict) traces a Function's ``forward`` into the graph; its own ``backward`` is
not kept, and the runtime differentiates the traced forward instead. That is the same gradient
where the backward is the forward's derivative (Bloom's GELU), but not where it is something
else on purpose: YOSO's ``YosoCumulation`` (an approximate gradient), RecurrentGemma's
``SqrtBoundDerivative`` (a gradient clipped near zero), straight-through estimators, gradient
reversal. The tracer says so, naming each class, rather than train other gradients silently.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["custom_functions"]

# Functions of these packages are their own machinery (torch's checkpoint, autopar's collectives).
_OWN = ("torch.", "autopar.")


@contextlib.contextmanager
def custom_functions() -> Iterator[list[str]]:
    """While active, the qualified names of the user ``autograd.Function`` classes applied
    (each once, in call order) are appended to the yielded list."""
    met: list[str] = []
    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        name = f"{cls.__module__}.{cls.__qualname__}"
        if not cls.__module__.startswith(_OWN) and name not in met:
            met.append(name)
        return original.__func__(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield met
    finally:
        torch.autograd.Function.apply = original
