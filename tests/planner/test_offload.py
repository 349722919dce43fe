"""Offload as a planner decision (issue 16): host-tier options of the parameters, priced by the
host link and a CPU optimizer against the device memory they free."""

import json
import math
from dataclasses import replace

import pytest

from autopar import zoo
from autopar.api import Progress, plan_traced
from autopar.layout.mesh import MeshSpec
from autopar.planner.builder import build_problem
from autopar.offload import OffloadPolicy
from autopar.planner.offload_fit import pinned_room
from autopar.planner.offload_pricing import offload_cost, offload_tier, option_name, static_tiers
from autopar.planner.options import PlanOptions
from autopar.plans import Plan, RecomputeRegion
from autopar.tracer import profile, trace


@pytest.fixture(scope="module")
def gpt2():
    model, inputs = zoo.build("gpt2", tiny=True, batch=8, seq=32, device="meta")
    traced = trace(model, inputs)
    return model, inputs, traced, profile(traced)


def _plan(gpt2, mesh=(1,), **kw):
    _, _, traced, prof = gpt2  # one trace for every plan here (planning is the subject)
    return plan_traced(traced, prof, mesh=mesh, options=PlanOptions(checkpoint="none", **kw)).plan


def test_policy_and_option_checks():
    assert PlanOptions().offload == "none" and "offload auto" in str(PlanOptions(offload="auto"))
    for bad in ("yes", None, 1.0, {"offload_optim_frac": 1}):
        with pytest.raises(ValueError, match="offload must be 'auto', 'none' or an OffloadPolicy"):
            PlanOptions(offload=bad)
    with pytest.raises(ValueError, match=r"offload_param_frac=0.5 needs offload_optim_frac=1.0"):
        OffloadPolicy(offload_optim_frac=0.5, offload_param_frac=0.5)
    with pytest.raises(ValueError, match=r"offload_optim_frac must be a number in \[0, 1\], got 1.5"):
        OffloadPolicy(offload_optim_frac=1.5)
    with pytest.raises(ValueError, match="not planned with a pipeline"):
        PlanOptions(offload="auto", pipeline=2)
    assert offload_tier(option_name("RR z1", "o")) == "o" and offload_tier("RR z1") == "device"
    # Gemini's order: the first parameters (by bytes) go first.
    tiers = static_tiers([("a", 10), ("b", 30), ("c", 40), ("d", 20)], OffloadPolicy(1.0, 0.4))
    assert tiers == {"a": "po", "b": "po", "c": "o", "d": "o"}
    assert set(static_tiers([("a", 1)], OffloadPolicy())) == {"a"} \
        and static_tiers([("a", 1)], OffloadPolicy())["a"] == "device"


def test_offload_cost_formulas():
    mesh = MeshSpec.cluster(nodes=1, devices_per_node=8)
    local, m = 10**9, 2.0
    o = offload_cost("o", local, mesh, stage=0, dp=1, optimizer_multiplier=m)
    assert (o.device_per_byte, o.host_per_byte) == (2.0, 4.0)  # param + grad on device; master + grad + state
    assert o.link_s == pytest.approx(2 * mesh.host_alpha + 2 * local / 50e9)
    assert o.cpu_s == pytest.approx(7 * local / 77e9)  # AdamW: read p, g, m, v; write p, m, v
    z2 = offload_cost("o", local, mesh, stage=2, dp=8, optimizer_multiplier=m, reduce_frac=0.5)
    assert z2.device_per_byte == pytest.approx(1 + 1 / 8) and z2.host_per_byte == pytest.approx(4 / 8)
    assert z2.link_s == pytest.approx(2 * mesh.host_alpha + 1.5 * local / 8 / 50e9)
    po = offload_cost("po", local, mesh, stage=0, dp=1, optimizer_multiplier=m, compute_frac=0.5, reduce_frac=1.0)
    assert po.device_per_byte == 0.0 and po.host_per_byte == 4.0
    assert po.link_s == pytest.approx(3 * mesh.host_alpha + 2.0 * local / 50e9)  # 2 bf16 uploads + fp32 grad
    bare = MeshSpec(shape=(1,), axis_names=("x",), alpha=(0.0,), beta=(1e-9,), peak_flops=1e12,
                    mem_bandwidth=1e11, mem_capacity=2**30)
    with pytest.raises(ValueError, match="has no host tier"):
        offload_cost("o", local, bare, stage=0, dp=1, optimizer_multiplier=m)


def test_none_keeps_the_problem_and_auto_adds_host_options(gpt2):
    _, _, traced, prof = gpt2
    mesh = MeshSpec.preset("cpu", (2,))
    plain = build_problem(traced, prof, mesh, budget_bytes=2**30).problem
    none = build_problem(traced, prof, mesh, budget_bytes=2**30, options=PlanOptions(offload="none")).problem
    auto = build_problem(traced, prof, mesh, budget_bytes=2**30,
                         options=PlanOptions(offload="auto", zero_stage="auto")).problem
    assert none == plain and not any(" off:" in o.name for n in none.nodes for o in n.options)
    staged = build_problem(traced, prof, mesh, budget_bytes=2**30, options=PlanOptions(zero_stage="auto")).problem
    # "auto" = the same device options (costs and order) plus host-tier ones on trainable parameters.
    for a, s in zip(auto.nodes, staged.nodes):
        assert tuple(o for o in a.options if offload_tier(o.name) == "device") == s.options
        extra = [o for o in a.options if offload_tier(o.name) != "device"]
        if extra:
            plain_of = {o.name: o for o in s.options}
            for o in extra:
                base = o.name.rsplit(" off:", 1)[0]
                if base in plain_of:  # less device memory, more time
                    assert o.param_bytes < plain_of[base].param_bytes and o.comm_s > plain_of[base].comm_s
    assert sum(1 for n in auto.nodes for o in n.options if o.name.endswith("off:po")) >= 10
    with pytest.raises(ValueError, match="needs a mesh with a host tier"):
        build_problem(traced, prof, replace(mesh, host_capacity=None), budget_bytes=2**30,
                      options=PlanOptions(offload="auto"))


def test_auto_offloads_only_when_the_budget_needs_it(gpt2):
    free = _plan(gpt2, offload="auto")
    assert set(free.offload.values()) == {("device", "device")} and free.estimate.host_link_s == 0.0
    params = free.estimate.param_bytes
    tight = int(free.estimate.peak_bytes - 0.6 * params)
    with pytest.raises(ValueError, match="cannot be met"):
        _plan(gpt2, memory_budget=tight)
    plan = _plan(gpt2, memory_budget=tight, offload="auto")
    assert plan.estimate.peak_bytes <= tight and plan.estimate.param_bytes < 0.5 * params
    assert {t for t in plan.offload.values()} & {("host", "host"), ("device", "host")}
    info = plan.offload_info
    assert info["host_bytes"] > 0 and plan.estimate.host_link_s == info["host_link_s"] > 0
    assert plan.estimate.step_s > free.estimate.step_s + info["host_link_s"] * 0.99  # priced, not free
    text = plan.summary()
    assert "offload (auto)" in text and "host link" in text
    back = Plan.from_json(plan.to_json())
    assert back.offload == plan.offload and back.offload_info == plan.offload_info and back.estimate == plan.estimate
    assert json.loads(plan.to_json())["mesh"]["host_capacity"] == plan.mesh.host_capacity
    # The host tier's capacity is respected: a plan that needs more host memory is refused.
    small = replace(MeshSpec.preset("cpu", (1,)), host_capacity=max(info["host_bytes"] // 4, 1))
    with pytest.raises(ValueError, match="on the host but the mesh's host tier holds"):
        _plan(gpt2, mesh=small, memory_budget=tight, offload="auto")


def test_static_policy_places_gemini_fractions(gpt2):
    plan = _plan(gpt2, mesh=(2,), offload=OffloadPolicy(offload_optim_frac=1.0, offload_param_frac=0.5),
                 zero_stage="auto")
    tiers = list(plan.offload.values())
    assert ("host", "host") in tiers and ("device", "host") in tiers and ("device", "device") not in tiers
    assert list(plan.offload)[0] == "transformer.wte.weight" and tiers[0] == ("host", "host")  # first first
    none = _plan(gpt2, mesh=(2,), offload=OffloadPolicy(), zero_stage="auto")
    assert set(none.offload.values()) == {("device", "device")}
    assert none.estimate.step_s == pytest.approx(_plan(gpt2, mesh=(2,), zero_stage="auto").estimate.step_s)


def test_one_device_mesh_is_a_valid_plan(gpt2):
    plan = _plan(gpt2, mesh=(1,))
    assert plan.mesh.num_devices == 1 and math.isfinite(plan.estimate.step_s)


def test_cli_offload_flag_and_text_report(gpt2):
    import argparse

    from autopar.cli.flags import parse_offload as _offload
    from autopar.report.text import _offload as offload_lines

    assert _offload("auto") == "auto" and _offload("static:1,0.25") == OffloadPolicy(1.0, 0.25)
    for bad in ("static:0.5,0.5", "static:1", "gemini"):
        with pytest.raises(argparse.ArgumentTypeError):
            _offload(bad)
    plan = _plan(gpt2, mesh=(2,), offload=OffloadPolicy(offload_optim_frac=1.0, offload_param_frac=0.5))
    text = "\n".join(offload_lines(plan))
    assert "parameters on host: transformer.wte.weight" in text and "CPU optimizer" in text


def test_pinned_room_is_what_an_op_or_a_recomputed_region_pins_at_once(gpt2):
    _, _, traced, _ = gpt2
    attn, fc, other = "p_transformer_h_0_attn_c_attn_weight", "p_transformer_h_0_mlp_c_fc_weight", \
        "p_transformer_h_1_attn_c_attn_weight"
    streamed = {attn: 100, fc: 10, other: 1000}
    assert pinned_room(traced, (), streamed) == 1000  # their readers are apart: one at a time
    block0 = RecomputeRegion("transformer.h.0", tuple(n.name for n in traced.compute_nodes()
                                                      if traced.module_path(n).startswith("transformer.h.0")))
    # Block 0 recomputed: its call reads both of its weights at once (its backward re-fetches both).
    assert pinned_room(traced, (block0,), {attn: 100, fc: 10}) == 110
    assert pinned_room(traced, (block0,), streamed) == 1000
    # The tied embedding is read by the first op and the lm head: pinned in between.
    assert pinned_room(traced, (), {"p_transformer_wte_weight": 7, other: 1000}) == 1007


def test_device_room_fits_the_budget_with_recompute(gpt2):
    """The stream room (what recomputed regions pin) and the ZeRO-2 gradient wait are added after
    the ILP: a plan whose peak plus room exceeds the budget is re-solved under a lower one."""
    _, _, traced, prof = gpt2
    free = _plan(gpt2, offload="auto")
    budget = int(free.estimate.peak_bytes - 1.25 * free.estimate.param_bytes)
    lines = []
    plan = plan_traced(traced, prof, mesh=(1,), options=PlanOptions(checkpoint="auto", offload="auto",
                                                                    memory_budget=budget),
                       progress=Progress(verbose=True, sink=lines.append)).plan
    info = plan.offload_info
    assert plan.recompute and info["num_offloaded"] > 0 and plan.budget_bytes == budget
    assert any("offload refit 1" in line and "re-solving under" in line for line in lines), lines
    assert plan.estimate.peak_bytes + info["stream_buffer_bytes"] + info["grad_wait_bytes"] <= budget
    streamed = {n.name: traced.node(n.name).meta["val"].numel() * 4 for n in plan.nodes  # fp32, one device
                if n.kind == "parameter" and plan.offload.get(n.module) == ("host", "host")}
    assert info["stream_buffer_bytes"] == max(sum(sorted(streamed.values())[-2:]),
                                              pinned_room(traced, plan.recompute, streamed)) > 0
    # ZeRO-2 gradients wait whole for their reduce-scatter: the largest one is in the room.
    zero = _plan(gpt2, mesh=(2,), offload=OffloadPolicy(offload_optim_frac=1.0), zero_stage=2)
    waits = [traced.node(n.name).meta["val"].numel() * 4 for n in zero.nodes  # replicated: local = whole
             if n.kind == "parameter" and n.zero_stage == 2]
    assert waits and zero.offload_info["grad_wait_bytes"] == max(waits)
