"""The planner's memory estimate against a measured step, on 4 gloo ranks of mesh (2, 2): a
grouped-query decoder (its causal mask built from ``arange``s, ``repeat_kv``'s copies, as HF
traces Qwen2) planned with ample memory and at a tight budget (ZeRO-2 pieces, recompute). The
measured figure is the benchmarks' (``benchmarks/_measure.py``): the peak bytes saved for
backward (each storage once, parameters left out; a checkpoint region's inputs included) plus
the rank's parameter, gradient and optimizer-state storages after a step. Each plan's estimate
(``Plan.estimate.peak_bytes``) is within 2% of it and so within its budget: attention priced as
the runtime runs it (``tracer.attention_form``), a ZeRO-2 piece's gradient held once."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.runtime.launch import run_local

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from _measure import SavedBytes, state_bytes  # noqa: E402

B, S, H, KV, D, LAYERS = 8, 32, 4, 2, 16, 4
FRACTIONS = (None, 0.6, 0.5)  # ample; ZeRO-2 pieces; ZeRO-2 and two blocks recomputed
WIDTH = H * D


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.q, self.kv, self.o = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 2 * KV * D), nn.Linear(WIDTH, WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x, mask):
        b, s = x.shape[:2]
        h = self.norm1(x)
        q = self.q(h).view(b, s, H, D).transpose(1, 2)
        k, v = self.kv(h).view(b, s, 2, KV, D).permute(2, 0, 3, 1, 4).unbind(0)
        k, v = (t[:, :, None].expand(b, KV, H // KV, s, D).reshape(b, H, s, D) for t in (k, v))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, s, WIDTH)
        x = x + self.o(a)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, WIDTH)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, 100, bias=False)

    def forward(self, ids, labels):
        pos = torch.arange(ids.shape[1], device=ids.device)
        mask = torch.zeros(ids.shape[1], ids.shape[1], device=ids.device).masked_fill(
            pos[None, :] > pos[:, None], float("-inf"))
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, mask)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _measure(rank, world, model, inputs, fractions):
    """Per fraction of the ample plan's estimated peak (None: ample): (the plan's estimated peak,
    the measured peak, its recompute regions, its ZeRO-2 parameters)."""
    import copy

    from autopar.booster import AutoParallelPlugin, Booster

    out = []
    for fraction in fractions:
        budget = None if fraction is None else int(fraction * out[0][0])
        plugin = AutoParallelPlugin(mesh=(2, 2), pp_size=1, memory_budget=budget)
        booster = Booster(plugin=plugin)
        local = copy.deepcopy(model)
        optimizer = torch.optim.AdamW(local.parameters(), lr=1e-3)
        samples = [{k: v[i] for k, v in inputs.items()} for i in range(B)]
        loader = plugin.prepare_dataloader(samples, batch_size=B // plugin.data_parallel_size(), drop_last=True)
        module, optimizer, _, loader, _ = booster.boost(local, optimizer, dataloader=loader)
        batch = next(iter(loader))
        for _ in range(2):  # the second step: the optimizer state and the kept buffers exist
            saved = SavedBytes(module.parameters())
            optimizer.zero_grad()
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                booster.backward(module(**batch), optimizer)
            optimizer.step()
        measured = saved.peak + state_bytes(list(module.parameters()), optimizer)
        plan = module.plan
        out.append((plan.estimate.peak_bytes, measured, len(plan.recompute),
                    sum(n.zero_stage == 2 for n in plan.nodes)))
    return out


@pytest.mark.timeout(300)
def test_a_grouped_query_decoder_measures_what_its_plans_estimate():
    torch.manual_seed(0)
    model = Decoder()
    ids = torch.randint(0, 100, (B, S))
    inputs = {"ids": ids, "labels": ids.roll(-1, 1)}
    results = run_local(_measure, 4, model, inputs, FRACTIONS, timeout=240)
    ample = results[0][0][0]
    for rank_results in results:
        for fraction, (estimate, measured, regions, zero2) in zip(FRACTIONS, rank_results):
            assert abs(measured - estimate) <= 0.02 * estimate, (fraction, measured, estimate, regions, zero2)
            if fraction is not None:
                assert measured <= int(fraction * ample), (fraction, measured)
    (_, _, regions, zero2), (_, _, more_regions, more_zero2) = results[0][1:]
    assert zero2 and more_zero2 and not regions and more_regions, results[0]  # what the budgets exercise
