"""Coverage by mechanism: generic rules from tags/schema, DTensor-derived candidates admitted by
the numeric check, foreign ops by name, and the order native > generic > decomposed > DTensor."""

import pytest
import torch

from autopar.layout.mesh import MeshSpec
from autopar.layout.placement import Shard
from autopar.strategies import (
    NoRuleError, Sample, enumerate_strategies, get_rule, needs_decomposition, rule_for, rule_source,
)
from autopar.strategies.check import check_strategy, reference
from autopar.strategies.samples import rand

aten = torch.ops.aten


def _all_strategies_match(target, sample, shapes=((2,), (2, 2))) -> int:
    ref = reference(target, sample)
    num_sharded = 0
    for shape in shapes:
        for st in enumerate_strategies(ref[0], MeshSpec.preset("cpu", shape), flops=(0.0, 0.0)):
            check_strategy(target, sample, st, shape, ref=ref)
            num_sharded += any(s is not None and not s.is_replicated() for s in st.input_specs + st.output_specs)
    return num_sharded


@pytest.mark.parametrize("target", [aten.hardtanh.default, aten.elu.default, aten.leaky_relu.default,
                                    aten.softplus.default, aten.threshold.default, aten.sign.default],
                         ids=str)
def test_pointwise_tag_gives_the_generic_rule(target):
    assert get_rule(target) is None and rule_source(target) == "generic"
    args = (rand(4, 8), 0.5, 0.0) if target == aten.threshold.default else (rand(4, 8),)
    assert _all_strategies_match(target, Sample(args)) > 0


@pytest.mark.parametrize("target,args,kwargs", [
    (aten.var.correction, (rand(4, 8, 4), [1]), {"correction": 1, "keepdim": False}),
    (aten.var_mean.correction, (rand(4, 8, 4), [2]), {"correction": 0, "keepdim": True}),
    (aten.logsumexp.default, (rand(4, 8), [1]), {}),
    (aten.prod.dim_int, (rand(4, 8), 0), {}),
], ids=lambda v: str(v) if isinstance(v, torch._ops.OpOverload) else "")
def test_reduction_schema_gives_the_generic_rule(target, args, kwargs):
    assert rule_source(target) == "generic"
    assert _all_strategies_match(target, Sample(args, kwargs)) > 0


def test_generic_reduction_never_splits_a_reduced_dim():
    for reduced, kept in ((1, 0), (0, 1)):
        ref = reference(aten.var.correction, Sample((rand(4, 8), [reduced]), {"correction": 1}))
        strategies = enumerate_strategies(ref[0], MeshSpec.preset("cpu", (2,)), flops=(0.0, 0.0))
        input_splits = {st.input_specs[0].placements[0] for st in strategies}
        assert Shard(reduced) not in input_splits and Shard(kept) in input_splits, [st.name for st in strategies]


def test_dtensor_candidates_pass_the_numeric_check_before_they_are_offered():
    # DTensor's native_group_norm strategy splits the batch, but the op's N argument is global:
    # the local op fails on a shard, so the admission check drops that candidate.
    target = aten.native_group_norm.default
    assert rule_source(target) == "dtensor"
    sample = Sample((rand(4, 8, 6), rand(8), rand(8), 4, 8, 6, 2, 1e-5))
    ref = reference(target, sample)
    strategies = enumerate_strategies(ref[0], MeshSpec.preset("cpu", (2,)), flops=(0.0, 0.0))
    assert [s.name for s in strategies] == ["R x R x R -> (R, R, R)"]
    # upsample's DTensor candidates (batch and channel splits) are exact and offered.
    assert rule_source(aten.upsample_nearest2d.default) in ("native", "dtensor")
    assert _all_strategies_match(aten.upsample_nearest2d.default, Sample((rand(4, 8, 3, 3), [6, 6]))) > 0


def test_order_native_then_generic_then_decomposition():
    assert rule_source(aten.add.Tensor) == "native"
    assert rule_source(aten.hardtanh.default) == "generic" and not needs_decomposition(aten.hardtanh.default)
    # glu has no rule of any kind, but PyTorch decomposes it: the tracer does that
    assert rule_for(aten.glu.default) is None and needs_decomposition(aten.glu.default)


def test_missing_rule_names_op_node_and_module():
    from autopar.strategies import OpInfo

    info = OpInfo.from_values(aten.trace.default, (rand(4, 4),), {}, torch.trace(rand(4, 4)))
    with pytest.raises(NoRuleError, match=r"aten.trace.default \(node 'sample'"):
        enumerate_strategies(info, MeshSpec.preset("cpu", (2,)))


def test_foreign_op_by_name_when_its_library_is_loaded():
    import transformers.integrations.moe  # noqa: F401 - registers transformers::grouped_mm_fallback

    target = torch.ops.transformers.grouped_mm_fallback.default
    entry = rule_for(target)
    assert entry is not None and rule_source(target) == "native"
    for sample in entry.samples():
        assert _all_strategies_match(target, sample, shapes=((2,), (4,), (2, 2))) > 0
