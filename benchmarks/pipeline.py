"""Pipelined step time: autopar's PipelineModule vs its plan's estimate vs a hand-written
``torch.distributed.pipelining`` split of the same model, same run (issue 15).

    python benchmarks/pipeline.py [--hidden 256 --layers 8 --heads 4 --vocab 1024 --seq 64
                                   --batch 16 --microbatches 8 --schedules gpipe,1f1b
                                   --world 4 --steps 5 --mesh-file mesh.json --out results.jsonl]

A GPT-2 (``_baselines.gpt2_config_model``: HF GPT-2, dropout 0, sdpa, tied ``wte``) on ``--world``
forked gloo processes, mesh ``(world,)``: ``pipeline=world`` stages, one device each. The default
size makes a step ~1 s on a 2-core machine with 4 ranks (about 60 ms of compute per stage and
micro-batch against ~5 ms of point-to-point), so compute dominates; ``--hidden 512 --seq 128
--vocab 2048`` is ~8x that.

1. The mesh is profiled on THIS machine first (``autopar.calibrate`` on
   ``world`` forked processes: per-axis alpha/beta from timed collectives, fp32 matmul FLOP/s
   and copy bandwidth measured while all ranks run at once, as they do in the pipeline's steady
   state), or read from ``--mesh-file`` (``autopar calibrate --local N --out``).
2. For each schedule the parent plans with that mesh (``autopar.api.plan_pipelined``,
   ``pipeline=world``, ``microbatches``, ``checkpoint="none"``): the plan's stage cut and its
   estimated step (``plan.estimate.step_s``: ``(M + S - 1) * slowest stage + gradient sync``).
3. Each rank builds, from the same weights, the same batch:

   - ``autopar``: the plan's ``PipelineModule`` (``autopar.runtime.pipeline.build_pipeline`` on the
     parent's micro-batch trace: what ``autoparallelize(..., pipeline=N)`` builds on each rank,
     without each rank tracing again); one step is ``pm.step(**batch)`` (forward + backward of every
     micro-batch under torch's schedule, gradient sums, the loss broadcast);
   - ``hand``: a hand-written split with the SAME block ranges as the plan: stage modules made of
     the HF model's own submodules (first: ``wte`` + ``wpe`` + its blocks; middle: blocks; last:
     blocks + ``ln_f`` + ``lm_head`` with its own copy of the tied weight), each a
     ``PipelineStage``, the same torch schedule and micro-batch count, the causal-LM loss as the
     schedule's ``loss_fn``, and the tied weight's gradient all-reduced between the first and
     last rank after the step (as autopar does).

   After ``--warmup`` steps each, ``--steps`` rounds time both back to back (order alternating,
   a barrier before each step; gradients dropped outside the timed region); a step's time is
   the slowest rank's. Both losses are checked against the single-device loss of the full batch.

Printed: the mesh profile, each plan's cut, and per schedule: median ms of autopar and of the
hand-written split, the estimate, autopar / hand, estimate / autopar, and the three losses.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _baselines import gpt2_config_model  # noqa: E402

LOSS_RTOL = 1e-4  # autopar, the hand-written split and the single-device loss agree to this


# --------------------------------------------------------------------------- hand-written
class _FirstStage(nn.Module):
    def __init__(self, model, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.wte, self.wpe = model.transformer.wte, model.transformer.wpe
        self.blocks = nn.ModuleList(blocks)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        h = self.wte(input_ids) + self.wpe(pos)
        for block in self.blocks:
            h = block(h)
        return h


class _MiddleStage(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = block(h)
        return h


class _LastStage(_MiddleStage):
    def __init__(self, model, blocks: list[nn.Module]) -> None:
        super().__init__(blocks)
        self.ln_f = model.transformer.ln_f
        self.lm_head = model.lm_head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(super().forward(h)))


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HF's ForCausalLM loss without ignored labels: next-token cross-entropy, mean over tokens."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())


class HandPipeline:
    """This rank's stage of the hand-written split (module docstring)."""

    def __init__(self, model: nn.Module, *, layers: tuple[int, int], num_stages: int, schedule: str,
                 num_microbatches: int, micro: dict[str, torch.Tensor]) -> None:
        from torch.distributed.pipelining import PipelineStage

        from autopar.runtime.pipeline import SCHEDULES

        rank = dist.get_rank()
        model = copy.deepcopy(model)
        blocks = list(model.transformer.h[layers[0]:layers[1]])
        if num_stages == 1:
            raise ValueError("the hand-written split needs at least 2 stages")
        hidden = model.config.n_embd
        mb, seq = micro["input_ids"].shape
        # requires_grad: the activations crossing the cut carry gradients back (static metadata)
        h = torch.zeros(mb, seq, hidden, requires_grad=True)
        if rank == 0:
            module, example = _FirstStage(model, blocks), (micro["input_ids"],)
        elif rank == num_stages - 1:
            module, example = _LastStage(model, blocks), (h,)
            # the tied weight: this rank's own copy (the first rank holds the embedding's)
            module.lm_head.weight = nn.Parameter(model.transformer.wte.weight.detach().clone())
        else:
            module, example = _MiddleStage(blocks), (h,)
        out = (torch.zeros(mb, seq, model.config.vocab_size, requires_grad=True) if rank == num_stages - 1 else h,)
        self.module, self.rank, self.num_stages = module, rank, num_stages
        stage = PipelineStage(module, rank, num_stages, torch.device("cpu"), input_args=example, output_args=out)
        # default scale_grads: gradients / M, with the per-micro-batch mean loss = the full-batch mean
        self.schedule = SCHEDULES[schedule](stage, n_microbatches=num_microbatches, loss_fn=causal_lm_loss)
        self.tied_group = dist.new_group([0, num_stages - 1])  # every rank creates it (collective)
        self.tied = (module.wte.weight if rank == 0 else module.lm_head.weight if rank == num_stages - 1 else None)

    def parameters(self):
        return self.module.parameters()

    def step(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        if self.rank == 0:
            self.schedule.step(inputs["input_ids"])
        elif self.rank == self.num_stages - 1:
            self.schedule.step(target=inputs["labels"], losses=losses)
        else:
            self.schedule.step()
        if self.tied is not None:
            dist.all_reduce(self.tied.grad, group=self.tied_group)
        loss = torch.stack(losses).mean() if losses else torch.zeros(())
        dist.broadcast(loss, src=self.num_stages - 1)
        return loss


# ----------------------------------------------------------------------------- the run
def _bench(rank: int, world: int, args, model, inputs, plans: dict, traced: dict) -> dict:
    from autopar.runtime.pipeline import build_pipeline
    from autopar.tracer.microbatch import micro_batch

    out = {}
    micro = micro_batch(inputs, args.microbatches)  # the hand pipeline's example: the rule autopar traces by
    for schedule, plan in plans.items():
        pm = build_pipeline(copy.deepcopy(model), traced[schedule], plan, device="cpu")
        st = plan.pipeline.stages[rank]
        hand = HandPipeline(model, layers=st.layers, num_stages=world, schedule=schedule,
                            num_microbatches=args.microbatches, micro=micro)
        impls = {"autopar": (pm.parameters, lambda: pm.step(**inputs)),
                 "hand": (hand.parameters, lambda: hand.step(inputs))}

        def step(name):
            for p in impls[name][0]():
                p.grad = None
            dist.barrier()
            t = time.perf_counter()
            loss = impls[name][1]()
            return time.perf_counter() - t, float(loss.detach())

        first = {name: step(name)[1] for name in impls}
        for _ in range(args.warmup):
            for name in impls:
                step(name)
        times = {name: [] for name in impls}
        order = list(impls)
        for r in range(args.steps):
            for name in (order if r % 2 == 0 else order[::-1]):
                times[name].append(step(name)[0])
        out[schedule] = {"times": times, "first_loss": first}
    return out


def measured_mesh(args):
    from autopar.layout.mesh import MeshSpec
    from autopar.runtime.calibrate import calibrate

    if args.mesh_file:
        mesh = MeshSpec.load(args.mesh_file)
        if tuple(mesh.shape) != (args.world,):
            raise ValueError(f"--mesh-file holds mesh {mesh.shape}, the run needs ({args.world},)")
        return mesh
    sizes = [int(s) for s in args.profile_sizes.split(",")]
    return calibrate((args.world,), local=args.world, sizes=sizes, repeats=args.profile_repeats)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--schedules", default="gpipe,1f1b", help="comma-separated: gpipe, 1f1b")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--mesh-file", help="a saved MeshSpec of this machine (skips the profile)")
    p.add_argument("--profile-sizes", default=f"{64 * 1024},{256 * 1024},{1024 * 1024},{4 * 1024 * 1024}",
                   help="full-tensor bytes the mesh profile times")
    p.add_argument("--profile-repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", help="append one JSON line with the figures")
    args = p.parse_args(argv)
    schedules = tuple(s for s in args.schedules.split(",") if s)
    bad = [s for s in schedules if s not in ("gpipe", "1f1b")]
    if bad or not schedules:
        raise ValueError(f"--schedules takes gpipe and/or 1f1b (one stage per rank), got {args.schedules!r}")
    if args.batch % args.microbatches:
        raise ValueError(f"--microbatches {args.microbatches} does not divide --batch {args.batch}")

    from autopar.api import plan_pipelined
    from autopar.planner.options import PlanOptions
    from autopar.runtime.launch import run_local

    load = os.getloadavg()[0]
    model, inputs = gpt2_config_model(hidden=args.hidden, layers=args.layers, heads=args.heads, vocab=args.vocab,
                                      seq=args.seq, batch=args.batch)
    with torch.no_grad():
        ref_loss = float(model(**inputs).loss)
    t0 = time.perf_counter()
    mesh = measured_mesh(args)
    profile_s = time.perf_counter() - t0
    plans, traced, plan_s = {}, {}, {}
    for schedule in schedules:
        t0 = time.perf_counter()
        found = plan_pipelined(model, inputs, mesh=mesh,
                               options=PlanOptions(pipeline=args.world, microbatches=args.microbatches,
                                                   schedule=schedule, checkpoint="none"))
        plan_s[schedule] = time.perf_counter() - t0
        if found.plan.pipeline is None or found.plan.pipeline.schedule != schedule:
            raise AssertionError(f"plan_pipelined returned no {schedule} pipeline")
        plans[schedule], traced[schedule] = found.plan, found.traced
    results = run_local(_bench, args.world, args, model, inputs, plans, traced, timeout=args.timeout)

    print(f"GPT-2 hidden {args.hidden}, {args.layers} layers, {args.heads} heads, vocab {args.vocab}; batch "
          f"{args.batch} x seq {args.seq}, {args.microbatches} micro-batches; {args.world} gloo processes, "
          f"pipeline {args.world} ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load {load:.2f} at start, {os.getloadavg()[0]:.2f} at end)")
    print(f"mesh ({'file ' + args.mesh_file if args.mesh_file else f'profiled in {profile_s:.1f} s'}): "
          f"alpha {mesh.alpha[0] * 1e6:.1f} us, beta {mesh.beta[0] * 1e9:.3f} ns/B, "
          f"{mesh.peak_flops / 1e9:.1f} GFLOP/s fp32 matmul, {mesh.mem_bandwidth / 1e9:.2f} GB/s copy")
    rows = {}
    for schedule, plan in plans.items():
        cut = [st.layers for st in plan.pipeline.stages]
        per_stage = [f"{s['time_s'] * 1e3:.1f}" for s in plan.solver["pipeline"]["stages"]]
        print(f"{schedule}: cut {cut}, planned in {plan_s[schedule]:.1f} s; per-stage micro-batch ms "
              f"{per_stage}; estimate {plan.estimate}")
        # a step ends when its slowest rank ends
        times = {name: [max(r[schedule]["times"][name][i] for r in results) for i in range(args.steps)]
                 for name in ("autopar", "hand")}
        med = {name: statistics.median(v) for name, v in times.items()}
        first = results[0][schedule]["first_loss"]
        losses_agree = all(abs(first[k] - ref_loss) <= LOSS_RTOL * abs(ref_loss) for k in first) and all(
            r[schedule]["first_loss"] == first for r in results)
        rows[schedule] = {"autopar_s": med["autopar"], "hand_s": med["hand"], "estimate_s": plan.estimate.step_s,
                          "autopar_over_hand": med["autopar"] / med["hand"],
                          "estimate_over_autopar": plan.estimate.step_s / med["autopar"],
                          "loss": {"autopar": first["autopar"], "hand": first["hand"], "single_device": ref_loss},
                          "losses_agree": losses_agree, "cut": cut, "times": times}
    print(f"{'schedule':<9} {'autopar ms':>11} {'hand ms':>9} {'estimate ms':>12} {'autopar/hand':>13} "
          f"{'estimate/autopar':>17}  losses (autopar, hand, single device)")
    for schedule, row in rows.items():
        loss = row["loss"]
        print(f"{schedule:<9} {row['autopar_s'] * 1e3:11.1f} {row['hand_s'] * 1e3:9.1f} "
              f"{row['estimate_s'] * 1e3:12.1f} "
              f"{row['autopar_over_hand']:13.3f} {row['estimate_over_autopar']:17.3f}  {loss['autopar']:.6f}, "
              f"{loss['hand']:.6f}, {loss['single_device']:.6f} ({'agree' if row['losses_agree'] else 'DIFFER'})")
    record = {"bench": "pipeline", "args": vars(args), "mesh": {"alpha": mesh.alpha[0], "beta": mesh.beta[0],
              "peak_flops": mesh.peak_flops, "mem_bandwidth": mesh.mem_bandwidth},
              "rows": rows, "load_start": load, "load_end": os.getloadavg()[0], "torch": torch.__version__}
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")
    return record


if __name__ == "__main__":
    main()
