"""The training mode a module's graph was traced in, and what runs in the other one.

``build_module`` emits the graph traced from the model in one mode (training, as a rule): a
training batch norm normalises by the batch and updates its running statistics, dropout draws
masks. ``model.eval()`` on the result flips ``training`` but cannot change that graph: run as it
is, an evaluation loop would keep training-mode behaviour and write the batch norms' running
statistics from validation batches. So, where the model has such parts:

- a module traced in TRAINING mode and called after ``.eval()`` evaluates on a gathered eval-mode
  replica of the model (``runtime/eval_replica.py``: running statistics, no dropout, no draws,
  no gradients -- one device's ``model.eval()``); ``.train()`` goes back to the training graph,
  untouched by the evaluation. A pipeline's ``step`` (a training step) still refuses eval mode;
- a module traced in EVALUATION mode refuses to run in training mode and says what to do (its
  graph has no training computation to run).

A model without such parts (the graph is the same in both modes as far as its modules tell)
runs its one graph in either mode.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd
from torch.nn.modules.instancenorm import _InstanceNorm

__all__ = ["TracedMode", "traced_mode"]


@dataclass(frozen=True)
class TracedMode:
    """``training``: the model's mode when traced; ``sensitive``: why the other mode would compute
    something else (the first module found), None when nothing tells the modes apart."""
    training: bool
    sensitive: str | None

    def replicated(self, training: bool) -> bool:
        """Whether a forward in mode ``training`` runs on the eval replica: traced in training
        mode, called in evaluation mode, and the model tells the two apart."""
        return self.training and not training and self.sensitive is not None

    def check(self, model_name: str, training: bool) -> None:
        """Raise when the module's graph is asked to run in the mode it was not traced in and its
        model has parts that behave differently there (a forward that ``replicated`` sends to
        the replica never gets here)."""
        if training == self.training or self.sensitive is None:
            return
        if self.training:  # a training step asked for in evaluation mode (a pipeline's ``step``)
            raise NotImplementedError(
                f"{model_name} is in evaluation mode and its {self.sensitive} behaves differently there: a "
                f"training step runs the training-mode graph it was traced in. Call .train() before training; "
                f"in evaluation mode, call the module (forward) for eval-mode outputs")
        raise NotImplementedError(
            f"{model_name} was traced and planned in evaluation mode, and its {self.sensitive} behaves differently "
            f"in training mode: this module has only the evaluation-mode graph. Set it back with .eval(); to "
            f"train, autoparallelize the model in training mode (model.train() before autoparallelize, then "
            f"load_full_state_dict from this one)")


def traced_mode(model: nn.Module, *, draws: bool) -> TracedMode:
    """The mode of ``model`` (as traced) and its first part whose behaviour depends on the mode:
    a batch norm (or an instance norm with running statistics), a dropout with p > 0 (modules,
    RNN layers and attention included), or -- ``draws`` -- random ops in the traced graph."""
    for name, module in model.named_modules():
        where = f"{type(module).__name__} {name!r}" if name else type(module).__name__
        if isinstance(module, _BatchNorm) or (isinstance(module, _InstanceNorm) and module.track_running_stats):
            return TracedMode(model.training, f"batch norm ({where})")
        dropout = getattr(module, "dropout", None) if isinstance(module, (nn.RNNBase, nn.MultiheadAttention)) else None
        if (isinstance(module, _DropoutNd) and module.p > 0) or (isinstance(dropout, float) and dropout > 0):
            return TracedMode(model.training, f"dropout ({where})")
    return TracedMode(model.training, "random ops (dropout)" if draws else None)
