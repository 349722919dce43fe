"""Embedding-table placement families: the best plan when every table is placed one given way.

autopar places each table (each ``aten._embedding_bag``) as part of the one ILP; to show what that
buys, a family pins every table's placement per mesh axis and leaves the rest of the model to the
same solver, on the same built problem (``assemble.restricted_problem``: same options, costs and
liveness, so the figures compare in one cost model). The families, in TorchRec's words
(``autopar/strategies/_embedding_bag.py`` maps TorchRec's placements onto per-axis layouts):

- ``row-wise``: every table ``Shard(0)`` on every axis (rows split over all devices, partial
  pooled outputs reduced by their consumers);
- ``table-wise``: every table whole on ONE device of the mesh (TorchRec's table-wise: the lookup
  table-wise on every axis; ``planner.table_partition`` picks the owners, and the plan's peak is
  the fullest device's);
- ``column-wise``: every table ``Shard(1)`` on every axis;
- ``data-parallel``: every table replicated, each device pooling its slice of the batch;
- ``dp x row-wise``: data-parallel over axis 0, row-wise over the others (rows split inside a
  node, every table replicated across nodes: the gradient all-reduce crosses nodes);
- ``dp x table-wise``: data-parallel over axis 0, table-wise over the others (each table whole on
  one device of every node; its gradient all-reduced across the nodes' owners);
- ``column x row-wise``: column-wise over axis 0, row-wise over the others (TorchRec's
  table-row-wise -- a table on one node, rows split inside it -- is table-wise over axis 0 and
  row-wise inside; not a family here).

Each family also stores the table in the layout it looks it up in (a data-parallel table is
replicated in memory, not sharded and gathered for every lookup).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx

from autopar.layout.placement import Partial, Placement, Replicate, Shard
from autopar.plans import NodeKind

__all__ = ["TABLE_FAMILIES", "table_roles", "table_restriction", "table_family_plan"]

_BAGS = (torch.ops.aten._embedding_bag.default, torch.ops.aten._embedding_bag_forward_only.default)
# Per-axis roles: (the table's placement, the pooled output's placement or None for any).
_ROW, _TABLE = (Shard(0), Partial()), (Shard(0), Shard(0))
_COLUMN, _DATA = (Shard(1), None), (Replicate(), Shard(0))
TABLE_FAMILIES = ("row-wise", "table-wise", "column-wise", "data-parallel", "dp x row-wise", "dp x table-wise",
                  "column x row-wise")


def table_roles(family: str, num_axes: int) -> tuple[tuple[Placement, Placement | None], ...]:
    """Per mesh axis: where family ``family`` puts each table and its pooled output."""
    roles = {"row-wise": _ROW, "table-wise": _TABLE, "column-wise": _COLUMN, "data-parallel": _DATA}
    if family in roles:
        return (roles[family],) * num_axes
    if family in ("dp x row-wise", "column x row-wise"):
        return ((_DATA if family.startswith("dp") else _COLUMN),) + (_ROW,) * (num_axes - 1)
    if family == "dp x table-wise":
        return (_DATA,) + (_TABLE,) * (num_axes - 1)
    raise ValueError(f"unknown table family {family!r}; known: {TABLE_FAMILIES}")


def table_restriction(family: str, mesh_shape: tuple[int, ...]) -> Callable:
    """``restricted_problem``'s ``restriction``: ``_embedding_bag`` options placing the table as
    ``family`` says on every axis of size > 1 (an axis of size 1 holds every tensor whole), and
    the table parameter stored in that layout; every other decision keeps all its options."""
    roles = table_roles(family, len(mesh_shape))

    def placed(spec, out_spec=None) -> bool:
        """``spec`` (and ``out_spec``, the pooled output, where given) as the roles say."""
        def on(a: int, w, o) -> bool:
            return spec.placements[a] == w and (o is None or out_spec is None or out_spec.placements[a] == o)
        return all(size == 1 or on(a, w, o) for a, (size, (w, o)) in enumerate(zip(mesh_shape, roles)))

    def allowed(kind: str, node: fx.Node, choice) -> bool:
        if kind == NodeKind.OP and node.target in _BAGS:
            return placed(choice.input_specs[0], choice.output_specs[0])
        if kind == NodeKind.PARAMETER and any(u.target in _BAGS and u.args[0] is node for u in node.users):
            # The table is also *stored* so (a replicated table is replicated in memory, as
            # TorchRec's data-parallel keeps it, not sharded and gathered for each lookup).
            return placed(choice.output_specs[0])
        return True

    return allowed


def table_family_plan(traced, built, family: str, *, solver: str = "auto", time_limit: float = 60.0):
    """The best ``Plan`` of ``built`` with every table placed as ``family`` says (table-wise tables
    given their owners). ValueError: some table cannot be placed so (a dim that does not divide),
    or no such plan meets the budget (for table-wise, with each table whole on its owner)."""
    from autopar.planner.assemble import assemble_plan, restricted_problem
    from autopar.planner.checkpointing import estimate
    from autopar.planner.table_partition import partition, with_tables
    from autopar.solver.driver import SolveTimeout, solve

    problem = restricted_problem(built, traced, table_restriction(family, built.mesh.shape), f"tables {family}")
    try:
        solution = solve(problem, solver=solver, time_limit=time_limit)
    except SolveTimeout as exc:
        raise ValueError(str(exc)) from exc
    evaluation = estimate(built, problem, solution.choice, (), built.segment_inputs)
    plan = with_tables(assemble_plan(traced, built, choice=solution.choice, evaluation=evaluation, solution=solution),
                       partition(traced, built, solution.choice))
    budget = built.problem.budget_bytes
    if budget is not None and plan.estimate.peak_bytes > budget:
        raise ValueError(f"tables {family}: with each table-wise table whole on its owner the fullest device needs "
                         f"{plan.estimate.peak_bytes} B, over the budget {budget} B")
    return plan
