"""Sort/top-k and scatter/index-write rules: what they offer, what they must not offer (the harness
rejects it), and a Mixtral-style top-k routing block that traces with a native rule for every op."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.layout.mesh import MeshSpec
from autopar.layout.placement import TensorSpec
from autopar.strategies import Sample, enumerate_strategies, get_rule, needs_no_decision, strategies_for
from autopar.strategies.check import StrategyMismatch, check_strategy, reference
from autopar.strategies.samples import ints, rand, randbool
from autopar.tracer import trace

aten = torch.ops.aten


def _strategies(target, sample, shape=(4,)):
    info, _ = reference(target, sample)
    return {s.name: s for s in enumerate_strategies(info, MeshSpec.preset("cpu", shape), flops=(0.0, 0.0))}


def _assert_wrong(target, sample, strategy, shape=(4,)):
    with pytest.raises(StrategyMismatch):
        check_strategy(target, sample, strategy, shape)


# ----------------------------------------------------------------------------- sort family
def test_topk_never_splits_the_selected_dim():
    sample = Sample((rand(4, 8, 4), 2, 1))
    names = set(_strategies(aten.topk.default, sample))
    assert names == {"R -> (R, R)", "S0 -> (S0, S0)", "S2 -> (S2, S2)"}
    # Why: a local top-k returns local positions and misses the other ranks' candidates.
    good = _strategies(aten.topk.default, sample)["S0 -> (S0, S0)"]
    bad = dataclasses.replace(good, input_specs=(TensorSpec.parse("S1"),),
                              output_spec=(TensorSpec.parse("S1"), TensorSpec.parse("S1")))
    _assert_wrong(aten.topk.default, Sample((rand(4, 16, 4), 4, 1)), bad)


def test_reduced_dim_renumbers_outputs_unless_keepdim():
    assert "S2 -> (S1, S1)" in _strategies(aten.max.dim, Sample((rand(4, 8, 4), 1)))
    assert "S2 -> (S2, S2)" in _strategies(aten.max.dim, Sample((rand(4, 8, 4), 1, True)))
    assert "S0 -> S0" in _strategies(aten.argmin.default, Sample((rand(4, 8, 4), -1)))


def test_argmax_of_the_flattened_tensor_is_replicated_only():
    assert set(_strategies(aten.argmax.default, Sample((rand(4, 8),)))) == {"R -> R"}


def test_sort_indices_are_never_partial():
    for target, sample in [(aten.sort.default, Sample((rand(4, 8), 1))), (aten.argsort.default, Sample((rand(4, 8),))),
                           (aten.mode.default, Sample((ints(3, 4, 8).double(), 1)))]:
        for name in _strategies(target, sample):
            assert "P" not in name, (target, name)


def test_pointwise_binary_max_is_left_to_the_generic_rule():
    for op in (aten.max.other, aten.min.other):
        assert torch.Tag.pointwise in op.tags
        entry = get_rule(op)
        assert entry is None or entry.family != "_sort"


# -------------------------------------------------------------------------- scatter family
def test_scatter_splits_only_dims_where_self_index_src_agree():
    idx = rand(8, 8).argsort(-1)[:4, :4]  # distinct targets per row
    corner = _strategies(aten.scatter.src, Sample((rand(8, 8), 1, idx, rand(4, 4))))
    assert set(corner) == {"R x R x R -> R", "P x R x P -> P"}
    full = _strategies(aten.scatter.src, Sample((rand(4, 8), 1, idx, rand(4, 4))))
    assert "S0 x S0 x S0 -> S0" in full


def test_a_replacing_scatter_cannot_split_its_positions():
    """The summing scatters offer ``self P, index/src split on dim -> P``; scatter.src must not."""
    add = Sample((rand(4, 8), 1, ints(8, 4, 8), rand(4, 8)))
    split = _strategies(aten.scatter_add.default, add)["P x S1 x S1 -> P"]
    check_strategy(aten.scatter_add.default, add, split, (4,))
    src = Sample((rand(4, 8), 1, rand(4, 8).argsort(-1), rand(4, 8)))
    assert "P x S1 x S1 -> P" not in _strategies(aten.scatter.src, src)
    _assert_wrong(aten.scatter.src, src, split)


def test_nonzero_fill_is_not_partial():
    fill = Sample((rand(4, 8), 1, ints(8, 4, 4), 2.5))
    assert "P x R -> P" not in _strategies(aten.scatter.value, fill)
    zero = Sample((rand(4, 8), 1, ints(8, 4, 4), 0.0))
    passthrough = _strategies(aten.scatter.value, zero)["P x R -> P"]
    _assert_wrong(aten.scatter.value, fill, passthrough)  # the fill would be added per rank


def test_scatter_reduce_partial_only_for_sum_and_mean():
    base = (rand(8, 4), 0, ints(8, 8, 4), rand(8, 4))
    amax = _strategies(aten.scatter_reduce.two, Sample(base + ("amax",)))
    assert not any("P" in n for n in amax)
    exclude = _strategies(aten.scatter_reduce.two, Sample(base + ("sum",), {"include_self": False}))
    assert "P x R x P -> P" in exclude and "P x S0 x S0 -> P" not in exclude
    include = _strategies(aten.scatter_reduce.two, Sample(base + ("sum",)))
    _assert_wrong(aten.scatter_reduce.two, Sample(base + ("sum",), {"include_self": False}),
                  include["P x S0 x S0 -> P"])


def test_index_add_token_split_on_a_2d_mesh():
    # Expert outputs of tokens split over both axes, summed into the per-token output.
    sample = Sample((rand(8, 4), 0, ints(8, 16), rand(16, 4)))
    strategies = _strategies(aten.index_add.default, sample, (2, 2))
    for name in ("PP x S0S0 x S0S0 -> PP", "PS1 x S0R x S0S1 -> PS1"):
        check_strategy(aten.index_add.default, sample, strategies[name], (2, 2))


def test_in_place_forms_share_the_rules():
    for out_of_place, in_place in [(aten.index_add.default, aten.index_add_.default),
                                   (aten.scatter_add.default, aten.scatter_add_.default),
                                   (aten.index_put.default, aten.index_put_.default)]:
        assert get_rule(in_place).rule is get_rule(out_of_place).rule


def test_one_hot_needs_the_class_count():
    assert set(_strategies(aten.one_hot.default, Sample((ints(4, 8),)))) == {"R -> R"}
    assert set(_strategies(aten.one_hot.default, Sample((ints(4, 8), 4)))) == {"R -> R", "S0 -> S0"}


def test_index_put_with_a_mask_is_replicated_only():
    mask = randbool(8)
    sample = Sample((rand(8, 4), [mask], rand(int(mask.sum()), 4)))
    assert set(_strategies(aten.index_put.default, sample)) == {"R x R x R -> R"}


# --------------------------------------------------------------------- Mixtral-style routing
class _TopKMoE(nn.Module):
    """Top-k routing with static shapes: route, sort tokens by expert, run the experts, and
    sum the weighted expert outputs back into the tokens with index_add."""

    def __init__(self, dim=8, hidden=16, experts=4, top_k=2):
        super().__init__()
        self.top_k, self.experts = top_k, experts
        self.gate = nn.Linear(dim, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, dim, hidden) * 0.1)
        self.w_out = nn.Parameter(torch.randn(experts, hidden, dim) * 0.1)

    def forward(self, x):
        tokens = x.shape[0]
        router_logits = self.gate(x)
        weights, chosen = torch.topk(router_logits.softmax(-1), self.top_k)
        weights = weights / weights.sum(-1, keepdim=True)
        dense = torch.zeros_like(router_logits).scatter(1, chosen, weights)  # (tokens, experts)
        load = F.one_hot(chosen, self.experts).sum(1)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of = torch.arange(tokens).unsqueeze(1).expand(tokens, self.top_k).reshape(-1)[order]
        expert_mask = F.one_hot(flat[order], self.experts).to(x.dtype)
        h = F.silu(torch.einsum("nd,edf->nef", x[token_of], self.w_in))
        y = torch.einsum("nef,efd,ne->nd", h, self.w_out, expert_mask) * weights.reshape(-1)[order].unsqueeze(1)
        return torch.zeros_like(x).index_add(0, token_of, y), dense, load


def test_mixtral_style_routing_block_has_a_rule_for_every_op():
    traced = trace(_TopKMoE(), (torch.randn(16, 8),))
    nodes = [n for n in traced.compute_nodes() if not needs_no_decision(n)]
    targets = {n.target for n in nodes}
    for op in (aten.topk.default, aten.scatter.src, aten.one_hot.default, aten.argsort.stable,
               aten.einsum.default, aten.index_add.default):
        assert op in targets, op
    missing = sorted(str(n.target) for n in nodes if get_rule(n.target) is None)
    assert not missing, f"ops of the routing block without a native rule: {missing}"
    mesh = MeshSpec.preset("cpu", (2, 2))
    by_target = {}
    for node in nodes:
        by_target.setdefault(node.target, []).extend(s.name for s in strategies_for(node, mesh))
    assert "S0R -> (S0R, S0R)" in by_target[aten.topk.default]  # tokens split
    assert "PR x S0R x S0R -> PR" in by_target[aten.index_add.default]  # combine split tokens
    assert "S0R x S0R x S0R -> S0R" in by_target[aten.scatter.src]


class _MoENet(nn.Module):
    def __init__(self):
        super().__init__()
        self.moe = _TopKMoE()
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        out, dense, load = self.moe(x)
        return ((self.head(out + x) ** 2).mean() + 1e-3 * (dense * load).sum(),)


def _train_check(rank, world, model, inputs, plan, ref):
    from autopar.api import autoparallelize
    from tests.runtime.test_e2e import check_module

    return check_module("moe (2, 2)", autoparallelize(model, inputs, plan=plan), inputs, ref)


@pytest.mark.slow
def test_routing_block_trains_like_one_device_on_gloo():
    """4 gloo processes, mesh (2, 2), tokens split: loss, gradients and 3 AdamW steps match."""
    from autopar.api import plan as make_plan
    from autopar.runtime.launch import run_local
    from tests.runtime.test_e2e import fast_mesh, reference as train_reference

    torch.manual_seed(0)
    model, inputs = _MoENet().double(), {"x": torch.randn(1024, 8, dtype=torch.float64)}
    plan = make_plan(model, inputs, mesh=fast_mesh((2, 2)))
    by_op = {n.op: n.strategy for n in plan.by_kind("op")}
    # Many tokens, nearly free links: the routing runs token-parallel, through these rules.
    assert by_op["aten.topk.default"] != "RR -> (RR, RR)", by_op
    errors = run_local(_train_check, 4, model, inputs, plan, train_reference(model, inputs), timeout=300)
    flat = [e for rank_errors in errors for e in rank_errors]
    assert not flat, "\n".join(flat[:10])
