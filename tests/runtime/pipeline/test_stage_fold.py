"""Pipeline stages fold their attention masks: an input-independent value (a causal mask built
from ``arange``s) is computed by every stage reading it, never sent across a cut
(``runtime.pipeline.split``), so each stage's ``runtime.fold`` runs its attention causal and
grouped -- the form the planner priced (``tracer.attention_form``)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from autopar.api import plan_traced
from autopar.layout.mesh import MeshSpec
from autopar.planner.pipeline.assemble import pipeline_plan
from autopar.runtime.fold import fold_constants
from autopar.runtime.pipeline.split import split_stages
from autopar.tracer import profile, trace
from autopar.tracer.attention_form import input_independent

B, H, KV, S, D = 2, 4, 2, 8, 8
SDPA = torch.ops.aten.scaled_dot_product_attention.default


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(H * D, H * D)
        self.kv = nn.Linear(H * D, 2 * KV * D)

    def forward(self, x, mask):
        q = self.q(x).view(B, S, H, D).transpose(1, 2)
        k, v = self.kv(x).view(B, S, 2, KV, D).permute(2, 0, 3, 1, 4).unbind(0)
        k, v = (t[:, :, None].expand(B, KV, H // KV, S, D).reshape(B, H, S, D) for t in (k, v))
        return x + F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(B, S, H * D)


class Decoder(nn.Module):
    """Grouped-query attention blocks reading one causal mask made before the first (as HF's)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x):
        pos = torch.arange(S, device=x.device)
        mask = torch.zeros(S, S, device=x.device).masked_fill(pos[None, :] > pos[:, None], float("-inf"))
        for layer in self.layers:
            x = layer(x, mask)
        return x.square().mean()


def test_every_stage_computes_its_mask_and_runs_attention_folded():
    torch.manual_seed(0)
    model, inputs = Decoder(), {"x": torch.randn(B, S, H * D)}
    traced = trace(model, inputs)
    sub = plan_traced(traced, profile(traced), mesh=(1,)).plan
    plan = pipeline_plan(sub, traced, mesh=MeshSpec.preset("cpu", (2,)), num_stages=2, num_microbatches=2,
                         schedule="gpipe")
    free = {n.name for n in input_independent(traced.gm.graph)}
    masks = {a.name for n in traced.nodes if n.target is SDPA for a in n.all_input_nodes if a.name in free}
    assert len(masks) == 1
    graphs = split_stages(traced, plan.pipeline)
    assert not masks & set(graphs[1].inputs)  # not sent: the second stage computes it
    ndim = {n.name: n.meta["val"].dim() for n in traced.nodes if isinstance(n.meta.get("val"), torch.Tensor)}
    for g in graphs:
        gm = copy.deepcopy(g.traced.gm)
        fold_constants(gm, ndim_of=lambda node: ndim.get(node.name))
        attention = [n for n in gm.graph.nodes if n.target is SDPA]
        assert len(attention) == 1, g.index
        assert attention[0].kwargs["is_causal"] and attention[0].kwargs["enable_gqa"], g.index
        assert attention[0].kwargs["attn_mask"] is None and "arange" not in gm.code
