"""The user-model probe as a regression sweep: hand-written models (``user_models``) trained
through the public API -- ``autopar.autoparallelize`` and the Booster, with and without
``prepare_dataloader`` -- on real gloo ranks, 3 AdamW steps, against one device: the loss and
every gradient of the first step and the state after the steps (``user_probe``).

Per case and mesh: an ample budget, 1.1x the smallest budget on the sweep mesh (nearly free
links) and on the plain ``cpu`` preset (what ``mesh=(2, 2)`` gets), where the default
``pipeline="auto"`` is a candidate. By default two cases run, each a past failure: a model
returning no loss on the ``cpu`` preset at a tight budget (the default picked a pipeline every
rank then refused to build) and a forward returning the user's own dataclass (the tracer refused
it; its default run: the ample and tight budgets through ``autoparallelize``). Every case on both
meshes, every budget: ``pytest -m full_sweep tests/sweeps/test_user_models.py``
(about 10 minutes on 2 cores), or ``python -m tests.sweeps.user_probe [case ...]`` for the table.
"""

from __future__ import annotations

import pytest

from . import user_probe
from .user_models import CASES, case

# (case, mesh, every budget of ``user_probe.probe``'s ``full``): the user's-dataclass case failed
# in the tracer, so its ample and tight budgets through ``autoparallelize`` check it; the Booster,
# the data loader and the plain ``cpu`` preset run with mlp_mixer by default (and with every case
# under ``full_sweep``).
DEFAULT = (("mlp_mixer", (2,), True), ("param_twice_paramlist_moduledict", (2,), False))


def _failures(name: str, shape: tuple[int, ...], full: bool = True) -> list[str]:
    return [f"{name} {shape} {label}: {'; '.join(o.errors[:4])}"
            for label, o in user_probe.probe(case(name), shape, full=full).items() if o.errors]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name, shape, full", DEFAULT, ids=[f"{n}-{'x'.join(map(str, s))}" for n, s, _ in DEFAULT])
def test_user_model_trains_like_one_device(name, shape, full):
    failures = _failures(name, shape, full)
    assert not failures, "\n".join(failures)


@pytest.mark.full_sweep
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("shape", user_probe.MESHES, ids=lambda s: "x".join(map(str, s)))
def test_every_user_model_trains_like_one_device(shape):
    failures = [f for c in CASES for f in _failures(c.name, shape)]
    assert not failures, f"{len(failures)} runs differ from one device or failed:\n" + "\n".join(failures)
