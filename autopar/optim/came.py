"""CAME (Luo et al., ACL 2023, "CAME: Confidence-guided Adaptive Memory Efficient
Optimization") on plain tensors and sharded DTensor parameters."""

from __future__ import annotations

import torch
from torch import Tensor

from ._dist import SumReducer, check_float, closure_loss, elementwise_state, grads_of, local, state_like

__all__ = ["CAME"]


class CAME(torch.optim.Optimizer):
    r"""CAME: Adafactor's factored second moment plus a factored confidence (instability) term.

    Follows the paper's Algorithm 1 with the conventions of the authors' reference
    implementation ``came_pytorch`` (github.com/yangluo7/CAME, ``CAME.py``): defaults
    ``betas=(0.9, 0.999, 0.9999)``, ``eps=(1e-30, 1e-16)``, ``clip_threshold=1.0``; means (not
    sums) over rows and columns; eps1 added to g*g and eps2 to the instability before averaging;
    no bias correction; weight decay ``p -= lr * weight_decay * p`` (decoupled, scaled by lr).
    Per parameter, with ``approx(R, C) = rsqrt(R / mean(R)) (outer) rsqrt(C)``::

        dim(p) >= 2 (factored over the LAST TWO dims; leading dims are a batch):
            R = b2 R + (1-b2) mean_{-1}(g*g + eps1);  C = b2 C + (1-b2) mean_{-2}(g*g + eps1)
            u = approx(R, C) * g
        else:  V = b2 V + (1-b2) (g*g + eps1);  u = g / sqrt(V)
        u = u / max(1, RMS(u) / clip_threshold)
        m = b1 m + (1-b1) u
        dim(p) >= 2:
            res = (u - m)**2 + eps2
            Rr = b3 Rr + (1-b3) mean_{-1}(res);  Cr = b3 Cr + (1-b3) mean_{-2}(res)
            u = approx(Rr, Cr) * m
        else:  u = m                                      # 1-D: no confidence term
        p = p - lr * weight_decay * p - lr * u

    ``lr`` defaults to the README's 2e-4 (``came_pytorch`` has no default). ``maximize``
    negates g.

    On DTensors each rank works on its local block; every mean over a dim sums partial sums
    over the mesh dims sharding that dim (the mean of R over its rows: the mesh dims sharding
    dim -2), RMS(u) over all sharded mesh dims. The mean of an updated row factor is linear in
    the old one and the new statistic, so it rides with the row/column sums: three batched
    rounds per step (row/col of g*g; RMS(u); row/col of the instability), each one all-reduce
    of the concatenated statistics per (mesh, mesh dims) and mesh dim, independent of the
    number of parameters. The state of a DTensor parameter is DTensors on its mesh (see
    ``_init_state``), so ``torch.distributed.checkpoint`` reshards it; the arithmetic runs on
    their local blocks.
    """

    def __init__(self, params, lr: float = 2e-4, eps: tuple[float, float] = (1e-30, 1e-16),
                 clip_threshold: float = 1.0, betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
                 weight_decay: float = 0.0, *, maximize: bool = False) -> None:
        lr = check_float("lr", lr, low=0.0, low_open=True)
        if not isinstance(eps, (tuple, list)) or len(eps) != 2:
            raise ValueError(f"eps must be a pair (eps1, eps2), got {eps!r}")
        for i, e in enumerate(eps):
            check_float(f"eps[{i}]", e, low=0.0)
        check_float("clip_threshold", clip_threshold, low=0.0, low_open=True)
        if not isinstance(betas, (tuple, list)) or len(betas) != 3:
            raise ValueError(f"betas must be a triple (beta1, beta2, beta3), got {betas!r}")
        for i, b in enumerate(betas):
            check_float(f"betas[{i}]", b, low=0.0, high=1.0)
        check_float("weight_decay", weight_decay, low=0.0)
        defaults = dict(lr=lr, eps=tuple(eps), clip_threshold=clip_threshold, betas=tuple(betas),
                        weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults)

    @staticmethod
    def _add_row_col(red: SumReducer, w: dict, sq: Tensor, old_row: Tensor) -> None:
        """Partial row (over dim -1) and column (over dim -2) sums of ``sq``, and the two sums
        that give the mean of the updated row factor without another round (it is linear:
        b * mean(old_row) + (1 - b) * mean_{-2,-1}(sq))."""
        lay = w["layout"]
        rows = sq.sum(dim=-1)
        w["i_r"] = red.add(rows, lay, lay.over(-1))
        w["i_c"] = red.add(sq.sum(dim=-2), lay, lay.over(-2))
        w["i_old"] = red.add(old_row.sum(dim=-1), lay, lay.over(-2))
        w["i_all"] = red.add(rows.sum(dim=-1), lay, lay.over(-2, -1))

    @staticmethod
    def _init_state(state: dict, p: Tensor, g: Tensor, *, factored: bool) -> None:
        """Zero state; of a DTensor parameter, DTensors: ``exp_avg``/``exp_avg_sq`` like ``p``, the
        row factors of global shape p.shape[:-1] (sharded like its rows, Replicate where dim -1
        is sharded) and the column factors p.shape[:-2] + p.shape[-1:] the other way round."""
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = elementwise_state(torch.zeros_like(g), p)
        if not factored:
            state["exp_avg_sq"] = elementwise_state(torch.zeros_like(g), p)
            return
        n = p.dim()
        row_dims = (*range(n - 1), None)
        col_dims = (*range(n - 2), None, n - 2)
        for kind in ("sq", "res"):
            state[f"exp_avg_{kind}_row"] = state_like(g.new_zeros(g.shape[:-1]), p, shape=p.shape[:-1],
                                                      dims=row_dims)
            state[f"exp_avg_{kind}_col"] = state_like(g.new_zeros(g.shape[:-2] + g.shape[-1:]), p,
                                                      shape=p.shape[:-2] + p.shape[-1:], dims=col_dims)

    @staticmethod
    def _ema_row_col(w: dict, sums: list[Tensor], row: Tensor, col: Tensor, beta: float) -> Tensor:
        """Update the factors in place from round sums; returns rsqrt(row / mean(row)) outer
        rsqrt(col) (came_pytorch's ``_approx_sq_grad``)."""
        m, n = w["p"].shape[-2], w["p"].shape[-1]
        row.mul_(beta).add_(sums[w["i_r"]] / n, alpha=1 - beta)
        col.mul_(beta).add_(sums[w["i_c"]] / m, alpha=1 - beta)
        mean = (sums[w["i_old"]] / m).mul_(beta).add_(sums[w["i_all"]] / (m * n), alpha=1 - beta)
        r = (row / mean.unsqueeze(-1)).rsqrt_().unsqueeze(-1)
        return r * col.unsqueeze(-2).rsqrt()

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        # ---- round 1: row/col partial sums of g*g + eps1
        red, work = SumReducer(), []
        for group in self.param_groups:
            for p, layout, x, g in grads_of(group, "CAME", upcast=True):
                factored = p.dim() >= 2
                if not self.state[p]:
                    self._init_state(self.state[p], p, g, factored=factored)
                # the local blocks: all updates below are in place, so they reach the DTensors
                state = {key: local(value) for key, value in self.state[p].items()}
                state["step"] += 1
                w = dict(group=group, p=p, x=x, g=g, state=state, layout=layout, factored=factored)
                sq = (g * g).add_(group["eps"][0])
                if factored:
                    self._add_row_col(red, w, sq, state["exp_avg_sq_row"])
                else:
                    w["sq"] = sq
                work.append(w)
        sums = red.run()
        # ---- round 2: RMS of the preconditioned update
        red = SumReducer()
        for w in work:
            state, b2 = w["state"], w["group"]["betas"][1]
            if w["factored"]:
                u = self._ema_row_col(w, sums, state["exp_avg_sq_row"], state["exp_avg_sq_col"], b2)
                u.mul_(w["g"])
            else:
                state["exp_avg_sq"].mul_(b2).add_(w.pop("sq"), alpha=1 - b2)
                u = state["exp_avg_sq"].rsqrt().mul_(w["g"])
            w["u"] = u
            w["i_u"] = red.add(torch.linalg.vector_norm(u).square(), w["layout"], w["layout"].all())
        sums = red.run()
        # ---- round 3: clip, first moment, row/col sums of the instability
        red = SumReducer()
        for w in work:
            group, state, p = w["group"], w["state"], w["p"]
            rms = sums[w["i_u"]].sqrt() / p.numel() ** 0.5
            u = w["u"].div_((rms / group["clip_threshold"]).clamp_(min=1.0))
            b1 = group["betas"][0]
            state["exp_avg"].mul_(b1).add_(u, alpha=1 - b1)
            if w["factored"]:
                res = (u - state["exp_avg"]).square_().add_(group["eps"][1])
                self._add_row_col(red, w, res, state["exp_avg_res_row"])
        sums = red.run()
        for w in work:
            group, state, p, x = w["group"], w["state"], w["p"], w["x"]
            if w["factored"]:
                update = self._ema_row_col(w, sums, state["exp_avg_res_row"], state["exp_avg_res_col"],
                                           group["betas"][2]).mul_(state["exp_avg"])
            else:
                update = state["exp_avg"].clone()
            if group["weight_decay"] != 0:
                x.add_(x, alpha=-group["weight_decay"] * group["lr"])
            x.add_(update.to(x.dtype), alpha=-group["lr"])
        return loss
