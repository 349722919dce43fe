"""What every rank of an ``autoparallelize`` launch must agree on, checked collectively.

Each rank fingerprints its inputs (graph hash, mesh, plan, options, versions); one
``all_gather_object`` compares them, and every rank raises the same error when any rank failed
or the ranks differ -- a rank that went on alone would hang in its first collective. Also the
``mesh="auto"`` world layout (``world_cluster``) and the check of a given plan's options.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from autopar.planner.options import precision_name

if TYPE_CHECKING:
    from autopar.layout.mesh import MeshSpec
    from autopar.plans import Plan

__all__ = ["world_cluster"]


def world_cluster(world: int, nodes: int | None, devices_per_node: int | None,
                  environ: dict | None = None) -> tuple[int, int]:
    """``(nodes, devices per node)`` of a ``world``-rank launch for ``mesh="auto"``: as given,
    the missing one from the other, devices per node from ``LOCAL_WORLD_SIZE`` (set by torchrun)
    when neither is given, else one node. ``ValueError`` when they do not multiply to ``world``."""
    env = os.environ if environ is None else environ
    for name, value in (("nodes", nodes), ("devices_per_node", devices_per_node)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    source = "given"
    if nodes is None and devices_per_node is None:
        local = env.get("LOCAL_WORLD_SIZE")
        if local is not None:
            if not local.isdigit() or int(local) < 1:
                raise ValueError(f"LOCAL_WORLD_SIZE={local!r} is not a positive int")
            devices_per_node, source = int(local), f"LOCAL_WORLD_SIZE={local}"
        else:
            devices_per_node = world
    if nodes is None:
        nodes = world // devices_per_node
    if devices_per_node is None:
        devices_per_node = world // nodes
    if nodes * devices_per_node != world:
        raise ValueError(f"mesh='auto': {nodes} nodes x {devices_per_node} devices per node ({source}) is not the "
                         f"world size {world}")
    return nodes, devices_per_node


def _check_plan_options(plan: Plan, *, precision, reduce_dtype, zero_stage) -> None:
    for what, asked, planned in (("precision", precision, plan.precision),
                                 ("reduce_dtype", reduce_dtype, plan.reduce_dtype)):
        if asked is not None and precision_name(asked, what=what) != planned:
            raise ValueError(f"{what}={asked!r} but the plan was made for {planned}; "
                             f"plan again or leave {what} out")
    planned_zero = max((n.zero_stage for n in plan.nodes), default=0)
    if zero_stage not in (None, "auto") and zero_stage != planned_zero:
        raise ValueError(f"zero_stage={zero_stage!r} but the plan was made with ZeRO stage {planned_zero}; "
                         f"plan again or leave zero_stage out")


def _fingerprint(traced, meta_inputs, *, world: int, spec: MeshSpec | None, plan: Plan | None, source: str,
                 device, options: dict, auto: tuple[int, int] | None = None) -> tuple[tuple[str, str, str], ...]:
    """What every rank must agree on: (what, key compared across ranks, what the error shows)."""
    import hashlib

    import torch

    from autopar import __version__
    from autopar.plans import PLAN_VERSION

    versions = f"autopar {__version__} (plan format {PLAN_VERSION}), torch {torch.__version__}"
    graph = traced.graph_hash
    mesh = ("the plan's" if spec is None and auto is None else
            f"auto over {auto[0]} nodes x {auto[1]} devices" if spec is None else
            f"{spec.shape} axes {spec.axis_names}")
    if plan is None:
        plan_key = plan_shown = source
    else:
        plan_key = hashlib.sha256(plan.to_json().encode()).hexdigest()[:16]
        plan_shown = (f"{source} (content {plan_key}, for graph {plan.graph_hash} on mesh {plan.mesh.shape})")
    opts = tuple((f"option {k}", repr(v), f"{k}={v!r}") for k, v in {**options, "device": device.type}.items())
    return (("autopar version", versions, versions),
            ("world size", str(world), str(world)),
            ("traced graph (model or input shapes)", graph,
             f"hash {graph} ({traced.model_name}; {_describe_inputs(meta_inputs)})"),
            ("mesh", mesh, mesh),
            ("plan", plan_key, plan_shown),
            *opts)


def _describe_inputs(meta_inputs) -> str:
    """``input_ids (8, 64), labels (8, 64)``: the shapes users get wrong across ranks."""
    import torch
    from torch.utils import _pytree as pytree

    leaves, _ = pytree.tree_flatten_with_path(meta_inputs)
    parts = []
    for path, leaf in leaves:
        name = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        parts.append(f"{name} {tuple(leaf.shape)}" if isinstance(leaf, torch.Tensor) else f"{name}={leaf!r:.40}")
    return ", ".join(parts) or "no inputs"


def _agree(prep: Any, *, device) -> None:
    """One ``all_gather_object`` of every rank's fingerprint (``prep``: an ``autopar.parallelize.Prepared``,
    or the error the rank met); the same ``ValueError`` on every rank when any rank failed or the ranks differ."""
    gathered = _all_gather(_status(prep) if isinstance(prep, Exception) else ("ok", prep.fingerprint), device=device)
    _raise_failures(gathered, prep, when="before planning")
    fingerprints = [fp for _, fp in gathered]
    differences = []
    for i, (what, _, _) in enumerate(fingerprints[0]):
        by_key: dict[str, tuple[str, list[int]]] = {}
        for rank, fp in enumerate(fingerprints):
            by_key.setdefault(fp[i][1], (fp[i][2], []))[1].append(rank)
        if len(by_key) > 1:
            differences.append(f"{what}: " + "; ".join(f"{_ranks(rs)} {shown}" for shown, rs in by_key.values()))
    if differences:
        raise ValueError("ranks disagree on the " + "; and on the ".join(differences) +
                         ". Every rank must call autoparallelize with the same model, input shapes, mesh, "
                         "plan and options")


def _status(outcome: Any) -> tuple[str, Any]:
    return ("error", f"{type(outcome).__name__}: {outcome}") if isinstance(outcome, Exception) else ("ok", None)


def _raise_failures(gathered: list[tuple[str, Any]], local: Any, *, when: str) -> None:
    """Raise the same error on every rank when any rank's status is an error: the error itself
    when every rank had the same one, else a ``ValueError`` naming the failing ranks."""
    failed: dict[str, list[int]] = {}
    for rank, (status, text) in enumerate(gathered):
        if status == "error":
            failed.setdefault(text, []).append(rank)
    if not failed:
        return
    if isinstance(local, Exception) and len(failed) == 1 and len(next(iter(failed.values()))) == len(gathered):
        raise local
    detail = "; ".join(f"{_ranks(rs)}: {text}" for text, rs in failed.items())
    error = ValueError(f"autoparallelize failed {when} on {sum(map(len, failed.values()))} of {len(gathered)} "
                       f"ranks, so every rank stops here: {detail}")
    raise error from (local if isinstance(local, Exception) else None)


def _ranks(ranks: list[int]) -> str:
    """``rank 3`` or ``ranks 0-2, 5``."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def _all_gather(obj: Any, *, device) -> list[Any]:
    """``all_gather_object`` on the default group; NCCL sends through this rank's device."""
    import torch
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    if device.type == "cuda" and dist.get_backend() == "nccl":
        with torch.cuda.device(device):
            dist.all_gather_object(out, obj)
    else:
        dist.all_gather_object(out, obj)
    return out
