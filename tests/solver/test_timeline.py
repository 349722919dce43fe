"""The one evaluator: per-point activations by hand, with and without recompute, kept inputs
counted once, and the bytes saved when the forward pass ends."""

import pytest

from autopar.solver.problem import Node, Problem, StrategyOption
from autopar.solver.timeline import SegmentInput, activation_bytes, evaluate


def _problem() -> Problem:
    """A user input ``x`` held all step and one block of two segments (``a``, ``b``) plus a loss,
    on 8 timeline points (op ``i`` lives on ``[i, 7 - i]``)."""
    def op(name, act, live, segment=None, forward_s=0.0):
        return Node(name, (StrategyOption("o", 1.0, param_bytes=3, act_bytes=act, forward_s=forward_s),),
                    live=live, block="blk.0" if segment else None, segment=segment)

    return Problem((op("x", 7, (0, 7)), op("a", 100, (1, 6), "blk.0.a", 0.25), op("b", 50, (2, 5), "blk.0.b", 0.5),
                    op("loss", 10, (3, 4))), (), None, 8)


CHOICE = {"x": "o", "a": "o", "b": "o", "loss": "o"}


def test_plain_timeline_by_hand():
    ev = _problem().evaluate(CHOICE)
    assert ev.activations == (7, 107, 157, 167, 167, 157, 107, 7)
    assert (ev.param_bytes, ev.peak_bytes, ev.peak_time) == (12, 179, 3)
    assert ev.objective == ev.compute_s == 4.0


@pytest.mark.parametrize("units, inputs, want, extra_s", [
    # the block: both activations come back at its backward (point 5), nothing kept
    (["blk.0"], {}, (7, 7, 7, 17, 17, 157, 107, 7), 0.75),
    # segment b alone, keeping a's output on b's span [2, 5]
    (["blk.0.b"], {"blk.0.b": (SegmentInput("a", (100,)),)}, (7, 107, 207, 217, 217, 257, 107, 7), 0.5),
    # both segments keep x: one tensor, held once from a's start to a's end
    (["blk.0.a", "blk.0.b"], {u: (SegmentInput("x", (7,)),) for u in ("blk.0.a", "blk.0.b")},
     (7, 14, 14, 24, 24, 64, 114, 7), 0.75),
])
def test_recompute_timeline_by_hand(units, inputs, want, extra_s):
    p = _problem()
    ev = p.evaluate(CHOICE, recompute=units, segment_inputs=inputs)
    assert ev.activations == want
    assert ev.peak_bytes == 12 + max(want) and ev.peak_time == want.index(max(want))
    assert ev.compute_s == ev.objective == 4.0 + extra_s
    assert ev == evaluate(p, CHOICE, recompute=units, segment_inputs=inputs)


def test_activation_bytes_at_the_end_of_forward():
    p = _problem()  # the forward pass ends at point 3
    assert activation_bytes(p, CHOICE, include_inputs=True) == 167
    assert activation_bytes(p, CHOICE) == 160  # x, live all step, is the caller's
    assert activation_bytes(p, CHOICE, recompute=["blk.0"]) == 10


def test_bad_choice_and_units_are_value_errors():
    p = _problem()
    with pytest.raises(ValueError, match="missing \\['loss'\\], unknown \\['y'\\]"):
        p.evaluate({"x": "o", "a": "o", "b": "o", "y": "o"})
    with pytest.raises(ValueError, match="unknown segments \\['blk.1'\\]"):
        p.evaluate(CHOICE, recompute=["blk.1"])
    with pytest.raises(ValueError, match="both alone and inside their block"):
        p.evaluate(CHOICE, recompute=["blk.0", "blk.0.a"])

