"""``autopar::chunked_batch_norm`` (per-rank batch statistics): the op is torch's batch norm per
chunk, the trace pass replaces exactly the batch-statistics batch norms, and a batch split runs
with no collective for the normalisation (one small sum forward, for the running statistics)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.layout.mesh import MeshSpec
from autopar.layout.placement import TensorSpec
from autopar.planner.orchestrate import trace_for_planning
from autopar.strategies import Sample, enumerate_strategies, get_kernel
from autopar.strategies.check import reference, run_spmd
from autopar.strategies.kernel_context import KernelContext
from autopar.tracer.batch_stats import chunked_batch_norm

from .test_sync_batch_norm import _Counting


class _CountingAsync(_Counting):
    """Counts the asynchronous sums apart (``counts["async"]``)."""

    def __init__(self, comm) -> None:
        super().__init__(comm)
        self.counts["async"] = 0

    def all_reduce_async(self, tensor, axes):
        self.counts["async"] += 1
        return self.comm.all_reduce_async(tensor, axes)


def _data(chunks: int = 4, batch: int = 8):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 4, 3, 3, generator=gen, dtype=torch.float64)
    size = batch // chunks
    for c in range(chunks):  # every chunk its own statistics
        x[c * size:(c + 1) * size] = (1 + c) * x[c * size:(c + 1) * size] + c
    weight = torch.rand(4, generator=gen, dtype=torch.float64) + 0.5
    bias = torch.rand(4, generator=gen, dtype=torch.float64)
    return x, weight, bias, torch.randn(x.shape, generator=gen, dtype=torch.float64)


def _per_chunk(x, weight, bias, chunks, momentum=0.1, updates=1):
    """torch's batch norm per chunk, and the documented running-statistics rule applied
    ``updates`` times from (0, 1)."""
    pieces = x.chunk(chunks)
    y = torch.cat([F.batch_norm(p, None, None, weight, bias, True, 0.0, 1e-5) for p in pieces])
    mean = torch.stack([p.mean((0, 2, 3)) for p in pieces]).mean(0)
    var = torch.stack([p.var((0, 2, 3)) for p in pieces]).mean(0)
    running_mean, running_var = torch.zeros_like(mean), torch.ones_like(var)
    for _ in range(updates):
        running_mean = (1 - momentum) * running_mean + momentum * mean
        running_var = (1 - momentum) * running_var + momentum * var
    return y, running_mean, running_var


def test_the_op_is_torch_batch_norm_per_chunk():
    x, weight, bias, grad_y = _data()
    want_y, want_mean, want_var = _per_chunk(x, weight, bias, 4)
    xs, ws = x.clone().requires_grad_(), weight.clone().requires_grad_()
    mean, var = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    y = chunked_batch_norm(xs, ws, bias, mean, var, 0.1, 1e-5, 4)
    torch.testing.assert_close(y, want_y)
    torch.testing.assert_close((mean, var), (want_mean, want_var))
    y.backward(grad_y)
    xr, wr = x.clone().requires_grad_(), weight.clone().requires_grad_()
    torch.cat([F.batch_norm(p, None, None, wr, bias, True, 0.0, 1e-5) for p in xr.chunk(4)]).backward(grad_y)
    torch.testing.assert_close((xs.grad, ws.grad), (xr.grad, wr.grad))
    with pytest.raises(ValueError, match="a batch of 8 cannot be cut into 3 equal chunks"):
        chunked_batch_norm(x, weight, bias, None, None, 0.1, 1e-5, 3)


@pytest.mark.parametrize("shape, spec", [((4,), "S0"), ((2, 2), "S0S1"), ((2, 2), "S1S0")], ids=str)
def test_batch_split_normalises_without_a_collective(shape, spec):
    x, weight, bias, grad_y = _data()
    want_y, want_mean, want_var = _per_chunk(x, weight, bias, 4)
    stats = (torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64))
    sample = Sample((x, weight, bias, *stats, 0.1, 1e-5, 4), no_grad=("running_mean", "running_var"))
    info, _ = reference(chunked_batch_norm, sample)
    in_spec = TensorSpec.parse(spec)
    # The per-channel tensors split (on their dim 0) on the axes that split the input's channels.
    per_channel = TensorSpec.parse("".join("S0" if spec[i:i + 2] == "S1" else "R" for i in range(0, len(spec), 2)))
    kernel = get_kernel("chunked_batch_norm_stats").fn

    def rank(comm):
        comm = _CountingAsync(comm)
        coord = tuple(comm.coordinate(a) for a in range(len(shape)))
        where = in_spec.local_slices(x.shape, shape, coord)
        ch = per_channel.local_slices((4,), shape, coord)
        local = x[where].clone().requires_grad_()
        w, b = weight[ch].clone().requires_grad_(), bias[ch].clone().requires_grad_()
        mean, var = stats[0][ch].clone(), stats[1][ch].clone()
        ctx = KernelContext(comm, info, (in_spec, per_channel, per_channel, per_channel, per_channel), (in_spec,),
                            shape)
        y = kernel(ctx, local, w, b, mean, var, 0.1, 1e-5, 4)
        comm.phase = "backward"
        before = mean.clone()
        y.backward(grad_y[where])  # where the running statistics' update lands
        once = (before, mean.clone(), var.clone())
        with torch.no_grad():  # no backward to come: applied at once
            kernel(ctx, local, w, b, mean, var, 0.1, 1e-5, 4)
        kernel(ctx, local, w, b, mean, var, 0.1, 1e-5, 4)  # a backward that never runs ...
        kernel(ctx, local, w, b, mean, var, 0.1, 1e-5, 4)  # ... is applied before the next update (pending)
        return where, ch, y.detach(), once, (mean, var), dict(comm.counts)

    for where, ch, y, once, thrice, counts in run_spmd(rank, shape).values():
        # No collective normalises; the running statistics' one sum per call goes asynchronously,
        # when its update is needed: the last call's (its backward never came) is not issued yet.
        assert counts == {"forward": 0, "backward": 0, "async": 3}, counts
        torch.testing.assert_close(y, want_y[where].detach())
        assert torch.equal(once[0], torch.zeros(len(once[0]), dtype=torch.float64))  # not in forward
        torch.testing.assert_close(once[1:], (want_mean[ch], want_var[ch]))
        _, mean3, var3 = _per_chunk(x, weight, bias, 4, updates=3)
        torch.testing.assert_close(thrice, (mean3[ch], var3[ch]))


def test_one_forwards_statistics_go_in_one_sum():
    """Two batch norms in one forward (the second normalising the first's output): their running
    statistics ride in ONE all-reduce, issued when backward starts, and both updates are applied
    by the time backward returns, equal to one device's."""
    x, weight, bias, grad_y = _data(chunks=2)
    stats = (torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64))
    info, _ = reference(chunked_batch_norm, Sample((x, weight, bias, *stats, 0.1, 1e-5, 2),
                                                   no_grad=("running_mean", "running_var")))
    in_spec, rep = TensorSpec.parse("S0"), TensorSpec.parse("R")
    kernel = get_kernel("chunked_batch_norm_stats").fn
    first_y, first_mean, first_var = _per_chunk(x, weight, bias, 2)
    _, second_mean, second_var = _per_chunk(first_y.detach(), weight, bias, 2)

    def rank(comm):
        comm = _CountingAsync(comm)
        where = in_spec.local_slices(x.shape, (2,), (comm.coordinate(0),))
        local = x[where].clone().requires_grad_()
        ctx = KernelContext(comm, info, (in_spec, rep, rep, rep, rep), (in_spec,), (2,))
        running = [(stats[0].clone(), stats[1].clone()) for _ in range(2)]
        y = kernel(ctx, local, weight, bias, *running[0], 0.1, 1e-5, 2)
        y = kernel(ctx, y, weight, bias, *running[1], 0.1, 1e-5, 2)
        in_forward = comm.counts["async"]
        y.backward(grad_y[where])
        return in_forward, comm.counts["async"], running

    for in_forward, after, running in run_spmd(rank, (2,)).values():
        assert (in_forward, after) == (0, 1)
        torch.testing.assert_close(running[0], (first_mean, first_var))
        torch.testing.assert_close(running[1], (second_mean, second_var))


def test_no_spatial_split_and_priced_as_one_small_sum():
    x, weight, bias, _ = _data()
    stats = (torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64))
    info, _ = reference(chunked_batch_norm, Sample((x, weight, bias, *stats, 0.1, 1e-5, 4)))
    strategies = enumerate_strategies(info, MeshSpec.preset("cpu", (4,)), flops=(0.0, 0.0))
    assert {str(s.input_specs[0]) for s in strategies} == {"R", "S0", "S1"}
    batch = next(s for s in strategies if str(s.input_specs[0]) == "S0")
    assert batch.kernel == "chunked_batch_norm_stats" and batch.kernel_bwd_comm_s == 0 and 0 < batch.forward_comm_s


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.train_bn, self.eval_bn, self.no_stats = nn.BatchNorm2d(3), nn.BatchNorm2d(3).eval(), nn.BatchNorm1d(
            3, track_running_stats=False)

    def forward(self, x):
        return self.no_stats(self.eval_bn(self.train_bn(x)).mean((2, 3))).sum()


def test_the_pass_replaces_the_batch_statistics_batch_norms_only():
    traced = trace_for_planning(_Net(), (torch.randn(8, 3, 4, 4),), precision="fp32", batch_norm_chunks=4)
    ops = [str(n.target) for n in traced.compute_nodes() if "batch_norm" in str(n.target)]
    assert ops == ["autopar.chunked_batch_norm.default", "aten.batch_norm.default",
                   "autopar.chunked_batch_norm.default"], ops
    assert traced.batch_norm_chunks == 4
    with pytest.raises(ValueError, match=r"module 'train_bn'.*batch of 6, which 4 ranks cannot share evenly"):
        trace_for_planning(_Net(), (torch.randn(6, 3, 4, 4),), precision="fp32", batch_norm_chunks=4)
