"""Offline: a Mixtral-8x22B-shaped model on 8 nodes x 8 H100s, planned on meta, expert parallelism.

    python benchmarks/moe.py [--batch 64 --seq 4096 --layers 56] [--ep 1,2,8] [--out results.jsonl]

The model is transformers' Mixtral at 8x22B's published sizes (hidden 6144, 56 layers, 48 heads,
8 KV heads, 8 experts of intermediate 16384, top-2, vocab 32768), bf16 compute with fp32 masters,
on a (8, 8) mesh of the ``h100-80gb`` preset (axis 0 across nodes, axis 1 inside one). Planned:

- ``auto``: the planner's own choice (every layout, expert parallelism included, and recompute);
- ``ep=N``: the best plan whose experts ops split their experts ``N`` ways with tokens sent by
  all-to-all (``ep_size=N``; ``N=1``: experts never split) -- the other decisions still the
  planner's, so each row is at least as fast as any fixed EP x TP x DP configuration of that
  expert degree in the same cost model.

Printed per row: planning seconds, the estimate (step, compute, communication, peak) and how the
first experts op is laid out.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def model_and_inputs(*, batch: int, seq: int, layers: int):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=32768, hidden_size=6144, intermediate_size=16384, num_hidden_layers=layers,
                           num_attention_heads=48, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                           max_position_embeddings=seq)
    with torch.device("meta"):
        model = MixtralForCausalLM(config)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}


def main(argv=None) -> list[dict]:
    import autopar

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--layers", type=int, default=56)
    p.add_argument("--ep", default="1,8", help="pinned expert-parallel degrees to compare with auto")
    p.add_argument("--out")
    args = p.parse_args(argv)
    model, inputs = model_and_inputs(batch=args.batch, seq=args.seq, layers=args.layers)
    print(f"Mixtral-8x22B shape, {args.layers} layers, batch {args.batch} x seq {args.seq}, (8, 8) h100-80gb, bf16; "
          f"load {os.getloadavg()[0]:.1f}")
    rows = []
    for ep in (None, *(int(x) for x in args.ep.split(","))):
        label = "auto" if ep is None else f"ep={ep}"
        start = time.perf_counter()
        try:
            plan = autopar.plan(model, inputs, mesh=(8, 8), preset="h100-80gb", precision="bf16", ep_size=ep,
                                cache=False)
        except ValueError as exc:
            print(f"{label:<7} no plan: {exc}")
            continue
        seconds = time.perf_counter() - start
        experts = next(n for n in plan.nodes if n.op == "autopar.moe_experts.default")
        print(f"{label:<7} planned in {seconds:6.1f} s: {plan.estimate}; experts op {experts.strategy}")
        rows.append({"config": label, "plan_s": seconds, "step_s": plan.estimate.step_s,
                     "peak_bytes": plan.estimate.peak_bytes, "experts": experts.strategy})
    if args.out:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps({"bench": "moe", **vars(args), **row}) + "\n")
    return rows


if __name__ == "__main__":
    main()
