"""Parameter copies a reader gathers and keeps for backward (``planner.gathered``): which inputs
an op saves, the bytes a choice keeps, and the plan's peak and budget with them."""

from __future__ import annotations

import torch
from torch import nn

from autopar.layout.mesh import MeshSpec
from autopar.planner.builder import build_problem
from autopar.planner.gathered import gathered_bytes, saved_slots, with_gathered
from autopar.plans import NodeKind
from autopar.strategies import input_nodes
from autopar.tracer import profile, trace


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 256)
        self.down = nn.Linear(256, 64)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))).pow(2).mean()


def _built(mesh=(2,)):
    traced = trace(Mlp(), (torch.randn(32, 64),))
    return traced, build_problem(traced, profile(traced), MeshSpec.preset("cpu", mesh), budget_bytes=None)


def test_saved_slots_are_read_off_torch():
    traced, _ = _built()
    for node in traced.nodes:
        if node.op != "call_function" or "addmm" not in str(node.target):
            continue
        names = [s.name for s in input_nodes(node)]  # bias, input, weight (transposed view)
        saved = {names[i] for i in saved_slots(node)}
        assert names[0] not in saved and names[1] in saved and names[2] in saved, (names, saved)


def test_a_gathered_weight_a_matmul_saves_counts_its_gathered_bytes():
    traced, built = _built()
    problem = built.problem
    # Every decision at its first option, then the up-projection's weight stored split by rows
    # (a ZeRO-3-like layout) while its reader takes it whole.
    choice = {n.name: n.options[0].name for n in problem.nodes}
    base = gathered_bytes(traced, built, choice)
    weight = next(n for n in problem.nodes if built.decision(n.name).kind == NodeKind.PARAMETER
                  and n.name.endswith("up_weight"))
    split = next(o.name for o in weight.options
                 if str(built.choice_of(weight.name, o.name).output_specs[0]) == "S0")
    whole = next(o.name for o in weight.options
                 if str(built.choice_of(weight.name, o.name).output_specs[0]) == "R")
    readers = [n for n in problem.nodes if built.decision(n.name).kind == NodeKind.OP
               and any(v is not None and v.producer == weight.name for v in built.decision(n.name).inputs)]
    assert readers
    kept = sum(1 for r in readers for slot in saved_slots(next(x for x in traced.nodes if x.name == r.name))
               if built.decision(r.name).inputs[slot] is not None
               and built.decision(r.name).inputs[slot].producer == weight.name
               and str(built.choice_of(r.name, choice[r.name]).input_specs[slot]) == "R")
    as_whole = gathered_bytes(traced, built, {**choice, weight.name: whole})
    as_split = gathered_bytes(traced, built, {**choice, weight.name: split})
    assert as_whole == base or weight.name not in choice  # stored whole: nothing is gathered for it
    assert as_split - as_whole == kept * 256 * 64 * 4  # each reader that saves it whole keeps one copy
    # A reader inside a recompute region keeps nothing: the region re-gathers in backward.
    region = type("Region", (), {"nodes": tuple(r.name for r in readers)})()
    assert gathered_bytes(traced, built, {**choice, weight.name: split}, regions=(region,)) == as_whole


def test_with_gathered_raises_the_peak_by_exactly_the_copies():
    from autopar.solver.timeline import Evaluation

    ev = Evaluation(1.0, 1.0, 0.0, 0.0, 100, (5, 40, 10))
    assert with_gathered(ev, 7).peak_bytes == 147 and with_gathered(ev, 0) is ev
