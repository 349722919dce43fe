"""The ParallelModule protocol and its one gradient clipping (autopar.runtime.parallel_module).

- ``clip_grad_norm`` over plain tensors is ``torch.nn.utils.clip_grad_norm_`` exactly (norm and
  clipped gradients, norms 2, 1 and inf); ``counted`` takes the norm over a subset and clips all;
- every module kind the runtime returns (``AutoParallelModule``, ``PipelineModule``) defines
  every method of the protocol, with ``clip_grad_norm_`` taking the same ``parameters=``.
(Multi-rank clipping is checked by tests/runtime/test_module.py, the pipeline and booster tests.)
"""

from __future__ import annotations

import inspect

import pytest
import torch

from autopar.runtime.module import AutoParallelModule
from autopar.runtime.parallel_module import ParallelModule, clip_grad_norm
from autopar.runtime.pipeline import PipelineModule


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(4, 3, generator=gen)) for _ in range(3)]
    for p in params[:2]:  # the last has no gradient: skipped
        p.grad = torch.randn(p.shape, generator=gen)
    return params


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_is_torchs_on_plain_tensors(norm_type):
    ours, theirs = _params(0), _params(0)
    want = torch.nn.utils.clip_grad_norm_(theirs, 0.5, norm_type=norm_type)
    got = clip_grad_norm(ours, 0.5, norm_type)
    assert want > 0.5 and torch.equal(got, want)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours[:2], theirs[:2])) and ours[2].grad is None


def test_counted_subset_sets_the_norm_and_every_gradient_is_clipped():
    params = _params(1)
    before = [p.grad.clone() for p in params[:2]]
    norm = clip_grad_norm(params, 0.1, counted=params[:1])
    assert torch.allclose(norm, before[0].norm())
    coef = 0.1 / (norm + 1e-6)
    assert all(torch.allclose(p.grad, g * coef) for p, g in zip(params, before))
    with pytest.raises(ValueError, match="norm_type must be positive"):
        clip_grad_norm(params, 1.0, 0.0)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_shards_count_in_the_norm_and_are_clipped(norm_type):
    """Gradients held outside ``.grad`` (chunk shards; one process: the all-reduce is skipped)
    count as if they were ``.grad`` of parameters of their own, and are scaled alike."""
    ours, theirs = _params(2), _params(2)
    shards = [p.grad for p in ours[1:2]]  # the second parameter's gradient, handed over as a shard
    ours[1].grad = None
    want = torch.nn.utils.clip_grad_norm_(theirs, 0.5, norm_type=norm_type)
    got = clip_grad_norm(ours, 0.5, norm_type, shards=iter(shards))  # an iterator: read once
    assert want > 0.5 and torch.allclose(got, want) and got.dtype == torch.float32
    assert torch.allclose(ours[0].grad, theirs[0].grad) and torch.allclose(shards[0], theirs[1].grad)


def test_every_module_kind_implements_the_protocol():
    # methods (``plan`` and ``device_mesh`` are instance attributes of a PipelineModule: the
    # multi-rank tests check ``isinstance(module, ParallelModule)`` on built modules)
    members = [name for name, value in vars(ParallelModule).items() if not name.startswith("_") and callable(value)]
    assert {"optimizer", "zero_parameters", "attach_zero", "clip_grad_norm_", "full_state_dict",
            "load_full_state_dict"} <= set(members)
    for cls in (AutoParallelModule, PipelineModule):
        assert [m for m in members if not hasattr(cls, m)] == [], cls.__name__
        assert "parameters" in inspect.signature(cls.clip_grad_norm_).parameters, cls.__name__
