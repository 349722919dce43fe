"""Sharded parameters gathered one reader ahead: ``prefetch_gathers`` and its two call modules.

A parameter stored sharded (ZeRO-3, or any layout its reader does not read it in) is gathered
right before the op that reads it: ``self.all_gather(w, axis=0, src_dim=0)``, a blocking
collective, so the op waits for the whole transfer while the cores sit idle -- FSDP's reason to
prefetch. ``prefetch_gathers(graph, modules, pmesh)`` splits each such gather of a parameter in
the top-level graph into

    buf = self.gather_start(w, axis=0, src_dim=0, key="all_gather_3")   # issued, not waited on
    ...                                                  # the previous parameter's reader computes
    w_full = self.gather_wait(buf, axis=0, src_dim=0, key="all_gather_3")   # where the gather stood

and places each start right after the previous parameter's wait (the first right after the
graph's placeholders), so at most one parameter's gather is in flight ahead of its reader and it
overlaps the compute of the op before it -- FSDP2's forward prefetch of one. Every rank runs the
same graph, so every rank issues the same collectives in the same order.

The values are the blocking gather's: the same collective into the same buffer, waited on before
the first read, and the same post-processing (``collectives._all_gather``). Backward is the
blocking gather's too (the local chunk of the gradient: ``GatherStart``'s function).

Gathers inside a recompute region (a ``CheckpointRegion``'s body, re-run in backward) are left
blocking: the pass runs after the regions are cut and sees only the top-level graph. What it
costs: a gathered parameter is allocated one op earlier than before (at most one parameter's
bytes more at a time; a gathered copy a reader saves is held until backward either way).
``AUTOPAR_PREFETCH=0`` turns the pass off.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from autopar.runtime.collectives import _Axis, gather_buffers, gathered
from autopar.runtime.dist_ops import all_gather_single, issue, wait
from autopar.runtime.nodes import Collective
from autopar.runtime.process_mesh import ProcessMesh

__all__ = ["GatherStart", "GatherWait", "prefetch_enabled", "prefetch_gathers"]

START, WAIT = "gather_start", "gather_wait"


def prefetch_enabled() -> bool:
    """``AUTOPAR_PREFETCH=0`` keeps every gather blocking (for A/B measurements; default on)."""
    return os.environ.get("AUTOPAR_PREFETCH", "1").strip().lower() not in ("0", "false", "off", "no")


class _InFlight:
    """The gathers a graph has issued and not yet waited for, by key (the blocking gather's node name)."""

    def __init__(self) -> None:
        self.works: dict[str, tuple[Any, torch.Tensor]] = {}

    def put(self, key: str, work: Any, send: torch.Tensor) -> None:
        if key in self.works:  # a step that raised between start and wait: drain the old one
            wait(self.works.pop(key)[0])
        self.works[key] = (work, send)  # the send buffer must outlive the collective

    def wait(self, key: str) -> None:
        entry = self.works.pop(key, None)
        if entry is None:
            raise RuntimeError(f"gather_wait for {key!r} without its gather_start: the prefetch pass "
                               f"placed a wait before its start")
        wait(entry[0])


class _Start(torch.autograd.Function):
    """Issue the all-gather of ``x``'s dim ``dim`` (moved to the front) into a new buffer; the
    buffer is returned before the collective has filled it. Backward: this rank's rows of the
    gradient (the blocking gather's backward, ``collectives._AllGather``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, ax: _Axis, key: str, inflight: _InFlight) -> torch.Tensor:
        ctx.dim, ctx.ax = dim, ax
        send, out = gather_buffers(x, dim, ax.size)
        inflight.put(key, issue(all_gather_single, out, send, group=ax.group), send)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows = grad.shape[0] // ctx.ax.size
        mine = grad.narrow(0, ctx.ax.coordinate * rows, rows).movedim(0, ctx.dim)
        return mine.contiguous(), None, None, None, None


class GatherStart(nn.Module):
    """``self.gather_start(x, axis=, src_dim=, key=)``: the all-gather issued, not waited on."""

    def __init__(self, pmesh: ProcessMesh, inflight: _InFlight) -> None:
        super().__init__()
        self.pmesh, self.inflight = pmesh, inflight

    def forward(self, x: torch.Tensor, *, axis: int, src_dim: int, key: str, segments: int = 1) -> torch.Tensor:
        del segments  # the wait reorders segments, after the data has arrived
        if not 0 <= src_dim < x.dim():
            raise ValueError(f"gather_start of {key!r}: dim {src_dim} out of range for shape {tuple(x.shape)}")
        return _Start.apply(x, src_dim, _Axis.of(self.pmesh, axis), key, self.inflight)


class GatherWait(nn.Module):
    """``self.gather_wait(buf, axis=, src_dim=, key=)``: wait for the gather, then the blocking
    gather's layout (segments reordered, the gathered dim moved back)."""

    def __init__(self, pmesh: ProcessMesh, inflight: _InFlight) -> None:
        super().__init__()
        self.pmesh, self.inflight = pmesh, inflight

    def forward(self, buf: torch.Tensor, *, axis: int, src_dim: int, key: str, segments: int = 1) -> torch.Tensor:
        self.inflight.wait(key)
        return gathered(buf, src_dim, self.pmesh.axis_size(axis), segments)


def _parameter_gathers(graph: fx.Graph, modules: dict[str, nn.Module], state_key: str) -> list[fx.Node]:
    """The top-level blocking all-gathers whose input is a parameter or buffer placeholder."""
    out = []
    for node in graph.nodes:
        module = modules.get(node.target) if node.op == "call_module" else None
        if not (isinstance(module, Collective) and module.kind == "all_gather"):
            continue
        src = node.args[0] if node.args else None
        if isinstance(src, fx.Node) and src.op == "placeholder" and src.meta.get(state_key) \
                and module.pmesh.axis_size(node.kwargs["axis"]) > 1:
            out.append(node)
    return out


def prefetch_gathers(graph: fx.Graph, modules: dict[str, nn.Module], pmesh: ProcessMesh, *,
                     state_key: str) -> int:
    """Split every top-level parameter all-gather into a start placed one reader ahead and a wait
    where it stood (module docstring). ``state_key``: the placeholder meta marking parameters
    and buffers. Returns how many gathers were split."""
    gathers = _parameter_gathers(graph, modules, state_key)
    if not gathers:
        return 0
    inflight = _InFlight()
    start_name, wait_name = _free(modules, START), _free(modules, WAIT)
    modules[start_name], modules[wait_name] = GatherStart(pmesh, inflight), GatherWait(pmesh, inflight)
    anchor = _last_placeholder(graph)
    for node in gathers:
        key = node.name  # one parameter may be gathered twice (two layouts): one key per gather
        kwargs = {"axis": node.kwargs["axis"], "src_dim": node.kwargs["src_dim"], "key": key}
        if node.kwargs.get("segments", 1) != 1:
            kwargs["segments"] = node.kwargs["segments"]
        with graph.inserting_after(anchor):
            start = graph.call_module(start_name, (node.args[0],), kwargs)
        with graph.inserting_before(node):
            wait = graph.call_module(wait_name, (start,), kwargs)
        wait.meta.update(node.meta)
        node.replace_all_uses_with(wait)
        graph.erase_node(node)
        anchor = wait
    graph.lint()
    return len(gathers)


def _free(modules: dict[str, nn.Module], name: str) -> str:
    while name in modules:
        name = f"{name}_"
    return name


def _last_placeholder(graph: fx.Graph) -> fx.Node:
    last = None
    for node in graph.nodes:
        if node.op != "placeholder":
            break
        last = node
    if last is None:
        raise ValueError("prefetch_gathers: the graph has no placeholders to issue the first gather after")
    return last
