"""`make demo`: plan, shard and train the embedded default GPT-2 on a (2, 2) mesh.

``python -m autopar.cli.demo`` (no arguments) starts 4 local CPU processes (gloo, ``fork``), plans
the embedded default model (``autopar.zoo.default_demo()``: GPT-2, 4 layers, hidden 256, the
full 50257-token vocabulary) on a (2, 2) mesh -- rank 0 solves the ILP and broadcasts the plan
-- and prints the plan summary. Every rank then materialises only its own shards, runs the
first batch and checks the loss against a single-process run of the same weights (gathered
with ``full_state_dict()``), and trains 20 AdamW steps on synthetic data, printing the loss
curve and the time per step.

Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set), the same script runs as one rank of that job:
NCCL on GPUs (``cuda:LOCAL_RANK``), gloo otherwise; 4 ranks form the (2, 2) mesh, any other
world size a 1-D mesh::

    torchrun --nproc-per-node 4 -m autopar.cli.demo

The demo inputs are shorter than the default config's (batch 8, seq 64 instead of 256) so
that the CPU run stays well under two minutes on a 2-core machine; ``--batch``/``--seq``/
``--steps`` change them.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections import Counter
from typing import Any

import torch

DEFAULT_STEPS = 20
DEFAULT_BATCH = 8
DEFAULT_SEQ = 64
WORLD = 4
MESH = (2, 2)
LR = 1e-3
# First-loss tolerance (relative): fp32 on CPU agrees to ~1e-6; GPUs reduce in other orders.
RTOL_CPU, RTOL_GPU = 1e-4, 2e-3


class FirstLossMismatch(RuntimeError):
    """The sharded model's first loss differs from the single-process model's."""


def _say(rank: int, message: str = "") -> None:
    if rank == 0:
        print(message, flush=True)


def synthetic_batch(step: int, *, batch: int, seq: int, vocab: int, device) -> dict[str, torch.Tensor]:
    """Learnable synthetic token streams, identical on every rank: each row counts up from a
    random start with a random stride (mod 1024), so the next token is predictable from the
    last two. Labels are the inputs (the model shifts them)."""
    gen = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, 1024, (batch, 1), generator=gen)
    stride = torch.randint(1, 8, (batch, 1), generator=gen)
    ids = (start + stride * torch.arange(seq)) % min(vocab, 1024)
    return {"input_ids": ids.to(device), "labels": ids.to(device)}


def _meta_inputs(batch: int, seq: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.empty(batch, seq, dtype=torch.long, device="meta"),
            "labels": torch.empty(batch, seq, dtype=torch.long, device="meta")}


def _layout_table(pm) -> list[str]:
    by_spec = Counter()
    for fqn, spec in pm.local_specs().items():
        by_spec[str(spec)] += 1
    calls = Counter()
    for line in pm.code.splitlines():
        for name in ("all_gather", "all_to_all", "reduce_scatter", "all_reduce", "split", "to_partial",
                     "grad_all_reduce", "grad_bucket"):
            if f"self.{name}(" in line:
                calls[name] += 1
    from autopar.runtime.nodes import KernelCall

    kernels = Counter(m.name for m in pm.graph_module.modules() if isinstance(m, KernelCall))
    lines = ["parameter/buffer layouts: " + ", ".join(f"{s} x{c}" for s, c in sorted(by_spec.items())),
             "communication in the emitted graph: " + (", ".join(f"{k} x{v}" for k, v in sorted(calls.items()))
                                                        or "none")]
    if kernels:
        lines.append("distributed kernels: " + ", ".join(f"{k} x{v}" for k, v in sorted(kernels.items())))
    return lines


class LossOnly(torch.nn.Module):
    """The HF model with only the loss as output. ``autoparallelize`` returns every output with
    full values on every rank; the (batch, seq, 50257) logits would cost an all-gather of
    ~100 MB per step that a training loop never reads."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


def _no_dropout(model: torch.nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0


def _reference_loss(pm, model_config, inputs: dict, device) -> float | None:
    """Rank 0: the single-process loss of the gathered weights (every rank must call)."""
    import torch.distributed as dist
    from transformers import GPT2LMHeadModel

    state = {k.removeprefix("model."): v for k, v in pm.full_state_dict().items()}  # a collective
    loss = None
    if dist.get_rank() == 0:
        with torch.device(device):
            ref = GPT2LMHeadModel(model_config)
        ref.loss_type = "ForCausalLM"
        _no_dropout(ref)
        ref.load_state_dict(state, strict=True)
        ref.train()
        with torch.no_grad():
            loss = float(ref(**inputs).loss)
        del ref
    del state
    return loss


def train(rank: int, world: int, *, steps: int = DEFAULT_STEPS, batch: int = DEFAULT_BATCH,
          seq: int = DEFAULT_SEQ, mesh: tuple[int, ...] | None = None) -> dict[str, Any]:
    """One rank of the demo (process group already initialised). Returns the figures."""
    import torch.distributed as dist

    from autopar import autoparallelize, zoo
    from autopar.runtime.build import runtime_device

    device = runtime_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    mesh = mesh or (MESH if world == 4 else (world,))
    model, _ = zoo.default_demo()
    _no_dropout(model)  # dropout masks are random per rank: exact first-loss check needs p = 0
    cfg = model.config
    t0 = time.perf_counter()
    _say(rank, f"[autopar] default model: GPT-2, {cfg.n_layer} layers, hidden {cfg.n_embd}, {cfg.n_head} heads, "
               f"vocab {cfg.vocab_size}, dropout 0; inputs batch {batch} x seq {seq}; {world} ranks "
               f"({dist.get_backend()}, {device.type}), mesh {mesh}")
    _say(rank, "[autopar] rank 0 plans (trace, profile, strategies, ILP) and broadcasts the plan ...")
    pm = autoparallelize(LossOnly(model), _meta_inputs(batch, seq), mesh=mesh, device=device)
    t_plan = time.perf_counter() - t0
    _say(rank, f"[autopar] planned and sharded in {t_plan:.1f} s")
    _say(rank)
    _say(rank, pm.plan.summary())
    for line in _layout_table(pm):
        _say(rank, "  " + line)
    local_bytes = pm.local_parameter_bytes()
    full_bytes = sum(math.prod(p.shape) * 4 for p in model.parameters())
    _say(rank, f"  local parameter bytes on rank 0: {local_bytes / 2**20:.1f} MiB of "
               f"{full_bytes / 2**20:.1f} MiB")
    _say(rank)

    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    first = synthetic_batch(0, batch=batch, seq=seq, vocab=cfg.vocab_size, device=device)
    ref_loss = _reference_loss(pm, cfg, first, device)
    rtol = RTOL_GPU if device.type == "cuda" else RTOL_CPU

    losses, times = [], []
    for step in range(steps):
        inputs = first if step == 0 else synthetic_batch(step, batch=batch, seq=seq, vocab=cfg.vocab_size,
                                                         device=device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = pm(**inputs)
        loss.backward()
        opt.step()
        value = loss.detach().item()  # synchronises
        times.append(time.perf_counter() - t)
        losses.append(value)
        if step == 0:
            ok = torch.tensor([0.0], device=device)
            if rank == 0:
                diff = abs(value - ref_loss)
                _say(rank, f"first loss: sharded {value:.6f}, single process {ref_loss:.6f}, "
                           f"difference {diff:.2e} ({diff / abs(ref_loss):.1e} relative, tolerance {rtol:g})")
                ok[0] = 1.0 if diff <= rtol * abs(ref_loss) else 0.0
            dist.broadcast(ok, src=0)
            if ok.item() != 1.0:
                raise FirstLossMismatch(f"rank {rank}: the sharded model's first loss {value:.6f} differs from "
                                        f"the single-process loss (see rank 0's line)")
            _say(rank, "")
            _say(rank, f"{'step':>4}  {'loss':>9}  {'time':>9}")
        _say(rank, f"{step:>4}  {value:9.4f}  {times[-1] * 1e3:7.1f} ms")
    steady = times[1:] if len(times) > 1 else times
    med = statistics.median(steady)
    _say(rank, "")
    _say(rank, f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {steps} AdamW steps; "
               f"time per step: median {med * 1e3:.1f} ms (first step {times[0] * 1e3:.1f} ms, "
               f"includes warm-up)")
    return {"losses": losses, "times": times, "first_loss": losses[0], "reference_loss": ref_loss,
            "median_step_s": med, "plan_s": t_plan, "mesh": mesh, "local_parameter_bytes": local_bytes,
            "full_parameter_bytes": full_bytes}


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m autopar.cli.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--batch", type=int, default=DEFAULT_BATCH)
    parser.add_argument("--seq", type=int, default=DEFAULT_SEQ)
    args = parser.parse_args(argv)
    kwargs = dict(steps=args.steps, batch=args.batch, seq=args.seq)
    start = time.perf_counter()
    if _under_torchrun():
        import torch.distributed as dist

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        own_group = not dist.is_initialized()
        if own_group:
            dist.init_process_group(backend)
        try:
            result = train(dist.get_rank(), dist.get_world_size(), **kwargs)
        finally:
            if own_group:
                dist.destroy_process_group()
        if int(os.environ["RANK"]) == 0:
            print(f"[autopar] done in {time.perf_counter() - start:.1f} s", flush=True)
        return result
    from autopar.runtime.launch import run_local

    print(f"[autopar] starting {WORLD} local CPU processes (gloo, fork) ...", flush=True)
    results = run_local(train, WORLD, timeout=600, **kwargs)
    print(f"[autopar] done in {time.perf_counter() - start:.1f} s", flush=True)
    return results[0]


if __name__ == "__main__":
    try:
        main()
    except (FirstLossMismatch, RuntimeError) as exc:
        print(f"[autopar] demo FAILED: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
