"""``autoparallelize`` with the default options picks a pipeline where it wins (issue 30, point
6: at a budget data parallelism does not fit) and the pipelined module trains like the
single-device model on gloo ranks: loss, every gradient and the parameters after optimizer
steps (``pipeline=1``, which plans without one: ``tests/planner/pipeline/test_default_auto.py``)
-- also with ``-100`` labels spread unevenly over the micro-batches, where the token-mean loss
weighs each micro-batch by its counted tokens (``autopar/runtime/pipeline/weights.py``), not 1/M,
and through the plain loop (``module(**batch).loss.backward()``) or a ``step_with`` criterion
(``Booster.execute_pipeline``'s), traced for its reduction like the model's own loss."""

import copy

import pytest
import torch

from autopar.layout.mesh import MeshSpec
from autopar.runtime.launch import run_local
from tests.planner.pipeline.test_default_auto import cheap_actions, qwen2_decoder, tight_budget
from tests.runtime.pipeline.test_pipeline import close

STEPS = 2


def _optimizer():
    # AdamW divides by sqrt(v): on elements whose gradient is ~1e-8 it turns fp32 rounding of
    # the micro-batch sum into a visible update difference (2e-5 on one device summing the same
    # micro-batches), so the steps are checked with SGD, linear in the gradient; the gradients
    # themselves are compared with the full batch's directly.
    return torch.optim.SGD, {"lr": 0.1}


def shifted_token_mean(outputs, batch):
    """The causal LM's loss written as a user's criterion: a token mean over labels not -100."""
    logits = outputs.logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1))


def _body(rank, world, model, cases, budget):
    """Every case in one launch: the first through the default planning (rank 0 solves, the
    pipeline a candidate), the rest on that plan (``plan=``: the labels that differ between cases
    change no byte the plan counts)."""
    errors, plan = [], None
    for label, loop, inputs, want in cases:
        case_errors, plan = _case(copy.deepcopy(model), inputs, want, loop, budget, plan)
        errors += [f"{label}: {e}" for e in case_errors]
    return errors


def _case(model, inputs, want, loop, budget, plan):
    """One case's errors and the plan it ran (``plan``: None plans through the default)."""
    from autopar.api import autoparallelize
    from autopar.runtime.pipeline import PipelineModule

    want_loss, want_grads, want_params = want
    if plan is None:  # pipeline: the default; the schedule's actions priced as a GPU's, where a
        # pipeline wins for this tiny decoder (tests/planner/pipeline/test_default_auto.py)
        pm = autoparallelize(model, inputs, mesh=cheap_actions(MeshSpec.preset("cpu", (2,))), memory_budget=budget,
                             cache=False)
    else:
        pm = autoparallelize(model, inputs, plan=plan)
    if not isinstance(pm, PipelineModule):
        return [f"the default planned no pipeline: {type(pm).__name__}"], pm.plan
    cls, kwargs = _optimizer()
    opt = pm.optimizer(cls, **kwargs)
    with torch.no_grad():
        errors = close("forward-only loss", pm(**inputs).loss, want_loss)
    for step in range(STEPS):
        if loop == "criterion":
            loss = pm.step_with(shifted_token_mean, **inputs)[0]
        elif loop:  # the plain module's loop: a training forward's loss is differentiable
            loss = pm(**inputs).loss
            (loss * 4.0).backward()  # any function of the loss: its gradient scales the step's
            for p in pm.parameters():
                if p.grad is not None:
                    p.grad /= 4.0
        else:
            loss = pm.step(**inputs)
        if step == 0:
            errors += close("loss", loss, want_loss)
            grads = pm.full_gradients()
            errors += [e for k, w in want_grads.items() for e in close(f"grad {k}", grads.get(k), w)]
        opt.step()
        opt.zero_grad()
    got = pm.full_state_dict()
    errors += [e for k, w in want_params.items() for e in close(f"param {k}", got.get(k), w)]
    return errors, pm.plan


@pytest.fixture(scope="module")
def budget() -> int:
    """The tight budget, planned once for the module's cases (one model, one mesh: the labels
    that differ between cases change no byte the plan counts)."""
    model, inputs = qwen2_decoder(device="cpu")
    return tight_budget(model, inputs, MeshSpec.preset("cpu", (2,)))


CASES = {"full": (False, False), "padded": (True, False), "padded-training-loop": (True, True),
         "padded-criterion": (True, "criterion")}


def _reference(model, inputs):
    ref = copy.deepcopy(model)
    cls, kwargs = _optimizer()
    opt = cls(ref.parameters(), **kwargs)
    want_loss = want_grads = None
    for step in range(STEPS):
        loss = ref(**inputs).loss
        loss.backward()
        if step == 0:
            want_loss = loss.detach().clone()
            want_grads = {k: p.grad.clone() for k, p in ref.named_parameters()}
        opt.step()
        opt.zero_grad()
    return want_loss, want_grads, {k: p.detach().clone() for k, p in ref.named_parameters()}


# [full] and [padded-criterion] (uneven micro-batch weights through a criterion) by default, in one
# launch (the second on the first's plan); the other two cases of the uneven weights with the whole
# sweeps (``pytest -m full_sweep``), where the first again plans through the default.
@pytest.mark.parametrize("names", [("full", "padded-criterion"),
                                   pytest.param(("padded", "padded-training-loop"), marks=pytest.mark.full_sweep)],
                         ids=["full+padded-criterion", "padded+padded-training-loop"])
def test_default_pipeline_trains_like_single_device(names, budget):
    model, _ = qwen2_decoder(device="cpu")
    cases = []
    for name in names:
        padded, loop = CASES[name]
        _, inputs = qwen2_decoder(device="cpu")
        if padded:  # the first rows count far fewer tokens than the rest: micro-batch means differ in weight
            inputs["labels"][0, 4:] = -100
            inputs["labels"][1, 1:] = -100
            inputs["labels"][5, 20:] = -100
        cases.append((name, loop, inputs, _reference(model, inputs)))
    errors = run_local(_body, 2, model, cases, budget, timeout=300)
    flat = [e for rank_errors in errors for e in rank_errors]
    assert not flat, "\n".join(flat[:20])
