"""Layouts, device-free and torch-free: placements and ``TensorSpec``, ``MeshSpec`` (shape, axis
names, link and device costs), the cost formulas in seconds, and the search for the cheapest
sequence of collectives that converts one layout into another; and the naming of repeated blocks
(``blocks.py``), which the planner, the solver and the report all group nodes by.

Everything above (strategies, planner, solver, runtime, report) speaks this vocabulary; nothing
here imports torch or any other autopar package.
"""

from autopar.layout.conversion import Conversion, ReshardStep, plan_conversion
from autopar.layout.cost import collective_seconds, compute_seconds, copy_seconds
from autopar.layout.mesh import PRESETS, MeshSpec, parse_bytes, parse_mesh_shape
from autopar.layout.placement import P, R, Partial, Placement, Replicate, Shard, TensorSpec

__all__ = ["Conversion", "ReshardStep", "plan_conversion", "collective_seconds", "compute_seconds",
           "copy_seconds", "PRESETS", "MeshSpec", "parse_bytes", "parse_mesh_shape", "P", "R", "Partial",
           "Placement", "Replicate", "Shard", "TensorSpec"]
