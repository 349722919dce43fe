"""coverage(): which ATen ops a traced model uses, and how often.

The table is later joined with the strategy registry ("has sharding rule") by passing
``has_rule`` to :func:`format_coverage`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from autopar.tracer.graph import TracedGraph, op_name


@dataclass(frozen=True, slots=True)
class OpCount:
    op: str            # e.g. "aten.addmm.default"
    count: int
    first_node: str    # name of the first node using it (to find an example)
    first_module: str  # module path of that node

    def __str__(self) -> str:
        return f"{self.op} x{self.count} (first: {self.first_node} in {self.first_module or '<root>'})"


def coverage(traced: TracedGraph) -> tuple[OpCount, ...]:
    """Each distinct op of the graph's call_function nodes, most frequent first (ties by name)."""
    counts: dict[str, int] = {}
    first: dict[str, tuple[str, str]] = {}
    for node in traced.compute_nodes():
        name = op_name(node)
        counts[name] = counts.get(name, 0) + 1
        first.setdefault(name, (node.name, traced.module_path(node)))
    return tuple(
        OpCount(op=name, count=count, first_node=first[name][0], first_module=first[name][1])
        for name, count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    )


def format_coverage(table: tuple[OpCount, ...], *,
                    has_rule: Callable[[str], bool] | None = None) -> str:
    """A fixed-width text table; with ``has_rule`` a third column says whether a rule exists."""
    width = max((len(row.op) for row in table), default=2)
    header = f"{'op':<{width}}  {'count':>5}" + ("  rule" if has_rule else "")
    lines = [header, "-" * len(header)]
    for row in table:
        line = f"{row.op:<{width}}  {row.count:>5}"
        if has_rule:
            line += "  " + ("yes" if has_rule(row.op) else "MISSING")
        lines.append(line)
    lines.append(f"{len(table)} distinct ops, {sum(r.count for r in table)} op nodes")
    return "\n".join(lines)
