"""Synthetic ILP planner benchmark: random DAGs and repeated-block depth sweeps.

    .venv/bin/python benchmarks/ilp_synthetic.py [--time-limit 120] [--sizes 800,2000]
        [--depths 12,24,48,96] [--backends highs,cbc] [--jsonl out.jsonl]

Random DAGs: a chain with skip edges; every node has 4-16 options, each with a layout label
(4 labels); resharding costs are 0 between equal labels and random otherwise, so following a
producer is cheap but not free of trade-offs. Activations live from their forward point to the
mirrored backward point; the budget is set between the smallest and the largest possible peak
so the memory rows bind. Depth sweep: ``h.<i>`` blocks of identical nodes, showing that
repeated-block aliasing keeps the solve time nearly flat in depth.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autopar.solver.ilp import available_backends  # noqa: E402
from autopar.solver.driver import SolveTimeout, solve  # noqa: E402
from autopar.solver.problem import Edge, Node, Problem, StrategyOption  # noqa: E402

MiB = 1 << 20


def _options(rng: random.Random, k: int, *, param: bool) -> tuple[StrategyOption, ...]:
    opts = []
    for j in range(k):
        shard = rng.choice([1, 2, 4, 8])
        opts.append(StrategyOption(
            name=f"L{j % 4}_{j}", compute_s=rng.uniform(1e-3, 4e-3) / shard, comm_s=rng.uniform(0, 1e-3),
            param_bytes=(64 * MiB // shard) if param else 0, act_bytes=rng.randint(4, 32) * MiB // shard,
            forward_s=0.0,
        ))
    return tuple(opts)


def _edge(rng: random.Random, a: Node, b: Node, *, labelled: bool = True) -> Edge:
    """Labelled: free between equal layout labels, random otherwise. Unlabelled: all random."""
    costs = [[0.0 if labelled and oa.name[:2] == ob.name[:2] else rng.uniform(2e-4, 2e-3) for ob in b.options]
             for oa in a.options]
    return Edge(a.name, b.name, costs)


def random_dag(n: int, *, seed: int = 0, skip: float = 0.3, labelled: bool = True) -> Problem:
    rng = random.Random(seed)
    nodes = [Node(f"n{i}", _options(rng, rng.randint(4, 16), param=rng.random() < 0.3), live=(i, 2 * n - 1 - i))
             for i in range(n)]
    edges = [_edge(rng, nodes[i - 1], nodes[i], labelled=labelled) for i in range(1, n)]
    for i in range(2, n):
        if rng.random() < skip:
            edges.append(_edge(rng, nodes[rng.randrange(0, i - 1)], nodes[i], labelled=labelled))
    return Problem(tuple(nodes), tuple(edges), None, 2 * n, (8,), {"case": f"dag{n}"})


def repeated_blocks(depth: int, *, per_block: int = 12, seed: int = 0) -> Problem:
    rng = random.Random(seed)
    template = [_options(rng, rng.randint(4, 16), param=j % 3 == 0) for j in range(per_block)]
    # Identical blocks have identical edges: inside a block (j -> j+1) and block to block (last -> first).
    inner = [_edge(rng, Node("a", template[j], live=(0, 0)), Node("b", template[j + 1], live=(0, 0))).costs
             for j in range(per_block - 1)]
    carry = _edge(rng, Node("a", template[-1], live=(0, 0)), Node("b", template[0], live=(0, 0))).costs
    n = depth * per_block + 2
    embed = Node("embed", _options(rng, 8, param=True), live=(0, 2 * n - 1))
    nodes, edges = [embed], []
    for d in range(depth):
        for j, opts in enumerate(template):
            i = len(nodes)
            node = Node(f"h{d}_op{j}", opts, live=(i, 2 * n - 1 - i), block=f"h.{d}", signature=f"op{j}")
            if j > 0:
                costs = inner[j - 1]
            else:
                costs = carry if d > 0 else _edge(rng, embed, node).costs
            edges.append(Edge(nodes[-1].name, node.name, costs))
            nodes.append(node)
    head = Node("head", _options(rng, 8, param=True), live=(n - 1, n))
    edges.append(_edge(rng, nodes[-1], head))
    nodes.append(head)
    return Problem(tuple(nodes), tuple(edges), None, 2 * n, (8,), {"case": f"blocks{depth}"})


def binding_budget(p: Problem, free_peak: int, frac: float = 0.5) -> Problem:
    """A budget ``frac`` of the way from the smallest-footprint choice's peak to the peak of the
    unconstrained optimum ``free_peak``: below the latter, so the memory rows bind."""
    small = p.evaluate({n.name: min(n.options, key=lambda o: o.act_bytes + o.param_bytes).name for n in p.nodes})
    return p.with_budget(int(small.peak_bytes + frac * max(0, free_peak - small.peak_bytes)))


def run_case(name: str, problem: Problem, backend: str, time_limit: float) -> dict:
    t0 = time.perf_counter()
    try:
        sol = solve(problem, solver=backend, time_limit=time_limit)
    except (SolveTimeout, ValueError) as exc:
        return {"case": name, "nodes": problem.num_nodes, "backend": backend, "status": type(exc).__name__,
                "total_s": time.perf_counter() - t0, "error": str(exc)[:200]}
    return {"case": name, "nodes": problem.num_nodes, "backend": backend, "status": sol.status,
            "budget": "none" if problem.budget_bytes is None else f"{sol.peak_bytes / problem.budget_bytes:.0%}",
            "groups": sol.stats["num_groups"], "vars": sol.num_variables, "rows": sol.num_constraints,
            **{k: round(v, 3) for k, v in sol.timings.items()}, "total_s": round(time.perf_counter() - t0, 3),
            "objective": sol.objective, "lp_bound": sol.lp_bound, "gap": sol.gap,
            "peak_MiB": sol.peak_bytes / MiB,
            "budget_MiB": None if problem.budget_bytes is None else problem.budget_bytes / MiB}


def _print(row: dict) -> None:
    if "error" in row:
        print(f"{row['case']:>10} {row['nodes']:>6} {row['backend']:>6} {'':>6} {row['status']:>9} "
              f"total {row['total_s']:.1f}s  {row['error']}", flush=True)
        return
    print(f"{row['case']:>10} {row['nodes']:>6} {row['backend']:>6} {row['budget']:>6} {row['status']:>9} "
          f"{row['groups']:>6} {row['vars']:>7} {row['rows']:>7} {row['simplify_s']:>7.2f} {row['build_s']:>7.2f} "
          f"{row['lp_s']:>7.2f} {row['solve_s']:>7.2f} {row['total_s']:>7.2f} {row['objective']:>10.5f} "
          f"{row['lp_bound']:>10.5f} {row['gap']:>7.2%}", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--time-limit", type=float, default=120.0)
    ap.add_argument("--sizes", default="800,2000")
    ap.add_argument("--random-sizes", default="800", help="DAGs with unstructured (all random) reshard costs")
    ap.add_argument("--depths", default="12,24,48,96")
    ap.add_argument("--backends", default=",".join(available_backends()))
    ap.add_argument("--jsonl", default=None, help="append one JSON line per case")
    args = ap.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    print("budget: none, or the plan's peak as a share of a budget set below the unconstrained optimum's peak")
    print(f"{'case':>10} {'nodes':>6} {'solver':>6} {'budget':>6} {'status':>9} {'groups':>6} {'vars':>7} {'rows':>7} "
          f"{'simpl_s':>7} {'build_s':>7} {'lp_s':>7} {'solve_s':>7} {'total_s':>7} {'objective':>10} "
          f"{'lp_bound':>10} {'gap':>7}")
    rows = []
    cases = [(f"dag{n}", random_dag(int(n))) for n in args.sizes.split(",") if n]
    cases += [(f"dagR{n}", random_dag(int(n), labelled=False)) for n in args.random_sizes.split(",") if n]
    cases += [(f"blocks{d}", repeated_blocks(int(d))) for d in args.depths.split(",") if d]
    for name, problem in cases:
        free = run_case(name, problem, backends[0], args.time_limit)
        _print(free)
        rows.append(free)
        if "peak_MiB" not in free:
            continue
        bound = binding_budget(problem, round(free["peak_MiB"] * MiB))
        for backend in backends:
            row = run_case(name, bound, backend, args.time_limit)
            _print(row)
            rows.append(row)
    if args.jsonl:
        with open(args.jsonl, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
