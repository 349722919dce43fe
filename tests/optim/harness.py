"""Shared drivers of the optimizer tests: a single-device run of an optimizer against a reference
step function, and the same optimizer on DTensor parameters on a gloo mesh (forked ranks)
against itself on the full tensors, with the collectives of each step counted.

Placements are written as strings ("S0", "S1", "R") so parameter specs stay plain data.
"""

from __future__ import annotations

from typing import Callable

import torch
# Imported here, in the parent, so that forked ranks inherit them: importing DTensor in each of
# 8 ranks sharing 2 cores costs seconds.
import torch.distributed.device_mesh  # noqa: F401
import torch.distributed.tensor  # noqa: F401
import torch.distributed.tensor.debug  # noqa: F401

from autopar.runtime.launch import run_local

TIMEOUT = 120  # seconds per multi-process run: a rank that skips a collective hangs
STEPS = 5
RTOL, ATOL = 1e-5, 1e-6

# (shape, placements): uneven shards (7 on 2 or 4 ranks), nested (S0, S0), every dim of a
# 3-D tensor, both orientations of the 2-D matrices (GaLore projects the smaller side).
SPECS_1D = [
    ((7,), ("S0",)), ((8, 6), ("S0",)), ((5, 9), ("S0",)), ((6, 7), ("S1",)), ((9, 4), ("S1",)),
    ((3, 5, 4), ("S2",)), ((2, 6, 4), ("S1",)), ((4, 6, 3), ("S0",)), ((4, 6), ("R",)), ((5,), ("R",)),
]
SPECS_2D = [
    ((6, 5), ("S0", "S1")), ((5, 8), ("S0", "S1")), ((9, 4), ("S0", "S0")), ((7,), ("S0", "S0")),
    ((4, 9), ("S0", "S0")), ((4, 6), ("R", "S1")), ((7, 5), ("R", "S1")), ((3, 8), ("S1", "R")),
    ((8, 3), ("S1", "R")), ((2, 6, 5), ("S1", "S2")), ((3, 4, 5), ("S0", "S2")), ((6,), ("R", "R")),
]


def full_tensors(shapes, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in shapes]


def run_single(make_opt: Callable, reference_step: Callable, shapes, *, steps: int = STEPS) -> None:
    """``make_opt(params)`` vs ``reference_step(params, grads, state, t)`` (plain tensors, in
    place) for ``steps`` steps on the same gradients; every parameter within RTOL."""
    params = [torch.nn.Parameter(t) for t in full_tensors(shapes, 0)]
    ref = [t.clone() for t in full_tensors(shapes, 0)]
    opt, state = make_opt(params), {}
    for t in range(1, steps + 1):
        grads = full_tensors(shapes, 100 + t)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        reference_step(ref, grads, state, t)
    for shape, p, r in zip(shapes, params, ref):
        torch.testing.assert_close(p.detach(), r, rtol=RTOL, atol=ATOL, msg=lambda m: f"{shape}: {m}")
        assert not torch.equal(p.detach(), full_tensors([shape], 0)[0]), f"{shape} never moved"


def _placements(names):
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if n == "R" else Shard(int(n[1:])) for n in names]


def _dist_body(rank, world, mesh_shape, make_opt, specs, steps):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    from autopar.optim._dist import layout_of, local_range

    mesh = init_device_mesh("cpu", mesh_shape)
    shapes = [s for s, _ in specs]
    places = [_placements(p) for _, p in specs]
    # Two distributed copies: the specs once and twice over, to show the collective count per
    # step does not grow with the number of parameters.
    runs = []
    for copies in (1, 2):
        full = full_tensors(shapes, 0) * copies
        # clone: a Replicate DTensor may share its source's storage. src_data_rank=None: every
        # rank holds the same full tensor, so skip the scatter (0.25 s a call on 8 ranks here)
        dparams = [torch.nn.Parameter(distribute_tensor(f.clone(), mesh, pl, src_data_rank=None))
                   for f, pl in zip(full, places * copies)]
        runs.append((dparams, make_opt(dparams), places * copies))
    ref = [torch.nn.Parameter(f) for f in full_tensors(shapes, 0)]
    ref_opt = make_opt(ref)
    counts = []  # per step: [counts of the 1x run, counts of the 2x run]
    for t in range(1, steps + 1):
        grads = full_tensors(shapes, 100 + t)
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        ref_opt.step()
        step_counts = []
        for dparams, opt, pls in runs:
            for p, g, pl in zip(dparams, grads * (len(dparams) // len(grads)), pls):
                p.grad = distribute_tensor(g.clone(), mesh, pl, src_data_rank=None)
            with CommDebugMode() as comm:
                opt.step()
            step_counts.append({str(k): v for k, v in comm.get_comm_counts().items()})
        counts.append(step_counts)
    # Every rank's local block (replicas included) equals its slice of the reference.
    errors = []
    for dparams, _, _ in runs:
        for i, p in enumerate(dparams):
            r = ref[i % len(ref)].detach()
            layout = layout_of(p)
            index = tuple(slice(*local_range(layout, n, d)) for d, n in enumerate(r.shape))
            try:
                torch.testing.assert_close(p.to_local().detach(), r[index], rtol=RTOL, atol=ATOL)
            except AssertionError as e:
                errors.append(f"rank {rank} param {i} {tuple(r.shape)} {specs[i % len(specs)][1]}: {e}")
    fulls = [p.full_tensor().detach() for p in runs[0][0]]
    return {"counts": counts, "errors": errors, "full": fulls, "ref": [p.detach() for p in ref]}


def run_distributed(make_opt: Callable, mesh_shape: tuple[int, ...], specs, *, steps: int = STEPS) -> list[dict]:
    """Every rank: the optimizer on DTensors equals it on full tensors; returns the per-step
    collective counts (rank 0), after checking they agree between 1x and 2x the parameters
    except on the steps listed by the caller's own assertions."""
    world = 1
    for n in mesh_shape:
        world *= n
    results = run_local(_dist_body, world, mesh_shape, make_opt, specs, steps, timeout=TIMEOUT)
    for res in results:
        assert res["errors"] == [], "\n".join(res["errors"])
        for (shape, pl), full, ref in zip(specs, res["full"], res["ref"]):
            torch.testing.assert_close(full, ref, rtol=RTOL, atol=ATOL, msg=lambda m: f"{shape} {pl}: {m}")
    return results[0]["counts"]


def all_reduces(counts: dict) -> int:
    return sum(v for k, v in counts.items() if "allreduce" in k or "all_reduce" in k)
