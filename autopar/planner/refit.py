"""The planner's side of ``refine=True``: what a plan priced, the profile refit to what the steps
measured, and the re-plan under it.

``priced_parts`` reads a plan's estimate apart the way the runtime measures a step
(``autopar.runtime.refine.StepTimes``): compute seconds per op class (each op's chosen option's
``compute_s``, classed by ``strategies.combine.op_class``) and link seconds: the estimate's in-op
communication plus its layout conversions, less the asynchronous part priced hidden under compute:
the measured figure is the time collectives held the step (a synchronous one's wait, which
``MachineProfile.blocking_s`` prices, and an asynchronous one's exposed wait), read as the wall
time of the runtime's communication functions, so their local copies (a conversion's ``split``,
priced as communication) are in both.

``refit_mesh`` scales the mesh's profile by measured / priced, per part:

- each measured op class's time (``MachineProfile.time_scale``: a factor on every kernel of the
  class, the per-kernel floor included, so the refit mesh prices this plan's compute at what was
  measured; a mesh without a profile gets one holding only the factors, which leaves the rest of
  its pricing as it was);
- every link's ``alpha`` and ``beta`` (the axis's and each per-kind ``LinkFit``, over one axis or
  several), each axis's ``blocking_s`` (and each set of axes' ``blocking_over``) and a pipeline
  transfer's measured latency (``pipeline_transfer_s``) by the
  communication ratio: the profiler does not say which mesh axis or which byte count a collective
  served, so the links are scaled together, keeping their measured shape.

A part the plan does not price or the step did not run (no collective in a replicated plan) keeps
its figures.

``replan`` plans again on the refit mesh and prices the current plan there too (its own choice on
the refit problem), so the two predictions come from one model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Mapping

from autopar.layout.machine import OP_CLASSES, ComputeProfile, MachineProfile
from autopar.layout.mesh import MeshSpec
from autopar.planner.options import PlanOptions
from autopar.plans import NodeKind, Plan

if TYPE_CHECKING:
    from autopar.planner.records import BuiltProblem
    from autopar.tracer.graph import TracedGraph
    from autopar.tracer.profile import ModelProfile

__all__ = ["Priced", "Refit", "check_refinable", "priced_parts", "refit_mesh", "replan"]

@dataclass(frozen=True, slots=True)
class Priced:
    """What a plan priced per step: compute seconds per op class, seconds on the links."""

    compute: Mapping[str, float]
    comm: float


@dataclass(frozen=True, slots=True)
class Refit:
    """The outcome of one refinement: the refit mesh, the current plan's and the best plan's
    predicted step under it, and that plan (the current one when nothing beats it)."""

    mesh: MeshSpec
    current_s: float
    best_s: float
    plan: Plan
    ratios: Mapping[str, float]  # measured / priced per part refit ("comm" and op classes)

    @property
    def gain(self) -> float:
        """The predicted step saved by the best plan, as a share of the current plan's."""
        return (self.current_s - self.best_s) / self.current_s if self.current_s > 0 else 0.0


def check_refinable(plan: Plan) -> None:
    """``NotImplementedError`` for a plan ``refine`` cannot re-plan and carry the state of."""
    if plan.pipeline is not None:
        raise NotImplementedError("refine=True: a pipelined plan (pipeline=) is not refined; leave refine off")
    if plan.offload:
        raise NotImplementedError("refine=True: a plan that offloads (offload=) runs in the chunk runtime, which "
                                  "refine does not rebuild; leave refine off")
    if plan.recompute and plan.checkpoint.get("method") != "ilp":
        raise NotImplementedError(
            f"refine=True: the plan recomputes {len(plan.recompute)} regions chosen by "
            f"{plan.checkpoint.get('method')!r} (e.g. {plan.recompute[0].name!r}), which the refit cannot price "
            f"on a new mesh; plan with checkpoint='ilp' or 'none', or leave refine off")


def _choice(plan: Plan) -> dict[str, str]:
    return {n.name: n.strategy for n in plan.nodes}


def _evaluate(built: BuiltProblem, plan: Plan):
    """The cost-model evaluation of ``plan``'s own choice and recompute units on ``built``."""
    from autopar.planner.checkpointing import estimate

    try:
        return estimate(built, built.problem, _choice(plan), tuple(r.name for r in plan.recompute),
                        built.segment_inputs)
    except KeyError as exc:
        raise ValueError(f"refine: the plan's option {exc} is not an option of the re-built problem (the plan was "
                         f"made by another autopar version?)") from None


def priced_parts(traced: TracedGraph, prof: ModelProfile, plan: Plan, *, options: PlanOptions,
                 mesh: MeshSpec | None = None) -> Priced:
    """``plan``'s step as priced on ``mesh`` (default its own), in the measured parts (module docstring)."""
    from autopar.planner.builder import build_problem
    from autopar.strategies.combine import op_class

    mesh = plan.mesh if mesh is None else mesh
    # segmented: a restricted Megatron-style plan's fused projections are S(d/k) options, which
    # only a segmented problem offers (it offers every other option as well).
    built = build_problem(traced, prof, mesh, budget_bytes=options.budget_bytes(mesh), options=options,
                          segmented=True)
    ev = _evaluate(built, plan)
    choice = _choice(plan)
    compute = dict.fromkeys(OP_CLASSES, 0.0)
    for node in built.problem.nodes:
        if built.decision(node.name).kind == NodeKind.OP:
            option = node.options[node.option_index(choice[node.name])]
            compute[op_class(traced.node(node.name).target)] += option.compute_s
    return Priced(compute, max(ev.comm_s + ev.reshard_s - ev.hidden_s, 0.0))


def _ratio(measured: float, priced: float) -> float | None:
    return measured / priced if measured > 0 and priced > 0 else None


def refit_mesh(mesh: MeshSpec, *, measured: Mapping[str, float], measured_comm: float,
               priced: Priced) -> tuple[MeshSpec, dict[str, float]]:
    """``mesh`` with its profile scaled to the measured parts (module docstring); the ratios used."""
    ratios = {c: r for c in OP_CLASSES if (r := _ratio(measured.get(c, 0.0), priced.compute.get(c, 0.0))) is not None}
    comm = _ratio(measured_comm, priced.comm)
    machine = mesh.machine or MachineProfile(ComputeProfile(()), (), mesh.shape, mesh.axis_names)
    scale = tuple((c, machine.scale_of(c) * ratios.get(c, 1.0)) for c in OP_CLASSES
                  if c in ratios or machine.scale_of(c) != 1.0)
    links, alpha, beta, blocking = machine.links, mesh.alpha, mesh.beta, machine.blocking_s
    if comm is not None:
        ratios["comm"] = comm
        links = tuple(replace(f, alpha=f.alpha * comm, beta=f.beta * comm) for f in links)
        alpha, beta = tuple(a * comm for a in alpha), tuple(b * comm for b in beta)
        blocking = tuple(b * comm for b in blocking)
        transfer = None if machine.pipeline_transfer_s is None else machine.pipeline_transfer_s * comm
        machine = replace(machine, blocking_over=tuple((axes, b * comm) for axes, b in machine.blocking_over),
                          pipeline_transfer_s=transfer)
    note = "refit to measured steps: " + ", ".join(f"{k} x{v:.3g}" for k, v in ratios.items())
    machine = replace(machine, links=links, blocking_s=blocking, time_scale=scale,
                      note=f"{machine.note}; {note}" if machine.note else note)
    return replace(mesh, alpha=alpha, beta=beta, machine=machine, name=f"{mesh.name} (refit)"), ratios


def replan(traced: TracedGraph, prof: ModelProfile, plan: Plan, *, options: PlanOptions,
           measured: Mapping[str, float], measured_comm: float) -> Refit:
    """Refit ``plan``'s mesh to the measured step, plan again on it, and price both plans there."""
    from autopar.planner.orchestrate import plan_traced

    options = replace(options, baselines=False)
    priced = priced_parts(traced, prof, plan, options=options)
    mesh, ratios = refit_mesh(plan.mesh, measured=measured, measured_comm=measured_comm, priced=priced)
    result = plan_traced(traced, prof, mesh=mesh, options=options)
    current = _evaluate(result.built, plan).objective
    best = result.plan.estimate.step_s
    if _choice(result.plan) == _choice(plan) or best >= current:
        return Refit(mesh, current, current, plan, ratios)
    return Refit(mesh, current, best, result.plan, ratios)
