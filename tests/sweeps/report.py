"""Sweep results for humans: the per-entry table and the failures grouped by cause."""

from __future__ import annotations

from typing import Sequence

from .harness import Result


def format_table(results: Sequence[Result]) -> str:
    """model | trace | planned | fallback nodes | missing ops | e2e, one row per entry. A plan
    that replicates every op is marked ``(R)`` after its mesh: its check is data movement only."""
    rows = [("model", "trace", "planned", "fallback", "missing ops", "e2e")]
    for r in results:
        planned = ",".join(f"{k}:{'ok' if m.strict else ('fb' if m.planned else 'ERR')}"
                           + ("(R)" if m.sharded is False else "")
                           for k, m in r.meshes.items()) or "-"
        fb = max((m.fallback_nodes for m in r.meshes.values()), default=0)
        e2e = ",".join(f"{k}:{'ok' if m.match else ('-' if m.errors is None else 'FAIL')}"
                       for k, m in r.meshes.items()) or "-"
        rows.append((r.name, "ok" if r.traced else "ERR", planned, str(fb),
                     " ".join(sorted(r.missing_ops)) or "-", e2e))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row[:5], widths)) + "  " + row[5] for row in rows]
    return "\n".join(lines)


def group_failures(results: Sequence[Result]) -> dict[str, list[str]]:
    """Cause -> entry names, for entries that are not ``strict_ok``. A missing op is its own
    cause (an entry with two missing ops is listed under both)."""
    groups: dict[str, list[str]] = {}
    for r in results:
        if r.strict_ok:
            continue
        keys = []
        if r.trace_error:
            keys.append("trace error: " + r.trace_error.split(" module:")[0][:160])
        elif r.ref_error:
            keys.append("reference: " + r.ref_error[:160])
        else:
            keys += [f"missing rule {op}" for op in sorted(r.missing_ops)]
            for m in r.meshes.values():
                if m.plan_error:
                    keys.append("plan error: " + m.plan_error[:160])
                elif m.errors:
                    first = m.errors[0]
                    kind = "e2e raised" if first.startswith(("raised", "hung", "the launch")) else "e2e mismatch"
                    # a mismatch is grouped by what differs (loss / grad / buffer), not by name
                    what = first[:160] if kind == "e2e raised" else first.split(" ")[0] + " differs"
                    keys.append(f"{kind} ({'strict' if m.strict else 'fallback'} plan): {what}")
        for k in dict.fromkeys(keys):
            groups.setdefault(k, []).append(r.name)
    return dict(sorted(groups.items(), key=lambda kv: -len(kv[1])))


def format_failures(results: Sequence[Result]) -> str:
    lines = []
    for cause, names in group_failures(results).items():
        lines.append(f"[{len(names)}] {cause}: {', '.join(names)}")
    return "\n".join(lines)


def replicated_plans(results: dict[str, Result]) -> list[str]:
    """Entries that planned strictly but kept every op replicated on some mesh: no rule was
    exercised there (the sweep mesh prices compute far above communication to prevent it)."""
    return [f"{name} on mesh {', '.join(r.replicated_meshes)}" for name, r in results.items()
            if r.strict_ok and r.replicated_meshes]
