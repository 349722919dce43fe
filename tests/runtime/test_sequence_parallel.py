"""Sequence-split attention on real gloo processes: HF Llama and Qwen2 (tiny, sdpa attention,
sequence 64) planned with ``sequence_parallel`` pinned train exactly like the single-device model.

Each plan pins every attention on the last mesh axis (``autopar.planner.sequence``): ``"ring"``
(query, key, value and output split on the sequence, the ring attention kernel with its
point-to-point steps) and ``"all_to_all"`` (Ulysses: heads split inside, sequence-split inputs).
With and without a left-padded ``attention_mask`` (HF's 4-D causal+padding mask, whose padded
query rows see no key), on meshes (4,) and (2, 2) (the ring on both, Ulysses on (2, 2)): the loss,
every gradient, the global gradient norm and the state after clipped AdamW steps equal the
single-device run, at ample budgets and (the ring on (2, 2)) under 60% of the replicated peak
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
SDPA = torch.ops.aten.scaled_dot_product_attention.default


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
        if "ring" in label and not counts["all_to_all"]:  # HF's causal masks vary over the rows
            errors.append(f"{label}: no zig-zag permutation ran")
        if "all_to_all" in label and not counts["all_to_all"]:
            errors.append(f"{label}: no all-to-all ran")
    return errors


# All four with the whole sweeps (``pytest -m full_sweep``: about 20 s each on 2 cores); the default
# run splits sequences through the Booster (tests/booster/test_hybrid_sequence.py) and the ring
# attention rules (tests/strategies/test_ring_attention.py).
CASES = [pytest.param("llama", True, id="llama-padding-mask", marks=pytest.mark.full_sweep)] + [
    pytest.param(name, padded, id=f"{name}-{'padding-mask' if padded else 'causal'}", marks=pytest.mark.full_sweep)
    for name, padded in (("llama", False), ("qwen2", False), ("qwen2", True))]


@pytest.mark.parametrize("name, padded", CASES)
def test_sequence_split_attention_matches_single_device(name, padded):
    model, inputs = build(name, padded)
    traced = trace(model, inputs, decompose_if=needs_decomposition)
    prof = profile(traced)
    # Tight: the ring under 60% of the replicated plan's peak on the CPU preset (parameters sharded too).
    tight = int(0.6 * plan_traced(traced, prof, mesh=(4,), options=PlanOptions(memory_budget=None)).plan
                .estimate.peak_bytes)
    plans = []
    for shape, mode, budget in [((4,), "ring", None), ((2, 2), "ring", None), ((2, 2), "all_to_all", None),
                                ((2, 2), "ring", tight)]:
        mesh = fast_mesh(shape) if budget is None else shape
        options = PlanOptions(sequence_parallel=mode, memory_budget=budget)
        plan = plan_traced(traced, prof, mesh=mesh, options=options).plan
        attention = [n for n in plan.by_kind("op") if n.name.startswith("scaled_dot_product_attention")]
        assert attention and all(_pinned(n.strategy, mode) for n in attention), [n.strategy for n in attention]
        if budget is not None:
            assert plan.estimate.peak_bytes <= budget
            assert any(not set(n.output_specs[0]) <= {"R"} for n in plan.by_kind("parameter"))
        label = f"{name} {'padded' if padded else 'causal'} {mode} mesh {shape} {'tight' if budget else 'ample'}"
        plans.append((label, plan))
    ref = reference(model, inputs)
    errors = run_local(_run, 4, model, inputs, traced, plans, ref, timeout=600)
    flat = [e for rank_errors in errors for e in rank_errors]
    assert not flat, "\n".join(flat[:20])


def _pinned(strategy: str, mode: str) -> bool:
    """The query spec of ``strategy`` ("S2 x S2 x ..."; "S0S2 ...") splits the sequence (dim 2)
    for the ring, the heads (dim 1) for all-to-all, on the last mesh axis."""
    query = strategy.split(" x ")[0]
    return query.endswith("S2" if mode == "ring" else "S1")


def _ring_steps(rank, world, model, x, traced, plan, ref):
    pm = build_module(model, traced, plan, device=torch.device("cpu"))
    with count_collectives() as counts:
        loss = pm(x)
        loss.backward()
    grads = pm.full_gradients()
    errors = [] if torch.allclose(loss.detach(), ref["loss"], rtol=1e-5) else [f"loss {loss} != {ref['loss']}"]
    errors += [f"grad {k}" for k, want in ref["grads"].items() if not torch.allclose(grads[k], want, atol=1e-6)]
    return errors, counts["send_recv"], counts.bytes["send_recv"], counts["all_to_all"], counts.bytes["all_to_all"]


def test_the_ring_takes_the_steps_its_cost_prices():
    """One causal attention ring-split over 4 ranks: the forward passes key and value 3 steps,
    the backward passes them 3 steps again and their gradients 4 (home) -- ``ring_comm_cost``'s
    open and closed turns -- each step one local block; the zig-zag layout (causal) moves query,
    key, value and output by one all-to-all each, and their gradients back; the result is exact."""
    from tests.planner.test_sequence import Attention

    torch.manual_seed(0)
    model, x = Attention(heads=4), torch.randn(4, 8, 16)
    traced = trace(model, (x,), decompose_if=needs_decomposition)
    options = PlanOptions(sequence_parallel="ring")
    plan = plan_traced(traced, profile(traced), mesh=fast_mesh((4,)), options=options).plan
    assert not plan.recompute  # a recomputed forward would pass the blocks again
    loss = model(x)
    loss.backward()
    ref = {"loss": loss.detach(), "grads": {k: p.grad for k, p in model.named_parameters()}}
    block = 4 * 4 * 2 * 4 * 4  # one rank's key (or value): batch 4, 4 heads, 2 of 8 positions, dim 4, fp32
    for errors, steps, nbytes, exchanges, exchanged in run_local(_ring_steps, 4, model, x, traced, plan, ref,
                                                                timeout=120):
        assert not errors, errors
        assert (steps, nbytes) == (2 * 3 + 2 * 3 + 2 * 4, (2 * 3 + 2 * 3 + 2 * 4) * block)
        # Causal: the zig-zag layout's all-to-alls, each one local block (query, key, value, the
        # output; backward their gradients).
        assert (exchanges, exchanged) == (8, 8 * block)


def _ring_kernel_on_gloo(rank, world, shape, sample, strategy, ref):
    """One rank: its local pieces of the sample through the ring kernel on the gloo process
    groups (``runtime.nodes.kernel_context``), forward and backward against the reference's."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.runtime.nodes import kernel_context
    from autopar.runtime.process_mesh import ProcessMesh
    from autopar.strategies.registry import OpInfo, get_kernel

    pmesh = ProcessMesh(init_device_mesh("cpu", shape))
    out_full, grads_full, grad_out = ref
    info = OpInfo.from_values(SDPA, sample.args, sample.kwargs, out_full)

    def local(t, spec):
        return t[spec.local_slices(t.shape, shape, pmesh.coordinate)].detach()

    args = [local(t, s).requires_grad_(t.is_floating_point()) for t, s in zip(sample.args, strategy.input_specs)]
    ctx = kernel_context(info, strategy, pmesh)
    out = get_kernel("ring_attention").fn(ctx, *args, **sample.kwargs)
    out.backward(local(grad_out, strategy.output_specs[0]))
    errors = [] if torch.allclose(out, local(out_full, strategy.output_specs[0]), atol=1e-10) else ["output"]
    for i, (a, spec) in enumerate(zip(args, strategy.input_specs)):
        if a.requires_grad and not torch.allclose(a.grad, local(grads_full[i], spec), atol=1e-10):
            errors.append(f"grad of input {i}")
    return errors


@pytest.mark.full_sweep
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "padding-causal-mask"])
def test_a_zigzag_ring_over_two_axes_on_gloo(causal):
    """The zig-zag routing over two mesh axes (one all-to-all per axis, ``strategies/_zigzag.route``)
    on real process groups: the sequence split over both axes of (2, 2), forward and backward equal
    to the unsplit op's (the per-rule check runs the same on simulated ranks)."""
    from autopar.layout.mesh import MeshSpec
    from autopar.strategies import enumerate_strategies
    from autopar.strategies.registry import OpInfo, Sample

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 16, 4, dtype=torch.float64, generator=gen) for h in (4, 2, 2))
    if causal:
        sample = Sample((q, k, v), {"is_causal": True, "enable_gqa": True})
    else:
        mask = torch.ones(16, 16, dtype=torch.bool).tril().expand(2, 1, 16, 16).clone()
        mask[1, :, :, :3] = False  # left padding in batch row 1
        sample = Sample((q, k, v, mask), {"enable_gqa": True})
    leaves = [t.clone().requires_grad_(t.is_floating_point()) for t in sample.args]
    out = SDPA(*leaves, **sample.kwargs)
    grad_out = torch.randn(out.shape, dtype=out.dtype, generator=gen)
    out.backward(grad_out)
    ref = (out.detach(), [t.grad for t in leaves], grad_out)
    info = OpInfo.from_values(SDPA, sample.args, sample.kwargs, ref[0])
    rings = [s for s in enumerate_strategies(info, MeshSpec.preset("cpu", (2, 2)), flops=(0.0, 0.0))
             if s.kernel == "ring_attention" and s.input_specs[0].shard_axes(2) == (0, 1)
             and s.input_specs[1].shard_axes(2) == (0, 1)]
    assert rings
    for errors in run_local(_ring_kernel_on_gloo, 4, (2, 2), sample, rings[0], ref, timeout=120):
        assert not errors, errors
