"""Offline: MoE models on 8 nodes x 8 H100s, planned on meta: auto against every fixed EP x TP x DP.

    python benchmarks/moe.py [--shape mixtral,deepseek] [--batch B --seq 4096] [--layers N]
                             [--tp 1,2,4,8] [--ep 1,2,4,8] [--out results.jsonl]

Shapes (transformers' models at published widths, bf16 compute with fp32 masters):

- ``mixtral``: Mixtral-8x22B (hidden 6144, 56 layers, 48 heads, 8 KV heads, 8 experts of
  intermediate 16384, top-2, vocab 32768);
- ``deepseek``: DeepSeek-V3-like (hidden 7168, multi-head latent attention, 256 routed experts of
  intermediate 2048 plus one shared, top-8 with group-limited routing -- 8 groups, the best 4
  kept -- vocab 129280), 8 of its 61 layers (the first dense) at batch 16 x 4096: the full
  depth's model state (~16 bytes a parameter over 671B parameters) does not fit 64 x 80 GB;
  ``--layers 16 --batch 64`` plans too (its joint recompute ILP from its block classes,
  ``autopar.solver.dive.blockwise``). The trace cuts the repeated blocks to four, the dense
  first layer included (``autopar.tracer.unroll``, ``autopar.tracer.depth``).

Each is traced once and planned on the 8 x 8 cluster (``MeshSpec.cluster``, axis 0 across nodes):

- ``auto``: the planner's own plan on the (8, 8) mesh (every layout, expert parallelism
  included, recompute);
- every fixed configuration ``ep E x tp T x dp D`` (``autopar.planner.baselines.expert_layouts``:
  Megatron TP over T devices of a node, the experts split E ways with tokens sent by all-to-all
  over E of the D data-parallel ranks, mesh outer-to-inner (D/E, E, T)), each the same planner's
  problem on its mesh restricted to that configuration (recompute still planned; ZeRO as
  ``--zero-stage``), in the same cost model. The experts op has no split of one expert's
  matrices (its gate and up halves are concatenated), so a TP axis either splits the experts by
  expert with the tokens whole (only while ``ep * tp`` divides the expert count) or runs them
  whole on every TP rank.

Printed per row: planning seconds, the estimate (step, compute, communication, peak) and how the
first experts op is laid out; then the best fixed configuration and whether auto is at least as
fast and chose expert parallelism.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

SHAPES = ("mixtral", "deepseek")
EXPERTS_OP = "autopar.moe_experts.default"


def model_and_inputs(*, batch: int, seq: int, layers: int, shape: str = "mixtral"):
    """The model of ``shape`` on meta and its inputs (module docstring)."""
    import transformers

    if shape == "mixtral":
        config = transformers.MixtralConfig(
            vocab_size=32768, hidden_size=6144, intermediate_size=16384, num_hidden_layers=layers,
            num_attention_heads=48, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
            max_position_embeddings=seq)
        cls = transformers.MixtralForCausalLM
    elif shape == "deepseek":
        config = transformers.DeepseekV3Config(
            vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
            num_hidden_layers=layers, first_k_dense_replace=1, n_routed_experts=256, num_experts_per_tok=8,
            n_group=8, topk_group=4, n_shared_experts=1, num_attention_heads=128, num_key_value_heads=128,
            q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
            max_position_embeddings=seq)
        cls = transformers.DeepseekV3ForCausalLM
    else:
        raise ValueError(f"unknown shape {shape!r}; known: {SHAPES}")
    with torch.device("meta"):
        model = cls(config)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}


def num_experts(model) -> int:
    config = model.config
    return getattr(config, "num_local_experts", None) or config.n_routed_experts


def _row(label: str, plan, seconds: float, **extra) -> dict:
    experts = next(n for n in plan.nodes if n.op == EXPERTS_OP)
    hidden, gate_up = experts.input_specs[0], experts.input_specs[3]
    return {"config": label, "plan_s": seconds, "step_s": plan.estimate.step_s,
            "peak_bytes": plan.estimate.peak_bytes, "mesh": list(plan.mesh.shape),
            "experts": experts.strategy, "expert_degree": _degree(hidden, gate_up, plan.mesh.shape), **extra}


def _degree(hidden: str, gate_up: str, shape) -> int:
    """Expert-parallel degree of an experts op's layout: the sizes of the axes that split both
    its experts and its tokens (the all-to-all's axes)."""
    from autopar.layout.placement import TensorSpec

    tokens, experts = TensorSpec.parse(hidden).shard_axes(0), TensorSpec.parse(gate_up).shard_axes(0)
    return math.prod(shape[a] for a in experts if a in tokens)


def run_shape(shape: str, *, batch: int, seq: int, layers: int, tps, eps, nodes: int = 8, per_node: int = 8,
              preset: str = "h100-80gb", zero_stage: int | str = 0, say=print) -> list[dict]:
    """Trace ``shape`` once; plan auto and every fixed configuration of ``tps`` x ``eps`` (all with
    ``zero_stage``); the rows."""
    from autopar.layout.mesh import MeshSpec
    from autopar.planner.baselines import expert_layouts, make_restriction
    from autopar.planner.options import PlanOptions
    from autopar.planner.orchestrate import plan_traced, trace_for_planning
    from autopar.solver.driver import SolveTimeout
    from autopar.tracer import profile

    model, inputs = model_and_inputs(batch=batch, seq=seq, layers=layers, shape=shape)
    options = PlanOptions(preset=preset, precision="bf16", zero_stage=zero_stage)
    start = time.perf_counter()
    traced = trace_for_planning(model, inputs, precision=options.precision)
    prof = profile(traced)
    trace_s = time.perf_counter() - start
    say(f"{shape}: {layers} layers, batch {batch} x seq {seq}, {nodes} x {per_node} {preset}, bf16, ZeRO stage "
        f"{zero_stage}; traced and "
        f"profiled in {trace_s:.1f} s; load {os.getloadavg()[0]:.1f}")
    rows = []

    def one(label: str, mesh: MeshSpec, restrict=None, **extra) -> None:
        t0 = time.perf_counter()
        try:
            plan = plan_traced(traced, prof, mesh=mesh, options=options, restrict=restrict).plan
        except (ValueError, SolveTimeout) as exc:  # nothing fits the budget, or no plan found in time
            say(f"  {label:<22} no plan: {str(exc).splitlines()[0][:240]}")
            rows.append({"config": label, "plan_s": time.perf_counter() - t0, "step_s": None, **extra})
            return
        row = _row(label, plan, time.perf_counter() - t0, trace_s=trace_s, **extra)
        rows.append(row)
        say(f"  {label:<22} {'x'.join(map(str, mesh.shape)):>8}  planned in {row['plan_s']:6.1f} s (+{trace_s:.1f} s "
            f"trace): {plan.estimate}; experts {row['experts']} (EP {row['expert_degree']}); "
            f"load {os.getloadavg()[0]:.1f}")

    one("auto", MeshSpec.cluster(nodes=nodes, devices_per_node=per_node, device=preset))
    for layout in expert_layouts(nodes, per_node, experts=num_experts(model)):
        if layout.tp not in tps or layout.ep not in eps:
            continue
        mesh = MeshSpec.cluster(nodes=nodes, devices_per_node=per_node, device=preset, shape=layout.shape)
        restriction = make_restriction(layout.roles, mesh_shape=mesh.shape, expert_parallel=True)
        one(str(layout), mesh, (str(layout), restriction), ep=layout.ep, tp=layout.tp, dp=layout.dp)
    auto, fixed = rows[0], [r for r in rows[1:] if r["step_s"] is not None]
    if auto["step_s"] is not None and fixed:
        best = min(fixed, key=lambda r: r["step_s"])
        say(f"  best fixed: {best['config']} {best['step_s'] * 1e3:.3f} ms; auto {auto['step_s'] * 1e3:.3f} ms "
            f"({'<=' if auto['step_s'] <= best['step_s'] else '>'} best fixed), expert parallelism "
            f"{'chosen' if auto['expert_degree'] > 1 else 'NOT chosen'} (degree {auto['expert_degree']})")
    return [{"shape": shape, **r} for r in rows]


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default=",".join(SHAPES), help=f"comma-separated, of {SHAPES}")
    p.add_argument("--batch", type=int, help="default: 64 (mixtral), 16 (deepseek)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--layers", type=int, help="default: 56 (mixtral), 8 (deepseek)")
    p.add_argument("--tp", default="1,2,4,8", help="tensor-parallel sizes of the fixed configurations")
    p.add_argument("--ep", default="1,2,4,8", help="expert-parallel sizes of the fixed configurations")
    p.add_argument("--zero-stage", default="0", help="ZeRO stage of every plan: 0, 1, 2 or auto (the solver's)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    zero = args.zero_stage if args.zero_stage == "auto" else int(args.zero_stage)
    tps, eps = {int(x) for x in args.tp.split(",")}, {int(x) for x in args.ep.split(",")}
    rows = []
    for shape in args.shape.split(","):
        layers = args.layers or {"mixtral": 56, "deepseek": 8}[shape]
        batch = args.batch or {"mixtral": 64, "deepseek": 16}[shape]
        rows += run_shape(shape, batch=batch, seq=args.seq, layers=layers, tps=tps, eps=eps, zero_stage=zero)
    if args.out:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps({"bench": "moe", **vars(args), **row}) + "\n")
    return rows


if __name__ == "__main__":
    main()
