"""The micro-batch rule (autopar.tracer.microbatch): the planner traces what the runtime runs.

A batch-major input (dim 0 = the batch, the first tensor's dim 0) is cut along dim 0; any
other input -- a ``(seq,)`` positions tensor, a scalar, a non-tensor -- is whole in every
micro-batch, for the planner's traced micro-batch and the runtime's split alike.
"""

from __future__ import annotations

import pytest
import torch

from autopar.planner.pipeline.geometry import micro_inputs
from autopar.tracer.microbatch import batch_size, is_batch_major, micro_batch, split_micro_batches

B, S = 8, 6


def _inputs():
    return {"input_ids": torch.arange(B * S).reshape(B, S), "positions": torch.arange(S),
            "scale": torch.tensor(2.0), "labels": torch.arange(B * S).reshape(B, S) + 1, "flag": True}


def test_batch_is_the_first_tensors_dim0_and_only_batch_major_tensors_are_cut():
    inputs = _inputs()
    assert batch_size(inputs) == B
    assert [k for k, v in inputs.items() if is_batch_major(v, B)] == ["input_ids", "labels"]
    micro = micro_batch(inputs, 4)
    assert micro["input_ids"].shape == (2, S) and torch.equal(micro["input_ids"], inputs["input_ids"][:2])
    assert micro["positions"] is inputs["positions"] and micro["scale"] is inputs["scale"] and micro["flag"] is True
    # The planner's micro_inputs is this rule.
    planned = micro_inputs(inputs, 4)
    assert all(planned[k] is micro[k] or torch.equal(planned[k], micro[k]) for k in inputs)


def test_split_gives_every_micro_batch_the_whole_non_batch_major_inputs():
    inputs = _inputs()
    pieces = split_micro_batches(inputs, 4)
    assert len(pieces) == 4
    for i, piece in enumerate(pieces):
        assert torch.equal(piece["input_ids"], inputs["input_ids"][2 * i:2 * i + 2])
        assert torch.equal(piece["labels"], inputs["labels"][2 * i:2 * i + 2])
        assert piece["positions"] is inputs["positions"] and piece["scale"] is inputs["scale"]
    # The traced micro-batch is the first of the run's micro-batches, input by input.
    first = micro_batch(inputs, 4)
    assert all(torch.equal(first[k], pieces[0][k]) if isinstance(first[k], torch.Tensor) else first[k] == pieces[0][k]
               for k in inputs)
    # Positional inputs: the tuple's order decides the batch.
    args = (inputs["positions"], inputs["input_ids"])
    assert batch_size(args) == S
    assert [tuple(t.shape) for t in micro_batch(args, 2)] == [(S // 2,), (B, S)]


def test_bad_counts_and_inputs_without_a_batch_are_refused():
    with pytest.raises(ValueError, match="microbatches=3 does not divide the batch of 8"):
        micro_batch(_inputs(), 3)
    with pytest.raises(ValueError, match="microbatches=3 does not divide the batch of 8"):
        split_micro_batches(_inputs(), 3)
    with pytest.raises(ValueError, match="no tensor with a batch dim"):
        batch_size({"scale": torch.tensor(1.0), "flag": True})
