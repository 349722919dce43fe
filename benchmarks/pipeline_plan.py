"""Offline pipeline planning: autopar's joint stage + sharding plan against Megatron-style 3-D
configurations priced in the same cost model (issue 15).

Cases: each model shape (Llama-70B, 80 layers; GPT-3-175B, 96 layers, its LM head tied: see
below) on each device count N (``MeshSpec.cluster``, 8 H100 80 GB per node; 64, 256, 1024).

Global batch: weak scaling, as Megatron-LM reports its runs -- ``--batch-per-device`` (1)
sequence per device, so ``B = N`` sequences of the model's length (Llama 4096, GPT-3 2048
tokens): 1024 devices train on 1024 x 4096 = 4M tokens, Llama 2 70B's published batch. Both sides
plan the same ``B`` per case.

Configurations (Megatron's space): pipeline size PP (``--pp``, with PP <= N / 8: the pipeline
axis spans nodes), tensor size TP in {1, 2, 4, 8}, DP = N / (PP TP); Megatron's micro-batch size
``b`` sequences per data-parallel replica (``--micro-sizes``, 1 and 2, with b <= TP so that
M >= PP), hence M = B / (b DP) micro-batches; schedules 1F1B and interleaved 1F1B (2 virtual
stages); per stage no or full recompute. For every (PP, TP, M), on mesh ``(PP, DP, TP)`` (inner
axes on the intra-node links), ONE stage Problem is built on the ``(DP, TP)`` sub-mesh for the
micro-batch graph (B / M sequences) and priced by both sides with the same stage slice, in-flight
memory, schedule formula and budget check (``autopar.planner.pipeline.search``):

- Megatron-style: the ``dp x tp`` baseline family (batch split on DP, Megatron column/row splits on
  TP), EVEN layer cuts, each stage with or without full recompute of its blocks;
- autopar: free per-op sharding on the same sub-mesh, free cuts (within ``--window`` blocks of
  even: the even cut is always inside), the same per-stage recompute choice, the same schedules.

So autopar searches a superset of each Megatron configuration, up to ILP gaps and the per-stage
memo heuristics both sides share. Not priced (both sides alike): ZeRO. The micro-batch graph is
traced once per (model, micro-batch size B / M) and shared by every configuration using it.

autopar's search of a case is branch and bound over its configurations
(``autopar.planner.pipeline.bounds``): every configuration's step floor first (one small ILP per
block class), then the configurations lowest floor first, each bounded by the best step so far;
one whose floor cannot beat it is not searched (its row says "pruned" with its floor, and the
per-configuration check then asks that Megatron's step there is at least that floor: Megatron's
plan lies in autopar's space). ``--exhaustive`` searches every configuration.

GPT-3's LM head is tied to its embedding, as GPT-2's and Megatron's GPT (``--untie`` unties
it). Pipelines trace a tied weight with one bf16 cast per reading module
(``PIPELINE_CASTS``): the first and last stages each hold the fp32 weight and cast it, as
Megatron keeps a copy on the last stage; nothing of it crosses the cuts. (Before, one cast on
the first stage sent its 1.2 GB bf16 copy through every stage per micro-batch, so this
benchmark compared an untied head.)

Reported per case: the best plan of each side, the speed-up (Megatron's best / autopar's best),
autopar's planning seconds for the case (its traces, builds, floors and searches, each also
printed on a "#" line), and at the end
the mean, min and max speed-up. ``--quick``: 8-layer shapes on 64 devices, sequence 1024, PP 2/4,
b = 1. One JSON line per configuration with ``--jsonl``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from autopar.layout.mesh import MeshSpec
from autopar.planner.assemble import restricted_problem
from autopar.planner.baselines import make_restriction
from autopar.planner.options import PlanOptions
from autopar.planner.pipeline.bounds import config_floors, in_bound_order
from autopar.planner.pipeline.costs import StageCosts, stage_costs
from autopar.planner.pipeline.schedule import SCHEDULE_VIRTUAL_STAGES, schedule_cuts
from autopar.planner.pipeline.search import search_stages
from autopar.planner.pipeline.geometry import PIPELINE_CASTS
from autopar.plans import stage_mesh_of
from autopar.solver.driver import solve as solve_ilp
from autopar.strategies import needs_decomposition
from autopar.tracer import profile, trace



def build_model(name: str, *, layers: int | None, tie: bool = True):
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
                             attn_implementation="sdpa", tie_word_embeddings=tie)
            return GPT2LMHeadModel(cfg), 2048
    raise ValueError(f"unknown model {name!r}")


class _Restricted:
    """A built problem with a baseline family's restricted Problem (decisions unchanged)."""

    def __init__(self, built, problem):
        self.problem, self._built = problem, built
        self.segment_inputs, self.mesh = built.segment_inputs, built.mesh

    def decision(self, name):
        return self._built.decision(name)

    def choice_of(self, name, option):  # option names are the full problem's
        return self._built.choice_of(name, option)


@dataclass
class Row:
    model: str
    devices: int
    pp: int
    tp: int
    microbatches: int
    who: str
    step_s: float | None
    schedule: str
    plan_s: float  # this configuration's search (build and trace excluded)
    recompute: str = ""
    note: str = ""
    floor: float | None = None  # autopar's step floor for the configuration (pipeline.bounds)
    bound: float | None = None  # the best step of the case when this configuration was searched


def _solver(options):
    return lambda p: solve_ilp(p, solver=options.solver, time_limit=options.time_limit)


def configs(n: int, pps, tps=(1, 2, 4, 8), *, batch: int, micro_sizes=(1, 2)):
    """(PP, TP, M) on N devices: PP x TP divides N, the pipeline axis outside the nodes (PP <= N /
    8), M = batch / (b DP) for each micro-batch size b (sequences per replica) with M >= PP."""
    out = []
    for pp in pps:
        for tp in tps:
            if n % (pp * tp) or pp > n // 8:
                continue
            dp = n // (pp * tp)
            for b in micro_sizes:
                if batch % (b * dp) == 0 and batch // (b * dp) >= pp:
                    out.append((pp, tp, batch // (b * dp)))
    return out


def run(args) -> tuple[list[Row], dict]:
    rows: list[Row] = []
    plan_s: dict[tuple[str, int], float] = {}
    options = PlanOptions(precision="bf16", preset="h100-80gb", time_limit=args.time_limit)
    for name in args.models:
        model, seq = build_model(name, layers=args.layers, tie=not args.untie)
        seq = args.seq or seq
        for n in args.devices:
            batch = args.batch_per_device * n
            todo = configs(n, args.pp, args.tp, batch=batch, micro_sizes=args.micro_sizes)
            t0 = time.perf_counter()
            staged = _autopar_case(name, n, todo, model, seq, batch, options, args)
            plan_s[name, n] = time.perf_counter() - t0
            print(f"# {name} on {n} devices: autopar planned {len(todo)} configurations in {plan_s[name, n]:.1f} s "
                  f"({sum(1 for r, _ in staged.values() if r.note.startswith('pruned'))} pruned by their floors)",
                  flush=True)
            for (pp, tp, m), (mine, costs) in staged.items():
                theirs = _megatron(name, n, pp, tp, m, costs.traced, costs.built, costs.mesh, options, args)
                for r in (mine, theirs):
                    rows.append(r)
                    print(json.dumps({**r.__dict__, "batch": batch}), flush=True)
    return rows, plan_s


def _autopar_case(name, n, todo, model, seq, batch, options, args) -> dict:
    """autopar's search of one case: every configuration's micro-batch graph traced (once per
    micro-batch size), its stage Problem built and its step floor computed
    (``autopar.planner.pipeline.bounds``), then the configurations searched lowest floor first,
    each given the best step so far (``in_bound_order``): one whose floor cannot beat it is
    not searched (``--exhaustive``: every one is). Returns (PP, TP, M) -> (its row, its StageCosts)."""
    staged: dict[tuple[int, int, int], StageCosts] = {}
    floors: dict[tuple[int, int, int], float] = {}
    spent = dict.fromkeys(("trace", "build", "floors", "search"), 0.0)
    clock = time.perf_counter()

    def lap(phase):
        nonlocal clock
        now = time.perf_counter()
        spent[phase] += now - clock
        clock = now

    for size in sorted({batch // m for _, _, m in todo}):  # one trace per micro-batch size
        ids = torch.zeros((size, seq), dtype=torch.long, device="meta")
        traced = trace(model, {"input_ids": ids, "labels": ids}, decompose_if=needs_decomposition, precision="bf16",
                       param_casts=PIPELINE_CASTS)
        prof = profile(traced)
        lap("trace")
        for pp, tp, m in (c for c in todo if batch // c[2] == size):
            mesh = MeshSpec.cluster(nodes=n // 8, devices_per_node=8, shape=(pp, n // (pp * tp), tp))
            staged[pp, tp, m] = costs = stage_costs(traced, prof, mesh=mesh, options=options, solve=_solver(options))
            lap("build")
            floors[pp, tp, m] = min(config_floors(costs, schedules=args.schedules, num_stages=pp, num_microbatches=m,
                                                  window=args.window).values())
            lap("floors")
    out: dict[tuple[int, int, int], tuple[Row, StageCosts]] = {}

    def search(cfg, incumbent):
        pp, tp, m = cfg
        t0 = time.perf_counter()
        costs = staged[cfg]
        given = None if args.exhaustive or incumbent == math.inf else incumbent  # what the row records too
        found = search_stages(costs.traced, None, mesh=costs.mesh, options=options, num_stages=pp, num_microbatches=m,
                              schedules=args.schedules, window=args.window, costs=costs, bound=given)
        best = found.plan
        rec = "" if best is None else ",".join("R" if st["recompute"] else "-"
                                               for st in best.solver["pipeline"]["stages"])
        out[cfg] = (Row(name, n, pp, tp, m, "autopar", None if best is None else best.estimate.step_s,
                        "" if best is None else best.pipeline.schedule, time.perf_counter() - t0, rec,
                        "; ".join(str(c) for c in found.candidates), floor=floors[cfg], bound=given), costs)
        return out[cfg][0]

    def skipped(cfg, floor, incumbent):
        out[cfg] = (Row(name, n, *cfg, "autopar", None, "", 0.0, "",
                        f"pruned: floor {floor * 1e3:.1f} ms/step >= best {incumbent * 1e3:.1f}", floor=floor),
                    staged[cfg])

    in_bound_order({c: (-math.inf if args.exhaustive else f) for c, f in floors.items()}, search,
                   step_of=lambda r: r.step_s, skipped=skipped)
    lap("search")
    print(f"# {name} on {n} devices: " + ", ".join(f"{k} {v:.1f} s" for k, v in spent.items()), flush=True)
    return dict(sorted(out.items(), key=lambda kv: floors[kv[0]]))


def _megatron(name, n, pp, tp, m, traced, built, mesh, options, args) -> Row:
    t0 = time.perf_counter()
    sub = stage_mesh_of(mesh)
    roles = ("dp", "tp")[-sub.ndim:] if sub.ndim <= 2 else ("dp",) + ("tp",) * (sub.ndim - 1)
    try:
        problem = restricted_problem(built, traced, make_restriction(roles, mesh_shape=sub.shape), "dp x tp")
    except ValueError as exc:
        return Row(name, n, pp, tp, m, "megatron", None, "", time.perf_counter() - t0, "", str(exc)[:120])
    costs = StageCosts(traced, _Restricted(built, problem), mesh=mesh, solve=_solver(options))
    best, notes = None, []
    for schedule in args.schedules:
        parts = pp * SCHEDULE_VIRTUAL_STAGES[schedule]
        even = {k: (k * costs.num_blocks // parts, (k + 1) * costs.num_blocks // parts) for k in range(parts)}
        found = schedule_cuts(costs, schedule=schedule, num_stages=pp, num_microbatches=m,
                              budget=options.budget_bytes(mesh), allowed=lambda k, a, b, even=even: even[k] == (a, b))
        notes.append(str(found[0]))
        if found[1] is not None and (best is None or found[1].objective < best[0]):
            best = (found[1].objective, schedule, ",".join("R" if r else "-" for r in found[5]))
    return Row(name, n, pp, tp, m, "megatron", None if best is None else best[0], "" if best is None else best[1],
               time.perf_counter() - t0, "" if best is None else best[2], "; ".join(notes))


def summarise(rows: list[Row], plan_s: dict) -> list[float]:
    print("\nmodel       devices  autopar ms (pp, tp, M, sched, recompute)  megatron ms (pp, tp, M, sched, recompute)  "
          "speed-up  autopar plan s")
    speedups = []

    def text(r):
        return (f"{r.step_s * 1e3:9.1f} ({r.pp}, {r.tp}, {r.microbatches}, {r.schedule}, {r.recompute or '-'})"
                if r else "no feasible plan")

    for key in sorted({(r.model, r.devices) for r in rows}):
        mine = [r for r in rows if (r.model, r.devices) == key and r.who == "autopar" and r.step_s is not None]
        theirs = [r for r in rows if (r.model, r.devices) == key and r.who == "megatron" and r.step_s is not None]
        a = min(mine, key=lambda r: r.step_s, default=None)
        b = min(theirs, key=lambda r: r.step_s, default=None)
        ratio = b.step_s / a.step_s if a and b else None
        if ratio:
            speedups.append(ratio)
        print(f"{key[0]:<11} {key[1]:>7}  {text(a):<41}  {text(b):<42}  {('%.3fx' % ratio) if ratio else '-':>8}  "
              f"{plan_s.get(key, 0.0):8.1f}")
    if speedups:
        print(f"speed-up over the best Megatron-style configuration: mean {statistics.mean(speedups):.3f}x, "
              f"min {min(speedups):.3f}x, max {max(speedups):.3f}x over {len(speedups)} (model, devices) cases")
    for line in slower(rows):
        print("autopar SLOWER than Megatron-style on one configuration (a superset should not be):", line)
    return speedups


def slower(rows: list[Row]) -> list[str]:
    """Configurations (model, devices, PP, TP, M) where autopar's plan is slower than the
    Megatron-style one, or has none where Megatron's fits: its space contains Megatron's."""
    out = []
    for key in sorted({(r.model, r.devices, r.pp, r.tp, r.microbatches) for r in rows}):
        mine = [r for r in rows if (r.model, r.devices, r.pp, r.tp, r.microbatches) == key and r.who == "autopar"]
        theirs = [r for r in rows if (r.model, r.devices, r.pp, r.tp, r.microbatches) == key and r.who == "megatron"]
        for a, b in zip(mine, theirs):
            if b.step_s is None:
                continue
            # Megatron's plan lies in autopar's space: at least autopar's floor there, and at least
            # the bound a search found no plan under ("no cut beats"): else autopar missed it.
            if a.note.startswith("pruned"):
                if a.floor is not None and b.step_s < a.floor * (1 - 1e-3):
                    out.append(f"{key}: megatron {b.step_s} below autopar's floor {a.floor} (an invalid floor)")
            elif a.step_s is None and a.bound is not None:
                if b.step_s < a.bound * (1 - 1e-3):
                    out.append(f"{key}: megatron {b.step_s} beats the bound {a.bound} autopar found no plan under")
            elif a.step_s is None or a.step_s > b.step_s * (1 + 1e-3):
                out.append(f"{key}: autopar {a.step_s}, megatron {b.step_s}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["llama-70b", "gpt3-175b"])
    p.add_argument("--devices", nargs="+", type=int, default=[64, 256, 1024])
    p.add_argument("--pp", nargs="+", type=int, default=[2, 4, 8, 16])
    p.add_argument("--tp", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--micro-sizes", nargs="+", type=int, default=[1, 2],
                   help="Megatron micro-batch sizes b (sequences per data-parallel replica): M = B / (b DP)")
    p.add_argument("--schedules", nargs="+", default=["1f1b", "interleaved-1f1b"])
    p.add_argument("--batch-per-device", type=int, default=1,
                   help="global batch B = this x the device count (sequences; weak scaling)")
    p.add_argument("--untie", action="store_true", help="GPT-3 with its LM head untied from the embedding")
    p.add_argument("--seq", type=int, help="sequence length (default: the model's)")
    p.add_argument("--layers", type=int, help="override the depth (default: the full model)")
    p.add_argument("--window", type=int, default=2, help="stage lengths within this many blocks of even")
    p.add_argument("--time-limit", type=float, default=30.0)
    p.add_argument("--quick", action="store_true", help="8-layer shapes, 64 devices, PP 2/4, b 1, sequence 1024")
    p.add_argument("--jsonl", help="write one JSON line per configuration")
    p.add_argument("--exhaustive", action="store_true",
                   help="search every configuration (default: skip those whose step floor cannot beat the best found)")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.devices, args.pp, args.micro_sizes = args.layers or 8, [64], [2, 4], [1]
        args.seq = args.seq or 1024
    args.schedules = tuple(args.schedules)
    rows, plan_s = run(args)
    summarise(rows, plan_s)
    print(f"global batch: {args.batch_per_device} sequence(s) per device; micro-batch sizes {args.micro_sizes}")
    if args.jsonl:
        with open(args.jsonl, "w") as f:
            for r in rows:
                f.write(json.dumps({**r.__dict__, "batch": args.batch_per_device * r.devices}) + "\n")
    return 1 if slower(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
