"""autopar.runtime.amp.GradScaler on real gloo processes: the overflow verdict is global.

- 2 ranks, DTensor parameters sharded Shard(0) (plus one Replicate, one plain and one unused
  parameter): inf/NaN injected into ONE rank's local gradient shard makes BOTH ranks skip the
  step (parameters bit-exact) and halve the scale; the next clean step applies on both, and a
  rank whose gradients are all None still takes part. The unscale issues exactly one
  collective (no DTensor dispatch, no per-tensor reduction).
- No overflow: scaler.step equals an unscaled optimizer step within fp32 rounding (also after
  an explicit unscale_ + clip_grad_norm_), and the scale grows after growth_interval clean steps.
- Plain tensors on a world-size-1 group, and in a process without any process group.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from autopar.runtime.amp import GradScaler
from autopar.runtime.launch import run_local

TIMEOUT = 120  # seconds per multi-process run: a rank that skips the collective hangs


def _dtensor_model(world: int) -> nn.ParameterDict:
    """Parameters: w1 and b1 Shard(0), w2 Replicate, plain ``scale`` (a tensor), ``unused``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)  # same full values on every rank
    full = {
        "w1": torch.randn(4 * world, 3, generator=gen),
        "b1": torch.randn(4 * world, generator=gen),
        "w2": torch.randn(2, 4 * world, generator=gen),
    }
    params = nn.ParameterDict({
        "w1": nn.Parameter(distribute_tensor(full["w1"], mesh, [Shard(0)])),
        "b1": nn.Parameter(distribute_tensor(full["b1"], mesh, [Shard(0)])),
        "w2": nn.Parameter(distribute_tensor(full["w2"], mesh, [Replicate()])),
        "unused": nn.Parameter(distribute_tensor(torch.ones(2 * world), mesh, [Shard(0)])),
    })
    params["scale"] = nn.Parameter(torch.tensor([1.5]))  # a plain tensor next to the DTensors
    return params


def _loss(params: nn.ParameterDict, step: int) -> torch.Tensor:
    """A loss on full tensors (full_tensor() is differentiable: grads come back as DTensors)."""
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(5, params["w1"].shape[1], generator=gen)
    h = torch.tanh(x @ params["w1"].full_tensor().T + params["b1"].full_tensor())
    out = h @ params["w2"].full_tensor().T * params["scale"]
    return (out ** 2).mean()


def _param_groups(params: nn.ParameterDict) -> list[dict]:
    """The plain parameter in its own group: foreach kernels must not mix it with DTensors."""
    return [{"params": [p for name, p in params.items() if name != "scale"]}, {"params": [params["scale"]]}]


def _locals(params: nn.ParameterDict) -> dict[str, torch.Tensor]:
    return {name: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for name, p in params.items()}


def _poison(params: nn.ParameterDict, value: float) -> None:
    """Write ``value`` into this rank's local shard of w1's gradient (DTensor grad, in place)."""
    grad = params["w1"].grad
    assert type(grad).__name__ == "DTensor" and grad.placements[0].is_shard()
    grad.to_local()[1, 2] = value


def _overflow_body(rank: int, world: int, bad_rank: int, value: float, drop_grads: bool) -> dict:
    from torch.distributed.tensor.debug import CommDebugMode

    params = _dtensor_model(world)
    opt = torch.optim.Adam(_param_groups(params), lr=0.01, foreach=True)
    scaler = GradScaler("cpu", init_scale=2.0**10, backoff_factor=0.5, growth_interval=100)

    scaler.scale(_loss(params, 0)).backward()
    assert params["unused"].grad is None
    if rank == bad_rank:
        _poison(params, value)
    elif drop_grads:
        opt.zero_grad(set_to_none=True)  # this rank checks nothing, yet must join the verdict
    before = _locals(params)

    calls = []
    all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append(tuple(tensor.shape))
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        with CommDebugMode() as comm:
            scaler.step(opt)
    finally:
        dist.all_reduce = all_reduce
    assert calls == [()], f"expected one all_reduce of the found-inf flag, got {calls}"
    assert comm.get_total_counts() == 1, comm.get_comm_counts()  # no DTensor collectives

    after = _locals(params)
    for name in before:  # skipped: bit-exact, and Adam's state never created
        assert torch.equal(before[name], after[name]), name
    assert len(opt.state) == 0
    scaler.update()
    assert scaler.get_scale() == 2.0**9, scaler.get_scale()

    # The next clean step applies everywhere (and never reuses the stale verdict).
    opt.zero_grad(set_to_none=True)
    scaler.scale(_loss(params, 1)).backward()
    scaler.step(opt)
    scaler.update()
    moved = _locals(params)
    for name in ("w1", "b1", "w2", "scale"):
        assert not torch.equal(after[name], moved[name]), name
    assert torch.equal(after["unused"], moved["unused"])  # no gradient: Adam leaves it alone
    assert scaler.get_scale() == 2.0**9
    full = {name: params[name].full_tensor() for name in ("w1", "b1", "w2")}
    return {"full": full, "scale": moved["scale"]}


@pytest.mark.parametrize(
    ("bad_rank", "value", "drop_grads"),
    [(1, math.inf, False), (0, math.nan, False), (1, -math.inf, True)],
    ids=["inf-on-rank1", "nan-on-rank0", "inf-other-rank-without-grads"],
)
def test_overflow_on_one_rank_skips_the_step_on_every_rank(bad_rank, value, drop_grads):
    results = run_local(_overflow_body, 2, bad_rank, value, drop_grads, timeout=TIMEOUT)
    # After the clean step the ranks agree (replicated parameters identical everywhere).
    for name, tensor in results[0]["full"].items():
        assert torch.equal(tensor, results[1]["full"][name]), name
    assert torch.equal(results[0]["scale"], results[1]["scale"])


def _clean_body(rank: int, world: int) -> dict:
    params = _dtensor_model(world)
    ref = copy.deepcopy(params)
    opt = torch.optim.SGD(_param_groups(params), lr=0.05, momentum=0.9, foreach=True)
    ref_opt = torch.optim.SGD(_param_groups(ref), lr=0.05, momentum=0.9, foreach=True)
    # 1000 is not a power of two, so unscaling really rounds; growth after 3 clean steps.
    scaler = GradScaler("cpu", init_scale=1000.0, growth_factor=2.0, growth_interval=3)
    scales = []
    worst = 0.0
    for step in range(4):
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        scaler.scale(_loss(params, step)).backward()
        _loss(ref, step).backward()
        assert type(params["w1"].grad).__name__ == "DTensor"
        if step == 1:  # unscale_ first (to clip), then step: one verdict, taken by unscale_
            scaler.unscale_(opt)
            dtensors = [p for name, p in params.items() if name != "scale"]
            norm = torch.nn.utils.clip_grad_norm_(dtensors, max_norm=1e9).full_tensor()
            ref_norm = torch.nn.utils.clip_grad_norm_([p for name, p in ref.items() if name != "scale"], 1e9)
            torch.testing.assert_close(norm, ref_norm.full_tensor(), rtol=1e-5, atol=0)
        assert scaler.step(opt) is None  # SGD.step returns None; the step was taken
        ref_opt.step()
        scaler.update()
        scales.append(scaler.get_scale())
        got, want = _locals(params), _locals(ref)
        for name in got:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)
            worst = max(worst, (got[name] - want[name]).abs().max().item())
    assert scales == [1000.0, 1000.0, 2000.0, 2000.0], scales
    return worst


def test_clean_steps_match_an_unscaled_step_and_the_scale_grows():
    worst = run_local(_clean_body, 2, timeout=TIMEOUT)
    assert all(w < 1e-6 for w in worst), worst


def _plain_run(poison: bool) -> tuple[list[float], list[list[torch.Tensor]]]:
    """A plain nn.Linear: one step with optional overflow, then one clean step."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=256.0, growth_interval=50)
    x = torch.randn(4, 3)
    snapshots, scales = [], []
    for step in range(2):
        opt.zero_grad()
        scaler.scale(model(x + step).square().mean()).backward()
        if poison and step == 0:
            model.bias.grad[0] = math.inf
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        snapshots.append([p.detach().clone() for p in model.parameters()])
    return scales, snapshots


def _plain_body(rank: int, world: int) -> tuple:
    assert dist.get_world_size() == 1
    return _plain_run(poison=True)


def _check_plain(scales, snapshots) -> None:
    torch.manual_seed(0)
    initial = [p.detach() for p in nn.Linear(3, 2).parameters()]
    assert scales == [128.0, 128.0], scales
    assert all(torch.equal(a, b) for a, b in zip(initial, snapshots[0]))  # skipped, bit-exact
    assert not any(torch.equal(a, b) for a, b in zip(initial, snapshots[1]))  # applied


def test_plain_tensors_on_a_world_size_one_group():
    (scales, snapshots), = run_local(_plain_body, 1, timeout=TIMEOUT)
    _check_plain(scales, snapshots)


def test_plain_tensors_without_a_process_group():
    assert not dist.is_initialized()
    scales, snapshots = _plain_run(poison=True)
    _check_plain(scales, snapshots)


def test_disabled_scaler_steps_plainly():
    model = nn.Linear(3, 2)
    scaler = GradScaler("cpu", enabled=False)
    loss = model(torch.ones(1, 3)).sum()
    assert scaler.scale(loss) is loss
    loss.backward()
    before = model.weight.detach().clone()
    scaler.step(torch.optim.SGD(model.parameters(), lr=0.1))
    assert not torch.equal(before, model.weight)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"growth_factor": 1.0}, "growth_factor must be > 1.0, got 1.0"),
        ({"backoff_factor": 1.5}, "backoff_factor must be in \\(0, 1\\), got 1.5"),
        ({"growth_interval": 0}, "growth_interval must be an int >= 1, got 0"),
        ({"init_scale": -2.0}, "init_scale must be > 0, got -2.0"),
    ],
)
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GradScaler("cpu", **kwargs)


def test_arguments_after_device_are_keyword_only():
    with pytest.raises(TypeError):
        GradScaler("cpu", None)  # type: ignore[misc]


def _scales(scaler, overflows: list[bool]) -> list[float]:
    """The scale after each step of a one-process run; ``True`` puts an inf into a gradient."""
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for bad in overflows:
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        if bad:
            model.weight.grad[0, 0] = math.inf
        before = model.weight.detach().clone()
        scaler.step(opt)
        scaler.update()
        assert torch.equal(before, model.weight) == bad  # an overflowed step is skipped, whatever the rule
        opt.zero_grad()
        out.append(scaler.get_scale())
    return out


def test_colossal_hysteresis_backs_off_at_the_hysteresis_th_overflow_since_growth():
    scaler = GradScaler("cpu", init_scale=16.0, growth_interval=2, hysteresis=2)
    # 1st overflow: skipped only; 2nd, 3rd: halved; two clean steps grow it and reset the count
    assert _scales(scaler, [True, True, True, False, False, True, True]) == [16, 8, 4, 4, 8, 8, 4]


def test_scale_bounds_clamp_backoff_and_growth():
    scaler = GradScaler("cpu", init_scale=4.0, growth_interval=1, min_scale=2.0, max_scale=8.0)
    assert _scales(scaler, [True, True, False, False, False]) == [2, 2, 4, 8, 8]


def test_default_rule_is_torchs():
    pattern = [False, True, False, False, False, True, True, False]
    ours = _scales(GradScaler("cpu", init_scale=64.0, growth_interval=2), pattern)
    assert ours == _scales(torch.amp.GradScaler("cpu", init_scale=64.0, growth_interval=2), pattern)


def test_hysteresis_count_is_in_the_state_dict():
    scaler = GradScaler("cpu", init_scale=16.0, growth_interval=100, hysteresis=2)
    _scales(scaler, [True])  # one overflow seen: the next one backs off
    state = scaler.state_dict()
    assert state["_hysteresis_step"] == 1
    resumed = GradScaler("cpu", init_scale=1.0, growth_interval=100, hysteresis=2)
    resumed.load_state_dict(state)
    assert _scales(resumed, [True]) == [8.0]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"hysteresis": 0}, "hysteresis must be an int >= 1, got 0"), ({"min_scale": 0}, "min_scale must be None or"),
    ({"max_scale": -1.0}, "max_scale must be None or"), ({"min_scale": 4.0, "max_scale": 2.0}, "must not exceed")])
def test_bad_colossal_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GradScaler("cpu", **kwargs)
