"""Whole-model state of a module with sharded chunks: its parameters view working copies that
exist only while gathered, so the module's state methods gather on demand.

``install(gemini)`` replaces three methods of the wrapped module (instance attributes):

- ``full_state_items`` (and so ``full_state_dict`` and the booster's ``save_model``): each
  sharded chunk is all-gathered just before the first of its tensors is read and dropped once
  the next tensor belongs to another chunk, so at most one gathered chunk is held at a time;
- ``load_full_state_dict``: the sharded chunks are gathered (the load may leave some tensors as
  they were), the original load slices the full tensors into the local ones, then each rank
  copies its shard back into the payload at rest and the fp32 master, and the copies are dropped.
  The device budget is not enforced meanwhile (every sharded chunk is whole at once);
- ``full_gradients``: sharded and ZeRO-2 chunks' gradient shards are all-gathered into temporary ``.grad``
  views for the call.

All of them are collectives: every rank must call them, as the originals.
"""

from __future__ import annotations

import functools

import torch

from autopar.runtime.gemini.grads import wrap_like
from autopar.runtime.gemini.shards import gather_into

__all__ = ["install"]


def install(gemini) -> None:
    module = gemini.module
    module.full_state_items = functools.partial(_items, gemini, module.full_state_items)
    module.load_full_state_dict = functools.partial(_load, gemini, module.load_full_state_dict)
    module.full_gradients = functools.partial(_gradients, gemini, module.full_gradients)


def _items(gemini, original):
    manager = gemini.manager
    order = [name for name, *_ in gemini.module._state_order()]
    items = original()
    for i, name in enumerate(order):
        chunk = manager.chunk_of.get(name)
        if chunk is None or not chunk.sharded:
            yield next(items)
            continue
        manager.hold(chunk)
        try:
            item = next(items)  # a copy, never a view of the working buffer
        finally:
            manager.release(chunk)
        following = manager.chunk_of.get(order[i + 1]) if i + 1 < len(order) else None
        if following is not chunk and chunk.resident and chunk.pins == 0:
            manager.evict(chunk)
        yield item


@torch.no_grad()
def _load(gemini, original, state_dict, *, strict: bool = True) -> None:
    manager = gemini.manager
    sharded = [c for c in manager.chunks if c.sharded]
    budget, manager.ledger.budget = manager.ledger.budget, None
    held = []
    try:
        for chunk in sharded:
            manager.hold(chunk)
            held.append(chunk)
        original(state_dict, strict=strict)
        for chunk in sharded:
            start = chunk.shard_index * chunk.shard_elems
            chunk.shard_buf.copy_(chunk.device_buf[start:start + chunk.shard_elems])
            if chunk.master is not chunk.shard_buf:
                chunk.master.copy_(chunk.shard_buf)
            manager.mark_synced(chunk)
    finally:
        for chunk in held:
            manager.release(chunk)
            if chunk.resident and chunk.pins == 0:
                manager.evict(chunk)
        manager.ledger.budget = budget


@torch.no_grad()
def _gradients(gemini, original):
    manager = gemini.manager
    lent = []
    try:
        for chunk in manager.chunks:
            if not chunk.scatters or chunk.grad is None:  # sharded, or ZeRO-2: the gradient is a shard
                continue
            whole = torch.empty(chunk.padded_elems, dtype=chunk.dtype, device=manager.device)
            gather_into(whole, chunk.grad.to(manager.device), chunk, manager.pmesh)
            for s in chunk.slots:
                p = manager.params[s.name]
                if s.name in chunk.grad_names and p.grad is None:
                    p.grad = wrap_like(chunk.view(whole, s.name), p)
                    lent.append(p)
        return original()
    finally:
        for p in lent:
            p.grad = None
