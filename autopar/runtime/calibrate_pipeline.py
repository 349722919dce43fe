"""Calibration's pipeline stage: what one action of torch's pipeline schedule costs beyond its work.

A pipelined step runs each stage's micro-batches as schedule actions (a forward, a backward, ...;
``torch.distributed.pipelining``), and each action pays more than its ops and its point-to-point
transfer's ``alpha + beta * bytes``: the schedule's Python bookkeeping, the stage's input and
output buffers, the batched send/receive set-up, and the wake-up of a rank that slept in a
receive. On 2 gloo ranks of a 2-core host that came to ~1.9 ms per action with trivial compute,
where the links' fit prices the transfer at a tenth of it.

``measure_pipeline_action(group, ...)`` runs the runtime's own 1F1B schedule
(``runtime.pipeline.module.SCHEDULES``) over ``group`` as a pipeline of ``group.size()`` stages,
each one tiny linear layer, at two micro-batch counts ``M_lo < M_hi``, timed in lockstep
(``links.lockstep_medians``: the median of the slowest rank, the two counts interleaved per
round). A 1F1B step takes ``(M + S - 1) t`` for a per-micro-batch stage time ``t``, so
``t = (T_hi - T_lo) / (M_hi - M_lo)`` whatever the fill and drain cost; 1F1B runs two actions
per micro-batch on each rank (forward, backward), so the action's overhead is
``(t - p2p) / 2``, with ``p2p`` the links' price of the activation sent forward and its gradient
sent back (``planner.pipeline.costs.StageCosts.p2p_s``'s formula). Calibration stores it as
``MachineProfile.pipeline_action_s``; the pipeline cost model adds it once per action of a
stage's micro-batch (``planner.pipeline.schedule.action_overhead_s``). Where ``t`` is below
``p2p`` the links' fit over-prices a point-to-point transfer (it is fitted on lockstep
collectives: on 4 gloo ranks sharing 2 cores axis 0's fit priced the trivial micro-batch's two
transfers at 6.4 ms, and it took 3.4): the overhead is 0 and each transfer's latency is what the
micro-batch took, ``t / 2 - beta * bytes`` (``MachineProfile.pipeline_transfer_s``,
``split_microbatch``), so a trivial stage's micro-batch is priced at what it measured either way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from autopar.runtime.links import lockstep_medians

__all__ = ["PIPELINE_MICROBATCHES", "PIPELINE_WIDTH", "PIPELINE_ROWS", "pipeline_bytes", "measure_pipeline_action",
           "split_microbatch"]

# Micro-batch counts per stage count S: (S, 4 S) -- 1F1B needs at least S, and the difference of
# 3 S micro-batches is long enough against a repetition's noise (~6 ms on 2 ranks of this host).
PIPELINE_MICROBATCHES = (1, 4)
# One micro-batch's activation: PIPELINE_ROWS x PIPELINE_WIDTH fp32 values (compute is trivial:
# the figure is the schedule's, not the layer's).
PIPELINE_WIDTH = 16
PIPELINE_ROWS = 2
# 1F1B's actions per micro-batch on a rank: its forward and its (full) backward.
_ONE_F_ONE_B_ACTIONS = 2


def pipeline_bytes() -> int:
    """Bytes of the activation one micro-batch sends forward (its gradient comes back as many)."""
    return PIPELINE_ROWS * PIPELINE_WIDTH * 4


def _schedule(group, *, microbatches: int, device: torch.device):
    """A runner of one 1F1B step over ``group``'s ranks as stages (rank order), ``microbatches`` of them."""
    from torch.distributed.pipelining import PipelineStage

    from autopar.runtime.pipeline.module import SCHEDULES

    rank, size = dist.get_group_rank(group, dist.get_rank()), dist.get_world_size(group)
    layer = nn.Linear(PIPELINE_WIDTH, PIPELINE_WIDTH).to(device)
    # A later stage's input needs a gradient (the schedule sends it back), the first's does not.
    example = torch.zeros(PIPELINE_ROWS, PIPELINE_WIDTH, device=device)
    stage = PipelineStage(layer, rank, size, device, group=group, input_args=(example.requires_grad_(rank > 0),),
                          output_args=(example.detach().requires_grad_(),))
    schedule = SCHEDULES["1f1b"](stage, n_microbatches=microbatches, loss_fn=lambda out, target: out.sum(),
                                 scale_grads=False)
    batch = torch.randn(microbatches * PIPELINE_ROWS, PIPELINE_WIDTH, device=device)

    def step() -> None:
        if rank == 0:
            schedule.step(batch)
        elif rank == size - 1:
            schedule.step(target=batch, losses=[])
        else:
            schedule.step()
    return step


def measure_pipeline_action(group, *, repeats: int, device: torch.device) -> tuple[float, dict[str, float]]:
    """Seconds per micro-batch of a stage of trivial compute under torch's 1F1B schedule over
    ``group`` (module docstring), and the figures it comes from: the steps at ``M_lo`` and
    ``M_hi`` micro-batches (``lo``, ``hi``) and the counts (``m_lo``, ``m_hi``). Collective over
    every rank (the lockstep barrier): each group of the mesh axis runs its own pipeline at once,
    as a pipelined step's do. Every rank returns the same figures."""
    size = dist.get_world_size(group)
    if size < 2:
        raise ValueError(f"a pipeline needs 2 stages or more; the group has {size} rank")
    m_lo, m_hi = (size * k for k in PIPELINE_MICROBATCHES)
    lo = _schedule(group, microbatches=m_lo, device=device)
    hi = _schedule(group, microbatches=m_hi, device=device)
    t_lo, t_hi = lockstep_medians([lo, hi], repeats=repeats, device=device)
    per_microbatch = max(t_hi - t_lo, 0.0) / (m_hi - m_lo)
    return per_microbatch, {"lo": t_lo, "hi": t_hi, "m_lo": float(m_lo), "m_hi": float(m_hi)}


def split_microbatch(per_microbatch: float, *, alpha: float, beta: float) -> tuple[float | None, float]:
    """A trivial-stage 1F1B micro-batch's time read apart (module docstring): (the latency of one of
    its two transfers where the links' ``alpha``/``beta`` price them above the whole micro-batch,
    else None; one action's overhead beyond the transfers, >= 0)."""
    p2p = 2 * (alpha + beta * pipeline_bytes())
    if per_microbatch >= p2p:
        return None, (per_microbatch - p2p) / _ONE_F_ONE_B_ACTIONS
    return max(per_microbatch / 2 - beta * pipeline_bytes(), 0.0), 0.0
