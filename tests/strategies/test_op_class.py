"""Each op is priced at its class's measured rate on a calibrated mesh (``combine.op_class``),
at the size of its local shard, and at the roofline on a preset (unchanged)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from autopar.layout.machine import ComputeProfile, MachineProfile, RateTable
from autopar.layout.mesh import MeshSpec
from autopar.strategies import strategies_for
from autopar.strategies.combine import op_class
from autopar.tracer import trace

aten = torch.ops.aten


@pytest.mark.parametrize("target, expected", [
    (aten.mm.default, "matmul"), (aten.addmm.default, "matmul"), (aten.bmm.default, "matmul"),
    (aten.linear.default, "matmul"), (aten.scaled_dot_product_attention.default, "attention"),
    (aten.native_layer_norm.default, "norm"), (aten._softmax.default, "norm"), (aten.add.Tensor, "elementwise"),
    (aten.gelu.default, "elementwise"), (aten.convolution.default, "conv"), (aten.conv2d.default, "conv"),
    (aten.conv_transpose2d.input, "conv"), (aten.max_pool2d.default, "pool"),
    (aten.adaptive_avg_pool2d.default, "pool"), (aten.batch_norm.default, "batch_norm"),
    (aten._native_batch_norm_legit_functional.default, "batch_norm"), (aten.group_norm.default, "norm"),
    (aten.sum.dim_IntList, "other"),
])
def test_op_classes(target, expected):
    assert op_class(target) == expected


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(256, 256, bias=False)

    def forward(self, x):
        return torch.relu(self.fc(x))


def _calibrated(mesh: MeshSpec) -> MeshSpec:
    # A matmul twice as fast on a quarter of the work (2^23 FLOPs) as on all of it (2^25): the
    # small-product efficiency a roofline misses, here inverted so that both ends show.
    compute = ComputeProfile((("matmul", "fp32", RateTable((2.0**23, 2.0**25), (2e9, 1e9))),
                              ("elementwise", "fp32", RateTable((1e3,), (1e9,)))))
    return replace(mesh, machine=MachineProfile(compute, (), mesh.shape, mesh.axis_names))


def test_a_strategy_is_priced_at_the_rate_of_its_local_shard():
    traced = trace(_Mlp(), (torch.randn(128, 256),))
    (mm,) = [n for n in traced.compute_nodes() if op_class(n.target) == "matmul"]
    (relu,) = [n for n in traced.compute_nodes() if op_class(n.target) == "elementwise"]
    preset = MeshSpec.preset("cpu", (4,))
    mesh = _calibrated(preset)
    plain = {s.name: s for s in strategies_for(mm, preset)}
    priced = {s.name: s for s in strategies_for(mm, mesh)}
    whole = 2.0 * 128 * 256 * 256  # forward FLOPs of the whole product (2^24); backward twice that
    replicated = next(s for s in priced.values() if not s.work_split_axes)
    split = next(s for s in priced.values() if s.work_split_axes == (0,))
    # Forward 2^24 FLOPs (halfway in log size: sqrt(2) GFLOP/s), backward 2^25 (1 GFLOP/s).
    assert replicated.forward_compute_s == pytest.approx(whole / 2 ** 0.5 / 1e9)
    assert replicated.compute_s == pytest.approx(whole / 2 ** 0.5 / 1e9 + 2 * whole / 1e9)
    # A quarter each: 2^22 (beyond the small end: 2 GFLOP/s) forward, 2^23 backward.
    assert split.compute_s == pytest.approx(whole / 4 / 2e9 + 2 * whole / 4 / 2e9)
    # The preset prices the same strategy by its peak (compute-bound at this size), as before.
    assert plain[split.name].forward_compute_s == pytest.approx(whole / 4 / preset.peak_flops)
    (relu_strategy, *_) = strategies_for(relu, mesh)
    moved = 2 * 128 * 256 * 4 / (4 if relu_strategy.work_split_axes else 1)
    assert relu_strategy.forward_compute_s == pytest.approx(moved / 1e9)


class _Tanh(nn.Module):
    def forward(self, x):
        return torch.tanh(x) + x


def test_a_math_function_is_priced_at_its_measured_factor_over_the_elementwise_rate():
    # tanh computes far more per byte than add, the class's calibrated kernel; its backward (a
    # multiply-add on the saved output) does not: calibration measures both apart.
    traced = trace(_Tanh(), (torch.randn(128, 256, requires_grad=True),))
    nodes = {str(n.target): n for n in traced.compute_nodes()}
    tanh, add = nodes["aten.tanh.default"], nodes["aten.add.Tensor"]
    plain = _calibrated(MeshSpec.preset("cpu", (1,)))
    mesh = replace(plain, machine=replace(plain.machine, pointwise=(("tanh", 16.0, 1.5),)))
    (before,), (after,) = strategies_for(tanh, plain), strategies_for(tanh, mesh)
    assert after.forward_compute_s == pytest.approx(16 * before.forward_compute_s)
    backward = before.compute_s - before.forward_compute_s
    assert after.compute_s - after.forward_compute_s == pytest.approx(1.5 * backward)
    assert strategies_for(add, mesh)[0].compute_s == strategies_for(add, plain)[0].compute_s  # not measured: 1


class _ConvPool(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1, bias=False)

    def forward(self, x):
        return nn.functional.max_pool2d(self.conv(x), 3, 2, 1)


def test_convolution_and_pool_backward_are_priced_at_their_own_rates():
    traced = trace(_ConvPool(), (torch.randn(4, 8, 16, 16),))
    (conv,) = [n for n in traced.compute_nodes() if op_class(n.target) == "conv"]
    (pool,) = [n for n in traced.compute_nodes() if op_class(n.target) == "pool"]
    preset = MeshSpec.preset("cpu", (1,))
    compute = ComputeProfile((("conv", "fp32", RateTable((1e3,), (4e9,))),
                              ("conv_backward", "fp32", RateTable((1e3,), (1e9,))),
                              ("pool", "fp32", RateTable((1e3,), (1e8,))),
                              ("pool_backward", "fp32", RateTable((1e3,), (2e9,)))))
    mesh = replace(preset, machine=MachineProfile(compute, (), (1,), preset.axis_names))
    (c,) = strategies_for(conv, mesh)
    fwd_flops = 2.0 * 4 * 8 * 16 * 16 * 8 * 9
    assert c.forward_compute_s == pytest.approx(fwd_flops / 4e9)
    assert c.compute_s - c.forward_compute_s == pytest.approx(2 * fwd_flops / 1e9)  # input and weight gradients
    (p,) = strategies_for(pool, mesh)
    moved = (4 * 8 * 16 * 16 + 4 * 8 * 8 * 8) * 4
    assert p.forward_compute_s == pytest.approx(moved / 1e8)
    assert p.compute_s - p.forward_compute_s == pytest.approx(2 * moved / 2e9)
    # Without a backward table the backward takes the forward's rate, as every other class does.
    forward_only = replace(mesh, machine=MachineProfile(ComputeProfile(compute.tables[:1]), (), (1,),
                                                        preset.axis_names))
    (c,) = strategies_for(conv, forward_only)
    assert c.compute_s - c.forward_compute_s == pytest.approx(2 * fwd_flops / 4e9)


def test_batch_norm_backward_is_priced_at_its_own_rate():
    # A training batch norm's backward (one pass over saved statistics) runs faster per byte than
    # its forward's two: calibration measures it apart (``batch_norm_backward``).
    traced = trace(nn.BatchNorm2d(8).train(), (torch.randn(4, 8, 16, 16),))
    (bn,) = [n for n in traced.compute_nodes() if op_class(n.target) == "batch_norm"]
    preset = MeshSpec.preset("cpu", (1,))
    compute = ComputeProfile((("batch_norm", "fp32", RateTable((1e3,), (1e8,))),
                              ("batch_norm_backward", "fp32", RateTable((1e3,), (4e8,)))))
    mesh = replace(preset, machine=MachineProfile(compute, (), (1,), preset.axis_names))
    (s,) = strategies_for(bn, mesh)
    moved = s.forward_compute_s * 1e8  # the forward's bytes, at the forward's rate
    assert moved > 2 * 4 * 8 * 16 * 16 * 4  # at least the input read and the output written
    assert s.compute_s - s.forward_compute_s == pytest.approx(2 * moved / 4e8)
    forward_only = replace(mesh, machine=MachineProfile(ComputeProfile(compute.tables[:1]), (), (1,),
                                                        preset.axis_names))
    (s,) = strategies_for(bn, forward_only)
    assert s.compute_s - s.forward_compute_s == pytest.approx(2 * moved / 1e8)


class _Views(nn.Module):
    def forward(self, x):
        y = x.view(64, 128).transpose(0, 1)  # views both ways: headers only
        a, b = y.split(64, dim=0)  # a view forward, a concatenation backward
        return (a * 2 + b).sum()


def test_a_view_moves_no_byte_and_a_split_pays_its_backward_concatenation():
    from autopar.layout.cost import KERNEL_FLOOR_S

    traced = trace(_Views(), (torch.randn(128, 64, requires_grad=True),))
    mesh = MeshSpec.preset("cpu", (1,))
    by_op = {str(n.target): strategies_for(n, mesh)[0] for n in traced.compute_nodes()}
    for view in ("aten.view.default", "aten.transpose.int"):
        s = by_op[view]  # the kernel floor forward and backward, however big the tensor
        assert s.forward_compute_s == KERNEL_FLOOR_S and s.compute_s == pytest.approx(2 * KERNEL_FLOOR_S)
    split = by_op["aten.split.Tensor"]
    assert split.forward_compute_s == KERNEL_FLOOR_S
    # its backward writes the input's gradient from the pieces': twice the bytes in and out
    assert split.compute_s - split.forward_compute_s == pytest.approx(2 * 2 * 128 * 64 * 4 / mesh.mem_bandwidth)


class _Sums(nn.Module):
    def forward(self, x, y, bias):
        h = x + y  # same shapes: autograd hands the gradient on to both
        h = h + bias  # bias broadcast: its gradient is a sum over the rows
        h = h - y  # the subtrahend's gradient is negated
        h = h * 0.5  # one tensor scaled by a number
        return (h * x).sum()  # a product of two tensors: a kernel per input


def test_a_sums_backward_moves_only_what_autograd_computes():
    from autopar.layout.cost import KERNEL_FLOOR_S

    traced = trace(_Sums(), (torch.randn(64, 128, requires_grad=True), torch.randn(64, 128, requires_grad=True),
                             torch.randn(128, requires_grad=True)))
    mesh = MeshSpec.preset("cpu", (1,))
    full, row = 64 * 128 * 4, 128 * 4
    ops = [n for n in traced.compute_nodes() if str(n.target) in ("aten.add.Tensor", "aten.sub.Tensor",
                                                                     "aten.mul.Tensor")]
    backward = [strategies_for(n, mesh)[0] for n in ops]
    backward = [s.compute_s - s.forward_compute_s for s in backward]
    bw = mesh.mem_bandwidth
    assert [str(n.target) for n in ops] == ["aten.add.Tensor", "aten.add.Tensor", "aten.sub.Tensor",
                                            "aten.mul.Tensor", "aten.mul.Tensor"]
    assert backward[0] == pytest.approx(KERNEL_FLOOR_S)  # x + y: no byte
    assert backward[1] == pytest.approx(max((full + row) / bw, KERNEL_FLOOR_S))  # the bias's sum
    assert backward[2] == pytest.approx(max(2 * full / bw, KERNEL_FLOOR_S))  # -y: one pass
    assert backward[3] == pytest.approx(max(2 * full / bw, KERNEL_FLOOR_S))  # * 0.5: one pass
    assert backward[4] == pytest.approx(max(2 * 3 * full / bw, KERNEL_FLOOR_S))  # h * x: twice the forward
