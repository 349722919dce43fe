"""Hugging Face models as users have them: key-value caches off for the trace, caches out of outputs.

A ``transformers`` model at its default config has ``use_cache=True``: its forward builds a
``DynamicCache`` (an object torch.export cannot return) even in training mode. For the trace:

- every config object reachable from the model (``model.config``, its sub-configs such as
  ``text_config`` / ``decoder``, and the ``.config`` of each submodule) gets ``use_cache=False``,
  restored afterwards, on failure too: the user's model is left as it was;
- ``forward`` gets ``use_cache=False`` as a keyword when it takes one and the user gave none;
- a cache object that still reaches the outputs is replaced by ``None`` (the output keeps its
  structure: tuple, dict or ``ModelOutput``), because a cache is inference state, not something
  a training step returns.

``transformers`` stays optional: configs and caches are recognised by their class names in the
MRO (``PreTrainedConfig``, ``Cache``), so nothing here imports it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any, Callable, Iterator

from torch import nn

__all__ = ["is_config", "is_cache", "configs_of", "caches_off", "wants_use_cache", "drop_caches"]

_CONFIG_BASES = frozenset({"PretrainedConfig", "PreTrainedConfig"})
_CACHE_BASES = frozenset({"Cache"})


def _mro_names(value: Any) -> set[str]:
    return {cls.__name__ for cls in type(value).__mro__}


def is_config(value: Any) -> bool:
    """A ``transformers`` config object (any ``PreTrainedConfig`` subclass)."""
    return bool(_mro_names(value) & _CONFIG_BASES)


def is_cache(value: Any) -> bool:
    """A ``transformers`` key-value cache (``DynamicCache``, ``EncoderDecoderCache``, ...).

    ``transformers.cache_utils.Cache`` subclasses, and duck-typed caches of other libraries:
    a class named ``...Cache`` with ``get_seq_length`` (the method every HF cache has)."""
    if _mro_names(value) & _CACHE_BASES:
        return True
    return type(value).__name__.endswith("Cache") and callable(getattr(value, "get_seq_length", None))


def configs_of(model: nn.Module) -> list[Any]:
    """Every config object reachable from ``model``, each once: ``.config`` of the model and its
    submodules, and configs nested in those (sub-configs, also inside lists and dicts)."""
    found: dict[int, Any] = {}

    def visit(value: Any) -> None:
        if isinstance(value, (list, tuple)):
            for item in value:
                visit(item)
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif is_config(value) and id(value) not in found:
            found[id(value)] = value
            for item in vars(value).values():
                visit(item)

    for module in model.modules():
        visit(getattr(module, "config", None))
    return list(found.values())


@contextlib.contextmanager
def caches_off(model: nn.Module) -> Iterator[int]:
    """``use_cache=False`` on every reachable config that has the attribute; restored on exit.

    Yields how many configs were changed."""
    saved: list[tuple[Any, bool, Any]] = []  # (config, had an instance value, old value)
    try:
        for config in configs_of(model):
            if not hasattr(config, "use_cache"):
                continue
            own = "use_cache" in vars(config)
            saved.append((config, own, getattr(config, "use_cache")))
            config.use_cache = False
        yield len(saved)
    finally:
        for config, own, old in reversed(saved):
            if own:
                config.use_cache = old
            else:  # the value came from the class: remove ours so the class one shows again
                with contextlib.suppress(AttributeError):
                    delattr(config, "use_cache")


def wants_use_cache(forward: Callable, given: dict) -> bool:
    """Whether to pass ``use_cache=False``: ``forward`` names the parameter, the user gave none."""
    if "use_cache" in given:
        return False
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):  # builtins and odd callables: nothing to bind
        return False
    param = params.get("use_cache")
    return param is not None and param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                inspect.Parameter.KEYWORD_ONLY)


def drop_caches(output: Any) -> Any:
    """``output`` with every cache object replaced by ``None``, structure kept.

    Tuples (named too), lists and dicts are rebuilt; a ``ModelOutput`` (a dataclass that is also
    a dict) is rebuilt from its other fields, so the cache field is unset, as when
    ``use_cache=False``."""
    if is_cache(output):
        return None
    if isinstance(output, dict) and dataclasses.is_dataclass(output):  # HF ModelOutput
        if not any(is_cache(v) or _holds_cache(v) for v in output.values()):
            return output
        kept = {k: drop_caches(v) for k, v in output.items() if not is_cache(v)}
        return type(output)(**kept)
    if isinstance(output, dict):
        return type(output)((k, drop_caches(v)) for k, v in output.items()) \
            if _holds_cache(output) else output
    if isinstance(output, (tuple, list)):
        if not _holds_cache(output):
            return output
        items = [drop_caches(v) for v in output]
        if isinstance(output, tuple) and hasattr(output, "_fields"):  # namedtuple
            return type(output)(*items)
        return type(output)(items)
    return output


def _holds_cache(value: Any) -> bool:
    if is_cache(value):
        return True
    if isinstance(value, dict):
        return any(_holds_cache(v) for v in value.values())
    if isinstance(value, (tuple, list)):
        return any(_holds_cache(v) for v in value)
    return False
