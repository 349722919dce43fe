"""End to end on real gloo processes: every entry's plans, one launch per world size.

Each rank builds the module of a plan (``build_module`` on the parent's trace, inherited by
fork), runs forward and backward on the full batch and compares with the single-device
reference computed before the fork: the loss, the buffers the step updated and every gathered
parameter gradient (rtol 1e-4, atol 1e-6). Random entries (``exact=False``) are checked for a
finite loss, full gradients and the same values on every rank instead.

Isolation: an exception is recorded for its entry; a rank stuck longer than ``task_timeout``
in one entry is ended by its watchdog, which marks the entry hung; the launch is then abandoned
(see ``_run_watched``) and the entries after the culprit run again in a fresh launch. Results
go through per-rank files, so they survive a dead launch.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import shutil
import tempfile
import threading
import time
import traceback
import warnings
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from autopar.runtime.build import build_module
from autopar.runtime.launch import run_local

RTOL, ATOL = 1e-4, 1e-6
_HUNG = "hung:"  # how a rank's watchdog marks the entry it was stuck in

Mesh = tuple[int, ...]


def mesh_label(shape: Mesh) -> str:
    return "x".join(map(str, shape))


def loss_of(out: Any) -> torch.Tensor:
    """A scalar loss from a model output: the tensor itself, ``.loss`` / ``["loss"]``, or ``[0]``."""
    if isinstance(out, torch.Tensor):
        return out
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    return loss if loss is not None else out[0]


def _short(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[:limit] + " ..."


def _call(model: nn.Module, inputs: tuple | dict) -> Any:
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def _compare(what: str, got: torch.Tensor | None, want: torch.Tensor) -> str | None:
    if got is None:
        return f"{what} missing"
    if tuple(got.shape) != tuple(want.shape):
        return f"{what} shape {tuple(got.shape)} != {tuple(want.shape)}"
    if not want.is_floating_point():
        return None if torch.equal(got, want) else f"{what} differs: {got.tolist()} != {want.tolist()}"
    if torch.allclose(got.detach().to(want.dtype), want, rtol=RTOL, atol=ATOL):
        return None
    diff = (got.detach().double() - want.double()).abs()
    return f"{what} differs: max abs error {diff.max().item():.3g} (max |want| {want.abs().max().item():.3g})"


def check_e2e(model, traced, plan, inputs, ref, *, exact: bool = True) -> list[str]:
    """On one rank: build the module, run forward + backward, compare the loss, the buffers the
    step updated (batch-norm running statistics) and every parameter gradient.
    ``exact=False`` (random ops): only a finite loss and every gradient present, full shape."""
    pm = build_module(model, traced, plan, device=torch.device("cpu"))
    loss = loss_of(_call(pm, inputs))
    loss.backward()
    grads = pm.full_gradients()
    if not exact:
        return _check_consistent(loss, grads, ref)
    errors = [e for e in [_compare("loss", loss, ref["loss"])] if e]
    if ref["buffers"]:
        state = pm.full_state_dict()
        for k, want in ref["buffers"].items():
            err = _compare(f"buffer {k} after the step", state.get(k), want)
            if err:
                errors.append(err)
    for k, want in ref["grads"].items():
        got = grads.get(k)
        if want is None:
            if got is not None and got.abs().max().item() > ATOL:
                errors.append(f"grad {k} should be None (unused parameter) but is nonzero")
            continue
        err = _compare(f"grad {k}", got, want)
        if err:
            errors.append(err)
    return errors + _diagnosis(pm, inputs, bool(errors))


def _diagnosis(pm, inputs, failed: bool) -> list[str]:
    """On a mismatch (on any rank: every rank must join), the plan's own check names the first
    node whose value or gradient diverges from the all-replicated run."""
    from autopar.runtime.verify import PlanVerificationError, verify_module

    flag = torch.tensor([float(failed)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not flag.item():
        return []
    try:
        verify_module(pm, inputs)
    except PlanVerificationError as exc:
        return [f"verify: {exc.divergence or 'no single node diverges'}"]
    except Exception as exc:  # noqa: BLE001 -- the diagnosis is a hint, the mismatch stands
        return [f"verify could not run: {_short(exc)}"]
    return ["verify: the plan matches the all-replicated run (the mismatch is against the original model)"]


def _check_consistent(loss: torch.Tensor, grads: dict, ref: dict) -> list[str]:
    """For random ops: a finite loss, every gradient present in full shape, and the same loss
    and gradients on every rank (a replicated random op must draw the same values on all its
    replicas, or the replicas silently diverge)."""
    errors = [] if bool(torch.isfinite(loss).all()) else [f"loss is not finite: {loss.item()}"]
    digest = [float(loss.detach())]
    for k, want in ref["grads"].items():
        got = grads.get(k)
        if want is not None and (got is None or tuple(got.shape) != tuple(want.shape)):
            errors.append(f"grad {k} missing or of the wrong shape")
        elif got is not None:
            digest += [float(got.double().sum()), float(got.double().norm())]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, digest)
    if any(len(d) != len(digest) or not torch.allclose(torch.tensor(d), torch.tensor(digest), rtol=1e-9, atol=1e-12)
           for d in gathered):
        errors.append("ranks disagree on the loss or gradients: a replicated random op drew "
                      "different values on different ranks")
    return errors


def _where(exc: BaseException) -> str:
    """The raising frame, and the last autopar frame above it when that is elsewhere."""
    frames = traceback.extract_tb(exc.__traceback__)
    last = frames[-1]
    ours = [f for f in frames if f"{os.sep}autopar{os.sep}" in f.filename]
    where = f"{os.path.basename(last.filename)}:{last.lineno}"
    if ours and ours[-1] is not last:
        where += f" (from autopar/{ours[-1].filename.split(os.sep + 'autopar' + os.sep)[-1]}:{ours[-1].lineno})"
    return where


def _rank_main(rank: int, world: int, tasks: list, preps: list, out_dir: str,
               task_timeout: float) -> int:
    warnings.simplefilter("ignore")  # fallback plans warn once per replicated op and rank
    path = os.path.join(out_dir, f"rank{rank}.jsonl")
    with open(path, "a") as log:
        def record(i: int, errors: list[str], seconds: float = 0.0) -> None:
            log.write(json.dumps({"task": i, "errors": errors, "seconds": seconds}) + "\n")
            log.flush()

        for i, (pi, label) in tasks:
            prep = preps[pi]
            timer = threading.Timer(task_timeout, lambda i=i: (
                record(i, [f"{_HUNG} did not finish within {task_timeout:.0f} s on rank {rank} "
                           f"(a collective that not every rank called?)"]), os._exit(17)))
            timer.daemon = True
            timer.start()
            started = time.perf_counter()
            try:
                errors = check_e2e(prep.model, prep.traced, prep.plans[label], prep.inputs, prep.ref,
                                   exact=prep.entry.exact)
            except Exception as exc:  # noqa: BLE001 -- the entry's result
                errors = [f"raised {_short(exc)} at {_where(exc)}"]
            finally:
                timer.cancel()
            record(i, errors, time.perf_counter() - started)
    return len(tasks)


def _read_logs(out_dir: str) -> dict[int, dict[int, dict]]:
    """task -> rank -> that rank's record (errors, seconds)."""
    found: dict[int, dict[int, dict]] = {}
    for name in os.listdir(out_dir):
        rank = int(name[len("rank"):-len(".jsonl")])
        with open(os.path.join(out_dir, name)) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a dying rank
                    continue
                found.setdefault(rec["task"], {})[rank] = rec
    return found


def _merge(records: dict[int, dict]) -> tuple[list[str], float]:
    errors: list[str] = []
    for rank in sorted(records):
        errors.extend(e for e in records[rank]["errors"] if e not in errors)
    return errors, max(r.get("seconds", 0.0) for r in records.values())


def _run_watched(world: int, tasks: list, preps: list, out_dir: str, task_timeout: float) -> str:
    """``run_local`` in a thread, watched: '' when every rank reported, else the failure.

    A rank whose watchdog ended it (a hung entry) never reports, and ``run_local`` would wait
    for its whole-launch timeout; so once a rank process is gone while the launch still waits
    (a finished rank reports before it exits), the remaining ranks are killed and the launch
    is abandoned."""
    before = set(mp.active_children())
    box: dict[str, str] = {}

    def target() -> None:
        try:
            run_local(_rank_main, world, tasks, preps, out_dir, task_timeout,
                      timeout=task_timeout * len(tasks) + 60)
        except BaseException as exc:  # noqa: BLE001 -- the launch's failure, as text
            box["error"] = " ".join(str(exc).split())[-400:]

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    gone_since = None
    while thread.is_alive():
        thread.join(0.5)
        ranks = [p for p in mp.active_children() if p not in before]
        if thread.is_alive() and len(ranks) < world:
            gone_since = gone_since or time.perf_counter()
            if time.perf_counter() - gone_since > 5:
                for p in ranks:
                    p.kill()
                return "a rank exited without reporting (its watchdog ended it)"
    return box.get("error", "")


def _launch(world: int, tasks: list, preps: list, task_timeout: float) -> tuple[dict, list]:
    """Run ``tasks`` in one launch: (task -> (errors, seconds), the tasks still to run).

    When the launch dies, the culprit is the first task that some rank reported as hung or that
    not every rank finished: it gets the launch's error; the tasks after it run again in a fresh
    launch (their partial results are not trusted: a dead peer fails them all)."""
    out_dir = tempfile.mkdtemp(prefix=f"autopar-sweep-w{world}-")
    try:
        failure = _run_watched(world, tasks, preps, out_dir, task_timeout)
        logs = _read_logs(out_dir)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    done: dict[int, tuple[list[str], float]] = {}
    for pos, (i, _) in enumerate(tasks):
        records = logs.get(i, {})
        complete = len(records) == world
        hung = any(e.startswith(_HUNG) for r in records.values() for e in r["errors"])
        if not failure or (complete and not hung):
            done[i] = _merge(records) if records else (["no rank reported this entry"], 0.0)
            continue
        errors = _merge(records)[0] if records else []
        if not hung:
            errors.append(f"the launch died during this entry: {failure}")
        done[i] = (errors, 0.0)
        return done, tasks[pos + 1:]
    return done, []


def run_e2e(preps: list, meshes: Sequence[Mesh], *, task_timeout: float = 60.0) -> None:
    """One launch per world size (relaunched after a hung or crashed entry); fills ``errors``."""
    by_world: dict[int, list] = {}
    for pi, prep in enumerate(preps):
        if prep.ref is None:
            continue
        for shape in meshes:
            label = mesh_label(shape)
            if label in prep.plans:
                by_world.setdefault(math.prod(shape), []).append((pi, label))
    for world, pending in by_world.items():
        tasks = list(enumerate(pending))
        while tasks:
            done, rest = _launch(world, tasks, preps, task_timeout)
            for i, (pi, label) in tasks:
                if i in done:
                    mesh = preps[pi].result.meshes[label]
                    mesh.errors, mesh.e2e_s = done[i]
            tasks = rest
