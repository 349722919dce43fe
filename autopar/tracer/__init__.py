"""The tracer ("ColoTracer"): model -> ATen fx graph with shapes, module paths and costs.

- :func:`trace` captures the forward with ``torch.export`` (non-strict) on fake tensors;
  Hugging Face models trace at their default configs (caches off for the trace: :mod:`.hf`).
- :func:`profile` computes per-node FLOPs, bytes and saved-for-backward bytes symbolically.
- :func:`coverage` counts each distinct ATen op.
"""

from autopar.tracer.coverage import OpCount, coverage
from autopar.tracer.graph import Placeholder, TracedGraph
from autopar.tracer.profile import ModelProfile, NodeProfile, profile
from autopar.tracer.trace import TraceError, trace

__all__ = ["trace", "profile", "coverage", "TraceError", "TracedGraph", "Placeholder",
           "NodeProfile", "ModelProfile", "OpCount"]
