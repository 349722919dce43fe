"""The plan cache (autopar.planner.cache): a hit neither traces nor solves and returns the same
plan; anything that changes the plan changes the key; a stale, corrupt or foreign entry is a miss
that is solved again and replaced; under autoparallelize only rank 0 touches the files."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from torch import nn

import autopar.api as api
import autopar.tracer
from autopar.planner import orchestrate
from autopar import zoo
from autopar.layout.mesh import MeshSpec
from autopar.planner import cache as plan_cache
from autopar.planner.options import PlanOptions
from autopar.plans import Plan
from autopar.runtime.launch import run_local


def _mlp(*, batch: int = 4, layers: int | None = None):
    return zoo.build("mlp", tiny=True, batch=batch, num_layers=layers)


def _entries() -> list[str]:
    root = plan_cache.cache_dir()
    return sorted(os.listdir(root)) if root.exists() else []


def _count_solves(monkeypatch) -> list[int]:
    """Counts plan_traced calls (every solve goes through it)."""
    calls = [0]
    real = orchestrate.plan_traced

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(orchestrate, "plan_traced", counting)
    return calls


def _forbid(*args, **kwargs):
    raise AssertionError("a cache hit must neither trace nor solve")


def test_a_hit_returns_the_same_plan_without_tracing_or_solving(monkeypatch):
    model, inputs = _mlp()
    first = api.plan(model, inputs, mesh=(2,), memory_budget="1GiB")
    (entry,) = _entries()
    assert Plan.load(str(plan_cache.cache_dir() / entry)).to_json() == first.to_json()
    monkeypatch.setattr(autopar.tracer, "trace", _forbid)
    monkeypatch.setattr(orchestrate, "plan_traced", _forbid)
    lines: list[str] = []
    again = api.plan(*_mlp(), mesh=(2,), memory_budget="1GiB", progress=api.Progress(True, sink=lines.append))
    assert again.to_json() == first.to_json()
    assert len(lines) == 1 and lines[0].endswith(f"plan cache hit {plan_cache.cache_dir() / entry}")


def _other_forward(self, x, labels):  # the MLP's forward with the residual dropped
    for block in self.blocks:
        x = block(x)
    logits = self.head(x)
    return nn.functional.cross_entropy(logits.reshape(-1, self.num_classes), labels.reshape(-1)), logits


class _Pair(nn.Module):
    def __init__(self, *, tied: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)
        if tied:
            self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(self.a(x)).sum()


def test_the_key_changes_with_everything_that_changes_the_plan(monkeypatch):
    mesh, options = MeshSpec.preset("cpu", (2,)), PlanOptions(memory_budget="1GiB")

    def key(model_inputs=None, *, mesh=mesh, options=options):
        model, inputs = model_inputs or _mlp()
        return plan_cache.structural_key(model, inputs, mesh=mesh, options=options)

    base = key()
    assert key() == base  # a rebuilt model (new weights) keys the same
    variants = {
        "budget": key(options=PlanOptions(memory_budget="2GiB")),
        "mesh shape": key(mesh=MeshSpec.preset("cpu", (4,))),
        "mesh costs": key(mesh=MeshSpec.preset("h100-80gb", (2,))),
        "checkpoint": key(options=PlanOptions(memory_budget="1GiB", checkpoint="none")),
        "precision": key(options=PlanOptions(memory_budget="1GiB", precision="bf16")),
        "time limit": key(options=PlanOptions(memory_budget="1GiB", time_limit=5.0)),
        "input shape": key(_mlp(batch=8)),
        "depth": key(_mlp(layers=3)),
        "eval mode": key((_mlp()[0].eval(), _mlp()[1])),
    }
    monkeypatch.setattr(zoo.MLP, "forward", _other_forward)
    variants["forward source"] = key()
    monkeypatch.undo()
    x = (torch.empty(2, 8, device="meta"),)
    variants["untied"], variants["tied"] = key((_Pair(tied=False), x)), key((_Pair(tied=True), x))
    assert len({base, *variants.values()}) == len(variants) + 1, variants
    # baselines are not in the key: one entry serves both (see test_baselines_...)
    assert key(options=PlanOptions(memory_budget="1GiB", baselines=True)) == base


def test_a_changed_budget_or_depth_is_solved_again(monkeypatch):
    solves = _count_solves(monkeypatch)
    api.plan(*_mlp(), mesh=(2,), memory_budget="1GiB")
    api.plan(*_mlp(), mesh=(2,), memory_budget="1GiB")
    assert solves[0] == 1
    api.plan(*_mlp(), mesh=(2,), memory_budget="2GiB")
    deeper = api.plan(*_mlp(layers=3), mesh=(2,), memory_budget="1GiB")
    assert solves[0] == 3 and len(_entries()) == 3
    assert len(deeper.by_kind("parameter")) == 4 * 3 + 2  # the deeper model's own plan (2 Linears a block)


def test_baselines_are_cached_and_asked_for(monkeypatch):
    solves = _count_solves(monkeypatch)
    plain = api.plan(*_mlp(), mesh=(2,))
    with_baselines = api.plan(*_mlp(), mesh=(2,), baselines=True)  # the entry has none: a miss
    assert solves[0] == 2 and with_baselines.baselines and not plain.baselines
    again = api.plan(*_mlp(), mesh=(2,), baselines=True)
    served = api.plan(*_mlp(), mesh=(2,))  # an entry with baselines serves a plan without them
    assert solves[0] == 2
    assert again.to_json() == with_baselines.to_json()
    assert served.baselines == () and served.nodes == plain.nodes and served.estimate == plain.estimate


def test_a_corrupt_or_foreign_entry_is_a_miss_that_is_replaced(monkeypatch):
    solves = _count_solves(monkeypatch)
    first = api.plan(*_mlp(), mesh=(2,))
    path = plan_cache.cache_dir() / _entries()[0]
    for bad in ("{ not json", json.dumps({"version": 1})):
        path.write_text(bad)
        with pytest.warns(UserWarning, match="plan cache: .* planning again"):
            again = api.plan(*_mlp(), mesh=(2,))
        assert again.nodes == first.nodes and Plan.load(str(path)).nodes == first.nodes
    data = json.loads(first.to_json())
    data["budget_bytes"] = 12345  # a readable plan that does not answer this request
    path.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="is for budget 12345"):
        api.plan(*_mlp(), mesh=(2,))
    assert solves[0] == 4 and Plan.load(str(path)).budget_bytes == first.budget_bytes


def test_a_stale_graph_hash_is_a_miss():
    model, inputs = _mlp()
    mesh, options = MeshSpec.preset("cpu", (2,)), PlanOptions()
    first = api.plan(model, inputs, mesh=mesh)
    key = plan_cache.structural_key(model, inputs, mesh=mesh, options=options)
    assert plan_cache.lookup(key, mesh=mesh, options=options, graph_hash=first.graph_hash)[0].nodes == first.nodes
    with pytest.warns(UserWarning, match="solved for traced graph .* now traces to 0123"):
        assert plan_cache.lookup(key, mesh=mesh, options=options, graph_hash="0123") is None


def test_the_location_and_the_switches(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "mine"))
    api.plan(*_mlp(), mesh=(2,))
    assert len(os.listdir(tmp_path / "mine")) == 1
    api.plan(*_mlp(), mesh=(2,), memory_budget="2GiB", cache=False)  # another key: it would be a new file
    monkeypatch.setenv("AUTOPAR_CACHE", "0")
    api.plan(*_mlp(), mesh=(2,), memory_budget="3GiB")
    assert len(os.listdir(tmp_path / "mine")) == 1
    monkeypatch.delenv("AUTOPAR_CACHE")
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "a-file" / "plans"))  # cannot be made
    with pytest.warns(UserWarning, match="plan cache: cannot write .*a-file/plans"):
        assert api.plan(*_mlp(), mesh=(2,)).nodes
    monkeypatch.delenv("AUTOPAR_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert plan_cache.cache_dir() == tmp_path / "xdg" / "autopar" / "plans"


def _ranks_share_one_entry(rank: int, world: int, cache_dir: str) -> dict:
    """Three autoparallelize calls: a miss (rank 0 solves and writes), a hit (nobody solves), and
    after rank 0 rewrites the entry's graph hash, a stale entry (solved again, replaced)."""
    import torch.distributed as dist

    os.environ["AUTOPAR_CACHE_DIR"] = cache_dir
    solves = [0]
    real = orchestrate.plan_traced

    def counting(*args, **kwargs):
        solves[0] += 1
        return real(*args, **kwargs)

    orchestrate.plan_traced = counting
    model, inputs = _mlp()
    out: dict = {"plans": [], "solves": [], "entries": []}
    for step in ("miss", "hit", "stale"):
        if step == "stale" and rank == 0:
            path = plan_cache.cache_dir() / _entries()[0]
            data = json.loads(path.read_text())
            data["graph_hash"] = "0123456789abcdef"
            path.write_text(json.dumps(data))
        dist.barrier()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pm = api.autoparallelize(model, inputs, mesh=(world,))
        out["plans"].append(pm.plan.to_json())
        out["solves"].append(solves[0])
        out["entries"].append(_entries())
        out.setdefault("warnings", []).extend(str(w.message) for w in caught if "plan cache" in str(w.message))
        dist.barrier()
    out["stored"] = Plan.load(str(plan_cache.cache_dir() / _entries()[0])).to_json() if rank == 0 else None
    return out


@pytest.mark.slow
def test_rank_0_fills_the_cache_and_every_rank_gets_its_plan(tmp_path):
    results = run_local(_ranks_share_one_entry, 2, str(tmp_path / "cache"), timeout=120)
    r0, r1 = results[0], results[1]
    assert r0["solves"] == [1, 1, 2] and r1["solves"] == [0, 0, 0]  # the hit solved nowhere
    assert r0["plans"] == r1["plans"]  # every rank has rank 0's plan each time
    assert r0["plans"][0] == r0["plans"][1]  # the hit is the solved plan
    assert len(r0["entries"][0]) == 1 and r0["entries"] == [r0["entries"][0]] * 3
    assert any("now traces to" in w for w in r0["warnings"]) and not r1.get("warnings")
    assert json.loads(r0["stored"])["graph_hash"] == json.loads(r0["plans"][0])["graph_hash"] != "0123456789abcdef"
