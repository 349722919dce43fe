"""The Booster's plugins side by side: every applicable fixed configuration and the auto plan, same run.

    python benchmarks/plugins.py [--models gpt2,llama,cnn] [--world 4] [--batch 8] [--steps 6]
                                 [--warmup 2] [--budgets ample,tight] [--out results.jsonl]

One model at a time is trained through the product notes' API -- ``Booster(plugin=...)``,
``booster.boost(model, optimizer, dataloader=plugin.prepare_dataloader(...))``, then
``booster.backward(loss, optimizer)``, ``optimizer.step()`` -- with each configuration in
``configs`` (torch's DDP and FSDP2, ZeRO-1 and ZeRO-2 as ``LowLevelZeroPlugin``, Gemini's
static ZeRO-3 chunks, ``HybridParallelPlugin`` with tp=2, tp=2 x pp=2 and pp=2, the pipelines
stepped by ``booster.execute_pipeline`` over two micro-batches) and with
``AutoParallelPlugin``, on ``--world`` forked gloo ranks, all boosted from the same weights and
fed the same global batch (``--batch`` samples per step: each plugin's ``batch_size`` is that
over its data-parallel size). After ``--warmup`` steps each, ``--steps`` rounds time them in
rotating order (a barrier before each step; a step is the slowest rank's time; the figure is
the median over rounds).

Budgets: ``ample`` (the device's capacity) and ``tight``: 60% of the peak the planner estimates
for plain data parallelism, where data parallelism does not fit. A configuration fits a budget
when its measured peak per rank (parameters, gradients, optimizer state and the peak of the
bytes saved for backward, as ``fidelity.py`` measures them, each storage once; ``GeminiPlugin``:
its chunk ledger's device peak plus the bytes its own saved-tensor hooks saw in the step) is
within it; ``AutoParallelPlugin`` plans with that budget. Printed per (model, budget): median
ms/step, measured peak MiB per rank,
the plan's estimate (torch's engines: the data-parallel and ZeRO-3 families' estimates, the
layouts they run), and auto / fastest fitting configuration -- issue 29's target is <= 1.05,
and auto must fit wherever any configuration fits.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import statistics
import sys
from typing import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import PeakAllocated, SavedBytes, build_model, sharded_state_budget, state_bytes  # noqa: E402

from autopar.runtime.links import Stopwatch, default_device, rank_device, sync_device  # noqa: E402

TARGET = 1.05
TIGHT_FRACTION = 0.6  # of data parallelism's estimated peak


def configs(budget: int | None, *, world: int = 4, auto_pipeline: bool = False) -> dict[str, Callable[[], object]]:
    """Configuration name -> plugin factory, at ``budget`` bytes per device (None: ample). Fixed
    configurations ignore the budget (they are what they are); the auto plan plans for it.
    ``auto_pipeline`` adds ``auto-pp``: ``AutoParallelPlugin`` on a (2, world / 2) mesh with
    ``pp_size="auto"`` (the planner also weighs a pipeline over axis 0, and 2-D layouts), the
    space the pipelined fixed configurations are in; plain ``auto`` plans a 1-D mesh without one."""
    from autopar.booster import (AutoParallelPlugin, GeminiPlugin, HybridParallelPlugin, LowLevelZeroPlugin,
                                 TorchDDPPlugin, TorchFSDPPlugin)

    return {
        "torch-ddp": TorchDDPPlugin,
        "torch-fsdp2": TorchFSDPPlugin,
        "zero1": lambda: LowLevelZeroPlugin(stage=1, precision="fp32"),
        "zero2": lambda: LowLevelZeroPlugin(stage=2, precision="fp32"),
        "gemini": lambda: GeminiPlugin(precision="fp32"),  # the notes' default placement: static, ZeRO-3 chunks
        "hybrid-tp2": lambda: HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32"),
        # Two micro-batches per step: the fewest that overlap the stages at all.
        "tp2xpp2": lambda: HybridParallelPlugin(tp_size=2, pp_size=2, precision="fp32", num_microbatches=2),
        "pp2": lambda: HybridParallelPlugin(tp_size=1, pp_size=2, precision="fp32", num_microbatches=2),
        "auto": lambda: AutoParallelPlugin(memory_budget=budget),
        **({"auto-pp": lambda: AutoParallelPlugin(mesh=(2, world // 2), pp_size="auto", memory_budget=budget)}
           if auto_pipeline else {}),
    }


def _dataset(inputs: dict) -> list[dict]:
    """The global batch as a map-style dataset of per-sample dicts (the default collate stacks them)."""
    n = next(iter(inputs.values())).shape[0]
    return [{k: v[i] for k, v in inputs.items()} for i in range(n)]


def _on(device: torch.device, batches):
    """The loader's batches on this rank's device (the loader collates on the CPU)."""
    for batch in batches:
        yield {k: v.to(device) for k, v in batch.items()}


def _boost(name: str, factory, model, inputs, world: int, device: torch.device):
    from autopar.booster import Booster

    plugin = factory()
    dp = plugin.data_parallel_size() if hasattr(plugin, "data_parallel_size") else world
    batch = next(iter(inputs.values())).shape[0]
    if batch % dp:
        raise ValueError(f"{name}: the global batch {batch} does not divide over {dp} data-parallel ranks")
    booster = Booster(plugin=plugin)
    local = copy.deepcopy(model)
    # torch's default implementation for all (GeminiPlugin's chunk optimizer refuses foreach=True)
    optimizer = torch.optim.AdamW(local.parameters(), lr=1e-4)
    loader = plugin.prepare_dataloader(_dataset(inputs), batch_size=batch // dp, drop_last=True)
    module, optimizer, _, loader, _ = booster.boost(local, optimizer, dataloader=loader)
    return booster, module, optimizer, _on(device, itertools.cycle(loader))


def _step(booster, module, optimizer, batch) -> torch.Tensor:
    optimizer.zero_grad()
    if getattr(getattr(module, "plan", None), "pipeline", None) is not None:  # the notes' pipelined step
        loss = booster.execute_pipeline(iter([batch]), module, None, optimizer)["loss"]
    else:
        loss = module(**batch)
        booster.backward(loss, optimizer)
    optimizer.step()
    return loss.detach()


def _worker(rank: int, world: int, model, inputs, budget, steps: int, warmup: int, auto_pipeline: bool,
            device_type: str = "cpu") -> dict:
    device = rank_device(device_type)
    built, refused = {}, {}
    for name, factory in configs(budget, world=world, auto_pipeline=auto_pipeline).items():
        try:
            built[name] = _boost(name, factory, model, inputs, world, device)
        except (ValueError, NotImplementedError) as exc:  # raised alike on every rank: this one does not apply
            refused[name] = f"{type(exc).__name__}: {exc}"[:160]
    memory, estimate, allocated = {}, {}, {}
    for name, (booster, module, optimizer, batches) in built.items():
        for _ in range(warmup):
            _step(booster, module, optimizer, next(batches))
        saved = SavedBytes(module.parameters())
        allocator = PeakAllocated(device)
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            _step(booster, module, optimizer, next(batches))
        inner = getattr(optimizer, "optimizer", optimizer)
        memory[name] = saved.peak + state_bytes(list(module.parameters()), inner)
        gemini = getattr(module, "gemini", None)
        if gemini is not None:  # chunks hide both from the above: their ledger and the runtime's own saved-tensor hooks
            memory[name] = gemini.manager.ledger.peak["device"] + sum(gemini.manager.saved.values())
        allocated[name] = allocator.peak()
        plan = getattr(module, "plan", None)
        estimate[name] = None if plan is None else (plan.estimate.step_s, plan.estimate.peak_bytes)
    names = list(built)
    times = {n: [] for n in names}
    watch = Stopwatch(device)
    for r in range(steps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            booster, module, optimizer, batches = built[name]
            batch = next(batches)
            dist.barrier()
            sync_device(device)  # the barrier's kernels (NCCL) are not the step's
            watch.start()
            _step(booster, module, optimizer, batch)
            times[name].append(watch.stop())
    return {"times": times, "memory": memory, "estimate": estimate, "refused": refused, "allocated": allocated,
            "device": str(device)}


def _family_estimates(model, inputs, world: int) -> dict:
    """The data-parallel and ZeRO-3 families' estimates (what torch's DDP and FSDP2 run)."""
    from autopar.planner.options import PlanOptions
    from autopar.planner.orchestrate import plan_family

    options = PlanOptions()
    mesh = options.mesh((world,))
    dp = plan_family(model, inputs, "data-parallel", mesh=mesh, options=options)
    zero3 = plan_family(model, inputs, "zero3", mesh=mesh,
                        options=PlanOptions(memory_budget=sharded_state_budget(dp.estimate, world)))
    return {"torch-ddp": dp.estimate, "torch-fsdp2": zero3.estimate}


def report(model_name: str, label: str, budget, results: list[dict], families: dict) -> dict:
    names = list(results[0]["times"])
    steps = len(results[0]["times"][names[0]])
    slowest = {n: [max(r["times"][n][i] for r in results) for i in range(steps)] for n in names}
    med = {n: statistics.median(slowest[n]) for n in names}
    least = {n: min(slowest[n]) for n in names}  # the least disturbed round: a floor under load
    peak = {n: max(r["memory"][n] for r in results) for n in names}
    est = {}
    for n in names:
        e = results[0]["estimate"][n]
        est[n] = e if e is not None else ((families[n].step_s, families[n].peak_bytes) if n in families else None)
    fits = {n: budget is None or peak[n] <= budget for n in names}
    for n, why in results[0]["refused"].items():
        print(f"  {n}: not run ({why})")
    print(f"\n{model_name}, budget {label}" + (f" ({budget / 2**20:.1f} MiB/rank)" if budget else "")
          + f" on {results[0]['device']}  (load {os.getloadavg()[0]:.2f})")
    allocated = {n: max(r["allocated"][n] or 0 for r in results) for n in names}
    if any(allocated.values()):
        print("CUDA allocator peaks (MiB): " + ", ".join(f"{n} {b / 2**20:.1f}" for n, b in allocated.items()))
    print(f"{'config':<12} {'median ms':>9} {'min ms':>8} {'peak MiB':>9} {'fits':>5} {'est ms':>8} {'est MiB':>8}")
    for n in names:
        e = est[n]
        print(f"{n:<12} {med[n] * 1e3:9.1f} {least[n] * 1e3:8.1f} {peak[n] / 2**20:9.1f} "
              f"{'yes' if fits[n] else 'no':>5} "
              + (f"{e[0] * 1e3:8.1f} {e[1] / 2**20:8.1f}" if e else f"{'-':>8} {'-':>8}"))
    fixed = [n for n in names if not n.startswith("auto") and fits[n]]
    ratio = None
    for auto in (n for n in names if n.startswith("auto")):
        if not fixed:
            print(f"no fixed configuration fits; {auto} fits: {fits[auto]}")
            continue
        best = min(fixed, key=med.__getitem__)
        r = med[auto] / med[best]
        ratio = r if auto == "auto" else ratio
        print(f"{auto} / fastest fitting ({best}) = {r:.3f} (target <= {TARGET}: "
              f"{'met' if r <= TARGET and fits[auto] else 'MISSED'}); {auto} fits: {fits[auto]}")
    return {"model": model_name, "budget": label, "budget_bytes": budget, "median_s": med, "min_s": least,
            "peak_bytes": peak,
            "fits": fits, "estimate": est, "auto_ratio": ratio, "load": os.getloadavg()[0]}


def main(argv=None) -> list[dict]:
    from autopar.runtime.launch import run_local

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt2,llama,cnn")
    p.add_argument("--budgets", default="ample,tight")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", help="append one JSON line per (model, budget)")
    p.add_argument("--auto-pipeline", action="store_true",
                   help="also AutoParallelPlugin on a (2, world/2) mesh with pp_size='auto' (auto-pp)")
    args = p.parse_args(argv)
    device_type, backend = default_device()
    records = []
    for name in args.models.split(","):
        model, inputs = build_model(name, batch=args.batch)
        families = _family_estimates(model, inputs, args.world)
        for label in args.budgets.split(","):
            if label not in ("ample", "tight"):
                p.error(f"--budgets: expected ample and/or tight, got {label!r}")
            budget = None if label == "ample" else int(TIGHT_FRACTION * families["torch-ddp"].peak_bytes)
            results = run_local(_worker, args.world, model, inputs, budget, args.steps, args.warmup,
                                args.auto_pipeline, device_type, backend=backend, timeout=1800)
            record = report(name, label, budget, results, {k: v for k, v in families.items()})
            records.append(record)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(record, default=str) + "\n")
    return records


if __name__ == "__main__":
    main()
