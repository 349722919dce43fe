"""Every candidate strategy of every registered rule, forward and backward, against the unsharded op."""

import pytest

from autopar.layout.mesh import MeshSpec
from autopar.strategies import enumerate_strategies, get_rule, registered_targets
from autopar.strategies.check import StrategyMismatch, check_strategy, reference

MESHES = [(4,), (2, 2)]


@pytest.mark.parametrize("target", registered_targets(), ids=str)
def test_every_strategy_matches_the_unsharded_op(target):
    samples = get_rule(target).samples()
    assert samples, f"rule for {target} has no samples"
    failures, num_checked = [], 0
    for sample in samples:
        ref = reference(target, sample)
        for shape in MESHES:
            strategies = enumerate_strategies(ref[0], MeshSpec.preset("cpu", shape), flops=(0.0, 0.0))
            # A rule must offer more than replication on a mesh its sample divides (factory ops
            # have no tensor input: their output counts), unless it declares replication only.
            sharded = [st for st in strategies
                       if not all(s is None or s.is_replicated() for s in st.input_specs + st.output_specs)]
            if get_rule(target).replicate_only:
                assert not sharded, f"{target} declares replicate_only but offers {sharded[0].name}"
            else:
                assert sharded, f"{target} sample {sample.label!r} on {shape}: only replicated strategies"
            for strategy in strategies:
                num_checked += 1
                try:
                    check_strategy(target, sample, strategy, shape, ref=ref)
                except StrategyMismatch as exc:
                    failures.append(str(exc))
    assert not failures, f"{len(failures)}/{num_checked} strategies wrong:\n" + "\n".join(failures)


@pytest.mark.parametrize("name", ["mm", "cross_entropy_loss", "embedding"])
def test_three_axis_mesh(name):
    import torch

    target = {"mm": torch.ops.aten.mm.default, "cross_entropy_loss": torch.ops.aten.cross_entropy_loss.default,
              "embedding": torch.ops.aten.embedding.default}[name]
    sample = get_rule(target).samples()[0]
    ref = reference(target, sample)
    strategies = enumerate_strategies(ref[0], MeshSpec.preset("cpu", (2, 2, 2)), flops=(0.0, 0.0))
    assert len(strategies) > 8
    for strategy in strategies:
        check_strategy(target, sample, strategy, (2, 2, 2), ref=ref)
