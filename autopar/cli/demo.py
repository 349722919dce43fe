"""`make demo`: plan, shard and train the embedded default GPT-2 on a (2, 2) mesh with the Booster.

``python -m autopar.cli.demo`` (no arguments) starts 4 local CPU processes (gloo, ``fork``) and
trains the embedded default model (``autopar.zoo.default_demo()``: GPT-2, 4 layers, hidden 256,
the full 50257-token vocabulary) through the Booster API: ``AutoParallelPlugin(mesh=(2, 2),
zero_stage="auto", max_norm=1.0, memory_budget=...)``, ``booster.boost(model, optimizer,
criterion, dataloader, lr_scheduler)`` with a torch AdamW and a warm-up + cosine LambdaLR built
over the original model, then ``booster.backward(loss, optimizer)``, ``optimizer.step()``,
``optimizer.zero_grad()``, ``lr_scheduler.step()``. Rank 0 solves the ILP and broadcasts the
plan, and prints the plan summary: layouts, the collectives of the emitted graph and which
parameters got which ZeRO stage (with the optimizer state each rank holds). The memory budget
lies halfway between the peaks of the plans without ZeRO and with ZeRO-2 everywhere (rank 0
solves those two first), so the planner has to save memory somewhere; ZeRO is its cheapest way
at the default sizes. Every rank materialises only its own shards, runs the first batch and
checks the loss against a single-process run of the same weights (gathered with
``full_state_dict()``), and trains 20 steps on synthetic data, printing the loss curve, the
learning rate and the time per step.

Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set), the same script runs as one rank of that job:
NCCL on GPUs (``cuda:LOCAL_RANK``), gloo otherwise; 4 ranks form the (2, 2) mesh, any other
world size a 1-D mesh::

    torchrun --nproc-per-node 4 -m autopar.cli.demo

The demo inputs are shorter than the default config's (batch 8, seq 64 instead of 256) so
that the CPU run stays well under two minutes on a 2-core machine; ``--batch``/``--seq``/
``--steps`` change them, and ``--layers`` the model's depth.
"""

from __future__ import annotations

import argparse
import logging
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
WARMUP = 3  # steps of linear learning-rate warm-up before the cosine decay
MAX_NORM = 1.0
# The demo's memory budget lies halfway between the per-device peaks of two plans rank 0 solves
# first: without ZeRO and with ZeRO-2 on every parameter it can split. Without a binding budget the
# planner keeps stage 0 everywhere (ZeRO only adds communication); halfway down it must save memory
# and does it the cheapest way, which at the default sizes is ZeRO-2 on the largest replicated
# optimizer state (the 50257 x 256 embedding) -- and the ZeRO-2 plan proves the budget feasible.
# Computed rather than fixed because the peaks move with --batch/--seq and the mesh.
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


class SyntheticTokens(torch.utils.data.Dataset):
    """Map-style: sample ``i`` is row ``i % batch`` of ``synthetic_batch(i // batch)``, so an
    unshuffled loader of ``batch``-sample global batches yields ``synthetic_batch(k)`` at step k."""

    def __init__(self, *, steps: int, batch: int, seq: int, vocab: int) -> None:
        self.ids = torch.cat([synthetic_batch(k, batch=batch, seq=seq, vocab=vocab, device="cpu")["input_ids"]
                              for k in range(steps)])

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def criterion(outputs: torch.Tensor, batch: dict) -> torch.Tensor:
    """The loss of one batch: ``LossOnly`` already returns it."""
    return outputs


def lr_factor(step: int, *, steps: int) -> float:
    """Linear warm-up over ``WARMUP`` steps, then cosine decay to a tenth of ``LR`` at ``steps``."""
    if step < WARMUP:
        return (step + 1) / WARMUP
    done = min(1.0, (step - WARMUP) / max(1, steps - WARMUP))
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * done))


def demo_budget(model: torch.nn.Module, meta_inputs: dict, mesh, device) -> tuple[int, int, int | None]:
    """(peak without ZeRO, peak with ZeRO-2, the demo's budget or None when ZeRO saves nothing) in
    bytes per device, on every rank: rank 0 solves the two plans, the others wait for the peaks."""
    import torch.distributed as dist

    from autopar import plan

    peaks = torch.zeros(2, dtype=torch.int64, device=device)
    if dist.get_rank() == 0:
        for i, stage in enumerate((0, 2)):
            peaks[i] = plan(model, meta_inputs, mesh=mesh, zero_stage=stage, checkpoint="none").estimate.peak_bytes
    dist.broadcast(peaks, src=0)
    without, with_zero2 = (int(v) for v in peaks.tolist())
    return without, with_zero2, (without + with_zero2) // 2 if with_zero2 < without else None


def adamw_state_bytes(optimizer) -> tuple[int, int]:
    """(bytes of AdamW state this rank holds, bytes it would hold without ZeRO): two fp32 tensors
    the size of each local tensor stepped (a ZeRO piece, else the local shard) against two the
    size of every local shard."""
    from autopar.runtime.dtensors import local_of

    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    held = sum(2 * local_of(p).numel() * p.element_size() for p in stepped)
    return held, 2 * optimizer.module.local_parameter_bytes()


def measured_state_bytes(optimizer) -> int:
    """Bytes of the optimizer's state tensors on this rank (after a step), the step counts aside."""
    from autopar.runtime.dtensors import local_of

    return sum(local_of(t).numel() * t.element_size() for state in optimizer.state.values()
               for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0)


def _zero_table(pm, optimizer) -> list[str]:
    """One line per ZeRO stage the plan gives parameters: how many, their bytes, a few names; then
    the AdamW state per rank against stage 0 everywhere."""
    from autopar.report.text import fmt_bytes

    fqn = {}
    for name, param in pm.parameters_by_fqn().items():
        fqn.setdefault(id(param), name.removeprefix("model."))
    by_stage: dict[int, list] = {}
    for _, param, stage, _ in pm.zero_parameters():
        by_stage.setdefault(stage, []).append(param)
    what = {0: "optimizer state whole on every replica",
            1: "optimizer state split over the mesh axes the layout replicates",
            2: "gradient and optimizer state split over the mesh axes the layout replicates"}
    lines = []
    for stage, params in sorted(by_stage.items()):
        names = ", ".join(fqn[id(p)] for p in params[:3]) + (", ..." if len(params) > 3 else "")
        size = fmt_bytes(sum(math.prod(p.shape) * p.element_size() for p in params))
        count = f"{len(params)} parameter{'s' if len(params) > 1 else ''}"
        lines.append(f"ZeRO stage {stage}: {count} ({size}; {what[stage]}), e.g. {names}")
    held, whole = adamw_state_bytes(optimizer)
    lines.append(f"AdamW state per rank (rank 0): {fmt_bytes(held)} instead of {fmt_bytes(whole)} without ZeRO "
                 f"(saves {fmt_bytes(whole - held)})")
    return lines


def demo_model(layers: int | None = None) -> torch.nn.Module:
    """The embedded default model (on meta), with ``layers`` transformer blocks instead of its 4
    when given (a quicker plan and step: the test of this script uses 2)."""
    from transformers import GPT2LMHeadModel

    from autopar import zoo

    model, _ = zoo.default_demo()
    if layers is None or layers == model.config.n_layer:
        return model
    if layers < 1:
        raise ValueError(f"--layers {layers}: the demo model needs at least one layer")
    config = model.config
    config.n_layer = layers
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
        model.loss_type = "ForCausalLM"
    return model.train()


def train(rank: int, world: int, *, steps: int = DEFAULT_STEPS, batch: int = DEFAULT_BATCH,
          seq: int = DEFAULT_SEQ, mesh: tuple[int, ...] | None = None,
          memory_budget: int | str | None = "auto", layers: int | None = None) -> dict[str, Any]:
    """One rank of the demo (process group already initialised). Returns the figures.
    ``memory_budget``: ``"auto"`` (``demo_budget``), bytes or ``"150MiB"``, or None (the device's);
    ``layers``: the model's depth (None: the default model's 4)."""
    import functools

    import torch.distributed as dist

    from autopar.booster import AutoParallelPlugin, Booster
    from autopar.layout.mesh import MeshSpec
    from autopar.report.text import fmt_bytes
    from autopar.runtime.build import mesh_preset, runtime_device

    device = runtime_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    # max_norm clipping reduces the global norm of DTensor gradients through torch, which warns on
    # every rank that a 2-D mesh takes two sequential all-reduces for it; the demo's output is
    # rank 0's lines, so that warning is kept out of it.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = mesh or (MESH if world == 4 else (world,))
    spec = MeshSpec.coerce(mesh, preset=mesh_preset(device))  # the costs autoparallelize would use
    model = demo_model(layers)
    _no_dropout(model)  # dropout masks are random per rank: exact first-loss check needs p = 0
    cfg = model.config
    model = LossOnly(model)
    t0 = time.perf_counter()
    _say(rank, f"[autopar] default model: GPT-2, {cfg.n_layer} layers, hidden {cfg.n_embd}, {cfg.n_head} heads, "
               f"vocab {cfg.vocab_size}, dropout 0; inputs batch {batch} x seq {seq}; {world} ranks "
               f"({dist.get_backend()}, {device.type}), mesh {mesh}")
    peak = peak_zero2 = None
    budget = memory_budget
    if memory_budget == "auto":
        _say(rank, "[autopar] rank 0 plans without ZeRO and with ZeRO-2 everywhere for the demo's memory budget ...")
        peak, peak_zero2, budget = demo_budget(model, _meta_inputs(batch, seq), spec, device)
        if budget is None:
            _say(rank, f"[autopar] no memory budget: ZeRO-2 does not lower the peak ({fmt_bytes(peak)} per device)")
        else:
            _say(rank, f"[autopar] memory budget {fmt_bytes(budget)} per device, halfway between the peaks without "
                       f"ZeRO ({fmt_bytes(peak)}) and with ZeRO-2 everywhere ({fmt_bytes(peak_zero2)}), so "
                       f"zero_stage='auto' must save memory")
    else:
        _say(rank, f"[autopar] memory budget {budget if budget is not None else 'the device capacity'} per device")
    # checkpoint="none": the budget is to be met by layouts and ZeRO, not by recomputation (which
    # would also make the solve several seconds slower).
    plugin = AutoParallelPlugin(mesh=spec, memory_budget=budget, zero_stage="auto", precision="fp32",
                                max_norm=MAX_NORM, checkpoint="none", device=device)
    booster = Booster(plugin=plugin)
    dp = plugin.data_parallel_size()  # prepare_dataloader's batch_size is per data-parallel rank
    if batch % dp:
        raise ValueError(f"the batch {batch} must divide among the {dp} data-parallel ranks")
    loader = plugin.prepare_dataloader(SyntheticTokens(steps=steps, batch=batch, seq=seq, vocab=cfg.vocab_size),
                                       batch_size=batch // dp, drop_last=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)  # over the original model: boost rebuilds it
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(lr_factor, steps=steps))
    _say(rank, "[autopar] booster.boost: rank 0 plans (trace, profile, strategies, ILP) and broadcasts the plan ...")
    pm, optimizer, loss_fn, loader, scheduler = booster.boost(model, optimizer, criterion, loader, scheduler)
    t_plan = time.perf_counter() - t0
    _say(rank, f"[autopar] planned and sharded in {t_plan:.1f} s")
    _say(rank)
    _say(rank, pm.plan.summary())
    for line in _layout_table(pm) + _zero_table(pm, optimizer):
        _say(rank, "  " + line)
    local_bytes = pm.local_parameter_bytes()
    full_bytes = sum(math.prod(p.shape) * 4 for p in model.parameters())
    _say(rank, f"  local parameter bytes on rank 0: {local_bytes / 2**20:.1f} MiB of "
               f"{full_bytes / 2**20:.1f} MiB")
    _say(rank)

    first = synthetic_batch(0, batch=batch, seq=seq, vocab=cfg.vocab_size, device=device)
    ref_loss = _reference_loss(pm, cfg, first, device)
    rtol = RTOL_GPU if device.type == "cuda" else RTOL_CPU

    losses, times, lrs = [], [], []
    for step, inputs in enumerate(loader):  # each rank's piece of the global batch when the plan splits it
        inputs = {k: v.to(device) for k, v in inputs.items()}
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        loss = loss_fn(pm(**inputs), inputs)
        booster.backward(loss, optimizer)
        optimizer.step()  # clips to MAX_NORM (the global norm), steps, gathers ZeRO pieces
        optimizer.zero_grad()
        value = loss.detach().item()  # synchronises
        times.append(time.perf_counter() - t)
        losses.append(value)
        lrs.append(optimizer.param_groups[0]["lr"])
        scheduler.step()
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
            _say(rank, f"{'step':>4}  {'loss':>9}  {'lr':>9}  {'time':>9}")
        _say(rank, f"{step:>4}  {value:9.4f}  {lrs[-1]:9.2e}  {times[-1] * 1e3:7.1f} ms")
    steady = times[1:] if len(times) > 1 else times
    med = statistics.median(steady)
    state_bytes = measured_state_bytes(optimizer)
    _say(rank, "")
    _say(rank, f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {steps} AdamW steps (Booster, max_norm {MAX_NORM:g}, "
               f"warm-up + cosine LR); time per step: median {med * 1e3:.1f} ms (first step "
               f"{times[0] * 1e3:.1f} ms, includes warm-up); AdamW state on rank 0 {fmt_bytes(state_bytes)}")
    held, whole = adamw_state_bytes(optimizer)
    zero_stages = Counter(stage for _, _, stage, _ in pm.zero_parameters())
    return {"losses": losses, "times": times, "lrs": lrs, "first_loss": losses[0], "reference_loss": ref_loss,
            "median_step_s": med, "plan_s": t_plan, "mesh": mesh, "local_parameter_bytes": local_bytes,
            "full_parameter_bytes": full_bytes, "budget_bytes": budget, "no_zero_peak_bytes": peak,
            "zero2_peak_bytes": peak_zero2,
            "zero_stages": dict(zero_stages), "state_bytes": state_bytes, "planned_state_bytes": held,
            "no_zero_state_bytes": whole}


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m autopar.cli.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--batch", type=int, default=DEFAULT_BATCH)
    parser.add_argument("--seq", type=int, default=DEFAULT_SEQ)
    parser.add_argument("--memory-budget", default="auto",
                        help="'auto' (halfway between the peaks of the plans without ZeRO and with ZeRO-2, "
                             "so the planner uses ZeRO), bytes per device such as 150MiB, or 'none'")
    parser.add_argument("--layers", type=int, help="the model's transformer blocks (default: 4)")
    args = parser.parse_args(argv)
    budget = None if args.memory_budget == "none" else args.memory_budget
    kwargs = dict(steps=args.steps, batch=args.batch, seq=args.seq, memory_budget=budget, layers=args.layers)
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
