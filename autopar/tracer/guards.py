"""What a traced graph cannot keep, refused while tracing instead of planned into a silently wrong
step: a forward that writes a parameter in place (also inside a ``torch.no_grad()`` region, which
export keeps as a sub-graph), and gradient hooks: one registered on a tensor during forward, or a
module's backward hook."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.fx as fx

from autopar.tracer.errors import TraceError
from autopar.tracer.graph import MODULE_KEY, PARAMETER, PLACEHOLDER_KEY

__all__ = ["check_no_backward_hooks", "check_no_parameter_writes", "refusing_tensor_hooks"]


def check_no_parameter_writes(gm: fx.GraphModule, model_name: str) -> None:
    """A forward that writes a parameter in place (``nn.Embedding(max_norm=...)`` renormalises the
    rows it reads; ``with torch.no_grad(): self.weight.clamp_(...)``) cannot be sharded: each rank
    would update only its copy or shard, or a gathered temporary, differently from one device.
    Say so instead of planning a silently wrong step. Higher-order ops (a ``no_grad`` region is
    ``wrap_with_set_grad_enabled``) are followed into their sub-graphs."""
    roots = {}
    for node in gm.graph.nodes:
        root = node.meta.get(PLACEHOLDER_KEY) if node.op == "placeholder" else None
        if root is not None and root.kind == PARAMETER:
            roots[node] = root
    _check_graph(gm, gm.graph, roots, model_name, module_path="")


def _check_graph(gm: fx.GraphModule, graph: fx.Graph, params: dict, model_name: str, *, module_path: str) -> None:
    """``params``: the placeholders of ``graph`` that are (views of) parameters -> their info."""
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        where = node.meta.get(MODULE_KEY, "") or module_path
        if isinstance(node.target, torch._ops.HigherOrderOperator):
            _check_sub_graphs(gm, node, params, model_name, module_path=where)
            continue
        if not isinstance(node.target, torch._ops.OpOverload):
            continue
        written = {a.name for a in node.target._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        for name, value in zip((a.name for a in node.target._schema.arguments), node.args):
            info = params.get(_alias_root(value)) if isinstance(value, fx.Node) else None
            if name in written and info is not None:
                raise TraceError(
                    f"cannot trace {model_name}: the forward writes parameter {info.fqn!r} in place",
                    op=str(node.target), module_path=where,
                    hint="a parameter updated by the forward itself cannot be sharded (each rank "
                         "would update its own copy); e.g. nn.Embedding(max_norm=...) renormalises "
                         "its weight, or a clamp_ under torch.no_grad(): do it outside forward (after "
                         "optimizer.step()), or drop max_norm",
                    cause=f"{node.target} writes its argument {name!r}")


def _check_sub_graphs(gm: fx.GraphModule, node: fx.Node, params: dict, model_name: str, *, module_path: str) -> None:
    """The sub-graphs a higher-order op calls, their placeholders bound to the operands after them
    (``wrap_with_set_grad_enabled(enabled, body, *operands)``, ``wrap_with_autocast(..., body, *operands)``)."""
    for i, arg in enumerate(node.args):
        if not (isinstance(arg, fx.Node) and arg.op == "get_attr"):
            continue
        sub = getattr(gm, arg.target, None)
        if not isinstance(sub, fx.GraphModule):
            continue
        operands = node.args[i + 1:]
        inner = {}
        for ph, operand in zip((n for n in sub.graph.nodes if n.op == "placeholder"), operands):
            info = params.get(_alias_root(operand)) if isinstance(operand, fx.Node) else None
            if info is not None:
                inner[ph] = info
        if inner:
            _check_graph(sub, sub.graph, inner, model_name, module_path=module_path)


def _alias_root(node: fx.Node) -> fx.Node:
    """The node whose storage ``node`` views: through ``detach``, ``view``, ``alias`` ... (ops
    whose first argument and output share an alias set in the schema)."""
    while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.args:
        schema = node.target._schema
        ret = schema.returns[0].alias_info if schema.returns else None
        arg = schema.arguments[0].alias_info if schema.arguments else None
        is_view = ret is not None and arg is not None and not ret.is_write and set(ret.before_set) & set(arg.before_set)
        if not is_view or not isinstance(node.args[0], fx.Node):
            break
        node = node.args[0]
    return node


@contextlib.contextmanager
def refusing_tensor_hooks(model_name: str, stack: list[str]) -> Iterator[None]:
    """While export runs the forward: ``Tensor.register_hook`` raises a ``TraceError`` naming the
    module (``stack``: the module path stack of the tracer's forward hooks). The exported graph
    keeps the hook's tensor but not the hook, so the gradient it would change -- halved, reversed
    (gradient reversal), clipped, recorded -- would silently be the plain one; a module's full
    backward hook registers such hooks too."""
    original = torch.Tensor.register_hook

    def refuse(tensor: torch.Tensor, hook) -> None:
        raise TraceError(
            f"cannot trace {model_name}: the forward registers a gradient hook on a tensor (Tensor.register_hook), "
            f"which the traced graph does not keep",
            module_path=stack[-1] if stack else "",
            hint="change the gradient in the computation itself (e.g. a custom autograd.Function, or "
                 "x.detach() + scale * (x - x.detach()) for a scaled gradient), or register hooks on the "
                 "parallel module's parameters after autoparallelize")

    torch.Tensor.register_hook = refuse
    try:
        yield
    finally:
        torch.Tensor.register_hook = original


def check_no_backward_hooks(model: torch.nn.Module, model_name: str) -> None:
    """A module backward hook (``register_full_backward_hook`` / ``register_full_backward_pre_hook``,
    on a module or globally) is not in the exported graph either: the gradients it would change or
    record would silently be the plain ones."""
    from torch.nn.modules import module as torch_module

    if torch_module._global_backward_hooks or torch_module._global_backward_pre_hooks:
        raise TraceError(f"cannot trace {model_name}: a global module backward hook is registered "
                         f"(torch.nn.modules.module.register_module_full_backward_hook), which the traced graph "
                         f"does not keep", hint="remove it while planning and training with autopar")
    for name, module in model.named_modules():
        if module._backward_hooks or module._backward_pre_hooks:
            raise TraceError(
                f"cannot trace {model_name}: module {name or '<root>'!r} ({type(module).__name__}) has a backward "
                f"hook, which the traced graph does not keep", module_path=name,
                hint="change the gradient in the computation itself (a custom autograd.Function), or hook "
                     "the parallel module's parameters after autoparallelize")
