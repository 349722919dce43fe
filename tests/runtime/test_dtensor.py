"""The module contract: DTensor parameters that torch's own tools understand.

- ``dtensor_placements`` maps autopar layouts to DTensor placements, and a dim sharded by two
  mesh axes (``S0S0``) holds on each rank exactly the piece ``distribute_tensor`` gives it;
- ``Plan.placements()`` exports the layouts as placement strings;
- ``layout_errors``/``grad_layout_errors``: every parameter and buffer is a DTensor on
  ``pm.device_mesh`` with the plan's placements, every gradient a DTensor with its parameter's
  placements. tests/runtime/test_e2e.py runs them on every zoo architecture (tiny) on meshes
  (2,), (4,) and (2, 2) in the same launch that checks ``torch.nn.utils.clip_grad_norm_`` (the
  single-device global norm at every step) and 3 steps of ``torch.optim.AdamW(foreach=True)``
  over ``pm.parameters()`` against single-device training (one launch per world size and
  model for all these checks keeps the suite's time down);
- ``pm.state_dict()`` holds DTensors; ``torch.distributed.checkpoint`` saves and loads it, and
  ``get_state_dict``/``set_state_dict`` restore the parameters and the AdamW state exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from autopar import zoo
from autopar.api import plan as make_plan
from autopar.layout.placement import TensorSpec
from autopar.runtime.build import build_module
from autopar.runtime.dtensors import dtensor_placements, to_dtensor
from autopar.runtime.launch import run_local
from autopar.runtime.materialize import slice_local
from autopar.runtime.process_mesh import ProcessMesh
from autopar.tracer import trace

pytestmark = pytest.mark.slow



def test_placements_map_and_partial_is_refused():
    assert dtensor_placements(TensorSpec.parse("S1R")) == (Shard(1), Replicate())
    assert dtensor_placements(TensorSpec.parse("S0S0")) == (Shard(0), Shard(0))
    with pytest.raises(ValueError, match="partial layout: PR"):
        dtensor_placements(TensorSpec.parse("PR"))


def _order_body(rank, world):
    pmesh = ProcessMesh.create((2, 2), axis_names=("dp", "tp"), device_type="cpu")
    torch.manual_seed(0)
    full = torch.randn(8, 12)
    out = {}
    for text in ("S0S0", "S1S1", "S0S1", "S1S0", "RS0", "S1R", "RR"):
        spec = TensorSpec.parse(text)
        ours = slice_local(full, spec, pmesh)
        theirs = distribute_tensor(full, pmesh.device_mesh, dtensor_placements(spec)).to_local()
        wrapped = to_dtensor(ours, spec, pmesh, full.shape)
        out[text] = (torch.equal(ours, theirs), torch.equal(wrapped.full_tensor(), full))
    return out


def test_two_axes_on_one_dim_follow_dtensor_order():
    """autopar's lower mesh axis is the major digit of the shard index, as in DTensor."""
    for rank, res in enumerate(run_local(_order_body, 4, timeout=120)):
        assert all(same and whole for same, whole in res.values()), (rank, res)


def test_plan_exports_placements():
    model, inputs = zoo.build("mlp", tiny=True, device="cpu")
    # pipeline=1: the DTensor module is what is tested; no pipeline candidates searched
    replicated = make_plan(model, inputs, mesh=(2,), memory_budget=None, pipeline=1)
    plan = make_plan(model, inputs, mesh=(2, 2), memory_budget=int(0.6 * replicated.estimate.peak_bytes), pipeline=1)
    placements = plan.placements()
    assert set(placements) == {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    for node in plan.by_kind("parameter"):
        spec = TensorSpec.parse(node.output_specs[0])
        assert placements[node.module] == tuple(_text(p) for p in dtensor_placements(spec)), node
    assert any("Shard(" in p for ps in placements.values() for p in ps), "a tight plan shards a parameter"


def layout_errors(pm, label: str) -> list[str]:
    """Every parameter and buffer of ``pm`` is a DTensor on ``pm.device_mesh`` (dim names = the
    mesh's axis names) with the placements ``pm.plan.placements()`` exports."""
    errors = []
    want = {f"graph_module.{fqn}": tuple(p) for fqn, p in pm.plan.placements().items()}
    tensors = [*pm.named_parameters(), *pm.named_buffers()]
    if not tensors or {n for n, _ in tensors} - set(want):
        errors.append(f"{label}: no plan layout for {sorted({n for n, _ in tensors} - set(want))}")
    for name, t in tensors:
        if not isinstance(t, DTensor):
            errors.append(f"{label}: {name} is a {type(t).__name__}, not a DTensor")
        elif t.device_mesh != pm.device_mesh or tuple(map(_text, t.placements)) != want.get(name):
            errors.append(f"{label}: {name} placements {t.placements}, plan {want.get(name)}")
    if tuple(pm.device_mesh.mesh_dim_names) != tuple(pm.plan.mesh.axis_names):
        errors.append(f"{label}: mesh dim names {pm.device_mesh.mesh_dim_names} != {pm.plan.mesh.axis_names}")
    return errors


def grad_layout_errors(pm, label: str) -> list[str]:
    """After backward, every gradient is a DTensor with its parameter's placements."""
    errors = []
    for name, p in pm.named_parameters():
        if p.requires_grad and (not isinstance(p.grad, DTensor) or p.grad.placements != p.placements):
            errors.append(f"{label}: grad of {name} is {type(p.grad).__name__} "
                          f"{getattr(p.grad, 'placements', '')}, parameter {p.placements}")
    return errors


def _text(placement) -> str:
    """A torch placement in ``Plan.placements()``'s spelling."""
    if isinstance(placement, _StridedShard):  # a fused projection's S(d/k)
        return f"_StridedShard({placement.dim}, split_factor={placement.split_factor})"
    return f"Shard({placement.dim})" if isinstance(placement, Shard) else f"{type(placement).__name__}()"


# --------------------------------------------------------------------------- checkpoints
def _loss(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out.loss


def _optim_tensors(opt) -> dict[str, torch.Tensor]:
    """"<parameter index>.<state key>" -> the full AdamW state tensors (exp_avg, exp_avg_sq)."""
    index = {id(p): i for i, p in enumerate(opt.param_groups[0]["params"])}
    return {f"{index[id(p)]}.{k}": v.full_tensor().clone() for p, st in opt.state.items() for k, v in st.items()
            if isinstance(v, DTensor)}


def _checkpoint_body(rank, world, model, inputs, traced, plan, checkpoint_dir) -> list[str]:
    label = f"{plan.model} mesh {plan.mesh.shape} rank {rank}"
    pm = build_module(model, traced, plan, device=torch.device("cpu"))
    errors = []
    if not all(isinstance(v, DTensor) for v in pm.state_dict().values()):
        errors.append(f"{label}: pm.state_dict() holds non-DTensor values")
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    _loss(pm(**inputs)).backward()
    opt.step()
    model_sd, optim_sd = get_state_dict(pm, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint_dir)
    saved_state, saved_optim = pm.full_state_dict(), _optim_tensors(opt)
    opt.zero_grad()
    _loss(pm(**inputs)).backward()
    opt.step()  # parameters and AdamW state move on; loading must bring them back
    model_sd, optim_sd = get_state_dict(pm, opt)
    loaded = {"model": model_sd, "optim": optim_sd}
    dcp.load(loaded, checkpoint_id=checkpoint_dir)
    set_state_dict(pm, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    restored, optim_now = pm.full_state_dict(), _optim_tensors(opt)
    errors += [f"{label}: {k} not restored" for k, v in saved_state.items() if not torch.equal(restored[k], v)]
    if not saved_optim or set(optim_now) != set(saved_optim):
        errors.append(f"{label}: AdamW state keys {sorted(optim_now)[:4]} vs {sorted(saved_optim)[:4]}")
    errors += [f"{label}: AdamW {k} not restored" for k, v in saved_optim.items()
               if k in optim_now and not torch.equal(optim_now[k], v)]
    return errors


def test_distributed_checkpoint_restores_parameters_and_adamw_state(tmp_path):
    torch.manual_seed(0)
    model, inputs = zoo.build("gpt2", tiny=True, device="cpu")
    # pipeline=1: the DTensor module is what is tested; no pipeline candidates searched
    replicated = make_plan(model, inputs, mesh=(2,), memory_budget=None, pipeline=1)
    plan = make_plan(model, inputs, mesh=(2, 2), memory_budget=int(0.6 * replicated.estimate.peak_bytes), pipeline=1)
    assert any(not set(n.output_specs[0]) <= {"R"} for n in plan.by_kind("parameter")), "some sharded parameter"
    results = run_local(_checkpoint_body, 4, model, inputs, trace(model, inputs), plan, str(tmp_path), timeout=300)
    errors = [e for rank_errors in results for e in rank_errors]
    assert not errors, "\n".join(errors[:20])
