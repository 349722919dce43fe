"""Problem builder: ops that update model state are never offered for recompute."""

from autopar import zoo
from autopar.planner.builder import build_problem, mutates_state
from autopar.solver.blocks import block_of
from autopar.layout.mesh import MeshSpec
from autopar.tracer import profile, trace


def _built(name: str):
    model, inputs = zoo.build(name, tiny=True)
    traced = trace(model, inputs)
    return traced, build_problem(traced, profile(traced), MeshSpec.preset("cpu", (2,)), budget_bytes=10**7)


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
