"""Placements and ``TensorSpec``: how one tensor lies on a device mesh.

A ``TensorSpec`` holds one placement per *mesh axis*:

- ``Shard(dim)``  -- the tensor's ``dim`` is split evenly over the axis (string ``S(dim)``),
- ``Shard(dim, segments=k)`` -- the ``dim`` is cut into ``k`` equal segments and EACH segment is
  split evenly over the axis (string ``S(dim/k)``): coordinate ``r`` holds ``[seg0_r | seg1_r |
  ...]``. A fused projection's output (GPT-2's ``c_attn``: ``q|k|v`` on the last dim) split this
  way gives every rank its heads of q, k and v alike (Megatron's and Colossal-AI's
  ``n_fused=3``); DTensor's ``_StridedShard(dim, split_factor=k)`` is the same layout. A
  segmented dim is sharded by that one mesh axis only (``validate`` refuses more),
- ``Replicate()`` -- every device on the axis holds the whole value (``R``),
- ``Partial()``   -- every device holds a summand; the value is the sum over the axis (``P``).

String form (documented contract, used in plans and strategy names): one token per mesh axis,
concatenated, with ``S<dim>`` for shards. On a 2-D mesh ``"S0R"`` shards dim 0 over axis 0 and
replicates over axis 1; ``"S0S0"`` shards dim 0 over both axes (axis 0 major, like DTensor);
``"S0S1"`` shards dim 0 over axis 0 and dim 1 over axis 1. The parser also accepts ``S(0)``
tokens and commas (``"S(0),R"``); dims >= 10 print as ``S(10)`` so the form stays unambiguous. A
segmented shard prints as ``S(2/3)`` (dim 2, 3 segments) in both forms.

Everything here is device-free: shapes in, shapes out. A dim that does not divide evenly is never
silently sharded -- ``ValueError`` names the shape, the dim and the axis sizes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Sequence, Union

__all__ = [
    "Shard",
    "Replicate",
    "Partial",
    "Placement",
    "TensorSpec",
    "parse_placement",
    "R",
    "P",
    "zero_split",
]


@dataclass(frozen=True, slots=True)
class Shard:
    dim: int
    # 1: the dim is split into contiguous chunks; k > 1: each of its k equal segments is (module doc).
    segments: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or self.dim < 0:
            raise ValueError(f"Shard dim must be a non-negative int, got {self.dim!r}")
        if isinstance(self.segments, bool) or not isinstance(self.segments, int) or self.segments < 1:
            raise ValueError(f"Shard segments must be a positive int, got {self.segments!r}")

    def __str__(self) -> str:
        return f"S({self.dim})" if self.segments == 1 else f"S({self.dim}/{self.segments})"

    @property
    def compact(self) -> str:
        if self.segments > 1:
            return str(self)
        return f"S{self.dim}" if self.dim < 10 else f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate:
    def __str__(self) -> str:
        return "R"

    @property
    def compact(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Partial:
    """A pending sum over the mesh axis (the only reduction autopar's layouts carry)."""

    def __str__(self) -> str:
        return "P"

    @property
    def compact(self) -> str:
        return "P"


Placement = Union[Shard, Replicate, Partial]
R = Replicate()
P = Partial()

_TOKEN = re.compile(r"\s*(?:S\((\d+)(?:/(\d+))?\)|S(\d)|(R)|(P))\s*,?")


def parse_placement(text: str) -> Placement:
    """Parse one placement token: ``S(0)``, ``S0``, ``S(2/3)``, ``R`` or ``P``."""
    spec = TensorSpec.parse(text)
    if len(spec.placements) != 1:
        raise ValueError(f"expected one placement, got {text!r}")
    return spec.placements[0]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One placement per mesh axis. Immutable and hashable; usable as a dict key."""

    placements: tuple[Placement, ...]
    # The compact string, computed once: specs are printed and used as keys in hot loops.
    _text: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.placements, tuple):
            object.__setattr__(self, "placements", tuple(self.placements))
        for p in self.placements:
            if not isinstance(p, (Shard, Replicate, Partial)):
                raise ValueError(f"not a placement: {p!r} in {self.placements!r}")
        object.__setattr__(self, "_text", "".join(p.compact for p in self.placements))

    # ----------------------------------------------------------------- construction / printing
    @classmethod
    def parse(cls, text: str) -> "TensorSpec":
        """Parse ``"S0R"``, ``"S(0)R"``, ``"S(0),R"``, ``"RR"``, ``"P"``, ``"S(12)S1"``, ``"RS(1/3)"``."""
        if isinstance(text, TensorSpec):
            return text
        pos, out = 0, []
        src = text.strip()
        while pos < len(src):
            m = _TOKEN.match(src, pos)
            if m is None or m.end() == pos:
                raise ValueError(
                    f"cannot parse tensor spec {text!r} at position {pos}: expected S<dim>, "
                    f"S(<dim>), S(<dim>/<segments>), R or P per mesh axis"
                )
            big, segments, small, rep, par = m.groups()
            if big is not None or small is not None:
                out.append(Shard(int(big if big is not None else small), int(segments or 1)))
            elif rep:
                out.append(R)
            else:
                out.append(P)
            pos = m.end()
        if not out:
            raise ValueError(f"empty tensor spec {text!r}")
        return cls(tuple(out))

    @classmethod
    def replicated(cls, num_axes: int) -> "TensorSpec":
        return cls((R,) * num_axes)

    def __str__(self) -> str:
        return self._text

    def __repr__(self) -> str:
        return f"TensorSpec({str(self)!r})"

    # ----------------------------------------------------------------------------- queries
    @property
    def num_axes(self) -> int:
        return len(self.placements)

    def is_replicated(self) -> bool:
        return all(isinstance(p, Replicate) for p in self.placements)

    def has_partial(self) -> bool:
        return any(isinstance(p, Partial) for p in self.placements)

    def partial_axes(self) -> tuple[int, ...]:
        return tuple(a for a, p in enumerate(self.placements) if isinstance(p, Partial))

    def shard_axes(self, dim: int) -> tuple[int, ...]:
        """Mesh axes that shard tensor ``dim``, major first (lower axis index is major)."""
        return tuple(
            a for a, p in enumerate(self.placements) if isinstance(p, Shard) and p.dim == dim
        )

    def sharded_dims(self) -> tuple[int, ...]:
        return tuple(sorted({p.dim for p in self.placements if isinstance(p, Shard)}))

    def segments(self, dim: int) -> int:
        """The segment count of tensor ``dim`` (1: not segmented or not sharded)."""
        return max((p.segments for p in self.placements if isinstance(p, Shard) and p.dim == dim), default=1)

    def is_segmented(self) -> bool:
        return any(isinstance(p, Shard) and p.segments > 1 for p in self.placements)

    def with_placement(self, axis: int, placement: Placement) -> "TensorSpec":
        ps = list(self.placements)
        ps[axis] = placement
        return TensorSpec(tuple(ps))

    # ----------------------------------------------------------------------------- shapes
    def num_shards(self, dim: int, mesh_shape: Sequence[int]) -> int:
        return math.prod(mesh_shape[a] for a in self.shard_axes(dim))

    def validate(self, global_shape: Sequence[int], mesh_shape: Sequence[int]) -> None:
        """Raise ``ValueError`` unless this spec can lay ``global_shape`` on ``mesh_shape``."""
        global_shape, mesh_shape = tuple(global_shape), tuple(mesh_shape)
        if len(mesh_shape) != self.num_axes:
            raise ValueError(
                f"spec {self} has {self.num_axes} placements but the mesh {mesh_shape} has "
                f"{len(mesh_shape)} axes"
            )
        for axis, p in enumerate(self.placements):
            if isinstance(p, Shard) and p.dim >= len(global_shape):
                raise ValueError(
                    f"spec {self} shards dim {p.dim} on mesh axis {axis}, but the tensor of shape "
                    f"{global_shape} has only {len(global_shape)} dims"
                )
        for dim in self.sharded_dims():
            n, k = self.num_shards(dim, mesh_shape), self.segments(dim)
            if k > 1 and len(self.shard_axes(dim)) > 1:
                # One axis per segmented dim: which axis would be the segment-major digit is
                # not defined, and no fused projection needs it.
                raise ValueError(
                    f"spec {self}: dim {dim} is segmented ({k} segments) and sharded by mesh axes "
                    f"{self.shard_axes(dim)}; a segmented dim is sharded by one mesh axis only"
                )
            if global_shape[dim] % (n * k) != 0:
                raise ValueError(
                    f"spec {self}: dim {dim} of shape {global_shape} has size {global_shape[dim]}, "
                    f"not divisible by {n * k} ({k} segment(s) x mesh axes {self.shard_axes(dim)} "
                    f"of mesh {mesh_shape})"
                )

    def is_valid(self, global_shape: Sequence[int], mesh_shape: Sequence[int]) -> bool:
        try:
            self.validate(global_shape, mesh_shape)
        except ValueError:
            return False
        return True

    def local_shape(self, global_shape: Sequence[int], mesh_shape: Sequence[int]) -> tuple[int, ...]:
        """Shape of each device's local piece (identical on every device: even splits only)."""
        self.validate(global_shape, mesh_shape)
        return tuple(
            size // self.num_shards(dim, mesh_shape) for dim, size in enumerate(global_shape)
        )

    def local_slices(
        self, global_shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int]
    ) -> tuple[slice, ...]:
        """Index of the device at mesh coordinate ``coord`` into the global tensor.

        For a dim sharded by several axes, the shard index is the mixed-radix number of the
        coordinates on those axes, major axis first (the lower axis index is the major digit).
        Partial and replicated axes do not select a slice. A segmented dim's piece is not one
        slice: ``ValueError`` (use ``local_index``).
        """
        if self.is_segmented():
            raise ValueError(f"spec {self} has a segmented shard: its local piece is not one slice per dim "
                             f"(use TensorSpec.local_index)")
        return self._slices(global_shape, mesh_shape, coord)

    def local_index(
        self, global_shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int]
    ) -> tuple[slice | tuple[int, ...], ...]:
        """Like ``local_slices``, except that a segmented dim gives the tuple of its global
        indices held at ``coord`` (``[seg0_r | seg1_r | ...]``, in local order): index the dims
        one at a time (two index lists in one subscript would be broadcast together)."""
        slices = self._slices(global_shape, mesh_shape, coord)
        out: list[slice | tuple[int, ...]] = []
        for dim, sl in enumerate(slices):
            k = self.segments(dim)
            if k == 1:
                out.append(sl)
                continue
            seg = global_shape[dim] // k
            chunk = sl.stop - sl.start  # the local size: k pieces of seg / n each
            piece, index = chunk // k, sl.start // k  # ``sl`` as if the shard were plain: start = r * chunk
            out.append(tuple(s * seg + index + i for s in range(k) for i in range(piece)))
        return tuple(out)

    def _slices(self, global_shape: Sequence[int], mesh_shape: Sequence[int],
                coord: Sequence[int]) -> tuple[slice, ...]:
        local = self.local_shape(global_shape, mesh_shape)
        out = []
        for dim, size in enumerate(local):
            index = 0
            for axis in self.shard_axes(dim):
                index = index * mesh_shape[axis] + coord[axis]
            out.append(slice(index * size, (index + 1) * size))
        return tuple(out)


def zero_split(spec: TensorSpec, ndim: int, mesh_shape: Sequence[int]) -> tuple[int, tuple[int, ...]] | None:
    """How ZeRO splits a parameter laid out ``spec``: ``(dim, axes)`` -- its replicated mesh axes
    of size > 1 (``axes``, in mesh order) further split tensor dim ``dim`` -- or None (no such
    axis, a 0-dim tensor, or no dim to split).

    ``dim`` is the first tensor dim whose existing shards all sit on lower mesh axes than every
    ``axes`` member: DTensor splits a dim over its mesh axes in mesh order, so only then is this
    device's ZeRO piece a block of its local shard (a view, no copy)."""
    axes = tuple(a for a, p in enumerate(spec.placements) if isinstance(p, Replicate) and mesh_shape[a] > 1)
    if not axes or ndim == 0:
        return None
    for dim in range(ndim):
        # A segmented dim's piece is not a block of the tensor: ZeRO splits another dim.
        if spec.segments(dim) == 1 and all(a < axes[0] for a in spec.shard_axes(dim)):
            return dim, axes
    return None
