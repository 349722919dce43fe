"""Deprecated: ``profile_mesh`` is ``autopar.calibrate`` (``autopar.runtime.calibrate``).

The mesh profiler used to time each rank's best-of-5 matmul alone (a lucky repetition that had
both cores overstates what a step gets) beside its collective fit. Calibration measures both the
way a training step uses the machine, so this module only forwards to it: ``profile_mesh`` and
``profile_mesh_detailed`` warn and calibrate; the fit and the collective timings it re-exports
live in ``autopar.runtime.links``.
"""

from __future__ import annotations

import warnings
from typing import Sequence

from autopar.layout.mesh import MeshSpec
from autopar.runtime.calibrate import calibrate_detailed
from autopar.runtime.links import (KINDS, MeshProfile, Timing, fit_alpha_beta, measure_axis, ring_factor,
                                   time_collective)

__all__ = ["KINDS", "Timing", "MeshProfile", "profile_mesh", "profile_mesh_detailed", "time_collective",
           "measure_axis", "fit_alpha_beta", "ring_factor"]


def profile_mesh_detailed(shape: Sequence[int] | str, *, device: str = "cpu", sizes: list[int] | None = None,
                          repeats: int = 5, local: int | None = None, backend: str | None = None,
                          verbose: bool = False) -> MeshProfile:
    """Deprecated: ``autopar.runtime.calibrate.calibrate_detailed``."""
    warnings.warn("profile_mesh is deprecated: it is autopar.calibrate (the same measurement, which it runs)",
                  FutureWarning, stacklevel=2)
    return calibrate_detailed(shape, device=device, sizes=sizes, repeats=repeats, local=local, backend=backend,
                              verbose=verbose)


def profile_mesh(shape: Sequence[int] | str, *, device: str = "cpu", sizes: list[int] | None = None,
                 repeats: int = 5, local: int | None = None, backend: str | None = None,
                 verbose: bool = False) -> MeshSpec:
    """Deprecated: ``autopar.calibrate`` (without ``out=``)."""
    warnings.warn("profile_mesh is deprecated: it is autopar.calibrate (the same measurement, which it runs)",
                  FutureWarning, stacklevel=2)
    return calibrate_detailed(shape, device=device, sizes=sizes, repeats=repeats, local=local, backend=backend,
                              verbose=verbose).mesh
