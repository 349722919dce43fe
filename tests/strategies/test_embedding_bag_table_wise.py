"""Table-wise ``_embedding_bag``: the whole table on ONE device of an axis, nothing on its peers.

The rule's table-wise strategies (table ``Shard(0)``, pooled output ``Shard(0)`` on an axis) are
checked by the generic numeric sweep with an even row split; here their kernel runs as the runtime
runs an *owned* table (``KernelContext.owners``): the owner holds every row, its peers a
zero-row table. Every sample of the rule -- sum, mean, max (ties across ranks included),
per-sample weights, offsets with and without ``include_last_offset``, padding index -- on (2,),
(3,) and (2, 2), every owner: forward outputs equal the op's on the whole table, the owner's
table gradient is the whole gradient, the peers' is empty, and the per-sample weights' partial
gradients sum to the whole one.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from autopar.layout.mesh import MeshSpec
from autopar.layout.placement import Replicate, Shard
from autopar.strategies import enumerate_strategies
from autopar.strategies._embedding_bag import KERNEL, _samples, table_wise_axes
from autopar.strategies.check import _replace_slots, _slot_values, reference, run_spmd
from autopar.strategies.kernel_context import KernelContext
from autopar.strategies.registry import get_kernel

BAG = torch.ops.aten._embedding_bag.default
SAMPLES = [s for s in _samples() if s.label != "scale-grad-by-freq"]


def _table_wise(info, mesh_shape):
    strategies = enumerate_strategies(info, MeshSpec.preset("cpu", mesh_shape), flops=(0.0, 0.0))
    return [s for s in strategies if s.kernel == KERNEL
            and table_wise_axes(s.input_specs, s.output_specs, mesh_shape)]


def _run_owned(info, ref, strategy, mesh_shape, owners):
    """Each rank's (outputs, weight grad, psw grad) with the table whole on ``owners``' coordinate."""
    tw = table_wise_axes(strategy.input_specs, strategy.output_specs, mesh_shape)
    owned = tuple((0, axis, owners[axis]) for axis in tw)
    values = _slot_values(ref.bound)
    weight_spec = strategy.input_specs[0]
    for axis in tw:
        weight_spec = weight_spec.with_placement(axis, Replicate())

    def rank(comm):
        coord = comm.coord
        leaves = []
        for k, (value, spec) in enumerate(zip(values, strategy.input_specs)):
            if k == 0:
                piece = value.detach()[weight_spec.local_slices(value.shape, mesh_shape, coord)]
                if any(coord[axis] != owners[axis] for axis in tw):
                    piece = piece[:0]  # a peer of the owner: no rows
            else:
                piece = value.detach()[spec.local_slices(value.shape, mesh_shape, coord)]
            leaves.append(piece.clone().requires_grad_(value.requires_grad))
        ctx = KernelContext(comm, info, strategy.input_specs, strategy.output_specs, mesh_shape, owners=owned)
        outs = get_kernel(KERNEL).fn(ctx, **_replace_slots(ref.bound, leaves))
        grad = ref.out_grads[0]
        out_spec = strategy.output_specs[0]
        outs[0].backward(grad[out_spec.local_slices(grad.shape, mesh_shape, coord)])
        return [o.detach() for o in outs], [t.grad for t in leaves]

    return run_spmd(rank, mesh_shape), tw, weight_spec


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)])
@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: s.label)
def test_owned_table_matches_the_whole_op(sample, mesh_shape):
    info, ref = reference(BAG, sample)
    strategies = _table_wise(info, mesh_shape)
    assert strategies, f"no table-wise strategy for {sample.label} on {mesh_shape}"
    checked = 0
    for strategy in strategies:
        tw = table_wise_axes(strategy.input_specs, strategy.output_specs, mesh_shape)
        for owner_coords in itertools.product(*(range(mesh_shape[a]) if a in tw else (0,)
                                                for a in range(len(mesh_shape)))):
            results, tw, weight_spec = _run_owned(info, ref, strategy, mesh_shape, owner_coords)
            _check_ranks(results, ref, strategy, mesh_shape, owner_coords, tw, weight_spec)
            checked += 1
    assert checked
    if mesh_shape == (2, 2):  # table-row-wise (table-wise x row-wise) is among them
        assert any(s.output_specs[0].has_partial() for s in strategies)


def _group_sum(results, k, coord, axes, mesh_shape):
    """Slot ``k``'s gradient summed over the ranks differing from ``coord`` on ``axes`` (partial)."""
    total = None
    for other, (_, grads) in results.items():
        if all(other[a] == coord[a] for a in range(len(mesh_shape)) if a not in axes):
            total = grads[k] if total is None else total + grads[k]
    return total


def _check_ranks(results, ref, strategy, mesh_shape, owner_coords, tw, weight_spec):
    out_spec = strategy.output_specs[0]
    for coord, (outs, grads) in results.items():
        want = ref.outputs[0][out_spec.local_slices(ref.outputs[0].shape, mesh_shape, coord)]
        # Row-wise on another axis (TorchRec's table-row-wise): a partial sum there.
        got = sum(o[0] for c, (o, _) in results.items()
                  if all(c[a] == coord[a] for a in range(len(mesh_shape)) if a not in out_spec.partial_axes()))
        torch.testing.assert_close(got, want, msg=f"{strategy.name} owner {owner_coords} at {coord}")
        if any(coord[a] != owner_coords[a] for a in tw):
            assert grads[0].numel() == 0  # a peer of the owner holds no rows and gets no gradient
            continue
        # A data-parallel axis leaves the owner's gradient partial there (all-reduced by the runtime).
        wgrad = _group_sum(results, 0, coord, strategy.grad_partial_axes[0], mesh_shape)
        full = ref.input_grads[0][weight_spec.local_slices(ref.input_grads[0].shape, mesh_shape, coord)]
        torch.testing.assert_close(wgrad, full, msg=f"owner's table gradient, {strategy.name}")
    if len(ref.input_grads) > 3 and ref.input_grads[3] is not None:
        origin = (0,) * len(mesh_shape)
        got = _group_sum(results, 3, origin, strategy.grad_partial_axes[3], mesh_shape)
        torch.testing.assert_close(got, ref.input_grads[3], msg=f"per-sample weights' gradient, {strategy.name}")


def test_table_wise_is_offered_only_with_the_batch_order_it_needs():
    info, _ = reference(BAG, SAMPLES[0])
    for s in _table_wise(info, (2, 2)):
        tw = table_wise_axes(s.input_specs, s.output_specs, (2, 2))
        others = [a for a, p in enumerate(s.output_specs[0].placements) if p == Shard(0) and a not in tw]
        assert not others or max(others) < min(tw), s.name
    names = {s.name for s in _table_wise(info, (2, 2))}
    assert len(names) >= 2
