"""Offline pipeline planning: autopar's joint stage + sharding plan against Megatron-style 3-D
configurations priced in the same cost model (issue 15).

For each model shape and device count N (``MeshSpec.cluster``, 8 H100 per node) and each pipeline
size PP:

- autopar: mesh ``(PP, N / (8 PP), 8)``; ``search_stages`` on the micro-batch graph (one trace per
  micro-batch count), free cuts (within ``--window`` blocks of even) and free per-op sharding on
  the ``(N / (8 PP), 8)`` stage sub-mesh, schedules 1F1B and interleaved 1F1B;
- Megatron-style: for TP in {1, 2, 4, 8}: mesh ``(PP, N / (PP TP), TP)``, the ``dp x tp`` baseline
  family on the stage sub-mesh (batch split on the DP axis, Megatron column/row splits on TP),
  EVEN layer cuts, the same schedules and micro-batch counts, the same stage ILP and step formula
  (``autopar.planner.pipeline_schedule``).

Not priced here (both sides alike): activation recompute (the pipelined planner does not plan it
yet, so the ``{no, full}`` recompute axis of the issue is only ``no``), ZeRO. Configurations that
do not fit the memory budget are reported as such.

Run: ``python benchmarks/pipeline_plan.py --quick`` (8-layer versions of both shapes on 64 devices,
minutes on 2 cores) or with ``--layers`` / ``--devices`` / ``--models`` to go bigger; the full
shapes (80 / 96 layers) on 256 and 1024 devices take far longer than the 60 s planning target on
this machine (see the printed planning times). One JSON line per configuration with ``--jsonl``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, replace

import torch

from autopar.layout.mesh import MeshSpec
from autopar.planner.assemble import restricted_problem
from autopar.planner.baselines import make_restriction
from autopar.planner.builder import build_problem
from autopar.planner.options import PlanOptions
from autopar.planner.pipeline_search import StageCosts, micro_inputs, schedule_cuts, search_stages
from autopar.plans import stage_mesh_of
from autopar.solver.driver import solve as solve_ilp
from autopar.strategies import needs_decomposition
from autopar.tracer import profile, trace

SCHEDULES = ("1f1b", "interleaved-1f1b")


def build_model(name: str, *, layers: int | None):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        if name == "llama-70b":
            cfg = LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                              num_hidden_layers=layers or 80, num_attention_heads=64, num_key_value_heads=8,
                              max_position_embeddings=4096, use_cache=False, tie_word_embeddings=False)
            return LlamaForCausalLM(cfg), 4096
        if name == "gpt3-175b":
            cfg = GPT2Config(vocab_size=50257, n_positions=2048, n_embd=12288, n_layer=layers or 96, n_head=96,
                             use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                             attn_implementation="sdpa")
            return GPT2LMHeadModel(cfg), 2048
    raise ValueError(f"unknown model {name!r}")


class _Restricted:
    """A built problem with a baseline family's restricted Problem (decisions unchanged)."""

    def __init__(self, built, problem):
        self.problem, self._built = problem, built

    def decision(self, name):
        return self._built.decision(name)


@dataclass
class Row:
    model: str
    devices: int
    pp: int
    tp: int | None
    microbatches: int
    who: str
    step_s: float | None
    schedule: str
    plan_s: float
    note: str = ""


def run(args) -> list[Row]:
    rows: list[Row] = []
    options = PlanOptions(precision="bf16", preset="h100-80gb", time_limit=args.time_limit)
    for name in args.models:
        model, seq = build_model(name, layers=args.layers)
        ids = torch.zeros((args.batch, args.seq or seq), dtype=torch.long, device="meta")
        inputs = {"input_ids": ids, "labels": ids}
        for n in args.devices:
            nodes = n // 8
            for pp in [p for p in args.pp if p <= nodes and n % (8 * p) == 0]:
                for m in args.microbatches:
                    if args.batch % m:
                        continue
                    t0 = time.perf_counter()
                    traced = trace(model, micro_inputs(inputs, m), decompose_if=needs_decomposition,
                                   precision="bf16")
                    prof = profile(traced)
                    trace_s = time.perf_counter() - t0
                    rows += _one(name, n, pp, m, traced, prof, options, args, trace_s)
                    for r in rows[-5:]:  # the configurations just priced
                        print(json.dumps(r.__dict__), flush=True)
    return rows


def _one(name, n, pp, m, traced, prof, options, args, trace_s) -> list[Row]:
    out = []
    # autopar: stage sub-mesh (N / (8 PP), 8), free cuts and free sharding.
    if n // pp >= 8:
        mesh = MeshSpec.cluster(nodes=n // 8, devices_per_node=8, shape=(pp, n // (8 * pp), 8))
        t0 = time.perf_counter()
        found = search_stages(traced, prof, mesh=mesh, options=options, num_stages=pp, num_microbatches=m,
                              schedules=SCHEDULES, window=args.window)
        plan_s = time.perf_counter() - t0 + trace_s
        best = found.plan
        out.append(Row(name, n, pp, None, m, "autopar", None if best is None else best.estimate.step_s,
                       "" if best is None else best.pipeline.schedule, plan_s,
                       "; ".join(str(c) for c in found.candidates)))
    for tp in (1, 2, 4, 8):
        if n % (pp * tp):
            continue
        mesh = MeshSpec.cluster(nodes=n // 8, devices_per_node=8, shape=(pp, n // (pp * tp), tp))
        t0 = time.perf_counter()
        out.append(_megatron(name, n, pp, tp, m, traced, prof, mesh, options, time.perf_counter() - t0 + trace_s))
    return out


def _megatron(name, n, pp, tp, m, traced, prof, mesh, options, t_start) -> Row:
    t0 = time.perf_counter()
    sub = stage_mesh_of(mesh)
    built = build_problem(traced, prof, sub, budget_bytes=None, options=replace(options, zero_stage=0))
    roles = ("dp", "tp")[-sub.ndim:] if sub.ndim <= 2 else ("dp",) + ("tp",) * (sub.ndim - 1)
    try:
        problem = restricted_problem(built, traced, make_restriction(roles, mesh_shape=sub.shape), "dp x tp")
    except ValueError as exc:
        return Row(name, n, pp, tp, m, "megatron", None, "", time.perf_counter() - t0 + t_start, str(exc)[:120])
    costs = StageCosts(traced, _Restricted(built, problem), mesh=mesh,
                       solve=lambda p: solve_ilp(p, solver=options.solver, time_limit=options.time_limit))
    best, notes = None, []
    for schedule in SCHEDULES:
        parts = pp * (2 if schedule == "interleaved-1f1b" else 1)
        even = {k: (k * costs.num_blocks // parts, (k + 1) * costs.num_blocks // parts) for k in range(parts)}
        found = schedule_cuts(costs, schedule=schedule, num_stages=pp, num_microbatches=m,
                              budget=options.budget_bytes(mesh), allowed=lambda k, a, b, even=even: even[k] == (a, b))
        notes.append(str(found[0]))
        if found[1] is not None and (best is None or found[1].objective < best[0]):
            best = (found[1].objective, schedule)
    return Row(name, n, pp, tp, m, "megatron", None if best is None else best[0], "" if best is None else best[1],
               time.perf_counter() - t0 + t_start, "; ".join(notes))


def summarise(rows: list[Row]) -> None:
    print("\nmodel        devices  autopar ms (pp, M, schedule)      megatron ms (pp, tp, M, schedule)  speed-up  "
          "autopar plan s")
    speedups = []
    for key in sorted({(r.model, r.devices) for r in rows}):
        mine = [r for r in rows if (r.model, r.devices) == key and r.who == "autopar" and r.step_s is not None]
        theirs = [r for r in rows if (r.model, r.devices) == key and r.who == "megatron" and r.step_s is not None]
        plan_s = max((r.plan_s for r in rows if (r.model, r.devices) == key and r.who == "autopar"), default=0.0)
        a = min(mine, key=lambda r: r.step_s, default=None)
        b = min(theirs, key=lambda r: r.step_s, default=None)
        ratio = b.step_s / a.step_s if a and b else None
        if ratio:
            speedups.append(ratio)
        fa = f"{a.step_s * 1e3:10.1f} ({a.pp}, {a.microbatches}, {a.schedule})" if a else "no feasible plan"
        fb = f"{b.step_s * 1e3:10.1f} ({b.pp}, {b.tp}, {b.microbatches}, {b.schedule})" if b else "no feasible config"
        print(f"{key[0]:<12} {key[1]:>7}  {fa:<32}  {fb:<34}  {('%.2fx' % ratio) if ratio else '-':>8}  "
              f"{plan_s:8.1f}")
    if speedups:
        print(f"speed-up over the best Megatron-style configuration: mean {statistics.mean(speedups):.2f}x, "
              f"max {max(speedups):.2f}x over {len(speedups)} (model, devices) cases")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["llama-70b", "gpt3-175b"])
    p.add_argument("--devices", nargs="+", type=int, default=[64, 256, 1024])
    p.add_argument("--pp", nargs="+", type=int, default=[2, 4, 8, 16])
    p.add_argument("--microbatches", nargs="+", type=int, default=[8, 32])
    p.add_argument("--batch", type=int, default=64, help="global batch (sequences)")
    p.add_argument("--seq", type=int, help="sequence length (default: the model's)")
    p.add_argument("--layers", type=int, help="override the depth (default: the full model)")
    p.add_argument("--window", type=int, default=2, help="stage lengths within this many blocks of even")
    p.add_argument("--time-limit", type=float, default=30.0)
    p.add_argument("--quick", action="store_true", help="8-layer shapes, 64 devices, PP 2/4, M 8")
    p.add_argument("--jsonl", help="write one JSON line per configuration")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.devices, args.pp, args.microbatches = args.layers or 8, [64], [2, 4], [8]
        args.seq = args.seq or 1024
        args.batch = 32
    rows = run(args)
    summarise(rows)
    if args.jsonl:
        with open(args.jsonl, "w") as f:
            for r in rows:
                f.write(json.dumps(r.__dict__) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
