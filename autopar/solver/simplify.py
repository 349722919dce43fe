"""Shrink a ``Problem`` into a ``Reduced`` model with fewer decisions, then map answers back.

A ``Reduced`` model has *groups* (one decision each) instead of nodes. Every problem node is a
*member* of one group, with a map from the group's option index to the node's option; choosing
option ``s`` for the group chooses ``member.option_names[s]`` for that node. Costs and memory
are re-expressed on groups so that, for every group choice, the reduced objective and memory
equal the problem's for the expanded node choice (``Problem.evaluate``). Four transformations:

1. **Repeated-block aliasing** (an intended restriction: without it, solve time grows with depth). Nodes whose
   ``block`` is ``"<prefix>.<i>"`` form instances of the prefix; instances with equal
   (signature, option names) sequences form a class, and the k-th node of every instance of a
   class joins one group. Costs of the members add up; each member keeps its own memory item
   (own liveness interval); edges between members add up per group pair, so within-block and
   block-to-block edges of a template pair share one edge variable; an edge whose two ends land
   in the same group becomes a diagonal (linear) cost. The reduced objective is exact for every
   shared choice; the only approximation is that instances may no longer differ.

2. **Separable-edge folding** (exact). An edge cost ``C[s, t] = a[s] + b[t]`` (all-zero
   matrices and any edge touching a single-option group included) needs no edge variables:
   ``a`` joins the first group's cost, ``b`` the second's.

3. **Dominated options** (exact). Option ``t`` of group ``g`` is dropped when another option
   ``t'`` is never worse whatever the neighbours choose:
   ``cost[t'] - cost[t] + sum_w max_r (C_gw[t', r] - C_gw[t, r]) <= 0`` over all neighbours
   ``w``, and (when memory can bind) ``t'`` holds no more bytes than ``t`` in every memory item
   and in parameters, and (when the group can be recomputed) recomputes no slower.

4. **Follow-merge** (Alpa's, made exact). Group ``v`` *follows* a neighbour ``u``: for every
   option ``s`` of ``u`` let ``t*(s)`` minimise ``cost_v[t] + C_uv[s, t]``. Following is exact
   when, for every ``s`` and every ``t``,
   ``cost_v[t*] + C_uv[s, t*] - cost_v[t] - C_uv[s, t] + sum_{w != u} max_r (C_vw[t*, r] - C_vw[t, r]) <= 0``
   and ``t*`` dominates ``t`` in memory (when memory can bind) and recompute time: then given
   ``u = s``, ``v = t*(s)`` is optimal whatever else is chosen, so ``v`` is removed and its
   cost, memory items and edges move onto ``u`` through ``t*``. This is the usual case of an
   elementwise op after its producer. Memory dominance is waived (chain merging) only where the
   memory constraint cannot bind: no budget, or the worst choice everywhere fits the budget.

Communication overlap (``autopar.solver.overlap``), when a problem has it: each group also
carries, per option, its asynchronous communication ``a`` and the compute ``w`` it may hide under,
and each edge its asynchronous matrix ``M`` beside ``C`` (aliased members and parallel edges add
up, a follower's move onto its leader through ``t*`` like its cost, a separable ``M`` folds into
``a`` like ``C`` into the cost: an edge folds only when both are separable). The step is then
``max(C - rho a, C - w)`` summed, so the cost comparisons of 3 and 4 must hold for both: with
node costs ``cost - rho a`` and edge costs ``C - rho M`` (their regret terms), and with
``cost - w`` and ``C``. Without overlap the tests are the plain ones above, unchanged.

Pairwise memory (``Edge.mem``: a parameter copy its reader keeps for backward) is an
``EdgeItem``: bytes per (option of ``a``, option of ``b``) held on ``start..end``. Aliased members
keep one item each (their own intervals); an item whose ends share a group is that group's
``MemItem`` (the diagonal); a follower's items move onto its leader through ``t*`` (onto the
leader itself: a ``MemItem``); dominance in memory asks an option to hold no more in every
row of every item it is in. Frozen, an item touching a 1-option group, or separable into
non-negative parts, becomes ``MemItem``s; the others keep an edge (cost matrix zero if
their costs folded), whose variables the ILP's memory rows read.

Transformations 2-4 repeat until nothing changes. No torch import.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from autopar.layout.blocks import split_block
from autopar.solver.memitems import EdgeItem, MemItem, peak_candidates, settle_edge_items
from autopar.solver.overlap import Overlap, overlap_active
from autopar.solver.problem import Problem

__all__ = ["MemItem", "EdgeItem", "Member", "Reduced", "simplify", "peak_candidates", "settle_edge_items"]

# Costs are seconds of order 1e-6..1e2; dominance and separability tests allow float noise only.
_EPS = 1e-12


@dataclass(frozen=True, slots=True)
class Member:
    """Problem node ``node`` follows group ``group``: its option is ``option_names[group choice]``."""

    node: str
    group: int
    option_names: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.node} -> g{self.group}"


@dataclass(frozen=True, slots=True)
class Reduced:
    """The simplified model the ILP solves (see the module docstring for the meaning).

    cost[g][s]:        seconds when group g picks s (node costs + folded edge costs, summed).
    param[g][s]:       bytes held for the whole step.
    forward[g]:        segment -> forward seconds per option (what recomputing would cost).
    mem_items:         activation memory items on the timeline.
    edges:             ``(g1, g2)`` with ``g1 < g2`` -> cost matrix ``[s1, s2]`` (non-separable only,
                       and every pair of an ``edge_items`` entry).
    edge_items:        pairwise memory items (``a < b``; each pair in ``edges``).
    constant:          seconds that do not depend on any choice.
    memory_can_bind:   False when the budget is None or cannot be exceeded by any choice.
    overlap:           the overlap terms (``autopar.solver.overlap.Overlap``), None without overlap.
    """

    cost: tuple[np.ndarray, ...]
    param: tuple[np.ndarray, ...]
    forward: tuple[dict[str, np.ndarray], ...]
    mem_items: tuple[MemItem, ...]
    edges: dict[tuple[int, int], np.ndarray]
    constant: float
    members: tuple[Member, ...]
    budget_bytes: int | None
    timeline_length: int
    memory_can_bind: bool
    stats: dict[str, int] = field(default_factory=dict)
    overlap: Overlap | None = None
    edge_items: tuple[EdgeItem, ...] = ()

    @property
    def num_groups(self) -> int:
        return len(self.cost)

    def num_options(self, g: int) -> int:
        return len(self.cost[g])

    def expand(self, group_choice: list[int] | tuple[int, ...]) -> dict[str, str]:
        """Group option indices -> option name for every problem node."""
        if len(group_choice) != self.num_groups:
            raise ValueError(f"expected {self.num_groups} group choices, got {len(group_choice)}")
        return {m.node: m.option_names[group_choice[m.group]] for m in self.members}

    def objective(self, group_choice: list[int] | tuple[int, ...]) -> float:
        """The reduced objective of a group choice (equals the problem's for the expansion)."""
        total = self.constant + sum(float(c[s]) for c, s in zip(self.cost, group_choice))
        for (a, b), mat in self.edges.items():
            total += float(mat[group_choice[a], group_choice[b]])
        return total - self.overlap.hidden(group_choice) if self.overlap is not None else total

    def __str__(self) -> str:
        opts = sum(len(c) for c in self.cost)
        return (f"Reduced({self.num_groups} groups, {opts} options, {len(self.edges)} edges, "
                f"{len(self.mem_items)} mem items, from {len(self.members)} nodes)")


# ------------------------------------------------------------------------ working model
def _option_arrays(options: tuple) -> tuple:
    """(names, cost, param bytes, forward seconds, act bytes or None when all zero, indices,
    async seconds, overlappable compute seconds) of one node's options, read-only (nodes with
    the same options share them)."""
    acts = np.array([o.act_bytes for o in options], dtype=float)
    out = (np.array([o.cost_s for o in options], dtype=float), np.array([o.param_bytes for o in options], dtype=float),
           np.array([o.forward_s for o in options], dtype=float), acts if acts.any() else None,
           np.arange(len(options)), np.array([o.async_s for o in options], dtype=float),
           np.array([o.overlap_s for o in options], dtype=float))
    for arr in out:
        if arr is not None:
            arr.setflags(write=False)
    return (tuple(o.name for o in options), *out)


class _Work:
    """Mutable form of ``Reduced`` used while simplifying."""

    def __init__(self, problem: Problem, alias: bool):
        # Overlap terms (module docstring): rho, and per group its async and overlappable seconds.
        self.rho = problem.comm_overlap if overlap_active(problem) else None
        self.asy: dict[int, np.ndarray] = {}
        self.ovl: dict[int, np.ndarray] = {}
        self.aadj: dict[int, dict[int, np.ndarray]] = defaultdict(dict)  # async matrices, as adj (nonzero ones)
        self._regret_async: dict[tuple[int, int], tuple] = {}  # see regret_term
        self.cost: dict[int, np.ndarray] = {}
        self.param: dict[int, np.ndarray] = {}
        self.forward: dict[int, dict[str, np.ndarray]] = {}
        self.items: dict[int, list[MemItem]] = defaultdict(list)
        self.adj: dict[int, dict[int, np.ndarray]] = defaultdict(dict)  # adj[a][b] is [s_a, s_b]
        self.eitems: dict[int, list[EdgeItem]] = defaultdict(list)  # group -> pairwise items touching it
        self.constant = 0.0
        # node -> (group, node option index for each group option)
        self.member: dict[str, tuple[int, np.ndarray]] = {}
        self.group_members: dict[int, list[str]] = defaultdict(list)
        self.names: dict[str, tuple[str, ...]] = {}
        self.num_aliased = 0
        self._regret: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}  # see regret_term
        groups = _alias_groups(problem) if alias else {n.name: i for i, n in enumerate(problem.nodes)}
        # The builder hands every repeat of a block position the same options tuple (GPT-2 96
        # layers: 4865 nodes, 88 tuples): their arrays are built once (kept with the tuple, so
        # an id is never reused within this loop).
        arrays: dict[int, tuple] = {}
        for n in problem.nodes:
            g = groups[n.name]
            hit = arrays.get(id(n.options))
            if hit is None:
                hit = arrays[id(n.options)] = (n.options, _option_arrays(n.options))
            names, cost, param, fwd_s, acts, index, asy, ovl = hit[1]
            self.names[n.name] = names
            if g not in self.cost:
                self.cost[g], self.param[g], self.forward[g] = cost.copy(), param.copy(), {}
                if self.rho is not None:
                    self.asy[g], self.ovl[g] = asy.copy(), ovl.copy()
            else:
                self.num_aliased += 1
                self.cost[g] += cost
                self.param[g] += param
                if self.rho is not None:
                    self.asy[g] += asy
                    self.ovl[g] += ovl
            if n.segment is not None:
                fwd = self.forward[g].get(n.segment)
                self.forward[g][n.segment] = fwd_s.copy() if fwd is None else fwd + fwd_s
            if n.live is not None and acts is not None:
                self.items[g].append(MemItem(g, n.live[0], n.live[1], acts, n.segment))
            self.member[n.name] = (g, index)
            self.group_members[g].append(n.name)
        for e in problem.edges:
            ga, gb = groups[e.src], groups[e.dst]
            if e.mem_array is not None:
                mem = e.mem_array.astype(float)
                if ga == gb:
                    self.items[ga].append(MemItem(ga, e.mem_live[0], e.mem_live[1], np.diag(mem).copy()))
                else:
                    self.add_eitem(EdgeItem(ga, gb, e.mem_live[0], e.mem_live[1], mem))
            mat = e.array
            asy = e.async_array if self.rho is not None else None
            if ga == gb:  # both ends share one decision: only the diagonal is reachable
                self.cost[ga] += np.diag(mat)
                if asy is not None:
                    self.asy[ga] = self.asy[ga] + np.diag(asy)
            else:
                self.add_edge(ga, gb, mat, asy)

    def add_edge(self, a: int, b: int, mat: np.ndarray, asy: np.ndarray | None = None) -> None:
        if b in self.adj[a]:
            self.adj[a][b] = self.adj[a][b] + mat
        else:
            self.adj[a][b] = mat
        self.adj[b][a] = self.adj[a][b].T
        if asy is not None:
            held = self.aadj[a].get(b)
            self.aadj[a][b] = asy if held is None else held + asy
            self.aadj[b][a] = self.aadj[a][b].T

    def add_eitem(self, it: EdgeItem) -> None:
        self.eitems[it.a].append(it)
        self.eitems[it.b].append(it)

    def drop_eitem(self, it: EdgeItem) -> None:
        for g in (it.a, it.b):
            self.eitems[g] = [x for x in self.eitems[g] if x is not it]

    def drop_edge(self, a: int, b: int) -> None:
        del self.adj[a][b]
        del self.adj[b][a]
        if b in self.aadj[a]:
            del self.aadj[a][b]
            del self.aadj[b][a]

    # ------------------------------------------------------------------- transformations
    def fold_if_separable(self, a: int, b: int) -> bool:
        mats = [self.adj[a][b]] + ([self.aadj[a][b]] if b in self.aadj[a] else [])
        parts = []
        for mat in mats:
            rows, cols = mat[:, 0], mat[0, :] - mat[0, 0]
            if np.abs(mat - rows[:, None] - cols[None, :]).max() > _EPS * (1.0 + np.abs(mat).max()):
                return False
            parts.append((rows, cols))
        self.cost[a] = self.cost[a] + parts[0][0]
        self.cost[b] = self.cost[b] + parts[0][1]
        if len(parts) > 1:
            self.asy[a] = self.asy[a] + parts[1][0]
            self.asy[b] = self.asy[b] + parts[1][1]
        self.drop_edge(a, b)
        return True

    def regret(self, g: int, skip: int | None = None, *, rho: float | None = None) -> np.ndarray:
        """``R[t', t] = sum_w max_r (C_gw[t', r] - C_gw[t, r])`` over neighbours w != skip;
        ``rho``: of ``C_gw - rho M_gw`` (module docstring, overlap)."""
        k = len(self.cost[g])
        total = np.zeros((k, k))
        for w, mat in self.adj[g].items():
            if w == skip:
                continue
            asy = self.aadj[g].get(w) if rho is not None else None
            total += self.regret_term(g, w, mat) if asy is None else self.async_regret_term(g, w, mat, asy, rho)
        return total

    def async_regret_term(self, g: int, w: int, mat: np.ndarray, asy: np.ndarray, rho: float) -> np.ndarray:
        """``regret_term`` of ``mat - rho asy``, kept while both arrays are the same."""
        hit = self._regret_async.get((g, w))
        if hit is not None and hit[0] is mat and hit[1] is asy:
            return hit[2]
        self._regret_async[(g, w)] = (mat, asy, term := _max_row_difference(mat - rho * asy))
        return term

    def regret_term(self, g: int, w: int, mat: np.ndarray) -> np.ndarray:
        """``max_r (C_gw[t', r] - C_gw[t, r])``, kept while ``adj[g][w]`` is the same array (every
        change to an edge makes a new one): a group is re-examined each time a neighbour
        changes, and this k x k x k' maximum was most of a 3-axis simplification."""
        hit = self._regret.get((g, w))
        if hit is not None and hit[0] is mat:
            return hit[1]
        self._regret[(g, w)] = (mat, term := _max_row_difference(mat))
        return term

    def dominates(self, g: int, memory: bool) -> np.ndarray:
        """``D[t', t]``: t' holds no more memory and recomputes no slower than t."""
        k = len(self.cost[g])
        ok = np.ones((k, k), dtype=bool)
        vectors = list(self.forward[g].values())
        if memory:
            vectors += [self.param[g]] + [it.bytes for it in self.items[g]]
            for it in self.eitems.get(g, ()):  # every row of a pairwise item: t' holds no more whatever the other picks
                mat = it.oriented(g)
                ok &= (mat[:, None, :] <= mat[None, :, :]).all(axis=2)
        for vec in vectors:
            ok &= vec[:, None] <= vec[None, :]
        return ok

    def comparisons(self, g: int, skip: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
        """(per-option cost, regret) pairs a dominance test of group ``g`` must pass: the plain
        ones, or with overlap those of ``max(C - rho A, C - W)`` (module docstring)."""
        if self.rho is None:
            return [(self.cost[g], self.regret(g, skip))]
        return [(self.cost[g] - self.rho * self.asy[g], self.regret(g, skip, rho=self.rho)),
                (self.cost[g] - self.ovl[g], self.regret(g, skip))]

    def prune_dominated(self, g: int, memory: bool) -> bool:
        k = len(self.cost[g])
        if k == 1:
            return False
        dom = self.dominates(g, memory)
        for c, regret in self.comparisons(g):
            dom &= c[:, None] - c[None, :] + regret <= _EPS * (1.0 + np.abs(c).max())
        np.fill_diagonal(dom, False)
        keep = np.ones(k, dtype=bool)
        for t in np.flatnonzero(dom.any(axis=0)):  # sequential so that of two equal options exactly one survives
            if (dom[:, t] & keep).any():
                keep[t] = False
        if keep.all():
            return False
        self.restrict(g, np.flatnonzero(keep))
        return True

    def restrict(self, g: int, kept: np.ndarray) -> None:
        self.cost[g] = self.cost[g][kept]
        self.param[g] = self.param[g][kept]
        if self.rho is not None:
            self.asy[g], self.ovl[g] = self.asy[g][kept], self.ovl[g][kept]
        self.forward[g] = {s: v[kept] for s, v in self.forward[g].items()}
        self.items[g] = [MemItem(g, it.start, it.end, it.bytes[kept], it.segment) for it in self.items[g]]
        for it in list(self.eitems.get(g, ())):
            self.drop_eitem(it)
            self.add_eitem(EdgeItem(it.a, it.b, it.start, it.end,
                                    it.bytes[kept, :] if it.a == g else it.bytes[:, kept]))
        for w in list(self.adj[g]):
            self.adj[g][w] = self.adj[g][w][kept, :]
            self.adj[w][g] = self.adj[g][w].T
        for w in list(self.aadj[g]):
            self.aadj[g][w] = self.aadj[g][w][kept, :]
            self.aadj[w][g] = self.aadj[g][w].T
        for node in self.group_members[g]:
            self.member[node] = (g, self.member[node][1][kept])

    def try_follow(self, v: int, u: int, memory: bool) -> bool:
        """Merge v into neighbour u when following u is exact (module docstring, item 4)."""
        c_uv = self.adj[u][v]  # [s_u, t_v]
        q = self.cost[v][None, :] + c_uv
        best = q.argmin(axis=1)
        rows = np.arange(len(best))
        m_uv = self.aadj[u].get(v) if self.rho is not None else None
        # The pair's own edge in each comparison: C_uv, less rho M_uv in the first overlap one.
        pairs = [c_uv] if self.rho is None else [c_uv if m_uv is None else c_uv - self.rho * m_uv, c_uv]
        for (cost, regret), pair in zip(self.comparisons(v, skip=u), pairs):
            c = cost[None, :] + pair
            loss = c[rows, best][:, None] - c + regret[best, :]
            if (loss > _EPS * (1.0 + np.abs(c).max())).any():
                return False
        if not self.dominates(v, memory)[best, :].all():
            return False
        self.cost[u] = self.cost[u] + q[rows, best]
        self.param[u] = self.param[u] + self.param[v][best]
        if self.rho is not None:
            self.asy[u] = self.asy[u] + self.asy[v][best] + (0.0 if m_uv is None else m_uv[rows, best])
            self.ovl[u] = self.ovl[u] + self.ovl[v][best]
        for seg, vec in self.forward[v].items():
            mine = self.forward[u].setdefault(seg, np.zeros(len(best)))
            self.forward[u][seg] = mine + vec[best]
        self.items[u] += [MemItem(u, it.start, it.end, it.bytes[best], it.segment) for it in self.items[v]]
        for it in list(self.eitems.get(v, ())):  # v's pairwise items move onto u through best
            self.drop_eitem(it)
            w = it.b if it.a == v else it.a
            moved = it.oriented(v)[best, :]  # [s_u, options of w]
            if w == u:
                self.items[u].append(MemItem(u, it.start, it.end, moved[rows, rows].copy()))
            else:
                self.add_eitem(EdgeItem(u, w, it.start, it.end, moved))
        self.drop_edge(u, v)
        for w, mat in list(self.adj[v].items()):
            asy = self.aadj[v].get(w)
            self.drop_edge(v, w)
            self.add_edge(u, w, mat[best, :], None if asy is None else asy[best, :])
        for node in self.group_members[v]:
            self.member[node] = (u, self.member[node][1][best])
        self.group_members[u] += self.group_members[v]
        for table in (self.cost, self.param, self.forward, self.items, self.adj, self.group_members, self.asy,
                      self.ovl, self.aadj, self.eitems):
            table.pop(v, None)
        return True


# Up to this many k x k x k' entries the maximum is taken directly: finding distinct rows costs
# more than it saves on 2-axis meshes (k ~ 40), and saves most on 3-axis ones (k ~ 180).
_DIRECT_MAX = 1 << 18


def _max_row_difference(mat: np.ndarray) -> np.ndarray:
    """``D[i, j] = max_r (mat[i, r] - mat[j, r])``, computed on the distinct rows and columns
    (options that differ in nothing this edge sees repeat a row; duplicate columns change no
    maximum): a k x k x k' array becomes u x u x u'."""
    if mat.shape[0] * mat.shape[0] * mat.shape[1] <= _DIRECT_MAX:
        return (mat[:, None, :] - mat[None, :, :]).max(axis=2)
    rows, inverse = np.unique(mat, axis=0, return_inverse=True)
    rows = np.unique(rows, axis=1)
    inverse = inverse.reshape(-1)
    return (rows[:, None, :] - rows[None, :, :]).max(axis=2)[np.ix_(inverse, inverse)]


def _alias_groups(problem: Problem) -> dict[str, int]:
    """Node name -> group id; identical repeated-block instances share ids position by position."""
    groups = {n.name: i for i, n in enumerate(problem.nodes)}
    instances: dict[tuple[str, int], list] = defaultdict(list)
    for n in problem.nodes:
        where = split_block(n.block)
        if where is not None:
            instances[where].append(n)
    classes: dict[tuple, list[list]] = defaultdict(list)
    names: dict[int, tuple] = {}  # id(options) -> (options, their names): repeats share the tuple

    def option_names(options: tuple) -> tuple[str, ...]:
        hit = names.get(id(options))
        if hit is None:
            hit = names[id(options)] = (options, tuple(o.name for o in options))
        return hit[1]

    for (prefix, idx), nodes in sorted(instances.items(), key=lambda kv: kv[0]):
        key = (prefix, tuple((n.signature, option_names(n.options)) for n in nodes))
        classes[key].append(nodes)
    for members in classes.values():
        template = members[0]
        for inst in members[1:]:
            for k, n in enumerate(inst):
                groups[n.name] = groups[template[k].name]
    return groups


def _worst_peak(work: _Work) -> float:
    params = sum(float(p.max()) for p in work.param.values())
    events: dict[int, float] = defaultdict(float)
    largest: dict[int, tuple] = {}  # id(bytes) -> (bytes, its max): aliased items share their arrays
    for items in work.items.values():
        for it in items:
            hit = largest.get(id(it.bytes))
            if hit is None:
                hit = largest[id(it.bytes)] = (it.bytes, float(it.bytes.max()))
            events[it.start] += hit[1]
            events[it.end + 1] -= hit[1]
    for it in {id(it): it for items in work.eitems.values() for it in items}.values():
        top = float(it.bytes.max())
        events[it.start] += top
        events[it.end + 1] -= top
    running, peak = 0.0, 0.0
    for t in sorted(events):
        running += events[t]
        peak = max(peak, running)
    return params + peak


def simplify(problem: Problem, *, alias: bool = True, merge: bool = True) -> Reduced:
    """Reduce ``problem``; ``alias``/``merge`` switch transformations 1 and 3-4 off (folding of
    separable edges is always done: it is exact and only removes variables)."""
    work = _Work(problem, alias)
    budget = problem.budget_bytes
    memory = budget is not None and _worst_peak(work) > budget
    num_folded = num_pruned = num_followed = 0
    dirty = set(work.cost)
    while dirty:
        g = dirty.pop()
        if g not in work.cost:
            continue
        for w in list(work.adj[g]):
            if work.fold_if_separable(g, w):
                num_folded += 1
                dirty.update((g, w))
        if not merge:
            continue
        if work.prune_dominated(g, memory):
            num_pruned += 1
            dirty.add(g)
            dirty.update(work.adj[g])
            continue
        for u in sorted(work.adj[g], key=lambda w: len(work.cost[w]), reverse=True):
            neighbours = set(work.adj[g])
            if work.try_follow(g, u, memory):
                num_followed += 1
                dirty.update(neighbours)
                break
    return _freeze(work, problem, memory, {
        "num_nodes": problem.num_nodes, "num_aliased": work.num_aliased, "num_folded_edges": num_folded,
        "num_pruned": num_pruned, "num_followed": num_followed,
    })


def _freeze(work: _Work, problem: Problem, memory: bool, stats: dict[str, int]) -> Reduced:
    order = sorted(work.cost)
    new = {g: i for i, g in enumerate(order)}
    edges = {}
    for a in order:
        for b, mat in work.adj[a].items():
            if new[a] < new[b]:
                edges[(new[a], new[b])] = mat
    items = tuple(MemItem(new[g], it.start, it.end, it.bytes, it.segment) for g in order for it in work.items[g])
    pairs = [EdgeItem(new[it.a], new[it.b], it.start, it.end, it.bytes)
             for it in {id(it): it for g in order for it in work.eitems.get(g, ())}.values()]
    settled, pairs = settle_edge_items(pairs, [len(work.cost[g]) for g in order])
    items += settled
    for it in pairs:  # their variables: an edge, zero-cost where the costs folded
        edges.setdefault((it.a, it.b), np.zeros(it.bytes.shape))
    picked: dict[tuple, tuple[str, ...]] = {}  # aliased nodes share their option names: build each once

    def option_names(node: str, idx: np.ndarray) -> tuple[str, ...]:
        key = (work.names[node], idx.tobytes())
        hit = picked.get(key)
        if hit is None:
            hit = picked[key] = tuple(work.names[node][i] for i in idx)
        return hit

    members = tuple(Member(node, new[grp], option_names(node, idx)) for node, (grp, idx) in work.member.items())
    stats = {**stats, "num_groups": len(order), "num_group_edges": len(edges),
             "num_options": int(sum(len(work.cost[g]) for g in order))}
    overlap = None if work.rho is None else Overlap(
        work.rho, tuple(work.asy[g] for g in order), tuple(work.ovl[g] for g in order),
        {(new[a], new[b]): m for a in order for b, m in work.aadj[a].items() if new[a] < new[b]})
    return Reduced(
        cost=tuple(work.cost[g] for g in order), param=tuple(work.param[g] for g in order),
        forward=tuple(work.forward[g] for g in order), mem_items=items, edges=edges,
        constant=work.constant, members=members, budget_bytes=problem.budget_bytes,
        timeline_length=problem.timeline_length, memory_can_bind=memory, stats=stats, overlap=overlap,
        edge_items=tuple(pairs),
    )
