"""The framework: the harness catches wrong strategies, errors name the op, expansion and costs."""

import dataclasses
import warnings

import pytest
import torch
from torch import nn

from autopar.layout.cost import collective_seconds
from autopar.layout.mesh import MeshSpec
from autopar.layout.placement import TensorSpec
from autopar.strategies import (
    NoRuleError, OpInfo, Sample, enumerate_strategies, estimate_flops, get_rule, input_nodes,
    strategies_for,
)
from autopar.strategies.grad_sums import comm_seconds, grad_sync_seconds, without_gradients
from autopar.strategies.check import StrategyMismatch, check_strategy, reference, run_spmd
from autopar.strategies.samples import ints, rand
from autopar.tracer import trace
from autopar.tracer.graph import MODULE_KEY

aten = torch.ops.aten


def _strategies(target, sample, shape, flops=(0.0, 0.0)):
    info, _ = reference(target, sample)
    return {s.name: s for s in enumerate_strategies(info, MeshSpec.preset("cpu", shape), flops=flops)}


def _wrong(strategy, **changes):
    return dataclasses.replace(strategy, **changes)


# ------------------------------------------------------------------ the harness can fail
def test_harness_rejects_a_wrong_output_layout():
    sample = Sample((rand(8, 4), rand(4, 8)))
    good = _strategies(aten.mm.default, sample, (4,))["S1 x S0 -> P"]
    bad = _wrong(good, output_spec=TensorSpec.parse("R"))  # forgot the pending sum
    check_strategy(aten.mm.default, sample, good, (4,))
    with pytest.raises(StrategyMismatch, match="output 0"):
        check_strategy(aten.mm.default, sample, bad, (4,))


def test_harness_rejects_a_missing_gradient_all_reduce():
    sample = Sample((rand(4, 8), rand(4, 8), rand(4)))
    good = _strategies(aten.linear.default, sample, (4,))["S0 x R x R -> S0"]
    assert good.grad_partial_axes == ((), (0,), (0,))
    bad = _wrong(good, grad_partial_axes=((), (), ()))
    with pytest.raises(StrategyMismatch, match="gradient of input 1"):
        check_strategy(aten.linear.default, sample, bad, (4,))


def test_harness_rejects_the_plain_op_where_a_kernel_is_needed():
    ce = get_rule(aten.cross_entropy_loss.default).samples()[0]  # mean with ignored targets
    mean = _strategies(aten.cross_entropy_loss.default, ce, (4,))["S0 x S0 -> P"]
    assert mean.kernel == "cross_entropy"
    with pytest.raises(StrategyMismatch):  # a mean of local means
        check_strategy(aten.cross_entropy_loss.default, ce, _wrong(mean, kernel=None), (4,))
    emb = Sample((rand(16, 8), ints(16, 4, 8)))
    vocab = _strategies(aten.embedding.default, emb, (4,))["S0 x R -> P"]
    assert vocab.kernel == "vocab_parallel_embedding"
    with pytest.raises(StrategyMismatch):
        check_strategy(aten.embedding.default, emb, _wrong(vocab, kernel=None), (4,))


def test_simulated_rank_failure_is_reported_not_hung():
    def fn(comm):
        if comm.coordinate(0) == 1:
            raise ValueError("boom")
        return comm.all_reduce(torch.ones(2), 0)

    with pytest.raises(RuntimeError, match=r"rank \(1,\).*boom"):
        run_spmd(fn, (2,))


def test_simulated_all_reduce_sums_over_the_axis_group_only():
    out = run_spmd(lambda c: c.all_reduce(torch.tensor([float(c.coordinate(0) * 10 + c.coordinate(1))]), 1), (2, 2))
    assert out[(0, 0)].item() == out[(0, 1)].item() == 1.0
    assert out[(1, 0)].item() == 21.0


# ------------------------------------------------------------------------- expansion
def test_expansion_prunes_uneven_splits_and_names_strategies():
    names = _strategies(aten.mm.default, Sample((rand(6, 8), rand(8, 8))), (4,))
    assert "S0 x R -> S0" not in names  # 6 rows do not split over 4
    assert {"R x R -> R", "R x S1 -> S1", "S1 x S0 -> P", "P x R -> P", "R x P -> P"} <= set(names)
    two = _strategies(aten.mm.default, Sample((rand(8, 8), rand(8, 8))), (2, 2))
    assert {"S0S0 x RR -> S0S0", "S0R x RS1 -> S0S1", "S1S1 x S0S0 -> PP"} <= set(two)
    assert len(two) == len(set(two))


def test_size_one_axis_adds_no_strategies():
    sample = Sample((rand(8, 8), rand(8, 8)))
    assert len(_strategies(aten.mm.default, sample, (1, 4))) == len(_strategies(aten.mm.default, sample, (4,)))


# ----------------------------------------------------------------------------- costs
def test_costs_follow_the_split():
    sample = Sample((rand(64, 32), rand(16, 32), rand(16)))
    info, _ = reference(aten.linear.default, sample)
    fwd, bwd = estimate_flops(info)
    assert fwd == 2 * 64 * 32 * 16 and bwd == 2 * fwd
    mesh = MeshSpec.preset("cpu", (4,))
    by_name = {s.name: s for s in enumerate_strategies(info, mesh)}
    rep, dp = by_name["R x R x R -> R"], by_name["S0 x R x R -> S0"]
    col, row = by_name["R x S0 x S0 -> S1"], by_name["S1 x S1 x P -> P"]
    assert col.compute_s < rep.compute_s and dp.compute_s < rep.compute_s
    assert rep.comm_s == 0 and row.comm_s == 0
    # Data parallel: the replicated weight and bias gradients are all-reduced in backward.
    assert dp.comm_s == pytest.approx(collective_seconds("all_reduce", 16 * 32 * 8, mesh, 0)
                                      + collective_seconds("all_reduce", 16 * 8, mesh, 0))
    # Column parallel: the replicated input's gradient is partial.
    assert col.grad_partial_axes == ((0,), (), ())
    assert col.output_bytes == 64 * 4 * 8 and col.input_bytes == (64 * 32 * 8, 4 * 32 * 8, 4 * 8)


def test_class_parallel_cross_entropy_pays_for_its_all_reduces():
    sample = get_rule(aten.cross_entropy_loss.default).samples()[0]
    st = _strategies(aten.cross_entropy_loss.default, sample, (4,))["S1 x R -> R"]
    assert st.kernel == "cross_entropy" and st.forward_comm_s > 0


def test_comm_left_out_of_an_op_is_summed_not_subtracted():
    """T5's position-bias ``where``: data parallel, the bias (4096 B) and a float scalar (4 B) both
    take partial gradients. Leaving both sums out by subtraction left -2.7e-20 s (a negative cost
    the solver rejects); ``comm_seconds`` sums what is kept, so nothing left is exactly 0."""
    mesh = MeshSpec.preset("cpu", (2,))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        args = [torch.empty((4, 1, 16, 16), dtype=torch.bool), torch.empty((1, 4, 16, 16)), torch.empty(())]
        info = OpInfo.from_values(aten.where.self, args, {}, aten.where.self(*args))
    strategies = {s.name: s for s in enumerate_strategies(info, mesh)}
    dp = strategies["S0 x R x R -> S0"]
    bias, scalar = grad_sync_seconds(dp, 1, mesh), grad_sync_seconds(dp, 2, mesh)
    assert dp.grad_partial_axes == ((), (0,), (0,))
    assert dp.comm_s - scalar - bias < 0, "these sizes no longer cancel on this preset: pick others"
    assert comm_seconds(dp, mesh, skip=(1, 2)) == 0.0
    assert comm_seconds(dp, mesh, skip=(1,)) == scalar
    assert comm_seconds(dp, mesh, reduce_scatter=(1,), skip=(2,)) == grad_sync_seconds(dp, 1, mesh, "reduce_scatter")
    no_scalar = without_gradients(dp, (2,), mesh)  # the scalar feeds no parameter: no gradient
    assert no_scalar.comm_s == bias and comm_seconds(no_scalar, mesh, skip=(1,)) == 0.0
    with pytest.raises(ValueError, match="both"):
        comm_seconds(dp, mesh, skip=(1,), reduce_scatter=(1,))
    # Nothing left out: comm_s itself, bit for bit, kernels' own collectives included.
    sample = get_rule(aten.cross_entropy_loss.default).samples()[0]
    kernels = _strategies(aten.cross_entropy_loss.default, sample, (4,)).values()
    assert any(s.kernel is not None and s.forward_comm_s + s.kernel_bwd_comm_s > 0 for s in kernels)
    assert all(comm_seconds(s, MeshSpec.preset("cpu", (4,))) == s.comm_s for s in kernels)
    assert all(comm_seconds(s, mesh) == s.comm_s for s in strategies.values())


# ------------------------------------------------------------------- fx nodes, errors
class _Inner(nn.Module):
    def forward(self, x):
        return torch.cumprod(x, 0)  # an op without a rule


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.inner = _Inner()

    def forward(self, x):
        return self.inner(self.proj(x))


@pytest.fixture(scope="module")
def exported():
    return torch.export.export(_Outer(), (torch.randn(4, 8),), strict=False).graph


def test_missing_rule_names_op_node_and_module(exported):
    node = next(n for n in exported.nodes if n.target == aten.cumprod.default)
    mesh = MeshSpec.preset("cpu", (2,))
    with pytest.raises(NoRuleError, match=r"aten\.cumprod\.default.*node 'cumprod'.*module inner"):
        strategies_for(node, mesh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (only,) = strategies_for(node, mesh, allow_replicate_fallback=True)
    assert only.is_fallback and only.output_spec.is_replicated() and "cumprod" in str(caught[0].message)


def test_missing_rule_names_the_module_the_tracer_recorded():
    traced = trace(_Outer(), (torch.randn(4, 8),))
    node = next(n for n in traced.compute_nodes() if n.target == aten.cumprod.default)
    # The tracer's key alone must name the module: nodes the runtime's emitter copies carry only it.
    del node.meta["nn_module_stack"]
    assert node.meta[MODULE_KEY] == "inner"
    with pytest.raises(NoRuleError, match=r"node 'cumprod'.*module inner\)") as caught:
        strategies_for(node, MeshSpec.preset("cpu", (2,)))
    assert caught.value.module_path == "inner"


def test_node_inputs_line_up_with_input_specs(exported):
    node = next(n for n in exported.nodes if n.target == aten.linear.default)
    info = OpInfo.from_node(node)
    assert [n.name for n in input_nodes(node)] == ["x", "p_proj_weight", "p_proj_bias"]
    assert [s.arg for s in info.slots] == ["input", "weight", "bias"]
    assert info.module_path == "proj"
    names = {s.name for s in strategies_for(node, MeshSpec.preset("cpu", (2,)))}
    assert "R x S0 x S0 -> S1" in names


def test_every_covered_node_of_tiny_gpt2_gets_strategies():
    from autopar import zoo

    model, inputs = zoo.build("gpt2", tiny=True)
    graph = torch.export.export(model, (), inputs, strict=False).graph
    mesh = MeshSpec.preset("cpu", (2, 2))
    covered = [n for n in graph.nodes if n.op == "call_function" and get_rule(n.target) is not None]
    targets = {str(n.target) for n in covered}
    assert {"aten.linear.default", "aten.addmm.default", "aten.embedding.default", "aten.layer_norm.default",
            "aten.scaled_dot_product_attention.default", "aten.cross_entropy_loss.default"} <= targets
    for node in covered:
        strategies = strategies_for(node, mesh)
        val = node.meta["val"]
        if isinstance(val, torch.Tensor) and any(size % 2 == 0 for size in val.shape):
            assert any(not st.output_specs[0].is_replicated() for st in strategies), node.format_node()
        assert all(st.compute_s > 0 for st in strategies)


# ------------------------------------------------------------------ compute precision
def _fake_info(target, *shapes, of, **kwargs):
    """OpInfo of ``target`` on fake tensors of dtype ``of`` and ``shapes`` (no data is allocated)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        args = [torch.empty(s, dtype=of) for s in shapes]
        return OpInfo.from_values(target, args, kwargs, target(*args, **kwargs))


def test_a_bf16_op_is_priced_at_the_half_precision_peak():
    # 4096^3 matmul: 137 GFLOP against 200 MB moved, compute-bound in both precisions on an A100
    # (7.0 ms fp32 / 0.44 ms bf16 of FLOPs vs 0.10 ms of memory), so the ratio is the peaks' ratio.
    n = 4096
    mesh = MeshSpec.preset("a100-80gb", (8,))
    costs = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        info = _fake_info(aten.addmm.default, (n,), (n, n), (n, n), of=dtype)
        assert estimate_flops(info) == (2 * n**3, 4 * n**3)  # the same FLOPs whatever the dtype
        costs[dtype] = {s.name: s for s in enumerate_strategies(info, mesh)}
    rep, split = "R x R x R -> R", "R x S0 x R -> S0"
    assert costs[torch.float32][rep].compute_s == pytest.approx(6 * n**3 / 19.5e12)
    for half in (torch.bfloat16, torch.float16):
        assert costs[torch.float32].keys() == costs[half].keys()
        assert costs[half][rep].compute_s == pytest.approx(6 * n**3 / 312e12)
        # A split strategy divides the FLOPs by 8 and stays compute-bound: the same ratio.
        for name in (rep, split):
            assert costs[torch.float32][name].compute_s / costs[half][name].compute_s == pytest.approx(312 / 19.5)


def test_an_op_computes_in_its_widest_float_output_else_its_float_inputs():
    from autopar.strategies.combine import _compute_itemsize

    assert _compute_itemsize(_fake_info(aten.mm.default, (4, 4), (4, 4), of=torch.bfloat16)) == 2
    assert _compute_itemsize(_fake_info(aten.mm.default, (4, 4), (4, 4), of=torch.float32)) == 4
    # A cast up reads bf16 and writes fp32: it runs in fp32; a cast down writes bf16.
    up = _fake_info(aten._to_copy.default, (4, 4), of=torch.bfloat16, dtype=torch.float32)
    assert up.outputs[0].dtype == torch.float32 and _compute_itemsize(up) == 4
    assert _compute_itemsize(_fake_info(aten._to_copy.default, (4, 4), of=torch.float32, dtype=torch.float16)) == 2
    # A comparison writes bool: its floating inputs decide; no floats at all: fp32.
    assert _compute_itemsize(_fake_info(aten.lt.Tensor, (4,), (4,), of=torch.bfloat16)) == 2
    assert _compute_itemsize(_fake_info(aten.lt.Tensor, (4,), (4,), of=torch.float64)) == 8
    assert _compute_itemsize(_fake_info(aten.lt.Tensor, (4,), (4,), of=torch.int64)) == 4


def test_partial_gradients_are_priced_at_the_reduce_dtype():
    """A data-parallel bf16 matmul's weight gradient is summed in fp32 by default: the backward
    all-reduce moves 4 bytes per element (runtime.kernels.grad_all_reduce widens it)."""
    from autopar.layout.cost import collective_seconds

    mesh = MeshSpec.preset("a100-80gb", (8,))
    info = _fake_info(aten.mm.default, (64, 512), (512, 512), of=torch.bfloat16)
    plain = {s.name: s for s in enumerate_strategies(info, mesh)}
    wide = {s.name: s for s in enumerate_strategies(info, mesh, reduce_itemsize=4)}
    dp = "S0 x R -> S0"
    assert plain[dp].grad_partial_axes == ((), (0,))
    weight = 512 * 512
    assert plain[dp].comm_s == pytest.approx(collective_seconds("all_reduce", 2 * weight, mesh, 0))
    assert wide[dp].comm_s == pytest.approx(collective_seconds("all_reduce", 4 * weight, mesh, 0))
    # Nothing narrows: an fp32 gradient "summed in bf16" still moves 4 bytes.
    fp32 = _fake_info(aten.mm.default, (64, 512), (512, 512), of=torch.float32)
    narrow = {s.name: s for s in enumerate_strategies(fp32, mesh, reduce_itemsize=2)}
    assert narrow[dp].comm_s == pytest.approx(collective_seconds("all_reduce", 4 * weight, mesh, 0))
