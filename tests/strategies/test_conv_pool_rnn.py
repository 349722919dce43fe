"""Convolution, pooling, normalisation, recurrent and resampling layers as users write them:
every op they trace to has a rule and offers a split; the running statistics that instance and
batch norm update in place end up as on one device under every strategy; the channel splits
that depend on groups appear exactly where they are exact."""

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.layout.mesh import MeshSpec
from autopar.strategies import KernelContext, Sample, enumerate_strategies, get_kernel, get_rule, strategies_for
from autopar.strategies.check import reference, run_spmd
from autopar.strategies.registry import bind, call_op, local_arguments
from autopar.strategies.samples import rand
from autopar.tracer import trace

aten = torch.ops.aten
OUR_FAMILIES = {"_conv", "_pool", "_norm", "_rnn", "_resample"}


class Call(nn.Module):
    """A functional call as a module (for the ops without an ``nn`` module of their own)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _x(*shape):
    return torch.randn(*shape)


def _eval(module):
    return module.eval()


MODULES = {
    "Conv3d": lambda: (nn.Conv3d(4, 8, 3), (_x(4, 4, 5, 5, 5),)),
    "Conv1d-same": lambda: (nn.Conv1d(4, 8, 3, padding="same"), (_x(4, 4, 6),)),
    "Conv2d-same": lambda: (nn.Conv2d(4, 8, 3, padding="same"), (_x(4, 4, 6, 6),)),
    "Conv3d-same": lambda: (nn.Conv3d(4, 8, 2, padding="same"), (_x(4, 4, 4, 4, 4),)),
    "Conv2d-depthwise": lambda: (nn.Conv2d(8, 8, 3, groups=8), (_x(4, 8, 6, 6),)),
    "ConvTranspose1d": lambda: (nn.ConvTranspose1d(4, 8, 3, stride=2), (_x(4, 4, 6),)),
    "ConvTranspose2d": lambda: (nn.ConvTranspose2d(4, 8, 3, stride=2, output_padding=1), (_x(4, 4, 5, 5),)),
    "ConvTranspose3d": lambda: (nn.ConvTranspose3d(4, 8, 2, bias=False), (_x(4, 4, 3, 3, 3),)),
    "MaxPool1d": lambda: (nn.MaxPool1d(2), (_x(4, 4, 8),)),
    "MaxPool2d-indices": lambda: (nn.MaxPool2d(2, return_indices=True), (_x(4, 4, 6, 6),)),
    "MaxPool3d": lambda: (nn.MaxPool3d(2, stride=1, padding=1), (_x(4, 4, 4, 4, 4),)),
    "AvgPool1d": lambda: (nn.AvgPool1d(3, stride=2, padding=1), (_x(4, 4, 8),)),
    "AvgPool3d": lambda: (nn.AvgPool3d(2), (_x(4, 4, 4, 4, 4),)),
    "AdaptiveAvgPool1d": lambda: (nn.AdaptiveAvgPool1d(3), (_x(4, 4, 8),)),
    "AdaptiveAvgPool2d": lambda: (nn.AdaptiveAvgPool2d((2, 3)), (_x(4, 4, 6, 6),)),
    "AdaptiveAvgPool3d": lambda: (nn.AdaptiveAvgPool3d(2), (_x(4, 4, 4, 4, 4),)),
    "AdaptiveMaxPool1d": lambda: (nn.AdaptiveMaxPool1d(3), (_x(4, 4, 8),)),
    "AdaptiveMaxPool2d-indices": lambda: (nn.AdaptiveMaxPool2d(3, return_indices=True), (_x(4, 4, 8, 8),)),
    "AdaptiveMaxPool3d": lambda: (nn.AdaptiveMaxPool3d(2), (_x(4, 4, 4, 4, 4),)),
    "LPPool1d": lambda: (nn.LPPool1d(2, 2), (_x(4, 4, 8),)),
    "LPPool2d": lambda: (nn.LPPool2d(2, 2), (_x(4, 4, 8, 8),)),
    "GroupNorm": lambda: (nn.GroupNorm(2, 8), (_x(4, 8, 4, 4),)),
    "GroupNorm-per-channel": lambda: (nn.GroupNorm(8, 8), (_x(4, 8, 4),)),
    "InstanceNorm1d": lambda: (nn.InstanceNorm1d(8), (_x(4, 8, 6),)),
    "InstanceNorm2d-affine": lambda: (nn.InstanceNorm2d(8, affine=True), (_x(4, 8, 4, 4),)),
    "InstanceNorm2d-running-stats": lambda: (nn.InstanceNorm2d(8, affine=True, track_running_stats=True),
                                             (_x(4, 8, 4, 4),)),
    "InstanceNorm1d-running-stats-eval": lambda: (_eval(nn.InstanceNorm1d(8, track_running_stats=True)),
                                                  (_x(4, 8, 6),)),
    "LocalResponseNorm": lambda: (nn.LocalResponseNorm(2), (_x(4, 8, 4, 4),)),
    "LSTM": lambda: (nn.LSTM(4, 8, 2, batch_first=True, bidirectional=True), (_x(4, 3, 4),)),
    "LSTM-proj": lambda: (nn.LSTM(4, 8, 1, proj_size=4), (_x(3, 4, 4),)),
    "GRU": lambda: (nn.GRU(4, 8, 2, batch_first=True, bidirectional=True), (_x(4, 3, 4),)),
    "RNN-tanh": lambda: (nn.RNN(4, 8, 2, bidirectional=True), (_x(3, 4, 4),)),
    "RNN-relu": lambda: (nn.RNN(4, 8, 2, nonlinearity="relu", batch_first=True, bias=False), (_x(4, 3, 4),)),
    "LSTMCell": lambda: (nn.LSTMCell(4, 8), (_x(4, 4),)),
    "GRUCell": lambda: (nn.GRUCell(4, 8), (_x(4, 4),)),
    "RNNCell": lambda: (nn.RNNCell(4, 8), (_x(4, 4),)),
    "RNNCell-relu": lambda: (nn.RNNCell(4, 8, nonlinearity="relu"), (_x(4, 4),)),
    "Upsample-nearest1d": lambda: (nn.Upsample(scale_factor=2), (_x(4, 4, 4),)),
    "Upsample-nearest2d": lambda: (nn.Upsample(scale_factor=2), (_x(4, 4, 4, 4),)),
    "Upsample-nearest3d": lambda: (nn.Upsample(size=(6, 6, 6)), (_x(4, 4, 4, 4, 4),)),
    "Upsample-nearest-exact": lambda: (nn.Upsample(scale_factor=2, mode="nearest-exact"), (_x(4, 4, 4, 4),)),
    "Upsample-linear": lambda: (nn.Upsample(scale_factor=2, mode="linear"), (_x(4, 4, 4),)),
    "Upsample-bilinear": lambda: (nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True), (_x(4, 4, 4, 4),)),
    "UpsamplingBilinear2d": lambda: (nn.UpsamplingBilinear2d(scale_factor=2), (_x(4, 4, 4, 4),)),
    "Upsample-bicubic": lambda: (nn.Upsample(scale_factor=2, mode="bicubic"), (_x(4, 4, 4, 4),)),
    "Upsample-trilinear": lambda: (nn.Upsample(scale_factor=2, mode="trilinear"), (_x(4, 4, 4, 4, 4),)),
    "interpolate-antialias": lambda: (Call(lambda x: F.interpolate(x, size=(3, 3), mode="bilinear", antialias=True)),
                                      (_x(4, 4, 6, 6),)),
    "PixelShuffle": lambda: (nn.PixelShuffle(2), (_x(4, 16, 4, 4),)),
    "PixelUnshuffle": lambda: (nn.PixelUnshuffle(2), (_x(4, 4, 8, 8),)),
    "ChannelShuffle": lambda: (nn.ChannelShuffle(2), (_x(4, 8, 4, 4),)),
    "Unfold": lambda: (nn.Unfold(2, padding=1), (_x(4, 4, 4, 4),)),
    "Fold": lambda: (nn.Fold((4, 4), 2), (_x(4, 16, 9),)),
    "Bilinear": lambda: (nn.Bilinear(4, 6, 8), (_x(4, 4), _x(4, 6))),
}


def _is_pointwise(target) -> bool:
    return torch.Tag.pointwise in getattr(target, "tags", ())


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_traces_to_ops_with_rules_that_split(name):
    module, inputs = MODULES[name]()
    traced = trace(module, inputs)
    nodes = [n for n in traced.compute_nodes() if n.target is not operator.getitem and not _is_pointwise(n.target)]
    missing = sorted({str(n.target) for n in nodes if get_rule(n.target) is None})
    assert not missing, f"{name}: no rule for {missing}"
    ours = [n for n in nodes if get_rule(n.target).family in OUR_FAMILIES]
    assert ours, f"{name}: traced to none of this family's ops: {[str(n.target) for n in nodes]}"
    mesh = MeshSpec.preset("cpu", (4,))
    for node in ours:
        # The real graph's arguments (hidden-state lists, flat weight lists, string padding ...)
        # reach the rule and give a split of the batch (all inputs here have batch 4).
        strategies = strategies_for(node, mesh)
        sharded = [st for st in strategies if any(s is not None and not s.is_replicated()
                                                  for s in st.input_specs + st.output_specs)]
        assert sharded, f"{name}: {node.target} offers only replication"


# ------------------------------------------------------------------------- running statistics
def _running_stats_cases():
    """(target, sample) of every rule sample that updates running statistics in place."""
    cases = []
    for target in (aten.instance_norm.default, aten.batch_norm.default):
        for sample in get_rule(target).samples():
            bound = bind(target, sample.args, sample.kwargs)
            updates = bound["training"] if "training" in bound else bound["use_input_stats"]
            if bound["running_mean"] is not None and updates:
                cases.append(pytest.param(target, sample, id=f"{target}-{sample.label}"))
    return cases


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=str)
@pytest.mark.parametrize("target, sample", _running_stats_cases())
def test_running_stats_after_every_strategy_match_one_device(target, sample, mesh_shape):
    bound = bind(target, sample.args, sample.kwargs)
    want = {k: bound[k].clone() for k in ("running_mean", "running_var")}
    call_op(target, {**bound, **want})
    assert not torch.equal(want["running_mean"], bound["running_mean"])  # the sample does update them
    info, _ = reference(target, sample)
    names = [s.arg for s in info.slots]
    strategies = enumerate_strategies(info, MeshSpec.preset("cpu", mesh_shape), flops=(0.0, 0.0))
    for st in strategies:
        kernel = get_kernel(st.kernel).fn if st.kernel else None

        def rank(comm, st=st, kernel=kernel):
            coord = tuple(comm.coordinate(a) for a in range(len(mesh_shape)))
            local = dict(bound)
            for name, spec in zip(names, st.input_specs):
                assert not spec.has_partial()
                local[name] = bound[name][spec.local_slices(bound[name].shape, mesh_shape, coord)].clone()
            if kernel is None:
                call_op(target, local_arguments(target, info, local, st.input_specs, st.output_specs, mesh_shape))
            else:
                kernel(KernelContext(comm, info, st.input_specs, st.output_specs, mesh_shape), **local)
            return coord, {k: local[k] for k in want}

        for coord, got in run_spmd(rank, mesh_shape).values():
            for k, value in got.items():
                spec = st.input_specs[names.index(k)]
                expected = want[k][spec.local_slices(want[k].shape, mesh_shape, coord)]
                torch.testing.assert_close(value, expected, rtol=1e-10, atol=1e-12,
                                           msg=lambda m: f"{st.name} rank {coord} {k}: {m}")


def test_instance_norm_batch_split_with_running_stats_uses_the_sync_kernel():
    sample = next(s for s in get_rule(aten.instance_norm.default).samples() if s.label == "train-running-stats")
    info, _ = reference(aten.instance_norm.default, sample)
    by_name = {st.name: st for st in enumerate_strategies(info, MeshSpec.preset("cpu", (4,)), flops=(0.0, 0.0))}
    batch = by_name["S0 x R x R x R x R -> S0"]
    assert batch.kernel == "instance_norm_running_stats" and batch.forward_comm_s > 0
    assert by_name["S1 x S0 x S0 x S0 x S0 -> S1"].kernel is None
    assert not any(name.startswith(("S2", "S3")) for name in by_name)  # training: no spatial split


# ---------------------------------------------------------------------------- group splits
def _names(target, sample, mesh_shape=(4,)):
    info, _ = reference(target, sample)
    return {st.name for st in enumerate_strategies(info, MeshSpec.preset("cpu", mesh_shape), flops=(0.0, 0.0))}


def test_channel_splits_only_where_groups_allow():
    x = rand(4, 8, 4, 4)
    depthwise = _names(aten.conv2d.default, Sample((x, rand(16, 1, 3, 3), None, [1, 1], [0, 0], [1, 1], 8)))
    assert "S1 x S0 -> S1" in depthwise
    grouped = _names(aten.conv2d.default, Sample((x, rand(8, 2, 3, 3), None, [1, 1], [0, 0], [1, 1], 4)))
    assert not any(n.startswith("S1") or "-> S1" in n for n in grouped)
    transposed = _names(aten.conv_transpose2d.input, Sample((x, rand(8, 4, 3, 3))))
    assert {"R x S1 -> S1", "S1 x S0 -> P"} <= transposed  # weight is (C_in, C_out, *k)
    assert "S1 x S1 -> P" not in transposed
    assert "S1 x S0 x S0 -> S1" in _names(aten.group_norm.default, Sample((x, 8, rand(8), rand(8))))
    assert not any(n.startswith("S1") for n in _names(aten.group_norm.default, Sample((x, 2, rand(8), rand(8)))))


def test_depthwise_split_runs_the_local_op_with_local_groups():
    sample = Sample((rand(4, 8, 4, 4), rand(8, 1, 3, 3), None, [1, 1], [0, 0], [1, 1], 8))
    info, _ = reference(aten.conv2d.default, sample)
    st = next(st for st in enumerate_strategies(info, MeshSpec.preset("cpu", (2, 2)), flops=(0.0, 0.0))
              if st.name == "S1S1 x S0S0 -> S1S1")
    bound = bind(aten.conv2d.default, sample.args, sample.kwargs)
    assert local_arguments(aten.conv2d.default, info, bound, st.input_specs, st.output_specs, (2, 2))["groups"] == 2


def test_rnn_batch_split_follows_batch_first():
    for batch_first, split in ((True, "S0"), (False, "S1")):
        module = nn.LSTM(4, 8, batch_first=batch_first)
        x = _x(4, 3, 4) if batch_first else _x(3, 4, 4)
        node = next(n for n in trace(module, (x,)).compute_nodes() if n.target is aten.lstm.input)
        names = {st.name for st in strategies_for(node, MeshSpec.preset("cpu", (4,)))}
        assert any(n.startswith(f"{split} x S1 x S1 x R") and n.endswith(f"-> ({split}, S1, S1)") for n in names)


# ------------------------------------------------------------------------------ end to end
class _ConvRnnNet(nn.Module):
    """Depthwise and transposed convolutions, group/instance norm (tracked statistics),
    resampling, pools, a bidirectional LSTM, a GRU, two cells and a bilinear head."""

    def __init__(self) -> None:
        super().__init__()
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.up = nn.ConvTranspose2d(8, 8, 2, stride=2)
        self.gn = nn.GroupNorm(8, 8)
        self.inorm = nn.InstanceNorm2d(8, affine=True, track_running_stats=True)
        self.shuffle = nn.PixelShuffle(2)
        self.lstm = nn.LSTM(32, 64, 2, batch_first=True, bidirectional=True)
        self.gru = nn.GRU(128, 64)
        self.cell = nn.LSTMCell(64, 64)
        self.rcell = nn.RNNCell(64, 64, nonlinearity="relu")
        self.bil = nn.Bilinear(64, 64, 32)
        self.head = nn.Linear(32, 5)

    def forward(self, x, labels):
        h = self.gn(self.up(F.relu(self.dw(x))))                                # (B, 8, 16, 16)
        h = self.inorm(F.interpolate(h, scale_factor=0.5, mode="bilinear"))     # (B, 8, 8, 8)
        h = F.adaptive_avg_pool2d(F.max_pool2d(h, 2), 2)                         # (B, 8, 2, 2)
        h = self.shuffle(torch.cat([h, 2 * h, 3 * h, 4 * h], 1))                  # (B, 8, 4, 4)
        t = h.flatten(2).transpose(1, 2)                                         # (B, 16, 8)
        seq, _ = self.lstm(torch.cat([t, t.sin(), t.cos(), t * t], 2))            # (B, 16, 128)
        seq, _ = self.gru(seq.transpose(0, 1))                                   # (16, B, 64)
        hx, cx = self.cell(seq[-1])
        g = self.rcell(hx + cx)
        logits = self.head(self.bil(g, hx))
        return F.cross_entropy(logits, labels)


def _train_steps(rank, world, model, inputs, plans):
    from autopar.api import autoparallelize

    out = []
    for plan in plans:
        pm = autoparallelize(model, inputs, plan=plan)
        loss = pm(**inputs)
        loss.backward()
        out.append((loss.detach(), pm.full_gradients(), pm.full_state_dict(), pm.code))
    return out


def _split_ops(plan) -> dict[str, str]:
    return {n.op: n.input_specs[0] for n in plan.nodes if n.input_specs and n.input_specs[0] not in ("R", None)}


@pytest.mark.slow
def test_conv_norm_rnn_model_trains_like_one_device_on_two_processes():
    """Two plans in one launch: the solver's (channel splits with local group counts, bilinear's
    contraction split) and the data-parallel one (instance norm's running-statistics kernel)."""
    import copy
    import dataclasses
    import os
    import sys

    from autopar.api import plan as make_plan
    from autopar.runtime.launch import run_local

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    from _baselines import restricted_plan

    torch.manual_seed(0)
    model = _ConvRnnNet().train()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 8, 8, 8, generator=gen)
    x[8:] = 2 * x[8:] + 1.5  # the halves differ: per-shard running statistics would be wrong
    inputs = {"x": x, "labels": torch.randint(0, 5, (16,), generator=gen)}
    ref = copy.deepcopy(model)
    want_loss = ref(**inputs)
    want_loss.backward()
    mesh = MeshSpec.preset("cpu", (2,))
    mesh = dataclasses.replace(mesh, alpha=(1e-7,), beta=(1e-13,), name="fast-links")  # split compute
    plans = [make_plan(model, inputs, mesh=mesh), restricted_plan(model, inputs, mesh=mesh)]
    solved, data_parallel = (_split_ops(p) for p in plans)
    assert {"aten.lstm.input", "aten.gru.input", "aten.lstm_cell.default", "aten.conv2d.default",
            "aten.group_norm.default", "aten.instance_norm.default"} <= set(solved), solved
    assert data_parallel.get("aten.instance_norm.default") == "S0", data_parallel
    for results in run_local(_train_steps, 2, model, inputs, plans, timeout=300):
        assert "instance_norm_running_stats" in results[1][3]
        for loss, grads, state, _ in results:
            torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-4, atol=1e-6)
            for k, p in ref.named_parameters():
                torch.testing.assert_close(grads[k], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"grad {k}: {m}")
            for k, v in ref.state_dict().items():
                torch.testing.assert_close(state[k], v, rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"state {k}: {m}")
