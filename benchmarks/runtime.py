"""Time per training step of the emitted module against hand-written baselines, same run.

    python benchmarks/runtime.py [--model gpt2|llama --hidden 256 --layers 4 --heads 4 --vocab 128
                                  --seq 128 --batch 8 --steps 20 --world 2 --out results.jsonl]

GPT-2-tiny family (the zoo's tiny GPT-2: vocab 128, dropout 0; hidden and depth raised by
default so that compute, not fixed overhead, dominates; ``--model llama``: issue 30's
Qwen2-style decoder of ``_measure.build_model`` instead), on ``--world`` local processes (gloo,
one thread each; under ``torchrun`` the job's ranks, NCCL on GPUs). Each rank builds, from the
same weights:

- ``autopar``: ``autoparallelize(model, inputs, mesh=(world,))`` -- the solver's own plan, on
  the model wrapped to return only the loss like the two others (``--full-outputs``: the HF
  outputs, whose full logits are then all-gathered on every rank each step; ``--plan
  data-parallel``: the best plan of the data-parallel baseline family instead, the layout DDP
  runs);
- ``megatron``: the hand-written Megatron tensor-parallel GPT-2 (``_baselines.MegatronGPT2``);
- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` on the HF model, each rank feeding
  its slice of the batch;
- ``plain``: autopar's same emitted graph (same plan) on plain local tensors instead of DTensor
  parameters -- the path the DTensor module contract replaced (issue 13's target: autopar
  within 1.10x of it in the same run);
- ``zero2``: autopar planned with ``zero_stage=2`` (optimizer state and gradients sharded over
  the replicas; ``model.optimizer``), and ``fsdp2``: torch's ``fully_shard`` on the HF model
  (per block, then the root), each rank feeding its slice of the batch like DDP.

``--precision bf16|fp16``: autopar and plain compute in that dtype with fp32 master weights;
Megatron and DDP run under ``torch.autocast`` of the same dtype.

One training step = zero_grad, forward, backward, AdamW step (autopar's built by
``model.optimizer(torch.optim.AdamW, ...)``, as the Booster builds it; ``--dtensor-optimizer``:
``torch.optim.AdamW(model.parameters())`` over the DTensors). After warm-up they are timed
in interleaved rounds (rotating order) on the same inputs, so load on the machine hits them
alike (``--impls autopar,plain,ddp``: only those, so more rounds fit in the same time).
Printed: per-step median and spread per implementation, collectives and bytes per step, the
first losses (all compute the same loss), autopar / best-of-the-others and, with ``--plan
data-parallel``, autopar / DDP against its 1.03 target (with the median of per-round ratios).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import statistics
import sys
import time
from collections import Counter
from contextlib import contextmanager

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _baselines import MegatronGPT2, ddp_model, fsdp2_model, gpt2_config_model  # noqa: E402
from autopar.runtime.links import default_device  # noqa: E402

TARGET = 1.15  # autopar / best of Megatron and DDP
DTENSOR_TARGET = 1.10  # autopar (DTensor parameters) / the same graph on plain tensors
DP_TARGET = 1.03  # --plan data-parallel: autopar / DDP (issue 30.3)
IMPLS = ("autopar", "plain", "megatron", "ddp", "zero2", "fsdp2")
_COLLECTIVES = ("all_reduce", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
                "reduce_scatter_tensor", "all_to_all_single", "broadcast")


@contextmanager
def count_collectives():
    """Count torch.distributed collective calls and their bytes (this process)."""
    calls, nbytes = Counter(), Counter()
    originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            t = args[0] if args else next(iter(kwargs.values()))
            calls[name] += 1
            if isinstance(t, torch.Tensor):
                nbytes[name] += t.numel() * t.element_size()
            return fn(*args, **kwargs)
        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield calls, nbytes
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bench(rank: int, world: int, args, model, inputs) -> dict:
    from autopar import autoparallelize
    from autopar.cli.demo import LossOnly
    from autopar.runtime.build import runtime_device

    device = runtime_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    full = {k: v.to(device) for k, v in inputs.items()}
    per = args.batch // world
    local = {k: v[rank * per:(rank + 1) * per] for k, v in full.items()}

    t0 = time.perf_counter()
    wrapped = copy.deepcopy(model) if args.full_outputs else LossOnly(copy.deepcopy(model))
    if args.plan == "auto":
        pm = autoparallelize(wrapped, inputs, mesh=(world,), device=device, precision=args.precision)
    else:  # one baseline family's best plan (rank 0 solves, every rank builds the same one)
        from _baselines import restricted_plan

        box = [restricted_plan(wrapped, inputs, mesh=(world,), baseline=args.plan) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        pm = autoparallelize(wrapped, inputs, plan=box[0], device=device, precision=args.precision)
    plan_s = time.perf_counter() - t0
    pick = (lambda out: out.loss) if args.full_outputs else (lambda out: out)  # noqa: E731
    autocast = (torch.autocast(device.type, dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[args.precision])
                if args.precision != "fp32" else contextlib.nullcontext())

    def under_autocast(fn):
        def run():
            with autocast:
                return fn()
        return run

    def autopar_impl(m):
        return m, lambda: pick(m(**full))

    def full_impl(m):  # the hand-written Megatron: the full batch, under autocast
        return m, under_autocast(lambda: m(**full))

    def local_impl(m):  # each rank feeds its slice of the batch (DDP, FSDP2)
        return m, under_autocast(lambda: m(**local).loss)

    builders = {
        "autopar": lambda: autopar_impl(pm),
        "plain": lambda: autopar_impl(PlainTensors(autoparallelize(copy.deepcopy(wrapped), inputs, plan=pm.plan,
                                                                   device=device))),
        "megatron": lambda: full_impl(MegatronGPT2(model).to(device)),
        "ddp": lambda: local_impl(ddp_model(model)),
        "zero2": lambda: autopar_impl(autoparallelize(copy.deepcopy(wrapped), inputs, mesh=(world,), device=device,
                                                      precision=args.precision, zero_stage=2)),
        "fsdp2": lambda: local_impl(fsdp2_model(model)),
    }
    impls = {name: builders[name]() for name in builders if name in args.impls}
    # foreach AdamW for all (torch's GPU default); --per-tensor: the loop, torch's CPU default. autopar's
    # through model.optimizer (as the Booster builds it: stepped on the local tensors, runtime.local_step);
    # --dtensor-optimizer: torch's AdamW over the DTensor parameters themselves.
    opts = {name: (m.optimizer(torch.optim.AdamW, lr=1e-4, foreach=args.foreach)
                   if name == "zero2" or (name == "autopar" and not args.dtensor_optimizer)
                   else torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=args.foreach))
            for name, (m, _) in impls.items()}

    def step(name):
        opts[name].zero_grad(set_to_none=True)
        loss = impls[name][1]()
        loss.backward()
        opts[name].step()
        return loss.detach()

    first = {}
    comm = {}
    for name in impls:
        with count_collectives() as (calls, nbytes):
            loss = step(name)
        first[name] = loss
        comm[name] = {"calls": dict(calls), "bytes": sum(nbytes.values())}
    if "ddp" in impls:  # DDP's reducer calls the process group from C++ (not torch.distributed.*): read its buckets.
        sizes = impls["ddp"][0]._get_ddp_logging_data().get("bucket_sizes", "")
        sizes = [int(x) for x in str(sizes).split(",") if x.strip()]
        comm["ddp"] = {"calls": {"all_reduce (reducer buckets)": len(sizes)}, "bytes": sum(sizes)}
    # DDP's and FSDP2's losses are their rank's part; the global loss is the mean over ranks.
    for k in ("ddp", "fsdp2"):
        if k in first:
            dist.all_reduce(first[k])
    first = {k: float(v) / (world if k in ("ddp", "fsdp2") else 1) for k, v in first.items()}
    for _ in range(args.warmup):
        for name in impls:
            step(name)
    times = {name: [] for name in impls}
    order = list(impls)
    for r in range(args.steps):
        for name in order[r % len(order):] + order[:r % len(order)]:
            dist.barrier()
            _sync(device)
            t = time.perf_counter()
            step(name)
            _sync(device)
            times[name].append(time.perf_counter() - t)
    return {"times": times, "first_loss": first, "comm": comm, "plan_s": plan_s,
            "plan": pm.plan.summary(), "code_comm": _graph_comm(pm), "device": str(device)}


class PlainTensors(torch.nn.Module):
    """The plain-tensor path that DTensor parameters replaced: ``pm``'s emitted graph run on
    plain local tensors (this rank's shards as ``nn.Parameter``s), its gradient buckets
    delivering into their ``.grad``. Benchmark-only: it reads ``AutoParallelModule`` internals."""

    def __init__(self, pm) -> None:
        super().__init__()
        from autopar.runtime.bucketing import GradBucketer
        from autopar.runtime.dtensors import local_of

        self.pm = pm
        self.state, by_name = [], {}
        for name in pm._arg_state:
            if name is None:
                continue
            dt = pm._state(name)
            local = local_of(dt).detach().clone()
            by_name[name] = (torch.nn.Parameter(local, requires_grad=dt.requires_grad)
                             if isinstance(dt, torch.nn.Parameter) else local)
            self.state.append(by_name[name])
        self.params = torch.nn.ParameterList([t for t in self.state if isinstance(t, torch.nn.Parameter)])
        for m in pm.graph_module.modules():
            if isinstance(m, GradBucketer):
                m.deliver_to(by_name.__getitem__)  # reduced gradients land in our plain parameters

    def parameters(self, recurse: bool = True):
        return iter(self.params)

    def forward(self, **kwargs):
        inputs = iter(self.pm.flat_inputs((), kwargs))
        state = iter(self.state)
        values = [next(inputs) if name is None else next(state) for name in self.pm._arg_state]
        return self.pm._traced.unflatten_outputs(list(self.pm.graph_module(*values)))


def _graph_comm(pm) -> dict:
    names = ("all_gather", "all_to_all", "reduce_scatter", "all_reduce", "split", "to_partial",
             "grad_all_reduce", "grad_bucket")
    calls = Counter()
    for line in pm.code.splitlines():
        for name in names:
            if f"self.{name}(" in line:
                calls[name] += 1
        if "_early(" in line:  # a kernel's early sum (runtime/early.py): the loss denominator's all-reduce
            calls["early_sum"] += 1
    return dict(calls)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2", choices=("gpt2", "llama"),
                   help="gpt2: the GPT-2 sized by --hidden/--layers/--heads/--vocab/--seq; llama: issue 30's "
                        "Qwen2-style decoder of benchmarks/_measure.build_model (GQA, RoPE; its own sizes, "
                        "--batch only)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--full-outputs", action="store_true",
                   help="autopar returns the HF outputs (full logits gathered on every rank) instead of the loss")
    p.add_argument("--per-tensor", dest="foreach", action="store_false",
                   help="AdamW's per-tensor loop for all (torch's CPU default; default here: foreach, torch's "
                        "GPU default and what autopar recommends on CPU, where the loop pays DTensor dispatch "
                        "for each of ~8 ops per parameter)")
    p.add_argument("--foreach", dest="foreach", action="store_true", help="AdamW(foreach=True) for all (the default)")
    p.add_argument("--dtensor-optimizer", action="store_true",
                   help="autopar's AdamW built by torch over its DTensor parameters (each foreach op through "
                        "DTensor's dispatch) instead of model.optimizer(AdamW), which steps their local tensors")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"),
                   help="autopar/plain compute dtype (fp32 masters); Megatron and DDP under torch.autocast")
    p.add_argument("--plan", default="auto", choices=("auto", "data-parallel"),
                   help="autopar's plan: the solver's own (auto), or the best plan of the data-parallel "
                        "baseline family (autopar.planner.baselines), e.g. to compare its runtime with DDP "
                        "at sizes where the solver picks tensor parallelism")
    p.add_argument("--impls", default=",".join(IMPLS),
                   help=f"comma-separated implementations to time (default: all of {','.join(IMPLS)}; autopar "
                        f"is always timed): fewer of them, more rounds in the same time")
    p.add_argument("--out", help="append one JSON line with the figures")
    args = p.parse_args(argv)
    args.impls = ["autopar", *(name for name in args.impls.split(",") if name.strip() and name.strip() != "autopar")]
    args.impls = [name.strip() for name in args.impls]
    unknown = sorted(set(args.impls) - set(IMPLS))
    if unknown:
        p.error(f"--impls: unknown {unknown}; choose from {','.join(IMPLS)}")
    if args.plan != "auto" and args.precision != "fp32":
        p.error("--plan data-parallel plans the fp32 trace: use it with --precision fp32")

    if args.model == "llama" and "megatron" in args.impls:
        p.error("--impls megatron: the hand-written Megatron is GPT-2's; leave it out with --model llama")
    if args.model == "gpt2":
        model, inputs = gpt2_config_model(hidden=args.hidden, layers=args.layers, heads=args.heads,
                                          vocab=args.vocab, seq=args.seq, batch=args.batch)
        about = (f"GPT-2 hidden {args.hidden}, {args.layers} layers, {args.heads} heads, vocab {args.vocab}; "
                 f"batch {args.batch} x seq {args.seq}")
    else:
        from _measure import build_model

        wrapped, inputs = build_model("llama", batch=args.batch)
        model = wrapped.model  # the HF model: each implementation wraps it as it needs
        cfg = model.config
        about = (f"Qwen2-style hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, "
                 f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} heads, vocab {cfg.vocab_size}; "
                 f"batch {args.batch} x seq {inputs['input_ids'].shape[1]}")
    load = os.getloadavg()[0]
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(default_device()[1])
        try:
            results = [_bench(dist.get_rank(), dist.get_world_size(), args, model, inputs)]
        finally:
            dist.destroy_process_group()
        if int(os.environ["RANK"]) != 0:
            return {}
        world = int(os.environ["WORLD_SIZE"])
    else:
        from autopar.runtime.launch import run_local

        world = args.world
        results = run_local(_bench, world, args, model, inputs, backend=default_device()[1], timeout=900)
    r0 = results[0]
    # A step ends when the slowest rank ends: take each step's maximum over ranks.
    times = {name: [max(r["times"][name][i] for r in results) for i in range(args.steps)] for name in r0["times"]}
    med = {name: statistics.median(v) for name, v in times.items()}
    # Load from other jobs drifts over a run; each round times them back to back, so the median
    # of the per-round ratios is the steadier figure.
    paired = {name: statistics.median(a / b for a, b in zip(times["autopar"], v)) for name, v in times.items()}
    others = [name for name in ("megatron", "ddp") if name in med]
    best_name = min(others, key=med.__getitem__) if others else None
    ratio = med["autopar"] / med[best_name] if best_name else None

    print(f"{about}; {world} processes on {r0['device']} "
          f"({platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {load:.2f} at start, "
          f"{os.getloadavg()[0]:.2f} at end)")
    print(r0["plan"])
    print(f"  autopar graph communication: {r0['code_comm']}; planned in {r0['plan_s']:.1f} s; outputs: "
          f"{'HF outputs (full logits)' if args.full_outputs else 'loss only'}")
    print("first losses: " + ", ".join(f"{k} {v:.6f}" for k, v in r0["first_loss"].items()))
    print(f"{'impl':<10} {'median ms':>10} {'p25 ms':>8} {'p75 ms':>8}  collectives/step (rank 0)")
    for name, v in times.items():
        q = statistics.quantiles(v, n=4) if len(v) > 1 else [v[0]] * 3
        c = r0["comm"][name]
        calls = ", ".join(f"{k} x{n}" for k, n in sorted(c["calls"].items()))
        print(f"{name:<10} {med[name] * 1e3:10.1f} {q[0] * 1e3:8.1f} {q[2] * 1e3:8.1f}  {calls} "
              f"({c['bytes'] / 2**20:.2f} MiB)")
    dt_ratio = med["autopar"] / med["plain"] if "plain" in med else None
    if dt_ratio is not None:
        print(f"DTensor parameters: autopar / plain = {dt_ratio:.3f} (target <= {DTENSOR_TARGET}: "
              f"{'met' if dt_ratio <= DTENSOR_TARGET else 'MISSED'}); median of per-round ratios "
              f"{paired['plain']:.3f}; optimizer: AdamW({'foreach' if args.foreach else 'per-tensor loop'})")
    if {"zero2", "fsdp2", "ddp"} <= set(med):
        print(f"ZeRO-2: autopar zero2 / fsdp2 = {med['zero2'] / med['fsdp2']:.3f}, zero2 / ddp = "
              f"{med['zero2'] / med['ddp']:.3f}, zero2 / autopar (stage 0) = {med['zero2'] / med['autopar']:.3f}")
    if "ddp" in med and args.plan == "data-parallel":
        print(f"data-parallel plan: autopar / ddp = {med['autopar'] / med['ddp']:.3f} (target <= {DP_TARGET}: "
              f"{'met' if med['autopar'] / med['ddp'] <= DP_TARGET else 'MISSED'}); median of per-round ratios "
              f"{paired['ddp']:.3f}")
    if best_name:
        print(", ".join(f"autopar / {name} = {med['autopar'] / med[name]:.3f}" for name in others)
              + f"; autopar / best ({best_name}) = {ratio:.3f} (target <= {TARGET}: "
              f"{'met' if ratio <= TARGET else 'MISSED'}); median of per-round ratios autopar / {best_name} = "
              f"{paired[best_name]:.3f}")
    record = {"bench": "runtime", "args": vars(args), "world": world, "device": r0["device"],
              "median_s": med, "ratio_vs_best": ratio, "dtensor_ratio": dt_ratio,
              "dtensor_paired_ratio": paired.get("plain"),
              "paired_ratio_vs_best": paired.get(best_name), "paired": paired, "best": best_name,
              "first_loss": r0["first_loss"],
              "comm": {k: r0["comm"][k] for k in r0["comm"]}, "load_start": load, "load_end": os.getloadavg()[0],
              "torch": torch.__version__}
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")
    return record


if __name__ == "__main__":
    main()
