"""The user-model probe: hand-written models (``user_models``) trained through the public API on
real gloo ranks, against the single-device model.

For each case and mesh the parent computes the single-device reference (loss, every gradient and
the state after ``STEPS`` AdamW steps) and the smallest budget the planner reports (its refusal of
a 1-byte budget, as a user reads it); then ONE ``run_local`` launch per (case, mesh) runs, on
every rank, for each budget: ``autopar.autoparallelize(model, inputs, mesh=..., memory_budget=...)``
(rank 0 plans; timed), a user's loop of ``STEPS`` AdamW steps over ``pm.parameters()`` with the
case's own loss function, and the comparison of the first step's loss and gradients
(``full_gradients()``) and of ``full_state_dict()`` after the steps. One budget per launch also
goes through the Booster (``AutoParallelPlugin``, ``boost(model, optimizer, criterion)``).

Budgets: ``ample`` (none: the device's capacity) and ``tight`` (``TIGHT`` x the smallest).
Meshes use ``harness.fast_mesh``'s prices, so that the toy shapes get split at all.

Run as a script for the whole table: ``python -m tests.sweeps.user_probe [case ...]``.
"""

from __future__ import annotations

import copy
import re
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

import autopar
from autopar.layout.mesh import MeshSpec
from autopar.runtime.launch import run_local

from .e2e import mesh_label
from .harness import fast_mesh
from .user_models import CASES, Case, case

STEPS, LR, EPS = 3, 1e-3, 1e-5  # eps 1e-5: see tests/runtime/test_e2e.py (float-noise gradients)
RTOL, ATOL = 1e-4, 1e-5
TIGHT = 1.1
BUDGETS = ("ample", "tight")
_SMALLEST = re.compile(r"smallest budget any plan meets is (?:between \d+ and )?(\d+) bytes")


@dataclass
class Outcome:
    """One (case, mesh, budget): errors [] = match."""
    errors: list[str] = field(default_factory=list)
    plan_s: float = 0.0
    budget: int | None = None
    how: str = ""      # "api" or "booster"
    note: str = ""     # what the plan did (pipeline, sharded params)


def _tolerances(c: Case) -> tuple[float, float]:
    # A bf16 submodule rounds at 8 bits whatever the summation order: a sharded reduction differs
    # from the single-device one by about one bf16 ulp of the activations.
    return (2e-2, 2e-3) if "bf16" in c.name else (RTOL, ATOL)


def reference(c: Case) -> dict:
    torch.manual_seed(0)
    model, inputs, targets = c.build()
    model_copy = copy.deepcopy(model)
    opt = torch.optim.AdamW(model_copy.parameters(), lr=LR, eps=EPS)
    ref: dict[str, Any] = {}
    for step in range(STEPS):
        opt.zero_grad()
        loss = c.loss_fn(model_copy(*inputs), targets)
        loss.backward()
        if step == 0:
            ref["loss"] = loss.detach().clone()
            ref["grads"] = {k: None if p.grad is None else p.grad.clone()
                            for k, p in model_copy.named_parameters()}
        opt.step()
    ref["state"] = {k: v.detach().clone() for k, v in model_copy.state_dict().items()}
    return {"model": model, "inputs": inputs, "targets": targets, "ref": ref}


def smallest_budget(c: Case, model, inputs, mesh: MeshSpec) -> tuple[int, float]:
    """(the smallest budget the planner names, the seconds that refusal took)."""
    start = time.perf_counter()
    try:
        autopar.plan(model, inputs, mesh=mesh, memory_budget=1, cache=False)
    except ValueError as exc:
        found = _SMALLEST.search(str(exc))
        if found is None:
            raise
        return int(found.group(1)), time.perf_counter() - start
    raise AssertionError(f"{c.name}: a 1-byte budget was met")


def _compare(what: str, got, want, tol) -> list[str]:
    if got is None:
        return [f"{what} missing"]
    if isinstance(got, torch.distributed.tensor.DTensor):
        got = got.full_tensor()
    if tuple(got.shape) != tuple(want.shape):
        return [f"{what} shape {tuple(got.shape)} != {tuple(want.shape)}"]
    if not want.is_floating_point():
        return [] if torch.equal(got, want) else [f"{what} differs: {got.tolist()} != {want.tolist()}"]
    if torch.allclose(got.detach().to(want.dtype), want, rtol=tol[0], atol=tol[1]):
        return []
    err = (got.detach().double() - want.double()).abs().max().item()
    return [f"{what} max abs error {err:.3g} (max |want| {want.abs().max().item():.3g})"]


def _train(c: Case, pm, opt, step_fn, prep: dict) -> list[str]:
    """``STEPS`` steps of the user's loop; the first step's loss and gradients, the final state."""
    ref, tol = prep["ref"], _tolerances(c)
    errors: list[str] = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = c.loss_fn(pm(*prep["inputs"]), prep["targets"])
        step_fn(loss)
        if step == 0:
            errors += _compare("loss", loss, ref["loss"], tol)
            grads = pm.full_gradients()
            for k, want in ref["grads"].items():
                if want is not None:
                    errors += _compare(f"grad {k}", grads.get(k), want, tol)
        opt.step()
    state = pm.full_state_dict()
    missing = sorted(set(ref["state"]) - set(state))
    errors += [f"state lacks {missing}"] if missing else []
    for k, want in ref["state"].items():
        if k in state:
            errors += _compare(f"state {k} after {STEPS} steps", state[k], want, tol)
    return errors


def _note(pm) -> str:
    """What the plan did: a pipeline, or how many parameters it shards, and the recompute regions."""
    plan = getattr(pm, "plan", None)
    if plan is None:
        return type(pm).__name__
    if plan.pipeline is not None:
        return f"pipeline x{plan.pipeline.num_stages}"
    params = plan.by_kind("parameter")
    sharded = sum(any(s and "S" in s for s in n.output_specs) for n in params)
    return f"{sharded}/{len(params)} split" + (f" rc{len(plan.recompute)}" if plan.recompute else "")


def _via_api(c: Case, prep: dict, spec, budget) -> Outcome:
    start = time.perf_counter()
    pm = autopar.autoparallelize(prep["model"], prep["inputs"], mesh=spec, memory_budget=budget, cache=False)
    out = Outcome(plan_s=time.perf_counter() - start, budget=budget, how="api", note=_note(pm))
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    out.errors = _train(c, pm, opt, lambda loss: loss.backward(), prep)
    return out


def _via_booster(c: Case, prep: dict, spec, budget) -> Outcome:
    from autopar.booster import AutoParallelPlugin, Booster

    booster = Booster(plugin=AutoParallelPlugin(mesh=spec, memory_budget=budget))
    model = copy.deepcopy(prep["model"])  # boost consumes the module it is given
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    start = time.perf_counter()
    pm, opt, _, _, _ = booster.boost(model, optimizer, meta_inputs=prep["inputs"])
    out = Outcome(plan_s=time.perf_counter() - start, budget=budget, how="booster", note=_note(pm))
    out.errors = _train(c, pm, opt, lambda loss: booster.backward(loss, opt), prep)
    return out


def _flat_targets(targets) -> tuple:
    if targets is None:
        return ()
    return tuple(targets) if isinstance(targets, (tuple, list)) else (targets,)


def _via_loader(c: Case, prep: dict, spec, budget) -> Outcome:
    """The Booster as the README trains: a map-style dataset of ``(inputs..., targets...)``
    samples, ``plugin.prepare_dataloader``, ``boost(model, optimizer, criterion, loader)``, and a
    loop over the loader (one global batch per epoch, the reference's batch every time)."""
    from autopar.booster import AutoParallelPlugin, Booster

    inputs, targets = prep["inputs"], _flat_targets(prep["targets"])
    if not all(isinstance(t, torch.Tensor) for t in (*inputs, *targets)):
        return Outcome(budget=budget, how="loader", note="n/a: not one tensor per input")
    n_in = len(inputs)
    dataset = list(zip(*inputs, *targets))
    plugin = AutoParallelPlugin(mesh=spec, memory_budget=budget)
    booster = Booster(plugin=plugin)
    loader = plugin.prepare_dataloader(dataset, batch_size=len(dataset) // spec.num_devices, drop_last=True)
    model = copy.deepcopy(prep["model"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)

    def criterion(outputs, batch_targets):
        if not targets:
            return c.loss_fn(outputs, None)
        return c.loss_fn(outputs, batch_targets[0] if len(batch_targets) == 1 else tuple(batch_targets))

    start = time.perf_counter()
    pm, opt, criterion, loader, _ = booster.boost(model, optimizer, criterion, loader)
    out = Outcome(plan_s=time.perf_counter() - start, budget=budget, how="loader", note=_note(pm))
    ref, tol = prep["ref"], _tolerances(c)
    for step in range(STEPS):
        for batch in loader:
            opt.zero_grad()
            loss = criterion(pm(*batch[:n_in]), batch[n_in:])
            booster.backward(loss, opt)
            if step == 0:
                out.errors += _compare("loss", loss, ref["loss"], tol)
                grads = pm.full_gradients()
                for k, want in ref["grads"].items():
                    if want is not None:
                        out.errors += _compare(f"grad {k}", grads.get(k), want, tol)
            opt.step()
    state = pm.full_state_dict()
    for k, want in ref["state"].items():
        out.errors += _compare(f"state {k} after {STEPS} steps", state.get(k), want, tol)
    return out


_RUNNERS = {"api": _via_api, "booster": _via_booster, "loader": _via_loader}


def _rank_main(rank: int, world: int, name: str, prep: dict, budgets: dict) -> dict:
    c = case(name)
    results = {}
    for label, (how, spec, budget) in budgets.items():
        try:
            results[label] = _RUNNERS[how](c, prep, spec, budget)
        except Exception as exc:  # noqa: BLE001 -- the probe's result
            tb = traceback.extract_tb(exc.__traceback__)[-1]
            results[label] = Outcome(errors=[f"raised {type(exc).__name__}: {' '.join(str(exc).split())[:400]} "
                                             f"at {tb.filename.rsplit('/', 2)[-1]}:{tb.lineno}"], budget=budget)
    return results


def probe(c: Case, shape: tuple[int, ...], *, full: bool = True, timeout: float = 300.0) -> dict[str, Outcome]:
    """Every budget of one case on one mesh, in one launch: label -> outcome. ``full``: also the
    Booster runs and the plain ``cpu`` preset (the mesh a user names by its shape) at a tight budget."""
    prep = reference(c)
    fast = fast_mesh(shape)
    budgets: dict[str, tuple] = {"ample": ("api", fast, None)}
    try:
        low, _ = smallest_budget(c, prep["model"], prep["inputs"], fast)
        budgets["tight"] = ("api", fast, int(TIGHT * low))
        if full:
            budgets["ample-booster"] = ("booster", fast, None)
            budgets["tight-loader"] = ("loader", fast, int(TIGHT * low))
            plain = MeshSpec.preset("cpu", shape)
            low, _ = smallest_budget(c, prep["model"], prep["inputs"], plain)
            budgets["cpu-tight"] = ("api", plain, int(TIGHT * low))
    except Exception as exc:  # noqa: BLE001
        return {"tight": Outcome(errors=[f"smallest budget: {type(exc).__name__}: {exc}"[:500]])}
    try:
        per_rank = run_local(_rank_main, fast.num_devices, c.name, prep, budgets, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 -- a dead or hung launch
        return {label: Outcome(errors=[f"launch failed: {' '.join(str(exc).split())[-400:]}"], budget=b[2])
                for label, b in budgets.items()}
    merged = {}
    for label in budgets:
        outs = [r[label] for r in per_rank]
        errors = []
        for o in outs:
            errors += [e for e in o.errors if e not in errors]
        merged[label] = Outcome(errors=errors, plan_s=outs[0].plan_s, budget=outs[0].budget,
                                how=outs[0].how, note=outs[0].note)
    return merged


MESHES = ((2,), (2, 2))


def main(names: list[str]) -> int:
    cases = [case(n) for n in names] if names else list(CASES)
    bad = 0
    for c in cases:
        for shape in MESHES:
            for label, o in probe(c, shape).items():
                status = ("n/a" if o.note.startswith("n/a") else "match") if not o.errors \
                    else "FAIL " + " | ".join(o.errors[:3])
                bad += bool(o.errors)
                print(f"{c.name:34s} {mesh_label(shape):4s} {label:14s} budget={o.budget} "
                      f"plan={o.plan_s:5.1f}s {o.note:20s} {status}", flush=True)
    return bad


if __name__ == "__main__":
    sys.exit(1 if main(sys.argv[1:]) else 0)
