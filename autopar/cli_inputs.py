"""CLI argument resolution: models (zoo name or ``file.py:factory``), ``--input`` specs, meshes.

Every function raises ``ValueError`` with one clear line on bad input; ``cli.main`` prints it.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import sys
from typing import Any

__all__ = ["check_model_spec", "load_model", "parse_input", "resolve_mesh"]

_INPUT = re.compile(r"^([A-Za-z_][\w.]*):([a-z0-9]+)\[([\d,\s]*)\]$")
_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")


def parse_input(text: str):
    """``input_ids:int64[8,1024]`` -> (name, meta tensor of that dtype and shape)."""
    import torch

    m = _INPUT.match(text.strip())
    if m is None:
        raise ValueError(f"cannot parse --input {text!r}; expected NAME:DTYPE[D0,D1,...], e.g. input_ids:int64[8,1024]")
    name, dtype, dims = m.groups()
    if dtype not in _DTYPES:
        raise ValueError(f"--input {text!r}: unknown dtype {dtype!r}; known: {', '.join(_DTYPES)}")
    shape = tuple(int(d) for d in dims.replace(" ", "").split(",") if d)
    if any(d < 1 for d in shape):
        raise ValueError(f"--input {text!r}: dimensions must be positive")
    return name, torch.empty(shape, dtype=getattr(torch, dtype), device="meta")


def _load_factory(spec: str):
    path, _, attr = spec.rpartition(":")
    if not os.path.isfile(path):
        raise ValueError(f"model file {path!r} not found")
    module_name = f"_autopar_user_{abs(hash(os.path.abspath(path)))}"
    loader = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(loader)
    sys.modules[module_name] = module
    try:
        loader.loader.exec_module(module)
    except Exception as exc:  # user code: any failure is a bad model file, reported in one line
        raise ValueError(f"cannot import {path}: {type(exc).__name__}: {exc}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"{path} has no callable {attr!r}")
    return factory


def _call_factory(factory, spec: str, *, batch, seq, layers):
    params = inspect.signature(factory).parameters
    kwargs = {k: v for k, v in (("batch", batch), ("seq", seq), ("num_layers", layers)) if v is not None}
    unknown = [k for k in kwargs if k not in params and not any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())]
    if unknown:
        raise ValueError(f"factory {spec} does not take {', '.join(unknown)} (options --batch/--seq/--layers)")
    try:
        return factory(**kwargs)
    except Exception as exc:  # user code
        raise ValueError(f"factory {spec} failed: {type(exc).__name__}: {exc}") from None


def _is_file_spec(spec: str) -> bool:
    return ":" in spec and spec.rpartition(":")[0].endswith(".py")


def check_model_spec(spec: str, inputs: list[str] | None = None) -> None:
    """Fail fast (before any tracing) on a model name that cannot resolve or a bad ``--input``."""
    from . import zoo

    for text in inputs or []:
        parse_input(text)
    if _is_file_spec(spec):
        path = spec.rpartition(":")[0]
        if not os.path.isfile(path):
            raise ValueError(f"model file {path!r} not found")
    elif spec not in zoo.NAMES:
        raise ValueError(f"unknown model {spec!r}: use a zoo name ({', '.join(zoo.NAMES)}) or path/to/file.py:factory")


def load_model(spec: str, *, batch: int | None = None, seq: int | None = None, layers: int | None = None,
               inputs: list[str] | None = None) -> tuple[Any, Any]:
    """(model, meta_inputs) for a zoo name or ``path/to/file.py:factory``.

    A factory returns ``(model, meta_inputs)`` or a bare model (then ``--input`` is required).
    ``--input`` specs replace the factory's inputs (keyword arguments of ``forward``)."""
    from . import zoo

    given = dict(parse_input(t) for t in inputs or [])
    if _is_file_spec(spec):
        out = _call_factory(_load_factory(spec), spec, batch=batch, seq=seq, layers=layers)
        model, meta = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
        if given:
            meta = given
        if meta is None:
            raise ValueError(f"factory {spec} returned only a model: give its inputs with --input NAME:DTYPE[SHAPE]")
        return model, meta
    if spec not in zoo.NAMES:
        raise ValueError(f"unknown model {spec!r}: use a zoo name ({', '.join(zoo.NAMES)}) or path/to/file.py:factory")
    model, meta = zoo.build(spec, batch=batch, seq=seq, num_layers=layers)
    return model, (given or meta)


def resolve_mesh(device: str, mesh: str | None):
    """A MeshSpec from a preset name + shape, or from a profiled mesh JSON (shape must agree)."""
    from .mesh import PRESETS, MeshSpec, parse_mesh_shape

    if device.endswith(".json") or os.path.sep in device:
        if not os.path.isfile(device):
            raise ValueError(f"mesh file {device!r} not found")
        spec = MeshSpec.load(device)
        if mesh is not None and parse_mesh_shape(mesh) != spec.shape:
            raise ValueError(f"--mesh {mesh} does not match the profiled mesh {spec.shape} in {device}")
        return spec
    if device not in PRESETS:
        raise ValueError(f"unknown --device {device!r}: use a preset ({', '.join(sorted(PRESETS))}) or a mesh JSON file")
    if mesh is None:
        raise ValueError("--mesh is required with a device preset, e.g. --mesh 2x4")
    return MeshSpec.preset(device, mesh)
