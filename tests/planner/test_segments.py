"""planner.segments.segment_inputs: what a recomputed segment keeps of the values it reads."""

from __future__ import annotations

import torch
from torch import nn

from autopar.api import PlanOptions
from autopar.planner.builder import build_problem
from autopar.planner.segments import segment_inputs
from autopar.tracer import profile, trace


class Block(nn.Module):
    """A norm read by two projections (a gated MLP's gate and up), as in Llama/Qwen2."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.down = nn.LayerNorm(32), nn.Linear(64, 32)
        self.gate, self.up = nn.Linear(32, 64), nn.Linear(32, 64)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(torch.relu(self.gate(h)) * self.up(h))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def test_a_value_an_earlier_reader_outside_saves_is_kept_in_that_readers_layout():
    """``up`` recomputed alone: the norm's output it reads is also saved by ``gate``, outside the
    segment, which keeps its copy in ITS input layout (a gathered copy when the norm's output is
    split and the projections read it whole) -- what the segment's checkpoint holds too, not
    the norm's output as the norm laid it out."""
    traced = trace(Stack(), {"x": torch.randn(8, 16, 32)})
    prof = profile(traced)
    built = build_problem(traced, prof, PlanOptions().mesh((2,)), budget_bytes=None, options=PlanOptions())
    by_module = {traced.module_path(n): n.name for n in traced.nodes if n.op == "call_function"
                 and n.target is torch.ops.aten.linear.default}
    gate, up = by_module["layers.0.gate"], by_module["layers.0.up"]
    (kept,) = segment_inputs(traced, prof, built.decisions, (2,), {up: "up"})["up"]
    reader = built.decisions[gate]
    value = reader.inputs[0]
    assert kept.node == gate
    assert kept.bytes == tuple(value.local_bytes(c.input_specs[0], (2,)) for c in reader.choices)
    norm = built.decisions[value.producer]
    produced = {value.local_bytes(c.output_specs[value.index], (2,)) for c in norm.choices}
    assert set(kept.bytes) - produced or max(kept.bytes) > min(produced)  # a layout of its own
    # Recomputed together, nothing outside saves it: the segment keeps the norm's output.
    (both,) = segment_inputs(traced, prof, built.decisions, (2,), {gate: "mlp", up: "mlp"})["mlp"]
    assert both.node == value.producer
