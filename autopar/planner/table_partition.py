"""Table-wise embedding tables: which device owns each one (TorchRec's enumerate-then-partition).

The ILP prices a table-wise lookup (``strategies/_embedding_bag.py``: table ``Shard(0)`` and
pooled output ``Shard(0)`` on an axis) at its balanced share: every device of the axis is charged
``1/n`` of the table's bytes (parameter, gradient, optimizer state), ``1/n`` of the full-batch
lookup, and its part of the pooled outputs' all-to-all. What runs is the whole table on ONE device
of the axis and nothing on its peers, so after the solve ``partition`` gives each such table an
owner: tables largest first, each onto the coordinate whose devices are least loaded so far (by
table bytes; a table table-wise over several axes has one owner coordinate per axis). The real
per-device peak is the planned peak plus the most any device holds over the balanced share it was
charged; ``fit_tables`` re-solves under a budget lowered by that overflow while it does not fit.

A table is owned only when its storage is exactly the layout its lookups read (so no conversion
touches an owned table), every consumer is a table-wise lookup over the same axes, and neither
ZeRO nor offload splits it further; otherwise it stays evenly split by rows, which the same
kernel runs exactly (each rank pools its rows, the reduce-scatter sums them) -- listed in
``Plan.solver["tables"]["even"]`` with the reason.
"""

from __future__ import annotations

import itertools
import math
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

import torch

from autopar.plans import Plan, TableOwner
from autopar.strategies._embedding_bag import table_wise_axes

__all__ = ["TablePartition", "partition", "fit_tables", "charge_lookups", "with_tables", "MAX_TABLE_REFITS"]

BAGS = (torch.ops.aten._embedding_bag.default, torch.ops.aten._embedding_bag_forward_only.default)
MAX_TABLE_REFITS = 3


@dataclass(frozen=True)
class TablePartition:
    """Owners of the table-wise tables and what they cost in memory.

    owners:      one ``TableOwner`` per owned table, graph order.
    device_bytes: per mesh coordinate, the owned tables' bytes it holds (with gradient and state).
    charged_bytes: what the ILP charged every device for those tables (their balanced shares).
    device_lookup_s / charged_lookup_s: the same for the tables' lookups (forward + backward seconds).
    even:        table FQN -> why a table-wise lookup's table stays evenly split.
    """

    owners: tuple[TableOwner, ...] = ()
    device_bytes: dict[tuple[int, ...], int] = field(default_factory=dict)
    charged_bytes: int = 0
    even: dict[str, str] = field(default_factory=dict)
    device_lookup_s: dict[tuple[int, ...], float] = field(default_factory=dict)
    charged_lookup_s: float = 0.0

    @property
    def excess_lookup_s(self) -> float:
        """The most lookup seconds any device spends over its charged share (the step waits for it)."""
        return max(0.0, max(self.device_lookup_s.values(), default=0.0) - self.charged_lookup_s)

    @property
    def excess_bytes(self) -> int:
        """The most any device holds over what it was charged (0 with no owned table)."""
        return max(self.device_bytes.values(), default=self.charged_bytes) - self.charged_bytes

    def info(self) -> dict:
        loads = sorted(self.device_bytes.values())
        return {"owned": len(self.owners), "charged_bytes": self.charged_bytes, "excess_bytes": self.excess_bytes,
                "excess_lookup_s": self.excess_lookup_s,
                "device_bytes_min": loads[0] if loads else 0, "device_bytes_max": loads[-1] if loads else 0,
                "even": dict(self.even)}


@dataclass(frozen=True)
class _Candidate:
    param: str
    fqn: str
    axes: tuple[int, ...]
    charged: int  # bytes per device the ILP charged (the balanced share)
    held: int  # bytes on the owner
    charged_s: float  # lookup seconds per device the ILP charged
    held_s: float  # lookup seconds on the owner


def _candidates(traced, built, choice: dict[str, str]) -> tuple[list[_Candidate], dict[str, str]]:
    shape = built.mesh.shape
    lookups: dict[str, list[tuple[tuple[int, ...], str]]] = {}
    seconds: dict[str, float] = {}
    for node in traced.gm.graph.nodes:
        if node.target in BAGS and node.name in choice:
            c = built.choice_of(node.name, choice[node.name])
            tw = table_wise_axes(c.input_specs, c.output_specs, shape)
            lookups.setdefault(node.args[0].name, []).append((tw, str(c.input_specs[0])))
            op = built.problem.node(node.name)
            seconds[node.args[0].name] = (seconds.get(node.args[0].name, 0.0)
                                          + op.options[op.option_index(choice[node.name])].compute_s)
    out, even = [], {}
    for param, reads in lookups.items():
        axes = reads[0][0]
        if not any(tw for tw, _ in reads):
            continue
        fqn = built.decision(param).module if param in choice else param
        reason = _why_even(traced, built, choice, param, reads)
        if reason:
            even[fqn] = reason
            continue
        c = built.choice_of(param, choice[param])
        node = built.problem.node(param)
        charged = node.options[node.option_index(choice[param])].param_bytes
        n = math.prod(shape[a] for a in axes)
        out.append(_Candidate(param, fqn, axes, charged, charged * n, seconds[param], seconds[param] * n))
    return out, even


def _why_even(traced, built, choice, param: str, reads) -> str:
    if param not in choice:
        return "the table is not a planned parameter"
    if len({r for r in reads}) > 1 or not reads[0][0]:
        return "its lookups read it in different layouts"
    users = [u for u in traced.node(param).users]
    if any(u.target not in BAGS for u in users):
        return "it is read by other ops than its lookups"
    c = built.choice_of(param, choice[param])
    if str(c.output_specs[0]) != reads[0][1]:
        return f"stored {c.output_specs[0]}, read {reads[0][1]} (a conversion would touch the owned table)"
    if c.zero_stage:
        return f"ZeRO-{c.zero_stage} splits it"
    if "off:" in choice[param]:
        return "it is offloaded"
    return ""


def partition(traced, built, choice: dict[str, str]) -> TablePartition:
    """Owners for the table-wise tables of ``choice`` (decision -> option name on ``built``)."""
    tables, even = _candidates(traced, built, choice)
    shape = built.mesh.shape
    loads = {c: 0 for c in itertools.product(*(range(n) for n in shape))}
    busy = dict.fromkeys(loads, 0.0)
    owners = {}
    for t in sorted(tables, key=lambda t: (-t.held, -t.held_s, t.fqn)):
        best = None
        for owner in itertools.product(*(range(shape[a]) for a in t.axes)):
            landing = [d for d in loads if all(d[a] == o for a, o in zip(t.axes, owner))]
            # Memory first (the budget is hard), then lookup time, then the emptier devices.
            key = (max(loads[d] for d in landing) + t.held, max(busy[d] for d in landing) + t.held_s,
                   sum(loads[d] for d in landing), owner)
            if best is None or key < best[0]:
                best = (key, owner, landing)
        _, owner, landing = best
        for d in landing:
            loads[d] += t.held
            busy[d] += t.held_s
        owners[t.param] = TableOwner(t.param, t.fqn, t.axes, owner)
    ordered = tuple(owners[t.param] for t in tables)
    return TablePartition(ordered, loads if tables else {}, sum(t.charged for t in tables), even,
                          busy if tables else {}, sum(t.charged_s for t in tables))


def with_tables(plan: Plan, placed: TablePartition) -> Plan:
    """``plan`` with its table owners, its peak and parameter bytes on the fullest device, and its
    step and compute seconds with the busiest device's lookups."""
    if not placed.owners and not placed.even:
        return plan
    excess, slow = placed.excess_bytes, placed.excess_lookup_s
    estimate = replace(plan.estimate, peak_bytes=plan.estimate.peak_bytes + excess,
                       param_bytes=plan.estimate.param_bytes + excess, step_s=plan.estimate.step_s + slow,
                       compute_s=plan.estimate.compute_s + slow)
    return replace(plan, tables=placed.owners, estimate=estimate, solver={**plan.solver, "tables": placed.info()})


def fit_tables(traced, built, rc, *, replan, progress=None):
    """``(rc, partition)``: the best of ``rc`` (``plan_recompute``'s outcome on ``built``) and up to
    ``MAX_TABLE_REFITS`` re-plans, judged with every table-wise table whole on its owner. A plan
    whose fullest device overflows the budget is re-solved under a budget lowered by the overflow;
    one whose busiest device's lookups exceed their charged share is re-solved with the tables of
    every device over its share priced at their whole lookup (``charge_lookups``), which the ILP
    then weighs against other placements. ValueError naming the overflow when no plan fits."""
    from autopar.planner.offload_fit import replace_budget

    budget = built.problem.budget_bytes
    best, current, placed, charged = None, built, None, False
    for attempt in range(MAX_TABLE_REFITS + 1):
        if charged:  # judged on the problem as priced, without the lookups charged for the re-solve
            rc = _on_priced_problem(built, rc)
        placed = partition(traced, built, rc.choice)
        over = rc.evaluation.peak_bytes + placed.excess_bytes - (budget or 0)
        fits = budget is None or over <= 0
        step = rc.evaluation.objective + placed.excess_lookup_s
        if fits and (best is None or step < best[0]):
            best = (step, rc, placed)
        # Worth a re-solve from 1% of the step; a Rotor plan's problem is its own (not re-priced).
        slow = placed.excess_lookup_s > 0.01 * rc.evaluation.objective and rc.method != "rotor"
        if attempt == MAX_TABLE_REFITS or (fits and not slow):
            break
        if not fits:
            # Leave the fullest device's overflow free, at least 1/64 of the budget lower each round.
            solved = current.problem.budget_bytes
            current = replace_budget(current, min(solved - over, solved - budget // 64))
            detail = f"owned tables put {placed.excess_bytes} B over the balanced share on one device"
        else:
            problem = charge_lookups(current.problem, built, traced, rc.choice, placed,
                                     slack=0.01 * rc.evaluation.objective)
            current, charged = replace(current, problem=problem), True
            detail = f"the busiest device's lookups take {placed.excess_lookup_s * 1e3:.3f} ms over their share"
        try:
            with (progress.stage(f"table refit {attempt + 1}", f"{detail}: re-solving")
                  if progress is not None else nullcontext()):
                rc = replan(current)
        except ValueError:
            break
    if best is None:
        raise ValueError(f"table-wise placement: with each table-wise table whole on one device, the fullest device "
                         f"needs {rc.evaluation.peak_bytes + placed.excess_bytes} B, over the budget {budget} B, "
                         f"after {MAX_TABLE_REFITS} re-solves under lower budgets. Give a larger budget.")
    return best[1], best[2]


def _on_priced_problem(built, rc):
    """``rc`` evaluated on ``built``'s own problem (a re-solve may have charged extra lookups)."""
    from autopar.planner.checkpointing import estimate

    if rc.method == "rotor":
        return rc
    ev = estimate(built, built.problem, rc.choice, rc.units, built.segment_inputs)
    return replace(rc, evaluation=ev, problem=built.problem)


def charge_lookups(problem, built, traced, choice: dict[str, str], placed: TablePartition, *, slack: float = 0.0):
    """``problem`` with the table-wise options of the tables owned by every device whose lookups
    exceed their charged share by more than ``slack`` seconds priced at the owner's whole lookup
    (their compute times the devices they are table-wise over)."""
    slow = {d for d, s in placed.device_lookup_s.items() if s - placed.charged_lookup_s > slack}
    mine = {t.param for t in placed.owners
            if any(all(d[a] == c for a, c in zip(t.axes, t.owner)) for d in slow)}
    shape = built.mesh.shape
    nodes = []
    for node in problem.nodes:
        fx_node = traced.node(node.name) if node.name in choice else None
        charged = node.signature.endswith("|whole lookup")
        if fx_node is None or fx_node.target not in BAGS or fx_node.args[0].name not in mine or charged:
            nodes.append(node)
            continue
        options = []
        for option, c in zip(node.options, built.decision(node.name).choices):
            tw = table_wise_axes(c.input_specs, c.output_specs, shape)
            n = math.prod(shape[a] for a in tw)
            options.append(replace(option, compute_s=option.compute_s * n) if tw else option)
        # Its own signature: no longer interchangeable with an uncharged twin table.
        nodes.append(replace(node, options=tuple(options), signature=f"{node.signature}|whole lookup"))
    return replace(problem, nodes=tuple(nodes))
