"""What a chosen plan executes per step, as the runtime emits it (``runtime.passes``).

The emitted graph converts a value to a layout ONCE for all the consumers that read it there,
and sums a partial gradient ONCE per (value, layout, mesh axes): the consumers' gradients meet
in autograd before the all-reduce (or, for a ZeRO-2 parameter read in its own layout, the
reduce-scatter into its pieces). The ILP prices each consumer's conversion and gradient sum on
its own -- its costs are per option and per edge -- so it counts a shared one once per consumer
(an over-estimate, e.g. the three projections reading one normalised activation).
``Plan.estimate`` (``planner.checkpointing.estimate``) and the inspect report count what runs:
``shared_savings`` is the difference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from autopar.layout.placement import TensorSpec
from autopar.plans import NodeKind
from autopar.planner.records import BuiltProblem, ChosenConversion, InputSlot
from autopar.strategies import Strategy

__all__ = ["GradSync", "grad_syncs", "unique_conversions", "shared_savings"]


@dataclass(frozen=True, slots=True)
class GradSync:
    """The backward sum of one value's partial gradient, read as ``spec`` by ``consumer``'s
    ``slot`` (the first consumer; later ones share it): an all-reduce over ``axes``, or a
    reduce-scatter into the pieces of a ZeRO-2 parameter read in its own layout."""

    consumer: str
    slot: int
    value: InputSlot
    spec: TensorSpec
    axes: tuple[int, ...]
    strategy: Strategy
    kind: str  # all_reduce | reduce_scatter

    def seconds(self, mesh) -> float:
        return self.strategy.grad_sync_s(self.slot, mesh, self.kind)


def _zero2_layouts(built: BuiltProblem, choice: Mapping[str, str]) -> dict[str, TensorSpec]:
    out = {}
    for name, d in built.decisions.items():
        if d.kind == NodeKind.PARAMETER:
            c = built.choice_of(name, choice[name])
            if c.zero_stage == 2:
                out[name] = c.output_specs[0]
    return out


def grad_syncs(built: BuiltProblem, choice: Mapping[str, str]) -> tuple[list[GradSync], list[GradSync]]:
    """(the gradient sums the runtime issues, the consumers' uses that share one of them)."""
    zero2 = _zero2_layouts(built, choice)
    first: dict[tuple, GradSync] = {}
    shared: list[GradSync] = []
    for name, d in built.decisions.items():
        if d.kind != NodeKind.OP:
            continue
        c = built.choice_of(name, choice[name])
        s = c.strategy
        for slot, axes in enumerate(s.grad_partial_axes if s is not None else ()):
            value = d.inputs[slot]
            if not axes or value is None:
                continue
            spec = c.input_specs[slot]
            kind = "reduce_scatter" if zero2.get(value.producer) == spec else "all_reduce"
            sync = GradSync(name, slot, value, spec, tuple(axes), s, kind)
            key = (value.producer, value.index, str(spec), tuple(axes))
            if key in first:
                shared.append(sync)
            else:
                first[key] = sync
    return list(first.values()), shared


def unique_conversions(built: BuiltProblem,
                       choice: Mapping[str, str]) -> tuple[list[ChosenConversion], list[ChosenConversion]]:
    """(the conversions the runtime runs, the consumers' edges that reuse one of them)."""
    first: dict[tuple, ChosenConversion] = {}
    shared: list[ChosenConversion] = []
    for cc in built.conversions(choice):
        value = built.decisions[cc.consumer].inputs[cc.slot]
        key = (value.producer, value.index, str(cc.conversion.dst))
        if key in first:
            shared.append(cc)
        else:
            first[key] = cc
    return list(first.values()), shared


def shared_savings(built: BuiltProblem, choice: Mapping[str, str]) -> tuple[float, float]:
    """(in-op, resharding) seconds the ILP's per-consumer pricing counts beyond what runs."""
    _, syncs = grad_syncs(built, choice)
    _, convs = unique_conversions(built, choice)
    return (sum(s.seconds(built.mesh) for s in syncs),
            sum(c.conversion.forward_s + c.conversion.backward_s for c in convs))
