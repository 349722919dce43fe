"""CLI argument resolution: models (zoo name, ``file.py:factory`` or a Hugging Face
``config.json``), ``--input`` specs, meshes.

A ``config.json`` (or a folder holding one) names its model class in ``architectures``; the
model is built from that class on ``meta`` (no weights), with inputs for its head made from
``--batch`` / ``--seq`` (token ids and labels for language models, pixels and class labels for
image classifiers), as the zoo does.

Every function raises ``ValueError`` with one clear line on bad input; ``cli.main`` prints it.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import re
import sys
from typing import Any

__all__ = ["check_model_spec", "load_config_model", "load_model", "parse_input", "resolve_mesh"]

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


_MODEL_FORMS = "a zoo name ({}), path/to/file.py:factory or a Hugging Face config.json"


def check_model_spec(spec: str, inputs: list[str] | None = None) -> None:
    """Fail fast (before any tracing) on a model name that cannot resolve or a bad ``--input``."""
    from autopar import zoo

    for text in inputs or []:
        parse_input(text)
    if _is_config_spec(spec):
        _read_config_json(spec)
    elif _is_file_spec(spec):
        path = spec.rpartition(":")[0]
        if not os.path.isfile(path):
            raise ValueError(f"model file {path!r} not found")
    elif spec not in zoo.NAMES:
        raise ValueError(f"unknown model {spec!r}: use {_MODEL_FORMS.format(', '.join(zoo.NAMES))}")


def load_model(spec: str, *, batch: int | None = None, seq: int | None = None, layers: int | None = None,
               inputs: list[str] | None = None) -> tuple[Any, Any]:
    """(model, meta_inputs) for a zoo name, ``path/to/file.py:factory`` or a ``config.json``.

    A factory returns ``(model, meta_inputs)`` or a bare model (then ``--input`` is required).
    ``--input`` specs replace the built inputs (keyword arguments of ``forward``)."""
    from autopar import zoo

    given = dict(parse_input(t) for t in inputs or [])
    if _is_config_spec(spec):
        model, meta = load_config_model(spec, batch=batch, seq=seq, layers=layers)
        return model, (given or meta)
    if _is_file_spec(spec):
        out = _call_factory(_load_factory(spec), spec, batch=batch, seq=seq, layers=layers)
        model, meta = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
        if given:
            meta = given
        if meta is None:
            raise ValueError(f"factory {spec} returned only a model: give its inputs with --input NAME:DTYPE[SHAPE]")
        return model, meta
    if spec not in zoo.NAMES:
        raise ValueError(f"unknown model {spec!r}: use {_MODEL_FORMS.format(', '.join(zoo.NAMES))}")
    model, meta = zoo.build(spec, batch=batch, seq=seq, num_layers=layers)
    return model, (given or meta)


# ------------------------------------------------------------------ Hugging Face config.json
_BATCH, _SEQ = 8, 1024  # the zoo's defaults for real-size models
# Head (class-name suffix) -> how its labels look: per token, per sequence, or none.
_TOKEN_LABELS = ("ForCausalLM", "LMHeadModel", "ForMaskedLM", "ForConditionalGeneration")
_CLASS_LABELS = ("ForSequenceClassification", "ForImageClassification")


def _is_config_spec(spec: str) -> bool:
    return spec.endswith(".json") or os.path.isfile(os.path.join(spec, "config.json"))


def _config_path(spec: str) -> str:
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        raise ValueError(f"config file {spec!r} not found")
    return path


def _read_config_json(spec: str) -> tuple[str, dict, str]:
    """(path, the JSON as a dict, the model class name from ``architectures``)."""
    path = _config_path(spec)
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a Hugging Face config (a JSON object)")
    archs = data.get("architectures") or []
    if not archs or not isinstance(archs, list) or not isinstance(archs[0], str):
        raise ValueError(f"{path} names no model class: its 'architectures' field is missing or empty; "
                         f"add e.g. \"architectures\": [\"LlamaForCausalLM\"]")
    return path, data, archs[0]


def load_config_model(spec: str, *, batch: int | None = None, seq: int | None = None,
                      layers: int | None = None):
    """(model on meta, meta inputs) for a Hugging Face ``config.json`` or a folder holding one."""
    import torch
    import transformers

    path, data, arch = _read_config_json(spec)
    cls = getattr(transformers, arch, None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise ValueError(f"{path}: architecture {arch!r} is not a model class of transformers "
                         f"{transformers.__version__}")
    try:
        config = cls.config_class.from_dict(data)
    except Exception as exc:  # the library validates the config: any failure is a bad file
        raise ValueError(f"{path}: not a valid {cls.config_class.__name__}: {type(exc).__name__}: {exc}") from None
    if layers is not None:
        _set_layers(config, layers)
    try:
        with torch.device("meta"):
            model = cls(config)
    except Exception as exc:  # library code on a user's config
        raise ValueError(f"cannot build {arch} from {path}: {type(exc).__name__}: {exc}") from None
    model.train()
    return model, _config_inputs(model, config, arch, batch=batch, seq=seq)


def _set_layers(config, layers: int) -> None:
    """--layers: the depth of every stack the config describes (encoder and decoder too)."""
    names = [n for n in ("num_hidden_layers", "num_layers", "num_decoder_layers", "encoder_layers",
                         "decoder_layers") if hasattr(config, n)]
    if not names:
        raise ValueError(f"--layers: {type(config).__name__} has no layer count to override")
    for name in names:
        setattr(config, name, layers)


def _config_inputs(model, config, arch: str, *, batch: int | None, seq: int | None) -> dict:
    """Meta inputs for the model's main input, plus labels when its head computes a loss."""
    import torch

    batch = batch or _BATCH
    kind = model.main_input_name
    with torch.device("meta"):
        if kind == "input_ids":
            vocab = _config_int(config, arch, "vocab_size")
            limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
            seq = seq or min(_SEQ, limit or _SEQ)
            inputs = {"input_ids": torch.randint(0, vocab, (batch, seq))}
            if arch.endswith(_TOKEN_LABELS):
                inputs["labels"] = torch.randint(0, vocab, (batch, seq))
        elif kind == "pixel_values":
            size = _config_int(config, arch, "image_size")
            inputs = {"pixel_values": torch.randn(batch, getattr(config, "num_channels", 3), size, size)}
        else:
            raise ValueError(f"{arch}: the CLI builds inputs for token and image models only, not "
                             f"{kind!r}; give them with --input NAME:DTYPE[SHAPE]")
        if arch.endswith(_CLASS_LABELS):
            inputs["labels"] = torch.randint(0, max(config.num_labels, 1), (batch,))
    return inputs


def _config_int(config, arch: str, name: str) -> int:
    value = getattr(config, name, None)
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{arch}: the config has no usable {name!r} (got {value!r}), needed to build inputs")
    return value


def resolve_mesh(preset: str, mesh: str | None, *, flag: str = "--preset"):
    """A MeshSpec from a preset name + shape, or from a calibrated profile (shape must agree).
    ``flag``: the option name ``preset`` came from, for error messages."""
    from autopar.layout.mesh import PRESETS, MeshSpec, is_profile_path

    if is_profile_path(preset):
        return MeshSpec.from_profile(preset, mesh)  # a calibrated profile: the shape it was measured on
    if preset not in PRESETS:
        raise ValueError(f"unknown {flag} {preset!r}: use a preset ({', '.join(sorted(PRESETS))}) or a mesh JSON file")
    if mesh is None:
        raise ValueError("--mesh is required with a device preset, e.g. --mesh 2x4")
    return MeshSpec.preset(preset, mesh)
