"""A module runs the graph traced in one mode. Where the model can tell the modes apart (batch
norm, dropout): traced in training mode and called after ``.eval()``, it evaluates on a gathered
eval-mode replica (``tests/runtime/test_eval_mode.py`` checks its numbers against one device);
traced in evaluation mode and called in training mode, it refuses, naming the module; a
pipeline's ``step`` in evaluation mode refuses too. A model without such parts runs its one
graph in either mode. A call with another batch size (a short last batch) says what to do.

Before, ``pm.eval()`` was ignored: a validation pass ran the training graph, normalised by the
batch and wrote the batch norm's running statistics from the validation batch."""

from __future__ import annotations

import copy

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
    with torch.no_grad():  # the running statistics as built (nothing trained): the plain model's eval
        out["normed_eval"] = torch.allclose(pm(x), normed.eval()(x), rtol=1e-5, atol=1e-6)
        out["normed_eval_short"] = pm(x[:6]).shape == (6, 3)  # the replica takes a short last batch
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
def test_a_training_module_evaluates_and_an_evaluation_module_refuses_training():
    torch.manual_seed(0)
    normed, frozen = Net(norm=True), Net(norm=True).eval()
    frozen.bn.running_mean.uniform_(-1, 1)
    normed.bn.running_var.uniform_(0.5, 2)
    for result in run_local(_body, 2, Net(norm=False), normed.train(), frozen, torch.randn(8, 8)):
        assert result["plain_eval_same"] and result["normed_train_runs"]
        assert result["normed_eval"] and result["normed_eval_short"]
        assert result["frozen_starts_in_eval"] and result["frozen_matches_eval"]
        said = "Net was traced and planned in evaluation mode, and its batch norm (BatchNorm1d 'bn')"
        assert said in result["frozen_train"], result["frozen_train"]
        assert "model.train() before autoparallelize" in result["frozen_train"]
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
        pm.step(x)
    plain = copy.deepcopy(model)
    plain.load_state_dict(pm.full_state_dict())
    with torch.no_grad():
        evaluated = torch.allclose(pm(x), plain.eval()(x), rtol=1e-5, atol=1e-6)
    return bool(torch.isfinite(loss)), evaluated, str(err.value)


@pytest.mark.timeout(180)
def test_a_pipelined_module_evaluates_and_refuses_a_training_step_in_evaluation_mode():
    torch.manual_seed(0)
    for ran, evaluated, said in run_local(_pipelined, 2, Blocks(), torch.randn(8, 8), timeout=150):
        assert ran and evaluated
        assert "Blocks is in evaluation mode and its dropout (Dropout 'blocks.0.1')" in said, said
        assert "Call .train() before training" in said, said
