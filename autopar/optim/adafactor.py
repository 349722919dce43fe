"""Adafactor with torch.optim.Adafactor's algorithm, on plain tensors and sharded DTensors."""

from __future__ import annotations

import torch
from torch import Tensor

from ._dist import SumReducer, check_float, closure_loss, elementwise_state, grads_of, local, state_like

__all__ = ["Adafactor"]


class Adafactor(torch.optim.Optimizer):
    r"""Adafactor (Shazeer & Stern 2018) exactly as ``torch.optim.Adafactor`` computes it.

    Same hyper-parameters, defaults and conventions (read torch's ``_single_tensor_adafactor``)::

        t += 1;  beta2_hat = 1 - t**beta2_decay;  rho = min(lr, 1/sqrt(t))
        alpha = max(eps2, RMS(p)) * rho                 # RMS of p BEFORE weight decay
        p *= 1 - lr * weight_decay                      # decoupled, scaled by lr
        dim(p) >= 2 (factored over the LAST TWO dims, leading dims are a batch):
            R = lerp(R, mean_{-1}(g*g), 1 - beta2_hat)   # shape [..., m, 1]
            C = lerp(C, mean_{-2}(g*g), 1 - beta2_hat)   # shape [..., 1, n]
            V = R @ C / max(mean_{-2}(R), eps1)
        else:  V = lerp(V, g*g, 1 - beta2_hat)
        U = g / sqrt(max(V, eps1**2));  p -= alpha / max(1, RMS(U) / d) * U

    ``eps1=None`` means ``finfo(p.dtype).eps``; ``maximize`` negates g. Step sizes are relative
    (rho, alpha): there is no absolute-lr mode, as in torch.

    On DTensors every rank works on its local block. Full statistics are sums over the shards:
    the row mean (over dim -1) sums partial row sums over the mesh dims sharding dim -1, the
    column mean over those sharding dim -2, ``mean_{-2}(R)`` over those sharding dim -2, the two
    RMS over all sharded mesh dims. ``mean_{-2}(R)`` of the updated R is linear in the old R and
    g*g, so it comes in the same round as the row and column sums: two batched rounds per step
    (||p||, row/column sums and the two sums for mean_{-2}(R); then RMS(U)), each one
    all-reduce of the concatenated statistics per (mesh, mesh dims) and mesh dim --
    independent of the number of parameters.

    State of a DTensor parameter is DTensors on its mesh, so ``torch.distributed.checkpoint``
    reshards it: ``variance`` like the parameter; ``row_var`` of global shape [..., m, 1]
    sharded like the rows and Replicate on the mesh dims sharding dim -1 (it is the full
    row mean there), ``col_var`` ([..., 1, n]) the other way round. The arithmetic runs on
    their local blocks.
    """

    def __init__(self, params, lr: float | Tensor = 1e-2, beta2_decay: float = -0.8,
                 eps: tuple[float | None, float] = (None, 1e-3), d: float = 1.0,
                 weight_decay: float = 0.0, *, maximize: bool = False) -> None:
        check_float("lr", lr, low=0.0)
        check_float("beta2_decay", beta2_decay, high=0.0)
        if not isinstance(eps, (tuple, list)) or len(eps) != 2:
            raise ValueError(f"eps must be a pair (eps1 or None, eps2), got {eps!r}")
        if eps[0] is not None:
            check_float("eps[0] (epsilon1)", eps[0], low=0.0)
        check_float("eps[1] (epsilon2)", eps[1], low=0.0)
        check_float("d (clipping threshold)", d, low=1.0)
        check_float("weight_decay", weight_decay, low=0.0)
        defaults = dict(lr=lr, beta2_decay=beta2_decay, eps=tuple(eps), d=d,
                        weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        # ---- round 1: ||p||^2, partial row and column sums of g*g, sums for mean_{-2}(R)
        red, work = SumReducer(), []
        for group in self.param_groups:
            lr = group["lr"].item() if isinstance(group["lr"], Tensor) else float(group["lr"])
            for p, layout, x, g in grads_of(group, "Adafactor", reject_complex=True):
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    if p.dim() > 1:  # torch's shapes: the reduced dim kept, size 1
                        keep = tuple(range(p.dim() - 1))
                        state["row_var"] = state_like(g.new_zeros((*g.shape[:-1], 1)), p,
                                                      shape=(*p.shape[:-1], 1), dims=(*keep, None))
                        state["col_var"] = state_like(g.new_zeros((*g.shape[:-2], 1, g.shape[-1])), p,
                                                      shape=(*p.shape[:-2], 1, p.shape[-1]),
                                                      dims=(*keep[:-1], None, p.dim() - 1))
                    else:
                        state["variance"] = elementwise_state(torch.zeros_like(g), p)
                state["step"] += 1
                w = dict(group=group, lr=lr, p=p, x=x, g=g, state=state, layout=layout,
                         i_p=red.add(torch.linalg.vector_norm(x).square(), layout, layout.all()))
                if p.dim() > 1:
                    # partial sums of squares, as torch's norm(g, dim).square()
                    rows = torch.linalg.vector_norm(g, dim=-1, keepdim=True).square_()
                    w["i_r"] = red.add(rows, layout, layout.over(-1))
                    w["i_c"] = red.add(torch.linalg.vector_norm(g, dim=-2, keepdim=True).square_(),
                                       layout, layout.over(-2))
                    # For mean_{-2}(R) after the update, without another round: it is linear,
                    # lerp(mean_{-2}(R_old), mean_{-2,-1}(g*g), 1 - beta2_hat).
                    w["i_old"] = red.add(local(state["row_var"]).sum(dim=-2, keepdim=True), layout,
                                         layout.over(-2))
                    w["i_all"] = red.add(rows.sum(dim=-2, keepdim=True), layout, layout.over(-2, -1))
                work.append(w)
        sums = red.run()
        # ---- after round 1: decay, the factors and the mean of R
        for w in work:
            group, p, x, state, layout = w["group"], w["p"], w["x"], w["state"], w["layout"]
            t = state["step"].item()
            one_minus_beta2 = t ** group["beta2_decay"]
            rho = min(w["lr"], 1 / t ** 0.5)
            w["alpha"] = (sums[w["i_p"]].sqrt() / p.numel() ** 0.5).clamp(min=group["eps"][1]) * rho
            if group["weight_decay"] != 0:
                x.mul_(1 - w["lr"] * group["weight_decay"])
            if p.dim() > 1:
                local(state["row_var"]).lerp_(sums[w["i_r"]].div_(p.shape[-1]), one_minus_beta2)
                local(state["col_var"]).lerp_(sums[w["i_c"]].div_(p.shape[-2]), one_minus_beta2)
                m, n = p.shape[-2], p.shape[-1]
                w["row_mean"] = sums[w["i_old"]].div_(m).lerp_(sums[w["i_all"]].div_(m * n), one_minus_beta2)
            else:
                local(state["variance"]).lerp_(w["g"] * w["g"], one_minus_beta2)
        # ---- round 2: RMS of the update
        red = SumReducer()
        for w in work:
            group, p, state, layout = w["group"], w["p"], w["state"], w["layout"]
            eps1 = group["eps"][0]
            if eps1 is None:
                eps1 = torch.finfo(p.dtype).eps
            if p.dim() > 1:
                var = local(state["row_var"]) @ local(state["col_var"])
                var.div_(w["row_mean"].clamp_(min=eps1))
            else:
                var = local(state["variance"]).clone()
            update = var.clamp_(min=eps1 * eps1).rsqrt_().mul_(w["g"])
            w["update"] = update
            w["i_u"] = red.add(torch.linalg.vector_norm(update).square(), layout, layout.all())
        sums = red.run()
        for w in work:
            rms = sums[w["i_u"]].sqrt() / (w["p"].numel() ** 0.5 * w["group"]["d"])
            w["x"].sub_(w["update"].mul_(w["alpha"] / rms.clamp(min=1.0)))
        return loss
