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

then ONE ``run_local`` launch per world size runs all entries' plans one after the other
(``e2e``: per-entry isolation, a watchdog for hung entries). ``report`` formats the results.
With ``workers=2`` two such sweeps run at once, each on half the entries (``_split``).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import pickle
import re
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from autopar.api import PlanOptions, plan_traced
from autopar.layout.mesh import MeshSpec
from autopar.strategies import needs_decomposition
from autopar.strategies.registry import NoRuleError
from autopar.tracer import TraceError, profile, trace
from autopar.tracer.graph import op_name

from .e2e import Mesh, _call, _short, loss_of, mesh_label, run_e2e  # noqa: F401 (re-exported)

def fast_mesh(shape: Mesh) -> MeshSpec:
    """The CPU preset with nearly free links and slow compute (1 MFLOP/s, 1 MB/s): for the tiny
    sweep shapes every op then costs far more than the per-kernel floor and far more than any
    collective, so the solver splits every op that a rule lets it split (with the plain CPU
    preset, most tiny modules would be planned fully replicated and test no rule at all)."""
    mesh = MeshSpec.preset("cpu", shape)
    return dataclasses.replace(mesh, alpha=(1e-7,) * len(shape), beta=(1e-13,) * len(shape),
                               peak_flops=1e6, mem_bandwidth=1e6, name="sweep")


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
    min_budget: int | None = None        # tight mode: the smallest budget the planner reported
    budget: int | None = None            # tight mode: the budget planned at
    plan_s: float = 0.0                  # planning seconds (tight mode: at ``budget``)
    status: str = ""                     # the solver's status and gap, e.g. "optimal 0.0%"

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
    ops: dict[str, int] = field(default_factory=dict)  # op name -> nodes of the trace
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


_SMALLEST = re.compile(r"smallest budget any plan meets is (?:between \d+ and )?(\d+) bytes")


def smallest_budget(traced, prof, shape: Mesh) -> int:
    """The smallest per-device budget the planner reports for ``shape`` (recompute allowed): the
    figure of the ``ValueError`` a 1-byte budget raises, as a user reads it."""
    try:
        plan_traced(traced, prof, mesh=fast_mesh(shape), options=PlanOptions(memory_budget=1))
    except ValueError as exc:
        found = _SMALLEST.search(str(exc))
        if found is None:
            raise
        return int(found.group(1))
    raise AssertionError("a 1-byte budget was met")


def _plan_on(traced, prof, shape: Mesh, focus: str = "", budget_factor: float | None = None
             ) -> tuple[MeshResult, Any]:
    """(what happened, the plan to check end to end or None) for one mesh. ``budget_factor``:
    plan at that multiple of the smallest budget the planner reports (tight mode, no fallback)."""
    res = MeshResult()
    options = PlanOptions()
    try:
        if budget_factor is not None:
            res.min_budget = smallest_budget(traced, prof, shape)
            res.budget = int(res.min_budget * budget_factor)
            options = PlanOptions(memory_budget=res.budget)
        start = time.perf_counter()
        plan = plan_traced(traced, prof, mesh=fast_mesh(shape), options=options).plan
        res.plan_s = time.perf_counter() - start
        res.status = f"{plan.solver.get('status', '?')} {100 * (plan.solver.get('gap') or 0.0):.1f}%"
        res.strict = True
        res.sharded = is_sharded(plan, focus)
        return res, plan
    except NoRuleError:
        if budget_factor is not None:
            raise
    except Exception as exc:  # noqa: BLE001 -- any planning failure is this entry's result
        res.plan_error = _short(exc)
        return res, None
    try:  # list every unruled op, and keep a plan that still checks the rest end to end
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = plan_traced(traced, prof, mesh=fast_mesh(shape),
                               options=PlanOptions(allow_replicate_fallback=True)).plan
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


def _plan_all(traced, prof, meshes: Sequence[Mesh], focus: str = "", budget_factor: float | None = None
              ) -> tuple[dict, dict, float]:
    start = time.perf_counter()
    results, plans = {}, {}
    for shape in meshes:
        label = mesh_label(shape)
        results[label], plan = _plan_on(traced, prof, shape, focus, budget_factor)
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
        prep.result.ops = dict(traced.op_counts())
        prep.result.nodes = sum(prep.result.ops.values())
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


def _plan_child(traced, prof, meshes, focus, budget_factor, conn) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    try:
        payload = ("ok", _plan_all(traced, prof, meshes, focus, budget_factor))
    except BaseException:  # noqa: BLE001 -- sent back as text
        payload = ("error", traceback.format_exc())
    conn.send_bytes(pickle.dumps(payload))
    conn.close()


class _Planner:
    """Plans each traced entry in a forked process, ``jobs`` at a time, while the parent traces
    the next entries (planning a 2-D mesh costs several times the trace)."""

    def __init__(self, meshes: Sequence[Mesh], jobs: int, timeout: float, budget_factor: float | None = None) -> None:
        self.meshes, self.jobs, self.timeout, self.budget_factor = meshes, jobs, timeout, budget_factor
        self.ctx = mp.get_context("fork")
        self.running: dict[Any, tuple[Any, _Prepared, float]] = {}  # conn -> (process, prep, start)

    # Forking costs more than planning a graph this small on a 1-D mesh (tens of milliseconds).
    FORK_MIN_NODES = 50

    def submit(self, prep: _Prepared, prof) -> None:
        if self.jobs <= 1 or prep.result.nodes < self.FORK_MIN_NODES:
            self._store(prep, ("ok", _plan_all(prep.traced, prof, self.meshes, prep.entry.focus, self.budget_factor)))
            return
        while len(self.running) >= self.jobs:
            self._collect(block=True)
        parent, child = self.ctx.Pipe(duplex=False)
        # Frozen objects are never visited by the child's garbage collector, so the child does
        # not copy the parent's whole heap page by page (copy-on-write) when it collects.
        gc.freeze()
        proc = self.ctx.Process(target=_plan_child, daemon=True,
                                args=(prep.traced, prof, self.meshes, prep.entry.focus, self.budget_factor, child))
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


def sweep(entries: Sequence[Entry], meshes: Sequence[Mesh], *, task_timeout: float = 60.0,
          plan_timeout: float = 300.0, jobs: int | None = None, budget_factor: float | None = None,
          progress: Callable[[str], None] | None = None, workers: int = 1) -> list[Result]:
    """Prepare every entry (planning in up to ``jobs`` forked processes, default: the CPU count,
    at most 2), then run all of them end to end; one ``Result`` per entry, in order.
    ``budget_factor``: plan each mesh at that multiple of its smallest budget (``_plan_on``).
    ``workers`` > 1: the entries are dealt to that many sweeps run at once (``_split``), each
    planning in its own process."""
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate entry names: {sorted({n for n in names if names.count(n) > 1})}")
    if workers > 1 and len(entries) > 1:
        return _split(entries, workers, lambda share: sweep(
            share, meshes, task_timeout=task_timeout, plan_timeout=plan_timeout, jobs=1,
            budget_factor=budget_factor, progress=progress))
    jobs = min(2, os.cpu_count() or 1) if jobs is None else jobs
    start = time.perf_counter()
    planner = _Planner(meshes, jobs, plan_timeout, budget_factor)
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
        torch.set_num_threads(threads)
        planned_at = time.perf_counter()
        gc.freeze()  # as for the planning processes: ranks forked next share the parent's pages
        run_e2e(preps, meshes, task_timeout=task_timeout)
    finally:
        torch.set_num_threads(threads)
        gc.unfreeze()  # the sweep's objects are collectable again once the caller drops them
    if progress:
        progress(f"sweep of {len(preps)}: traced by {traced_at - start:.1f} s, planned by "
                 f"{planned_at - start:.1f} s, end to end {time.perf_counter() - planned_at:.1f} s")
    return [p.result for p in preps]


def _split(entries: Sequence[Entry], workers: int, run: Callable[[list[Entry]], list[Result]]) -> list[Result]:
    """``run`` on ``workers`` shares of the entries (dealt round-robin, so that a catalog's
    expensive kinds spread), one share in this process and each other in a forked one whose
    results come back pickled. Why: the parent traces its entries one after the other (the
    trace, not the planning, is most of a sweep of small graphs), so one sweep keeps one core
    busy; two sweeps at once keep both (each its own planning and end-to-end launch)."""
    ctx = mp.get_context("fork")
    shares = [list(entries[w::workers]) for w in range(workers)]
    children = []
    gc.freeze()  # as for the planning processes: the workers share the parent's pages
    try:
        for share in shares[1:]:
            parent, child = ctx.Pipe(duplex=False)
            # Not daemonic: a worker forks planning processes and gloo ranks of its own.
            proc = ctx.Process(target=_worker, args=(run, share, child))
            proc.start()
            child.close()
            children.append((proc, parent, share))
        results = run(shares[0])
        for proc, parent, share in children:
            try:
                kind, value = pickle.loads(parent.recv_bytes())
            except (EOFError, OSError):
                proc.join(timeout=5)
                kind, value = "error", f"the sweep worker died (exit code {proc.exitcode})"
            proc.join(timeout=30)
            if kind == "ok":
                results += value
            else:
                text = " ".join(str(value).split())[-300:]
                results += [Result(e.name, e.group, ref_error=f"sweep worker failed: {text}") for e in share]
    finally:
        gc.unfreeze()
        for proc, _, _ in children:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    by_name = {r.name: r for r in results}
    return [by_name[e.name] for e in entries]


def _worker(run: Callable[[list[Entry]], list[Result]], share: list[Entry], conn) -> None:
    try:
        payload = ("ok", run(share))
    except BaseException:  # noqa: BLE001 -- sent back as text
        payload = ("error", traceback.format_exc())
    conn.send_bytes(pickle.dumps(payload))
    conn.close()


def __getattr__(name: str):
    """The reporting helpers live in ``report`` (imported lazily: it imports ``Result``)."""
    if name in ("format_table", "group_failures", "format_failures", "replicated_plans"):
        from . import report

        return getattr(report, name)
    raise AttributeError(name)
