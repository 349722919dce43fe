"""The training mode a module's graph was traced in, and refusing to run it in the other one.

``build_module`` emits the graph traced from the model in one mode (training, as a rule): a
training batch norm normalises by the batch and updates its running statistics, dropout draws
masks. ``model.eval()`` on the result flips ``training`` but cannot change that graph, so an
evaluation loop would silently keep training-mode behaviour -- and write the batch norms' running
statistics from validation batches. A module whose model has such parts refuses to run in the
mode it was not traced in and says what to do; a model without them (the graph is the same in
both modes as far as its modules tell) runs in either.
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

    def check(self, model_name: str, training: bool) -> None:
        """Raise when a module traced in one mode is called in the other and its model has parts
        that behave differently there."""
        if training == self.training or self.sensitive is None:
            return
        traced, called = ("training", "evaluation") if self.training else ("evaluation", "training")
        raise NotImplementedError(
            f"{model_name} was traced and planned in {traced} mode, and its {self.sensitive} behaves differently "
            f"in {called} mode: this module runs the {traced}-mode graph whatever .train()/.eval() says. Set it "
            f"back with .{'train' if self.training else 'eval'}(); for the {called}-mode computation, "
            f"autoparallelize the model in that mode (model.{'eval' if self.training else 'train'}() before "
            f"autoparallelize, then load_full_state_dict from this one)")


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
