"""Problem builder: decisions, their options and costs, edges, recompute segments, the frozen form."""

import dataclasses
import json
import operator

import pytest
import torch
from torch import nn

from autopar import zoo
from autopar.layout.conversion import plan_conversion
from autopar.layout.cost import collective_seconds
from autopar.planner.executed import pending_output_refund
from autopar.layout.mesh import MeshSpec
from autopar.plans import Estimate, NodeKind, NodePlan, Plan
from autopar.planner.builder import build_problem
from autopar.planner.options import PlanOptions
from autopar.planner.segments import mutates_state, op_segments
from autopar.layout.blocks import block_of
from autopar.strategies import input_nodes
from autopar.strategies.grad_sums import grad_sync_seconds
from autopar.tracer import profile, trace
from autopar.tracer.depth import blocks_of
from autopar.tracer.graph import BUFFER, CONSTANT, INPUT, PARAMETER

MESH = MeshSpec.preset("cpu", (2,))


def _built(name: str):
    model, inputs = zoo.build(name, tiny=True)
    traced = trace(model, inputs)
    return traced, build_problem(traced, profile(traced), MeshSpec.preset("cpu", (2,)), budget_bytes=10**7)


class Gated(nn.Module):
    """A linear, a gate from a two-way split (a multi-output op read through ``getitem``), a
    buffer, a linear and a sum."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 16)
        self.down = nn.Linear(8, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.up(x).chunk(2, dim=-1)
        return (self.down(a * torch.sigmoid(b)) * self.scale).sum()


class Blocks(nn.Module):
    """Repeated residual blocks ``x + fc2(gelu(fc1(norm(x))))``; ``norm``: layer or batch norm."""

    def __init__(self, d: int = 8, num_blocks: int = 2, batch_norm: bool = False) -> None:
        super().__init__()
        self.h = nn.ModuleList(_Block(d, batch_norm) for _ in range(num_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.h:
            x = block(x)
        return x.sum()


class _Block(nn.Module):
    def __init__(self, d: int, batch_norm: bool) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(d) if batch_norm else nn.LayerNorm(d)
        self.fc1, self.act, self.fc2 = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


def _build(model: nn.Module, *args, mesh: MeshSpec = MESH, **kwargs):
    traced = trace(model, args)
    return traced, build_problem(traced, profile(traced), mesh, budget_bytes=None, **kwargs)


# -------------------------------------------------------------------------------- decisions
def test_decisions_in_graph_order_with_their_kinds():
    traced, built = _build(Gated(), torch.randn(6, 4))
    names = [n.name for n in built.problem.nodes]
    assert list(built.decisions) == names  # one Decision per Problem node, same order
    kinds = [built.decisions[n].kind for n in names]
    assert all(isinstance(k, NodeKind) for k in kinds)
    num_ops = kinds.count(NodeKind.OP)
    assert kinds == [NodeKind.PARAMETER] * 4 + [NodeKind.BUFFER, NodeKind.INPUT] + [NodeKind.OP] * num_ops + [
        NodeKind.OUTPUT]
    params = [d for d in built.decisions.values() if d.kind == NodeKind.PARAMETER]
    assert [d.module for d in params] == ["up.weight", "up.bias", "down.weight", "down.bias"]
    assert built.decision(names[-1]).module is None  # the graph output
    # every op with a tensor output is a decision, except getitem (it resolves to its producer)
    ops = [n for n in traced.compute_nodes() if n.target is not operator.getitem]
    assert [n.name for n in ops] == names[6:-1]
    for n in ops:
        d = built.decisions[n.name]
        assert d.op == str(n.target) and d.module == traced.module_path(n)
        assert len(d.choices) == built.problem.node(n.name).num_options
        assert [c.name for c in d.choices] == [o.name.split(" #")[0] for o in built.problem.node(n.name).options]


def test_input_slots_are_the_fx_producers():
    traced, built = _build(Gated(), torch.randn(6, 4))
    getitems = 0
    for d in built.decisions.values():
        if d.kind != NodeKind.OP:
            continue
        slots = input_nodes(traced.node(d.name))
        assert len(d.inputs) == len(slots)
        for value, src in zip(d.inputs, slots):
            val = src.meta["val"]
            if not isinstance(val, torch.Tensor):
                assert value is None
                continue
            if src.target is operator.getitem:  # a chunk: its producer's element k
                getitems += 1
                assert (value.producer, value.index) == (src.args[0].name, src.args[1])
            else:
                assert (value.producer, value.index) == (src.name, 0)
            assert value.shape == tuple(val.shape) and value.itemsize == val.dtype.itemsize
            assert built.sources[src.name] == (value.producer, value.index)
    assert getitems == 2  # a * sigmoid(b) reads both halves of the chunk


def test_layout_options_hold_their_bytes():
    traced, built = _build(Gated(), torch.randn(6, 4), options=PlanOptions(optimizer_multiplier=3.0),
                           segmented=True)
    weight = next(d for d in built.decisions.values() if d.module == "up.weight")  # 16 x 4 float32
    options = {o.name: o for o in built.problem.node(weight.name).options}
    # ``up`` is a fused projection (its output is chunked in two): its weight may also be S(d/2) in
    # the restricted (Megatron-style) plans; the auto plan keeps parameters plain (DCP saves them)
    assert set(options) == {"R", "S0", "S1", "S(0/2)", "S(1/2)"}
    plain = _build(Gated(), torch.randn(6, 4))[1]
    assert {o.name for o in plain.problem.node(weight.name).options} == {"R", "S0", "S1"}
    # parameter + gradient + 3 optimizer-state bytes per local byte
    assert options["R"].param_bytes == 16 * 4 * 4 * (2 + 3)
    assert options["S0"].param_bytes == options["S1"].param_bytes == 16 * 4 * 4 * 5 // 2
    assert options["S(0/2)"].param_bytes == options["S0"].param_bytes
    assert all(o.act_bytes == 0 for o in options.values()) and built.problem.node(weight.name).live is None
    x = next(d for d in built.decisions.values() if d.kind == NodeKind.INPUT)  # 6 x 4 float32
    node = built.problem.node(x.name)
    assert {o.name: (o.act_bytes, o.param_bytes) for o in node.options} == {
        "R": (96, 0), "S0": (48, 0), "S1": (48, 0)}
    assert node.live == (0, built.problem.timeline_length - 1)  # held through the whole step
    scale = next(d for d in built.decisions.values() if d.kind == NodeKind.BUFFER)
    assert {o.name: o.param_bytes for o in built.problem.node(scale.name).options} == {"R": 16, "S0": 8}


def test_edge_costs_are_the_planned_conversions_and_unbucketed_sums():
    traced, built = _build(Gated(), torch.randn(6, 4), mesh=MeshSpec.preset("cpu", (2, 2)))
    assert built.problem.edges
    for e in built.problem.edges:
        src, dst = built.decisions[e.src], built.decisions[e.dst]
        for i, c_src in enumerate(src.choices):
            for j, c_dst in enumerate(dst.choices):
                want = 0.0
                for slot, value in enumerate(dst.inputs):  # a value read twice pays twice
                    if value is None or value.producer != e.src:
                        continue
                    a, b = c_src.output_specs[value.index], c_dst.input_specs[slot]
                    if a is not None and b is not None and a != b:
                        conv = plan_conversion(a, b, value.shape, value.itemsize, built.mesh)
                        want += conv.forward_s + conv.backward_s
                        if dst.kind == NodeKind.OUTPUT and value.shape == () and conv.steps and all(
                                step.kind == "all_reduce" for step in conv.steps):
                            # a scalar loss's sum, left in flight: its bytes' time, not its latency
                            axes = tuple(sorted(step.axis for step in conv.steps))
                            want += (collective_seconds("all_reduce", value.itemsize, built.mesh, axes, blocking=False)
                                     - collective_seconds("all_reduce", 0, built.mesh, axes, blocking=False)
                                     - conv.forward_s - conv.backward_s)
                        if slot in dst.bucketed and c_dst.strategy is not None:
                            # a converted parameter's gradient is summed in-graph, not in a bucket:
                            # the latency its reader's option priced as a bucket share, in full
                            s = c_dst.strategy
                            want += grad_sync_seconds(s, slot, built.mesh) - grad_sync_seconds(s, slot, built.mesh,
                                                                                    bucket_cap=built.bucket_cap)
                assert e.costs[i][j] == pytest.approx(want, rel=1e-12, abs=0.0), (e.src, e.dst, i, j)


def test_conversions_of_a_choice_are_the_edges_it_pays():
    traced, built = _build(Gated(), torch.randn(6, 4))
    choice = {n.name: n.options[-1].name for n in built.problem.nodes}
    convs = built.conversions(choice)
    assert convs
    pick = {n.name: n.option_index(choice[n.name]) for n in built.problem.nodes}
    edge_s = sum(e.costs[pick[e.src]][pick[e.dst]] for e in built.problem.edges)
    # but the scalar loss's sum: left in flight, priced at its bytes' time on the output edge
    out = next(d for d in built.decisions.values() if d.kind == NodeKind.OUTPUT)
    refund = sum(r[pick[v.producer], 0] for v in out.inputs if v is not None and (
        r := pending_output_refund(built.decisions[v.producer].choices, v, built.mesh)) is not None)
    assert sum(c.conversion.forward_s + c.conversion.backward_s for c in convs) == pytest.approx(edge_s + refund)
    for c in convs:
        value = built.decisions[c.consumer].inputs[c.slot]
        assert value.producer == c.producer
        assert c.conversion.src == built.choice_of(c.producer, choice[c.producer]).output_specs[value.index]


def test_built_problem_is_frozen():
    _, built = _build(Gated(), torch.randn(6, 4))
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.problem = None
    with pytest.raises(TypeError):
        built.decisions["x"] = None
    d = next(iter(built.decisions.values()))
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.kind = NodeKind.OP
    with pytest.raises(KeyError, match="not a decision"):
        built.decision("no_such_node")


# ------------------------------------------------------------------------------- node kinds
def test_node_kinds_are_one_vocabulary():
    traced, built = _build(Gated(), torch.randn(6, 4))
    assert (PARAMETER, BUFFER, INPUT) == (NodeKind.PARAMETER, NodeKind.BUFFER, NodeKind.INPUT)
    assert CONSTANT is NodeKind.CONSTANT
    for p in traced.placeholders:
        assert built.decisions[p.name].kind is p.kind
    # plain strings in comparisons, printing and JSON
    assert NodeKind.OP == "op" and str(NodeKind.OP) == "op" and f"{NodeKind.BUFFER}" == "buffer"
    assert json.dumps([NodeKind.INPUT]) == '["input"]'
    plan = Plan("m", "h", MESH, None, (NodePlan("x", NodeKind.INPUT, "S0", (), ("S0",)),),
                Estimate(1.0, 1.0, 0.0, 0.0, 0, 0), {})
    text = plan.to_json()
    assert json.loads(text)["nodes"][0]["kind"] == "input"
    again = Plan.from_json(text)
    assert again.nodes[0].kind is NodeKind.INPUT and again.by_kind("input") == again.nodes


def test_tensor_constant_is_a_replicated_buffer():
    class WithConstant(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weights = torch.arange(4.0)  # a plain tensor attribute: a lifted constant

        def forward(self, x):
            return (x * self.weights).sum()

    traced, built = _build(WithConstant(), torch.randn(6, 4))
    constants = [p for p in traced.placeholders if p.kind == CONSTANT]
    assert constants
    for p in constants:
        d = built.decisions[p.name]
        assert d.kind == NodeKind.BUFFER and [c.name for c in d.choices] == ["R"]


# --------------------------------------------------------------------------------- segments
def test_op_segments_are_contiguous_runs():
    ops = [("a", "h.0.fc"), ("b", "h.0.fc"), ("c", "h.0.act"), ("d", "h.0.fc"), ("e", "h.0"),
           ("f", "top"), ("g", "h.1.fc"), ("h", "")]
    assert op_segments(ops) == {"a": "h.0.fc", "b": "h.0.fc", "c": "h.0.act", "d": "h.0.fc#2",
                                "e": "h.0.(self)", "f": None, "g": "h.1.fc", "h": None}


def test_block_segments_and_their_kept_inputs():
    traced, built = _build(Blocks(), torch.randn(6, 8))
    ops = [n for n in built.problem.nodes if built.decisions[n.name].kind == NodeKind.OP]
    segments = [n.segment for n in ops]
    assert {block_of(s) for s in segments if s} == {"h.0", "h.1"}
    for seg in set(segments) - {None}:  # each segment one contiguous run of ops of one module
        where = [i for i, s in enumerate(segments) if s == seg]
        assert where == list(range(where[0], where[-1] + 1)), seg
        module = seg.removesuffix(".(self)")
        assert all(traced.module_path(traced.node(ops[i].name)) == module for i in where)
    assert any(s == "h.0.(self)" for s in segments)  # the residual add
    # A segment or block keeps only activations made outside it, with their bytes per option.
    for unit, kept in built.segment_inputs.items():
        for k in kept:
            producer, where = built.decisions[k.node], built.problem.node(k.node).segment
            assert producer.kind == NodeKind.OP and where != unit and block_of(where) != unit, (unit, k)
            assert len(k.bytes) == len(producer.choices)
    assert "h.0" not in built.segment_inputs  # it reads only the user input and weights: held anyway
    (stream,) = built.segment_inputs["h.1"]  # h.0's output, the residual stream: 6 x 8 float32
    assert built.problem.node(stream.node).segment == "h.0.(self)"
    assert max(stream.bytes) == 6 * 8 * 4 and min(stream.bytes) == 6 * 8 * 4 // 2


def test_training_batch_norm_blocks_get_no_segments():
    traced, built = _build(Blocks(batch_norm=True), torch.randn(6, 8))
    assert any(mutates_state(n) for n in traced.compute_nodes())
    assert not any(n.segment for n in built.problem.nodes) and not built.segment_inputs
    # in eval mode batch norm only reads its running statistics: the blocks stay recomputable
    traced, built = _build(Blocks(batch_norm=True).eval(), torch.randn(6, 8))
    assert not any(mutates_state(n) for n in traced.compute_nodes())
    assert {block_of(n.segment) for n in built.problem.nodes if n.segment} == {"h.0", "h.1"}


def test_batch_norm_blocks_are_not_recomputable():
    traced, built = _built("resnet50")
    stateful = [n for n in traced.compute_nodes() if mutates_state(n)]
    targets = {str(n.target) for n in stateful}
    # training batch norm (running statistics) and num_batches_tracked += 1
    assert "aten.batch_norm.default" in targets and "aten.add_.Tensor" in targets
    blocks = {block_of(traced.module_path(n)) for n in stateful} - {None}
    assert blocks
    for node in built.problem.nodes:
        assert node.segment is None or block_of(node.segment) not in blocks, node
    assert all(block_of(seg) not in blocks for seg in built.segment_inputs)


def test_transformer_blocks_stay_recomputable():
    traced, built = _built("gpt2")
    assert not any(mutates_state(n) for n in traced.compute_nodes())  # relu_/add_ on activations are fine
    assert sum(1 for n in built.problem.nodes if n.segment) > 0


class _NoMemo(dict):
    """A builder cache that never hits: every node computes its own records."""

    def get(self, key, default=None):
        return default

    def setdefault(self, key, default=None):
        return default


@pytest.mark.parametrize("name,mesh_shape,zero", [("gpt2", (2, 2), "auto"), ("llama-1b", (2,), 0),
                                                  ("bert-base", (2,), 1)])
def test_repeated_blocks_reuse_records_exactly(name, mesh_shape, zero):
    """Options, layout choices and conversion costs are computed once per repeated block position
    and stamped onto the repeats: the Problem (options, costs, edges, liveness) and the decisions
    are what computing every node on its own gives."""
    from autopar.planner.builder import _Builder

    model, inputs = zoo.build(name, tiny=True, num_layers=3)
    traced = trace(model, inputs)
    prof = profile(traced)
    options = PlanOptions(preset="a100-80gb", zero_stage=zero)
    mesh = options.mesh(mesh_shape)
    memo = build_problem(traced, prof, mesh, budget_bytes=10**9, options=options)
    fresh = _Builder(traced, prof, mesh, budget_bytes=10**9, options=options)
    fresh._option_cache, fresh._placeholder_cache, fresh._conv_cache = _NoMemo(), _NoMemo(), _NoMemo()
    plain = fresh.build()
    assert memo.problem == plain.problem
    assert dict(memo.decisions) == dict(plain.decisions) and dict(memo.sources) == dict(plain.sources)
    assert dict(memo.segment_inputs) == dict(plain.segment_inputs)
    ops = [n for n in memo.problem.nodes if memo.decisions[n.name].kind == NodeKind.OP]
    assert len({id(n.options) for n in ops}) < len(ops) / 2  # the repeats did share


_STAMP_MODELS: dict = {}


def _stamp_model(name: str, frozen: int | None = None):
    """Tiny ``name`` with 7 blocks (traced by blocks, so its block structure is known), traced
    and profiled once per module; ``frozen``: that block's parameters take no gradient."""
    key = (name, frozen)
    if key not in _STAMP_MODELS:
        model, inputs = zoo.build(name, tiny=True, num_layers=7)
        if frozen is not None:
            blocks = next(m for m in model.modules() if isinstance(m, nn.ModuleList))
            blocks[frozen].requires_grad_(False)
        traced = trace(model, inputs)
        _STAMP_MODELS[key] = traced, profile(traced)
    return _STAMP_MODELS[key]


def _both_builds(traced, prof, mesh_shape, **option_kwargs):
    from autopar.planner.builder import _Builder

    options = PlanOptions(preset="a100-80gb", **option_kwargs)
    mesh = options.mesh(mesh_shape)
    out = []
    for stamp in (True, False):
        builder = _Builder(traced, prof, mesh, budget_bytes=10**9, options=options, stamp_blocks=stamp)
        out.append((builder.build(), builder.num_stamped))
    return out


def _typed(problem):
    """What ``==`` on a Problem does not see: the types of its numbers (an int cost equals the
    float, but serialises differently). Edge ``costs`` are left out: ``Edge`` makes them floats,
    so ``==`` on them is already byte for byte (and serialising them took most of this test)."""
    numbers = [type(getattr(problem, f)).__name__ for f in ("budget_bytes", "timeline_length", "comm_overlap")]
    options = [[type(getattr(o, f)).__name__ for f in o.__dataclass_fields__] for n in problem.nodes for o in n.options]
    nodes = [(n.live, n.block, n.signature, n.segment) for n in problem.nodes]
    edges = [(e.async_costs, e.mem, e.mem_live) for e in problem.edges]
    return json.dumps([numbers, options, nodes, edges])


def _assert_same_build(stamped, plain):
    assert stamped.problem == plain.problem
    assert _typed(stamped.problem) == _typed(plain.problem)
    assert dict(stamped.decisions) == dict(plain.decisions) and dict(stamped.sources) == dict(plain.sources)
    assert list(stamped.decisions) == list(plain.decisions)
    assert dict(stamped.segment_inputs) == dict(plain.segment_inputs) and stamped.fallbacks == plain.fallbacks


@pytest.mark.parametrize("name", ["gpt2", "llama-1b", "bert-base"])
@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2), pytest.param((2, 1, 2), marks=pytest.mark.full_sweep)])
def test_stamped_blocks_equal_the_op_by_op_build(name, mesh_shape):
    """Blocks 3 .. N-1 stamped from block 2's records (``planner.block_stamps``) build the very
    Problem (byte for byte), decisions, sources and segment inputs of building every op."""
    traced, prof = _stamp_model(name)
    assert blocks_of(traced) is not None
    (stamped, num_stamped), (plain, none) = _both_builds(traced, prof, mesh_shape)
    _assert_same_build(stamped, plain)
    ops_after_template = sum(len(run) for run in blocks_of(traced).blocks[3:])
    assert none == 0 and num_stamped > ops_after_template / 2  # the stamps did the work


@pytest.mark.parametrize("name,option_kwargs", [("gpt2", dict(zero_stage="auto", offload="auto")),
                                                 ("llama-1b", dict(zero_stage=2))])
def test_stamped_blocks_with_zero_and_offload_options(name, option_kwargs):
    traced, prof = _stamp_model(name)
    (stamped, num_stamped), (plain, _) = _both_builds(traced, prof, (2, 2), **option_kwargs)
    _assert_same_build(stamped, plain)
    assert num_stamped > 0


def test_a_frozen_block_is_built_op_by_op():
    """Block 4 takes no parameter gradient: its ops (which price no gradient sums) are not
    stamped from block 2's; the build stays exact."""
    traced, prof = _stamp_model("gpt2", frozen=4)
    (stamped, num_stamped), (plain, _) = _both_builds(traced, prof, (2, 2))
    _assert_same_build(stamped, plain)
    blocks = blocks_of(traced).blocks
    assert 0 < num_stamped <= sum(len(run) for k, run in enumerate(blocks[3:], 3) if k != 4)


def test_pinned_ops_are_stamped_only_from_alike_pinned_templates():
    """``build_problem(fixed=)`` (``planner.mesh_search``'s pinned axis) pins block 4's ops
    only: block 4 differs from block 2, the others are stamped, the build stays exact."""
    from autopar.planner.builder import _Builder
    from autopar.strategies import axis_placements

    traced, prof = _stamp_model("gpt2")
    options = PlanOptions(preset="a100-80gb")
    mesh = options.mesh((2, 2))
    free = build_problem(traced, prof, mesh, budget_bytes=10**9, options=options)
    block4 = {n.name for n in blocks_of(traced).blocks[4]}
    pins = {d.name: d.choices[0].strategy for d in free.decisions.values()
            if d.name in block4 and d.kind == NodeKind.OP and d.choices[0].strategy is not None}

    def fixed(node):
        s = pins.get(node.name)
        return None if s is None else (1, *axis_placements(s, 1)[1:])

    builds = []
    for stamp in (True, False):
        builder = _Builder(traced, prof, mesh, budget_bytes=10**9, options=options, fixed=fixed, stamp_blocks=stamp)
        builds.append((builder.build(), builder.num_stamped))
    (stamped, num_stamped), (plain, _) = builds
    _assert_same_build(stamped, plain)
    assert 0 < num_stamped <= sum(len(run) for k, run in enumerate(blocks_of(traced).blocks[3:], 3) if k != 4)
    assert any(len(stamped.decisions[name].choices) < len(free.decisions[name].choices) for name in pins)


def test_tiny_t5_plans_when_an_ops_gradient_sums_all_go_elsewhere():
    """T5's position-bias ``where`` (data parallel) reads a bias whose gradient sum is priced on an
    earlier reader's edge and a scalar no parameter feeds: the op's option is left with no
    communication, which subtracting both sums from its comm_s made -2.7e-20 s (a ValueError)."""
    import transformers as tf

    import autopar

    config = tf.T5Config(vocab_size=101, d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16,
                         decoder_start_token_id=0, pad_token_id=0)
    with torch.device("meta"):
        model = tf.T5ForConditionalGeneration(config)
    ids, labels = torch.randint(1, 101, (4, 16)), torch.randint(1, 101, (4, 16))
    plan = autopar.plan(model, {"input_ids": ids, "labels": labels}, mesh=(2,), cache=False)
    assert plan.estimate.comm_s >= 0 and plan.estimate.step_s > 0
