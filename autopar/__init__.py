"""autopar: a compiler-style auto-parallelizer for PyTorch training.

``import autopar`` is cheap and does not import torch: heavy entry points load on first use.
"""

from __future__ import annotations

import importlib

from autopar.layout.mesh import MeshSpec
from autopar.layout.placement import Partial, Replicate, Shard, TensorSpec

__version__ = "0.1.0"

# public name -> module that defines it (imported on first attribute access)
_LAZY = {
    "trace": "autopar.tracer",
    "profile": "autopar.tracer",
    "coverage": "autopar.tracer",
    "TraceError": "autopar.tracer",
    "TracedGraph": "autopar.tracer",
    "plan": "autopar.api",
    "Plan": "autopar.plans",
    "autoparallelize": "autopar.api",
    "OffloadPolicy": "autopar.offload",
    "AutoParallelModule": "autopar.runtime.module",
    "clip_grad_norm_": "autopar.runtime.module",
    "profile_mesh": "autopar.runtime.mesh_profile",
    "calibrate": "autopar.runtime.calibrate",
    "GradScaler": "autopar.runtime.amp",
    "verify": "autopar.proof",
    "PlanVerificationError": "autopar.runtime.verify",
    "VerifyReport": "autopar.runtime.verify",
    "manual_seed": "autopar.strategies.rng",
    "ParallelModule": "autopar.runtime.parallel_module",
    # the product notes' launchers (``colossalai.launch`` / ``launch_from_torch``)
    "launch": "autopar.runtime.launch",
    "launch_from_torch": "autopar.runtime.launch",
    "get_default_parser": "autopar.runtime.launch",
    "Booster": "autopar.booster",  # the notes' ``from colossalai import Booster``
}
# Subpackages users reach as attributes (``autopar.optim.Lamb``, ``autopar.booster.Booster``) without
# importing them first, as ``torch.optim`` is reached after ``import torch``.
_SUBPACKAGES = ("optim", "booster")

__all__ = ["MeshSpec", "TensorSpec", "Shard", "Replicate", "Partial", *_LAZY, *_SUBPACKAGES]


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")  # the import binds it here too
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'autopar' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
