"""``autopar`` command line: ``inspect`` a plan offline, ``coverage`` of sharding rules, ``calibrate``
the machine (``profile-mesh`` is its deprecated old name).

Bad input (unknown model, mesh that does not tile the device's nodes, unparsable sizes, an
infeasible budget ...) ends with exit status 1 and one line ``autopar: error: ...`` on stderr;
usage errors (unknown options) with argparse's status 2.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from dataclasses import replace

from autopar.cli.flags import add_option_flags, plan_options
from autopar.planner.options import check_count

__all__ = ["main", "build_parser"]


class CliError(ValueError):
    """Bad input found by the CLI itself."""


# ------------------------------------------------------------------------------------ parser
def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="zoo name (gpt2, gpt2-xl, llama-8b, resnet50, ...), path/to/file.py:factory, "
                   "or a Hugging Face config.json (or its folder): the class in `architectures`, built on meta")
    p.add_argument("--batch", type=int, help="batch size (zoo models; factories that take `batch`)")
    p.add_argument("--seq", type=int, help="sequence length (zoo models; factories that take `seq`)")
    p.add_argument("--layers", type=int, help="override the number of layers/blocks")
    p.add_argument("--input", action="append", metavar="NAME:DTYPE[SHAPE]",
                   help="a model input as a meta tensor, e.g. input_ids:int64[8,1024] (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autopar",
                                     description="Automatic parallelization planner for PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("inspect", help="plan a model offline and show the plan")
    _model_args(p)
    p.add_argument("--mesh", help="logical mesh shape, e.g. 8, 2x4, 4x4 (optional with a mesh JSON), or auto: "
                                  "every 1-3 axis arrangement of --nodes x --devices-per-node devices, the fastest "
                                  "kept")
    p.add_argument("--nodes", type=int, help="with --mesh auto: the number of nodes")
    p.add_argument("--devices-per-node", type=int, help="with --mesh auto: devices per node")
    add_option_flags(p)  # one flag per planning option (autopar.planner.options), in groups
    p.add_argument("--family", metavar="NAME",
                   help="plan within one family of the planner (autopar.planner.baselines): a baseline (zero1, "
                        "megatron-tp, 'dp x tp', ...) or a fixed configuration ('megatron', 'dp x megatron', "
                        "'zero1 x megatron', ...: HybridParallelPlugin's; over the stage sub-mesh with --pipeline)")
    p.add_argument("--no-layers", action="store_true", help="omit the per-layer table from the text output")
    p.add_argument("--no-cache", action="store_true",
                   help="do not store the plan in the plan cache ($AUTOPAR_CACHE_DIR, default ~/.cache/autopar/plans)")
    p.add_argument("--json", metavar="FILE", help="write the plan (loadable by autoparallelize(plan=FILE))")
    p.add_argument("--html", metavar="FILE", help="write a self-contained HTML report")
    p.add_argument("--verify", action="store_true",
                   help="run one step of the plan on --local N processes against the all-replicated plan and "
                        "compare the loss and every gradient (exit 1 naming the first diverging node)")
    p.add_argument("--local", type=int, help="with --verify: start N local processes (N = the mesh's devices)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")

    c = sub.add_parser("coverage", help="the ATen ops of a model and how each is covered (native, generic, "
                                        "decomposed, dtensor, fallback, missing)")
    _model_args(c)
    c.add_argument("--strict", action="store_true", help="exit 1 when an op has no rule")
    c.add_argument("--allow-fallback", action="store_true",
                   help="report uncovered ops as replicated by the fallback instead of missing")

    k = sub.add_parser("calibrate", help="measure this machine as a training step uses it (compute per op class, "
                                         "size and dtype; collectives per kind and axis; overlap) into a machine "
                                         "profile JSON that --preset takes")
    k.add_argument("--mesh", required=True, help="mesh shape, e.g. 2x2 (the profile serves this shape)")
    k.add_argument("--local", type=int, help="start N local processes (else run under torchrun)")
    k.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda (NCCL) where available, else cpu (gloo)")
    k.add_argument("--repeats", type=int, help="timed repetitions per point (default 5; --quick 3)")
    k.add_argument("--quick", action="store_true", help="a smaller grid, fewer sizes and repetitions (tests)")
    k.add_argument("--out", "-o", required=True, metavar="FILE", help="where to write the profile JSON")
    k.add_argument("-q", "--quiet", action="store_true", help="no progress lines")

    m = sub.add_parser("profile-mesh", help="deprecated: autopar calibrate")
    m.add_argument("--mesh", required=True, help="mesh shape, e.g. 2x2")
    m.add_argument("--local", type=int, help="start N local processes (else run under torchrun)")
    m.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda (NCCL) where available, else cpu (gloo)")
    m.add_argument("--repeats", type=int, default=5)
    m.add_argument("-o", "--output", dest="out", required=True, metavar="FILE", help="where to write the JSON")
    m.set_defaults(quick=False, quiet=True)
    return parser


# ----------------------------------------------------------------------------------- helpers
# What the planner's messages tell a library user to pass -> the flag that does it here (the
# options' own checks name the flag already: cli.flags).
_FLAG_WORDS = {"pass allow_replicate_fallback=True": "pass --allow-fallback"}


def _one_line(exc: BaseException) -> str:
    text = " ".join(part.strip() for part in str(exc).strip().splitlines() if part.strip())
    for word, flag in _FLAG_WORDS.items():
        text = text.replace(word, flag)
    return text or type(exc).__name__


def _check_writable(path: str | None, flag: str) -> None:
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CliError(f"{flag} {path}: folder {folder} does not exist")
    if os.path.isdir(path):
        raise CliError(f"{flag} {path} is a folder")


# ---------------------------------------------------------------------------------- commands
def cmd_inspect(args) -> int:
    from autopar import api
    from autopar.cli.inputs import check_model_spec, load_model, resolve_mesh
    from autopar.cli.progress import StageSink

    t0 = time.perf_counter()
    for flag in ("batch", "seq", "layers"):
        check_count(getattr(args, flag), name=f"--{flag}", words=(None,))
    # Cheap checks first (no torch import): bad input fails in well under a second.
    auto = args.mesh == "auto"
    if auto:
        for flag in ("nodes", "devices_per_node"):
            if getattr(args, flag) is None:
                raise ValueError("--mesh auto needs --nodes and --devices-per-node")
            check_count(getattr(args, flag), name="--" + flag.replace("_", "-"))
        mesh = None
    else:
        if args.nodes is not None or args.devices_per_node is not None:
            raise ValueError("--nodes and --devices-per-node go with --mesh auto")
        mesh = resolve_mesh(args.preset, args.mesh, flag=args.preset_flag)
    options = plan_options(args)  # the preset goes with the mesh (resolve_mesh: a name or a profiled JSON)
    if isinstance(options.pipeline, int) and auto:
        raise CliError("--pipeline plans over the given mesh's first axis, without --mesh auto")
    _check_family(args, auto=auto)
    _check_verify(args, mesh)
    _check_writable(args.json, "--json")
    _check_writable(args.html, "--html")
    check_model_spec(args.model, args.input)
    sink = StageSink(quiet=args.quiet)
    progress = api.Progress(verbose=True, sink=sink)
    candidates: tuple[str, ...] = ()  # the default's pipelines considered, when a plan without one wins
    try:
        with progress.stage("build model", args.model):
            model, meta = load_model(args.model, batch=args.batch, seq=args.seq, layers=args.layers, inputs=args.input)
        with warnings.catch_warnings():
            # One summary line replaces a warning per replicated op.
            warnings.filterwarnings("ignore", message="no sharding rule")
            if isinstance(options.pipeline, int):
                return _inspect_pipelined(api.plan_pipelined(model, meta, mesh=mesh, options=options,
                                                             progress=progress, family=args.family),
                                          args, t0=t0, sink=sink)
            if args.family is not None:
                return _inspect_family(model, meta, args, mesh=mesh, options=options, t0=t0, sink=sink)
            if auto:
                # --time-limit bounds the whole command, building the model included.
                search = api.plan_mesh_auto(model, meta, nodes=args.nodes, devices_per_node=args.devices_per_node,
                                            options=replace(options, preset=args.preset), progress=progress,
                                            time_budget=max(options.time_limit - (time.perf_counter() - t0), 1.0))
                result = search.best
            elif options.pipeline == "auto" and mesh.shape[0] > 1 and not args.verify:
                # The default: pipelines over axis 0 are candidates; a plan without one is reported as usual.
                key = api.cache_key(model, meta, mesh=mesh, options=options, cache=not args.no_cache)
                chosen = api.plan_auto(model, meta, mesh=mesh, options=options, progress=progress, key=key)
                if chosen.flat is None or chosen.plan.pipeline is not None:
                    return _inspect_pipelined(chosen, args, t0=t0, sink=sink)
                result, candidates = chosen.flat, chosen.candidates
            else:
                result = api.plan_model(model, meta, mesh=mesh,
                                        options=replace(options, pipeline=None) if args.verify else options,
                                        progress=progress, cache=not args.no_cache)
        with progress.stage("report"):
            report = _report(result, args)
    finally:
        sink.close()
    report.wall_s = time.perf_counter() - t0
    from autopar.report import render_text

    if auto:
        print(f"mesh search: {args.nodes} nodes x {args.devices_per_node} {args.preset} devices, "
              f"{len(search.rows)} meshes\n{search.table()}\n")
    print(render_text(report, layers=not args.no_layers))
    if candidates:
        print("\npipeline candidates:\n" + "\n".join(f"  {line}" for line in candidates))
    print(f"\nplanned in {report.wall_s:.1f}s" + "".join(f"; wrote {p}" for p in (args.json, args.html) if p))
    return _verify_locally(model, meta, result.plan, args.local) if args.verify else 0


def _check_verify(args, mesh) -> None:
    if args.local is not None and not args.verify:
        raise CliError("--local N goes with --verify")
    if not args.verify:
        return
    if _pipelined(args):
        raise CliError("--verify: pipelined plans are not verified yet")
    if args.local is None:
        raise CliError("--verify runs the plan on local processes: pass --local N (N = the mesh's devices)")
    devices = mesh.num_devices if mesh is not None else args.nodes * args.devices_per_node
    if args.local != devices:
        raise CliError(f"--local {args.local}: the mesh has {devices} devices; pass --local {devices}")


def _verify_locally(model, meta, plan, processes: int) -> int:
    """One step of ``plan`` on ``processes`` gloo ranks against the all-replicated plan (inputs
    made up from the meta shapes, weights from the model's own initialisation)."""
    import autopar
    from autopar.runtime.launch import run_local

    def check(rank, world):
        try:
            return str(autopar.verify(model, meta, plan))
        except (autopar.PlanVerificationError, NotImplementedError) as exc:
            return exc

    t0 = time.perf_counter()
    outcome = run_local(check, processes, timeout=600)[0]
    if isinstance(outcome, NotImplementedError):
        print(f"\nverify could not run: {outcome}")
        return 1
    if isinstance(outcome, Exception):
        print(f"\nverify FAILED on {processes} local processes: {outcome}")
        return 1
    print(f"\n{outcome} on {processes} local processes (in {time.perf_counter() - t0:.1f}s)")
    return 0


def _pipelined(args) -> bool:
    """Whether ``--pipeline`` asks for a pipeline of a given size (its default "auto" only allows one)."""
    return isinstance(args.pipeline, int) and args.pipeline > 1


def _check_family(args, *, auto: bool) -> None:
    if args.family is None:
        return
    from autopar.planner.baselines import BASELINES, FIXED_FAMILIES

    if args.family not in BASELINES + FIXED_FAMILIES:
        raise CliError(f"--family {args.family!r}: known families are {', '.join(BASELINES + FIXED_FAMILIES)}")
    if auto:
        raise CliError("--family plans on the given mesh, without --mesh auto")
    if args.verify or (args.html and not _pipelined(args)):
        raise CliError("--family (without --pipeline) writes the plan's summary and --json; not --html or --verify")


def _inspect_family(model, meta, args, *, mesh, options, t0: float, sink) -> int:
    """--family: the family's plan (``plan_family``): its summary and every parameter's layout."""
    from autopar.planner.orchestrate import plan_family
    from autopar.plans import NodeKind

    if args.family.startswith("zero"):  # a ZeRO family picks among the problem's per-parameter stages
        options = replace(options, zero_stage="auto")
    plan = plan_family(model, meta, args.family, mesh=mesh, options=replace(options, checkpoint="none"))
    sink.close()
    print(plan.summary())
    print(f"parameters ({args.family}):")
    for node in plan.by_kind(NodeKind.PARAMETER):
        print(f"  {node.module}: {node.output_specs[0]}" + (f" ZeRO-{node.zero_stage}" if node.zero_stage else ""))
    if args.json:
        plan.save(args.json)
    print(f"\nplanned in {time.perf_counter() - t0:.1f}s" + (f"; wrote {args.json}" if args.json else ""))
    return 0


def _inspect_pipelined(result, args, *, t0: float, sink) -> int:
    """--pipeline: the plan's summary (its stage table) and every candidate tried."""
    sink.close()
    print(result.plan.summary())
    print("candidates:\n" + "\n".join(f"  {line}" for line in result.candidates))
    if args.json:
        result.plan.save(args.json)
    if args.html:
        from autopar.report.pipeline_html import render_pipeline

        with open(args.html, "w") as f:
            f.write(render_pipeline(result.plan, candidates=result.candidates))
    written = "".join(f"; wrote {p}" for p in (args.json, args.html) if p)
    print(f"\nplanned in {time.perf_counter() - t0:.1f}s{written}")
    return 0


def _report(result, args):
    from autopar.report import build_report, render_html

    report = build_report(result.plan, result)
    if args.json:
        result.plan.save(args.json)
    if args.html:
        with open(args.html, "w") as f:
            f.write(render_html(report))
    return report


def cmd_coverage(args) -> int:
    from autopar.cli.inputs import load_model
    from autopar.planner.orchestrate import trace_for_planning
    from autopar.strategies import rule_source
    from autopar.strategies.registry import needs_no_decision
    from autopar.tracer import coverage
    from autopar.tracer.graph import op_name

    model, meta = load_model(args.model, batch=args.batch, seq=args.seq, layers=args.layers, inputs=args.input)
    traced = trace_for_planning(model, meta, precision="fp32")
    uncovered = "fallback" if args.allow_fallback else "MISSING"
    status: dict[str, str] = {}
    for node in traced.compute_nodes():
        name = op_name(node)
        if name not in status:
            status[name] = rule_source(node.target) or ("no decision" if needs_no_decision(node) else uncovered)
    table = coverage(traced)
    width = max([len(r.op) for r in table] + [len(op) for op in traced.decomposed])
    print(f"{'op':<{width}}  {'count':>5}  {'rule':<11}  first seen in")
    print(f"{'-' * width}  -----  -----------  -------------")
    for r in table:
        print(f"{r.op:<{width}}  {r.count:>5}  {status[r.op]:<11}  {r.first_module or '<top level>'}")
    for op, pieces in sorted(traced.decomposed.items()):
        print(f"{op:<{width}}  {'-':>5}  {'decomposed':<11}  into {', '.join(pieces)}")
    missing = [r for r in table if status[r.op] == uncovered]
    by_source = {src: sum(1 for r in table if status[r.op] == src) for src in ("native", "generic", "dtensor")}
    print(f"{len(table)} distinct ops, {sum(r.count for r in table)} op nodes; "
          + ", ".join(f"{n} {src}" for src, n in by_source.items()) + f", {len(traced.decomposed)} decomposed; "
          f"{len(missing)} ops ({sum(r.count for r in missing)} nodes) without a sharding rule"
          + (" (replicated by the fallback)" if args.allow_fallback and missing else ""))
    return 1 if args.strict and missing and not args.allow_fallback else 0


def cmd_calibrate(args) -> int:
    from autopar.layout.mesh import parse_mesh_shape
    from autopar.runtime.calibrate import calibrate

    shape = parse_mesh_shape(args.mesh)
    if args.repeats is not None:
        check_count(args.repeats, name="--repeats")
    _check_writable(args.out, "--out")
    if args.local is None and "RANK" not in os.environ:
        raise CliError(f"{args.command} needs processes: pass --local N, or run it under torchrun")
    mesh = calibrate(shape, device=args.device, local=args.local, repeats=args.repeats, quick=args.quick,
                     out=args.out, verbose=not args.quiet)
    if os.environ.get("RANK", "0") != "0":
        return 0  # under torchrun every rank measures; rank 0 writes and reports
    for name, size, a, b in zip(mesh.axis_names, mesh.shape, mesh.alpha, mesh.beta):
        bw = f"{1 / b / 1e9:.2f} GB/s" if b else "n/a"
        print(f"axis {name} (n={size}): alpha {a * 1e6:.1f} us, beta {b * 1e9:.3f} ns/B ({bw})")
    for fit in mesh.machine.links if mesh.machine is not None else ():
        if len(fit.axes) > 1 and fit.kind == "all_reduce":  # the group a bucket over several axes sums on
            names, size = "+".join(mesh.axis_names[a] for a in fit.axes), math.prod(mesh.shape[a] for a in fit.axes)
            print(f"axes {names} (n={size}) all-reduce: alpha {fit.alpha * 1e6:.1f} us, beta {fit.beta * 1e9:.3f} ns/B")
    half = f", bf16 {mesh.half_peak_flops / 1e9:.1f} GFLOP/s" if mesh.half_peak_flops else ""
    print(f"device: {mesh.peak_flops / 1e9:.1f} GFLOP/s fp32 matmul{half}, {mesh.mem_bandwidth / 1e9:.2f} GB/s; "
          f"{mesh.comm_overlap:.0%} of a collective hidden under compute; wrote {args.out}")
    if args.command == "profile-mesh":
        print("note: profile-mesh is deprecated; it ran `autopar calibrate`, which is the same measurement")
    return 0


def _is_planner_error(exc: RuntimeError) -> bool:
    """Trace failures and solver time-outs are the user's to fix; other RuntimeErrors are bugs."""
    from autopar.solver.driver import SolveTimeout
    from autopar.tracer import TraceError

    return isinstance(exc, (TraceError, SolveTimeout))


_COMMANDS = {"inspect": cmd_inspect, "coverage": cmd_coverage, "calibrate": cmd_calibrate,
             "profile-mesh": cmd_calibrate}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except (ValueError, LookupError, OSError, RuntimeError) as exc:
        if isinstance(exc, RuntimeError) and not _is_planner_error(exc):
            raise  # an internal bug: keep the traceback for the report
        print(f"autopar: error: {_one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
