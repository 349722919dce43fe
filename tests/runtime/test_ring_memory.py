"""Issue 31 point 6: the saved-activation bytes of a sequence-split plan, measured on gloo, within
10% of the plan's estimate.

HF Llama at the zoo's tiny width (hidden 64, 2 layers, 4 heads, 2 KV heads), batch 1, a long
sequence (1024 tokens), ``sequence_parallel="ring"`` pinned on 2 gloo ranks, no recompute: each
rank runs the forward under ``saved_tensors_hooks`` (``tests/runtime/pipeline/test_memory``'s
``SavedBytes``: each storage once while autograd holds it; parameters, buffers and the inputs left
out) and the bytes still held when the forward ends are compared with the plan's
``checkpoint["activation_bytes"]`` (``solver.timeline.activation_bytes``: the saved bytes per device
at the end of the forward). The measured figure must be within 10% of the estimate; the loss and
gradients must equal the single-device run's (the plan is a real one, not only a memory probe).
"""

from __future__ import annotations

import pytest
import torch

from autopar import zoo
from autopar.api import PlanOptions, plan_traced
from autopar.runtime.build import build_module
from autopar.runtime.dtensors import local_of
from autopar.runtime.launch import run_local
from autopar.strategies import needs_decomposition
from autopar.tracer import profile, trace
from tests.runtime.pipeline.test_memory import SavedBytes
from tests.runtime.test_e2e import loss_of, reference

pytestmark = pytest.mark.slow

SEQ = 1024
TOLERANCE = 0.10


def _measure(rank, world, model, inputs, traced, plan, ref):
    pm = build_module(model, traced, plan, device=torch.device("cpu"))
    excluded = {local_of(t).untyped_storage().data_ptr() for t in [*pm.parameters(), *pm.buffers(), *inputs.values()]}
    saved = SavedBytes(excluded)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        loss = loss_of(pm(**inputs))
    held = saved.live
    loss.backward()
    grads = pm.full_gradients()
    errors = [] if torch.allclose(loss.detach(), ref["loss"], rtol=1e-5) else [f"loss {loss} != {ref['loss']}"]
    errors += [f"grad {k}" for k, want in ref["grads"].items()
               if want is not None and not torch.allclose(grads[k], want, rtol=1e-4, atol=1e-6)]
    return held, errors


def saved_per_rank(seq: int, ranks: int, *, layers: int | None = None) -> tuple[int, list[int]]:
    """(the plan's saved bytes per device, the bytes each gloo rank held when its forward ended)
    for Llama-tiny at ``seq`` tokens, batch 1, the ring pinned over ``ranks`` ranks; raises when a
    rank's loss or gradients differ from the single device's (also ``benchmarks/ring_memory.py``)."""
    torch.manual_seed(0)
    model, inputs = zoo.build("llama-1b", tiny=True, batch=1, seq=seq, num_layers=layers, device="cpu")
    traced = trace(model, inputs, decompose_if=needs_decomposition)
    options = PlanOptions(sequence_parallel="ring", memory_budget=None, checkpoint="none")
    plan = plan_traced(traced, profile(traced), mesh=(ranks,), options=options).plan
    if plan.recompute:
        raise AssertionError(f"checkpoint='none' planned recompute regions {[r.name for r in plan.recompute]}")
    ref = reference(model, inputs, steps=1)
    results = run_local(_measure, ranks, model, inputs, traced, plan, ref, timeout=300)
    errors = [e for _, rank_errors in results for e in rank_errors]
    if errors:
        raise AssertionError("\n".join(errors[:10]))
    return plan.checkpoint["activation_bytes"], [held for held, _ in results]


def test_ring_saved_activations_match_the_estimate():
    est, held = saved_per_rank(SEQ, 2)
    for rank, measured in enumerate(held):
        assert abs(measured - est) <= TOLERANCE * est, f"rank {rank}: measured {measured} B saved, plan {est} B"
