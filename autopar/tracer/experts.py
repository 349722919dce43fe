"""Mixture-of-experts blocks as ONE op: ``autopar::moe_experts``, so experts can be split by expert.

transformers 5 runs a MoE block's experts as a chain of ops over *all* tokens: a global sort of
the (token, expert) pairs by expert, a gather of the tokens in that order, grouped products
with global offsets, and an inverse permutation (``transformers.integrations.moe``). The
sorted tensor's rows belong to experts by data-dependent offsets, which no placement can
describe, so that chain can split features but never experts. Expert parallelism moves whole
tokens to the rank holding their expert (all-to-all dispatch and combine), which only an op
that sees the whole block can do. During the trace every experts module is therefore called
as one custom op::

    moe_experts(hidden (T, H), top_k_index (T, k) int, top_k_weights (T, k),
                gate_up (E, 2I, H), down (E, H, I), act) -> (T, H)

    out[t] = sum_j top_k_weights[t, j] * down[e] @ act(gate[e] @ x[t]) * (up[e] @ x[t]),
             e = top_k_index[t, j], [gate; up] = gate_up[e] (concatenated halves)

the same math, in the same order of the final sum over ``k``, as transformers' experts
(``grouped_mm_experts_forward``; the routing weights multiply each expert's output before the
per-token sum, which is done in the output's dtype). Its backward recomputes the experts under
autograd (``moe_experts_backward``), so the op saves only its inputs.

Which modules: duck-typed, as ``transformers.integrations.moe.use_experts_implementation``
shapes them -- 3-D ``gate_up_proj`` and ``down_proj`` parameters, ``num_experts``, the default
gate (concatenated ``[gate; up]``, not transposed, no biases, no post-expert norm) and an
activation this file knows (silu, gelu, gelu-tanh, relu). Also DBRX's experts (``DbrxExperts``:
no ``use_experts_implementation``; a Python loop over the experts the batch hits, which export
cannot trace): flat ``mlp.w1``, ``mlp.v1``, ``mlp.w2`` of shape (E * I, H) are the same GLU,
``gate_up = cat(w1, v1)`` and ``down = w2^T`` per expert, viewed as such in the graph (a split of
the experts is a split of the flat rows). Any other experts module is traced through as it
is (its ops keep their own rules). ``transformers`` is not imported.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import register_flop_formula

__all__ = ["moe_experts", "moe_experts_backward", "experts_as_ops", "is_experts_module", "experts_flops"]

# activation class name (transformers' ACT2FN classes, torch's) -> the op's ``act`` argument
_ACT_NAMES = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
              "relu": F.relu}
_CLASS_TO_NAME = {"SiLUActivation": "silu", "SiLU": "silu", "GELUActivation": "gelu", "GELU": "gelu",
                  "GELUTanh": "gelu_tanh", "NewGELUActivation": "gelu_tanh", "ReLU": "relu"}


def _experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
             gate_up: torch.Tensor, down: torch.Tensor, act: str) -> torch.Tensor:
    """The reference computation (differentiable): grouped by expert, summed over ``k`` last."""
    tokens, k = top_k_index.shape
    flat_ids = top_k_index.reshape(-1)
    rows = hidden.new_zeros(tokens * k, hidden.shape[-1])
    fn = _ACT_NAMES[act]
    for e in torch.unique(flat_ids).tolist():
        if not 0 <= e < gate_up.shape[0]:
            continue  # transformers' expert-parallel sentinel: a pair no local expert takes
        pairs = (flat_ids == e).nonzero().squeeze(1)
        x = hidden[pairs // k]
        gate, up = F.linear(x, gate_up[e]).chunk(2, dim=-1)
        rows = rows.index_copy(0, pairs, F.linear(fn(gate) * up, down[e]))
    weighted = rows * top_k_weights.reshape(-1, 1).to(rows.dtype)
    return weighted.view(tokens, k, weighted.shape[-1]).sum(dim=1).to(hidden.dtype)


@torch.library.custom_op("autopar::moe_experts", mutates_args=())
def moe_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor, act: str) -> torch.Tensor:
    """A MoE block's experts (module docstring)."""
    with torch.no_grad():
        return _experts(hidden, top_k_index, top_k_weights, gate_up, down, act)


@moe_experts.register_fake
def _moe_experts_fake(hidden, top_k_index, top_k_weights, gate_up, down, act):
    return hidden.new_empty(hidden.shape)


@torch.library.custom_op("autopar::moe_experts_backward", mutates_args=())
def moe_experts_backward(grad: torch.Tensor, hidden: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                         act: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``moe_experts`` for hidden, top_k_weights, gate_up and down, by recomputing
    the experts (what the forward did not save). ``torch.func.vjp``: autograd proper is below
    this op's dispatch, functorch's transform is not."""
    def experts(h, w, gu, d):
        return _experts(h, top_k_index, w, gu, d, act)

    _, pullback = torch.func.vjp(experts, hidden, top_k_weights, gate_up, down)
    return tuple(pullback(grad))


@moe_experts_backward.register_fake
def _moe_experts_backward_fake(grad, hidden, top_k_index, top_k_weights, gate_up, down, act):
    return (hidden.new_empty(hidden.shape), top_k_weights.new_empty(top_k_weights.shape),
            gate_up.new_empty(gate_up.shape), down.new_empty(down.shape))


def _setup_context(ctx, inputs, output) -> None:
    hidden, top_k_index, top_k_weights, gate_up, down, act = inputs
    ctx.save_for_backward(hidden, top_k_index, top_k_weights, gate_up, down)
    ctx.act = act


def _backward(ctx, grad):
    hidden, top_k_index, top_k_weights, gate_up, down = ctx.saved_tensors
    g_hidden, g_weights, g_gate_up, g_down = moe_experts_backward(
        grad.contiguous(), hidden, top_k_index, top_k_weights, gate_up, down, ctx.act)
    return g_hidden, None, g_weights, g_gate_up, g_down, None


moe_experts.register_autograd(_backward, setup_context=_setup_context)


def experts_flops(hidden_shape, top_k_shape, gate_up_shape, *, backward: bool = False) -> int:
    """FLOPs of the experts' products: ``2 * T * k * H * 3I`` forward (gate/up and down); the
    backward recomputes the forward and then costs twice it."""
    pairs = top_k_shape[0] * top_k_shape[1]
    two_i, h = gate_up_shape[1], gate_up_shape[2]
    forward = 2 * pairs * h * (two_i + two_i // 2)
    return 3 * forward if backward else forward


@register_flop_formula(torch.ops.autopar.moe_experts)
def _forward_flops(hidden, top_k_index, top_k_weights, gate_up, down, act, *args, **kwargs) -> int:
    return experts_flops(hidden, top_k_index, gate_up)  # tensors arrive as their shapes


@register_flop_formula(torch.ops.autopar.moe_experts_backward)
def _backward_flops(grad, hidden, top_k_index, top_k_weights, gate_up, down, act, *args, **kwargs) -> int:
    return experts_flops(hidden, top_k_index, gate_up, backward=True)


def _activation_name(module: nn.Module) -> str | None:
    return _CLASS_TO_NAME.get(type(getattr(module, "act_fn", None)).__name__)


def is_experts_module(module: nn.Module) -> bool:
    """A transformers experts module of the shape this op computes (module docstring)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)):
        return False
    if gate_up.dim() != 3 or down.dim() != 3 or not isinstance(getattr(module, "num_experts", None), int):
        return False
    default_gate = getattr(type(module), "_apply_gate", None)
    return (getattr(module, "has_gate", False) and not getattr(module, "has_bias", True)
            and not getattr(module, "is_transposed", True) and getattr(module, "is_concatenated", False)
            and not getattr(module, "has_post_expert_norm", True)
            and getattr(default_gate, "__name__", "") == "_default_apply_gate"
            and _activation_name(module) is not None
            and gate_up.shape[0] == down.shape[0] == module.num_experts
            and gate_up.shape[2] == down.shape[1] and gate_up.shape[1] == 2 * down.shape[2])


def _flat_glu(module: nn.Module) -> tuple[int, int, int, str] | None:
    """(experts, intermediate, hidden, act) of DBRX's experts module, else None: ``mlp.w1``,
    ``mlp.v1``, ``mlp.w2`` all (E * I, H), ``num_experts``, ``ffn_hidden_size`` and
    ``hidden_size`` ints, an activation this file knows (``mlp.activation_fn``)."""
    mlp = getattr(module, "mlp", None)
    weights = [getattr(mlp, name, None) for name in ("w1", "v1", "w2")]
    if not all(isinstance(w, torch.Tensor) and w.dim() == 2 for w in weights):
        return None
    sizes = [getattr(module, name, None) for name in ("num_experts", "ffn_hidden_size", "hidden_size")]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in sizes):
        return None
    experts, inter, hidden = sizes
    act = _CLASS_TO_NAME.get(type(getattr(mlp, "activation_fn", None)).__name__)
    if act is None or any(tuple(w.shape) != (experts * inter, hidden) for w in weights):
        return None
    return experts, inter, hidden, act


def _flat_glu_forward(module: nn.Module, experts: int, inter: int, hidden: int, act: str):
    def forward(hidden_states, top_k_index, top_k_weights):
        mlp = module.mlp
        gate_up = torch.cat([mlp.w1.view(experts, inter, hidden), mlp.v1.view(experts, inter, hidden)], dim=1)
        down = mlp.w2.view(experts, inter, hidden).transpose(1, 2)
        out = moe_experts(hidden_states.reshape(-1, hidden), top_k_index, top_k_weights, gate_up, down, act)
        return out.view(hidden_states.shape[0], -1, hidden)

    return forward


@contextlib.contextmanager
def experts_as_ops(model: nn.Module) -> Iterator[int]:
    """While active, every experts module of ``model`` (``is_experts_module``, or DBRX's flat
    GLU experts) runs as ``autopar::moe_experts``; yields how many. Restored afterwards, on
    failure too."""
    patched = []
    for module in model.modules():
        if "forward" in module.__dict__:
            continue
        if is_experts_module(module):
            act = _activation_name(module)

            def forward(hidden_states, top_k_index, top_k_weights, _m=module, _act=act):
                return moe_experts(hidden_states, top_k_index, top_k_weights, _m.gate_up_proj, _m.down_proj, _act)

            module.forward = forward
            patched.append(module)
        elif (flat := _flat_glu(module)) is not None:
            module.forward = _flat_glu_forward(module, *flat)
            patched.append(module)
    try:
        yield len(patched)
    finally:
        for module in patched:
            del module.forward
