"""Embedding tables in a plan: each ``_embedding_bag`` lookup's table, its placement per mesh axis,
that placement in TorchRec's words (``autopar/strategies/_embedding_bag.py`` maps the two), and
for a table-wise table the device that holds it whole (``Plan.tables``).

The per-layer section collapses the tables of a recommendation model into one repeated block; a
user placing tables wants one line per table, so the report lists them here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.plans import Plan

__all__ = ["TableRow", "embedding_tables", "torchrec_name"]

_BAGS = {str(torch.ops.aten._embedding_bag.default), str(torch.ops.aten._embedding_bag_forward_only.default)}
_MODES = {0: "sum", 1: "mean", 2: "max"}


@dataclass(frozen=True)
class TableRow:
    module: str
    rows: int
    dim: int
    mode: str
    weight_spec: str  # the table's placement per mesh axis, e.g. "S0S1"
    placement: str  # in TorchRec's words, per axis
    owner: str = ""  # a table-wise table's device, e.g. "ax0=1" (coordinate per owned axis); "" otherwise


def torchrec_name(weight_spec: str, output_spec: str, axis_names: tuple[str, ...]) -> str:
    """``S0R`` / ``(PR, ...)`` -> "row-wise over ax0, replicated over ax1": per axis, a row split with
    a partial output is row-wise, a row split with a batch-split output table-wise, a column split
    column-wise, a replicated table pooling a slice of the batch data-parallel, a replicated table
    doing the whole lookup on every device replicated."""
    def placements(spec: str) -> list[str]:
        out, i = [], 0
        while i < len(spec):
            step = 2 if spec[i] == "S" else 1
            out.append(spec[i:i + step])
            i += step
        return out

    weight, output = placements(weight_spec), placements(output_spec)
    words = []
    for axis, w, o in zip(axis_names, weight, output):
        if w == "S0":
            kind = "table-wise" if o == "S0" else "row-wise"
        else:
            kind = {"S1": "column-wise"}.get(w) or ("data-parallel" if o == "S0" else "replicated")
        words.append(f"{kind} over {axis}")
    return ", ".join(words)


def embedding_tables(plan: Plan, traced) -> list[TableRow]:
    """One row per ``_embedding_bag`` decision of ``plan`` (graph order); ``traced``: its trace."""
    rows = []
    names = tuple(plan.mesh.axis_names)
    owners = {t.param: ", ".join(f"{names[a]}={c}" for a, c in zip(t.axes, t.owner)) for t in plan.tables}
    for n in plan.nodes:
        if n.op not in _BAGS:
            continue
        node = traced.node(n.name)
        rows_, dim = node.args[0].meta["val"].shape  # the schema's first argument: the table
        mode = node.args[4] if len(node.args) > 4 else node.kwargs.get("mode", 0)
        out_spec = n.output_specs[0] or ""
        rows.append(TableRow(n.module, int(rows_), int(dim), _MODES.get(mode, str(mode)), n.input_specs[0] or "",
                             torchrec_name(n.input_specs[0] or "", out_spec, names),
                             owners.get(node.args[0].name, "")))
    return rows

