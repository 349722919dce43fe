"""The output all-reduce left in flight (``runtime.pending``): a data-parallel loss is returned
before its all-reduce completes and waited on at its first read, with the blocking version's
values; backward does not wait for it. With it, GPT-2's data-parallel step has no blocking
collective left but the loss denominator's (the position embedding's gradient is bucketed:
``passes._Emitter._bucket_chain``)."""

from __future__ import annotations

import copy
import os
import pickle
import sys

import pytest
import torch

from autopar import zoo
from autopar.runtime.build import build_module
from autopar.runtime.launch import run_local
from autopar.runtime.pending import Inflight, PendingTensor
from autopar.tracer import trace

sys.path.insert(0, os.path.dirname(__file__))
from test_bucketing import _assert_close, fast_mesh, loss_of, reference_grads  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from _baselines import restricted_plan  # noqa: E402


class FakeWork:
    def __init__(self) -> None:
        self.waits = 0

    def wait(self) -> bool:
        self.waits += 1
        return True


def _pending(value: torch.Tensor, inflight: Inflight | None = None):
    work = FakeWork()
    return PendingTensor(value, (inflight or Inflight()).add(work)), work


def test_shape_only_ops_do_not_wait_and_the_first_read_waits_once():
    t, work = _pending(torch.tensor(2.5))
    assert torch.ones_like(t).item() == 1.0 and type(torch.ones_like(t)) is torch.Tensor
    assert torch.zeros_like(t).shape == () and work.waits == 0
    assert (t * 2).item() == 5.0 and type(t * 2) is torch.Tensor
    assert float(t) == 2.5 and f"{t:.2f}" == "2.50" and "2.5" in repr(t)
    assert work.waits == 1  # waited once, at the first read


def test_pickling_copying_and_lists_give_the_reduced_value():
    t, _ = _pending(torch.arange(4.0))
    for copied in (pickle.loads(pickle.dumps(t)), copy.deepcopy(t), t.detach()):
        assert type(copied) is torch.Tensor and torch.equal(copied, torch.arange(4.0))
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0] and t.numpy().tolist() == [0.0, 1.0, 2.0, 3.0]


def test_inflight_waits_for_unread_values_before_the_next_collective():
    inflight = Inflight()
    _, unread = _pending(torch.tensor(1.0), inflight)
    read, work = _pending(torch.tensor(2.0), inflight)
    read.item()
    inflight.wait_all()
    assert unread.waits == 1 and work.waits == 1


def _steps(rank, world, model, traced, plan, a, b):
    pm = build_module(model, traced, plan, device=torch.device("cpu"))
    out = {"code": pm.code}
    outputs = pm(**a)
    loss = outputs.loss
    out["pending"] = isinstance(loss, PendingTensor)
    out["logits"] = type(outputs.logits) is torch.Tensor  # gathered, not an all-reduce: returned as before
    if rank == 0:  # one rank reads the loss before backward, the other does not: no deadlock
        out["read_early"] = float(loss)
    loss.backward()
    out["loss"] = float(loss)
    out["grads"] = {k: None if g is None else g.clone() for k, g in pm.full_gradients().items()}
    pm.zero_grad(set_to_none=True)
    pm(**b).loss.backward()  # a loss nobody reads: waited on before the next step's all-reduce
    with torch.no_grad():
        out["eval"] = float(pm(**a).loss)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(2,), (2, 2)], ids=["2", "2x2"])
def test_data_parallel_loss_is_pending_and_exact(shape):
    """On (2, 2) the batch splits over both axes and the loss is a sum over both: one all-reduce
    on the group spanning them, left in flight like the one-axis sum (not a blocking chain)."""
    torch.manual_seed(3)
    model, a = zoo.build("gpt2", tiny=True, device="cpu")
    b = {k: v.roll(1, dims=0) for k, v in a.items()}
    plan = restricted_plan(model, a, mesh=fast_mesh(shape))
    traced = trace(model, a)
    with torch.no_grad():
        ref_loss = float(loss_of(model(**a)))
    ref = reference_grads(model, a)
    results = run_local(_steps, len(shape) * 2, model, traced, plan, a, b, timeout=300)
    for rank, res in enumerate(results):
        assert "pending = True" in res["code"], res["code"]
        assert ("axes = (0, 1)" in res["code"]) == (len(shape) == 2), res["code"]
        # The position embedding (looked up replicated, added to the batch-split token embedding)
        # is bucketed like every other weight: no blocking all-reduce of its activation gradient.
        axes = tuple(range(len(shape)))
        assert "self.grad_all_reduce(" not in res["code"] and f"wpe_weight, axes = {axes}, slot = 1)" in res["code"]
        assert res["pending"] and res["logits"], rank
        assert res["loss"] == pytest.approx(ref_loss, rel=1e-5)
        assert res["eval"] == res["loss"]
        for k, want in ref.items():
            _assert_close(res["grads"][k], want, f"rank {rank} grad {k}")
    assert results[0]["read_early"] == results[0]["loss"] == results[1]["loss"]
