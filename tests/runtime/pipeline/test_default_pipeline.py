"""``autoparallelize`` with the default options picks a pipeline where it wins (issue 30, point
6) and the pipelined module trains like the single-device model on gloo ranks: loss, every
gradient and the parameters after AdamW steps (``pipeline=1``, which plans without one:
``tests/planner/pipeline/test_default_auto.py``)."""

import copy

import torch

from autopar.layout.mesh import MeshSpec
from autopar.runtime.launch import run_local
from tests.planner.pipeline.test_default_auto import qwen2_decoder
from tests.runtime.pipeline.test_pipeline import close

STEPS = 2


def _body(rank, world, model, inputs, want_loss, want_grads, want_params):
    from autopar.api import autoparallelize
    from autopar.runtime.pipeline import PipelineModule

    pm = autoparallelize(model, inputs, mesh=MeshSpec.preset("cpu", (2,)), cache=False)  # pipeline: the default
    if not isinstance(pm, PipelineModule):
        return [f"the default planned no pipeline: {type(pm).__name__}"]
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-3)
    errors = []
    for step in range(STEPS):
        loss = pm.step(**inputs)
        if step == 0:
            errors += close("loss", loss, want_loss)
            grads = pm.full_gradients()
            errors += [e for k, w in want_grads.items() for e in close(f"grad {k}", grads.get(k), w)]
        opt.step()
        opt.zero_grad()
    got = pm.full_state_dict()
    errors += [e for k, w in want_params.items() for e in close(f"param {k}", got.get(k), w)]
    return errors


def test_default_pipeline_trains_like_single_device():
    model, inputs = qwen2_decoder(device="cpu")
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    want_loss = want_grads = None
    for step in range(STEPS):
        loss = ref(**inputs).loss
        loss.backward()
        if step == 0:
            want_loss = loss.detach().clone()
            want_grads = {k: p.grad.clone() for k, p in ref.named_parameters()}
        opt.step()
        opt.zero_grad()
    want_params = {k: p.detach().clone() for k, p in ref.named_parameters()}
    errors = run_local(_body, 2, model, inputs, want_loss, want_grads, want_params, timeout=300)
    flat = [e for rank_errors in errors for e in rank_errors]
    assert not flat, "\n".join(flat[:20])
