"""Megatron tensor parallelism of a fused projection: GPT-2's ``c_attn`` (q|k|v in one Conv1D,
then ``split(hidden, dim=2)``) under ``HybridParallelPlugin(tp_size=2)``.

The weight and bias are stored ``S(1/3)`` on the tp axis (each of q, k, v split: rank r holds
``q_r | k_r | v_r``, Colossal-AI's ``n_fused=3``), the fused output stays so, the split turns it
into heads split, and attention runs on each rank's heads: nothing between ``c_attn`` and the
attention is gathered (read from the plan). On gloo: loss, every gradient and the parameters
after 5 AdamW steps equal one device's, on tp=2 (2 ranks, the default suite) and tp=2 x dp=2
(4 ranks, ``full_sweep``); the checkpoint (Hugging Face safetensors shards, gathered to the full
layout) loads into a plain model and back into a boosted one with its optimizer state (one
gathered file, then a ``torch.distributed.checkpoint`` directory, which holds the state in the
plain block layout DCP can describe: the step after loading equals the step after saving).
"""

from __future__ import annotations

import operator
import os

import pytest
import torch

from autopar.layout.mesh import MeshSpec
from autopar.planner.orchestrate import plan_family, trace_for_planning
from autopar.planner.options import PlanOptions
from autopar.runtime.launch import run_local
from autopar.strategies import input_nodes
from tests.booster.test_hybrid_plugin import BATCH, EPS, LR, SEQ, STEPS, _build, _loss, _single_device, lm_batches

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default


def _gathered_between_c_attn_and_attention(plan, traced) -> list[str]:
    """Every read on the way from each ``c_attn`` output to the attention whose layout differs
    from what its producer gives (a conversion: the all-gather Megatron avoids), and every
    attention input not split by heads on the tp axis (the mesh's last)."""
    specs = {n.name: n for n in plan.nodes}
    starts = [n for n in traced.compute_nodes()
              if n.target is aten.addmm.default and traced.module_path(n).endswith("attn.c_attn")]
    assert starts, "no c_attn in the trace"
    problems = []
    for start in starts:
        last = specs[start.name].output_specs[0]
        if not last.endswith("S(1/3)"):
            problems.append(f"{start.name} gives {last}, not S(1/3) on the tp axis")
        frontier = [(start, last)]
        while frontier:
            node, produced = frontier.pop()
            for user in node.users:
                if user.target is operator.getitem:  # the split's element, in its own layout
                    frontier.append((user, specs[node.name].output_specs[user.args[1]]))
                    continue
                read = specs[user.name].input_specs[input_nodes(user).index(node)]
                if read != produced:
                    problems.append(f"{user.name} reads {read}, {node.name} gives {produced}")
                if user.target is SDPA:
                    if not read.endswith("S1"):
                        problems.append(f"{user.name} reads {read}: heads not split on the tp axis")
                else:
                    frontier.append((user, specs[user.name].output_specs[0]))
    return problems


@pytest.mark.parametrize("family, shape", [("megatron", (2,)), ("dp x megatron", (2, 2))])
def test_plan_keeps_c_attn_split_by_heads(family, shape):
    model, batches = _build("gpt2")
    plan = plan_family(model, batches[0], family, mesh=MeshSpec.preset("cpu", shape),
                       options=PlanOptions(checkpoint="none", precision="fp32"))
    traced = trace_for_planning(model, batches[0], precision="fp32")
    assert not _gathered_between_c_attn_and_attention(plan, traced)
    placements = plan.placements()
    assert placements["transformer.h.0.attn.c_attn.weight"][-1] == "_StridedShard(1, split_factor=3)"
    assert placements["transformer.h.0.attn.c_attn.bias"][-1] == "_StridedShard(0, split_factor=3)"


def _train_and_checkpoint(rank, world, model, batches, options, path):
    from transformers import GPT2LMHeadModel

    from autopar.booster import Booster, HybridParallelPlugin

    def boosted(seed):
        torch.manual_seed(seed)
        fresh = GPT2LMHeadModel(model.config) if seed else model
        booster = Booster(plugin=HybridParallelPlugin(precision="fp32", **options))
        opt = torch.optim.AdamW(fresh.parameters(), lr=LR, eps=EPS)
        pm, opt, *_ = booster.boost(fresh, opt, meta_inputs=batches[0])
        return booster, pm, opt

    def step(booster, pm, opt, batch):
        loss = _loss(pm(**batch))
        booster.backward(loss, opt)
        grads = pm.full_gradients()
        opt.step()
        opt.zero_grad()
        return loss.item(), grads

    booster, pm, opt = boosted(0)
    losses, grads = [], None
    for batch in batches[:-1]:
        loss, step_grads = step(booster, pm, opt, batch)
        losses.append(loss)
        grads = grads or step_grads
    trained = pm.full_state_dict()
    booster.save_model(pm, os.path.join(path, "model"), True, True, "", 0.05, True)  # HF safetensors shards
    optim_path = os.path.join(path, "optim.pt")
    booster.save_optimizer(opt, optim_path, False)  # one gathered file
    # a DCP directory too: an S(1/3) piece is three blocks, saved in the plain layout
    booster.save_optimizer(opt, os.path.join(path, "optim"), True)
    continued, _ = step(booster, pm, opt, batches[-1])

    booster2, pm2, opt2 = boosted(1)  # other weights, then the checkpoint's
    booster2.load_model(pm2, os.path.join(path, "model"))
    booster2.load_optimizer(opt2, optim_path)
    booster2.load_optimizer(opt2, os.path.join(path, "optim"))  # the directory's state is what resumes
    loaded = pm2.full_state_dict()
    resumed, _ = step(booster2, pm2, opt2, batches[-1])
    plain = GPT2LMHeadModel(model.config)
    booster.load_model(plain, os.path.join(path, "model"))
    return {"losses": losses, "grads": grads, "trained": trained, "loaded": loaded, "plain": plain.state_dict(),
            "continued": continued, "resumed": resumed, "final": pm.full_state_dict(),
            "final2": pm2.full_state_dict(), "plan": pm.plan}


def _check(world: int, options: dict, tmp_path) -> None:
    model, _ = _build("gpt2")
    batches = lm_batches(model.config.vocab_size, batch=BATCH, seq=SEQ, steps=STEPS + 1)  # + 1: after the checkpoint
    ref_grads: dict = {}
    ref_losses, ref_params = _single_device(model, batches[:-1], grads=ref_grads)
    results = run_local(_train_and_checkpoint, world, model, batches, options, str(tmp_path), timeout=400)
    traced = trace_for_planning(model, batches[0], precision="fp32")
    for rank, res in enumerate(results):
        assert not _gathered_between_c_attn_and_attention(res["plan"], traced)
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref_losses), rtol=1e-4, atol=1e-6)
        for key, value in ref_grads.items():
            torch.testing.assert_close(res["grads"][key], value, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, k=key: f"rank {rank} grad {k}: {m}")
        for key, value in ref_params.items():
            torch.testing.assert_close(res["trained"][key], value, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, k=key: f"rank {rank} {k}: {m}")
            assert torch.equal(res["loaded"][key], res["trained"][key]), key
            assert torch.equal(res["plain"][key], res["trained"][key]), key  # the full layout, HF names
        assert res["resumed"] == pytest.approx(res["continued"], rel=1e-6)
        for key, value in res["final"].items():
            torch.testing.assert_close(res["final2"][key], value, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_tp2_trains_like_one_device_and_round_trips_checkpoints(tmp_path):
    _check(2, dict(tp_size=2, pp_size=1), tmp_path)


@pytest.mark.slow
@pytest.mark.full_sweep
@pytest.mark.timeout(600)
def test_tp2_x_dp2_trains_like_one_device_and_round_trips_checkpoints(tmp_path):
    _check(4, dict(tp_size=2, pp_size=1), tmp_path)


def _phi3():
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    config = Phi3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "sdpa"
    return Phi3ForCausalLM(config)


@pytest.mark.slow
@pytest.mark.full_sweep
@pytest.mark.timeout(420)
def test_phi3_qkv_and_gate_up_split_per_part_train_like_one_device():
    """Phi-3 cuts its fused ``qkv_proj`` by three slices and ``gate_up_proj`` by ``chunk(2)``:
    both stored split per part (``S(0/3)``, ``S(0/2)``), attention head-parallel, and 5 AdamW
    steps on tp=2 equal one device's."""
    from tests.booster.test_hybrid_plugin import _train

    model = _phi3()
    batches = lm_batches(128, batch=BATCH, seq=SEQ, steps=STEPS)
    ref_grads: dict = {}
    ref_losses, ref_params = _single_device(model, batches, grads=ref_grads)
    results = run_local(_train, 2, model, batches, dict(tp_size=2, pp_size=1, precision="fp32"), timeout=400)
    for rank, (losses, state, plan, grads) in enumerate(results):
        specs = {n.module: n.output_specs[0] for n in plan.nodes if n.kind == "parameter"}
        assert specs["model.layers.0.self_attn.qkv_proj.weight"] == "S(0/3)", specs
        assert specs["model.layers.0.mlp.gate_up_proj.weight"] == "S(0/2)", specs
        attention = [n.input_specs[:3] for n in plan.nodes if n.op == str(SDPA)]
        assert attention and all(s == "S1" for specs3 in attention for s in specs3), attention
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-6)
        for key, value in ref_grads.items():
            torch.testing.assert_close(grads[key], value, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, k=key: f"rank {rank} grad {k}: {m}")
        for key, value in ref_params.items():
            torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, k=key: f"rank {rank} {k}: {m}")
