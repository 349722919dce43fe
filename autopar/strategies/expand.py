"""The central expander: single-axis rule options -> whole-mesh ``Strategy`` records with costs.

For a node on a mesh of ``d`` axes:

1. the rule gives its options for one axis; the all-replicate option is always added, and an
   axis of size 1 keeps only that option (any other choice is the same layout, renamed);
2. options that cannot split a dim evenly on that axis alone are dropped early;
3. the cartesian product over axes is formed; a combination is kept only if every input and
   output spec is valid on the whole mesh (a dim sharded by several axes must divide by their
   product; the lower axis is the major digit -- ``TensorSpec.local_slices``), at most one custom
   kernel is involved, and the rule's ``combine_check`` (if any) accepts it;
4. duplicates (same input and output specs) are dropped, the first kept;
   (``fixed``: one axis may be pinned to given placements, e.g. the placements a plan on a
   coarser mesh chose there -- ``autopar.planner.mesh_search``'s restricted 3-axis plans; only
   that axis's matching options enter the product, so the result is the subset of the full
   enumeration whose strategies place every tensor so on that axis;)
5. costs are filled in: compute = forward + backward roofline on the local work (FLOPs divided by
   the product of the work-splitting axes, bytes from the local shard sizes); communication =
   the backward all-reduce of every partial input gradient + the kernel's own collectives.

Steps 3-5 live in ``autopar.strategies.combine`` (the DTensor admission check uses them too).
"""

from __future__ import annotations

import dataclasses
import warnings

import torch.fx

from autopar.layout.mesh import MeshSpec
from autopar.layout.placement import Placement
from autopar.strategies.combine import build_strategies, estimate_flops, fits_axis, normalise_option, replicate_option
from autopar.strategies.registry import AxisOption, NoRuleError, OpInfo, RuleEntry, Strategy, draws_random
from autopar.strategies.derived import rule_for
from autopar.strategies.fused import fused_segments

__all__ = ["strategies_for", "op_info", "enumerate_strategies", "axis_options", "FixedAxis", "axis_placements"]

# (axis, placement of each input slot, placement of each output) -- None: no constraint there
FixedAxis = tuple[int, tuple[Placement | None, ...], tuple[Placement | None, ...]]


def axis_placements(strategy: Strategy, axis: int) -> FixedAxis:
    """What ``strategy`` places on mesh axis ``axis``, as ``enumerate_strategies(fixed=)`` takes it."""
    def on(specs):
        return tuple(None if spec is None else spec.placements[axis] for spec in specs)

    return axis, on(strategy.input_specs), on(strategy.output_specs)


def strategies_for(node: torch.fx.Node, mesh: MeshSpec, *, flops: tuple[float, float] | None = None,
                   allow_replicate_fallback: bool = False, reduce_itemsize: int | None = None,
                   fixed: FixedAxis | None = None) -> list[Strategy]:
    """All candidate strategies of an fx node (``call_function`` on an ATen overload).

    ``flops``: (forward, backward) FLOPs of the whole op, e.g. from the tracer's profile; when
    None they are counted with ``torch.utils.flop_counter`` on fake tensors (cached).
    ``reduce_itemsize``: bytes per element partial gradients are summed in when that is wider
    than the input (bf16 gradients summed in fp32: 4); None = the input's own.
    ``fixed``: only the strategies placing every tensor on one axis as given (``FixedAxis``).
    """
    return enumerate_strategies(op_info(node), mesh, flops=flops,
                                allow_replicate_fallback=allow_replicate_fallback, reduce_itemsize=reduce_itemsize,
                                fixed=fixed)


def op_info(node: torch.fx.Node) -> OpInfo:
    """``OpInfo.from_node`` with the segment counts of a fused projection's way to its cut
    (``strategies.fused``): what the rules and their ``local_args`` see of a graph node."""
    return dataclasses.replace(OpInfo.from_node(node), segments=fused_segments(node))


def enumerate_strategies(info: OpInfo, mesh: MeshSpec, *, flops: tuple[float, float] | None = None,
                         allow_replicate_fallback: bool = False, reduce_itemsize: int | None = None,
                         fixed: FixedAxis | None = None) -> list[Strategy]:
    entry = rule_for(info.target)
    if draws_random(info.target, info.bound) and (entry is None or entry.kernel_for is None
                                                  or entry.kernel_for(info) is None):
        # A draw only a mesh-invariant kernel may make (``_random.py``): a plain op, a generic or
        # DTensor-derived rule or the fallback would draw from each rank's own torch generator.
        raise NoRuleError(info.target, info.node_name, info.module_path, random=True)
    if entry is None:
        if not allow_replicate_fallback:
            raise NoRuleError(info.target, info.node_name, info.module_path)
        warnings.warn(f"no sharding rule for {info.where()}: replicating it on every device",
                      stacklevel=2)
        options = [[replicate_option(info)]] * mesh.ndim
        return build_strategies(info, mesh, None, options, flops or (0.0, 0.0), fallback=True,
                                reduce_itemsize=reduce_itemsize)
    per_axis = []
    base = axis_options(entry, info)
    for size in mesh.shape:
        if size == 1:
            per_axis.append([replicate_option(info)])
        else:
            per_axis.append([o for o in base if fits_axis(info, o, size)])
    if fixed is not None:
        per_axis[fixed[0]] = _matching(per_axis[fixed[0]], fixed, info)
    if flops is None:
        flops = estimate_flops(info) if entry.has_flops else (0.0, 0.0)
    return build_strategies(info, mesh, entry, per_axis, flops, fallback=False, reduce_itemsize=reduce_itemsize)


def _matching(options: list[AxisOption], fixed: FixedAxis, info: OpInfo) -> list[AxisOption]:
    """The axis options placing each tensor as ``fixed`` says (None there: anything)."""
    axis, ins, outs = fixed
    if len(ins) != len(info.slots) or len(outs) != len(info.outputs):
        raise ValueError(f"fixed placements on axis {axis} for {info.where()}: {len(ins)} inputs / {len(outs)} "
                         f"outputs given, the op has {len(info.slots)} input slots / {len(info.outputs)} outputs")
    want = ins + outs
    kept = [o for o in options if all(w is None or w == p for w, p in zip(want, o.inputs + o.outputs))]
    if not kept:
        raise ValueError(f"no option of {info.where()} places its tensors {want} on mesh axis {axis}")
    return kept


# ---------------------------------------------------------------------------------- options
def axis_options(entry: RuleEntry, info: OpInfo) -> list[AxisOption]:
    """The rule's options for one axis, normalised, replicate first, duplicates removed."""
    out = [replicate_option(info)]
    seen = {(out[0].inputs, out[0].outputs)}
    for opt in entry.rule(info):
        opt = normalise_option(info, opt)
        key = (opt.inputs, opt.outputs)
        if key not in seen:
            seen.add(key)
            out.append(opt)
    return out
