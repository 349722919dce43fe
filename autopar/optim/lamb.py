"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76
minutes") on plain tensors and on sharded DTensor parameters."""

from __future__ import annotations

import torch

from ._dist import SumReducer, check_betas, check_float, closure_loss, elementwise_state, grads_of, local

__all__ = ["Lamb"]


class Lamb(torch.optim.Optimizer):
    r"""Layer-wise Adaptive Moments for Batch training.

    For each parameter :math:`p` with gradient :math:`g` at step :math:`t` (1-based)::

        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat = m / (1 - beta1**t),  v_hat = v / (1 - beta2**t)     # only if bias_correction
        u = m_hat / (sqrt(v_hat) + eps) + weight_decay * p           # decoupled weight decay
        w = ||p||_2  clamped to at most clamp_value (phi of the paper; None: no clamp)
        r = w / ||u||_2   if w > 0 and ||u|| > 0   else 1            # the trust ratio
        p = p - lr * r * u

    ``eps`` is added to ``sqrt(v_hat)`` after bias correction (the paper's Algorithm 2 and the
    pytorch-lamb reference; ``clamp_value=10`` is that reference's default for phi). The norms
    are over the FULL parameter: on a DTensor each rank sums the squares of its local block and
    the sums are all-reduced over the mesh dims the parameter is sharded on, every parameter's
    two scalars in one concatenated all-reduce per (mesh, sharded mesh dims). The moments of a
    DTensor parameter are DTensors laid out like it (as torch's optimizers keep them), so
    ``torch.distributed.checkpoint`` reshards them.
    ``maximize`` ascends (g is negated).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, *, clamp_value: float | None = 10.0,
                 bias_correction: bool = True, maximize: bool = False) -> None:
        lr = check_float("lr", lr, low=0.0)
        betas = check_betas(betas)
        check_float("eps", eps, low=0.0)
        check_float("weight_decay", weight_decay, low=0.0)
        if clamp_value is not None:
            check_float("clamp_value", clamp_value, low=0.0, low_open=True)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        clamp_value=clamp_value, bias_correction=bias_correction, maximize=maximize)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        reducer = SumReducer()
        pending = []  # (group, local param, update, index of ||p||^2, index of ||u||^2)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p, layout, x, g in grads_of(group, "Lamb"):
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = elementwise_state(torch.zeros_like(x), p)
                    state["exp_avg_sq"] = elementwise_state(torch.zeros_like(x), p)
                state["step"] += 1
                t = state["step"].item()
                m, v = local(state["exp_avg"]), local(state["exp_avg_sq"])
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                bc1 = 1 - beta1 ** t if group["bias_correction"] else 1.0
                bc2 = 1 - beta2 ** t if group["bias_correction"] else 1.0
                update = (m / bc1).div_((v / bc2).sqrt_().add_(group["eps"]))
                if group["weight_decay"]:
                    update.add_(x, alpha=group["weight_decay"])
                sharded = layout.all()
                i_p = reducer.add(x.square().sum(), layout, sharded)
                i_u = reducer.add(update.square().sum(), layout, sharded)
                pending.append((group, x, update, i_p, i_u))
        sums = reducer.run()
        for group, x, update, i_p, i_u in pending:
            # tensors, not .item(): no host sync per parameter on an accelerator
            w, u = sums[i_p].sqrt(), sums[i_u].sqrt()
            if group["clamp_value"] is not None:
                w = w.clamp(max=group["clamp_value"])
            trust = torch.where((w > 0) & (u > 0), w / u, torch.ones_like(w))
            x.sub_(update.mul_(trust * group["lr"]))
        return loss
