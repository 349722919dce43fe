"""``runtime.local_step``: torch's elementwise optimizers stepped on the local tensors of DTensor
parameters give exactly the DTensor step's parameters and state (DTensor moments with the
parameter's placements, plain step counts), on sharded and replicated parameters, 2 gloo ranks;
anything it cannot map steps on the DTensors."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from autopar.runtime.launch import run_local
from autopar.runtime.local_step import _swappable, stepping_locally

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adam-amsgrad-loop": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, foreach=False),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2, foreach=True),
}


def _params(mesh, seed):
    gen = torch.Generator().manual_seed(seed)
    full = [torch.randn(6, 4, generator=gen), torch.randn(5, generator=gen), torch.randn((), generator=gen)]
    layouts = [(Shard(0),), (Replicate(),), (Replicate(),)]
    return [torch.nn.Parameter(distribute_tensor(t, mesh, p)) for t, p in zip(full, layouts)], layouts


def _run(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    return {name: _compare(mesh, name) for name in OPTIMIZERS}


def _compare(mesh, name):
    a, layouts = _params(mesh, 0)
    b, _ = _params(mesh, 0)
    plain = torch.nn.Parameter(torch.randn(3))  # a plain parameter (its own group: foreach mixes no kinds)
    plain_b = torch.nn.Parameter(plain.detach().clone())
    opt_a = OPTIMIZERS[name]([{"params": a}, {"params": [plain], "lr": 3e-2}])
    opt_b = OPTIMIZERS[name]([{"params": b}, {"params": [plain_b], "lr": 3e-2}])
    for step in range(3):
        gen = torch.Generator().manual_seed(100 + step)
        for pa, pb, layout in zip(a, b, layouts):
            g = distribute_tensor(torch.randn(pa.shape, generator=gen), mesh, layout)
            pa.grad, pb.grad = g, g.detach().clone()
        plain.grad = torch.randn(3, generator=gen)
        plain_b.grad = plain.grad.clone()
        assert _swappable(opt_a)
        with stepping_locally(opt_a):
            opt_a.step()
        opt_b.step()
    out = {"params": all(torch.equal(pa.to_local(), pb.to_local()) for pa, pb in zip(a, b))
           and torch.equal(plain, plain_b),
           "grads_unpinned": all(pa._local_tensor.grad is None for pa in a),
           "groups": [[id(p) for p in g["params"]] for g in opt_a.param_groups] == [[id(p) for p in a],
                                                                                    [id(plain)]]}
    kinds = []
    for pa, pb in zip(a + [plain], b + [plain_b]):
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert sorted(sa) == sorted(sb)
        for key in sa:
            va, vb = sa[key], sb[key]
            kinds.append((key, type(va).__name__, type(vb).__name__))
            if isinstance(vb, DTensor):
                assert isinstance(va, DTensor) and va.placements == vb.placements and va.shape == vb.shape
                assert torch.equal(va.to_local(), vb.to_local()), key
            elif torch.is_tensor(vb):
                assert torch.equal(va, vb), key
            else:
                assert va == vb, key
    out["kinds"] = kinds
    # A state tensor in another layout than its parameter's: the ordinary DTensor step.
    key = next(k for k, v in opt_a.state[a[0]].items() if isinstance(v, DTensor))
    opt_a.state[a[0]][key] = opt_a.state[a[0]][key].redistribute(mesh, (Replicate(),))
    out["refused"] = not _swappable(opt_a)
    return out


@pytest.mark.timeout(120)
def test_local_step_equals_the_dtensor_step():
    for ranks in run_local(_run, 2, timeout=100):
        for name, out in ranks.items():
            assert out["params"] and out["grads_unpinned"] and out["groups"] and out["refused"], (name, out)
            assert all(ka == kb for _, ka, kb in out["kinds"]), (name, out["kinds"])


def test_other_optimizers_step_on_dtensors():
    class MyAdam(torch.optim.Adam):
        pass

    p = torch.nn.Parameter(torch.randn(3))
    assert not _swappable(MyAdam([p]))  # a subclass may step differently
    assert not _swappable(torch.optim.Adam([p], differentiable=True))
    assert _swappable(torch.optim.Adam([p]))
