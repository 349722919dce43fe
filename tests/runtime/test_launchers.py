"""The notes' launchers (``autopar.launch`` / ``launch_from_torch``), ``get_default_parser`` and
``priority_execution``; and the notes' ``CosineAnnealingLR(optimizer, total_steps=...)``."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

import autopar
from autopar.runtime.launch import free_port, get_default_parser, priority_execution, run_local

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_launch_joins_a_new_group_from_torchrun_variables():
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    code = ("import torch, torch.distributed as dist, autopar\n"
            "autopar.launch_from_torch(config=dict(), verbose=False)\n"
            "print(dist.get_world_size(), dist.get_backend(), torch.initial_seed())\n"
            "dist.destroy_process_group()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "gloo", "1024"]


def test_launch_refusals(monkeypatch):
    for name in ("RANK", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=r"launch_from_torch: environment variables \['RANK'.*'MASTER_PORT'\]"):
        autopar.launch_from_torch(config=dict())
    with pytest.raises(NotImplementedError, match="legacy config"):
        autopar.launch(config={"parallel": {"tensor": {"size": 2}}})
    with pytest.raises(ValueError, match=r"rank 2 is not in range\(world_size=2\)"):
        autopar.launch(rank=2, world_size=2)


def _in_group(rank, world, path):
    autopar.launch(config=dict(), rank=rank, world_size=world, verbose=False)  # the group exists: kept
    try:
        autopar.launch(rank=1 - rank, world_size=world)
        wrong = None
    except ValueError as exc:
        wrong = str(exc)
    with priority_execution():  # rank 0 first: the others find its file
        if rank == 0:
            pathlib.Path(path).write_text("cached")
        seen = pathlib.Path(path).read_text()
    return wrong, seen, torch.initial_seed()


def test_launch_keeps_an_existing_group_and_priority_execution_orders_ranks(tmp_path):
    for rank, (wrong, seen, seed) in enumerate(run_local(_in_group, 2, str(tmp_path / "data"), timeout=60)):
        assert f"already rank {rank} of 2, not rank {1 - rank} of 2" in wrong
        assert seen == "cached" and seed == 1024


def test_default_parser_reads_the_launch_arguments():
    args = get_default_parser().parse_args(["--rank", "1", "--world_size", "2", "--port", "29501"])
    assert (args.rank, args.world_size, args.port, args.host, args.backend) == (1, 2, 29501, None, None)


def test_cosine_annealing_lr_is_torchs_over_total_steps():
    from autopar.optim.lr_scheduler import CosineAnnealingLR

    ours = CosineAnnealingLR(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1), total_steps=4)
    theirs = torch.optim.lr_scheduler.CosineAnnealingLR(
        torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1), T_max=4)
    lrs = []
    for _ in range(6):
        ours.optimizer.step()
        theirs.optimizer.step()
        ours.step()
        theirs.step()
        lrs.append((ours.get_last_lr()[0], theirs.get_last_lr()[0]))
    assert all(a == pytest.approx(b) for a, b in lrs) and lrs[3][0] == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="total_steps must be an int >= 1"):
        CosineAnnealingLR(ours.optimizer, total_steps=0)
