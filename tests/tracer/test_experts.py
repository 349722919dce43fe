"""A MoE block's experts traced as one op (``autopar::moe_experts``): the same numbers as transformers'."""

from __future__ import annotations

import copy

import pytest
import torch

from autopar.strategies import needs_decomposition
from autopar.tracer import profile, trace
from autopar.tracer.experts import experts_as_ops, is_experts_module


def mixtral(vocab: int = 101):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2))


def qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=101, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2))


def _same_as_transformers(model, ids, *, loss_tol: float, grad_atol: float) -> None:
    """One step of ``model`` with its experts as the op equals transformers' own (a copy):
    the op replaces one experts module per layer (two layers), loss and every gradient."""
    ref = copy.deepcopy(model)
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    with experts_as_ops(model) as count:
        assert count == 2  # one experts module per layer
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=loss_tol, atol=loss_tol)
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, rtol=1e-5, atol=grad_atol, msg=name)


@pytest.mark.parametrize("make", [mixtral, qwen2_moe], ids=["mixtral", "qwen2-moe"])
def test_the_op_gives_transformers_loss_and_gradients(make):
    model = make()
    ids = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(1))
    _same_as_transformers(model, ids, loss_tol=0, grad_atol=1e-7)
    assert "forward" not in model.model.layers[0].mlp.experts.__dict__  # restored


def test_traced_graph_has_one_op_per_block_with_its_flops():
    model = mixtral()
    ids = torch.randint(0, 101, (4, 8))
    traced = trace(model, {"input_ids": ids, "labels": ids}, decompose_if=needs_decomposition)
    ops = [n for n in traced.graph.nodes if n.target is torch.ops.autopar.moe_experts.default]
    assert len(ops) == 2
    prof = profile(traced)
    tokens, k, hidden, inter = 32, 2, 32, 64
    forward = 2 * tokens * k * hidden * 3 * inter  # gate, up and down products
    assert prof[ops[0].name].fwd_flops == forward
    assert prof[ops[0].name].bwd_flops == 3 * forward  # recompute + twice the forward


def test_other_experts_modules_are_traced_as_they_are():
    model = mixtral()
    experts = model.model.layers[0].mlp.experts
    assert is_experts_module(experts)
    experts.has_bias = True  # biases: a computation this op does not do
    assert not is_experts_module(experts)
    with experts_as_ops(model) as count:
        assert count == 1


def dbrx():
    from transformers import DbrxConfig, DbrxForCausalLM

    torch.manual_seed(0)
    return DbrxForCausalLM(DbrxConfig(
        vocab_size=101, d_model=32, n_heads=4, n_layers=2, max_seq_len=64,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2}))


def test_dbrx_flat_experts_give_transformers_loss_and_gradients():
    """DBRX's experts loop over the experts the batch hits (export cannot trace that); as the op
    they trace, and compute what the loop does (the per-expert sums in another order: float32)."""
    model = dbrx()
    ids = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(1))
    _same_as_transformers(model, ids, loss_tol=1e-6, grad_atol=1e-6)
    traced = trace(model, {"input_ids": ids, "labels": ids}, decompose_if=needs_decomposition)
    assert sum(n.target is torch.ops.autopar.moe_experts.default for n in traced.graph.nodes) == 2
