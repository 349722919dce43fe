"""``sync_batch_norm``: one collective forward and one backward (as torch's ``SyncBatchNorm``),
statistics that stay exact far from a zero mean, and the one-device gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autopar.layout.placement import TensorSpec
from autopar.strategies import Sample, get_kernel
from autopar.strategies.check import reference, run_spmd
from autopar.strategies.kernel_context import KernelContext

aten = torch.ops.aten


class _Counting:
    """A rank's ``Comm`` that counts the all-reduces issued while ``phase`` is set."""

    def __init__(self, comm) -> None:
        self.comm, self.phase, self.counts = comm, "forward", {"forward": 0, "backward": 0}

    def all_reduce(self, tensor, axes, op="sum"):
        self.counts[self.phase] += 1
        return self.comm.all_reduce(tensor, axes, op)

    def __getattr__(self, name):
        return getattr(self.comm, name)


@pytest.mark.parametrize("shape, spec", [((4,), "S0"), ((2, 2), "S0S2")], ids=str)
def test_one_collective_each_way_and_stable_statistics(shape, spec):
    # float32 values at 1000 +- 0.01: a sum of squares less the squared sum (E[x^2] - E[x]^2)
    # loses the variance entirely (it comes out negative here); the gathered per-rank moments
    # keep it. ATen's own float32 batch norm is 3e-3 off the float64 one on these values.
    gen = torch.Generator().manual_seed(0)
    x = 1000.0 + 0.01 * torch.randn(8, 4, 4, 4, generator=gen)
    x[4:] += 0.02  # the halves differ: local statistics would not do
    weight, bias = torch.rand(4, generator=gen) + 0.5, torch.rand(4, generator=gen)
    grad_y = torch.randn(x.shape, generator=gen)
    stats = (torch.zeros(4), torch.ones(4))
    sample = Sample((x, weight, bias, *stats, True, 0.1, 1e-5, False), no_grad=("running_mean", "running_var"))
    info, _ = reference(aten.batch_norm.default, sample)
    in_spec, rep = TensorSpec.parse(spec), TensorSpec.replicated(len(shape))
    kernel = get_kernel("sync_batch_norm").fn

    want_x = x.double().requires_grad_()
    want_w, want_b = weight.double().requires_grad_(), bias.double().requires_grad_()
    want_y = F.batch_norm(want_x, None, None, want_w, want_b, True, 0.1, 1e-5)
    want_y.backward(grad_y.double())

    def rank(comm):
        comm = _Counting(comm)
        coord = tuple(comm.coordinate(a) for a in range(len(shape)))
        where = in_spec.local_slices(x.shape, shape, coord)
        local = x[where].clone().requires_grad_()
        w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
        ctx = KernelContext(comm, info, (in_spec, rep, rep, rep, rep), (in_spec,), shape)
        y = kernel(ctx, local, w, b, stats[0].clone(), stats[1].clone(), True, 0.1, 1e-5, False)
        comm.phase = "backward"
        y.backward(grad_y[where])
        return where, y.detach(), local.grad, w.grad, b.grad, comm.counts

    results = run_spmd(rank, shape).values()
    for where, y, grad_x, *_, counts in results:
        assert counts == {"forward": 1, "backward": 1}
        torch.testing.assert_close(y.double(), want_y.detach()[where], rtol=0, atol=1e-2)
        torch.testing.assert_close(grad_x.double(), want_x.grad[where], rtol=0, atol=1e-2 * want_x.grad.abs().max())
    # The weight and bias gradients are each rank's partial sums (all-reduced by the runtime);
    # x's float32 rounding at 1000 puts ATen's own weight gradient 1e-3 of its largest off here.
    grad_w = sum(r[3] for r in results).double()
    grad_b = sum(r[4] for r in results).double()
    torch.testing.assert_close(grad_w, want_w.grad, rtol=0, atol=3e-3 * want_w.grad.abs().max())
    torch.testing.assert_close(grad_b, want_b.grad, rtol=1e-4, atol=1e-4)
