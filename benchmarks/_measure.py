"""Measuring helpers shared by ``fidelity.py`` and ``plugins.py``: the three benchmark models,
the bytes a step saves for backward, a rank's parameter/gradient/optimizer-state bytes, the CUDA
allocator's peak where there is one, and Spearman's rank correlation."""

from __future__ import annotations

import math
import os
import statistics
import sys
import weakref

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _baselines import gpt2_config_model  # noqa: E402

__all__ = ["LossOnly", "build_model", "SavedBytes", "PeakAllocated", "state_bytes", "spearman", "MODELS"]

MODELS = ("gpt2", "llama", "cnn")


# ----------------------------------------------------------------------------------- models
class LossOnly(torch.nn.Module):
    """An HF model returning only its loss (so no plan pays for gathering full logits)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        return self.model(**inputs).loss


def build_model(name: str, *, batch: int) -> tuple[torch.nn.Module, dict]:
    """(loss-only model with real weights, full-batch inputs) for ``gpt2``, ``llama`` or ``cnn``."""
    torch.manual_seed(0)
    if name == "gpt2":
        model, inputs = gpt2_config_model(hidden=256, layers=4, heads=4, vocab=1000, seq=128, batch=batch)
    elif name == "llama":  # issue 30's Qwen2-style decoder
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(vocab_size=1000, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                             attn_implementation="sdpa", use_cache=False, tie_word_embeddings=False)
        model = Qwen2ForCausalLM(config).train()
        ids = torch.randint(0, 1000, (batch, 128))
        inputs = {"input_ids": ids, "labels": ids.clone()}
    elif name == "cnn":
        from transformers import ResNetConfig, ResNetForImageClassification

        config = ResNetConfig(embedding_size=32, hidden_sizes=[64, 128, 256], depths=[2, 2, 2],
                              layer_type="basic", num_labels=10)
        model = ResNetForImageClassification(config).train()
        inputs = {"pixel_values": torch.randn(batch, 3, 64, 64), "labels": torch.randint(0, 10, (batch,))}
    else:
        raise ValueError(f"unknown model {name!r}; expected gpt2, llama or cnn")
    return LossOnly(model), inputs


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class SavedBytes:
    """Peak bytes saved for backward while active: each storage once, parameters excluded --
    the ``Parameter`` objects themselves and any view of their storage (``params``): a runtime
    that computes on ``DTensor.to_local()`` or a cast-free alias saves a non-leaf view of the
    parameter, which holds no byte beyond the parameter that ``state_bytes`` already counts."""

    def __init__(self, params=()) -> None:
        self.params = {_local(p).untyped_storage().data_ptr() for p in params}
        self.live: dict[int, int] = {}
        self.refs: dict[int, int] = {}
        self.now = self.peak = 0

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            self.now -= self.live.pop(key)
            del self.refs[key]

    def pack(self, t: torch.Tensor):
        if isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad):
            return t
        storage = _local(t).untyped_storage()
        key = storage.data_ptr()
        if key in self.params:
            return t
        if key not in self.live:
            self.live[key] = storage.nbytes()
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
        self.refs[key] = self.refs.get(key, 0) + 1
        box = _Box(t)
        weakref.finalize(box, self._release, key)
        return box

    @staticmethod
    def unpack(box):
        return box.t if isinstance(box, _Box) else box


class _Box:
    """A saved tensor as autograd holds it: freed (and uncounted) when autograd drops it."""

    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class PeakAllocated:
    """The CUDA allocator's peak bytes from construction to ``peak()`` on ``device``
    (``torch.cuda.max_memory_allocated``: everything the step allocated, temporaries and
    communication buffers included); None on the CPU, which keeps no such count."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)

    def peak(self) -> int | None:
        if self.device.type != "cuda":
            return None
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device))


def state_bytes(params, optimizer) -> int:
    """A rank's bytes of parameters, gradients and optimizer state: every distinct storage once
    (local shards of DTensors), ZeRO's per-rank gradient pieces (``piece.master.grad``: a view
    of the parameter's gradient at stage 1, a reduce-scattered piece of its own at stage 2).
    ``optimizer``: a ``ZeroOptimizer`` (its ``pieces``), the booster's optimizer (its ZeRO
    optimizer is ``zero``: the pieces are found there -- a ZeRO-2 gradient is in no ``.grad``
    of the module's parameters nor in the inner optimizer's state) or any optimizer."""
    seen: dict[int, int] = {}

    def add(t) -> None:
        if torch.is_tensor(t):
            storage = _local(t).untyped_storage()
            seen.setdefault(storage.data_ptr(), storage.nbytes())

    for p in params:
        add(p)
        add(p.grad)
    for state in getattr(optimizer, "state", {}).values():
        for v in state.values():
            if torch.is_tensor(v) and v.dim():  # not Adam's scalar step counts
                add(v)
    zero = getattr(optimizer, "zero", None) or optimizer
    for piece in getattr(zero, "pieces", ()):  # ZeRO: this rank's pieces
        add(piece.master.grad)
    return sum(seen.values())


def plan_signature(plan) -> tuple:
    """What a plan runs, without its estimate: every node's strategy and ZeRO stage, the
    recomputed segments, the mesh, and the pipeline's stages, schedule and micro-batches. Two
    configurations with one signature run one program: their measured gap is the run's noise."""
    nodes = tuple((n.name, str(n.strategy), n.zero_stage) for n in plan.nodes)
    pipe = plan.pipeline
    stages = None if pipe is None else (tuple(s.layers for s in pipe.stages), pipe.schedule, pipe.num_microbatches)
    return nodes, tuple(r.nodes for r in plan.recompute), tuple(plan.mesh.shape), stages


def slowest_per_round(results: list[dict]) -> dict[str, list[float]]:
    """Each configuration's step seconds per round from every rank's ``results[rank]["times"]``:
    a round's step is its slowest rank's (every rank waits for it at the next collective)."""
    names = list(results[0]["times"])
    rounds = len(results[0]["times"][names[0]])
    return {n: [max(r["times"][n][i] for r in results) for i in range(rounds)] for n in names}


def round_normalized(times: dict[str, list[float]]) -> dict[str, float]:
    """Each plan's step seconds with the load drift between rounds taken out: in round ``r``
    every plan ran once, back to back, so their times share that round's load. A plan's figure
    is the median over rounds of its time over the round's geometric mean, times the median
    round mean -- on a steady machine the plain median, on a shared one (outside load swinging
    2x between rounds) a ranking that does not depend on which round a plan drew."""
    names = list(times)
    rounds = len(times[names[0]])
    means = [math.exp(statistics.fmean(math.log(times[n][r]) for n in names)) for r in range(rounds)]
    scale = statistics.median(means)
    return {n: scale * statistics.median(times[n][r] / means[r] for r in range(rounds)) for n in names}


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def sharded_state_budget(dp_estimate, devices: int) -> int:
    """A budget that the data-parallel plan misses by most of its sharable state, with room for
    the copies ZeRO-3's readers gather and keep for backward (at most the weights once, all alive
    at the end of forward; the planner counts them): the ZeRO-3 family's best plan under it shards
    (nearly) every parameter, as FSDP2 does. (At an ample budget that family's best is to shard
    nothing, which is data parallelism again.)"""
    from autopar.planner.options import PlanOptions

    sharable = dp_estimate.param_bytes * (devices - 1) / devices
    weights = dp_estimate.param_bytes / (2 + PlanOptions().optimizer_multiplier)  # parameter, gradient, state
    return int(dp_estimate.peak_bytes - 0.9 * sharable + weights)
