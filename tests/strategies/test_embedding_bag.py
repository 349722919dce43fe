"""``aten._embedding_bag`` on PyTorch's own ``nn.functional.embedding_bag`` OpInfo samples.

The OpInfo sweep (``test_opinfo.py``) traces samples without decomposing, so it never reaches
``_embedding_bag`` (``F.embedding_bag`` exports as the composite ``embedding_bag.padding_idx``,
which the planner decomposes). Here the samples' ``_embedding_bag`` / ``_embedding_bag_forward_only``
calls are recorded under a dispatch mode -- 2-D inputs, offsets with and without
``include_last_offset``, per-sample weights, padding indices, every mode -- and
every candidate strategy is checked on them on meshes (2,), (2, 2), (3,) and (5,) (OpInfo sizes
are often odd), forward and backward. Sparse-gradient samples offer replication only.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.layout.mesh import MeshSpec
from autopar.strategies import enumerate_strategies
from autopar.strategies.check import StrategyMismatch, check_strategy, reference
from autopar.strategies.registry import Sample

aten = torch.ops.aten
BAGS = (aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
MESHES = [(2,), (2, 2), (3,), (5,)]


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in BAGS:
            self.calls.append((func, tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args),
                               dict(kwargs or {})))
        return func(*args, **(kwargs or {}))


def _opinfo_samples() -> list[tuple]:
    from torch.testing._internal.common_methods_invocations import op_db

    (info,) = [o for o in op_db if o.name == "nn.functional.embedding_bag"]
    out = []
    for index, s in enumerate(info.sample_inputs("cpu", torch.float64, requires_grad=True)):
        recorder = _Recorder()
        with recorder:
            info.op(s.input, *s.args, **s.kwargs)
        for func, args, kwargs in recorder.calls:
            frozen = ("weight", "per_sample_weights") if func is BAGS[1] else ()
            out.append((func, Sample(args, kwargs, label=f"opinfo sample {index}", no_grad=frozen)))
    return out


def test_every_strategy_on_opinfo_samples():
    samples = _opinfo_samples()
    assert len(samples) > 20
    failures, sharded = [], 0
    for target, sample in samples:
        ref = reference(target, sample)
        for shape in MESHES:
            for strategy in enumerate_strategies(ref[0], MeshSpec.preset("cpu", shape), flops=(0.0, 0.0)):
                sharded += not all(s is None or s.is_replicated() for s in strategy.input_specs)
                try:
                    check_strategy(target, sample, strategy, shape, ref=ref)
                except StrategyMismatch as exc:
                    failures.append(str(exc))
    assert sharded > 100  # the sweep is not vacuous: most samples shard on some mesh
    assert not failures, f"{len(failures)} strategies wrong:\n" + "\n".join(failures[:10])


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_sparse_gradients_stay_replicated(mode):
    info_sample = Sample((torch.randn(8, 4, dtype=torch.float64), torch.tensor([1, 2, 3, 4]),
                          torch.tensor([0, 2]), False, mode, True))
    ref = reference(aten._embedding_bag.default, info_sample)
    strategies = enumerate_strategies(ref[0], MeshSpec.preset("cpu", (2,)), flops=(0.0, 0.0))
    assert len(strategies) == 1 and strategies[0].input_specs[0].is_replicated()
