"""Pipeline planning: stage cuts over mesh axis 0 searched jointly with each stage's sharding.

Modules, lowest first (each imports only those above it in this list):

- ``geometry``: where the cuts can go -- the repeated-block container, each op's block position,
  the decisions and bytes of a stage range, range families, the micro-batch cut of the inputs;
- ``schedule``: the schedules' step-time and in-flight formulas and the stage-cut DP over
  priced stage ranges (torch-free);
- ``timeline``: one step played out pass by pass (the report draws it; torch-free);
- ``bounds``: step floors of a configuration before its search, and search in floor order;
- ``costs``: a stage range's Problem slice and its memoised intra-stage solves (``StageCosts``);
- ``assemble``: the pipelined ``Plan`` of chosen cuts (and of the even cut);
- ``search``: ``search_stages``, the schedules of one configuration searched in floor order;
- ``candidates``: whether the default (``pipeline="auto"``) searches pipelines at all, before
  any micro-batch trace (``blocker``, ``work_floor``).

The package imports nothing on its own: ``import autopar.planner.pipeline.timeline`` (the
report's) loads neither torch nor the solver.
"""
