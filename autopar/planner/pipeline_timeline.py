"""Deprecated alias: the simulated schedule moved to ``autopar.planner.pipeline.timeline``. The
README named this module, so importing it keeps working, with a ``DeprecationWarning``."""

import warnings

from autopar.planner.pipeline.timeline import Pass, Timeline, rank_order, simulate

__all__ = ["Pass", "Timeline", "simulate", "rank_order"]

warnings.warn("autopar.planner.pipeline_timeline is deprecated: import from autopar.planner.pipeline.timeline",
              DeprecationWarning, stacklevel=2)
