"""Tiny training-mode models that draw random numbers, and a runner comparing them across meshes.

GPT-2 and BERT at their default dropout probabilities (0.1 everywhere: embeddings, attention
weights inside SDPA, residual paths), a GPT-NeoX decoder with dropout 0.1, a DINOv2 ViT with
stochastic depth (``drop_path_rate=0.1``: ``torch.rand`` inside forward) -- tiny widths, depths and
vocabularies. ``run_on`` plans one model on a mesh with nearly free links (so the solver splits
what rules let it split), then on forked gloo ranks seeds autopar (``autopar.manual_seed``), trains
``steps`` steps of SGD and returns the loss curve, the first step's full gradients and the final
full parameters (rank 0's, after checking every rank agrees).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

import autopar
from autopar.api import PlanOptions, plan_traced
from autopar.runtime.build import build_module
from autopar.runtime.launch import run_local
from autopar.runtime.nodes import KernelCall
from autopar.runtime.recompute import CheckpointRegion
from autopar.strategies import needs_decomposition
from autopar.tracer import profile, trace
from tests.runtime.pipeline.test_pipeline import with_block_recompute
from tests.sweeps.harness import fast_mesh

SEED = 1234
BATCH, SEQ, VOCAB = 4, 8, 96


def gpt2():
    import transformers as tf

    cfg = tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                        bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    assert (cfg.resid_pdrop, cfg.embd_pdrop, cfg.attn_pdrop) == (0.1, 0.1, 0.1)  # the defaults
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return tf.GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}


def bert():
    import transformers as tf

    cfg = tf.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                        vocab_size=VOCAB, max_position_embeddings=SEQ, attn_implementation="sdpa")
    assert (cfg.hidden_dropout_prob, cfg.attention_probs_dropout_prob) == (0.1, 0.1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return tf.BertForMaskedLM(cfg), {"input_ids": ids, "labels": ids}


def gpt_neox():
    """The issue's example: a GPT-NeoX decoder with attention and hidden dropout 0.1 gave 4.62362 on
    (1,), 4.62338 on (2,) and 4.62698 on (2, 2) when each rank drew its own masks."""
    import transformers as tf

    cfg = tf.GPTNeoXConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                           vocab_size=VOCAB, max_position_embeddings=SEQ, attention_dropout=0.1, hidden_dropout=0.1,
                           attn_implementation="sdpa")
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return tf.GPTNeoXForCausalLM(cfg), {"input_ids": ids, "labels": ids}


class _PixelLoss(nn.Module):
    """A DINOv2 backbone with a linear classifier on the CLS token and cross entropy."""

    def __init__(self, backbone: nn.Module, hidden: int, classes: int) -> None:
        super().__init__()
        self.backbone, self.head = backbone, nn.Linear(hidden, classes)

    def forward(self, pixel_values, labels):
        cls = self.backbone(pixel_values=pixel_values).last_hidden_state[:, 0]
        return nn.functional.cross_entropy(self.head(cls), labels)


def vit_drop_path():
    import transformers as tf

    cfg = tf.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2, image_size=16,
                          patch_size=4, drop_path_rate=0.1, attn_implementation="sdpa")
    return _PixelLoss(tf.Dinov2Model(cfg), 32, 10), (torch.randn(BATCH, 3, 16, 16), torch.randint(0, 10, (BATCH,)))


def phimoe():
    """PhiMoE: training-mode routing samples with ``exponential_`` (Gumbel) and ``rand_like``
    (Heun's third-order switch), inputs jittered by ``uniform_``."""
    import transformers as tf

    cfg = tf.PhimoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                          max_position_embeddings=SEQ, input_jitter_noise=0.01, attention_dropout=0.0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return tf.PhimoeForCausalLM(cfg), {"input_ids": ids, "labels": ids}


MODELS = {"gpt2": gpt2, "bert": bert, "vit-drop-path": vit_drop_path, "gpt-neox": gpt_neox, "phimoe": phimoe}


def build(name: str):
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    return model.train(), inputs


def traced_of(model, inputs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = trace(model, inputs, decompose_if=needs_decomposition)
    return traced, profile(traced)


def plan_for(traced, prof, shape, *, recompute: bool = False):
    plan = plan_traced(traced, prof, mesh=fast_mesh(shape), options=PlanOptions(checkpoint="none")).plan
    return with_block_recompute(plan, traced) if recompute else plan


DRAW_OPS = ("dropout", "rand", "bernoulli", "scaled_dot_product_attention", "uniform", "exponential")


def sharded_draws(plan) -> int:
    """Random ops (and attention, which draws its dropout) the plan runs on shards."""
    return sum(any(w in n.op for w in DRAW_OPS) and "S" in (n.output_specs[0] or "") for n in plan.by_kind("op"))


def _call(model, inputs):
    out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    return out if isinstance(out, torch.Tensor) else out.loss


def _train(rank, world, model, traced, plan, inputs, steps, lr):
    autopar.manual_seed(SEED)
    pm = build_module(model, traced, plan, device=torch.device("cpu"))
    opt = torch.optim.SGD(pm.parameters(), lr=lr)
    losses, first = [], None
    for _ in range(steps):
        opt.zero_grad()
        loss = _call(pm, inputs)
        loss.backward()
        losses.append(loss.detach().clone())
        if first is None:
            first = pm.full_gradients()
        opt.step()
    kernels = sum(isinstance(m, KernelCall) and m.name in ("random_draw", "sdpa_dropout") for m in pm.modules())
    return torch.stack(losses), first, pm.full_state_dict(), kernels


def _train_each(rank, world, model, traced, plans, inputs, steps, lr):
    return [_train(rank, world, model, traced, plan, inputs, steps, lr) for plan in plans]


def run_on(model, traced, plan, inputs, *, steps: int = 1, lr: float = 0.1):
    """(loss curve, first step's gradients, final full state, random kernel calls in the code) on
    rank 0, after checking that every rank returned the same."""
    return run_each(model, traced, [plan], inputs, steps=steps, lr=lr)[0]


def run_each(model, traced, plans, inputs, *, steps: int = 1, lr: float = 0.1):
    """``run_on`` for several plans of one mesh, in one launch: each from the same seed (the
    draws restart with ``autopar.manual_seed``) and a fresh module."""
    world = 1
    for s in plans[0].mesh.shape:
        world *= s
    assert all(p.mesh.shape == plans[0].mesh.shape for p in plans), [p.mesh.shape for p in plans]
    results = run_local(_train_each, world, model, traced, plans, inputs, steps, lr, timeout=240)
    for other in results[1:]:
        for mine, theirs in zip(results[0], other):
            assert torch.equal(theirs[0], mine[0]), "ranks disagree on the loss"
    return results[0]


def assert_same(label: str, got, want, *, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    """Loss curve, gradients and parameters equal (float tolerance: sums are ordered per plan)."""
    g_loss, g_grads, g_state, _ = got
    w_loss, w_grads, w_state, _ = want
    assert torch.allclose(g_loss, w_loss, rtol=rtol, atol=atol), f"{label}: loss {g_loss.tolist()} != {w_loss.tolist()}"
    for k, w in w_grads.items():
        g = g_grads.get(k)
        if w is None:
            assert g is None or not g.abs().max() > atol, f"{label}: grad {k} should be zero"
            continue
        assert g is not None and torch.allclose(g, w, rtol=rtol, atol=atol), \
            f"{label}: grad {k} max error {(g - w).abs().max().item() if g is not None else 'missing'}"
    for k, w in w_state.items():
        assert torch.allclose(g_state[k], w, rtol=rtol, atol=atol), f"{label}: parameter {k} after the steps"


def pipeline_plan_for(model, inputs, shape, *, microbatches: int = 2, recompute: bool = False):
    """(micro-batch trace, plan) with 2 pipeline stages on ``shape`` (stages on its sub-mesh),
    every block recomputed in backward when asked (regions inside the stages)."""
    from autopar.tracer.microbatch import micro_batch

    plan = autopar.plan(model, inputs, mesh=fast_mesh(shape), pipeline=2, microbatches=microbatches,
                        checkpoint="none", cache=False)
    traced, _ = traced_of(model, micro_batch(inputs, microbatches))
    return traced, with_block_recompute(plan, traced) if recompute else plan


def _train_pipeline(rank, world, model, traced, plan, inputs, steps, lr):
    from autopar.runtime.pipeline import build_pipeline

    autopar.manual_seed(SEED)
    pm = build_pipeline(model, traced, plan, device="cpu")
    opt = torch.optim.SGD(pm.parameters(), lr=lr)
    losses, first = [], None
    for _ in range(steps):
        opt.zero_grad()
        losses.append(pm.step(*inputs) if isinstance(inputs, tuple) else pm.step(**inputs))
        if first is None:
            first = pm.full_gradients()
        opt.step()
    regions = sum(isinstance(m, CheckpointRegion) for stage in pm._stages for m in stage.modules())
    return torch.stack([x.detach() for x in losses]), first, pm.full_state_dict(), regions


def run_pipeline(model, traced, plan, inputs, *, steps: int = 1, lr: float = 0.1):
    """``run_on`` for a pipeline plan (``pipeline_plan_for``); the last item is the number of
    checkpoint regions in rank 0's stages."""
    world = 1
    for s in plan.mesh.shape:
        world *= s
    results = run_local(_train_pipeline, world, model, traced, plan, inputs, steps, lr, timeout=240)
    for other in results[1:]:
        assert torch.equal(other[0], results[0][0]), "ranks disagree on the loss"
    return results[0]
