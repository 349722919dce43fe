"""The planner's intermediate form: what ``build_problem`` returns, one record per decision.

``BuiltProblem`` pairs the solver's plain-data ``Problem`` (costs, liveness, segments) with what
the rest of the planner needs to turn a solved choice back into layouts: per decision node a
``Decision`` (its kind, its options as ``Choice``s, the values its input slots read), where each
graph value comes from (``sources``), and the inputs each recompute segment keeps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from autopar.layout.conversion import Conversion, plan_conversion
from autopar.layout.mesh import MeshSpec
from autopar.layout.placement import TensorSpec
from autopar.plans import NodeKind
from autopar.solver.problem import Problem
from autopar.solver.timeline import SegmentInput
from autopar.strategies import Strategy

__all__ = ["BuiltProblem", "Choice", "ChosenConversion", "Decision", "InputSlot"]

# (spec, shape, mesh shape, itemsize) -> local bytes: every block asks again for the same few
# (segment inputs price each choice of each value they keep); bounded by the distinct shapes.
_LOCAL_BYTES: dict[tuple, int] = {}


@dataclass(frozen=True, slots=True)
class Choice:
    """One option of one decision, as the runtime needs it (the ``Problem`` has the costs)."""

    name: str
    output_specs: tuple[TensorSpec | None, ...]
    strategy: Strategy | None = None  # None for placeholders (a layout only) and the output
    inputs: tuple[TensorSpec | None, ...] = ()  # what the graph output requires of each value
    zero_stage: int = 0  # parameters: the ZeRO stage this option keeps (autopar.runtime.zero)

    @property
    def input_specs(self) -> tuple[TensorSpec | None, ...]:
        return self.strategy.input_specs if self.strategy is not None else self.inputs

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True, slots=True)
class InputSlot:
    """The value one input slot of a decision reads: output ``index`` of decision ``producer``,
    a tensor of global ``shape`` with ``itemsize`` bytes per element."""

    producer: str
    index: int
    shape: tuple[int, ...]
    itemsize: int

    def local_bytes(self, spec: TensorSpec, mesh_shape: tuple[int, ...]) -> int:
        """Bytes per device of this value laid out as ``spec``."""
        key = (str(spec), self.shape, tuple(mesh_shape), self.itemsize)
        nbytes = _LOCAL_BYTES.get(key)
        if nbytes is None:
            nbytes = _LOCAL_BYTES[key] = int(math.prod(spec.local_shape(self.shape, mesh_shape)) * self.itemsize)
        return nbytes

    def __str__(self) -> str:
        return f"{self.producer}[{self.index}]: {list(self.shape)} x {self.itemsize} B"


@dataclass(frozen=True, slots=True)
class Decision:
    """One decision node of the ``Problem``.

    choices: its options, in the order of the ``Problem`` node's options (``BuiltProblem.choice_of``
             looks one up by option name).
    inputs:  per input slot (as ``Choice.input_specs``), the value it reads; None for a slot that
             reads no laid-out tensor (a SymInt, a non-tensor constant).
    module:  the owning module path of an op ("" at top level), the FQN of a placeholder, None for
             the graph output.
    op:      the ATen overload of an op ("" otherwise).
    bucketed: the input slots whose partial gradient the cost model counts asynchronous (a
             parameter's, read directly: ``autopar.planner.builder``).
    """

    name: str
    kind: NodeKind
    choices: tuple[Choice, ...]
    inputs: tuple[InputSlot | None, ...] = ()
    module: str | None = None
    op: str = ""
    bucketed: tuple[int, ...] = ()

    def __str__(self) -> str:
        where = f" @ {self.module}" if self.module else ""
        return f"{self.kind} {self.name}{where}: {len(self.choices)} options"


@dataclass(frozen=True, slots=True)
class ChosenConversion:
    """A layout conversion a chosen plan runs on the edge into input ``slot`` of ``consumer``."""

    consumer: str
    slot: int
    producer: str
    conversion: Conversion

    def __str__(self) -> str:
        return f"{self.producer} -> {self.consumer}[{self.slot}]: {self.conversion}"


@dataclass(frozen=True, slots=True, kw_only=True)
class BuiltProblem:
    """What ``build_problem`` returns (module docstring).

    decisions:      decision node name -> its ``Decision``, in graph order (as ``problem.nodes``).
    sources:        graph value name -> (decision, output index) holding it; a ``getitem`` resolves
                    to its producer's output element.
    fallbacks:      op nodes replicated without a sharding rule (opt-in).
    segment_inputs: recompute segment or block -> the inputs it keeps when recomputed.
    """

    problem: Problem
    decisions: Mapping[str, Decision]
    sources: Mapping[str, tuple[str, int]]
    fallbacks: tuple[str, ...]
    mesh: MeshSpec
    segment_inputs: Mapping[str, tuple[SegmentInput, ...]]
    bucket_cap: int = 0  # bytes per gradient bucket the sums were priced for (``layout.buckets``; 0: none)
    gather_cap: int = 0  # bytes per ZeRO all-gather bucket the gathers were priced for (``zero_gather_cap``)
    exposed: frozenset[str] = frozenset()  # parameters of the last gradient bucket (``executed.last_bucket_params``)

    def decision(self, name: str) -> Decision:
        try:
            return self.decisions[name]
        except KeyError:
            raise KeyError(f"{name!r} is not a decision node of the built problem") from None

    def choice_of(self, name: str, option: str) -> Choice:
        """The ``Choice`` of decision ``name`` behind the ``Problem`` option named ``option``."""
        return self.decision(name).choices[self.problem.node(name).option_index(option)]

    def conversions(self, choice: Mapping[str, str]) -> list[ChosenConversion]:
        """The layout conversions a full choice (decision name -> option name) executes."""
        out = []
        chosen: dict[str, Choice] = {}
        # (id(src spec), id(dst spec), shape, itemsize) -> its conversion (None: same layout).
        # Repeated blocks share their choices, so their specs: each pair is looked at once.
        convs: dict[tuple, Conversion | None] = {}

        def pick(name: str) -> Choice:
            c = chosen.get(name)
            if c is None:
                c = chosen[name] = self.choice_of(name, choice[name])
            return c

        for dst in self.decisions.values():
            if all(value is None for value in dst.inputs):
                continue
            dst_choice = pick(dst.name)
            for slot, value in enumerate(dst.inputs):
                if value is None:
                    continue
                a = pick(value.producer).output_specs[value.index]
                b = dst_choice.input_specs[slot]
                if a is None or b is None:
                    continue
                key = (id(a), id(b), value.shape, value.itemsize)
                if key in convs:
                    conv = convs[key]
                else:
                    conv = convs[key] = None if a == b else plan_conversion(a, b, value.shape, value.itemsize,
                                                                              self.mesh)
                if conv is not None:
                    out.append(ChosenConversion(dst.name, slot, value.producer, conv))
        return out

    def __str__(self) -> str:
        return (f"BuiltProblem({len(self.decisions)} decisions, {len(self.segment_inputs)} segments, "
                f"mesh {self.mesh}: {self.problem})")
