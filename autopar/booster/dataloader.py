"""The Booster's data loader: one global batch order on every rank, each rank loading its piece.

``GlobalBatchSampler`` yields the sample indices of each global batch (seeded, identical on
every rank). ``configure_for(module)`` (called by ``Booster.boost``) reads the plan's input
layouts: when every tensor input is split along dim 0 only, all by the same mesh axes
(:func:`batch_split`), the sampler yields only this rank's positions of each global batch, so
the loader reads and collates just those samples; otherwise it keeps yielding whole batches.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.utils._pytree as pytree
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from autopar.tracer.graph import keyword_path

if TYPE_CHECKING:
    from autopar.layout.placement import TensorSpec
    from autopar.runtime.module import AutoParallelModule

__all__ = [
    "GlobalBatchSampler", "make_dataloader", "batch_split", "input_shapes", "configure_for", "first_batch_inputs",
    "model_inputs",
]


class GlobalBatchSampler(Sampler[list[int]]):
    """Batches of ``batch_size`` indices of ``range(num_samples)`` in one order on every rank,
    optionally cut down to this rank's piece (``piece = (index, count)``: the ``index``-th of
    ``count`` equal contiguous slices of each batch)."""

    def __init__(self, num_samples: int, batch_size: int, *, shuffle: bool, seed: int, drop_last: bool) -> None:
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.piece: tuple[int, int] | None = None  # set by Booster.boost

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (the same order on every rank), like ``DistributedSampler``."""
        self.epoch = int(epoch)

    def global_batches(self) -> Iterator[list[int]]:
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_samples, generator=gen).tolist()
        else:
            order = list(range(self.num_samples))
        for start in range(0, self.num_samples, self.batch_size):
            batch = order[start:start + self.batch_size]
            if len(batch) < self.batch_size and self.drop_last:
                return
            yield batch

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.global_batches():
            if self.piece is None:
                yield batch
            else:
                index, count = self.piece
                # A short last batch (drop_last=False) is cut by the same proportions; the
                # model, planned for one batch shape, will refuse it with a shape error.
                yield batch[len(batch) * index // count:len(batch) * (index + 1) // count]

    def __len__(self) -> int:
        full, rest = divmod(self.num_samples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)


def make_dataloader(dataset: Dataset, batch_size: int, *, shuffle: bool = False, seed: int = 1024,
                    drop_last: bool = False, data_parallel: int = 1, **kwargs: Any) -> DataLoader:
    """See ``AutoParallelPlugin.prepare_dataloader``: ``batch_size`` samples per data-parallel
    rank, ``data_parallel`` of them, so each global batch holds ``batch_size * data_parallel``."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise ValueError(f"data_parallel must be an int >= 1, got {data_parallel!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    for name, value in (("shuffle", shuffle), ("drop_last", drop_last)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a bool, got {value!r}")
    taken = sorted(set(kwargs) & {"sampler", "batch_sampler", "batch_size", "shuffle", "drop_last"})
    if taken:
        raise ValueError(f"prepare_dataloader chooses the sampler itself; do not pass {taken}")
    try:
        if isinstance(dataset, IterableDataset):
            raise TypeError
        num_samples = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"prepare_dataloader needs a map-style dataset with __len__, got "
                         f"{type(dataset).__name__}") from None
    sampler = GlobalBatchSampler(num_samples, batch_size * data_parallel, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
    return DataLoader(dataset, batch_sampler=sampler, **kwargs)


def batch_split(specs: dict[str, TensorSpec | None], shapes: dict[str, tuple[int, ...]], batch_size: int,
                mesh_shape: tuple[int, ...], coordinate: tuple[int, ...]) -> tuple[int, int] | None:
    """``(index, count)`` of this rank's slice of the batch when every tensor input (``shapes``:
    FQN -> global shape) has ``batch_size`` as its first dim and a layout in ``specs`` that
    splits dim 0 only, all by the same mesh axes (``count`` 1: no input is split); None when
    some input is laid out otherwise, has no layout, or is not batched along dim 0."""
    if any(specs.get(fqn) is None or not shape or shape[0] != batch_size for fqn, shape in shapes.items()):
        return None
    used = [specs[fqn] for fqn in shapes]
    axes = {spec.shard_axes(0) for spec in used}
    if len(axes) != 1 or any(set(spec.sharded_dims()) - {0} for spec in used):
        return None
    index, count = 0, 1
    for axis in axes.pop():  # mixed radix, major axis first (TensorSpec.local_slices)
        index = index * mesh_shape[axis] + coordinate[axis]
        count *= mesh_shape[axis]
    return index, count


def input_shapes(forward: Any, args: tuple, kwargs: dict) -> dict[str, tuple[int, ...]]:
    """Input FQN (as the tracer names it: ``input_ids``, ``x['a'][0]``) -> shape of every tensor
    among the arguments of a call of ``forward``."""
    bound = inspect.signature(forward).bind(*args, **kwargs)
    leaves = pytree.tree_flatten_with_path(dict(bound.arguments))[0]
    return {keyword_path(path): tuple(v.shape) for path, v in leaves if isinstance(v, torch.Tensor)}


def configure_for(loader: DataLoader, module: AutoParallelModule, shapes: dict[str, tuple[int, ...]]) -> bool:
    """Cut ``loader``'s batches to this rank's piece when ``module``'s input layouts allow it
    (:func:`batch_split`); True when they do. ``shapes``: :func:`input_shapes` of a global batch."""
    sampler = loader.batch_sampler
    assert isinstance(sampler, GlobalBatchSampler), "only loaders from prepare_dataloader are configured"
    piece = batch_split(dict(module.input_specs), shapes, sampler.batch_size, module.pmesh.shape,
                        module.pmesh.coordinate)
    sampler.piece = None if piece is None or piece[1] == 1 else piece
    return piece is not None


def first_batch_inputs(loader: Any, forward: Any = None) -> tuple[tuple | dict, int]:
    """The model's inputs (``autoparallelize``'s ``meta_inputs``) from ``loader``'s first batch,
    and how many of the batch's elements are NOT the model's (the criterion's targets): see
    :func:`model_inputs`."""
    try:
        batch = next(iter(loader))
    except StopIteration:
        raise ValueError("the dataloader is empty: no first batch to take the meta inputs from") from None
    return model_inputs(batch, forward)


def model_inputs(batch: Any, forward: Any = None) -> tuple[tuple | dict, int]:
    """``(inputs, targets)``: a dict batch is the model's keyword arguments; anything else but a
    tuple/list is its one argument. A tuple/list is positional arguments: all of them when
    ``forward`` is None (no criterion: the model computes its own loss), else -- the notes'
    ``output = model(img); loss = criterion(output, label)`` over ``(img, label)`` batches --
    the leading elements ``forward`` requires (its positional parameters without a default, at
    least one; all with ``*args``), the other ``targets`` elements being the criterion's."""
    if isinstance(batch, dict):
        return dict(batch), 0
    if not isinstance(batch, (tuple, list)):
        return (batch,), 0
    batch = tuple(batch)
    if forward is None:
        return batch, 0
    params = inspect.signature(forward).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return batch, 0
    required = sum(1 for p in params if p.default is inspect.Parameter.empty
                   and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD))
    n = min(len(batch), max(1, required))
    return batch[:n], len(batch) - n
