"""Model outputs the tracer accepts beyond torch.export's own: a user's plain dataclass."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.utils._pytree as pytree


def register_dataclass_output(value: Any) -> bool:
    """Register the plain dataclass type of ``value`` as a pytree node
    (``torch.export.register_dataclass``, once per type and process), so that a forward returning
    one -- ``Output(loss=..., logits=...)``, as hand-written training code does -- is traced, and
    its value rebuilt by the parallel module, like a ``ModelOutput``. Every process that traces
    registers it itself (``autoparallelize`` traces on every rank; forked ranks inherit it).

    Only types whose every field goes through ``__init__`` can be rebuilt from their fields;
    those, and anything not a dataclass instance, are left to the caller's error naming them.
    True when it registered."""
    cls = type(value)
    if not dataclasses.is_dataclass(value) or isinstance(value, type) or cls in pytree.SUPPORTED_NODES:
        return False
    if not all(f.init for f in dataclasses.fields(cls)):
        return False
    torch.export.register_dataclass(cls)
    return True
