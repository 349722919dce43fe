"""Deprecated alias: the step floors moved to ``autopar.planner.pipeline.bounds``. The README
named this module, so importing it keeps working, with a ``DeprecationWarning``."""

import warnings

from autopar.planner.pipeline.bounds import block_floor, config_floors, in_bound_order, step_floor

__all__ = ["block_floor", "step_floor", "config_floors", "in_bound_order"]

warnings.warn("autopar.planner.pipeline_bounds is deprecated: import from autopar.planner.pipeline.bounds",
              DeprecationWarning, stacklevel=2)
