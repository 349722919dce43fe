"""The sweep harness: trace, plan and train catalog entries on real gloo processes.

One entry = a model builder (real CPU weights under ``torch.manual_seed``) plus its inputs. For
each entry

1. the parent traces (as ``plan()`` does, decomposing unruled ops that PyTorch can decompose)
   and profiles it once (a :class:`TraceError` is the entry's result), and computes the
   single-device loss and parameter gradients;
2. a forked process plans it on every mesh WITHOUT replicate fallback; when an op has no rule
   it re-plans with ``allow_replicate_fallback=True`` to list every unruled op (name and module
   path), and keeps that plan so that the entry is still checked end to end. Up to two such
   processes plan while the parent traces the next entries (a 2-D mesh plan costs several
   times the trace);

then ONE ``run_local`` launch per world size runs all entries' plans one after the other: each
rank builds the module, runs forward and backward on the full batch and compares the loss and
every gathered parameter gradient with the reference (rtol 1e-4, atol 1e-6).

Per-entry isolation inside a launch: an exception is caught and recorded for that entry; a rank
that hangs (a collective the other ranks never call) is ended by a watchdog after
``task_timeout`` seconds, the entry is recorded as hung and the launch resumes with the entries
after it. Results go through per-rank files, so they survive a dead launch.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import pickle
import shutil
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from autopar.api import plan_graph
from autopar.mesh import MeshSpec
from autopar.runtime.api import build_module
from autopar.runtime.launch import run_local
from autopar.strategies import needs_decomposition
from autopar.strategies.registry import NoRuleError
from autopar.tracer import TraceError, profile, trace
from autopar.tracer.graph import op_name

RTOL, ATOL = 1e-4, 1e-6
_HUNG = "hung:"  # how a rank's watchdog marks the entry it was stuck in

Mesh = tuple[int, ...]


def fast_mesh(shape: Mesh) -> MeshSpec:
    """The CPU preset with nearly free links and slow compute (1 MFLOP/s, 1 MB/s): for the tiny
    sweep shapes every op then costs far more than the per-kernel floor and far more than any
    collective, so the solver splits every op that a rule lets it split (with the plain CPU
    preset, most tiny modules would be planned fully replicated and test no rule at all)."""
    mesh = MeshSpec.preset("cpu", shape)
    return dataclasses.replace(mesh, alpha=(1e-7,) * len(shape), beta=(1e-13,) * len(shape),
                               peak_flops=1e6, mem_bandwidth=1e6, name="sweep")


def mesh_label(shape: Mesh) -> str:
    return "x".join(map(str, shape))


def loss_of(out: Any) -> torch.Tensor:
    """A scalar loss from a model output: the tensor itself, ``.loss`` / ``["loss"]``, or ``[0]``."""
    if isinstance(out, torch.Tensor):
        return out
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    return loss if loss is not None else out[0]


@dataclass
class Entry:
    """``build()`` -> (model, inputs): inputs a positional tuple or a keyword dict."""
    name: str
    build: Callable[[], tuple[nn.Module, tuple | dict]]
    group: str = ""
    seed: int = 0
    focus: str = ""  # module path whose ops should be split ("sharded" in the results)
    exact: bool = True  # False for random ops: the ranks' values are not compared (check_e2e)


@dataclass
class MeshResult:
    strict: bool = False                 # planned without replicate fallback
    missing: dict[str, str] = field(default_factory=dict)  # unruled op -> first module path
    fallback_nodes: int = 0              # op nodes the fallback plan replicated
    plan_error: str | None = None        # any other planning failure
    sharded: bool | None = None          # the plan splits some op under the entry's focus
                                         # (None: no op there, e.g. nn.Identity)
    errors: list[str] | None = None      # end to end: [] = match, None = not run
    e2e_s: float = 0.0                   # end-to-end check time (slowest rank)

    @property
    def planned(self) -> bool:
        return self.plan_error is None and (self.strict or bool(self.missing))

    @property
    def match(self) -> bool:
        return self.errors == []


@dataclass
class Result:
    name: str
    group: str
    trace_error: str | None = None
    ref_error: str | None = None
    meshes: dict[str, MeshResult] = field(default_factory=dict)
    nodes: int = 0
    prep_s: float = 0.0

    @property
    def traced(self) -> bool:
        return self.trace_error is None

    @property
    def strict_ok(self) -> bool:
        """Traced, planned without fallback and matched on every mesh."""
        return self.traced and self.ref_error is None and bool(self.meshes) and all(
            m.strict and m.match for m in self.meshes.values())

    @property
    def fallback_ok(self) -> bool:
        """Matched on every mesh, some through a replicate-fallback plan."""
        return self.traced and self.ref_error is None and bool(self.meshes) and all(
            m.match for m in self.meshes.values())

    @property
    def replicated_meshes(self) -> list[str]:
        """Meshes whose plan replicates every op of the entry's focus (no rule exercised)."""
        return [k for k, m in self.meshes.items() if m.sharded is False]

    @property
    def missing_ops(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for m in self.meshes.values():
            for op, where in m.missing.items():
                out.setdefault(op, where)
        return out

    def cause(self) -> str:
        """One line: why this entry is not ``strict_ok`` ('' when it is)."""
        if self.trace_error:
            return f"trace error: {self.trace_error}"
        if self.ref_error:
            return f"single-device reference failed: {self.ref_error}"
        parts = []
        missing = self.missing_ops
        if missing:
            parts.append("missing rules: " + ", ".join(f"{op} (module {where or '<root>'})"
                                                        for op, where in sorted(missing.items())))
        for label, m in self.meshes.items():
            if m.plan_error:
                parts.append(f"mesh {label}: plan error: {m.plan_error}")
            elif m.errors is None:
                parts.append(f"mesh {label}: not run end to end")
            elif m.errors:
                how = "strict plan" if m.strict else "fallback plan"
                parts.append(f"mesh {label} ({how}): " + "; ".join(m.errors[:4])
                             + (f"; ... {len(m.errors) - 4} more" if len(m.errors) > 4 else ""))
        return " | ".join(parts)


@dataclass
class _Prepared:
    entry: Entry
    result: Result
    model: nn.Module | None = None
    inputs: tuple | dict | None = None
    traced: Any = None
    ref: dict | None = None
    plans: dict[str, Any] = field(default_factory=dict)  # mesh label -> Plan


def _short(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[:limit] + " ..."


def _call(model: nn.Module, inputs: tuple | dict) -> Any:
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def _reference(model: nn.Module, inputs: tuple | dict) -> dict:
    model = copy.deepcopy(model)
    loss = loss_of(_call(model, inputs))
    loss.backward()
    grads = {k: (None if p.grad is None else p.grad.detach().clone())
             for k, p in model.named_parameters(remove_duplicate=False)}
    params = {k for k, _ in model.named_parameters(remove_duplicate=False)}
    # Buffers the step updated (batch-norm running statistics and counters), as saved.
    buffers = {k: v.detach().clone() for k, v in model.state_dict().items() if k not in params}
    return {"loss": loss.detach().clone(), "grads": grads, "buffers": buffers}


def is_sharded(plan, focus: str = "") -> bool | None:
    """Whether some op of the plan under module path ``focus`` ('' = anywhere) computes on
    pieces (a Shard or Partial layout on some axis); None when no op lies there."""
    ops = [n for n in plan.by_kind("op") if n.module.startswith(focus)]
    if not ops:
        return None
    return any(spec is not None and ("S" in spec or "P" in spec)
               for n in ops for spec in (*n.input_specs, *n.output_specs))


def _plan_on(traced, prof, shape: Mesh, focus: str = "") -> tuple[MeshResult, Any]:
    """(what happened, the plan to check end to end or None) for one mesh."""
    res = MeshResult()
    try:
        plan = plan_graph(traced, prof, mesh=fast_mesh(shape))
        res.strict = True
        res.sharded = is_sharded(plan, focus)
        return res, plan
    except NoRuleError:
        pass
    except Exception as exc:  # noqa: BLE001 -- any planning failure is this entry's result
        res.plan_error = _short(exc)
        return res, None
    try:  # list every unruled op, and keep a plan that still checks the rest end to end
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = plan_graph(traced, prof, mesh=fast_mesh(shape), allow_replicate_fallback=True)
    except Exception as exc:  # noqa: BLE001
        res.plan_error = f"with replicate fallback: {_short(exc)}"
        return res, None
    res.sharded = is_sharded(plan, focus)
    res.fallback_nodes = len(plan.fallbacks)
    for name in plan.fallbacks:
        node = traced.node(name)
        res.missing.setdefault(op_name(node), traced.module_path(node))
    if not res.missing:
        res.plan_error = "strict planning raised NoRuleError but the fallback plan replicated nothing"
    return res, plan


def _plan_all(traced, prof, meshes: Sequence[Mesh], focus: str = "") -> tuple[dict, dict, float]:
    start = time.perf_counter()
    results, plans = {}, {}
    for shape in meshes:
        label = mesh_label(shape)
        results[label], plan = _plan_on(traced, prof, shape, focus)
        if plan is not None:
            plans[label] = plan
    return results, plans, time.perf_counter() - start


def _front(entry: Entry) -> tuple[_Prepared, Any]:
    """Build, trace, profile and compute the single-device reference; (prep, profile or None)."""
    start = time.perf_counter()
    prep = _Prepared(entry, Result(entry.name, entry.group))
    prof = None
    try:
        torch.manual_seed(entry.seed)
        prep.model, prep.inputs = entry.build()
        prep.model.train()
    except Exception as exc:  # noqa: BLE001 -- a broken recipe is reported, not raised
        prep.result.ref_error = f"building the entry failed: {_short(exc)}"
        return prep, None
    traced = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # Exactly as plan() and autoparallelize() trace: unruled ops with a PyTorch
            # decomposition are decomposed at trace time.
            traced = trace(prep.model, prep.inputs, name=entry.name, decompose_if=needs_decomposition)
        prep.result.nodes = sum(1 for _ in traced.compute_nodes())
        prof = profile(traced)
        prep.traced = traced
    except TraceError as exc:
        prep.result.trace_error = " ".join(str(exc).split())[:400]
    except Exception as exc:  # noqa: BLE001 -- not a clear TraceError: reported as such
        what = "profile failed:" if traced is not None else "(not a TraceError)"
        prep.result.trace_error = f"{what} {_short(exc)}"
    try:
        prep.ref = _reference(prep.model, prep.inputs)
    except Exception as exc:  # noqa: BLE001
        prep.result.ref_error = _short(exc)
    prep.result.prep_s = time.perf_counter() - start
    return prep, prof


def _plan_child(traced, prof, meshes, focus, conn) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    try:
        payload = ("ok", _plan_all(traced, prof, meshes, focus))
    except BaseException:  # noqa: BLE001 -- sent back as text
        payload = ("error", traceback.format_exc())
    conn.send_bytes(pickle.dumps(payload))
    conn.close()


class _Planner:
    """Plans each traced entry in a forked process, ``jobs`` at a time, while the parent traces
    the next entries (planning a 2-D mesh costs several times the trace)."""

    def __init__(self, meshes: Sequence[Mesh], jobs: int, timeout: float) -> None:
        self.meshes, self.jobs, self.timeout = meshes, jobs, timeout
        self.ctx = mp.get_context("fork")
        self.running: dict[Any, tuple[Any, _Prepared, float]] = {}  # conn -> (process, prep, start)

    # Forking costs more than planning a graph this small on a 1-D mesh (tens of milliseconds).
    FORK_MIN_NODES = 50

    def submit(self, prep: _Prepared, prof) -> None:
        if self.jobs <= 1 or prep.result.nodes < self.FORK_MIN_NODES:
            self._store(prep, ("ok", _plan_all(prep.traced, prof, self.meshes, prep.entry.focus)))
            return
        while len(self.running) >= self.jobs:
            self._collect(block=True)
        parent, child = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(target=_plan_child, args=(prep.traced, prof, self.meshes, prep.entry.focus, child), daemon=True)
        proc.start()
        child.close()
        self.running[parent] = (proc, prep, time.perf_counter())

    def finish(self) -> None:
        while self.running:
            self._collect(block=True)

    def _collect(self, block: bool) -> None:
        ready = mp_connection.wait(list(self.running), timeout=1.0 if block else 0)
        for conn in ready:
            proc, prep, _ = self.running.pop(conn)
            try:
                payload = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                payload = ("error", f"the planning process died (exit code {proc.exitcode})")
            proc.join(timeout=5)
            self._store(prep, payload)
        now = time.perf_counter()
        for conn, (proc, prep, started) in list(self.running.items()):
            if now - started > self.timeout:
                proc.kill()
                proc.join(timeout=5)
                del self.running[conn]
                self._store(prep, ("error", f"planning did not finish within {self.timeout:.0f} s"))

    def _store(self, prep: _Prepared, payload) -> None:
        kind, value = payload
        if kind == "ok":
            results, plans, seconds = value
            prep.result.meshes.update(results)
            prep.plans.update(plans)
            prep.result.prep_s += seconds
        else:
            text = " ".join(str(value).split())[-300:]
            for shape in self.meshes:
                prep.result.meshes[mesh_label(shape)] = MeshResult(plan_error=text)


# ------------------------------------------------------------------------------ end to end
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
    return errors


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


def _rank_main(rank: int, world: int, tasks: list, preps: list[_Prepared], out_dir: str,
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


def _run_watched(world: int, tasks: list, preps: list[_Prepared], out_dir: str, task_timeout: float) -> str:
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


def _launch(world: int, tasks: list, preps: list[_Prepared], task_timeout: float) -> tuple[dict, list]:
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


def run_e2e(preps: list[_Prepared], meshes: Sequence[Mesh], *, task_timeout: float = 60.0) -> None:
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


def sweep(entries: Sequence[Entry], meshes: Sequence[Mesh], *, task_timeout: float = 60.0,
          plan_timeout: float = 300.0, jobs: int | None = None,
          progress: Callable[[str], None] | None = None) -> list[Result]:
    """Prepare every entry (planning in up to ``jobs`` forked processes, default: the CPU count,
    at most 2), then run all of them end to end; one ``Result`` per entry, in order."""
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate entry names: {sorted({n for n in names if names.count(n) > 1})}")
    jobs = min(2, os.cpu_count() or 1) if jobs is None else jobs
    start = time.perf_counter()
    planner = _Planner(meshes, jobs, plan_timeout)
    preps = []
    threads = torch.get_num_threads()
    # One intra-op thread: the tiny reference steps gain nothing from more, and OpenMP threads
    # that spin while the planning processes hold the cores cost seconds per step.
    torch.set_num_threads(1)
    try:
        for entry in entries:
            prep, prof = _front(entry)
            preps.append(prep)
            if prep.traced is not None:
                planner.submit(prep, prof)
            if progress:
                progress(f"traced {entry.name} in {prep.result.prep_s:.2f} s")
        traced_at = time.perf_counter()
        planner.finish()
    finally:
        torch.set_num_threads(threads)
    planned_at = time.perf_counter()
    run_e2e(preps, meshes, task_timeout=task_timeout)
    if progress:
        progress(f"sweep of {len(preps)}: traced by {traced_at - start:.1f} s, planned by "
                 f"{planned_at - start:.1f} s, end to end {time.perf_counter() - planned_at:.1f} s")
    return [p.result for p in preps]


# ------------------------------------------------------------------------------ reporting
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
                    keys.append(f"{kind} ({'strict' if m.strict else 'fallback'} plan): "
                                + (first[:160] if kind == "e2e raised" else first.split(":")[0].split(" ")[0]))
        for k in dict.fromkeys(keys):
            groups.setdefault(k, []).append(r.name)
    return dict(sorted(groups.items(), key=lambda kv: -len(kv[1])))


def format_failures(results: Sequence[Result]) -> str:
    lines = []
    for cause, names in group_failures(results).items():
        lines.append(f"[{len(names)}] {cause}: {', '.join(names)}")
    return "\n".join(lines)

