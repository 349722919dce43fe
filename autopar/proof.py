"""``autopar.verify``: a plan proves itself on real processes before anyone trains on it.

``verify(model, inputs, plan)`` is called on every rank (after ``init_process_group``): it
builds ``model`` under ``plan`` (``autoparallelize(model, inputs, plan=plan, verify=inputs)``)
-- or takes an already built ``AutoParallelModule`` -- and runs one forward and backward under
the plan and one under the all-replicated plan on the same weights and inputs
(``autopar.runtime.verify``). It returns the ``VerifyReport``, or raises
``PlanVerificationError`` naming the first traced node whose value or gradient diverges, with
its module path, its strategy and its layouts. ``inputs`` may be meta tensors: values are then
made up from their shapes (``verify_inputs``: token ids within the embedding, labels within the
classes). The module is left as it was (buffers and gradients restored).
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["verify"]


def verify(model: Any, inputs: tuple | dict, plan: Any = None, *, rtol: float | None = None, seed: int = 0):
    """Check ``plan`` for ``model`` on ``inputs`` (see the module docstring); every rank must call.
    ``model``: the original ``nn.Module`` with ``plan`` (a ``Plan`` or a path to its JSON), or an
    ``AutoParallelModule`` (its own plan; ``plan`` must then be None). ``rtol``: None for the
    compute dtype's tolerance (``autopar.runtime.verify.tolerance``)."""
    from autopar.runtime.module import AutoParallelModule
    from autopar.runtime.verify import verify_inputs, verify_module

    if isinstance(model, AutoParallelModule):
        if plan is not None:
            raise ValueError("verify(module, inputs): an AutoParallelModule brings its own plan; leave plan=None")
        return verify_module(model, verify_inputs(model._traced, inputs, seed=seed), rtol=rtol)
    if plan is None:
        raise ValueError("verify(model, inputs, plan): give the plan (a Plan or the path to its JSON) or an "
                         "AutoParallelModule")
    if not hasattr(plan, "nodes") and not isinstance(plan, (str, os.PathLike)):
        raise ValueError(f"plan must be a Plan or a path to its JSON, got {type(plan).__name__}")
    from autopar.api import autoparallelize

    module = autoparallelize(model, inputs, plan=plan, seed=seed)
    return verify_module(module, verify_inputs(module._traced, inputs, seed=seed), rtol=rtol)
