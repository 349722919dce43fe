"""Every op of every zoo model has a rule (no replicate fallback), and the new families' key
semantics: exact view splits only, mean's 1/n, synchronised batch norm, getitem's convention."""

import dataclasses
import operator

import pytest
import torch

from autopar import zoo
from autopar.layout.mesh import MeshSpec
from autopar.layout.placement import TensorSpec
from autopar.strategies import (
    KernelContext, OpInfo, Sample, enumerate_strategies, get_kernel, get_rule, input_nodes, needs_decomposition,
    strategies_for,
)
from autopar.strategies.check import StrategyMismatch, check_strategy, reference, run_spmd
from autopar.strategies.registry import local_arguments, needs_no_decision
from autopar.strategies.samples import rand
from autopar.tracer import trace

aten = torch.ops.aten
MODELS = ["mlp", "gpt2", "bert-base", "llama-1b", "vit-base", "resnet50", "dlrm"]
MESHES = [(2, 2), (4,)]
HEAVY = {aten.linear.default, aten.addmm.default, aten.mm.default, aten.bmm.default, aten.matmul.default,
         aten.conv2d.default, aten.scaled_dot_product_attention.default, aten.embedding.default,
         aten._embedding_bag.default}


@pytest.fixture(scope="module", params=MODELS)
def traced(request):
    model, inputs = zoo.build(request.param, tiny=True)
    # As the planner traces: an op without a rule but with a decomposition (nn.EmbeddingBag's
    # embedding_bag.padding_idx -> _embedding_bag) is decomposed; the others are left as they are.
    return request.param, trace(model, inputs, decompose_if=needs_decomposition)


def _sharded(strategy) -> bool:
    specs = strategy.input_specs + strategy.output_specs
    return any(s is not None and not s.is_replicated() for s in specs)


@pytest.mark.parametrize("shape", MESHES, ids=str)
def test_every_zoo_op_has_a_rule(traced, shape):
    name, graph = traced
    mesh = MeshSpec.preset("cpu", shape)
    heavy_seen = set()
    for node in graph.gm.graph.nodes:
        if node.op != "call_function":
            continue
        strategies = strategies_for(node, mesh)  # NoRuleError if any op lacks a rule
        assert strategies and not any(s.is_fallback for s in strategies), node.format_node()
        assert all(len(s.input_specs) == len(input_nodes(node)) for s in strategies), node.format_node()
        if node.target in HEAVY:
            heavy_seen.add(node.target)
            assert any(_sharded(s) for s in strategies), f"{name}: {node.format_node()} only replicated"
    assert heavy_seen, f"{name}: no matmul/conv/attention/embedding node found"


def test_getitem_follows_its_producer_element(traced):
    _, graph = traced
    mesh = MeshSpec.preset("cpu", (2, 2))
    for node in graph.gm.graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem:
            assert needs_no_decision(node)
            producer, k = node.args
            element = producer.meta["val"][k]
            info = OpInfo.from_node(node)
            assert info.slots[0].meta.shape == tuple(element.shape)
            for s in strategies_for(node, mesh):
                assert s.input_specs == (s.output_spec,)  # the identity on element k


def test_producers_of_getitem_emit_one_spec_per_element():
    model, inputs = zoo.build("gpt2", tiny=True)
    graph = trace(model, inputs).gm.graph
    split = next(n for n in graph.nodes if n.target == aten.split.Tensor)
    strategies = strategies_for(split, MeshSpec.preset("cpu", (4,)))
    assert {s.name for s in strategies} >= {"S0 -> (S0, S0, S0)", "P -> (P, P, P)"}
    assert all(len(s.output_specs) == 3 for s in strategies)
    # The split dim (2) is never sharded: 64-wide chunks do not align with 4 shards of 192/4.
    assert "S2 -> (S2, S2, S2)" not in {s.name for s in strategies}


def test_metadata_asserts_need_no_decision():
    model, inputs = zoo.build("resnet50", tiny=True)
    graph = trace(model, inputs).gm.graph
    kinds = {n.target: needs_no_decision(n) for n in graph.nodes if n.op == "call_function"}
    assert kinds[aten._assert_tensor_metadata.default] is True
    assert kinds[aten.conv2d.default] is False and kinds[aten.batch_norm.default] is False


# ------------------------------------------------------------------------ family semantics
def _by_name(target, sample, shape):
    info, _ = reference(target, sample)
    return {s.name: s for s in enumerate_strategies(info, MeshSpec.preset("cpu", shape), flops=(0.0, 0.0))}


def test_view_splits_only_the_major_dim_of_a_merged_group():
    sample = Sample((rand(8, 4, 4), [8, 16]))
    names = _by_name(aten.view.default, sample, (4,))
    assert {"S0 -> S0", "S1 -> S1", "P -> P"} <= set(names) and "S2 -> S1" not in names
    # Forcing the minor dim: its chunks are strided in the merged dim, so the harness rejects it.
    minor = dataclasses.replace(names["S1 -> S1"], input_specs=(TensorSpec.parse("S2"),))
    with pytest.raises(StrategyMismatch):
        check_strategy(aten.view.default, sample, minor, (4,))


def test_view_keeps_axis_order_on_two_axes():
    sample = Sample((rand(4, 4, 8), [16, 8]))
    names = _by_name(aten.view.default, sample, (2, 2))
    assert "S0S0 -> S0S0" in names
    check_strategy(aten.view.default, sample, names["S0S0 -> S0S0"], (2, 2))


def test_mean_over_a_split_dim_needs_the_one_over_n_kernel():
    sample = Sample((rand(4, 8), [1]))
    st = _by_name(aten.mean.dim, sample, (4,))["S1 -> P"]
    assert st.kernel == "partial_mean"
    check_strategy(aten.mean.dim, sample, st, (4,))
    with pytest.raises(StrategyMismatch, match="output 0"):  # a sum of local means is 4x too big
        check_strategy(aten.mean.dim, sample, dataclasses.replace(st, kernel=None), (4,))
    assert "S1 -> P" not in _by_name(aten.amax.default, sample, (4,))  # max is not a sum


def test_softmax_and_cumsum_never_split_their_dim():
    names = _by_name(aten._softmax.default, Sample((rand(4, 8), 1, False)), (4,))
    assert "S0 -> S0" in names and "S1 -> S1" not in names
    names = _by_name(aten.cumsum.default, Sample((rand(4, 8), 0)), (4,))
    assert "S1 -> S1" in names and "S0 -> S0" not in names


def _bn_sample():
    return Sample((rand(8, 4, 2, 2), rand(4), rand(4), rand(4) * 0.1, rand(4, positive=True), True, 0.1, 1e-5,
                   False), no_grad=("running_mean", "running_var"))


def test_batch_split_batch_norm_synchronises_statistics():
    sample = _bn_sample()
    st = _by_name(aten.batch_norm.default, sample, (4,))["S0 x R x R x R x R -> S0"]
    assert st.kernel == "sync_batch_norm" and st.forward_comm_s > 0
    check_strategy(aten.batch_norm.default, sample, st, (4,))
    with pytest.raises(StrategyMismatch):  # local statistics are not the batch's
        check_strategy(aten.batch_norm.default, sample, dataclasses.replace(st, kernel=None), (4,))
    channel = _by_name(aten.batch_norm.default, sample, (4,))["S1 x S0 x S0 x S0 x S0 -> S1"]
    assert channel.kernel is None and channel.comm_s == 0


@pytest.mark.parametrize("shape, spec", [((4,), "S0"), ((2, 2), "S0S2")], ids=str)
def test_sync_batch_norm_updates_running_stats_like_one_device(shape, spec):
    sample = _bn_sample()
    x, weight, bias, mean, var = sample.args[:5]
    want_mean, want_var = mean.clone(), var.clone()
    aten.batch_norm.default(x, weight, bias, want_mean, want_var, True, 0.1, 1e-5, False)
    info, _ = reference(aten.batch_norm.default, sample)
    in_spec = TensorSpec.parse(spec)
    rep = TensorSpec.replicated(len(shape))
    specs = (in_spec, rep, rep, rep, rep)
    kernel = get_kernel("sync_batch_norm").fn

    def rank(comm):
        coord = tuple(comm.coordinate(a) for a in range(len(shape)))
        local_x = x[in_spec.local_slices(x.shape, shape, coord)]
        run_mean, run_var = mean.clone(), var.clone()
        ctx = KernelContext(comm, info, specs, (in_spec,), shape)
        kernel(ctx, local_x, weight, bias, run_mean, run_var, True, 0.1, 1e-5, False)
        return run_mean, run_var

    for run_mean, run_var in run_spmd(rank, shape).values():
        torch.testing.assert_close(run_mean, want_mean, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(run_var, want_var, rtol=1e-10, atol=1e-12)


def test_conv_channel_splits():
    sample = get_rule(aten.conv2d.default).samples()[0]
    names = _by_name(aten.conv2d.default, sample, (4,))
    assert {"S0 x R x R -> S0", "R x S0 x S0 -> S1", "S1 x S1 x P -> P"} <= set(names)
    assert not any(n.startswith("S2") or n.startswith("S3") for n in names)  # no spatial split
    grouped = get_rule(aten.conv2d.default).samples()[2]
    assert "R x S0 -> S1" not in _by_name(aten.conv2d.default, grouped, (4,))


def test_arange_shards_emit_their_own_run():
    names = _by_name(aten.arange.start_step, Sample((1, 33, 2)), (2, 2))
    st = next(s for s in names.values() if str(s.output_spec) == "S0S0")
    assert st.kernel == "arange_shard"
    check_strategy(aten.arange.start_step, Sample((1, 33, 2)), st, (2, 2))


def test_factories_with_global_sizes_need_the_local_rewrite():
    sample = Sample((rand(4, 8), [8, 4]))
    info, _ = reference(aten.new_ones.default, sample)
    st = _by_name(aten.new_ones.default, sample, (4,))["R -> S0"]
    assert st.grad_partial_axes == ((),)  # new_ones reads only dtype and device
    check_strategy(aten.new_ones.default, sample, st, (4,))
    bound = {"self": rand(4, 8), "size": [8, 4]}
    local = local_arguments(aten.new_ones.default, info, bound, st.input_specs, st.output_specs, (4,))
    assert local["size"] == [2, 4] and bound["size"] == [8, 4]
