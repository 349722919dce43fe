"""What communication/compute overlap changes in the plan: a Qwen2-style decoder planned offline at
``comm_overlap`` 0, the preset's value and 1, with the hand-written baselines in the same model.

Usage:
  python benchmarks/overlap.py                       # cpu preset, mesh (2,)
  python benchmarks/overlap.py --preset h100-80gb --mesh 8 --jsonl out.jsonl

Per overlap: the planner's estimate (step, communication, the part hidden under compute), its
parameter layouts by count, and the data-parallel, ZeRO-3 and Megatron estimates. Planning only:
no process group, nothing runs.
"""

from __future__ import annotations

import argparse
import json
import warnings
from collections import Counter
from dataclasses import replace


def decoder(*, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int, batch: int,
            seq: int):
    """The decoder on meta (no weights) and its meta inputs (token ids and labels)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=seq, use_cache=False, attn_implementation="sdpa",
                         tie_word_embeddings=False)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    model.loss_type = "ForCausalLM"  # HF's default for this class, named to skip a warning
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids.clone()}


def row(plan, overlap: float) -> dict:
    est = plan.estimate
    return {"comm_overlap": overlap, "step_ms": est.step_s * 1e3, "communication_ms": est.communication_s * 1e3,
            "async_ms": est.async_s * 1e3, "hidden_ms": est.hidden_s * 1e3,
            "layouts": dict(Counter(n.strategy for n in plan.nodes if n.kind == "parameter").most_common()),
            "baselines": {b.name: (b.estimate.step_s * 1e3 if b.feasible else None) for b in plan.baselines}}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="cpu")
    p.add_argument("--mesh", default="2")
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--jsonl", default=None)
    args = p.parse_args(argv)
    import autopar

    model, inputs = decoder(layers=4, hidden=256, intermediate=args.intermediate, heads=8, kv_heads=2, vocab=1000,
                            batch=8, seq=128)
    base = autopar.MeshSpec.preset(args.preset, args.mesh)
    rows = []
    for overlap in dict.fromkeys((0.0, base.comm_overlap, 1.0)):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="no sharding rule")
            plan = autopar.plan(model, inputs, mesh=replace(base, comm_overlap=overlap), baselines=True, cache=False)
        rows.append(row(plan, overlap))
        r = rows[-1]
        print(f"comm_overlap {overlap:.2f}: {r['step_ms']:.1f} ms/step (communication {r['communication_ms']:.1f} ms, "
              f"{r['hidden_ms']:.1f} of {r['async_ms']:.1f} ms asynchronous hidden); layouts {r['layouts']}; "
              + ", ".join(f"{k} {v:.1f} ms" if v is not None else f"{k} infeasible" for k, v in r["baselines"].items()))
    if args.jsonl:
        with open(args.jsonl, "a") as f:
            for r in rows:
                f.write(json.dumps({"preset": args.preset, "mesh": args.mesh, **r}) + "\n")
    return rows


if __name__ == "__main__":
    main()
