"""Table-wise embedding tables on real gloo ranks: each table whole on ONE device of its axes.

The zoo's tiny DLRM (four tables pooling by sum, mean, max and sum over jagged bags) is planned
with every table's lookup pinned table-wise (``fixed``: table and pooled output ``Shard(0)`` on an
axis), with a mix of table-wise, row-wise, column-wise and data-parallel tables, and with every
table table-wise on every axis (each on one device of the mesh: ``planner.table_families``) or,
on (2, 2), data-parallel over axis 0 and table-wise over axis 1; the planner's partition
(``planner.table_partition``) names an owner per table-wise table (``Plan.tables``). On (2,) and
(2, 2), every rank checks: the owner holds the whole table and its peers none; ``verify`` agrees
with the all-replicated run; the loss, every gradient, the global gradient norm before each of 5
clipped AdamW steps, the full state after them (each table gathered from its owner) and a reload
of that state match the single-device model; the optimizer holds state for a table only on its
owner, and the Booster's DCP optimizer checkpoint refuses it. (2,) runs with the whole sweeps
(``pytest -m full_sweep``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from autopar import zoo
from autopar.api import PlanOptions, plan_traced
from autopar.booster.checkpoint_io import _refuse_uneven
from autopar.layout.placement import Partial, Replicate, Shard
from autopar.planner.table_families import table_family_plan
from autopar.plans import Plan
from autopar.runtime.build import build_module
from autopar.runtime.launch import run_local
from autopar.runtime.verify import verify_module
from autopar.strategies import needs_decomposition
from autopar.tracer import profile, trace
from tests.runtime.test_dlrm import pin
from tests.runtime.test_dtensor import grad_layout_errors, layout_errors
from tests.runtime.test_e2e import compare, loss_of
from tests.runtime.test_e2e import reference as e2e_reference

pytestmark = pytest.mark.slow

STEPS, LR, EPS, MAX_NORM = 5, 1e-3, 1e-5, 0.5
TABLE, ROW, COLUMN, DATA = (Shard(0), Shard(0)), (Shard(0), Partial()), (Shard(1), Shard(1)), (Replicate(), Shard(0))
PINNED = {
    "all table-wise": (TABLE, TABLE, TABLE, TABLE),
    "mixed": (TABLE, ROW, COLUMN, TABLE),
    "mixed, max table-wise": (DATA, TABLE, TABLE, ROW),
}


def reference(model, inputs) -> dict:
    return e2e_reference(model, inputs, steps=STEPS)


def _ownership_errors(label, pm, plan) -> list[str]:
    errors = []
    coord = pm.pmesh.coordinate
    params = pm.parameters_by_fqn()
    for t in plan.tables:
        local = params[t.fqn].to_local()
        owner = all(coord[a] == c for a, c in zip(t.axes, t.owner))
        rows = params[t.fqn].shape[0]
        if owner and local.shape[0] * _row_split(pm, t) != rows or not owner and local.numel():
            errors.append(f"{label}: {t.fqn} has {tuple(local.shape)} on {coord} (owner {t})")
    return errors


def _row_split(pm, t) -> int:
    """How many ways the owner's table is still split by rows (a row-wise axis beside the owned ones)."""
    spec = pm.local_specs()[t.fqn]
    n = 1
    for a in spec.shard_axes(0):
        n *= 1 if a in t.axes else pm.pmesh.shape[a]
    return n


def _train(rank, world, model, traced, plans, inputs, ref):
    errors = []
    for label, text in plans:
        plan = Plan.from_json(text)  # what a saved plan gives: the owners survive JSON
        pm = build_module(model, traced, plan, device=torch.device("cpu"))
        errors += layout_errors(pm, label) + _ownership_errors(label, pm, plan)
        verify_module(pm, inputs)  # autopar's own check against the all-replicated run agrees
        opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS, foreach=True)
        loss = loss_of(pm(**inputs))
        loss.backward()
        errors += compare(label, "loss", loss.detach(), ref["loss"]) + grad_layout_errors(pm, label)
        grads = pm.full_gradients()
        for k, want in ref["grads"].items():
            errors += compare(label, f"grad {k}", grads.get(k), want)
        for step in range(STEPS):
            if step:
                opt.zero_grad()
                loss_of(pm(**inputs)).backward()
            norm = torch.nn.utils.clip_grad_norm_(pm.parameters(), MAX_NORM)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            errors += compare(label, f"gradient norm at step {step}", norm, torch.tensor(ref["norms"][step]))
            opt.step()
        errors += _state_errors(label, pm, opt, plan, ref)
    return errors


def _state_errors(label, pm, opt, plan, ref) -> list[str]:
    errors = []
    params = pm.parameters_by_fqn()
    for t in plan.tables:  # the optimizer's state for a table lives where the table does
        held = params[t.fqn].to_local().numel()
        for key, value in opt.state[params[t.fqn]].items():
            if key != "step" and value.to_local().numel() != held:
                errors.append(f"{label}: {key} of {t.fqn} has {value.to_local().numel()} elements here, table {held}")
    try:  # DCP cannot describe a table whole on one device: the Booster's optimizer checkpoint says so
        _refuse_uneven(SimpleNamespace(optim=opt))
        errors += [f"{label}: an optimizer over table-wise tables passed the DCP check"] if plan.tables else []
    except NotImplementedError as exc:
        errors += [] if plan.tables and "table-wise" in str(exc) else [f"{label}: {exc}"]
    state = pm.full_state_dict()
    for k, want in ref["state"].items():
        errors += compare(label, f"state {k} after {STEPS} steps", state.get(k), want, atol=1e-5)
    pm.load_full_state_dict({k: torch.zeros_like(v) for k, v in state.items()})
    pm.load_full_state_dict(state)
    again = pm.full_state_dict()
    errors += [f"{label}: {k} changed by a save and reload" for k in state if not torch.equal(state[k], again[k])]
    return errors


# (2,) with the whole sweeps: (2, 2) pins the same placements on axis 0, puts every table
# table-wise on both axes and adds data-parallel x table-wise.
@pytest.mark.parametrize("shape", [pytest.param((2,), marks=pytest.mark.full_sweep), (2, 2)])
def test_table_wise_dlrm_trains_like_one_device(shape):
    torch.manual_seed(0)
    model, inputs = zoo.build("dlrm", tiny=True, device="cpu")
    traced = trace(model, inputs, decompose_if=needs_decomposition)
    prof = profile(traced)
    plans = []
    for label, placements in PINNED.items():
        plan = plan_traced(traced, prof, mesh=shape, options=PlanOptions(), fixed=pin(placements)).plan
        want = sum(p is TABLE for p in placements)
        assert not plan.fallbacks and len(plan.tables) == want, (label, plan.tables, plan.solver.get("tables"))
        plans.append((f"dlrm {shape} {label}: {[str(t) for t in plan.tables]}", plan.to_json()))
    # Every table table-wise on every axis: each whole on one device of the mesh (TorchRec's table-wise).
    # On (2, 2) also data-parallel over axis 0 x table-wise over axis 1: the owners' gradients are
    # all-reduced across axis 0 (owner and peer shapes differ, but never inside one axis-0 group).
    built = plan_traced(traced, prof, mesh=shape, options=PlanOptions()).built
    for name, axes in [("table-wise", tuple(range(len(shape))))] + [("dp x table-wise", (1,))] * (len(shape) == 2):
        family = table_family_plan(traced, built, name)
        assert len(family.tables) == 4 and all(t.axes == axes for t in family.tables), family.tables
        plans.append((f"dlrm {shape} tables {name}: {[str(t) for t in family.tables]}", family.to_json()))
    ref = reference(model, inputs)
    errors = run_local(_train, 2 if len(shape) == 1 else 4, model, traced, plans, inputs, ref, timeout=400)
    flat = [e for rank_errors in errors for e in rank_errors]
    assert not flat, "\n".join(flat[:20])


def test_a_plan_whose_owned_table_is_converted_is_refused():
    """``Plan.tables`` is data: a hand-made plan that owns a table its layout does not split by rows
    on the owned axis (or one it does not place) is refused before any rank holds a table whole."""
    import dataclasses

    from autopar.plans import TableOwner
    from autopar.runtime.table_wise import check_tables

    torch.manual_seed(0)
    model, inputs = zoo.build("dlrm", tiny=True, device="cpu")
    traced = trace(model, inputs, decompose_if=needs_decomposition)
    plan = plan_traced(traced, profile(traced), mesh=(2,), options=PlanOptions(), fixed=pin(PINNED["mixed"])).plan
    check_tables(plan, traced)
    column_wise = dataclasses.replace(plan, tables=plan.tables + (TableOwner("p_tables_2_weight", "tables.2.weight",
                                                                             (0,), (0,)),))
    with pytest.raises(ValueError, match="tables.2.weight.*does not split its rows"):
        check_tables(column_wise, traced)
    with pytest.raises(ValueError, match="does not place"):
        check_tables(dataclasses.replace(plan, tables=(TableOwner("nope", "nope.weight", (0,), (1,)),)), traced)
