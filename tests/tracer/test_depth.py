"""Depth-independent tracing and profiling: the cut-and-expand trace and the stamped profile give
exactly the full path's graph, profile and plan; anything else falls back to the full path."""

import importlib

import pytest
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

import autopar
from autopar import zoo
from autopar.strategies import needs_decomposition
from autopar.tracer import depth, profile, trace, unroll
from autopar.tracer.graph import PLACEHOLDER_KEY, op_name, tensor_vals

trace_mod = importlib.import_module("autopar.tracer.trace")  # the package exports trace() by this name
profile_mod = importlib.import_module("autopar.tracer.profile")


def describe(traced):
    """Everything later stages read from a node: op, name, target, wiring, shapes, paths."""
    out = []
    for n in traced.graph.nodes:
        args = pytree.tree_map(lambda a: f"%{a.name}" if isinstance(a, fx.Node) else a, (n.args, n.kwargs))
        vals = [(tuple(v.shape), v.dtype, tuple(v.stride())) for v in tensor_vals(n.meta.get("val"))]
        out.append((n.op, n.name, op_name(n), repr(args), vals, traced.module_path(n),
                    n.meta.get(PLACEHOLDER_KEY)))
    return out


def spy(monkeypatch):
    """Counts how often the shortcuts really produced the result."""
    used = {"expand": 0, "stamp": 0}
    real_expand, real_stamp = unroll.expand, profile_mod.stamp

    def counted_expand(*args, **kwargs):
        out = real_expand(*args, **kwargs)
        used["expand"] += out is not None
        return out

    def counted_stamp(*args, **kwargs):
        out = real_stamp(*args, **kwargs)
        used["stamp"] += out is not None
        return out

    monkeypatch.setattr(unroll, "expand", counted_expand)
    monkeypatch.setattr(profile_mod, "stamp", counted_stamp)
    return used


@pytest.mark.parametrize("name, depths", [("gpt2", (6, 9)), ("llama-1b", (7,)), ("bert-base", (6,))])
def test_fast_trace_and_profile_equal_the_full_path(name, depths, monkeypatch):
    used = spy(monkeypatch)
    for layers in depths:
        model, inputs = zoo.build(name, tiny=True, num_layers=layers)
        full = trace(model, inputs, decompose_if=needs_decomposition, by_blocks=False)
        fast = trace(model, inputs, decompose_if=needs_decomposition)
        assert describe(fast) == describe(full)
        assert fast.graph_hash == full.graph_hash
        assert fast.placeholders == full.placeholders
        assert fast.loss_node.name == full.loss_node.name
        assert fast.in_spec == full.in_spec and fast.out_spec == full.out_spec
        # the expansion hands its blocks over: what discovering them on the graph finds
        assert fast._blocks is not None and depth.blocks_of(fast) == depth.block_structure(fast)
        assert [[n.name for n in run] for run in depth.blocks_of(fast).blocks] == \
            [[n.name for n in run] for run in depth.blocks_of(full).blocks]
        slow, quick = profile(full, by_blocks=False), profile(full)
        assert quick.nodes == slow.nodes  # saved_parts' storage ids included
        assert (quick.fwd_flops, quick.bwd_flops, quick.activation_bytes, quick.param_bytes) == \
            (slow.fwd_flops, slow.bwd_flops, slow.activation_bytes, slow.param_bytes)
        assert profile(fast).nodes == slow.nodes
    assert used == {"expand": len(depths), "stamp": 2 * len(depths)}  # the shortcuts did the work


def test_plan_keeps_objective_and_strategies(monkeypatch):
    model, inputs = zoo.build("gpt2", tiny=True, num_layers=6)
    kwargs = dict(mesh=(2, 2), checkpoint="none", cache=False, pipeline=1)  # the full-batch trace's plan
    fast = autopar.plan(model, inputs, **kwargs)
    monkeypatch.setattr(trace_mod, "trace_shallow", lambda *a, **k: None)
    monkeypatch.setattr(depth, "block_structure", lambda *a, **k: None)  # profile and builder per node
    full = autopar.plan(model, inputs, **kwargs)
    assert fast.graph_hash == full.graph_hash
    assert fast.solver["objective"] == pytest.approx(full.solver["objective"], rel=1e-9)
    assert fast.estimate == full.estimate
    assert [(n.name, n.strategy) for n in fast.nodes] == [(n.name, n.strategy) for n in full.nodes]


class Block(nn.Module):
    def __init__(self, width, scale=1.0):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.scale = scale

    def forward(self, x):
        return x + torch.relu(self.fc(x)) * self.scale


class Stack(nn.Module):
    def __init__(self, widths, scales):
        super().__init__()
        self.blocks = nn.ModuleList(Block(w, s) for w, s in zip(widths, scales))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.sum()


def test_identical_toy_stack_uses_the_shortcuts():
    model = Stack([8] * 7, [1.0] * 7)
    traced = trace(model, (torch.randn(4, 8),))
    assert unroll.repeated_list(model) is not None and depth.block_structure(traced) is not None
    full = trace(model, (torch.randn(4, 8),), by_blocks=False)
    assert describe(traced) == describe(full)
    assert profile(traced).nodes == profile(full, by_blocks=False).nodes


def test_non_identical_blocks_fall_back(monkeypatch):
    used = spy(monkeypatch)
    # A setting that differs in a middle block: the model is not cut.
    model = Stack([8] * 7, [1.0, 1.0, 1.0, 1.0, 0.5, 1.0, 1.0])
    assert unroll.repeated_list(model) is None
    traced = trace(model, (torch.randn(4, 8),))
    full = trace(model, (torch.randn(4, 8),), by_blocks=False)
    assert describe(traced) == describe(full)
    # Shapes that differ in a middle block: the graph's blocks are not identical.
    model = Stack([8, 8, 8, 8, 8, 8, 8], [1.0] * 7)
    model.blocks[4].fc = nn.Linear(8, 8, bias=False)
    assert unroll.repeated_list(model) is None
    traced = trace(model, (torch.randn(4, 8),))
    assert depth.block_structure(traced) is None
    assert profile(traced).nodes == profile(traced, by_blocks=False).nodes
    # One block object repeated (weights shared across depth): its aliases need the full model.
    model = Stack([8], [1.0])
    model.blocks = nn.ModuleList([model.blocks[0]] * 7)
    assert unroll.repeated_list(model) is None
    traced = trace(model, (torch.randn(4, 8),))
    assert traced.params[0].aliases == tuple(f"blocks.{i}.fc.weight" for i in range(7))
    assert used == {"expand": 0, "stamp": 0}


class DenseFirst(nn.Module):
    """A different first block (DeepSeek-V3's dense layer 0 before its MoE layers): more ops."""

    def __init__(self, width):
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + torch.tanh(self.down(torch.relu(self.up(x))))


def test_a_different_first_block_keeps_the_shortcuts(monkeypatch):
    """Blocks 1 .. N-1 identical after a different block 0: found (block 1 reads block 0 as
    block 2 reads block 1, by distance from its end), and the stamped profile and the cut trace
    equal the full ones."""
    used = spy(monkeypatch)
    model = Stack([8] * 7, [1.0] * 7)
    model.blocks[0] = DenseFirst(8)
    full = trace(model, (torch.randn(4, 8),), by_blocks=False)
    s = depth.block_structure(full)
    assert s is not None and len(s.blocks) == 7 and len(s.blocks[0]) != len(s.blocks[1])
    assert profile(full).nodes == profile(full, by_blocks=False).nodes
    fast = trace(model, (torch.randn(4, 8),))
    assert describe(fast) == describe(full)
    assert used == {"expand": 1, "stamp": 1}
    # A middle block that differs is still refused.
    model.blocks[4].fc = nn.Linear(8, 8, bias=False)
    assert depth.block_structure(trace(model, (torch.randn(4, 8),), by_blocks=False)) is None
