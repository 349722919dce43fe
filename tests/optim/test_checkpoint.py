"""The state of every autopar.optim optimizer on DTensor parameters is DTensors on the parameter's
mesh whose full tensors are the state of the same optimizer on the full parameters, laid out so
that ``torch.distributed.checkpoint`` reshards it: a checkpoint of ``get_state_dict(model, opt)``
saved on 2 ranks (mesh (2,), Shard(0)) loads on 4 ranks under mesh (2, 2) with other placements,
and training goes on as if uninterrupted on one device."""

from __future__ import annotations

import pytest
import torch
# Imported in the parent so forked ranks inherit them (see harness.py).
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.checkpoint.state_dict  # noqa: F401

from autopar.optim import CAME, Adafactor, GaLoreAdamW, Lamb
from autopar.runtime.launch import run_local

from .harness import ATOL, RTOL, SPECS_2D, TIMEOUT, _placements, full_tensors

OPTIMIZERS = {
    "lamb": lambda ps: Lamb(ps, lr=0.05, weight_decay=0.1),
    "adafactor": lambda ps: Adafactor(ps, weight_decay=0.1),
    "came": lambda ps: CAME(ps, lr=1e-2, weight_decay=0.1),
    # gap 3: a projector made on 2 ranks is used after the load (step 3), then one made on 4 (step 4)
    "galore": lambda ps: GaLoreAdamW(ps, lr=0.02, rank=2, update_proj_gap=3),
}
# uneven shards on 2 and 4 ranks; both GaLore orientations (8x6 projects right, 5x9 left); a 3-D
# tensor whose leading dim is a batch of factored matrices (GaLore: plain AdamW)
SHAPES = {"bias": (7,), "tall": (8, 6), "wide": (5, 9), "stack": (4, 6, 3)}
SPECS_4 = [((7, 6), ("S0",)), ((5, 9), ("S1",)), ((3, 4, 5), ("S2",)), ((6,), ("R",))]


# --------------------------------------------------------------------------- state placements
def _kept_dims(key: str, ndim: int, right: bool | None) -> tuple[int | None, ...]:
    """Where each parameter dim goes in state ``key`` (None: reduced, so the state is Replicate
    over the mesh dims sharding it) -- the layout rules written out per state."""
    same = tuple(range(ndim))
    if key in ("row_var", "exp_avg_sq_row", "exp_avg_res_row"):  # statistics over dim -1
        return (*same[:-1], None)
    if key == "col_var":  # torch's [..., 1, n]
        return (*same[:-2], None, ndim - 1)
    if key in ("exp_avg_sq_col", "exp_avg_res_col"):  # came_pytorch's [..., n]
        return (*same[:-2], None, ndim - 2)
    if key == "proj":  # right: P is r x n (meets G's columns); left: m x r (meets its rows)
        return (None, 1) if right else (0, None)
    if key in ("exp_avg", "exp_avg_sq") and right is not None:  # GaLore's low-rank R: m x r or r x n
        return (0, None) if right else (None, 1)
    return same


def _expected_placements(p, key: str, right: bool | None):
    from torch.distributed.tensor import Replicate, Shard

    dims = _kept_dims(key, p.dim(), right)
    return tuple(Shard(dims[pl.dim]) if isinstance(pl, Shard) and dims[pl.dim] is not None else Replicate()
                 for pl in p.placements)


def _placements_body(rank, world, make_opt):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    errors, checked = [], 0
    for mesh_shape, specs in (((2, 2), SPECS_2D), ((4,), SPECS_4)):
        mesh = init_device_mesh("cpu", mesh_shape)
        shapes, places = [s for s, _ in specs], [_placements(pl) for _, pl in specs]
        dparams = [torch.nn.Parameter(distribute_tensor(f, mesh, pl, src_data_rank=None))
                   for f, pl in zip(full_tensors(shapes, 0), places)]
        ref = [torch.nn.Parameter(f) for f in full_tensors(shapes, 0)]
        opt, ref_opt = make_opt(dparams), make_opt(ref)
        for t in (1, 2):
            for p, q, g, pl in zip(dparams, ref, full_tensors(shapes, 100 + t), places):
                p.grad, q.grad = distribute_tensor(g.clone(), mesh, pl, src_data_rank=None), g
            opt.step()
            ref_opt.step()
        for (shape, names), p, q in zip(specs, dparams, ref):
            state, want = opt.state[p], ref_opt.state[q]
            where = f"mesh {mesh_shape} {shape} {names}"
            if set(state) != set(want):
                errors.append(f"{where}: keys {sorted(state)} vs {sorted(want)}")
                continue
            right = state.get("right")
            for key in sorted(want):
                value, expect = state[key], want[key]
                if isinstance(expect, DTensor):
                    errors.append(f"{where} {key}: a plain parameter got DTensor state")
                if key == "step" or not isinstance(expect, torch.Tensor):  # plain, as torch keeps step
                    same = torch.equal(value, expect) if isinstance(expect, torch.Tensor) else value == expect
                    if isinstance(value, DTensor) or not same:
                        errors.append(f"{where} {key}: {value!r} vs {expect!r}")
                    continue
                checked += 1
                if not isinstance(value, DTensor):
                    errors.append(f"{where} {key}: {type(value).__name__}, not a DTensor")
                    continue
                placements = _expected_placements(p, key, right)
                if value.device_mesh != p.device_mesh or tuple(value.placements) != placements:
                    errors.append(f"{where} {key}: placements {value.placements}, want {placements}")
                if value.shape != expect.shape:  # the full parameter's state shape
                    errors.append(f"{where} {key}: global shape {tuple(value.shape)}, want {tuple(expect.shape)}")
                    continue
                try:
                    torch.testing.assert_close(value.full_tensor(), expect, rtol=RTOL, atol=ATOL)
                except AssertionError as e:
                    errors.append(f"{where} {key}: {e}")
    return errors, checked


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_state_is_dtensors_holding_the_full_parameters_state(name):
    for errors, checked in run_local(_placements_body, 4, OPTIMIZERS[name], timeout=TIMEOUT):
        assert errors == [], "\n".join(errors)
        assert checked >= len(SPECS_2D) + len(SPECS_4), checked


# --------------------------------------------------------------------------- resharding
def _layout(shape: tuple[int, ...], names: tuple[str, ...]):
    """``names`` for a matrix; a 1-D tensor has no dim 1, so its S1 becomes S0."""
    return _placements(tuple("S0" if n == "S1" and len(shape) == 1 else n for n in names))


def _model(mesh, names: tuple[str, ...], seed: int) -> torch.nn.Module:
    from torch.distributed.tensor import distribute_tensor

    model = torch.nn.Module()
    for (key, shape), full in zip(SHAPES.items(), full_tensors(list(SHAPES.values()), seed)):
        model.register_parameter(key, torch.nn.Parameter(
            distribute_tensor(full, mesh, _layout(shape, names), src_data_rank=None)))
    return model


def _train(model, opt, steps) -> None:
    from torch.distributed.tensor import distribute_tensor

    for t in steps:
        for p, g in zip(model.parameters(), full_tensors(list(SHAPES.values()), 100 + t)):
            p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)
        opt.step()


def _full_state(opt, model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    names = {id(p): k for k, p in model.named_parameters()}
    return {f"{names[id(p)]}.{key}": (v.full_tensor() if isinstance(v, DTensor) else v).clone()
            for p, state in opt.state.items() for key, v in state.items() if isinstance(v, torch.Tensor)}


def _save_body(rank, world, make_opt, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    model = _model(init_device_mesh("cpu", (2,)), ("S0",), seed=0)
    opt = make_opt(list(model.parameters()))
    _train(model, opt, (1, 2))
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return _full_state(opt, model)


def _load_body(rank, world, make_opt, names, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    model = _model(init_device_mesh("cpu", (2, 2)), names, seed=1)  # other weights, to be overwritten
    opt = make_opt(list(model.parameters()))
    model_sd, optim_sd = get_state_dict(model, opt)  # initialises the state to load into
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = _full_state(opt, model)
    _train(model, opt, (3, 4))
    # the uninterrupted run on one device
    ref = [torch.nn.Parameter(f) for f in full_tensors(list(SHAPES.values()), 0)]
    ref_opt = make_opt(ref)
    for t in (1, 2, 3, 4):
        for q, g in zip(ref, full_tensors(list(SHAPES.values()), 100 + t)):
            q.grad = g
        ref_opt.step()
    return loaded, [p.full_tensor().detach() for p in model.parameters()], [q.detach() for q in ref]


LOAD_PLACEMENTS = (("S0", "S1"), ("R", "S1"))


def _load_each(rank, world, make_opt, path):
    """Both placements' loads, one after the other in the same 4 ranks (one launch)."""
    return [_load_body(rank, world, make_opt, names, path) for names in LOAD_PLACEMENTS]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_checkpoint_from_2_ranks_resumes_on_a_2x2_mesh_under_other_placements(name, tmp_path):
    make_opt = OPTIMIZERS[name]
    path = str(tmp_path / "ckpt")
    saved = run_local(_save_body, 2, make_opt, path, timeout=TIMEOUT)[0]
    assert any(k.endswith(("exp_avg", "row_var", "exp_avg_sq_row")) for k in saved), sorted(saved)
    per_rank = run_local(_load_each, 4, make_opt, path, timeout=TIMEOUT)
    for i, names in enumerate(LOAD_PLACEMENTS):
        for rank, (loaded, params, ref) in enumerate(ranks[i] for ranks in per_rank):
            assert set(loaded) == set(saved), (names, sorted(set(loaded) ^ set(saved)))
            wrong = [k for k, v in saved.items() if not torch.equal(loaded[k], v)]
            assert not wrong, f"{names} rank {rank}: state not restored exactly: {wrong}"
            for key, got, want in zip(SHAPES, params, ref):
                torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"{names} rank {rank} {key}: {m}")
