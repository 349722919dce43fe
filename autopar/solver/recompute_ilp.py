"""Recompute (activation checkpointing) decided inside the sharding ILP: one objective, one budget.

Units (``autopar.solver.timeline``: geometry, what a recomputed unit keeps, the exact
evaluation): for a choice ``x`` (one option per node) and a unit ``s``,

* ``A_s(x)``: bytes the unit's nodes save for backward (their ``act_bytes``);
* ``c_s(x)``: bytes of the activations the unit reads from outside (its ``SegmentInput``s; inputs
  whose storage an outside node saves anyway are left out by the builder, so no storage counts
  twice);
* ``F_s(x)``: forward seconds of its nodes (``StrategyOption.forward_s``): what recomputing costs.

``S0``, ``b``, ``E`` are the unit's ``start``, ``bwd`` and ``end`` (``SegmentGeometry``). Kept
(``r_s = 0``): each item is held on ``[start, end]``. Recomputed (``r_s = 1``): each item's
forward part ``[start, b-1]`` is gone, its backward part ``[b, end]`` stays, the inputs
``c_s(x)`` are held on ``[S0, E]`` and step time grows by ``F_s(x)``. A value several recomputed
units read is one tensor for the evaluation; the ILP counts it per unit (an upper bound).

Every forward part of a segment is live at every timeline point ``t`` with ``N <= t < b`` (the
backward half; all items start in forward, ``start < N``) and at the last forward start, the
only points where a peak can be (``simplify.peak_candidates``: nothing ends in forward). So on
``[S0, b-1]`` a segment contributes ``H_s = (1 - r_s) A_s(x) + r_s c_s(x)`` at every peak
candidate, and on ``[b, E]`` its backward parts plus ``J_s = r_s c_s(x)``.

Linearisation (exact for binary ``x`` and ``r``; all in MiB or seconds; no big-M)
--------------------------------------------------------------------------------
Each product ``form(x) * r_s`` (form = ``A``, ``c``, ``F``, or a child's ``A`` times its block's
``r``) is written with ``z_{s,g,q} >= 0`` per group ``g`` and class ``q`` of options the forms
cannot tell apart: ``z <= sum_{k in q} x[g,k]``, ``sum_q z_{s,g,q} = r_s`` (the convex hull of
``x[g,.] * r_s``: the big-M version's LP relaxation freed a whole activation with a sliver of
``r``; Llama-70B's LP bound 5.524 s -> 5.739 s, the best plan found 5.745 s). Then
``H_s = A_s(x) - A_s r_s - A_s r_B + c_s r_s``, ``J_s = c_s r_s`` (equalities, ``>= 0``), and the
objective gains ``F_s r_s``.

Size and repeated blocks: ``x`` stays shared between identical blocks (``simplify`` aliasing), so
the sharding part of the model is flat in depth; recompute adds one binary, three continuous
variables and four rows per block (the memory rows already grow with the timeline). An integer
count per alias class ``k = sum_i r_i`` would not be exact here: which blocks are recomputed
changes which memory rows drop (a recomputed block frees memory only *before* its own backward),
and the contribution at a candidate is ``min(k, #blocks live there)``, not linear in ``k``.

Tying (``tie``): identical units (``_identity``, the same key as the symmetry rows below) in runs
of ``tie`` share one ``r``, their products and their span variables, and a memory row counts
how many of a variable's spans hold a candidate; a restriction (each plan of it is a plan of the
full model, same time and peak) whose size is a block class's, not a depth's, and whose rows
differing only in which identical block they see dominate one another (``autopar.solver.dive.blockwise``).

Symmetry (``order``)
--------------------
Identical blocks share ``x`` but each has its own ``r``: the search meets every permutation of
"which blocks recompute unit kind ``u``". Two instances ``u_i``, ``u_j`` of a kind are
*identical* when their linear forms ``A``, ``c``, ``F`` are the same (same groups, same vectors:
block 0 reading the embedding, not the previous block, is not identical to block 1), their
blocks' fine segments have disjoint backward spans, and ``u_j`` (the later one in forward) ends
before block ``i``'s backward begins (``E_{u_j} < b_{B_i}``). Between consecutive identical
instances (``i`` earlier) the model adds ``w_i >= w_j`` for whole blocks and
``r_{u,i} >= r_{u,j} - w_i - w_j`` for fine segments (``w``: the blocks' own ``r``). Exact, by
exchange, in the model's own memory terms (all non-negative, so a point's total is at least
any sub-sum): take an optimum; first drop every recomputed unit with ``c > A`` (its
``d(t) = H - A`` before ``b`` and ``+c`` after is ``>= 0`` everywhere: more memory and more
time), then swap until ordered. A swap moves a recompute from ``u_j`` to ``u_i`` with every
other decision kept; time is unchanged (same ``F``). At a peak candidate ``t`` (``t >= N-1``):
``t < b_{u_j}``: both give ``c - A``; ``t`` in ``[b_{u_j}, E_{u_j}]``: ``c - A`` instead of ``+c``;
between ``E_{u_j}`` and ``b_{u_i}``: ``c - A <= 0`` instead of 0; ``t`` in ``[b_{u_i}, E_{u_i}]``:
the total after the swap is at most the total before it at ``t' = b_{u_j}``: what is held at
``t`` from outside the blocks, from earlier blocks and from block ``i``'s other units (its later
fine segments are done, its earlier ones still forward-held) is held at ``t'`` too (everything
starts in forward and ``t' < t``; block ``i`` is wholly forward-held at ``t' < b_{B_i}``), block
``i``'s ``u`` then holds at most ``A + c``, and at ``t'`` the old plan held ``A`` in ``u_i`` and
``J = c`` in ``u_j``. A whole-block swap (``w_j = 1``, ``w_i = 0``, block ``i``'s fine set ``T``
moves to block ``j``) is checked the same way against the old plan at ``b_{B_j}``, where block
``j`` holds ``c_B`` plus every rematerialised item. Fine swaps among blocks not recomputed whole
then order each kind. Caveats: the argument is about this model (it counts a value several
units keep once per unit); ``Problem.evaluate`` re-checks the plan either way.
``tests/solver/test_recompute_ilp.py`` compares the optimum with and without the rows.

The pipeline (``autopar.solver.driver``) re-evaluates every answer exactly with
``Problem.evaluate(choice, recompute=...)`` (item by item, on the true intervals) and checks it
against the solver's objective. No torch import.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from typing import Mapping

import numpy as np

from autopar.layout.blocks import block_of, split_block
from autopar.solver.ilp import MEM_UNIT, IlpModel, Terms, undominated_rows
from autopar.solver.problem import Problem
from autopar.solver.simplify import MemItem, Reduced, peak_candidates
from autopar.solver.timeline import SegmentInputs, segment_geometry

__all__ = ["RecomputeModel", "RECOMPUTE_GAP", "floor_model"]

# The joint ILP is solved to within this share of the step time (``autopar.solver.driver``:
# a first plan by ``autopar.solver.dive``, proved against the relaxation or searched from).
RECOMPUTE_GAP = 1e-3


class RecomputeModel(IlpModel):
    """``IlpModel`` plus the recompute variables and memory rows of the module docstring.
    ``inputs``: what each unit keeps when recomputed; ``fixed``: unit -> recomputed or not,
    imposed (e.g. uniform per-block checkpointing); ``order``: the symmetry-breaking rows of the
    module docstring (exact: some optimum satisfies them)."""

    def __init__(self, reduced: Reduced, problem: Problem, inputs: SegmentInputs, name: str = "autopar_recompute",
                 *, fixed: Mapping[str, bool] | None = None, order: bool = True, tie: int = 0):
        super().__init__(reduced, name)
        self.problem = problem
        self.fixed = dict(fixed or {})
        self.tie = tie
        self.rep: dict[str, str] = {}  # unit -> the unit whose variables it shares (``tie``; itself otherwise)
        self.geo = segment_geometry(problem)
        self.units = sorted(self.geo, key=lambda s: (self.geo[s].start, self.geo[s].parent is not None, s))
        self.r: dict[str, int] = {}  # unit -> its recompute binary's column
        self.spans: list[tuple[int, int, int]] = []  # (column, first, last timeline point)
        self.c_vec = self._input_vectors(inputs)  # seg -> {group: MiB per group option}
        self.order = order
        self.num_order_rows = 0
        self._class_cache: dict[tuple, tuple[np.ndarray, dict[tuple, list[int]]]] = {}
        self._span_vars: dict[tuple, int] = {}  # (representative unit, kind) -> its span variable
        self.turn_only = False  # memory rows: only the last forward start's (``floor_model``)
        self.shared_rows = 0  # rows tied units share: the untied model has num_rows + this (memory rows aside)

    def _input_vectors(self, inputs) -> dict[str, dict[int, np.ndarray]]:
        member = {m.node: m for m in self.reduced.members}
        out: dict[str, dict[int, np.ndarray]] = {}
        for seg in self.geo:
            vecs: dict[int, np.ndarray] = {}
            for si in inputs.get(seg, ()):
                m = member[si.node]
                node = self.problem.node(si.node)
                vec = np.array([si.bytes[node.option_index(o)] for o in m.option_names], dtype=float) / MEM_UNIT
                vecs[m.group] = vecs.get(m.group, 0.0) + vec
            out[seg] = vecs
        return out

    def _sum(self, vecs: Mapping[int, np.ndarray]) -> tuple[list, float, float]:
        """``sum_g vec_g . x_g`` as (terms, constant, its maximum)."""
        terms, const, top = [], 0.0, 0.0
        for g, vec in vecs.items():
            t, c = self.linear(g, np.asarray(vec, dtype=float))
            terms += t
            const += c
            top += float(np.max(vec))
        return terms, const, top

    def add_recompute(self, objective: Terms) -> None:
        """Variables and rows of the module docstring, then the ``fixed`` decisions and the
        symmetry rows; appends the recompute seconds to ``objective``."""
        fwd_vecs: dict[str, dict[int, np.ndarray]] = defaultdict(dict)
        for g, table in enumerate(self.reduced.forward):
            for seg, vec in table.items():
                for u in dict.fromkeys((seg, block_of(seg))):
                    if u in self.geo:
                        prev = fwd_vecs[u].get(g)
                        fwd_vecs[u][g] = vec if prev is None else prev + vec
        act_vecs: dict[str, dict[int, np.ndarray]] = defaultdict(dict)
        for it in self.reduced.mem_items:
            if it.segment in self.geo:
                prev = act_vecs[it.segment].get(it.group)
                vec = it.bytes / MEM_UNIT
                act_vecs[it.segment][it.group] = vec if prev is None else prev + vec
        self.rep = self._representatives(fwd_vecs, act_vecs) if self.tie else {u: u for u in self.units}
        reps = list(dict.fromkeys(self.rep[u] for u in self.units))
        columns = dict(zip(reps, self.lp.add_binaries(len(reps))))
        self.r = {u: columns[self.rep[u]] for u in self.units}
        children: dict[str, list[str]] = defaultdict(list)
        for u in self.units:
            if self.geo[u].parent is not None:
                children[self.geo[u].parent].append(u)
        # Tied units (``tie``) share their products and span variables: one set per representative.
        products: dict[tuple, tuple[list[Terms], int]] = {}  # -> (terms, rows they took)

        def product(i: int, u: str, forms: list, tag: str) -> list[Terms]:
            key = (self.rep[u], tag)
            if key not in products:
                rows = self.lp.num_rows
                products[key] = (self._products(i, u, forms), 0)
                products[key] = (products[key][0], self.lp.num_rows - rows)
            else:
                self.shared_rows += products[key][1]
            return products[key][0]

        block_times: dict[str, Terms] = {}  # child -> A_child(x) * r_block
        for i, u in enumerate(self.units):
            if self.geo[u].parent is None and children.get(u):  # a block: J = c r, T = F r
                kids = children[u]
                f_r, c_r, *a_r = product(i, u, [fwd_vecs.get(u, {}), self.c_vec[u]]
                                         + [act_vecs.get(v, {}) for v in kids], "block")
                block_times.update(zip(kids, a_r))
                objective.extend(f_r)  # once per unit: tied units recompute each
                self._span_var(f"J_{i}", c_r, 0.0, self.geo[u].start, self.geo[u].end, key=(self.rep[u], "J"))
        exclusive: set[tuple[int, int]] = set()
        for i, u in enumerate(self.units):
            g = self.geo[u]
            if g.parent is None and children.get(u):
                continue
            r, rb = self.r[u], self.r.get(g.parent) if g.parent is not None else None
            f_r, a_r, c_r = product(i, u, [fwd_vecs.get(u, {}), act_vecs.get(u, {}), self.c_vec[u]], "unit")
            objective.extend(f_r)
            a_terms, a_const, _ = self._sum(act_vecs.get(u, {}))
            minus_a = [(v, -c) for v, c in a_r]
            # before the block's backward: A unless recomputed (alone or in the block), c if alone
            drop_block = [(v, -c) for v, c in block_times.get(u, ())] if rb is not None else []
            b_block = self.geo[g.parent].bwd if rb is not None else g.bwd
            if rb is not None and (r, rb) in exclusive:
                self.shared_rows += 1
            elif rb is not None:
                exclusive.add((r, rb))
                self.lp.add_row([(r, 1.0), (rb, 1.0)], upper=1.0)
            key = (self.rep[u], self.rep.get(g.parent))  # H reads the block's decision too
            self._span_var(f"H_{i}", a_terms + minus_a + drop_block + c_r, a_const, g.start, b_block - 1,
                           key=(*key, "H"))
            if b_block < g.bwd:  # the block is rematerialised, this segment not yet (if alone)
                self._span_var(f"H2_{i}", a_terms + minus_a + c_r, a_const, b_block, g.bwd - 1, key=(*key, "H2"))
            self._span_var(f"J_{i}", c_r, 0.0, g.bwd, g.end, key=(*key, "J"))
        for i, (unit, value) in enumerate(sorted(self.fixed.items())):
            if unit not in self.r:
                raise ValueError(f"cannot fix unknown segment {unit!r}; known: {sorted(self.r)}")
            self.lp.add_row([(self.r[unit], 1.0)], lower=float(bool(value)), upper=float(bool(value)))
        if self.order and not self.tie:  # tied identical units share r: nothing left to order
            self.num_order_rows = self._add_order(fwd_vecs, act_vecs)

    def _representatives(self, fwd_vecs, act_vecs) -> dict[str, str]:
        """Unit -> the first unit identical to it (``_identity``): ``tie`` gives them one
        recompute decision, a restriction of the model (every plan of it is a plan of the full
        model, at the same time and peak)."""
        first: dict[tuple, str] = {}
        seen: dict[tuple, int] = defaultdict(int)
        out = {}
        for u, key in self._identity(fwd_vecs, act_vecs).items():
            if key is None:
                out[u] = u
                continue
            run = seen[key] // self.tie  # runs of ``tie`` consecutive identical units
            seen[key] += 1
            out[u] = first.setdefault((key, run), u)
        return out

    def _span_var(self, name: str, terms: Terms, const: float, first: int, last: int, *, key: tuple) -> None:
        """A variable equal to ``terms + const`` (MiB, >= 0), held on ``[first, last]``; one
        variable per ``key`` (tied units' spans hold the same amount)."""
        var = self._span_vars.get(key)
        if var is None:
            var = self._span_vars[key] = self.lp.add_column()
            self.lp.add_row(terms + [(var, -1.0)], lower=0.0, upper=0.0, const=const)
        else:
            self.shared_rows += 1
        self.spans.append((var, first, last))

    def _products(self, i: int, unit: str, forms: list[Mapping[int, np.ndarray]]) -> list[Terms]:
        """``form(x) * r_unit`` for each form (group -> vector over the group's options), exact
        and without big-M (module docstring): one ``z`` per group and class of options the forms
        cannot tell apart, ``z <= sum of the class's x``, ``sum z = r``."""
        r = self.r[unit]
        out: list[Terms] = [[] for _ in forms]
        if unit in self.fixed and not self.fixed[unit]:  # r = 0: every product is 0
            return out
        for g in sorted(set().union(*forms)):
            low, classes = self._classes(g, [f.get(g) for f in forms])
            for f in np.flatnonzero(low):
                out[f].append((r, float(low[f])))
            xs = self.x[g]
            if xs is None or len(classes) == 1:
                continue
            if self.fixed.get(unit):  # r = 1: each product is its form (no z: a smaller model)
                for values, members in classes.items():
                    for f, v in enumerate(values):
                        if v:
                            out[f].extend((xs[k], float(v)) for k in members)
                continue
            zs = []
            for c, (values, members) in enumerate(classes.items()):
                z = self.lp.add_column()
                self.lp.add_row([(z, 1.0)] + [(xs[k], -1.0) for k in members], upper=0.0)
                zs.append(z)
                for f, v in enumerate(values):
                    if v:
                        out[f].append((z, float(v)))
            self.lp.add_row([(z, 1.0) for z in zs] + [(r, -1.0)], lower=0.0, upper=0.0)
        return out

    def _classes(self, g: int, vecs: list) -> tuple[np.ndarray, dict[tuple, list[int]]]:
        """Per form its minimum over group ``g``'s options, and the options grouped by what the
        forms add above it (``_products``). Cached by content: the units of identical blocks
        share ``x`` and their forms, so 80 Llama-70B blocks compute each class set once."""
        n = len(self.reduced.cost[g])
        key = (g, tuple(None if v is None else np.asarray(v, dtype=float).tobytes() for v in vecs))
        hit = self._class_cache.get(key)
        if hit is None:
            mat = np.array([np.broadcast_to(np.asarray(0.0 if v is None else v, dtype=float), (n,)) for v in vecs])
            low = mat.min(axis=1)
            classes: dict[tuple, list[int]] = {}
            for k, col in enumerate(np.round(mat - low[:, None], 9).T):
                classes.setdefault(tuple(col.tolist()), []).append(k)
            hit = self._class_cache[key] = (low, classes)
        return hit

    def _identity(self, fwd_vecs, act_vecs) -> dict[str, tuple | None]:
        """Per unit, a key equal for identical units of identical blocks (module docstring,
        "Symmetry": the same kind in the same block list, the same forms ``F``, ``c``, ``A``, a
        whole block's fine segments too); None outside a repeated block."""
        def form(vecs) -> tuple:
            return tuple(sorted((g, np.asarray(v, dtype=float).tobytes()) for g, v in vecs.items()))

        def key(u):
            return form(fwd_vecs.get(u, {})), form(self.c_vec[u]), form(act_vecs.get(u, {}))

        children: dict[str, list[str]] = defaultdict(list)
        for u in self.units:
            if self.geo[u].parent is not None:
                children[self.geo[u].parent].append(u)
        out: dict[str, tuple | None] = {}
        for u in self.units:
            g = self.geo[u]
            block = g.parent or u
            where = split_block(block)
            if where is None:
                out[u] = None
                continue
            k = (where[0], u[len(block):], key(u))
            if g.parent is None:  # a whole block: identical only with identical fine segments
                k += tuple(sorted((v[len(u):], key(v)) for v in children.get(u, ())))
            out[u] = k
        return out

    def _add_order(self, fwd_vecs, act_vecs) -> int:
        """Symmetry-breaking rows between identical units of identical blocks (module docstring,
        "Symmetry"): ``r_{u,i} >= r_{u,j} - w_i - w_j`` for a fine segment kind ``u`` and
        ``w_i >= w_j`` for whole blocks, ``i`` the earlier of two consecutive identical
        instances. Returns the number of rows added."""
        children: dict[str, list[str]] = defaultdict(list)
        for u in self.units:
            if self.geo[u].parent is not None:
                children[self.geo[u].parent].append(u)
        chains: dict[tuple, list[str]] = defaultdict(list)  # kind + identical forms -> units by start
        for u, k in self._identity(fwd_vecs, act_vecs).items():  # sorted by start: earlier blocks first
            if k is not None and self._backward_disjoint(children.get(self.geo[u].parent or u, ())):
                chains[k].append(u)
        rows = 0
        for units in chains.values():
            for early, late in zip(units, units[1:]):
                ge, gl = self.geo[early], self.geo[late]
                if not gl.end < self.geo[ge.parent or early].bwd:  # the later one must be nested inside
                    continue
                terms = [(self.r[early], 1.0), (self.r[late], -1.0)]
                if ge.parent is not None:  # only while neither block is recomputed whole
                    terms += [(self.r[b], 1.0) for b in (ge.parent, gl.parent) if b in self.r]
                self.lp.add_row(terms, lower=0.0)
                rows += 1
        return rows

    def _backward_disjoint(self, segments) -> bool:
        """Whether the backward spans ``[bwd, end]`` of a block's fine segments are disjoint
        (the exchange argument needs one fine segment in backward at a time)."""
        spans = sorted((self.geo[s].bwd, self.geo[s].end) for s in segments)
        return all(a[1] < b[0] for a, b in zip(spans, spans[1:]))

    def add_memory(self, *, budget: float | None = None, peak: int | None = None) -> int:
        """Memory rows at the peak candidates of the split timeline (module docstring)."""
        p_terms, p_const = self.param_bytes()
        rhs_terms, upper = self.memory_rhs(budget=budget, peak=peak)
        plain: list[MemItem] = []
        for it in self.reduced.mem_items:
            g = self.geo.get(it.segment)
            if g is None:
                plain.append(it)
            else:  # the backward part; the forward part lives in H
                plain.append(MemItem(it.group, g.bwd, it.end, it.bytes, it.segment))
        spans = [MemItem(-1, a, b, np.zeros(1)) for _, a, b in self.spans]
        cands = peak_candidates(plain + spans + self.edge_spans())
        if self.turn_only and self.reduced.mem_items:  # (``floor_model``)
            cands = [max(it.start for it in self.reduced.mem_items)]
        if not cands:
            self.lp.add_row(p_terms + rhs_terms, upper=upper, const=p_const)
            return 1
        offsets = np.cumsum([0] + [len(c) for c in self.reduced.cost])
        # One column per span variable: a candidate counts how many of its spans hold it (tied
        # units' spans share one), so rows differing only in which identical block they see dominate.
        extra = list(dict.fromkeys(v for v, _, _ in self.spans))
        column = {v: c for c, v in enumerate(extra)}
        # Then the pairwise items' columns (``IlpModel.edge_held``: a parameter copy its reader
        # keeps, held on its whole interval, recomputed or not: ``timeline``'s rule).
        width = offsets[-1] + len(extra) + len(self.edge_held)
        coef = np.zeros((len(cands) + 1, width))
        const = np.zeros(len(cands) + 1)

        def add(start, end, cols, vals, low):
            a, b = bisect.bisect_left(cands, start), bisect.bisect_right(cands, end) - 1
            if a > b:
                return
            coef[a, cols] += vals
            coef[b + 1, cols] -= vals
            const[a] += low
            const[b + 1] -= low

        for it in plain:
            vec = it.bytes / MEM_UNIT
            low = float(vec.min())
            add(it.start, it.end, slice(offsets[it.group], offsets[it.group + 1]), vec - low, low)
        for var, a, b in self.spans:
            add(a, b, [offsets[-1] + column[var]], 1.0, 0.0)
        for start, end, k, low in self.edge_mem:
            add(start, end, [offsets[-1] + len(extra) + k], 1.0, low)
        coef, const = np.cumsum(coef, axis=0)[:-1], np.cumsum(const)[:-1]
        kept = undominated_rows(coef, const)
        slot_cols = self.slot_columns()
        for k in kept:
            terms = self.row_terms(coef[k], slot_cols)
            counts = coef[k, offsets[-1]:offsets[-1] + len(extra)]
            terms += [(extra[c], float(round(counts[c]))) for c in np.flatnonzero(counts > 0.5)]
            held = coef[k, offsets[-1] + len(extra):]
            terms += [(self.edge_held[c], float(round(held[c]))) for c in np.flatnonzero(held > 0.5)]
            self.lp.add_row(terms + p_terms + rhs_terms, upper=upper, const=float(const[k]) + p_const)
        return len(kept)

    def recomputed(self) -> tuple[str, ...]:
        return tuple(u for u in self.units if self.lp.value(self.r[u]) > 0.5)

    @property
    def stats(self) -> dict[str, int]:
        return {"num_segments": len(self.units), "num_order_rows": self.num_order_rows}


def floor_model(reduced: Reduced, problem: Problem, inputs: SegmentInputs) -> RecomputeModel:
    """A relaxation of the joint model's smallest peak, block classes tied: every identical unit
    shares its variables (``tie``) and only the memory row of the last forward start is kept.
    Exact as a relaxation: there every forward part of every block is held, so the row reads the
    tied units through their sum, and averaging a plan's recompute and product variables over
    identical units (the hull rows are convex) gives a point of this model with the same row.
    Its LP optimum (MiB) is a lower bound on any plan's peak, found in a block class's time."""
    model = RecomputeModel(reduced, problem, inputs, "autopar_recompute_floor", tie=max(len(inputs), 1))
    model.turn_only = True
    model.build_min_peak()
    return model
