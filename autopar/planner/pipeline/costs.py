"""Unconstrained stage optima reused along a range family (``StageCosts``' mixin): ranges that
differ only in how many identical interior blocks they hold share one pattern of layouts, so the
optimum of a range between a family's shortest and longest solved members needs no solve of its
own (``RangeFamilies._between``)."""

from __future__ import annotations

from autopar.plans import NodeKind

__all__ = ["HELD", "RangeFamilies"]

# Suffix of the node that holds a value a recomputed stage keeps (``StageCosts.slice``).
HELD = "@held"


class RangeFamilies:
    """Methods of ``autopar.planner.pipeline.search.StageCosts`` (its attributes: ``block_class``,
    ``num_blocks``, ``lengths``, ``_memo``, ``_solved_on``, ...) for range families."""

    def _family(self, a: int, b: int):
        """Ranges of one family differ only in how many interior blocks they hold, all of one
        class: (first?, last?, first block's class, last block's class, interior class)."""
        if b - a < 3 or len(set(self.block_class[a + 1:b - 1])) != 1:
            return None
        return a == 0, b == self.num_blocks, self.block_class[a], self.block_class[b - 1], self.block_class[a + 1]

    def _member(self, a: int, b: int, length: int) -> tuple[int, int] | None:
        """The range of ``length`` blocks in the family of ``[a, b)`` (same first/last flags)."""
        lo = 0 if a == 0 else (self.num_blocks - length if b == self.num_blocks else a)
        hi = lo + length
        if lo < 0 or hi > self.num_blocks or (lo == 0) != (a == 0) or (hi == self.num_blocks) != (b == self.num_blocks):
            return None
        return (lo, hi) if self._family(lo, hi) == self._family(a, b) else None

    def _blocks(self, a: int, b: int) -> tuple[list[list[str]], list[str]]:
        """Per block of ``[a, b)`` its decisions in problem order (its ops, the parameters only it
        reads), and the stage's other decisions."""
        per: list[list[str]] = [[] for _ in range(b - a)]
        rest = []
        for name in (n.name for n in self.built.problem.nodes):
            kind = self.kind[name]
            if kind == NodeKind.OP and name in self.in_block and a <= self.pos[name] < b:
                per[self.pos[name] - a].append(name)
            elif kind == NodeKind.PARAMETER and len(self.readers.get(name, ())) == 1 and \
                    a <= next(iter(self.readers[name])) < b:
                per[next(iter(self.readers[name])) - a].append(name)
            else:
                rest.append(name)
        return per, rest

    def _pattern(self, a: int, b: int, choice: dict[str, str]):
        """The choice of ``[a, b)`` independent of its length: first, interior (all equal, as
        repeated-block aliasing makes them), last block's options, and the rest by name."""
        per, rest = self._blocks(a, b)
        inner = {tuple(choice[n] for n in blk) for blk in per[1:-1]}
        if len(inner) != 1:
            return None
        return (tuple(choice[n] for n in per[0]), inner.pop(), tuple(choice[n] for n in per[-1]),
                tuple((n, choice[n]) for n in rest if n in choice))

    def _between(self, a: int, b: int, *, factor: float, recompute: bool):
        """The unconstrained optimum of ``[a, b)`` without a solve when the family's shortest and
        longest ranges (``lengths``) have one and the same pattern: with aliased interior blocks a
        pattern's objective is linear in the interior count ``n`` (``n A + B``) and the optimum
        ``min over patterns`` is concave in ``n``, so a pattern optimal at both ends of an interval
        is optimal inside it (exact up to the solver's gap). None: solve it."""
        family = self._family(a, b)
        if family is None or self.lengths is None:
            return None
        shortest, longest = max(self.lengths[0], 3), self.lengths[1]
        if not shortest < b - a < longest:
            return None
        ends = [self._member(a, b, n) for n in (shortest, longest)]
        if None in ends:
            return None
        found = []
        for lo, hi in ends:
            key = (lo == 0, hi == self.num_blocks, self.block_class[lo:hi], factor, recompute, None, None)
            if key not in self._memo:
                self._memo[key] = self.solve_range(lo, hi, in_flight=1, factor=factor, budget=None,
                                                   recompute=recompute)
                self._solved_on[key] = (lo, hi)
            if self._memo[key] is None:
                return None
            # The shape may have been solved on another range of it: its choice names that range's nodes.
            found.append(self._pattern(*self._solved_on[key], self._memo[key][0]))
        if found[0] is None or found[0] != found[1]:
            return None
        first, inner, last, rest = found[0]
        per, _ = self._blocks(a, b)
        if any(len(blk) != len(inner) for blk in per[1:-1]) or len(per[0]) != len(first) or len(per[-1]) != len(last):
            return None
        choice = dict(rest)
        for blk, opts in [(per[0], first), (per[-1], last)] + [(blk, inner) for blk in per[1:-1]]:
            choice.update(zip(blk, opts))
        problem = self.slice(self.decisions(a, b), in_flight=1, factor=factor, budget=None, fixed={},
                             recompute=recompute)
        if set(choice) != {n.name for n in problem.nodes if not n.name.endswith(HELD)}:
            return None
        choice.update({n.name: choice[n.name[:-len(HELD)]] for n in problem.nodes if n.name.endswith(HELD)})
        self.num_reused += 1
        return self._figures(problem, b, choice, in_flight=1, factor=factor, recompute=recompute, status="optimal",
                             gap=max(self._memo[(e[0] == 0, e[1] == self.num_blocks, self.block_class[e[0]:e[1]],
                                                 factor, recompute, None, None)][1].gap for e in ends))

