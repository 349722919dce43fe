"""GaLore-AdamW (Zhao et al., ICML 2024, "GaLore: Memory-Efficient LLM Training by Gradient
Low-Rank Projection") on plain tensors and sharded DTensor parameters."""

from __future__ import annotations

import torch
from torch import Tensor

from ._dist import SumReducer, check_betas, check_float, closure_loss, grads_of, local, local_index, state_like

__all__ = ["GaLoreAdamW"]


class GaLoreAdamW(torch.optim.Optimizer):
    r"""AdamW whose moments live in a rank-``rank`` projection of each 2-D gradient.

    For a 2-D parameter of shape (m, n) at step t (1-based), with ``k = t - 1``::

        if k % update_proj_gap == 0:  U, S, Vh = svd(G) of the FULL gradient (float32)
            m >= n: P = Vh[:rank]      (rank x n),  R = G P^T   (m x rank)   # project the right
            m <  n: P = U[:, :rank]    (m x rank),  R = P^T G   (rank x n)   # (smaller) side
        mo = b1 mo + (1-b1) R;  v = b2 v + (1-b2) R*R
        N = (mo / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)
        p = p * (1 - lr * weight_decay) - lr * scale * back(N)   # back: N P, or P N

    The side rule and the refresh at steps 0, gap, 2*gap, ... (counting before the increment)
    are those of the authors' ``galore_torch.GaLoreProjector`` (proj_type "std"); moments are
    kept across refreshes, as there. The AdamW arithmetic is ``torch.optim.AdamW``'s (eps added
    after bias correction, weight decay ``p *= 1 - lr*wd`` before the step), not the
    transformers-AdamW arithmetic that ``galore_torch`` inherits (eps before correction, decay
    after the step). Parameters of other ranks (1-D, 3-D+) or in a group with ``rank=None`` get
    exactly ``torch.optim.AdamW`` (amsgrad off).

    Distributed: only on refresh steps is the gradient all-gathered (``full_tensor()``, one
    gather per projected parameter); every rank then computes the same SVD of the same bits
    (LAPACK is deterministic for equal inputs and thread counts) and keeps its slice of P.
    The projection R is a sum over the shards of the projected dim: R = sum_i G_i P_i^T is
    all-reduced (an m_local x rank, or rank x n_local, block) over the mesh dims sharding that
    dim, all projected parameters in one batched all-reduce per (mesh, mesh dims) and step.
    R is then sharded like G along the kept dim, so the moments and ``back`` are local.

    State of a DTensor parameter is DTensors on its mesh (so ``torch.distributed.checkpoint``
    reshards it; the arithmetic runs on their local blocks): unprojected moments like the
    parameter; ``proj`` (P, global r x n or m x r, identical on every rank) sharded like G's
    projected dim, Replicate on the other mesh dims; the low-rank moments (global m x r or
    r x n) sharded like G's kept dim, Replicate on the mesh dims sharding the projected one.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, rank: int | None = 128,
                 update_proj_gap: int = 200, scale: float = 0.25, maximize: bool = False) -> None:
        lr = check_float("lr", lr, low=0.0)
        betas = check_betas(betas)
        check_float("eps", eps, low=0.0)
        check_float("weight_decay", weight_decay, low=0.0)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, rank=rank,
                        update_proj_gap=update_proj_gap, scale=scale, maximize=maximize)
        super().__init__(params, defaults)
        for group in self.param_groups:  # groups may override rank/gap/scale
            r, gap = group["rank"], group["update_proj_gap"]
            if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 1):
                raise ValueError(f"rank must be a positive int or None, got {r!r}")
            if isinstance(gap, bool) or not isinstance(gap, int) or gap < 1:
                raise ValueError(f"update_proj_gap must be a positive int, got {gap!r}")
            check_float("scale", group["scale"], low=0.0, low_open=True)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        red, work = SumReducer(), []
        for group in self.param_groups:
            for p, layout, _, g in grads_of(group, "GaLoreAdamW"):
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                project = group["rank"] is not None and p.dim() == 2
                w = dict(group=group, p=p, g=g, state=state, project=project)
                if project:
                    k = int(state["step"].item())
                    if k % group["update_proj_gap"] == 0:
                        self._refresh(p, state, layout, group["rank"], maximize=group["maximize"])
                    P = local(state["proj"])
                    if state["right"]:  # G (m_l x n_l) P^T (n_l x r): sum over the column shards
                        w["i"] = red.add(g @ P.T, layout, layout.over(1))
                    else:  # P^T (r x m_l) G (m_l x n_l): sum over the row shards
                        w["i"] = red.add(P.T @ g, layout, layout.over(0))
                work.append(w)
        sums = red.run()
        for w in work:
            group, p, state = w["group"], w["p"], w["state"]
            grad = sums[w["i"]] if w["project"] else w["g"]
            beta1, beta2 = group["betas"]
            if "exp_avg" not in state:
                state["exp_avg"] = self._moment(torch.zeros_like(grad), p, state, w["project"])
                state["exp_avg_sq"] = self._moment(torch.zeros_like(grad), p, state, w["project"])
            state["step"] += 1
            t = state["step"].item()
            m, v = local(state["exp_avg"]), local(state["exp_avg_sq"])
            m.lerp_(grad, 1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            bc1, bc2 = 1 - beta1 ** t, 1 - beta2 ** t
            norm = v.sqrt().div_(bc2 ** 0.5).add_(group["eps"])
            step_size = group["lr"] / bc1
            x = local(p)
            if group["weight_decay"] != 0:
                x.mul_(1 - group["lr"] * group["weight_decay"])
            if w["project"]:
                n = m / norm
                P = local(state["proj"])
                back = n @ P if state["right"] else P @ n
                x.add_(back.to(x.dtype), alpha=-step_size * group["scale"])
            else:
                x.addcdiv_(m, norm, value=-step_size)
        return loss

    @staticmethod
    def _refresh(p: Tensor, state: dict, layout, rank: int, *, maximize: bool) -> None:
        """New projector from the SVD of the full gradient; keeps this rank's slice of it."""
        from torch.distributed.tensor import DTensor

        full = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        if maximize:
            full = -full
        u, _, vh = torch.linalg.svd(full.float(), full_matrices=False)
        m, n = p.shape
        right = m >= n
        if right:
            proj = vh[:rank, local_index(layout, n, 1)]  # rank x n_local
        else:
            proj = u[local_index(layout, m, 0), :rank]  # m_local x rank
        proj = proj.to(p.dtype)
        if "proj" in state:  # in place: whoever holds the state (a checkpoint) sees the new one
            local(state["proj"]).copy_(proj)
            return
        state["right"] = right
        # P is the same full matrix on every rank; a rank keeps the slice its block of G meets,
        # sharded like G's projected dim (right: P's columns like G's; left: P's rows like G's)
        # and Replicate on the other mesh dims.
        if right:
            state["proj"] = state_like(proj, p, shape=(vh[:rank].shape[0], n), dims=(None, 1))
        else:
            state["proj"] = state_like(proj, p, shape=(m, u[:, :rank].shape[1]), dims=(0, None))

    @staticmethod
    def _moment(value: Tensor, p: Tensor, state: dict, project: bool) -> Tensor:
        """A zero moment (``value``, the local block) as a DTensor: like ``p`` unprojected; the
        low-rank moments like R -- right: (m x r), sharded like G's rows, Replicate where G's
        columns are sharded (R sums over them); left: (r x n) the other way round."""
        if not project:
            return state_like(value, p, shape=p.shape, dims=(*range(p.dim()),))
        r = state["proj"].shape[0] if state["right"] else state["proj"].shape[1]
        m, n = p.shape
        if state["right"]:
            return state_like(value, p, shape=(m, r), dims=(0, None))
        return state_like(value, p, shape=(r, n), dims=(None, 1))
