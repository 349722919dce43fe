"""``Booster`` with a pipelined plan (issue 15): ``AutoParallelPlugin(pp_size=2, ...)`` boosts
GPT-2 tiny (2 layers, one per stage) into a ``PipelineModule`` on 4 gloo ranks as mesh (2, 2), and
``booster.execute_pipeline`` trains it exactly like the single-device model:

- 3 AdamW steps (loss of every step on every rank, every parameter after them) equal the
  single-device run, rtol 1e-4; the criterion ``(outputs, micro-batch) -> loss`` runs on the
  last stage (here GPT-2's loss recomputed from the logits and the micro-batch's labels),
  ``return_outputs`` gives the full-batch logits;
- ``zero_stage=1`` with ``max_norm``: clipping by the global norm over BOTH stages (the tied
  ``wte`` counted once) equals ``torch.nn.utils.clip_grad_norm_`` over the single-device model
  then AdamW, with AdamW state for only 1/dp of each replicated parameter per rank.

The plan is made in the parent (``autopar.plan`` with ``pipeline=2``) and given to the plugin,
so the forked ranks only trace and build. One launch, with a timeout.
"""

from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar import zoo
from autopar.booster import AutoParallelPlugin, Booster
from autopar.runtime.dtensors import local_of
from autopar.runtime.launch import run_local
from tests.runtime.pipeline.test_pipeline import close, fast_mesh

pytestmark = pytest.mark.slow  # many processes

LR, EPS, STEPS, MAX_NORM = 1e-3, 1e-5, 3, 0.05
MICRO, NUM_MICRO = 2, 4


def _reference(model, batch, *, max_norm: float = 0.0) -> dict:
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), lr=LR, eps=EPS)
    losses, logits, norms = [], None, []
    for _ in range(STEPS):
        out = m(**batch)
        logits = out.logits.detach() if logits is None else logits
        out.loss.backward()
        if max_norm:
            norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm))
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.detach())
    return {"losses": losses, "logits": logits, "norms": norms,
            "state": {k: v.clone() for k, v in m.state_dict().items()}}


def _criterion(outputs, inputs):
    """GPT-2's causal-LM loss recomputed from the logits and the micro-batch's labels: the
    gradient enters the last stage through the logits, not through the model's own loss."""
    logits = outputs.logits[:, :-1].flatten(0, 1)
    return torch.nn.functional.cross_entropy(logits.float(), inputs["labels"][:, 1:].flatten())


def _train(model, batch, plan, *, max_norm: float = 0.0, zero_stage: int | str = "auto"):
    plugin = AutoParallelPlugin(plan=plan, pp_size=2, num_microbatches=NUM_MICRO, pp_style="1f1b",
                                max_norm=max_norm, zero_stage=zero_stage)
    booster = Booster(plugin=plugin)
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), lr=LR, eps=EPS)
    pm, opt, criterion, _, _ = booster.boost(m, opt, _criterion, meta_inputs=batch)
    losses, logits, norms = [], None, []
    for step in range(STEPS):
        out = booster.execute_pipeline(iter([batch]), pm, criterion, opt, return_outputs=step == 0)
        if step == 0:
            logits = out["outputs"].logits
        if max_norm:  # the norm the step clips by, measured before it (same value, no clipping here)
            norms.append(pm.clip_grad_norm_(float("inf")))
        opt.step()
        opt.zero_grad()
        losses.append(out["loss"])
    return booster, pm, opt, losses, logits, norms


def _step(booster, pm, opt, batch) -> None:
    booster.execute_pipeline(iter([batch]), pm, _criterion, opt)
    opt.step()
    opt.zero_grad()


def _checkpoint_errors(rank, model, batch, plan, trained, path) -> list[str]:
    """Booster.save_model / save_optimizer of a pipelined model (several shard files), loaded
    by a fresh boost from other weights whose AdamW state already exists: the loaded model equals
    the saved one, the files hold the full tensors, and the next step of both is identical."""
    from autopar.booster.checkpoint_io import read_full_state_dict

    booster, pm, opt = trained
    booster.save_model(pm, f"{path}/model", shard=True, size_per_shard=0.05, use_safetensors=True)
    booster.save_optimizer(opt, f"{path}/optim")
    saved = pm.full_state_dict()
    errors = []
    if rank == 0:
        files = read_full_state_dict(f"{path}/model")
        errors += [f"checkpoint file misses {k}" for k in saved if k not in files and k != "lm_head.weight"]
        errors += [f"checkpoint file {k} differs" for k in files if not torch.equal(files[k], saved[k])]
        import transformers  # the directory loads as the original model: its config was written too

        hf = transformers.AutoModelForCausalLM.from_pretrained(f"{path}/model")
        errors += [f"from_pretrained: {k} differs" for k, v in hf.state_dict().items() if not torch.equal(v, saved[k])]
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)
    plugin = AutoParallelPlugin(plan=plan, pp_size=2, num_microbatches=NUM_MICRO, pp_style="1f1b",
                                max_norm=MAX_NORM, zero_stage=1)
    booster2 = Booster(plugin=plugin)
    pm2, opt2, _, _, _ = booster2.boost(other, torch.optim.AdamW(other.parameters(), lr=LR, eps=EPS), _criterion,
                                        meta_inputs=batch)
    _step(booster2, pm2, opt2, batch)  # AdamW state exists, with other values, before the load
    booster2.load_model(pm2, f"{path}/model")
    booster2.load_optimizer(opt2, f"{path}/optim")
    loaded = pm2.full_state_dict()
    errors += [f"rank {rank} loaded {k} differs" for k in saved if not torch.equal(loaded[k], saved[k])]
    _step(booster, pm, opt, batch)
    _step(booster2, pm2, opt2, batch)
    want, got = pm.full_state_dict(), pm2.full_state_dict()
    errors += [f"rank {rank} after load + step: {k} differs" for k in want if not torch.equal(got[k], want[k])]
    return errors


def _body(rank, world, model, batch, plan, refs, path):
    errors = []
    # Two boosts (each traces and builds): plain, and ZeRO-1 with clipping (the pieces' gradients
    # are views of the clipped ones).
    for label, kwargs in (("plain", {}), ("zero1 clipped", {"max_norm": MAX_NORM, "zero_stage": 1})):
        ref = refs["clipped" if "clipped" in label else "plain"]
        booster, pm, opt, losses, logits, norms = _train(model, batch, plan, **kwargs)
        errors += [e for i, (got, want) in enumerate(zip(losses, ref["losses"]))
                   for e in close(f"rank {rank} {label} loss {i}", got, want)]
        errors += close(f"rank {rank} {label} logits", logits, ref["logits"], atol=1e-5)
        errors += [e for i, (got, want) in enumerate(zip(norms, ref["norms"]))
                   for e in close(f"rank {rank} {label} grad norm {i}", got, want)]
        state = pm.full_state_dict()
        errors += [e for k, want in ref["state"].items() for e in close(f"rank {rank} {label} {k}", state.get(k), want,
                                                                         atol=1e-5)]
        if "zero1" in label:
            errors += _zero_state_errors(f"rank {rank}", pm, opt)
            errors += _checkpoint_errors(rank, model, batch, plan, (booster, pm, opt), path)
    return errors


def _zero_state_errors(label, pm, opt) -> list[str]:
    """AdamW's exp_avg holds 1/dp of every parameter replicated over the stage's (2,) sub-mesh
    (up to uneven splits), the whole local shard of the others; most of the bytes are replicated."""
    dp = pm.pmesh.shape[0]
    repl = sum(local_of(p).numel() for p in pm.parameters() if all(pl.is_replicate() for pl in p.placements))
    other = sum(local_of(p).numel() for p in pm.parameters()) - repl
    state = sum(local_of(v).numel() for s in opt.state.values() for k, v in s.items() if k == "exp_avg")
    slack = sum(max(p.shape) for p in pm.parameters())  # one row more per uneven piece at most
    errors = []
    if not repl > other:
        errors.append(f"{label} zero1: only {repl} of {repl + other} elements replicated: nothing to test")
    if not other + repl / dp - slack <= state <= other + repl / dp + slack:
        errors.append(f"{label} zero1: AdamW exp_avg holds {state} elements, want {other} + {repl}/{dp}")
    return errors


def test_execute_pipeline_trains_like_single_device(tmp_path):
    torch.manual_seed(0)
    model, batch = zoo.build("gpt2", tiny=True, num_layers=2, batch=MICRO * NUM_MICRO, device="cpu")
    plan = autopar.plan(model, batch, mesh=fast_mesh((2, 2)), pipeline=2, microbatches=NUM_MICRO, schedule="1f1b")
    refs = {"plain": _reference(model, batch), "clipped": _reference(model, batch, max_norm=MAX_NORM)}
    assert refs["clipped"]["norms"][0] > 2 * MAX_NORM  # the clip really clips
    errors = run_local(_body, 4, model, batch, plan, refs, str(tmp_path), timeout=300)
    flat = [e for rank_errors in errors for e in rank_errors]
    assert not flat, "\n".join(flat[:20])


def test_execute_pipeline_refuses_a_plain_model_and_zero2():
    with pytest.raises(ValueError, match="zero_stage=2 does not compose with a pipeline"):
        from autopar.booster.booster import _pipeline_options

        plugin = AutoParallelPlugin(pp_size=2, zero_stage=2)
        _pipeline_options(plugin, plugin.autoparallelize_kwargs())
    with pytest.raises(ValueError, match="execute_pipeline needs a model boosted with a pipeline"):
        Booster().execute_pipeline(iter([{}]), torch.nn.Linear(2, 2), None)
