"""Deprecated alias: the stage search moved to the package ``autopar.planner.pipeline``.

``search_stages`` and ``PipelineSearch`` are in ``autopar.planner.pipeline.search``, ``StageCosts``,
``StageCost``, ``stage_costs`` and ``HELD`` in ``.costs``, ``PipelineCandidate``,
``schedule_cuts``, ``schedules_for`` and ``check_pipeline_zero`` in ``.schedule``. The README named
this module, so importing it keeps working, with a ``DeprecationWarning``.
"""

import warnings

from autopar.planner.pipeline.costs import HELD, StageCost, StageCosts, stage_costs
from autopar.planner.pipeline.schedule import PipelineCandidate, check_pipeline_zero, schedule_cuts, schedules_for
from autopar.planner.pipeline.search import PipelineSearch, search_stages

__all__ = ["StageCost", "StageCosts", "PipelineCandidate", "PipelineSearch", "stage_costs", "search_stages",
           "schedule_cuts", "schedules_for", "check_pipeline_zero", "HELD"]

warnings.warn("autopar.planner.pipeline_search is deprecated: import search_stages from "
              "autopar.planner.pipeline.search (StageCosts from .costs, schedule_cuts from .schedule)",
              DeprecationWarning, stacklevel=2)
