"""What ``test_opinfo.py`` checks (its expected failures, meshes, grouping) and the collection of
its OpInfo samples, traced in a forked process while pytest collects the other test files.

Why a child: ``opinfo.collect`` imports PyTorch's ``op_db`` and traces ~1,300 OpInfo samples
with ``torch.export`` (~17 s on the 2-core host, about 40 % of the suite's collection). In the
pytest process that work would be serial with importing the other ~170 test modules, and what
it leaves behind (``op_db``'s thousands of OpInfo objects, export's caches: ~300k objects,
~230 MB) would stay in the heap that every later forked rank and planner inherits. The child
(``start``, called from ``tests/conftest.py`` when the run's paths include ``test_opinfo.py``)
traces in parallel (half its batches in a process of its own: once the other files are imported,
pytest only waits for it) and sends back only the kept samples (small tensors, pickled);
``collection`` waits for it when ``test_opinfo.py`` is imported, or collects in-process when no
child was started (``python -m pytest tests/strategies/test_opinfo.py`` from a debugger, or a
plain import).
"""

from __future__ import annotations

import io
import os
import pickle
import traceback
from pathlib import Path
from typing import Any

import torch

from autopar.layout.mesh import MeshSpec
from autopar.strategies import enumerate_strategies, opinfo

MESHES = [(2,), (2, 2)]
# For samples whose every dim is odd (OpInfo's sizes are 5 and 3 for most reductions): the first
# of these that offers a sharded candidate is checked as well, so the sweep does not only
# check replication there.
ODD_MESHES = [(3,), (5,)]

XFAIL: dict[str, str] = {
    # (Random ops -- OpInfo samples on which two calls differ, quirk "random" -- are compared
    # exactly when strategies/_random.py rules them: the reference runs their counter-based
    # kernel whole, check.run_whole. A random op with no rule there would be listed here.)
    # The reference itself cannot be computed.
    "aten.linalg_eig.default": "reference backward raises: the gradient of complex eigenvectors is defined only "
                               "for losses invariant to their phase, and check.py draws a random output gradient",
}

TEST_FILE = Path(__file__).with_name("test_opinfo.py")


def bucket(item: opinfo.OpInfoSample) -> str:
    """The most specific ``XFAIL`` key that names ``item``, else ``<overload>@<quirk>`` for a
    sample with a quirk (it needs an entry), else its overload."""
    target = str(item.target)
    for key in (f"{target}@{item.source}[{item.index}]", f"{target}@{item.source}"):
        if key in XFAIL:
            return key
    return f"{target}@{item.quirk}" if item.quirk else target


def _opinfos():
    """``AUTOPAR_OPINFO=add,nn.functional.linear`` restricts the sweep (while debugging a rule)."""
    names = os.environ.get("AUTOPAR_OPINFO")
    if not names:
        return None
    return [o for o in opinfo.op_db() if o.name in names.split(",")]


def _sharded(strategy) -> bool:
    specs = strategy.input_specs + strategy.output_specs
    return not all(s is None or s.is_replicated() for s in specs)


def strategies(info, shape):
    return enumerate_strategies(info, MeshSpec.preset("cpu", shape), flops=(0.0, 0.0))


def meshes(info) -> tuple[list[tuple[int, ...]], str]:
    """The meshes to check ``info`` on and how its sharding gets checked there: ``MESHES``
    ("even" when they offer a sharded candidate), plus the first of ``ODD_MESHES`` that does
    when they offer none ("odd"; OpInfo's reductions use sizes 5 and 3 only), else "none"."""
    if any(_sharded(st) for shape in MESHES for st in strategies(info, shape)):
        return MESHES, "even"
    odd = next((shape for shape in ODD_MESHES if any(_sharded(st) for st in strategies(info, shape))), None)
    return (MESHES + [odd], "odd") if odd else (MESHES, "none")


def _prefer(item: opinfo.OpInfoSample) -> tuple:
    """``(class, tiebreak)`` for ``opinfo.collect``: samples without a quirk first, then those
    whose sharding gets checked (on ``MESHES``, else on an odd mesh), then
    ``opinfo.preference``."""
    try:
        kind = meshes(opinfo.info_of(item))[1]
    except Exception:  # noqa: BLE001 - a rule that raises: its test reports it
        kind = "none"
    return (item.quirk != "", ("even", "odd", "none").index(kind)), opinfo.preference(item)


def _collect(*, split: bool = False) -> opinfo.Collection:
    return opinfo.collect(opinfos=_opinfos(), bucket=bucket, prefer=_prefer,
                          trace_batches=_traced_in_two if split else None)


def _fork_pickled(work, *, quiet: bool = False) -> tuple[int, int]:
    """Run ``work()`` in a forked child that writes ``("ok", result)`` -- or ``("error",
    traceback)``: everything goes back to the parent as text -- pickled to a pipe; returns the
    child's pid and the pipe's read end. ``quiet``: the child's stdout/stderr go nowhere and it
    runs one thread (the parent collects the other test files on the other core)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover -- the child
        code = 1
        try:
            os.close(read)
            if quiet:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 1)
                os.dup2(devnull, 2)
                torch.set_num_threads(1)
            try:
                payload = _dumps(("ok", work()))
            except BaseException:  # noqa: BLE001 - back to the parent as text
                payload = _dumps(("error", traceback.format_exc()))
            with os.fdopen(write, "wb") as out:
                out.write(payload)
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    return pid, read


def _traced_in_two(batches: list) -> list:
    """``opinfo.traced_batches``, the odd batches in a forked process: once pytest has imported
    the other test files, its process only waits for this collector, so a second process keeps
    the second core busy (tracing is CPU-bound, one thread each)."""
    pid, read = _fork_pickled(lambda: opinfo.traced_batches(batches[1::2]))
    try:
        even = opinfo.traced_batches(batches[::2])
    finally:
        with os.fdopen(read, "rb") as f:
            data = f.read()
        os.waitpid(pid, 0)
    if not data:
        raise RuntimeError("the OpInfo collector's helper process died without reporting")
    kind, odd = _Unpickler(io.BytesIO(data)).load()
    if kind == "error":
        raise RuntimeError(f"tracing OpInfo samples failed in the collector's helper:\n{odd}")
    merged = [None] * len(batches)
    merged[::2], merged[1::2] = even, odd
    return merged


# ------------------------------------------------------------------------ the forked collector
# OpOverloads do not pickle (pybind function records): they travel by name.
class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch._ops.OpOverload):
            namespace, name = obj._schema.name.split("::")
            return ("op", namespace, name, obj._overloadname or "default")
        return None


class _Unpickler(pickle.Unpickler):
    def persistent_load(self, pid: Any) -> Any:
        _, namespace, name, overload = pid
        return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def _dumps(value: Any) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buf.getvalue()


_child: tuple[int, int] | None = None  # (pid, read end of its pipe), until ``collection`` reads it


def wanted(args: list[str], invocation_dir: Path) -> bool:
    """Whether pytest's path arguments (``config.args``) include ``test_opinfo.py``."""
    for arg in args:
        path = (invocation_dir / arg.split("::")[0]).resolve()
        if TEST_FILE == path or path in TEST_FILE.parents:
            return True
    return False


def start() -> None:
    """Fork the collector (once). Its stdout/stderr go nowhere (``op_db``'s import warnings);
    a failure comes back as its traceback and fails ``test_opinfo.py``'s collection."""
    global _child
    if _child is not None:
        return
    _child = _fork_pickled(lambda: _collect(split=True), quiet=True)


def stop() -> None:
    """End a collector nobody read (the run's filters left ``test_opinfo.py`` out)."""
    global _child
    if _child is not None:
        pid, read = _child
        _child = None
        os.close(read)
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def collection() -> opinfo.Collection:
    """The sweep's samples: the forked collector's when ``start`` ran, else collected here."""
    global _child
    if _child is None:
        return _collect()
    pid, read = _child
    _child = None
    with os.fdopen(read, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        raise RuntimeError(f"the OpInfo collector (pid {pid}) died without reporting (wait status {status})")
    kind, value = _Unpickler(io.BytesIO(data)).load()
    if kind == "error":
        raise RuntimeError(f"collecting the OpInfo samples failed in the forked collector:\n{value}")
    return value
