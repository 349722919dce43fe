"""``aten.einsum.default`` (export keeps it whole). Local op: the same einsum on local shards.

The equation is parsed into one label per operand dim and the output labels (``...`` expands to
private labels, right-aligned across operands as NumPy broadcasting does; an implicit output is
the ellipsis dims followed by the labels that occur once, in alphabetical order). With ``n`` the
axis size, single-axis options for a label ``L`` of full size ``N`` (the largest size it has):

- ``L`` in the output (a *batch* label, in every operand, or a *free* one, in some): every
  operand holding ``L`` at size ``N`` is split on it, an operand that broadcasts it (size 1) or
  lacks it is replicated; the output is split on ``L``. Each rank computes its own output
  positions exactly: ``out[.., l, ..]`` only reads operand entries with that ``l``.
- ``L`` not in the output (*contracted* between operands, or *summed out* of one, ``"ij->i"``):
  the operands holding it are split, the others replicated, the output is ``Partial``: the sum
  over ``L`` is the sum over ranks of the sums over each rank's chunk.
- one operand ``Partial``, the others replicated -> ``Partial`` output: einsum is linear in each
  operand, so summands map to summands. Every rank does the full work.

A label that repeats inside one operand (a diagonal, ``"ii->i"``, ``"iij->j"``) is never split:
both dims of that operand would need the same mesh axis, which one placement cannot say, and
splitting only the other operands would hand the local op mismatched sizes.

Replicated operands of a split computation get partial gradients (derived centrally).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from autopar.layout.placement import Partial, Replicate, Shard
from autopar.strategies.registry import AxisOption, OpInfo, Sample, register
from autopar.strategies.samples import rand

aten = torch.ops.aten
R, P = Replicate(), Partial()

__all__ = ["EinsumSpec", "parse_einsum"]

# Private labels for the dims an ellipsis stands for: never valid equation letters.
_ELLIPSIS_BASE = 0x2460


@dataclass(frozen=True)
class EinsumSpec:
    """A parsed equation: one label per dim of each operand, and the output's labels."""

    operands: tuple[str, ...]
    output: str

    def labels(self) -> list[str]:
        """Every label once, in order of first appearance (operands, then the output)."""
        return list(dict.fromkeys("".join(self.operands) + self.output))


def parse_einsum(equation: str, ndims: Sequence[int]) -> EinsumSpec:
    """Labels per operand dim and of the output, ``...`` and an implicit output resolved.

    ``ndims``: the operands' numbers of dims (what an ellipsis stands for depends on them).
    """
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ndims):
        raise ValueError(f"einsum equation {equation!r} names {len(terms)} operands, got {len(ndims)}")
    ell_counts = []
    for term, ndim in zip(terms, ndims):
        letters = term.replace("...", "")
        _check_letters(equation, letters)
        num = ndim - len(letters)
        if num < 0 or (num > 0 and "..." not in term):
            raise ValueError(f"einsum equation {equation!r}: operand {term!r} does not fit {ndim} dims")
        ell_counts.append(num)
    total = max(ell_counts, default=0)
    ellipsis = "".join(chr(_ELLIPSIS_BASE + k) for k in range(total))
    # Right-aligned: an operand with fewer ellipsis dims holds the trailing ones.
    operands = tuple(term.replace("...", ellipsis[total - num:]) for term, num in zip(terms, ell_counts))
    if arrow:
        _check_letters(equation, rhs.replace("...", ""))
        output = rhs.replace("...", ellipsis)
    else:
        letters = "".join(terms).replace("...", "")
        output = ellipsis + "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    return EinsumSpec(operands, output)


def _check_letters(equation: str, letters: str) -> None:
    bad = [c for c in letters if not c.isascii() or not c.isalpha()]
    if bad:
        raise ValueError(f"einsum equation {equation!r}: unexpected characters {bad}")


# ------------------------------------------------------------------------------------ rule
def _label_sizes(spec: EinsumSpec, shapes: Sequence[Sequence[int]]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for labels, shape in zip(spec.operands, shapes):
        for c, s in zip(labels, shape):
            sizes[c] = max(sizes.get(c, 1), s)
    return sizes


def einsum_label_options(info: OpInfo, spec: EinsumSpec, shapes: Sequence[Sequence[int]]) -> list[AxisOption]:
    """Split options per label, then the ``Partial`` pass-throughs (see the module docstring)."""
    sizes = _label_sizes(spec, shapes)
    options = []
    for label in spec.labels():
        if any(labels.count(label) > 1 for labels in spec.operands):
            continue  # a diagonal: not expressible with one placement per axis
        ins = []
        for labels, shape in zip(spec.operands, shapes):
            j = labels.find(label)
            ins.append(Shard(j) if j >= 0 and shape[j] == sizes[label] else R)
        out = Shard(spec.output.index(label)) if label in spec.output else P
        options.append(info.option(out, tensors=ins))
    num = len(spec.operands)
    for i in range(num):
        ins = [P if k == i else R for k in range(num)]
        options.append(info.option(P, work_split=False, tensors=ins))
    return options


def _einsum_samples() -> list[Sample]:
    return [
        Sample(("ij,jk->ik", [rand(4, 8), rand(8, 4)]), label="matmul"),
        Sample(("bhqd,bhkd->bhqk", [rand(4, 4, 8, 4), rand(4, 4, 4, 4)]), label="attention"),
        Sample(("...ij,...jk->...ik", [rand(4, 4, 8), rand(1, 8, 4)]), label="ellipsis-broadcast"),
        Sample(("b...d,de", [rand(4, 4, 8, 4), rand(4, 8)]), label="ellipsis-implicit"),
        Sample(("td,edf,te->tf", [rand(8, 4), rand(4, 4, 8), rand(8, 4)]), label="three-operands"),
        Sample(("i,j->ij", [rand(8), rand(4)]), label="outer"),
        Sample(("ij->i", [rand(4, 8)]), label="sum-out"),
        Sample(("bii,bj->bij", [rand(4, 4, 4), rand(4, 8)]), label="diagonal"),
        Sample(("ii->i", [rand(8, 8)]), label="diagonal-only"),
        Sample(("ij,ij", [rand(4, 8), rand(4, 8)]), label="implicit-full-contraction"),
    ]


@register(aten.einsum.default, has_flops=True, samples=_einsum_samples)
def _einsum(info: OpInfo) -> list[AxisOption]:
    metas = [s.meta for s in info.slots]
    if any(m is None for m in metas):
        return []  # an operand that is not a tensor value (never from torch.export)
    shapes = [m.shape for m in metas]
    try:
        spec = parse_einsum(info.arg("equation"), [len(s) for s in shapes])
    except ValueError as exc:
        raise ValueError(f"{info.where()}: {exc}") from exc
    return einsum_label_options(info, spec, shapes)
