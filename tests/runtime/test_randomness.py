"""Mesh-invariant randomness (issue 32 points 1, 2, 5): random draws depend on the seed and each
element's global index only.

"Equal to one device" means equal to autopar's own module on mesh ``(1,)`` (one rank running the
same counter-based draws on whole tensors); the eager model draws from torch's generator instead
(``autopar/strategies/rng.py``). Default suite: the generator's properties, the refusal of
random ops without a rule, and GPT-2 tiny (dropout 0.1 everywhere, attention dropout inside
SDPA) on (1,), (2, 2), recompute and a pipeline, plus ``verify`` on it, and DINOv2's drop-path
on (2,) and (2, 2), with and without recompute, and a recomputed pipeline; ``slow``: 20 training
steps of GPT-2 on (2, 2). ``full_sweep``: the whole matrix -- GPT-2, BERT, GPT-NeoX, DINOv2 with
drop-path on (1,), (2,), (2, 2), (4,), with every block recomputed, through 2 pipeline stages
(with and without recompute).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
from autopar.runtime.build import build_module
from autopar.runtime.launch import run_local
from autopar.strategies import rng
from autopar.strategies.registry import NoRuleError
from tests.runtime import random_models as rm

MESHES = [(1,), (2,), (2, 2), (4,)]


# ------------------------------------------------------------------------------ the generator
def test_draws_are_a_function_of_seed_step_op_and_global_index():
    draw = rng.Draw(7, 3)
    whole = rng.uniform(draw.key("dropout"), rng.element_indices((8, 6), (slice(0, 8), slice(0, 6)), draw=draw))
    piece = rng.uniform(draw.key("dropout"), rng.element_indices((8, 6), (slice(4, 8), slice(2, 4)), draw=draw))
    assert torch.equal(piece, whole[4:8, 2:4])
    for other in (rng.Draw(8, 3), rng.Draw(7, 4)):
        assert not torch.equal(rng.uniform(other.key("dropout"), torch.arange(48).view(8, 6)), whole)
    assert not torch.equal(rng.uniform(draw.key("dropout_1"), torch.arange(48).view(8, 6)), whole)
    # A pipeline micro-batch draws its rows of the full batch's draw (dim 0 = micro-batch size 4).
    micro = rng.Draw(7, 3, micro_batch=1, micro_batches=2, micro_batch_size=4)
    rows = rng.uniform(draw.key("dropout"), rng.element_indices((4, 6), (slice(0, 4), slice(0, 6)), draw=micro))
    assert torch.equal(rows, whole[4:8])


def test_distributions():
    idx = torch.arange(200_000)
    u = rng.uniform(rng.Draw(0, 0).key("u"), idx)
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
    assert abs((u < 0.1).double().mean() - 0.1) < 0.003  # a dropout probability
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert rng.uniform(0, idx, dtype).max() < 1  # never rounds up to 1
    z = rng.normal(rng.Draw(0, 0).key("z"), idx)
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1) < 0.01 and abs((z.abs() < 1).double().mean() - 0.6827) < 0.005
    # Neighbouring streams are uncorrelated (keys of consecutive steps, of neighbouring indices).
    v = rng.uniform(rng.Draw(0, 1).key("u"), idx)
    assert abs(torch.corrcoef(torch.stack([u, v]))[0, 1]) < 0.01
    assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1]) < 0.01


def test_distribution_fills_have_their_distributions():
    """``uniform_``, ``normal_``, ``exponential_``, ``geometric_``, ``cauchy_``, ``log_normal_``:
    the kernel's inverse CDFs give torch's distributions (their parameters named as in the schema)."""
    from autopar.strategies._random import _FILLS
    from autopar.strategies.registry import bind

    aten = torch.ops.aten
    idx = torch.arange(400_000)
    u = rng.uniform(rng.Draw(0, 0).key("fill"), idx)
    z = rng.normal(rng.Draw(0, 0).key("fill"), idx)
    x = _FILLS[aten.uniform.default](u, {"from": 0.9, "to": 1.1})
    assert 0.9 <= x.min() and x.max() < 1.1 and abs(x.mean() - 1.0) < 1e-3
    x = _FILLS[aten.normal_.default](z, {"mean": 1.0, "std": 2.0})
    assert abs(x.mean() - 1.0) < 0.02 and abs(x.std() - 2.0) < 0.02
    x = _FILLS[aten.exponential.default](u, {"lambd": 2.0})
    assert x.min() >= 0 and abs(x.mean() - 0.5) < 0.005 and abs(x.std() - 0.5) < 0.005
    x = _FILLS[aten.geometric.default](u, {"p": 0.3})  # trials to the first success: 1, 2, ...
    assert x.min() == 1 and torch.equal(x, x.round()) and abs(x.mean() - 1 / 0.3) < 0.03
    assert abs((x == 1).double().mean() - 0.3) < 0.003
    x = _FILLS[aten.cauchy.default](u, {"median": 1.0, "sigma": 0.5})
    assert abs(x.median() - 1.0) < 0.01 and abs(((x - 1).abs() < 0.5).double().mean() - 0.5) < 0.003
    x = _FILLS[aten.log_normal.default](z, {"mean": 0.0, "std": 0.25})
    assert x.min() > 0 and abs(x.log().mean()) < 0.002 and abs(x.log().std() - 0.25) < 0.002
    defaults = bind(aten.uniform.default, (u[:4],), {})  # as the kernel gets a call that left them out
    assert _FILLS[aten.uniform.default](u[:4], defaults).max() < 1


def test_manual_seed_fixes_the_draws_and_restarts_the_steps():
    autopar.manual_seed(3)
    a = [rng.next_draw() for _ in range(2)]
    autopar.manual_seed(3)
    b = [rng.next_draw() for _ in range(2)]
    assert a == b and [d.step for d in a] == [0, 1] and a[0].seed == 3 and torch.initial_seed() == 3
    assert rng.next_draw(advance=False) == rng.next_draw()  # verify's draw leaves the sequence alone


# ----------------------------------------------------------------------- refusal (point 5)
class _Noisy(nn.Module):
    """A random draw no rule covers (``normal``), inside a submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return (self.proj(x) + torch.normal(0.0, 1.0, size=(4, 8))).sum()


class _Outer(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


class _Poisson(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return (self.proj(x) * torch.poisson(torch.full((4, 8), 2.0))).sum()


@pytest.mark.parametrize("inner", [_Noisy, _Poisson], ids=["normal", "poisson"])
def test_an_unruled_random_op_is_a_no_rule_error_even_with_the_fallback(inner):
    model = _Outer(inner()).train()
    for fallback in (False, True):
        with pytest.raises(NoRuleError) as caught:
            autopar.plan(model, (torch.randn(4, 8),), mesh=(2,), allow_replicate_fallback=fallback, cache=False)
        text = str(caught.value)
        assert "inner" in text and ("normal" in text or "poisson" in text), text
        assert "random" in text and "_random.py" in text and "fallback is refused" in text, text


def test_a_derived_rule_of_a_random_op_is_refused():
    """DTensor has a strategy for ``bernoulli_.float`` (each rank would draw its own numbers): a
    draw is planned only by a mesh-invariant kernel, whatever other rule exists."""
    from autopar.layout.mesh import MeshSpec
    from autopar.strategies import OpInfo, enumerate_strategies, rule_for

    op = torch.ops.aten.bernoulli_.float
    assert rule_for(op) is not None
    x = torch.rand(4, 8)
    info = OpInfo.from_values(op, (x, 0.5), {}, x)
    with pytest.raises(NoRuleError, match="bernoulli_"):
        enumerate_strategies(info, MeshSpec.preset("cpu", (2,)), allow_replicate_fallback=True)
    off = OpInfo.from_values(op, (x, 0.0), {}, x)  # p = 0 draws nothing: its rule plans it
    assert enumerate_strategies(off, MeshSpec.preset("cpu", (2,)))


@pytest.mark.filterwarnings("ignore:The tensor attributes")  # export on nn.LSTM's flat weights
def test_an_lstm_with_dropout_in_training_is_refused_and_planned_in_eval():
    lstm = nn.LSTM(8, 8, num_layers=2, dropout=0.5, batch_first=True)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = lstm

        def forward(self, x):
            return self.lstm(x)[0].sum()

    model = Model()
    with pytest.raises(NoRuleError, match="lstm"):
        autopar.plan(model.train(), (torch.randn(4, 6, 8),), mesh=(2,), cache=False)
    autopar.plan(model.eval(), (torch.randn(4, 6, 8),), mesh=(2,), cache=False)  # no draw: planned


# ------------------------------------------------------------------------- proof (point 2)
@pytest.fixture(scope="module")
def gpt2():
    model, inputs = rm.build("gpt2")
    traced, prof = rm.traced_of(model, inputs)
    return model, inputs, traced, prof, rm.run_on(model, traced, rm.plan_for(traced, prof, (1,)), inputs, steps=2)


def test_gpt2_dropout_same_on_a_sharded_mesh_and_under_recompute(gpt2):
    model, inputs, traced, prof, ref = gpt2
    assert ref[3] == 7  # 5 dropouts + 2 attention dropouts inside SDPA, all drawn by the kernels
    plans = {recompute: rm.plan_for(traced, prof, (2, 2), recompute=recompute) for recompute in (False, True)}
    for recompute, got in zip(plans, rm.run_each(model, traced, list(plans.values()), inputs, steps=2)):
        assert rm.sharded_draws(plans[recompute]) >= 7  # every dropout and attention runs on shards
        rm.assert_same(f"(2, 2) recompute={recompute}", got, ref)
    # The plain model draws from torch's generator: another (valid) sample, not autopar's numbers.
    torch.manual_seed(rm.SEED)
    assert not torch.allclose(rm._call(model, inputs).detach(), ref[0][0])


def test_gpt2_dropout_same_through_a_pipeline(gpt2):
    model, inputs, _, _, ref = gpt2
    traced, plan = rm.pipeline_plan_for(model, inputs, (2,))
    assert plan.pipeline is not None and plan.pipeline.num_microbatches == 2
    rm.assert_same("pipeline (2,)", rm.run_pipeline(model, traced, plan, inputs, steps=2), ref)


def _verify(rank, world, model, traced, plan, inputs):
    autopar.manual_seed(rm.SEED)
    pm = build_module(model, traced, plan, device=torch.device("cpu"))
    report = autopar.verify(pm, inputs)  # refused models that draw before (NotImplementedError)
    first = float(rm._call(pm, inputs))  # verify left the step counter at 0: the same draw
    built = autopar.autoparallelize(model, inputs, mesh=rm.fast_mesh(plan.mesh.shape), verify=True, cache=False)
    return report.loss, first, built.plan.mesh.shape


def test_verify_checks_a_model_with_dropout(gpt2):
    """``autopar.verify`` and ``autoparallelize(verify=True)`` compare a model that draws (both
    sides make the same draw)."""
    model, inputs, traced, prof, ref = gpt2
    results = run_local(_verify, 4, model, traced, rm.plan_for(traced, prof, (2, 2)), inputs, timeout=240)
    for verified, first, shape in results:
        assert verified == pytest.approx(float(ref[0][0]), rel=1e-5) and first == pytest.approx(verified, rel=1e-5)
        assert shape == (2, 2)


def _seeded_by_rank(rank, world, model, traced, plan):
    autopar.manual_seed(rank)  # e.g. a per-rank data seed mistaken for the model's
    try:
        build_module(model, traced, plan, device=torch.device("cpu"))
    except ValueError as exc:
        return str(exc)
    return None


def test_ranks_holding_different_seeds_refuse_to_build(gpt2):
    model, _, traced, prof, _ = gpt2
    errors = run_local(_seeded_by_rank, 2, model, traced, rm.plan_for(traced, prof, (2,)), timeout=240)
    assert all(e is not None and "rank 1: seed 1 step 0" in e and "autopar.manual_seed" in e for e in errors), errors


def test_phimoe_random_routing_same_on_a_sharded_mesh():
    """PhiMoE in training mode samples its routing (``exponential_``, ``rand_like``) and jitters its
    inputs (``uniform_``): two SGD steps on (2, 2) equal those on one rank (the full sweep adds
    recompute and pipelines)."""
    model, inputs = rm.build("phimoe")
    traced, prof = rm.traced_of(model, inputs)
    ref = rm.run_on(model, traced, rm.plan_for(traced, prof, (1,)), inputs, steps=2)
    plan = rm.plan_for(traced, prof, (2, 2))
    assert rm.sharded_draws(plan) > 0 and ref[3] > 0
    rm.assert_same("phimoe (2, 2)", rm.run_on(model, traced, plan, inputs, steps=2), ref)


PIPELINES = (((2,), False), ((2, 2), False), ((2, 2), True))
# The default run: drop_path (gpt2's dropout below) on a 1-D and a 2-D mesh, each with and without
# recompute, and the pipeline whose stages are sharded and recomputed; (4,) is (2,) at another
# width, and a pipeline without recompute runs by default in
# test_gpt2_dropout_same_through_a_pipeline. `pytest -m full_sweep` runs the whole matrix.
_DEFAULT = ([(2,), (2, 2)], (((2, 2), True),))


@pytest.mark.slow
@pytest.mark.parametrize("name, meshes, pipelines", [
    pytest.param("vit-drop-path", *_DEFAULT, id="vit-drop-path"),
    *(pytest.param(n, MESHES, PIPELINES, id=f"{n}-all", marks=pytest.mark.full_sweep) for n in sorted(rm.MODELS))])
def test_same_loss_and_gradients_on_every_mesh_under_recompute_and_pipelines(name, meshes, pipelines):
    model, inputs = rm.build(name)
    traced, prof = rm.traced_of(model, inputs)
    ref = rm.run_on(model, traced, rm.plan_for(traced, prof, (1,)), inputs, steps=2)
    assert ref[3] > 0
    for shape in meshes:  # one launch per mesh
        plans = {recompute: rm.plan_for(traced, prof, shape, recompute=recompute) for recompute in (False, True)}
        for recompute, got in zip(plans, rm.run_each(model, traced, list(plans.values()), inputs, steps=2)):
            assert shape == (1,) or rm.sharded_draws(plans[recompute]) > 0, f"{name} {shape}: no draw runs on shards"
            assert got[3] == ref[3]
            rm.assert_same(f"{name} {shape} recompute={recompute}", got, ref)
    for shape, recompute in pipelines:
        micro, plan = rm.pipeline_plan_for(model, inputs, shape, recompute=recompute)
        got = rm.run_pipeline(model, micro, plan, inputs, steps=2)
        assert (got[3] > 0) == recompute  # checkpoint regions inside the stages
        rm.assert_same(f"{name} pipeline {shape} recompute={recompute}", got, ref)


@pytest.mark.slow
def test_gpt2_trains_20_steps_with_dropout_on_2x2_as_on_one_rank(gpt2):
    model, inputs, traced, prof, _ = gpt2
    ref = rm.run_on(model, traced, rm.plan_for(traced, prof, (1,)), inputs, steps=20)
    got = rm.run_on(model, traced, rm.plan_for(traced, prof, (2, 2)), inputs, steps=20)
    assert ref[0][-1] < ref[0][0] - 0.5  # it trains
    rm.assert_same("20 steps on (2, 2)", got, ref, rtol=1e-5, atol=1e-6)
