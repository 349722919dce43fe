"""Issue 29: ``booster.no_sync(model)`` gradient accumulation on 2 gloo ranks (GPT-2 tiny).

N-1 micro-steps whose forward runs under ``no_sync`` and one synced micro-step, the losses
summed (each micro-batch's ``backward`` adds to ``.grad``, the notes' loop), must equal the
single-device gradients of the same micro-batches summed -- i.e. one step on the N-times batch
with the loss summed over micro-batches -- and the accumulation steps must issue no bucketed
gradient collective (the point of ``no_sync``). The update after ``step()`` must match too.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from autopar import zoo
from autopar.api import plan as make_plan
from autopar.booster import AutoParallelPlugin, Booster
from autopar.layout.mesh import MeshSpec
from autopar.runtime.bucketing import GradBucketer
from autopar.runtime.launch import run_local

MICRO, BATCH, SEQ, LR = 3, 4, 16, 0.05


def micro_batches(vocab):
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(MICRO):
        ids = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def fast_mesh(shape):
    """Nearly free links: the solver splits the batch (data parallelism, bucketed gradient sums)."""
    mesh = MeshSpec.preset("cpu", shape)
    return dataclasses.replace(mesh, alpha=(1e-7,) * len(shape), beta=(1e-13,) * len(shape), name="fast-links")


def _accumulate(rank, world, model, batches, backward_inside, plan):
    booster = Booster(AutoParallelPlugin(mesh=fast_mesh((2,)), checkpoint="none", plan=plan))
    pm, bopt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=LR), meta_inputs=batches[0])
    bucketers = [m for m in pm.modules() if isinstance(m, GradBucketer)]
    slots = sum(len(b.slots) for b in bucketers)
    before = {k: v.clone() for k, v in pm.full_state_dict().items()}
    issued = []
    for i, batch in enumerate(batches):
        start = sum(b.stats["all_reduces"] + b.stats["reduce_scatters"] for b in bucketers)
        if i < len(batches) - 1:
            with booster.no_sync(pm, bopt):  # the notes' form: forward inside the context
                loss = pm(**batch)[0]
                if backward_inside:
                    booster.backward(loss, bopt)
            if not backward_inside:  # DDP reads the flag at forward: backward may come after
                booster.backward(loss, bopt)
        else:
            booster.backward(pm(**batch)[0], bopt)
        issued.append(sum(b.stats["all_reduces"] + b.stats["reduce_scatters"] for b in bucketers) - start)
    grads = {k: v.clone() for k, v in pm.full_gradients().items() if v is not None}
    bopt.step()
    after = pm.full_state_dict()
    # zero_grad forgets an abandoned accumulation: the next synced step holds only its own gradient
    with booster.no_sync(pm):
        booster.backward(pm(**batches[0])[0], bopt)
    bopt.zero_grad()
    booster.backward(pm(**batches[1])[0], bopt)
    alone = {k: v.clone() for k, v in pm.full_gradients().items() if v is not None}
    pieces = len(bopt.zero.pieces) if bopt.zero is not None else 0
    return {"slots": slots, "issued": issued, "pieces": pieces, "grads": grads, "alone": alone,
            "update": {k: after[k] - before[k] for k in before}}


CASES = ((True, 0), (False, 0), (True, 2))  # (backward inside no_sync, ZeRO stage)


def _accumulate_each(rank, world, model, batches, cases):
    """Every case, one after the other in the same 2 ranks, each on its own copy of the model."""
    return [_accumulate(rank, world, copy.deepcopy(model), batches, inside, plan) for inside, plan in cases]


@pytest.fixture(scope="module")
def accumulation():
    """The single-device reference (summed micro-batch gradients, the update, one micro-batch's
    gradient after ``zero_grad``) and each case's per-rank results: one plan, one launch."""
    torch.manual_seed(0)
    model, _ = zoo.build("gpt2", tiny=True, device="cpu", batch=BATCH, seq=SEQ)
    batches = micro_batches(model.config.vocab_size)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    for batch in batches:  # loss-sum semantics: .grad accumulates every micro-batch's gradient
        ref(**batch)[0].backward()
    want_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    opt.step()
    want = {k: v - before[k] for k, v in ref.state_dict().items()}
    ref.zero_grad()
    ref(**batches[1])[0].backward()
    want_alone = {n: p.grad.clone() for n, p in ref.named_parameters()}
    plan = make_plan(model, batches[0], mesh=fast_mesh((2,)), checkpoint="none", pipeline=1)
    plans = {0: plan,  # ZeRO-2 by hand (the tiny model never needs it): reduce-scatters into pieces
             2: dataclasses.replace(plan, nodes=tuple(dataclasses.replace(n, zero_stage=2)
                                                      if n.kind == "parameter" else n for n in plan.nodes))}
    per_rank = run_local(_accumulate_each, 2, model, batches, [(inside, plans[z]) for inside, z in CASES],
                         timeout=180)
    return (want_grads, want, want_alone), {case: [ranks[i] for ranks in per_rank] for i, case in enumerate(CASES)}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("backward_inside,zero_stage", CASES)
def test_no_sync_accumulation_equals_one_step_on_the_summed_batch(backward_inside, zero_stage, accumulation):
    (want_grads, want, want_alone), results = accumulation
    for res in results[backward_inside, zero_stage]:
        assert res["slots"] > 0, "the plan should reduce data-parallel gradients in buckets"
        assert (res["pieces"] > 0) == (zero_stage == 2), res["pieces"]
        # no bucketed collective during accumulation; the synced step reduces everything
        assert res["issued"][:-1] == [0] * (MICRO - 1) and res["issued"][-1] > 0, res["issued"]
        for name, g in want_grads.items():
            if zero_stage == 2 and name not in res["grads"]:  # it lives in its ZeRO piece: see the update
                continue
            assert torch.allclose(res["grads"][name], g, rtol=1e-4, atol=1e-6), name
        for name, g in want_alone.items():
            if name in res["alone"] or zero_stage == 0:
                assert torch.allclose(res["alone"][name], g, rtol=1e-4, atol=1e-6), name
        wrong = [k for k, v in want.items() if not torch.allclose(res["update"][k], v, rtol=1e-4, atol=1e-7)]
        assert not wrong, wrong[:5]
