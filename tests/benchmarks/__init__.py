"""Tests of the benchmark scripts (``benchmarks/*.py``: scripts, not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_script(name: str):
    """``benchmarks/<name>.py`` as a module, registered in ``sys.modules`` (a script's dataclasses
    look their module up)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
