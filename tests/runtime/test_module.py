"""AutoParallelModule on real gloo processes: meta initialisation, plan files, clipping, inputs.

- A GPT-2 built on ``meta`` is materialised shard by shard: no rank allocates the whole
  parameter set, replicas agree, the HF initialisation scheme is followed, and the module
  computes exactly what a single-device model loaded with its ``full_state_dict()`` computes.
- Plan round trip: solved by ``autoparallelize`` (rank 0 solves and broadcasts), saved, applied
  in a new process group: identical code and bitwise-identical numerics; stale plans refused.
- ``clip_grad_norm_`` uses the true global norm; ``local_inputs=True`` takes per-rank pieces.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from autopar import zoo
from autopar.api import autoparallelize
from autopar.api import plan as make_plan
from autopar.layout.mesh import MeshSpec
from autopar.plans import Plan
from autopar.runtime.collectives import count_collectives
from autopar.runtime.launch import run_local
from autopar.runtime.module import clip_grad_norm_
from autopar.runtime.parallel_module import ParallelModule

pytestmark = pytest.mark.slow


def loss_of(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out.loss


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def tight_plan(model, inputs, mesh, fraction=0.6) -> Plan:
    # pipeline=1: an AutoParallelModule is what is tested; no pipeline candidates searched
    replicated = make_plan(model, inputs, mesh=mesh, pipeline=1)
    return make_plan(model, inputs, mesh=mesh, memory_budget=int(fraction * replicated.estimate.peak_bytes),
                     pipeline=1)


# ------------------------------------------------------------------------------ meta models
def _meta_body(rank, world, meta_model, meta_inputs, inputs, plan, full_bytes):
    pm = autoparallelize(meta_model, meta_inputs, plan=plan, seed=7)
    out = {"local_bytes": pm.local_parameter_bytes(), "peak_bytes": pm.materialize_stats.peak_bytes,
           "still_meta": all(p.device.type == "meta" for p in meta_model.parameters())}
    keys = [(n.target, n.args[0].name, tuple(sorted(n.kwargs.items())))
            for n in pm.graph_module.graph.nodes if n.op == "call_module" and n.args]
    out["duplicate_conversions"] = len(keys) - len(set(keys))
    state = pm.full_state_dict()  # test-side gather, after materialisation
    out["checksum"] = float(sum(v.double().sum() * (i + 1) for i, v in enumerate(state.values())))
    out["wte_std"] = state["transformer.wte.weight"].std().item()
    out["c_proj_std"] = state["transformer.h.0.attn.c_proj.weight"].std().item()
    out["ln_ok"] = bool(torch.equal(state["transformer.h.0.ln_1.weight"], torch.ones(64))
                        and torch.equal(state["transformer.h.0.ln_1.bias"], torch.zeros(64)))
    out["tied"] = bool(torch.equal(state["lm_head.weight"], state["transformer.wte.weight"]))
    # The single-device model with the same weights computes the same loss and gradients.
    torch.manual_seed(0)
    ref, _ = zoo.build("gpt2", tiny=True, device="cpu")
    ref.load_state_dict(state)
    loss = loss_of(pm(**inputs))
    loss.backward()
    ref_loss = loss_of(ref(**inputs))
    ref_loss.backward()
    grads = pm.full_gradients()
    errs = [max_err(loss.detach(), ref_loss.detach())]
    errs += [max_err(grads[k], p.grad) / (p.grad.abs().max().item() + 1e-6)
             for k, p in ref.named_parameters(remove_duplicate=False)]
    out["max_rel_err"] = max(errs)
    return out


def test_meta_gpt2_materialised_shard_by_shard():
    meta_model, meta_inputs = zoo.build("gpt2", tiny=True, device="meta")
    torch.manual_seed(1)
    _, inputs = zoo.build("gpt2", tiny=True, device="cpu")
    plan = tight_plan(meta_model, meta_inputs, (2, 2))
    full_bytes = sum(p.numel() * p.element_size() for p in meta_model.parameters())
    largest_module = max(sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
                         for m in meta_model.modules())
    results = run_local(_meta_body, 4, meta_model, meta_inputs, inputs, plan, full_bytes)
    for r in results:
        assert r["still_meta"]
        assert r["local_bytes"] < 0.75 * full_bytes, (r["local_bytes"], full_bytes)
        # At most one module's own tensors are ever whole at once (here the MLP's c_fc).
        assert r["peak_bytes"] <= largest_module < full_bytes / 4, (r["peak_bytes"], largest_module)
        assert r["duplicate_conversions"] == 0
        assert r["ln_ok"] and r["tied"]
        assert 0.017 < r["wte_std"] < 0.023  # HF: normal(0, initializer_range=0.02)
        assert 0.008 < r["c_proj_std"] < 0.012  # HF's GPT-2 rescale: 0.02 / sqrt(2 * n_layer)
        assert r["max_rel_err"] < 1e-4
    assert len({r["checksum"] for r in results}) == 1, "replicas disagree on initial values"


# ----------------------------------------------------------------------------- plan files
def _solve_body(rank, world, model, inputs, budget):
    # mesh None: 1-D over the world; pipeline=1: the round trip of a module called as pm(...)
    pm = autoparallelize(model, inputs, memory_budget=budget, pipeline=1)
    loss = loss_of(pm(**inputs))
    loss.backward()
    grads = {k: v.numpy() for k, v in pm.full_gradients().items()}
    return pm.plan.to_json(), pm.code, loss.item(), grads


def _apply_body(rank, world, model, inputs, path, stale_paths):
    pm = autoparallelize(model, inputs, plan=path)
    loss = loss_of(pm(**inputs))
    loss.backward()
    grads = {k: v.numpy() for k, v in pm.full_gradients().items()}
    refusals = {}
    for label, (stale, kwargs) in stale_paths.items():
        try:
            autoparallelize(model, inputs, plan=stale, **kwargs)
            refusals[label] = "accepted"
        except ValueError as exc:
            refusals[label] = str(exc)
    return pm.code, loss.item(), grads, refusals


def test_plan_round_trip_and_refusals(tmp_path):
    torch.manual_seed(0)
    model, inputs = zoo.build("gpt2", tiny=True, device="cpu")
    replicated = make_plan(model, inputs, mesh=(2,), pipeline=1)
    solved = run_local(_solve_body, 2, model, inputs, int(0.6 * replicated.estimate.peak_bytes))
    plan_json, code, loss, grads = solved[0]
    assert all(s[0] == plan_json for s in solved), "ranks applied different plans"
    plan = Plan.from_json(plan_json)
    assert plan.mesh.shape == (2,) and plan.mesh.name != "fast-links"
    path = tmp_path / "plan.json"
    plan.save(str(path))
    data = json.loads(plan_json)
    stale = {**data, "graph_hash": "0123456789abcdef"}
    (tmp_path / "stale.json").write_text(json.dumps(stale))
    wide = dataclasses.replace(plan, mesh=MeshSpec.preset("cpu", (4,)))
    stale_paths = {"hash": (str(tmp_path / "stale.json"), {}), "world": (wide, {}),
                   "mesh": (plan, {"mesh": (1, 2)})}
    applied = run_local(_apply_body, 2, model, inputs, str(path), stale_paths)
    for (code2, loss2, grads2, refusals), (_, code1, loss1, grads1) in zip(applied, solved):
        assert code2 == code1
        assert loss2 == loss1
        assert all((grads2[k] == grads1[k]).all() for k in grads1)
        assert "stale plan" in refusals["hash"] and "0123456789abcdef" in refusals["hash"]
        assert "has 4 devices but the process group has 2 ranks" in refusals["world"]
        assert "the plan is for mesh (2,), autoparallelize was given mesh (1, 2)" in refusals["mesh"]


# ------------------------------------------------------------ clipping, inputs, code, errors
def _fast_mesh(shape):
    mesh = MeshSpec.preset("cpu", shape)
    return dataclasses.replace(mesh, alpha=(1e-7,) * len(shape), beta=(1e-13,) * len(shape))


def _clip_body(rank, world, model, inputs, plan, ref):
    pm = autoparallelize(model, inputs, plan=plan, local_inputs=True)
    errors = [] if isinstance(pm, ParallelModule) else ["not a ParallelModule"]
    local = {}
    for k, v in inputs.items():
        spec = pm.input_specs[k]
        local[k] = v[spec.local_slices(tuple(v.shape), pm.pmesh.shape, pm.pmesh.coordinate)]
    with count_collectives() as counts:
        loss, logits = pm(**local)
        loss.backward()
    if abs(loss.item() - ref["loss"]) > 1e-5:
        errors.append(f"loss {loss.item()} != {ref['loss']}")
    if not torch.allclose(logits, ref["logits"], rtol=1e-4, atol=1e-6):
        errors.append("logits differ")
    for norm_type, key in ((2.0, "norm2"), (float("inf"), "norm_inf")):
        saved = [p.grad.clone() for p in pm.parameters()]
        norm = clip_grad_norm_(pm, 0.05, norm_type=norm_type)
        if abs(norm.item() - ref[key]) > 1e-5 * ref[key]:
            errors.append(f"{key}: {norm.item()} != {ref[key]}")
        if norm_type == 2.0:
            grads = pm.full_gradients()
            errors += [f"clipped grad {k}" for k, g in ref["clipped"].items()
                       if not torch.allclose(grads[k], g, rtol=1e-4, atol=1e-7)]
        for p, g in zip(pm.parameters(), saved):
            p.grad = g
    try:
        pm(**inputs)  # full inputs where local pieces are expected
        errors.append("full inputs accepted with local_inputs=True")
    except ValueError as exc:
        if "local piece" not in str(exc):
            errors.append(f"bad message: {exc}")
    try:
        pm.load_full_state_dict({"head.weight": torch.zeros(32, 64)})
        errors.append("partial state dict accepted")
    except ValueError as exc:
        if "missing keys" not in str(exc):
            errors.append(f"bad message: {exc}")
    return errors, pm.code, dict(counts)


def test_clip_grad_norm_local_inputs_and_code():
    torch.manual_seed(0)
    model, inputs = zoo.build("mlp", tiny=True, device="cpu")
    plan = make_plan(model, inputs, mesh=_fast_mesh((2, 2)), pipeline=1)
    assert any(not set(n.output_specs[0]) <= {"R"} for n in plan.by_kind("input")), "inputs should be split"
    ref_model = copy.deepcopy(model)
    loss, logits = ref_model(**inputs)
    loss.backward()
    params = list(ref_model.parameters())
    norm_inf = torch.nn.utils.clip_grad_norm_(params, float("inf"), norm_type=float("inf")).item()
    norm2 = torch.nn.utils.clip_grad_norm_(params, 0.05).item()
    assert norm2 > 0.05  # so that clipping happens
    ref = {"loss": loss.item(), "logits": logits.detach(), "norm2": norm2, "norm_inf": norm_inf,
           "clipped": {k: p.grad.clone() for k, p in ref_model.named_parameters()}}
    results = run_local(_clip_body, 4, model, inputs, plan, ref)
    # A counted collective comes from a named node in the code (forward) or its backward.
    sources = {"all_gather": ("all_gather", "split", "reduce_scatter"), "all_reduce": ("all_reduce",),
               "all_to_all": ("all_to_all",), "reduce_scatter": ("reduce_scatter",)}
    for errors, code, counts in results:
        assert not errors, errors
        assert sum(counts.values()) > 0, "a split plan communicates"
        for kind, n in counts.items():
            assert n == 0 or any(f"self.{src}(" in code for src in sources[kind]), (kind, code)


def _snapshot_body(rank, world_size, model, inputs):
    module = autoparallelize(model, inputs, mesh=(2,), pipeline=1)  # the unpipelined module's snapshot
    loss, _ = module(**inputs)
    loss.backward()
    state, grads = module.full_state_dict(), module.full_gradients()
    kept = {k: v.clone() for k, v in state.items()}
    kept_grads = {k: v.clone() for k, v in grads.items() if v is not None}
    with torch.no_grad():  # the next optimizer step and zero_grad, done by hand
        for p in module.parameters():
            p.add_(1.0)
            p.grad.zero_()
    same_state = all(torch.equal(state[k], v) for k, v in kept.items())
    same_grads = all(torch.equal(grads[k], v) for k, v in kept_grads.items())
    return same_state, same_grads, len(kept_grads)


def test_full_state_dict_and_gradients_are_snapshots():
    """Replicated parameters must not hand back the live shard: later steps would change the
    caller's copy."""
    torch.manual_seed(0)
    model, inputs = zoo.build("mlp", tiny=True, device="cpu")
    for same_state, same_grads, num_grads in run_local(_snapshot_body, 2, model, inputs):
        assert same_state and same_grads and num_grads > 0


def test_var_keyword_forward_inputs_bind_by_their_keys():
    """``forward(self, **inputs)`` (a loss wrapper around an HF model): the trace names the inputs
    by their keys, so a call must bind them there too, not under ``inputs[...]``."""
    import inspect

    from autopar.runtime.module import input_leaves

    def forward(x, **inputs):
        return x

    x, ids, labels = torch.zeros(1), torch.zeros(2), torch.ones(2)
    leaves = input_leaves(inspect.signature(forward), "M", (x,), {"input_ids": ids, "labels": labels})
    assert set(leaves) == {"x", "input_ids", "labels"}
    assert leaves["labels"] is labels
