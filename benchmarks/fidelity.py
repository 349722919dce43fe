"""Fidelity of the cost model: estimate vs measured step time and memory over many plans, same run.

    python benchmarks/fidelity.py [--models gpt2,llama,cnn] [--meshes 2,2x2] [--profile PATH]
                                  [--steps 8] [--warmup 2] [--out results.jsonl] [--parts]

For each (model, mesh) the parent process plans at least 8 distinct plans with ONE mesh profile
(``--profile``: a machine profile JSON from ``autopar calibrate``, or, without it, the mesh is
calibrated here first -- ``autopar.calibrate`` on as many forked processes as it has devices):

- ``auto``: ``autopar.plan`` at an ample budget and at 60% and 40% of the data-parallel plan's
  peak (the budgets where data parallelism no longer fits);
- the fixed configurations the plugins run, each a restricted plan of the same planner
  (``planner.orchestrate.plan_family``): data parallel (autopar's runtime), ZeRO-1, ZeRO-2,
  ZeRO-3, Megatron tensor parallel, and DP x TP on 2-D meshes;
- a two-stage pipeline over mesh axis 0 (``pipeline=2``, ``checkpoint="none"``);
- torch's ``DistributedDataParallel`` and FSDP2 (``fully_shard``) on the model itself, priced by
  the data-parallel and ZeRO-3 families' estimates (the layouts they run);
- a model with training-mode batch norms (the CNN): torch's engines normalise each rank's share
  of the batch, so they are priced by those families planned with ``batch_norm_stats="per_rank"``,
  and ``auto-per-rank`` and ``data-parallel-per-rank`` (autopar computing what DDP computes) are
  added. Choices are judged like for like: a global-statistics plan against the plans with
  global statistics, a per-rank one against every plan.

Identical plans (same strategy per node, ZeRO stages, recompute, stages) are kept once. Every
rank then builds every plan from the same weights and times them in interleaved rounds (rotating
order, a barrier before each step; one step = zero_grad, forward, backward, AdamW step); a step
is the slowest rank's time, a plan's figure the median over rounds of its share of the round
(``round_normalized``: outside load that changes between rounds cancels). Memory per rank is
measured as the local bytes of parameters, gradients and optimizer state after a step (each
storage once, ZeRO's gradient pieces included) plus the peak of the bytes saved for backward
(``saved_tensors_hooks``, each storage counted once, parameters and views of them excluded,
released when autograd frees them); on CUDA the allocator's peak is printed beside it.

Printed per (model, mesh): estimate vs measured per plan, Spearman's rank correlation, the
median |estimate / measured - 1|, how far autopar's choice (at each budget) is from the fastest
measured plan that fits that budget (by its measured bytes), and memory estimate vs measured;
the targets are issue 30's (rho >= 0.9, median error <= 15%, choice within 3%, memory within 10%).
``--parts``: each flat autopar plan's estimate and step read apart alike (``parts``): per op
class, collectives, optimizer step, and the rest no part accounts for.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import (PeakAllocated, SavedBytes, build_model, plan_signature, round_normalized,  # noqa: E402
                      sharded_state_budget, slowest_per_round, spearman, state_bytes)

from autopar.runtime.links import Stopwatch, default_device, rank_device, sync_device  # noqa: E402

RHO_TARGET, ERROR_TARGET, CHOICE_TARGET, MEMORY_TARGET = 0.9, 0.15, 1.03, 0.10
BUDGET_FRACTIONS = (0.6, 0.4)  # of the data-parallel plan's peak: the two tight auto plans


# ------------------------------------------------------------------------------------ plans
@dataclass(frozen=True)
class Candidate:
    """One plan to time: ``plan`` is None for torch's engines (``engine`` ``ddp``/``fsdp2``)."""

    name: str
    estimate_s: float
    estimate_bytes: int
    plan: object = None
    engine: str = "autopar"
    budget: int | None = None  # the auto plans' budget (None: ample)
    options: object = None  # the PlanOptions it was planned with (``--parts`` re-prices it with them)
    per_rank_stats: bool = False  # its batch norms normalise each rank's share (torch's engines, *-per-rank)


def candidates(model, inputs, *, mesh, only: frozenset[str] | None = None,
               skip: frozenset[str] = frozenset()) -> list[Candidate]:
    """The distinct plans of one (model, mesh), planned in this process with ``mesh``'s costs;
    ``only``: the names of the plans to keep (None: all), ``skip``: names to leave out; the plans
    not kept are not planned."""
    import autopar
    from autopar.planner.baselines import BASELINES, baseline_roles
    from autopar.planner.options import PlanOptions
    from autopar.planner.orchestrate import plan_family

    out: list[Candidate] = []
    seen: set = set()

    def wanted(name: str) -> bool:
        return (only is None or name in only) and name not in skip

    def add(name: str, plan, *, budget=None, options=None, per_rank: bool = False) -> None:
        sig = (per_rank, plan_signature(plan))
        if sig in seen:
            print(f"  {name}: same plan as one already listed", flush=True)
            return
        seen.add(sig)
        out.append(Candidate(name, plan.estimate.step_s, plan.estimate.peak_bytes, plan, budget=budget,
                             options=options, per_rank_stats=per_rank))
        print(f"  {name}: {plan.estimate.step_s * 1e3:.1f} ms, {plan.estimate.peak_bytes / 2**20:.1f} MiB", flush=True)

    per_rank = _trains_batch_norm(model)
    families, family_options = {}, {}
    for family in ("data-parallel", *(f for f in BASELINES if f != "data-parallel")):
        if baseline_roles(family, len(mesh.shape)) is None:
            continue
        # data parallelism sets the auto budgets and ZeRO-3's, and prices torch DDP: always planned
        if family != "data-parallel" and not (wanted(family) or (family == "zero3" and wanted("torch-fsdp2"))):
            continue
        options = PlanOptions(zero_stage="auto" if family in ("zero1", "zero2") else 0)
        if family == "zero3" and "data-parallel" in families:
            options = PlanOptions(memory_budget=sharded_state_budget(families["data-parallel"].estimate,
                                                                     math.prod(mesh.shape)))
        family_options[family] = options
        try:
            families[family] = plan_family(model, inputs, family, mesh=mesh, options=options)
        except ValueError as exc:  # e.g. a family no layout of which fits
            print(f"  {family}: {exc}", flush=True)
    dp = families.get("data-parallel")
    for name, fraction in (("auto", None), *((f"auto@{f:.0%}", f) for f in BUDGET_FRACTIONS)):
        if not wanted(name):
            continue
        budget = None if fraction is None or dp is None else int(fraction * dp.estimate.peak_bytes)
        try:
            add(name, autopar.plan(model, inputs, mesh=mesh, memory_budget=budget, cache=False), budget=budget,
                options=PlanOptions(memory_budget=budget))
        except ValueError as exc:
            print(f"  {name}: no plan ({exc})", flush=True)
    for family, plan in families.items():
        if wanted(family):
            add(family, plan, options=family_options[family])
    try:
        if wanted("pipeline-2"):
            add("pipeline-2", autopar.plan(model, inputs, mesh=mesh, pipeline=2, checkpoint="none", cache=False))
    except (ValueError, NotImplementedError) as exc:
        print(f"  pipeline-2: {exc}", flush=True)
    engines = families
    if per_rank:
        engines = _per_rank_plans(model, inputs, mesh=mesh, families=families, family_options=family_options,
                                  wanted=wanted, add=add)
    for engine, family in (("ddp", "data-parallel"), ("fsdp2", "zero3")):
        if family in engines and wanted(f"torch-{engine}"):
            est = engines[family].estimate
            out.append(Candidate(f"torch-{engine}", est.step_s, est.peak_bytes, engine=engine,
                                 per_rank_stats=per_rank))
    return out


def _trains_batch_norm(model) -> bool:
    from autopar.booster.torch_plugins import per_rank_batch_norms

    return bool(per_rank_batch_norms(model))


def _per_rank_plans(model, inputs, *, mesh, families: dict, family_options: dict, wanted, add) -> dict:
    """A model with training batch norms: torch's DDP and FSDP2 normalise each rank's share of the
    batch, which autopar plans as ``batch_norm_stats="per_rank"``. Adds ``auto-per-rank`` and
    ``data-parallel-per-rank`` (the plans computing what DDP computes) and returns the families
    that price torch's engines: the per-rank data-parallel and ZeRO-3 plans, the layouts DDP and
    FSDP2 run with the statistics they keep (the global-statistics families would price batch
    norm collectives they never issue)."""
    import autopar
    from autopar.planner.orchestrate import plan_family

    engines = {}
    for family in ("data-parallel", "zero3"):
        if family not in families:
            continue
        options = replace(family_options[family], batch_norm_stats="per_rank")
        if family == "zero3" and "data-parallel" in engines:
            # Its budget from the plan it shards: the global-statistics data-parallel plan computes
            # the whole batch on every rank, so its peak left ZeRO-3 room to keep every weight
            # gathered (CNN (2,): priced 60.7 ms, torch FSDP2 measured 115.6).
            options = replace(options, memory_budget=sharded_state_budget(engines["data-parallel"].estimate,
                                                                          math.prod(mesh.shape)))
        try:
            engines[family] = plan_family(model, inputs, family, mesh=mesh, options=options)
        except ValueError as exc:
            print(f"  {family}-per-rank: {exc}", flush=True)
            continue
        if family == "data-parallel" and wanted("data-parallel-per-rank"):
            add("data-parallel-per-rank", engines[family], options=options, per_rank=True)
    if wanted("auto-per-rank"):
        from autopar.planner.options import PlanOptions

        try:
            add("auto-per-rank", autopar.plan(model, inputs, mesh=mesh, batch_norm_stats="per_rank", cache=False),
                options=PlanOptions(batch_norm_stats="per_rank"), per_rank=True)
        except ValueError as exc:
            print(f"  auto-per-rank: no plan ({exc})", flush=True)
    return engines


# ---------------------------------------------------------------------------------- running
def _fsdp2(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = copy.deepcopy(model).to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList):
            for block in module:
                fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _engine(cand: Candidate, model, inputs, rank: int, world: int, device: torch.device):
    """(module, step closure, optimizer) of one candidate on this rank, on ``device``."""
    from autopar import autoparallelize

    inputs = {k: v.to(device) for k, v in inputs.items()}
    per = next(iter(inputs.values())).shape[0] // world
    local = {k: v[rank * per:(rank + 1) * per] for k, v in inputs.items()}
    if cand.engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = None if device.type == "cpu" else [device.index]
        module = DistributedDataParallel(copy.deepcopy(model).to(device), device_ids=ids)
        return module, lambda: module(**local), torch.optim.AdamW(module.parameters(), lr=1e-4, foreach=True)
    if cand.engine == "fsdp2":
        module = _fsdp2(model, device)
        return module, lambda: module(**local), torch.optim.AdamW(module.parameters(), lr=1e-4, foreach=True)
    stats = {"batch_norm_stats": "per_rank"} if cand.per_rank_stats else {}
    module = autoparallelize(copy.deepcopy(model), inputs, plan=cand.plan, device=device, **stats)
    optimizer = module.optimizer(torch.optim.AdamW, lr=1e-4, foreach=True)
    if cand.plan.pipeline is not None:
        return module, lambda: module.step(**inputs), optimizer
    return module, lambda: module(**inputs), optimizer


def _parts_measured(step, name: str, device: torch.device, *, steps: int = 2) -> dict:
    """One plan's step read apart by torch's profiler over ``steps`` steps: compute per op class and
    the collectives (``runtime.refine.StepTimes``, as ``refine=True`` measures them) and the
    optimizer's step (its outermost ``Optimizer.step`` events), seconds per step."""
    from torch.profiler import ProfilerActivity, profile

    from autopar.runtime.refine import StepTimes

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    dist.barrier()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step(name)
    sync_device(device)
    events = prof.events()
    times = StepTimes.of_events(events, steps=steps, device_time=device.type == "cuda")

    def outermost(e) -> bool:
        parent = e.cpu_parent
        while parent is not None:
            if parent.name.startswith("Optimizer."):
                return False
            parent = parent.cpu_parent
        return True

    optimizer = sum(e.cpu_time_total for e in events if e.name.startswith("Optimizer.step") and outermost(e))
    return {"compute": times.by_class(), "comm": times.comm, "optimizer": optimizer * 1e-6 / steps}


def _worker(rank: int, world: int, cands: list[Candidate], model, inputs, steps: int, warmup: int,
            device_type: str = "cpu", parts: bool = False) -> dict:
    device = rank_device(device_type)
    built = {c.name: _engine(c, model, inputs, rank, world, device) for c in cands}

    def step(name: str, *, backward: bool = True):
        module, forward, optimizer = built[name]
        optimizer.zero_grad(set_to_none=True)
        loss = forward()
        if loss.requires_grad:  # a pipeline's step ran its backward already
            loss.backward()
        optimizer.step()

    memory = {}
    for name, (module, forward, optimizer) in built.items():
        for _ in range(warmup):
            step(name)
        saved = SavedBytes(module.parameters())
        optimizer.zero_grad(set_to_none=True)
        allocator = PeakAllocated(device)
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            loss = forward()
        if loss.requires_grad:
            loss.backward()
        optimizer.step()
        memory[name] = {"saved": saved.peak, "state": state_bytes(list(module.parameters()), optimizer),
                        "allocated": allocator.peak()}
    names = list(built)
    times = {n: [] for n in names}
    watch = Stopwatch(device)
    for r in range(steps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            dist.barrier()
            sync_device(device)  # the barrier's kernels (NCCL) are not the step's
            watch.start()
            step(name)
            times[name].append(watch.stop())
    # After the timed rounds (the profiler slows a step down): the parts of autopar's flat plans.
    measured_parts = {c.name: _parts_measured(step, c.name, device) for c in cands
                      if parts and c.engine == "autopar" and c.plan.pipeline is None}
    return {"times": times, "memory": memory, "device": str(device), "parts": measured_parts}


# ---------------------------------------------------------------------------------- figures
def summarize(model_name: str, mesh, cands: list[Candidate], results: list[dict]) -> dict:
    measured = round_normalized(slowest_per_round(results))
    mem = {c.name: max(r["memory"][c.name]["saved"] + r["memory"][c.name]["state"] for r in results) for c in cands}
    allocated = {c.name: max(r["memory"][c.name]["allocated"] or 0 for r in results) for c in cands}
    on_gpu = any(allocated.values())
    print(f"\n{model_name} on mesh {tuple(mesh.shape)} on {results[0]['device']}  (load {os.getloadavg()[0]:.2f})")
    print(f"{'plan':<14} {'est ms':>8} {'meas ms':>8} {'est/meas':>8} {'est MiB':>8} {'meas MiB':>8} {'mem':>6}"
          + (f" {'alloc MiB':>9}" if on_gpu else ""))
    for c in cands:
        print(f"{c.name:<14} {c.estimate_s * 1e3:8.1f} {measured[c.name] * 1e3:8.1f} "
              f"{c.estimate_s / measured[c.name]:8.2f} {c.estimate_bytes / 2**20:8.1f} {mem[c.name] / 2**20:8.1f} "
              f"{c.estimate_bytes / mem[c.name]:6.2f}" + (f" {allocated[c.name] / 2**20:9.1f}" if on_gpu else ""))
    rho = spearman([c.estimate_s for c in cands], [measured[c.name] for c in cands])
    errors = [abs(c.estimate_s / measured[c.name] - 1) for c in cands]
    med_err = statistics.median(errors)
    mem_err = statistics.median(abs(c.estimate_bytes / mem[c.name] - 1) for c in cands)
    choices = {}
    for c in cands:
        if not c.name.startswith("auto"):
            continue
        # What fits is what measured within the budget: an estimate that under-counts a plan's
        # bytes (a pipeline's, here) must not make it the plan to beat.
        # Like for like: a plan with the global batch's statistics is timed against the plans that
        # compute them; a per-rank one (what torch's engines compute) against every plan.
        alike = [d for d in cands if c.per_rank_stats or not d.per_rank_stats]
        fits = [d for d in alike if c.budget is None or mem[d.name] <= c.budget] or [c]
        fastest = min(fits, key=lambda d: measured[d.name])
        choices[c.name] = (measured[c.name] / measured[fastest.name], fastest.name,
                           c.budget is None or mem[c.name] <= c.budget)
    print(f"Spearman rho {rho:.2f} (target >= {RHO_TARGET}); median |est/meas - 1| {med_err:.1%} "
          f"(target <= {ERROR_TARGET:.0%}); median memory error {mem_err:.1%} (target <= {MEMORY_TARGET:.0%})")
    for name, (ratio, fastest, fits) in choices.items():
        print(f"  {name}: measured {ratio:.3f}x the fastest plan that fits ({fastest}); target <= {CHOICE_TARGET}"
              + ("" if fits else "; its own measured bytes exceed the budget"))
    return {"model": model_name, "mesh": list(mesh.shape), "plans": [c.name for c in cands],
            "estimate_s": {c.name: c.estimate_s for c in cands}, "measured_s": measured,
            "estimate_bytes": {c.name: c.estimate_bytes for c in cands}, "measured_bytes": mem,
            "allocated_bytes": allocated if on_gpu else None, "device": results[0]["device"],
            "spearman": rho, "median_error": med_err, "memory_error": mem_err,
            "choice_ratio": {k: v[0] for k, v in choices.items()}, "load": os.getloadavg()[0]}


def parts(model, inputs, cands: list[Candidate], results: list[dict], measured_s: dict[str, float]) -> dict:
    """Priced vs measured per part for the plans the ranks profiled (``--parts``): each op class
    (``planner.refit.priced_parts`` against ``runtime.refine.StepTimes``, the slowest rank's figure
    per part), the collectives (priced: the links' seconds less what the estimate hides under
    compute, a blocking collective's ``MachineProfile.blocking_s`` included; measured: the time
    collectives held the issuing thread, ``StepTimes``' rule), the optimizer step (priced: the
    estimate's compute less its ops'), and what no part accounts for: the measured step less its
    measured parts (Python, the autograd engine, hooks)."""
    from autopar.layout.machine import OP_CLASSES
    from autopar.planner.orchestrate import trace_for_planning
    from autopar.planner.refit import priced_parts
    from autopar.tracer import profile as profile_graph

    names = [c for c in cands if c.name in results[0]["parts"]]
    if not names:
        return {}
    traced = {}
    out = {}
    used = [k for k in OP_CLASSES if any(r["parts"][c.name]["compute"][k] for r in results for c in names)]
    print(f"\nparts, ms per step, priced / measured ({', '.join(used)}, comm, optimizer; rest: measured step "
          f"less its measured parts)")
    for c in names:
        key = (c.options.precision, c.options.batch_norm_chunks(math.prod(c.plan.mesh.shape)))
        if key not in traced:
            traced[key] = trace_for_planning(model, inputs, precision=key[0], batch_norm_chunks=key[1])
        graph = traced[key]
        priced = priced_parts(graph, profile_graph(graph), c.plan, options=c.options)
        meas = {k: max(r["parts"][c.name]["compute"][k] for r in results) for k in OP_CLASSES}
        comm = max(r["parts"][c.name]["comm"] for r in results)
        optimizer = max(r["parts"][c.name]["optimizer"] for r in results)
        priced_opt = c.plan.estimate.compute_s - sum(priced.compute.values())
        rest = measured_s[c.name] - sum(meas.values()) - optimizer - comm
        cells = [f"{k} {priced.compute.get(k, 0.0) * 1e3:.1f}/{meas[k] * 1e3:.1f}" for k in used]
        cells += [f"comm {priced.comm * 1e3:.1f}/{comm * 1e3:.1f}",
                  f"optimizer {priced_opt * 1e3:.1f}/{optimizer * 1e3:.1f}", f"rest {rest * 1e3:.1f}"]
        print(f"  {c.name:<14} " + "  ".join(cells))
        out[c.name] = {"priced": {**priced.compute, "comm": priced.comm, "optimizer": priced_opt},
                       "measured": {**meas, "comm": comm, "optimizer": optimizer, "rest": rest}}
    return out


def _mesh(shape: tuple[int, ...], profile: str | None, device_type: str):
    from autopar.layout.mesh import MeshSpec
    from autopar.runtime.calibrate import calibrate

    if profile:
        spec = MeshSpec.load(profile)
        if tuple(spec.shape) != shape:
            raise ValueError(f"--profile {profile} was measured on mesh {spec.shape}, not {shape}")
        return spec
    print(f"calibrating mesh {shape} on {math.prod(shape)} local processes ...", flush=True)
    return calibrate(shape, local=math.prod(shape), device=device_type)


def main(argv=None) -> list[dict]:
    from autopar.layout.mesh import parse_mesh_shape
    from autopar.runtime.launch import run_local

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt2,llama,cnn")
    p.add_argument("--meshes", default="2,2x2")
    p.add_argument("--profile", action="append", default=[],
                   help="a machine profile JSON per mesh (autopar calibrate --out); repeat for several meshes")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", help="append one JSON line per (model, mesh)")
    p.add_argument("--plans", help="only these plans, comma-separated (auto, auto@60%%, auto@40%%, data-parallel, "
                                   "zero1, zero2, zero3, megatron, ..., pipeline-2, torch-ddp, torch-fsdp2)")
    p.add_argument("--parts", action="store_true",
                   help="also profile two steps of each autopar plan after the timed rounds and print the "
                        "estimate and the step read apart per op class, collectives and optimizer")
    p.add_argument("--skip", default="", help="plans left out, e.g. pipeline-2 (torch < 2.13's pipelining asks "
                   "integer stage inputs for gradients)")
    args = p.parse_args(argv)
    device_type, backend = default_device()
    records = []
    for mesh_text in args.meshes.split(","):
        shape = parse_mesh_shape(mesh_text)
        profile = next((f for f in args.profile if _profile_shape(f) == shape), None)
        mesh = _mesh(shape, profile, device_type)
        for name in args.models.split(","):
            model, inputs = build_model(name, batch=args.batch)
            print(f"planning {name} on {shape} ...", flush=True)
            cands = candidates(model, inputs, mesh=mesh, only=frozenset(args.plans.split(",")) if args.plans else None,
                               skip=frozenset(filter(None, args.skip.split(","))))
            results = run_local(_worker, math.prod(shape), cands, model, inputs, args.steps, args.warmup,
                                device_type, args.parts, backend=backend, timeout=1800)
            record = summarize(name, mesh, cands, results)
            if args.parts:
                record["parts"] = parts(model, inputs, cands, results, record["measured_s"])
            records.append(record)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(record) + "\n")
    return records


def _profile_shape(path: str) -> tuple[int, ...]:
    with open(path) as f:
        return tuple(json.load(f)["shape"])


if __name__ == "__main__":
    main()
