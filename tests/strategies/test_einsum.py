"""einsum: equation parsing (ellipsis, implicit output), the options per label kind, a traced einsum."""

import pytest
import torch
from torch import nn

from autopar.layout.mesh import MeshSpec
from autopar.layout.placement import Partial, Replicate, Shard, TensorSpec
from autopar.strategies import OpInfo, Sample, enumerate_strategies, estimate_flops, get_rule, strategies_for
from autopar.strategies._einsum import parse_einsum
from autopar.strategies.check import check_strategy, reference
from autopar.strategies.expand import axis_options
from autopar.strategies.samples import rand
from autopar.tracer import trace

aten = torch.ops.aten
EINSUM = aten.einsum.default
R, P = Replicate(), Partial()


# ------------------------------------------------------------------------------- parsing
def test_parse_explicit():
    spec = parse_einsum("ij, jk -> ik", [2, 2])
    assert spec.operands == ("ij", "jk") and spec.output == "ik"


def test_parse_implicit_output_is_sorted_singletons():
    assert parse_einsum("ij,jk", [2, 2]).output == "ik"
    assert parse_einsum("ba", [2]).output == "ab"  # implicit output transposes
    assert parse_einsum("ii", [2]).output == ""  # a trace
    assert parse_einsum("bB,Bc", [2, 2]).output == "bc"


def test_parse_ellipsis_right_aligned():
    spec = parse_einsum("...ij,...jk->...ik", [4, 2])
    e0, e1 = spec.operands[0][:2]
    assert spec.operands[1] == "jk"  # no ellipsis dims
    assert spec.output == e0 + e1 + "ik"
    spec = parse_einsum("...ij,...jk->...ik", [3, 4])
    assert spec.operands[0][0] == spec.operands[1][1]  # the shorter ellipsis holds the trailing dims
    implicit = parse_einsum("b...d,de", [4, 2])
    assert implicit.output == implicit.operands[0][1:3] + "be"  # ellipsis first, then sorted letters


@pytest.mark.parametrize("equation, shapes", [
    ("ij,jk", [(2, 3), (3, 5)]),
    ("Ab,bc", [(2, 3), (3, 5)]),
    ("zyx", [(2, 3, 5)]),
    ("b...d,de", [(2, 3, 5, 7), (7, 11)]),
    ("...ij,...jk", [(2, 1, 3, 5), (7, 5, 11)]),
    ("i...->...", [(2, 3, 5)]),
    ("bii,bj->bij", [(2, 3, 3), (2, 5)]),
])
def test_parse_agrees_with_torch_output_shape(equation, shapes):
    tensors = [torch.zeros(s) for s in shapes]
    spec = parse_einsum(equation, [len(s) for s in shapes])
    sizes = {}
    for labels, shape in zip(spec.operands, shapes):
        for c, n in zip(labels, shape):
            sizes[c] = max(sizes.get(c, 1), n)
    assert tuple(sizes[c] for c in spec.output) == tuple(torch.einsum(equation, *tensors).shape)


def test_parse_rejects_a_mismatched_operand():
    with pytest.raises(ValueError, match="does not fit"):
        parse_einsum("ij,jk->ik", [3, 2])
    with pytest.raises(ValueError, match="names 2 operands"):
        parse_einsum("ij,jk->ik", [2])


# ------------------------------------------------------------------------------- options
def _options(equation, *tensors):
    out = torch.einsum(equation, *tensors)
    info = OpInfo.from_values(EINSUM, (equation, list(tensors)), {}, out)
    return {(o.inputs, o.outputs[0]) for o in axis_options(get_rule(EINSUM), info)}


def test_contracted_label_gives_partial():
    opts = _options("ij,jk->ik", rand(4, 8), rand(8, 4))
    assert ((Shard(1), Shard(0)), P) in opts  # j contracted
    assert ((Shard(0), R), Shard(0)) in opts  # i free
    assert ((R, Shard(1)), Shard(1)) in opts  # k free
    assert ((P, R), P) in opts and ((R, P), P) in opts  # multilinear pass-through


def test_batch_label_splits_every_operand():
    opts = _options("bhqd,bhkd->bhqk", rand(4, 4, 8, 4), rand(4, 4, 4, 4))
    assert ((Shard(0), Shard(0)), Shard(0)) in opts
    assert ((Shard(1), Shard(1)), Shard(1)) in opts
    assert ((Shard(3), Shard(3)), P) in opts


def test_summed_out_label_of_one_operand_gives_partial():
    assert ((Shard(1),), P) in _options("ij->i", rand(4, 8))


def test_broadcast_ellipsis_dim_stays_replicated():
    opts = _options("...ij,...jk->...ik", rand(4, 4, 8), rand(1, 8, 4))
    assert ((Shard(0), R), Shard(0)) in opts  # the size-1 dim is read whole


def test_diagonal_label_is_never_split():
    opts = _options("bii,bj->bij", rand(4, 4, 4), rand(4, 8))
    for inputs, _ in opts:
        assert not (isinstance(inputs[0], Shard) and inputs[0].dim in (1, 2))
    assert ((R, Shard(1)), Shard(2)) in opts and ((Shard(0), Shard(0)), Shard(0)) in opts


def test_einsum_counts_flops():
    entry = get_rule(EINSUM)
    assert entry.has_flops
    a, b = rand(4, 8), rand(8, 16)
    info = OpInfo.from_values(EINSUM, ("ij,jk->ik", [a, b]), {}, torch.einsum("ij,jk->ik", a, b))
    fwd, bwd = estimate_flops(info)
    assert fwd == 2 * 4 * 8 * 16 and bwd == 2 * fwd


def test_three_axis_mesh_attention():
    sample = Sample(("bhqd,bhkd->bhqk", [rand(4, 4, 8, 4), rand(4, 4, 4, 4)]))
    ref = reference(EINSUM, sample)
    strategies = enumerate_strategies(ref[0], MeshSpec.preset("cpu", (2, 2, 2)), flops=(0.0, 0.0))
    names = {s.name for s in strategies}
    assert "S0S1S3 x S0S1S3 -> S0S1P" in names  # batch, heads, contraction on three axes
    # Every axis splitting work: where major/minor order across operands could go wrong.
    three = [s for s in strategies if len(s.work_split_axes) == 3]
    assert len(three) > 20
    for strategy in three:
        check_strategy(EINSUM, sample, strategy, (2, 2, 2), ref=ref)


# ------------------------------------------------------------------------------ traced
class _Attention(nn.Module):
    def forward(self, q, k):
        return torch.einsum("bhqd,bhkd->bhqk", q, k).softmax(-1)


def test_traced_einsum_is_kept_whole_and_planned():
    # Large enough that the roofline, not the per-kernel floor, decides the compute time.
    q, k = torch.randn(8, 8, 256, 64), torch.randn(8, 8, 256, 64)
    traced = trace(_Attention(), (q, k))
    nodes = [n for n in traced.compute_nodes() if n.target is EINSUM]
    assert len(nodes) == 1
    mesh = MeshSpec.preset("cpu", (2, 2))
    strategies = {s.name: s for s in strategies_for(nodes[0], mesh)}
    full = strategies["RR x RR -> RR"].compute_s
    both = strategies["S0S1 x S0S1 -> S0S1"]  # batch over axis 0, heads over axis 1
    assert both.work_split_axes == (0, 1) and both.comm_s == 0.0
    assert both.compute_s == pytest.approx(full / 4, rel=0.05)
    contracted = strategies["S3R x S3R -> PR"]  # the head dim contracted over axis 0
    assert contracted.output_spec == TensorSpec((P, R))
    assert contracted.work_split_axes == (0,) and contracted.compute_s < full
    # Replicated inputs of a split computation pay the all-reduce of their partial gradient.
    assert strategies["S2R x RR -> S2R"].comm_s > 0.0  # q split, k read whole
