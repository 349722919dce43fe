"""Hand-written baselines for benchmarks/runtime.py (and plans restricted to a baseline family).

- :class:`MegatronGPT2`: a hand-written Megatron tensor-parallel GPT-2 (Shoeybi et al. 2019)
  over one process group, written with ``torch.distributed`` directly: column-parallel
  ``c_attn`` (heads split) and ``c_fc``, row-parallel ``c_proj`` with one all-reduce each in
  forward ("g"), an identity-forward/all-reduce-backward "f" in front of each column-parallel
  pair, embeddings, layer norms and the tied LM head replicated. Built from an HF
  ``GPT2LMHeadModel``'s weights, so its loss equals the HF model's.
- :func:`ddp_model`: PyTorch ``DistributedDataParallel`` around a copy of the HF model (each
  rank feeds its slice of the batch; DDP averages the gradients in 25 MiB buckets).
- :func:`restricted_plan`: the plan autopar's solver finds when every node is restricted to a
  baseline family (``"data-parallel"``, ``"megatron-tp"`` ...), as a runnable ``Plan``.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["MegatronGPT2", "ddp_model", "restricted_plan", "gpt2_config_model"]


# ------------------------------------------------------------------------------- the model
def gpt2_config_model(*, hidden: int, layers: int, heads: int, vocab: int, seq: int, batch: int,
                      device: str = "cpu", seed: int = 0):
    """An HF GPT-2 (dropout 0, sdpa attention) with real weights and random token inputs."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=hidden, n_layer=layers, n_head=heads,
                        use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        attn_implementation="sdpa", bos_token_id=vocab - 1, eos_token_id=vocab - 1)
    torch.manual_seed(seed)
    with torch.device(device):
        model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    model.train()
    gen = torch.Generator().manual_seed(seed + 1)
    inputs = {"input_ids": torch.randint(0, vocab, (batch, seq), generator=gen),
              "labels": torch.randint(0, vocab, (batch, seq), generator=gen)}
    return model, inputs


# ------------------------------------------------------------------- Megatron's f and g
class _CopyToTP(torch.autograd.Function):
    """Megatron's "f": identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's "g": all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Block(nn.Module):
    def __init__(self, hidden: int, heads_local: int, head_dim: int, ffn_local: int, group) -> None:
        super().__init__()
        local = heads_local * head_dim
        self.heads_local, self.head_dim, self.group = heads_local, head_dim, group
        self.ln_1 = nn.LayerNorm(hidden, eps=1e-5)
        self.c_attn_w = nn.Parameter(torch.empty(hidden, 3 * local))
        self.c_attn_b = nn.Parameter(torch.empty(3 * local))
        self.attn_proj_w = nn.Parameter(torch.empty(local, hidden))
        self.attn_proj_b = nn.Parameter(torch.empty(hidden))
        self.ln_2 = nn.LayerNorm(hidden, eps=1e-5)
        self.c_fc_w = nn.Parameter(torch.empty(hidden, ffn_local))
        self.c_fc_b = nn.Parameter(torch.empty(ffn_local))
        self.mlp_proj_w = nn.Parameter(torch.empty(ffn_local, hidden))
        self.mlp_proj_b = nn.Parameter(torch.empty(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = _CopyToTP.apply(self.ln_1(x), self.group)
        qkv = torch.addmm(self.c_attn_b, h.reshape(b * s, -1), self.c_attn_w).view(b, s, 3, self.heads_local,
                                                                                   self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = a.transpose(1, 2).reshape(b * s, -1)
        x = x + (_ReduceFromTP.apply(a @ self.attn_proj_w, self.group) + self.attn_proj_b).view(b, s, -1)
        h = _CopyToTP.apply(self.ln_2(x), self.group)
        m = F.gelu(torch.addmm(self.c_fc_b, h.reshape(b * s, -1), self.c_fc_w), approximate="tanh")
        return x + (_ReduceFromTP.apply(m @ self.mlp_proj_w, self.group) + self.mlp_proj_b).view(b, s, -1)


class MegatronGPT2(nn.Module):
    """Megatron tensor-parallel GPT-2 over ``group`` (this rank's shards of ``hf_model``)."""

    def __init__(self, hf_model: nn.Module, group=None) -> None:
        super().__init__()
        cfg = hf_model.config
        self.group = group
        n, r = dist.get_world_size(group), dist.get_rank(group)
        hidden, heads = cfg.n_embd, cfg.n_head
        if heads % n or (4 * hidden) % n:
            raise ValueError(f"{heads} heads / ffn {4 * hidden} do not split over {n} ranks")
        head_dim, heads_local, ffn_local = hidden // heads, heads // n, 4 * hidden // n
        src = hf_model.transformer
        self.wte = nn.Parameter(src.wte.weight.detach().clone())
        self.wpe = nn.Parameter(src.wpe.weight.detach().clone())
        self.blocks = nn.ModuleList()
        cols = slice(r * heads_local * head_dim, (r + 1) * heads_local * head_dim)
        ffn = slice(r * ffn_local, (r + 1) * ffn_local)
        with torch.no_grad():
            for layer in src.h:
                blk = _Block(hidden, heads_local, head_dim, ffn_local, group)
                blk.ln_1.load_state_dict(layer.ln_1.state_dict())
                blk.ln_2.load_state_dict(layer.ln_2.state_dict())
                w = layer.attn.c_attn.weight.view(hidden, 3, hidden)[:, :, cols]  # q, k, v: this rank's heads
                blk.c_attn_w.copy_(w.reshape(hidden, -1))
                blk.c_attn_b.copy_(layer.attn.c_attn.bias.view(3, hidden)[:, cols].reshape(-1))
                blk.attn_proj_w.copy_(layer.attn.c_proj.weight[cols])
                blk.attn_proj_b.copy_(layer.attn.c_proj.bias)
                blk.c_fc_w.copy_(layer.mlp.c_fc.weight[:, ffn])
                blk.c_fc_b.copy_(layer.mlp.c_fc.bias[ffn])
                blk.mlp_proj_w.copy_(layer.mlp.c_proj.weight[ffn])
                blk.mlp_proj_b.copy_(layer.mlp.c_proj.bias)
                self.blocks.append(blk)
        self.ln_f = nn.LayerNorm(hidden, eps=1e-5)
        self.ln_f.load_state_dict(src.ln_f.state_dict())

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, s = input_ids.shape
        x = F.embedding(input_ids, self.wte) + self.wpe[:s]
        for blk in self.blocks:
            x = blk(x)
        logits = F.linear(self.ln_f(x), self.wte)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


# --------------------------------------------------------------------------------- DDP
def ddp_model(hf_model: nn.Module) -> nn.Module:
    """``DistributedDataParallel`` around a copy of ``hf_model`` (CPU/gloo or the rank's GPU)."""
    from torch.nn.parallel import DistributedDataParallel

    model = copy.deepcopy(hf_model)
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
        return DistributedDataParallel(model.to(device), device_ids=[device.index])
    return DistributedDataParallel(model)


def fsdp2_model(hf_model: nn.Module) -> nn.Module:
    """torch's FSDP2 (``fully_shard``) around a copy of ``hf_model``: each block (GPT-2's or a
    Llama-style decoder's), then the root, sharded over a 1-D mesh of every rank (CPU/gloo, or
    the ranks' GPUs under NCCL)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = copy.deepcopy(hf_model)
    cuda = dist.get_backend() == "nccl"
    if cuda:
        model = model.to(torch.device("cuda", torch.cuda.current_device()))
    mesh = init_device_mesh("cuda" if cuda else "cpu", (dist.get_world_size(),))
    blocks = model.transformer.h if hasattr(model, "transformer") else model.model.layers  # GPT-2, Llama/Qwen2
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


# --------------------------------------------------------------------- restricted plans
def restricted_plan(model, inputs, *, mesh, baseline: str = "data-parallel", memory_budget=None):
    """The best plan within one baseline family (``autopar.planner.baselines``), as a runnable Plan."""
    from autopar.api import PlanOptions
    from autopar.planner.assemble import assemble_plan, baseline_problem
    from autopar.planner.builder import build_problem
    from autopar.planner.checkpointing import estimate
    from autopar.solver.driver import solve
    from autopar.strategies import needs_decomposition
    from autopar.tracer import profile, trace

    options = PlanOptions(memory_budget=memory_budget)
    mesh = options.mesh(mesh)
    traced = trace(model, inputs, decompose_if=needs_decomposition)
    built = build_problem(traced, profile(traced), mesh, budget_bytes=options.budget_bytes(mesh),
                          options=options)
    problem = baseline_problem(baseline, traced, built)
    solution = solve(problem, solver=options.solver, time_limit=options.time_limit)
    evaluation = estimate(built, problem, solution.choice, (), built.segment_inputs)
    return assemble_plan(traced, built, choice=solution.choice, evaluation=evaluation, solution=solution)


def median(values) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else 0.5 * (values[mid - 1] + values[mid])
