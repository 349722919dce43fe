"""Sequence-split attention on real gloo processes: HF Llama and Qwen2 (tiny, sdpa attention,
sequence 64) planned with ``sequence_parallel`` pinned train exactly like the single-device model.

Each plan pins every attention on the last mesh axis (``autopar.planner.sequence``): ``"ring"``
(query, key, value and output split on the sequence, the ring attention kernel with its
point-to-point steps) and ``"all_to_all"`` (Ulysses: heads split inside, sequence-split inputs).
With and without a left-padded ``attention_mask`` (HF's 4-D causal+padding mask, whose padded
query rows see no key), on meshes (4,) and (2, 2): the loss, every gradient, the global gradient
norm and the state after clipped AdamW steps equal the single-device run
(``tests/runtime/test_e2e.check_module``), and each plan really runs the pinned strategy.
"""

from __future__ import annotations

import pytest
import torch

from autopar import zoo
from autopar.api import PlanOptions, plan_traced
from autopar.runtime.build import build_module
from autopar.runtime.counting import count_collectives
from autopar.runtime.launch import run_local
from autopar.strategies import needs_decomposition
from autopar.tracer import profile, trace
from tests.runtime.test_e2e import check_module, fast_mesh, reference

pytestmark = pytest.mark.slow

SEQ = 64


def qwen2_tiny():
    """Qwen2 at the zoo's tiny Llama sizes (2 layers, hidden 64, 4 heads, 2 KV heads, vocab 128)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         use_cache=False, attn_implementation="sdpa", tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config)
    ids = torch.randint(0, 128, (4, SEQ))
    return model, {"input_ids": ids, "labels": ids.clone()}


def build(name: str, padded: bool):
    torch.manual_seed(0)
    model, inputs = qwen2_tiny() if name == "qwen2" else zoo.build("llama-1b", tiny=True, seq=SEQ, device="cpu")
    if padded:  # left padding: batch row b starts with 3b padding tokens (their labels ignored)
        mask = torch.ones(inputs["input_ids"].shape, dtype=torch.long)
        for b in range(mask.shape[0]):
            mask[b, :3 * b] = 0
        labels = inputs["labels"].masked_fill(mask == 0, -100)
        inputs = {**inputs, "attention_mask": mask, "labels": labels}
    return model, inputs


def _run(rank, world, model, inputs, traced, plans, ref):
    errors = []
    for label, plan in plans:
        pm = build_module(model, traced, plan, device=torch.device("cpu"))
        with count_collectives() as counts:
            errors += check_module(label, pm, inputs, ref)
        if "ring" in label and not counts["send_recv"]:
            errors.append(f"{label}: no ring step ran")
        if "all_to_all" in label and not counts["all_to_all"]:
            errors.append(f"{label}: no all-to-all ran")
    return errors


@pytest.mark.parametrize("padded", [False, True], ids=["causal", "padding-mask"])
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_sequence_split_attention_matches_single_device(name, padded):
    model, inputs = build(name, padded)
    traced = trace(model, inputs, decompose_if=needs_decomposition)
    prof = profile(traced)
    plans = []
    for shape, mode in [((4,), "ring"), ((2, 2), "ring"), ((2, 2), "all_to_all")]:
        plan = plan_traced(traced, prof, mesh=fast_mesh(shape), options=PlanOptions(sequence_parallel=mode)).plan
        attention = [n for n in plan.by_kind("op") if n.name.startswith("scaled_dot_product_attention")]
        assert attention and all(_pinned(n.strategy, mode) for n in attention), [n.strategy for n in attention]
        plans.append((f"{name} {'padded' if padded else 'causal'} {mode} mesh {shape}", plan))
    ref = reference(model, inputs)
    errors = run_local(_run, 4, model, inputs, traced, plans, ref, timeout=600)
    flat = [e for rank_errors in errors for e in rank_errors]
    assert not flat, "\n".join(flat[:20])


def _pinned(strategy: str, mode: str) -> bool:
    """The query spec of ``strategy`` ("S2 x S2 x ..."; "S0S2 ...") splits the sequence (dim 2)
    for the ring, the heads (dim 1) for all-to-all, on the last mesh axis."""
    query = strategy.split(" x ")[0]
    return query.endswith("S2" if mode == "ring" else "S1")
