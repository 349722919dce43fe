"""``batch_norm_stats="per_rank"``: torch DDP's batch norm on autopar's plans, on real gloo processes.

Under per-rank statistics a training batch norm normalises each of ``W`` (world size) equal
contiguous chunks of the batch by that chunk's statistics (``autopar.tracer.batch_stats``), on
every plan. Checked here:

(a) the data-parallel plan equals torch DDP fed the same chunks in rank order: loss, every
    gradient, the parameters after SGD steps (DDP keeps rank 0's running statistics, autopar
    the chunks' average: those are compared with the one-device reference instead);
(b) a plan splitting the batch norms' channels on one axis and the batch on the other (mesh
    (2, 2)) equals the one-device chunked reference -- loss, gradients, parameters and running
    statistics -- written here with ``F.batch_norm`` per chunk, not with autopar's op;
(c) the auto plan at a tight budget (a third of the way from the smallest budget to the
    unconstrained peak) equals the same reference;
(d) the data-parallel plan on mesh (2, 2), the batch split over both axes, equals it too, and
    the running statistics' sums over both axes go as ONE collective on the group spanning them
    (``DistComm.all_reduce_async``), not a chain whose second all-reduce blocks the end of backward.

The data makes the chunks' statistics differ from each other and from the batch's, so a global
batch norm (or chunks in another order) fails every comparison.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.api import autoparallelize
from autopar.layout.mesh import MeshSpec
from autopar.layout.placement import Shard
from autopar.planner.options import PlanOptions
from autopar.planner.orchestrate import plan_family, plan_traced, trace_for_planning
from autopar.runtime.launch import run_local
from autopar.tracer import profile
from autopar.tracer.batch_stats import chunked_batch_norm

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from budgets import between, smallest_budget  # noqa: E402

# In float64, so that a wrong chunk, order or statistic stands out from rounding by orders of
# magnitude (in float32 the batch norms' backward through chunks of 2 samples rounds at ~1e-5).
RTOL, ATOL = 1e-9, 1e-11
STATE_ATOL = 1e-10  # after the steps
STEPS = 2


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.norm = nn.BatchNorm1d(8)  # a 2-D batch norm too
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor, labels: torch.Tensor):
        h = F.relu(self.bn(self.conv(x)))
        h = F.relu(self.bn2(self.conv2(h)) + h)
        logits = self.head(self.norm(h.mean((2, 3))))
        return F.cross_entropy(logits, labels), logits


def fast_mesh(shape):
    mesh = MeshSpec.preset("cpu", shape)
    return dataclasses.replace(mesh, alpha=(1e-7,) * len(shape), beta=(1e-13,) * len(shape), name="fast-links")


def _inputs(batch: int = 8, chunks: int = 4) -> dict:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(batch, 3, 8, 8, generator=gen, dtype=torch.float64)
    size = batch // chunks
    for c in range(chunks):  # every chunk its own scale and shift
        x[c * size:(c + 1) * size] = (1 + 0.5 * c) * x[c * size:(c + 1) * size] + 0.7 * c
    return {"x": x, "labels": torch.randint(0, 5, (batch,), generator=gen)}


def _chunked_forward(module: nn.modules.batchnorm._BatchNorm, chunks: int):
    """``module.forward`` with the documented per-rank semantics, from torch's own batch norm per chunk."""
    def forward(x):
        if not module.training:
            return module.__class__.forward(module, x)
        pieces = x.chunk(chunks)
        y = torch.cat([F.batch_norm(p, None, None, module.weight, module.bias, True, 0.0, module.eps) for p in pieces])
        with torch.no_grad():
            dims = [0, *range(2, x.dim())]
            mean = torch.stack([p.mean(dims) for p in pieces]).mean(0)
            var = torch.stack([p.var(dims, correction=1) for p in pieces]).mean(0)
            m = module.momentum
            module.running_mean.mul_(1 - m).add_(m * mean)
            module.running_var.mul_(1 - m).add_(m * var)
            module.num_batches_tracked.add_(1)
        return y
    return forward


def _train(model, inputs, grads_of) -> dict:
    # SGD with momentum and weight decay: linear in the gradients, so float rounding stays rounding
    # (Adam divides by sqrt(v): a gradient entry near zero would amplify it).
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)
    loss, _ = model(**inputs)
    loss.backward()
    out = {"loss": loss.detach().clone(), "grads": grads_of()}
    opt.step()
    for _ in range(STEPS - 1):
        opt.zero_grad()
        model(**inputs)[0].backward()
        opt.step()
    return out


def _reference(model, inputs, chunks: int) -> dict:
    model = copy.deepcopy(model)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.forward = _chunked_forward(m, chunks)
    out = _train(model, inputs, lambda: {k: p.grad.clone() for k, p in model.named_parameters()})
    out["state"] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


def _run(rank, world, model, inputs, plan, with_ddp):
    out = {}
    if with_ddp:  # torch DDP on this rank's chunk: rank r holds rows [r n, (r + 1) n)
        ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
        local = {k: v.chunk(world)[rank] for k, v in inputs.items()}
        res = _train(ddp, local, lambda: {k: p.grad.clone() for k, p in ddp.module.named_parameters()})
        torch.distributed.all_reduce(res["loss"])
        res["loss"] /= world
        res["state"] = {k: v.clone() for k, v in ddp.module.state_dict().items()}
        out["ddp"] = res
    pm = autoparallelize(model, inputs, plan=plan, batch_norm_stats="per_rank")
    res = _train(pm, inputs, lambda: {k: g.clone() for k, g in pm.full_gradients().items()})
    res["state"] = pm.full_state_dict()
    res["code"] = pm.code
    out["autopar"] = res
    return out


def _close(got, want, what, atol=ATOL):
    assert got.shape == want.shape, what
    assert torch.allclose(got, want, rtol=RTOL, atol=atol), \
        f"{what}: max abs error {(got - want).abs().max().item():.3g}"


def _same(res, ref, rank, *, stats: bool = True):
    _close(res["loss"], ref["loss"], f"rank {rank} loss")
    for k, want in ref["grads"].items():
        _close(res["grads"][k], want, f"rank {rank} grad {k}")
    for k, want in ref["state"].items():
        if "running" in k and not stats:
            continue
        if want.dtype.is_floating_point:
            _close(res["state"][k], want, f"rank {rank} {k} after {STEPS} SGD steps", atol=STATE_ATOL)
        else:
            assert torch.equal(res["state"][k], want), k


def _bn_nodes(plan):
    return [n for n in plan.nodes if n.op.startswith("autopar.chunked_batch_norm")]


def _check_global_differs(model, inputs, ref):
    glob = copy.deepcopy(model)
    assert not torch.allclose(glob(**inputs)[0], ref["loss"], rtol=1e-3), "the data must separate the semantics"


@pytest.mark.parametrize("world", [4, pytest.param(2, marks=pytest.mark.full_sweep)])
def test_data_parallel_plan_equals_torch_ddp(world):
    torch.manual_seed(0)
    model, inputs = CNN().double().train(), _inputs(chunks=world)
    plan = plan_family(model, inputs, "data-parallel", mesh=fast_mesh((world,)),
                       options=PlanOptions(batch_norm_stats="per_rank"))
    nodes = _bn_nodes(plan)
    # The convolutions' batch norms split the batch (the 1-D one may run replicated: tiny).
    assert len(nodes) == 3 and [n.input_specs[0] for n in nodes[:2]] == ["S0", "S0"], [n.input_specs for n in nodes]
    ref = _reference(model, inputs, world)
    _check_global_differs(model, inputs, ref)
    for rank, out in enumerate(run_local(_run, world, model, inputs, plan, True, timeout=240)):
        res = out["autopar"]
        # No collective normalises: the batch split runs the chunks locally, the running
        # statistics' one small sum per batch norm is the only collective of the kernel.
        assert "sync_batch_norm" not in res["code"] and "chunked_batch_norm_stats(" in res["code"], res["code"]
        _same(res, out["ddp"], rank, stats=False)  # DDP keeps rank 0's running statistics
        _same(out["ddp"], ref, rank, stats=False)
        _same(res, ref, rank)


def _channel_and_batch(kind, node, choice) -> bool:
    """Batch norms split by channel on mesh axis 0 and by batch on axis 1 (everything else free)."""
    if kind != "op" or node.target is not chunked_batch_norm:
        return True
    return tuple(choice.input_specs[0].placements) == (Shard(1), Shard(0))


def test_channel_and_batch_split_equals_one_device():
    torch.manual_seed(0)
    model, inputs = CNN().double().train(), _inputs()
    options = PlanOptions(batch_norm_stats="per_rank", pipeline=None)
    traced = trace_for_planning(model, inputs, precision="fp32", batch_norm_chunks=4)
    plan = plan_traced(traced, profile(traced), mesh=fast_mesh((2, 2)), options=options,
                       restrict=("bn channel x batch", _channel_and_batch)).plan
    assert all(n.input_specs[0] == "S1S0" for n in _bn_nodes(plan)), [n.input_specs for n in _bn_nodes(plan)]
    ref = _reference(model, inputs, 4)
    for rank, out in enumerate(run_local(_run, 4, model, inputs, plan, False, timeout=240)):
        _same(out["autopar"], ref, rank)


def test_tight_budget_equals_one_device():
    torch.manual_seed(0)
    model, inputs = CNN().double().train(), _inputs()
    mesh = fast_mesh((4,))

    def plan(budget):
        return autopar.plan(model, inputs, mesh=mesh, memory_budget=budget, batch_norm_stats="per_rank",
                            pipeline=None, cache=False)

    free = plan(None)
    budget = between(smallest_budget(plan), free.estimate.peak_bytes, 1 / 3)
    tight = plan(budget)
    assert tight.estimate.peak_bytes <= budget
    params = [n for n in tight.nodes if n.kind.value == "parameter"]
    assert any(n.output_specs != ("R",) for n in params), "the tight budget must shard some parameter"
    ref = _reference(model, inputs, 4)
    for rank, out in enumerate(run_local(_run, 4, model, inputs, tight, False, timeout=240)):
        _same(out["autopar"], ref, rank)


def test_bad_input_errors():
    model = CNN().double().train()
    with pytest.raises(ValueError, match=r"module 'bn'.*batch of 6.*4 ranks"):
        autopar.plan(model, _inputs(batch=6, chunks=2), mesh=(4,), batch_norm_stats="per_rank", pipeline=None,
                     cache=False)
    with pytest.raises(ValueError, match="batch_norm_stats must be one of"):
        autopar.plan(model, _inputs(), mesh=(4,), batch_norm_stats="local")
    with pytest.raises(ValueError, match="not planned with a pipeline"):
        PlanOptions(batch_norm_stats="per_rank", pipeline=2)
    traced = trace_for_planning(model, _inputs(), precision="fp32")
    with pytest.raises(ValueError, match="batch_norm_chunks=None"):
        plan_traced(traced, profile(traced), mesh=(4,), options=PlanOptions(batch_norm_stats="per_rank"))


def test_a_per_rank_plan_applied_to_the_global_graph_names_the_option():
    from autopar.runtime.build import check_plan

    model = CNN().double().train()
    plan = autopar.plan(model, _inputs(), mesh=(4,), batch_norm_stats="per_rank", pipeline=None, cache=False)
    global_hash = autopar.plan(model, _inputs(), mesh=(4,), pipeline=None, cache=False).graph_hash
    assert global_hash != plan.graph_hash
    with pytest.raises(ValueError, match=r"stale plan.*made with batch_norm_stats='per_rank'"):
        check_plan(plan, graph_hash=global_hash, world_size=4, mesh=None)


@pytest.mark.full_sweep  # the default run covers the batch split, the channel x batch split and a tight budget
@pytest.mark.parametrize("shape", [(2,), (4,), (2, 2)], ids=str)
def test_auto_plan_equals_one_device(shape):
    torch.manual_seed(0)
    world = 2 if shape == (2,) else 4
    model, inputs = CNN().double().train(), _inputs(chunks=world)
    plan = autopar.plan(model, inputs, mesh=fast_mesh(shape), batch_norm_stats="per_rank", pipeline=None, cache=False)
    ref = _reference(model, inputs, world)
    for rank, out in enumerate(run_local(_run, world, model, inputs, plan, False, timeout=240)):
        _same(out["autopar"], ref, rank)


def _sum_over_both_axes(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.runtime.counting import count_collectives
    from autopar.runtime.kernels import DistComm
    from autopar.runtime.process_mesh import ProcessMesh

    comm = DistComm(ProcessMesh(init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))))
    with count_collectives() as counts:
        result = comm.all_reduce_async(torch.full((3,), float(rank + 1)), (0, 1))
        summed = result()
    return summed.tolist(), counts["all_reduce"]


def test_data_parallel_plan_over_both_axes_of_a_2d_mesh_equals_one_device():
    for summed, issued in run_local(_sum_over_both_axes, 4, timeout=120):
        assert summed == [10.0] * 3 and issued == 1  # 1 + 2 + 3 + 4, one collective
    torch.manual_seed(0)
    model, inputs = CNN().double().train(), _inputs()
    plan = plan_family(model, inputs, "data-parallel", mesh=fast_mesh((2, 2)),
                       options=PlanOptions(batch_norm_stats="per_rank"))
    assert [n.input_specs[0] for n in _bn_nodes(plan)[:2]] == ["S0S0", "S0S0"], [n.input_specs for n in _bn_nodes(plan)]
    ref = _reference(model, inputs, 4)
    for rank, out in enumerate(run_local(_run, 4, model, inputs, plan, True, timeout=240)):
        _same(out["autopar"], ref, rank)
