"""Per-rank batch statistics (``batch_norm_stats="per_rank"``): DDP's batch norm, defined on ONE device.

By default a training-mode batch norm normalises with the statistics of the WHOLE batch on every
plan (``strategies/_norm.py``'s ``sync_batch_norm`` when the batch is split). torch's DDP and
FSDP2 instead normalise each rank's share of the batch by its own statistics, with no collective.
``per_rank`` gives autopar's plans those semantics without tying them to a plan: the pass below
replaces every batch norm that uses batch statistics (``microbatch._batch_statistics``: training
mode, or no running statistics) by ONE op,

    chunked_batch_norm(input (N, C, *), weight?, bias?, running_mean?, running_var?, momentum, eps,
                       chunks) -> (N, C, *)

which cuts the batch (dim 0) into ``chunks`` equal contiguous pieces and normalises each by its
own per-channel mean and biased variance -- exactly what DDP computes on ``chunks`` ranks fed the
batch evenly in rank order. ``chunks`` is the world size (the mesh's device count), fixed at the
trace, so every plan of that world -- data parallel, channel split, 2-D mesh, replicated --
computes the same thing; the rule (``strategies/_batch_norm_chunks.py``) runs it on a batch
split with ``chunks / shards`` local chunks and no collective for the normalisation.

Running statistics (when given): ONE update per call, with the chunks' statistics averaged:
``running_mean = (1 - m) running_mean + m * mean_c(chunk mean)``, and ``running_var`` likewise
with the mean over chunks of each chunk's UNBIASED variance. DDP with ``broadcast_buffers=True``
(its default) instead keeps rank 0's: every rank updates its buffers from its own chunk and rank
0's are broadcast at the next forward, so DDP's running statistics follow chunk 0 alone. The
average over chunks has the same expectation with less noise, and the same value on every plan.
Eval-mode batch norms (running statistics) are untouched.

A batch that ``chunks`` does not divide is a ``ValueError`` naming the module path and the sizes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from autopar.tracer.meta_keys import MODULE_KEY
from autopar.tracer.microbatch import _arg, _batch_statistics

if TYPE_CHECKING:
    from autopar.tracer.graph import TracedGraph

__all__ = ["chunked_batch_norm", "chunk_normalise", "update_running", "per_rank_batch_norms"]

torch.library.define(
    "autopar::chunked_batch_norm",
    "(Tensor input, Tensor? weight, Tensor? bias, Tensor(a!)? running_mean, Tensor(b!)? running_var, "
    "float momentum, float eps, int chunks) -> Tensor")


def chunk_normalise(x: torch.Tensor, weight, bias, eps: float, chunks: int, *,
                    stats_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` with each of its ``chunks`` batch pieces normalised by its own statistics (ATen's
    batch norm per piece: differentiable through autograd), and, when ``stats_dtype`` is given,
    the (2, C) SUMS over the pieces of each piece's mean and unbiased variance (no gradient).
    ATen's own running-statistics update computes those: each piece writes them into fresh
    buffers with momentum 1 -- the values ``nn.BatchNorm`` would fold into its running ones."""
    pieces = x.chunk(chunks, 0) if chunks > 1 else (x,)
    outs, sums = [], None
    for piece in pieces:
        if stats_dtype is None:
            outs.append(F.batch_norm(piece, None, None, weight, bias, training=True, eps=eps))
            continue
        # Rows 0 and 1 of one (2, C) buffer take the piece's mean and variance: no stack after
        # (zeros, not empty: momentum 1 still multiplies the old value by 0).
        stats = x.new_zeros((2, x.shape[1]), dtype=stats_dtype)
        outs.append(F.batch_norm(piece, stats[0], stats[1], weight, bias, training=True, momentum=1.0, eps=eps))
        sums = stats if sums is None else sums + stats
    return (outs[0] if len(outs) == 1 else torch.cat(outs, 0)), sums


def update_running(running_mean, running_var, stats: torch.Tensor, momentum: float) -> None:
    """The running statistics' one update per call with ``stats`` = (mean over chunks of the
    chunks' means, of their unbiased variances) (module docstring)."""
    with torch.no_grad():
        running_mean.mul_(1 - momentum).add_(stats[0].to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            running_var.mul_(1 - momentum).add_(stats[1].to(running_var.dtype), alpha=momentum)


def _check_chunks(x: torch.Tensor, chunks: int, where: str = "") -> None:
    if chunks < 1 or x.shape[0] % chunks:
        raise ValueError(f"chunked_batch_norm{where}: a batch of {x.shape[0]} cannot be cut into {chunks} equal "
                         f"chunks (batch_norm_stats='per_rank' normalises each rank's share of the batch)")


@torch.library.impl("autopar::chunked_batch_norm", "CompositeImplicitAutograd")
def _chunked_batch_norm(input, weight, bias, running_mean, running_var, momentum, eps, chunks):
    _check_chunks(input, chunks)
    stats_dtype = None if running_mean is None else running_mean.dtype
    y, sums = chunk_normalise(input, weight, bias, eps, chunks, stats_dtype=stats_dtype)
    if sums is not None:
        update_running(running_mean, running_var, sums / chunks, momentum)
    return y


chunked_batch_norm = torch.ops.autopar.chunked_batch_norm.default


def per_rank_batch_norms(traced: TracedGraph, chunks: int) -> int:
    """Replace every ``aten.batch_norm`` of ``traced`` that uses batch statistics by
    ``chunked_batch_norm(..., chunks)`` (module docstring); returns how many. Eval-mode batch
    norms stay. A batch ``chunks`` does not divide is a ``ValueError`` naming the module."""
    if type(chunks) is not int or chunks < 1:
        raise ValueError(f"per-rank batch statistics need a positive number of chunks (the world size), "
                         f"got {chunks!r}")
    found = [n for n in traced.gm.graph.nodes if n.target is torch.ops.aten.batch_norm.default and _batch_statistics(n)]
    for node in found:
        batch = node.args[0].meta["val"].shape[0]
        if batch % chunks:
            raise ValueError(f"batch_norm_stats='per_rank': the batch norm at module "
                             f"{node.meta.get(MODULE_KEY) or '<root>'!r} (node {node.name!r}) gets a batch of "
                             f"{batch}, which {chunks} ranks cannot share evenly (each rank normalises an equal "
                             f"contiguous chunk of the batch by its own statistics)")
    traced.batch_norm_chunks = chunks  # what plan_traced checks the options against
    if not found:
        return 0
    with traced.rewriting():
        graph = traced.gm.graph
        for node in found:
            # aten.batch_norm's arguments by name (momentum and eps have no default in its schema)
            args = (*(_arg(node, n, None) for n in ("input", "weight", "bias", "running_mean", "running_var")),
                    float(_arg(node, "momentum", None)), float(_arg(node, "eps", None)), chunks)
            with graph.inserting_before(node):
                new = graph.call_function(chunked_batch_norm, args)
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
        graph.lint()
        traced.gm.recompile()
    return len(found)
