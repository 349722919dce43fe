"""Bucketed data-parallel gradient all-reduce, on real gloo processes.

The same data-parallel plan is emitted with bucketing (the default) and without it
(``AUTOPAR_BUCKET_CAP_MB=0``: one in-graph ``grad_all_reduce`` per parameter). Every
``torch.distributed.all_reduce`` issued during backward is counted; the bucketed module must
issue fewer (one per bucket) and end with the same gradients, equal to single-device autograd.
Tied weights (one parameter read twice), gradient accumulation over two backward passes and two
forwards before one backward are covered, on meshes (2,) and (2, 2).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autopar import zoo
from autopar.layout.mesh import MeshSpec
from autopar.runtime.build import build_module
from autopar.runtime.launch import run_local
from autopar.tracer import trace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from _baselines import restricted_plan  # noqa: E402

pytestmark = pytest.mark.slow

RTOL, ATOL = 1e-4, 1e-6


def fast_mesh(shape):
    mesh = MeshSpec.preset("cpu", shape)
    return dataclasses.replace(mesh, alpha=(1e-7,) * len(shape), beta=(1e-13,) * len(shape), name="fast-links")


class TiedNet(nn.Module):
    """``w`` is read twice (like GPT-2's tied embedding): both uses must reach one gradient."""

    def __init__(self, hidden: int = 32, classes: int = 8) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(hidden, hidden) / hidden ** 0.5)
        self.head = nn.Linear(hidden, classes)
        self.classes = classes

    def forward(self, x: torch.Tensor, labels: torch.Tensor):
        h = F.linear(torch.tanh(F.linear(x, self.w)), self.w)
        logits = self.head(h)
        return F.cross_entropy(logits.reshape(-1, self.classes), labels.reshape(-1)), logits


def loss_of(out):
    return out[0] if isinstance(out, tuple) else out.loss


def reference_grads(model, *batches):
    """Single-device gradients accumulated over ``batches`` (one backward each)."""
    model = copy.deepcopy(model)
    for inputs in batches:
        loss_of(model(**inputs)).backward()
    return {k: p.grad.clone() for k, p in model.named_parameters(remove_duplicate=False)}


class CountAllReduce:
    """Counts every torch.distributed.all_reduce call in this process while active."""

    def __init__(self) -> None:
        self.count = 0

    def __enter__(self):
        self._orig = dist.all_reduce

        def counting(*args, **kwargs):
            self.count += 1
            return self._orig(*args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._orig


def _emit(model, traced, plan, cap_mb):
    os.environ["AUTOPAR_BUCKET_CAP_MB"] = str(cap_mb)
    try:
        return build_module(model, traced, plan, device=torch.device("cpu"))
    finally:
        del os.environ["AUTOPAR_BUCKET_CAP_MB"]


def _backward_counts(rank, world, model, traced, plan, inputs, caps):
    out = {}
    for cap in caps:
        pm = _emit(model, traced, plan, cap)
        loss = loss_of(pm(**inputs))
        with CountAllReduce() as counter:
            loss.backward()
        bucketer = getattr(pm.graph_module, "grad_bucket", None)
        out[cap] = {"all_reduces": counter.count, "grads": pm.full_gradients(), "loss": loss.detach(),
                    "code": pm.code, "buckets": None if bucketer is None else len(bucketer.buckets),
                    "slots": None if bucketer is None else len(bucketer.slots)}
    return out


def _assert_close(got, want, what):
    assert got is not None, f"{what}: missing"
    assert torch.allclose(got, want, rtol=RTOL, atol=ATOL), \
        f"{what}: max abs error {(got - want).abs().max().item():.3g}"


def test_gpt2_data_parallel_buckets_fewer_all_reduces_same_gradients():
    torch.manual_seed(0)
    model, inputs = zoo.build("gpt2", tiny=True, device="cpu")
    plan = restricted_plan(model, inputs, mesh=fast_mesh((2,)))
    traced = trace(model, inputs)
    ref = reference_grads(model, inputs)
    caps = (25, 0.02, 0)  # default cap, a cap that makes several buckets, no bucketing
    results = run_local(_backward_counts, 2, model, traced, plan, inputs, caps)
    for rank, res in enumerate(results):
        one, several, none = res[25], res[0.02], res[0]
        assert "self.grad_bucket(" in one["code"] and "self.grad_all_reduce(p_" not in one["code"]
        assert "self.grad_bucket(" not in none["code"] and "self.grad_all_reduce(p_" in none["code"]
        assert one["slots"] >= 20, one["slots"]  # every block weight is data parallel in this plan
        assert one["buckets"] == 1 and several["buckets"] > 1
        # In-graph: at least one all-reduce per bucketed parameter; bucketed: the activations'
        # all-reduces (same in both) plus one per bucket.
        activation_ars = none["all_reduces"] - one["slots"]
        assert activation_ars >= 0
        assert one["all_reduces"] == activation_ars + 1, (one["all_reduces"], none["all_reduces"])
        assert several["all_reduces"] == activation_ars + several["buckets"]
        assert one["all_reduces"] < several["all_reduces"] < none["all_reduces"]
        for k, want in ref.items():
            _assert_close(one["grads"][k], want, f"rank {rank} bucketed grad {k}")
            _assert_close(several["grads"][k], want, f"rank {rank} small-bucket grad {k}")
            # Two ranks: a + b is exact, so bucketing changes no bit.
            assert torch.equal(one["grads"][k], none["grads"][k]), k
            assert torch.equal(several["grads"][k], none["grads"][k]), k


def _grads(pm):
    """Full gradients, copied (a replicated parameter's full gradient is its own ``.grad``)."""
    return {k: None if g is None else g.clone() for k, g in pm.full_gradients().items()}


def _tied_runs(rank, world, model, traced, plan, a, b):
    out = {}
    pm = _emit(model, traced, plan, 25)
    out["code"] = pm.code
    # Two backward passes, no zero_grad in between: gradients accumulate.
    loss_of(pm(**a)).backward()
    out["first"] = _grads(pm)
    loss_of(pm(**b)).backward()
    out["accumulated"] = _grads(pm)
    # Two forwards, one backward: the tied weight's slot gets two contributions.
    pm.zero_grad(set_to_none=True)
    (loss_of(pm(**a)) + loss_of(pm(**b))).backward()
    out["two_forwards"] = _grads(pm)
    # Gradients stay identical on every replica (the local shards, not gathered copies).
    out["local"] = {n: p.grad.to_local().clone() for n, p in pm.named_parameters()}  # DTensor grads
    # The graph reads each trained parameter as its persistent leaf: no autograd node per
    # parameter per step (runtime.dtensors.LocalLeaf) ...
    pm.zero_grad(set_to_none=True)
    loss = loss_of(pm(**a))
    out["nodes"] = _node_kinds(loss.grad_fn)
    loss.backward()
    # ... remade for a parameter replaced in the module (load_state_dict(assign=True) does so).
    name, old = next((n, p) for n, p in pm.named_parameters() if n.rpartition(".")[2] == "w")
    path, _, leaf = name.rpartition(".")
    new = nn.Parameter(old.detach().clone())
    pm.get_submodule(path)._parameters[leaf] = new
    pm.zero_grad(set_to_none=True)
    old.grad = None
    loss_of(pm(**a)).backward()
    out["replaced"] = _grads(pm)
    out["old_grad"] = old.grad
    return out


def _node_kinds(fn) -> set[str]:
    seen, todo = set(), [fn]
    while todo:
        f = todo.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        todo.extend(g for g, _ in f.next_functions)
    return {type(f).__name__ for f in seen}


@pytest.mark.parametrize("shape", [(2,), (2, 2)], ids=["2", "2x2"])
def test_tied_weight_accumulation_and_two_forwards(shape):
    torch.manual_seed(1)
    model = TiedNet()
    world = 2 if shape == (2,) else 4
    a = {"x": torch.randn(8, 4, 32), "labels": torch.randint(0, 8, (8, 4))}
    b = {"x": torch.randn(8, 4, 32), "labels": torch.randint(0, 8, (8, 4))}
    plan = restricted_plan(model, a, mesh=fast_mesh(shape))
    traced = trace(model, a)
    ref_a, ref_ab = reference_grads(model, a), reference_grads(model, a, b)
    results = run_local(_tied_runs, world, model, traced, plan, a, b)
    for rank, res in enumerate(results):
        assert res["code"].count("self.grad_bucket(p_w,") == 1, res["code"]
        for k in ref_a:
            _assert_close(res["first"][k], ref_a[k], f"rank {rank} grad {k}")
            _assert_close(res["accumulated"][k], ref_ab[k], f"rank {rank} accumulated grad {k}")
            _assert_close(res["two_forwards"][k], ref_ab[k], f"rank {rank} two-forward grad {k}")
        for n, g in res["local"].items():
            assert torch.equal(g, results[0]["local"][n]), f"rank {rank}: {n} differs from rank 0"
        assert not {"_BucketGradBackward", "_LocalViewsBackward"} & res["nodes"], res["nodes"]
        assert "AccumulateGrad" in res["nodes"]
        assert res["old_grad"] is None
        for k in ref_a:
            _assert_close(res["replaced"][k], ref_a[k], f"rank {rank} grad {k} after replacing w")


def _after_failed_backward(rank, world, model, traced, plan, a):
    pm = _emit(model, traced, plan, 25)
    x = a["x"].clone().requires_grad_(True)

    def boom(grad):
        raise RuntimeError("backward interrupted on purpose")

    x.register_hook(boom)  # x's gradient comes last: the parameters' buckets are under way
    try:
        loss_of(pm(x=x, labels=a["labels"])).backward()
    except RuntimeError as exc:
        assert "on purpose" in str(exc)
    else:
        raise AssertionError("the hook did not raise")
    pm.zero_grad(set_to_none=True)
    loss_of(pm(**a)).backward()  # a clean pass after the interrupted one
    return _grads(pm)


def test_backward_after_an_interrupted_backward():
    torch.manual_seed(2)
    model = TiedNet()
    a = {"x": torch.randn(8, 4, 32), "labels": torch.randint(0, 8, (8, 4))}
    plan = restricted_plan(model, a, mesh=fast_mesh((2,)))
    ref = reference_grads(model, a)
    for rank, grads in enumerate(run_local(_after_failed_backward, 2, model, trace(model, a), plan, a)):
        for k, want in ref.items():
            _assert_close(grads[k], want, f"rank {rank} grad {k} after an interrupted backward")


def test_first_bucket_is_small_like_ddp():
    """Buckets fill in reverse forward order; the first to leave (per axes and dtype) is capped at
    ``first_cap_bytes`` (DDP's 1 MiB) so it is issued early in backward, the rest at ``cap_bytes``."""
    from autopar.runtime.bucketing import GradBucketer

    half_mib = (2**17,)  # float32: 0.5 MiB
    for first_cap, want in ((2**20, [[9, 8], [7, 6, 5, 4, 3, 2, 1, 0]]), (0, [[9, 8, 7, 6, 5, 4, 3, 2], [1, 0]])):
        b = GradBucketer(None, 4 * 2**20, first_cap)  # the layout needs no process group
        for k in range(10):
            b.add_slot(f"w{k}", (0,), half_mib, torch.float32)
        assert [bucket.slots for bucket in b.buckets] == want, first_cap
    # Each (axes, dtype) group has its own small first bucket.
    b = GradBucketer(None, 4 * 2**20, 2**20)
    for k in range(6):
        dtype = torch.float32 if k % 2 else torch.bfloat16
        b.add_slot(f"w{k}", (0,), (2**19 // dtype.itemsize,), dtype)  # 0.5 MiB each
    assert [(bucket.dtype, bucket.slots) for bucket in b.buckets] == [
        (torch.float32, [5, 3]), (torch.bfloat16, [4, 2]), (torch.float32, [1]), (torch.bfloat16, [0])]


def _spanning_runs(rank, world, model, traced, plan, inputs):
    pm = _emit(model, traced, plan, 25)
    bucketer = pm.graph_module.grad_bucket
    groups = []
    orig = dist.all_reduce

    def recording(tensor, *args, group=None, **kwargs):
        groups.append(None if group is None else dist.get_world_size(group))
        return orig(tensor, *args, group=group, **kwargs)

    loss = loss_of(pm(**inputs))
    dist.all_reduce = recording
    try:
        loss.backward()
    finally:
        dist.all_reduce = orig
    both = [b for b in bucketer.buckets if len(b.axes) == 2]
    return {"grads": _grads(pm), "spanning": len(both), "stats": dict(bucketer.stats), "groups": groups}


def test_a_bucket_over_both_axes_is_one_all_reduce_over_the_world():
    """Data parallelism on (2, 2): each bucket's sum over both axes is one collective on the
    group spanning them (4 ranks), in flight beside backward, not a chain of two whose second
    waits for the end of backward; the gradients equal one device's."""
    torch.manual_seed(2)
    model = TiedNet(hidden=64)  # large enough that the plan splits the batch over both axes
    inputs = {"x": torch.randn(16, 8, 64), "labels": torch.randint(0, 8, (16, 8))}
    plan = restricted_plan(model, inputs, mesh=fast_mesh((2, 2)))
    traced = trace(model, inputs)
    ref = reference_grads(model, inputs)
    for rank, res in enumerate(run_local(_spanning_runs, 4, model, traced, plan, inputs, timeout=120)):
        assert res["spanning"] >= 1, res
        assert res["stats"]["all_reduces"] == res["stats"]["buckets"], res["stats"]
        assert res["groups"].count(4) >= res["spanning"], res["groups"]
        for k, want in ref.items():
            _assert_close(res["grads"][k], want, f"rank {rank} grad {k}")
