"""The plan cache: solved plans on disk, so re-planning the same model, mesh and options is a read.

Planning is trace + profile + strategies + solve; a cache hit must skip all of them, the trace
included (GPT-2 XL traces in seconds), so the key is computed from the model object without
tracing. Two levels:

1. **Structural key** (``structural_key``): a SHA-256 over what determines the traced graph and
   the solve, read from the module tree in milliseconds: the model's class; per submodule its
   name, class (module and qualname), training flag and scalar attributes (``in_features``,
   ``p``, ``eps``, ``layer_idx``, ...); per parameter and buffer its name, shape, dtype and
   ``requires_grad``, and which names alias one tensor (tied weights); the Hugging Face config
   (``config.to_dict()`` and its attention implementation) when there is one; the source text of
   every distinct ``forward`` in the tree (an edited forward misses) and the version of the
   package defining it; the meta inputs' tree, names, shapes, dtypes (non-tensor leaves by
   value); the mesh (its full JSON, costs included); the budget in bytes; every
   ``PlanOptions`` field but ``baselines``; the autopar version, a hash of autopar's planning
   source (layout, planner, solver, strategies, tracer, plans, api: a changed cost model
   misses even at the same version number), the plan format and torch version.
2. **Graph hash**: the stored plan records the ``graph_hash`` of the trace it was solved from.
   Where a trace exists anyway (``autoparallelize`` traces on every rank to emit the module),
   ``lookup(..., graph_hash=...)`` serves the entry only when the hashes are equal; otherwise it
   is a miss with a warning and the caller plans again and overwrites the entry. A structural
   key cannot see everything that shapes a trace (a module-level helper a forward calls, a
   monkeypatched function), so ``autopar.plan`` -- which has no trace on a hit -- trusts the
   structural key alone; pass ``cache=False`` (or set ``AUTOPAR_CACHE=0``) while editing such code.

``baselines`` is not in the key: an entry solved with baselines serves requests with or without
them (the baselines are dropped for the latter); a request for baselines is not served by an entry
without them, and its solve overwrites the entry.

Storage: one file per key, ``<key>.json``, holding exactly ``Plan.to_json()`` (so
``autoparallelize(plan=<that file>)`` applies it), written atomically (a temporary file in the
same directory, then ``os.replace``: readers see the old file or the new one, concurrent writers
of one key leave one whole plan). The directory is ``$AUTOPAR_CACHE_DIR``, else
``$XDG_CACHE_HOME/autopar/plans``, else ``~/.cache/autopar/plans``. ``AUTOPAR_CACHE=0`` (or
``false``/``no``/``off``) switches the cache off everywhere; ``cache=False`` per call. An entry
that cannot be read or parsed, or that does not match the request, is a miss with a warning,
never an error; a cache directory that cannot be written only warns.

Under ``torchrun``, only rank 0 reads and writes the cache (``autopar.api``); the other ranks
receive rank 0's plan by broadcast, so ranks never race on files.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import os
import secrets
import sys
import warnings
from pathlib import Path
from typing import Any

from autopar.layout.buckets import bucket_cap_bytes
from autopar.layout.mesh import MeshSpec
from autopar.planner.options import PlanOptions
from autopar.plans import COST_MODEL_VERSION, PLAN_VERSION, Plan

__all__ = ["CACHE_FORMAT", "cache_enabled", "cache_dir", "structural_key", "entry_path", "lookup", "store"]

CACHE_FORMAT = 1  # bump when the key's contents change meaning
_OFF = ("0", "false", "no", "off")
# autopar's code that decides a plan; a change here must miss (see module docstring).
_PLANNING_SOURCES = ("layout", "planner", "solver", "strategies", "tracer", "plans.py", "api.py")
_SCALARS = (bool, int, float, str, type(None))


def cache_enabled(cache: bool = True) -> bool:
    """``cache`` unless ``AUTOPAR_CACHE`` switches the cache off."""
    return bool(cache) and os.environ.get("AUTOPAR_CACHE", "1").strip().lower() not in _OFF


def cache_dir() -> Path:
    explicit = os.environ.get("AUTOPAR_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "autopar" / "plans"


def entry_path(key: str) -> Path:
    return cache_dir() / f"{key}.json"


# ------------------------------------------------------------------------------------- the key
def structural_key(model: Any, meta_inputs: Any, *, mesh: MeshSpec, options: PlanOptions) -> str:
    """The hex key of (model, inputs, mesh, options) without tracing; see the module docstring."""
    digest = hashlib.sha256()

    def feed(*parts: Any) -> None:
        digest.update(repr(parts).encode())
        digest.update(b"\0")

    feed("format", CACHE_FORMAT, *_versions())
    feed("mesh", mesh.to_json(), "budget", options.budget_bytes(mesh))
    feed("bucket_cap", bucket_cap_bytes())  # the gradient sums are priced for it (``layout.buckets``)
    feed("options", sorted((k, repr(v)) for k, v in dataclasses.asdict(options).items() if k != "baselines"))
    feed("model", _class_name(type(model)))
    _feed_modules(model, feed)
    _feed_tensors(model, feed)
    _feed_config(model, feed)
    _feed_inputs(meta_inputs, feed)
    return digest.hexdigest()[:32]


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _versions() -> tuple[str, ...]:
    import torch

    # The package is imported before any of its modules; the planner layer does not import it.
    version = sys.modules["autopar"].__version__
    return (version, str(PLAN_VERSION), COST_MODEL_VERSION, torch.__version__, _planning_source_hash())


@functools.cache
def _planning_source_hash() -> str:
    root = Path(__file__).resolve().parent.parent  # the autopar package
    digest = hashlib.sha256()
    files = [p for name in _PLANNING_SOURCES
             for p in ((root / name).rglob("*.py") if (root / name).is_dir() else [root / name])]
    files += list(root.glob("_rotor*.so"))  # the compiled recompute solver
    for path in sorted(files):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _feed_modules(model, feed) -> None:
    forwards: dict[Any, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        cls = type(module)
        attrs = sorted((k, v) for k, v in vars(module).items()
                       if not k.startswith("_") and _is_plain(v))
        feed("module", name, _class_name(cls), attrs)
        forward = getattr(cls, "forward", None)
        if forward is not None and forward not in forwards:
            forwards[forward] = _forward_source_hash(forward)
            feed("forward", _class_name(cls), forwards[forward])


def _is_plain(value) -> bool:
    if isinstance(value, (tuple, list)):
        return all(isinstance(v, _SCALARS) for v in value)
    return isinstance(value, _SCALARS)


def _forward_source_hash(fn) -> str:
    """The forward's source text (its code object where there is no source file) and the
    version of the package that defines it."""
    module = getattr(fn, "__module__", None) or ""
    version = getattr(sys.modules.get(module.split(".")[0]), "__version__", "")
    try:
        text = inspect.getsource(fn)
    except (OSError, TypeError):  # defined in a REPL, or a builtin
        code = getattr(inspect.unwrap(fn), "__code__", None)
        text = repr(fn) if code is None else repr((code.co_code, code.co_consts, code.co_names))
    return hashlib.sha256(f"{module} {version}\n{text}".encode()).hexdigest()[:16]


def _feed_tensors(model, feed) -> None:
    """Parameters and buffers, and tied weights: a second name of one tensor is an alias."""
    first: dict[int, str] = {}
    for kind, items in (("param", model.named_parameters(remove_duplicate=False)),
                        ("buffer", model.named_buffers(remove_duplicate=False))):
        for name, t in items:
            alias = first.setdefault(id(t), name)
            feed(kind, name, tuple(t.shape), str(t.dtype), bool(t.requires_grad),
                 alias if alias != name else "")


def _feed_config(model, feed) -> None:
    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        feed("config", json.dumps(to_dict(), sort_keys=True, default=repr),
             repr(getattr(config, "_attn_implementation", None)))


def _feed_inputs(meta_inputs, feed) -> None:
    import torch
    from torch.utils import _pytree as pytree

    leaves, spec = pytree.tree_flatten_with_path(meta_inputs)
    feed("inputs", str(spec))
    for path, leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            feed("input", pytree.keystr(path), tuple(leaf.shape), str(leaf.dtype), bool(leaf.requires_grad))
        else:
            feed("input", pytree.keystr(path), type(leaf).__name__, repr(leaf))


# ------------------------------------------------------------------------------ read and write
def lookup(key: str, *, mesh: MeshSpec, options: PlanOptions,
           graph_hash: str | None = None) -> tuple[Plan, Path] | None:
    """The cached plan for ``key`` and its file, or None (a miss). ``graph_hash``: the caller's
    trace; an entry solved from a different graph is a miss with a warning."""
    path = entry_path(key)
    try:
        text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):  # no entry (store warns about a bad directory)
        return None
    except OSError as exc:
        warnings.warn(f"plan cache: cannot read {path} ({exc}); planning again", stacklevel=3)
        return None
    try:
        plan = Plan.from_json(text)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        warnings.warn(f"plan cache: {path} is not a readable plan ({str(exc)[:200]}); planning again",
                      stacklevel=3)
        return None
    problem = _mismatch(plan, mesh=mesh, options=options, graph_hash=graph_hash)
    if problem:
        warnings.warn(f"plan cache: {path} {problem}; planning again and replacing it", stacklevel=3)
        return None
    if options.baselines and not plan.baselines:
        return None  # solved without baselines: solve again with them
    if not options.baselines and plan.baselines:
        plan = dataclasses.replace(plan, baselines=())
    return plan, path


def _mismatch(plan: Plan, *, mesh: MeshSpec, options: PlanOptions, graph_hash: str | None) -> str:
    """Why an entry does not answer the request (the key makes these equal unless the file was
    edited or the graph changed below what the structural key sees); "" when it does."""
    if graph_hash is not None and plan.graph_hash != graph_hash:
        return (f"was solved for traced graph {plan.graph_hash} but the model now traces to {graph_hash} "
                f"(code the structural key does not see changed)")
    if plan.mesh != mesh:
        return f"is for mesh {plan.mesh}, not {mesh}"
    if plan.budget_bytes != options.budget_bytes(mesh):
        return f"is for budget {plan.budget_bytes}, not {options.budget_bytes(mesh)}"
    if (plan.precision, plan.reduce_dtype) != (options.precision, options.reduce_dtype):
        return f"is for {plan.precision}/{plan.reduce_dtype}, not {options.precision}/{options.reduce_dtype}"
    return ""


def store(key: str, plan: Plan) -> Path | None:
    """Write ``plan`` as the entry for ``key`` atomically; its path, or None (with a warning)
    when the cache directory cannot be written."""
    path = entry_path(key)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # os.open with 0o666, not mkstemp's 0o600: the umask decides, so a shared cache stays readable.
        tmp = str(path.parent / f".{key}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "w") as f:
            f.write(plan.to_json())
        os.replace(tmp, path)
        return path
    except OSError as exc:
        warnings.warn(f"plan cache: cannot write {path} ({exc}); the plan is not cached", stacklevel=3)
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        return None
