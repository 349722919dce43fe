"""Sharding strategies: per-op rules for one mesh axis, expanded over the whole mesh.

Public API
----------
``strategies_for(node, mesh, *, flops=None, allow_replicate_fallback=False) -> list[Strategy]``
    every candidate for an fx node (``node.target`` an ATen overload, ``node.meta["val"]`` set).
    ``Strategy.input_specs[i]`` belongs to ``input_nodes(node)[i]``. No rule -> ``NoRuleError``
    naming the op, the node and its module path; with ``allow_replicate_fallback=True`` one
    replicated strategy with ``is_fallback=True`` and a warning.
``enumerate_strategies(info, mesh, ...)`` the same from an ``OpInfo`` (``OpInfo.from_node``).

How to add a rule family
------------------------
1. Create ``autopar/strategies/_<family>.py`` and add it to ``_FAMILIES`` below.
2. Write a rule for ONE mesh axis: ``rule(info: OpInfo) -> list[AxisOption]``. ``info`` has the
   global metadata (``info.input("self").shape``, ``info.arg("dim")``, ``info.output``). Build
   options with ``info.option(out_placement, self=Shard(0), weight=R, ...)``: unnamed tensor
   inputs are ``Replicate``; the all-replicate option is added for you, so list only the
   splits and the ``Partial`` pass-throughs. Do not think about other axes or divisibility:
   ``expand.py`` forms the product over axes, prunes uneven splits, dedups and costs.
   - ``grad_partial`` is derived (a float input that is ``R`` while the option is not all-R has a
     partial local gradient, all-reduced in the op's backward); pass ``grad_partial=[...]``
     only to override. ``work_split`` is derived the same way; pass ``work_split=False`` for
     options where every rank does the full work (e.g. ``P`` in -> ``P`` out).
   - Options whose dims map across axes in a way the local op cannot honour (e.g. a flatten that
     would reverse the major/minor order) are vetoed with ``register(..., combine_check=fn)``.
3. Register it: ``@register(aten.op.overload, samples=fn)`` (several overloads may share one rule;
   loop over a family table calling ``register(op, samples=...)(rule)``). ``has_flops=True`` makes
   the cost model count FLOPs with ``torch.utils.flop_counter``; otherwise the op is costed as
   memory-bound.
4. ``samples()`` returns ``Sample(args, kwargs, label)`` with small float64 tensors (sizes divisible
   by 4; helpers in ``samples.py``). The numerical check (``tests/strategies/test_rules_numeric.py``)
   is parametrised over ``registered_targets()``: for every sample, on meshes (4,) and (2, 2), it
   runs EVERY candidate strategy forward and backward on simulated ranks (``check.py``) against
   the unsharded op. Nothing else to wire: registering the rule enrols it.
5. Local op: by default "the same ATen op on local shards". Ops whose arguments hold global
   sizes (``view``'s ``size``, ``expand``, ``new_ones`` ...) register
   ``local_args=fn(info, bound, input_specs, output_specs, mesh_shape) -> bound``; the runtime
   applies that rewrite when it emits the local op (``local_arguments``), and so does the check.
   When the sharded op needs different math (masking, collectives inside), give the option
   ``kernel="name"`` and register ``@register_kernel("name", comm_cost=fn)`` with
   ``fn(ctx: KernelContext, **bound_args)``; it communicates only through ``ctx.comm``
   (``all_reduce(t, axes, op)``, ``shift(t, axis)``, ``coordinate(axis)``, ``size(axis)``; see
   ``kernel_context.py``) and
   ``comm_cost(info, input_specs, output_specs, mesh) -> (forward_s, backward_s)``.
6. A random op (``registry.draws_random``) is planned only when EVERY strategy of the call runs a
   mesh-invariant kernel: ``register(..., kernel_for=fn)``, ``fn(info) -> kernel name | None``
   (``_random.py``'s ``random_kernel``; the numeric check's reference is that kernel run whole).
   Anything else -- no rule, a generic or DTensor-derived one, the fallback -- is a ``NoRuleError``.
7. A rule that offers only replication on purpose (an opaque sub-graph, a 0-d value) says so
   with ``register(..., replicate_only=True)``; the numerical check then asserts exactly that.

Conventions for nodes that need no decision (``needs_no_decision(node)``)
------------------------------------------------------------------------
- ``operator.getitem(producer, k)`` on a multi-output op: its one input slot is the producer's
  element ``k``; it receives the producer's ``output_specs[k]`` and is the identity on it. A
  planner resolves it to its producer (``strategies_for`` still answers, with identity
  strategies).
- Ops without a tensor output (``aten._assert_tensor_metadata``) accept any layout; a planner
  skips them and the runtime runs them on the local shard (their rule rewrites ``size``).
- In-place ops (``add_``, ``relu_``) are sharded like their out-of-place versions; the check runs
  them on a clone of the written argument, as on an activation in a graph.
"""

from __future__ import annotations

import importlib

from autopar.strategies.kernel_context import Comm, KernelContext
from autopar.strategies.derived import SOURCES, has_decomposition, needs_decomposition, rule_for, rule_source
from autopar.strategies.combine import estimate_flops
from autopar.strategies.expand import FixedAxis, axis_placements, enumerate_strategies, strategies_for
from autopar.strategies.registry import (
    AxisOption, InputSlot, LocalKernel, NoRuleError, OpInfo, RuleEntry, Sample, Strategy, TensorMeta,
    get_kernel, get_rule, input_nodes, local_arguments, needs_no_decision, register, register_kernel,
    registered_targets,
)

# Rule families, imported for their registrations.
_FAMILIES = ("_matmul", "_einsum", "_pointwise", "_attention", "_embedding", "_embedding_bag", "_norm", "_loss",
             "_loss_elementwise", "_loss_margin", "_distance", "_view", "_index", "_scatter", "_sort",
             "_reduction", "_factory", "_conv", "_pool", "_rnn", "_resample", "_spectral", "_moe", "_experts",
             "_functions", "_misc",
             "_random", "_batch_norm_chunks")
for _name in _FAMILIES:
    importlib.import_module(f"{__name__}.{_name}")

__all__ = [
    "strategies_for", "enumerate_strategies", "FixedAxis", "axis_placements", "estimate_flops", "Strategy",
    "AxisOption", "OpInfo", "TensorMeta", "InputSlot", "Sample", "RuleEntry", "LocalKernel", "NoRuleError", "Comm",
    "KernelContext", "register", "register_kernel", "get_rule", "get_kernel", "registered_targets",
    "input_nodes", "local_arguments", "needs_no_decision", "rule_for", "rule_source", "needs_decomposition",
    "has_decomposition", "SOURCES",
]
