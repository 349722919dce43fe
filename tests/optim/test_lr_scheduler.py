"""``autopar.optim.lr_scheduler.LinearWarmupLR``: Colossal-AI's linear warm-up then linear decay
(``colossalai/nn/lr_scheduler/linear.py``), stepping, saving and loading as a torch scheduler."""

from __future__ import annotations

import pytest
import torch

from autopar.optim.lr_scheduler import LinearWarmupLR


def _optimizer(lrs=(0.1, 0.3)) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.ones(2)) for _ in lrs]
    return torch.optim.SGD([{"params": [p], "lr": lr} for p, lr in zip(params, lrs)])


def _run(scheduler, steps: int) -> list[list[float]]:
    seen = [scheduler.get_last_lr()]
    for _ in range(steps):
        scheduler.optimizer.step()
        scheduler.step()
        seen.append(scheduler.get_last_lr())
    return seen


def test_warmup_then_decay_to_zero_per_group():
    # Colossal-AI's formula, by hand, for warmup_steps=3 and total_steps=7: (e+1)/4 while e < 3,
    # then (7-e)/4, then 0 where the formula would go negative.
    expected = [1 / 4, 2 / 4, 3 / 4, 4 / 4, 3 / 4, 2 / 4, 1 / 4, 0, 0, 0]
    seen = _run(LinearWarmupLR(_optimizer(), total_steps=7, warmup_steps=3), len(expected) - 1)
    for factor, (a, b) in zip(expected, seen):
        assert (a, b) == (pytest.approx(0.1 * factor), pytest.approx(0.3 * factor))


def test_the_optimizer_steps_with_the_scheduled_rate():
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    sched = LinearWarmupLR(opt, total_steps=4, warmup_steps=1)  # rates 1/2, 1, 2/3, 1/3, 0
    for _ in range(5):
        param.grad = torch.ones(1)
        opt.step()
        sched.step()
    assert param.item() == pytest.approx(-(1 / 2 + 1 + 2 / 3 + 1 / 3))


def test_no_warmup_and_the_notes_arguments():
    seen = _run(LinearWarmupLR(_optimizer((1.0,)), total_steps=4), 5)
    assert [s[0] for s in seen] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0, 0.0])
    # The notes' AMP page: warmup_steps=50, total_steps=NUM_EPOCHS=2 -- warm-up as Colossal-AI's
    # (positional order total_steps, warmup_steps as theirs; extra keywords accepted as their **kwargs).
    notes = LinearWarmupLR(_optimizer((1.0,)), warmup_steps=50, total_steps=2, verbose_unused=True)
    assert [s[0] for s in _run(notes, 3)] == pytest.approx([1 / 51, 2 / 51, 3 / 51, 4 / 51])
    ended = LinearWarmupLR(_optimizer((1.0,)), 2, 2)  # decay has no room: 0 after warm-up, no division by zero
    assert [s[0] for s in _run(ended, 3)] == pytest.approx([1 / 3, 2 / 3, 0.0, 0.0])


def test_state_dict_resumes_the_schedule():
    first = LinearWarmupLR(_optimizer(), total_steps=9, warmup_steps=4)
    _run(first, 3)
    state = first.state_dict()
    assert (state["warmup_steps"], state["total_steps"], state["last_epoch"]) == (4, 9, 3)
    resumed = LinearWarmupLR(_optimizer(), total_steps=9, warmup_steps=4)
    resumed.load_state_dict(state)
    assert _run(resumed, 4) == _run(first, 4)


@pytest.mark.parametrize("kwargs, name", [(dict(total_steps=0), "total_steps"), (dict(total_steps=2.5), "total_steps"),
                                          (dict(total_steps=5, warmup_steps=-1), "warmup_steps"),
                                          (dict(total_steps=5, warmup_steps=True), "warmup_steps")])
def test_bad_arguments_raise_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        LinearWarmupLR(_optimizer(), **kwargs)
