"""A module runs the graph traced in one mode: called in the other mode it refuses where the model
can tell the modes apart (batch norm, dropout), naming the module, and runs where it cannot. A
call with another batch size (a short last batch) says what to do.

Before, ``pm.eval()`` was ignored: a validation pass ran the training graph, normalised by the
batch and wrote the batch norm's running statistics from the validation batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.api import autoparallelize
from autopar.runtime.launch import run_local
from autopar.runtime.modes import traced_mode


class Net(nn.Module):
    def __init__(self, norm: bool):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8) if norm else nn.Identity()
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.fc(x))))


def test_the_parts_that_tell_the_modes_apart():
    assert traced_mode(Net(norm=False), draws=False).sensitive is None
    assert traced_mode(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.0)), draws=False).sensitive is None
    assert traced_mode(nn.InstanceNorm1d(4, affine=True), draws=False).sensitive is None
    assert "batch norm (BatchNorm1d 'bn')" == traced_mode(Net(norm=True), draws=False).sensitive
    assert "dropout (Dropout '1')" == traced_mode(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)),
                                                 draws=False).sensitive
    assert "LSTM" in traced_mode(nn.LSTM(4, 4, num_layers=2, dropout=0.2), draws=False).sensitive
    assert "MultiheadAttention" in traced_mode(nn.MultiheadAttention(4, 2, dropout=0.1), draws=False).sensitive
    assert traced_mode(nn.Linear(4, 4), draws=True).sensitive == "random ops (dropout)"
    assert not traced_mode(nn.Linear(4, 4).eval(), draws=False).training


def _body(rank, world, plain, normed, frozen, x):
    out = {}
    pm = autoparallelize(plain, (x,), mesh=(2,))
    want = pm(x).detach()
    with pytest.raises(ValueError) as err:  # a short last batch: another shape than the plan's
        pm(x[:6])
    out["short_batch"] = str(err.value)
    pm.eval()
    out["plain_eval_same"] = torch.equal(pm(x).detach(), want)  # nothing tells the modes apart
    pm = autoparallelize(normed, (x,), mesh=(2,))
    pm.eval()
    with pytest.raises(NotImplementedError) as err:
        pm(x)
    out["normed_eval"] = str(err.value)
    pm.train()
    out["normed_train_runs"] = pm(x).shape == (8, 3)
    pm = autoparallelize(frozen, (x,), mesh=(2,))  # traced in eval mode: the module starts there
    out["frozen_starts_in_eval"] = not pm.training
    eval_out = pm(x).detach()
    out["frozen_matches_eval"] = torch.allclose(eval_out, frozen(x), rtol=1e-5, atol=1e-6)
    pm.train()
    with pytest.raises(NotImplementedError) as err:
        pm(x)
    out["frozen_train"] = str(err.value)
    return out


@pytest.mark.timeout(120)
def test_a_module_refuses_the_mode_it_was_not_traced_in_where_the_model_tells_them_apart():
    torch.manual_seed(0)
    normed, frozen = Net(norm=True), Net(norm=True).eval()
    frozen.bn.running_mean.uniform_(-1, 1)
    for result in run_local(_body, 2, Net(norm=False), normed, frozen, torch.randn(8, 8)):
        assert result["plain_eval_same"] and result["normed_train_runs"]
        assert result["frozen_starts_in_eval"] and result["frozen_matches_eval"]
        said = "Net was traced and planned in training mode, and its batch norm (BatchNorm1d 'bn')"
        assert said in result["normed_eval"]
        assert "model.eval() before autoparallelize" in result["normed_eval"]
        assert "traced and planned in evaluation mode" in result["frozen_train"]
        assert "expected torch.float32[8, 8]" in result["short_batch"] and "drop_last=True" in result["short_batch"]


class Blocks(nn.Module):
    """Four identical blocks with dropout and a mean loss: a pipeline can cut it."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1)) for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.mean()


def _pipelined(rank, world, model, x):
    pm = autoparallelize(model, (x,), mesh=(2,), pipeline=2, microbatches=2)
    loss = pm.step(x)
    pm.eval()
    with pytest.raises(NotImplementedError) as err:
        pm(x)
    with pytest.raises(NotImplementedError):
        pm.step(x)
    return bool(torch.isfinite(loss)), str(err.value)


@pytest.mark.timeout(180)
def test_a_pipelined_module_refuses_the_mode_it_was_not_traced_in():
    torch.manual_seed(0)
    for ran, said in run_local(_pipelined, 2, Blocks(), torch.randn(8, 8), timeout=150):
        assert ran and "traced and planned in training mode, and its dropout (Dropout 'blocks.0.1')" in said
