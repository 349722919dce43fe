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


def test_ring_saved_activations_match_the_estimate():
    torch.manual_seed(0)
    model, inputs = zoo.build("llama-1b", tiny=True, batch=1, seq=SEQ, device="cpu")
    traced = trace(model, inputs, decompose_if=needs_decomposition)
    options = PlanOptions(sequence_parallel="ring", memory_budget=None, checkpoint="none")
    plan = plan_traced(traced, profile(traced), mesh=(2,), options=options).plan
    assert not plan.recompute
    est = plan.checkpoint["activation_bytes"]
    ref = reference(model, inputs, steps=1)
    results = run_local(_measure, 2, model, inputs, traced, plan, ref, timeout=300)
    for rank, (held, errors) in enumerate(results):
        assert not errors, errors
        assert abs(held - est) <= TOLERANCE * est, f"rank {rank}: measured {held} B saved, plan estimates {est} B"
