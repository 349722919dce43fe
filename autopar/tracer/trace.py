"""trace(): capture a model's forward as an ATen graph with torch.export (non-strict), shapes only.

Inputs are turned into fake tensors on the model's device (meta or cpu), so no kernel runs and
no parameter-sized memory is allocated, whether the model lives on ``meta`` or holds real
weights. The graph is export's default training IR: no decompositions, so ``aten.linear``,
``aten.scaled_dot_product_attention``, ``aten.layer_norm``, ``aten.cross_entropy_loss`` stay
whole. When export fails, :class:`TraceError` names the op, the module path and the user's
source line, with a hint matched to the cause; torch's own failure logs are kept off stderr, so
the TraceError is the one message. Hugging Face models trace at their default configs: caches
are off for the trace and cache objects never reach the outputs (see :mod:`.hf`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import logging
import os
import traceback
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.fx.config as fx_config
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export.graph_signature import InputKind
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from autopar.tracer import hf
from autopar.tracer.errors import TraceError
from autopar.tracer.guards import check_no_backward_hooks, check_no_parameter_writes, refusing_tensor_hooks
from autopar.tracer.heap import frozen_heap
from autopar.tracer.outputs import register_dataclass_output
from autopar.tracer.unroll import trace_shallow
from autopar.tracer.experts import experts_as_ops
from autopar.tracer.functions import custom_functions, refused_function
from autopar.tracer.meta_keys import export_module_path
from autopar.tracer.precision import apply_precision, compute_dtype
from autopar.tracer.graph import (BUFFER, CONSTANT, INPUT, MODULE_KEY, PARAMETER, PLACEHOLDER_KEY, Placeholder,
                    TracedGraph, keyword_path)

_TORCH_DIR = os.path.dirname(torch.__file__)
_AUTOPAR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_KIND = {InputKind.PARAMETER: PARAMETER, InputKind.BUFFER: BUFFER,
         InputKind.CONSTANT_TENSOR: CONSTANT, InputKind.CUSTOM_OBJ: CONSTANT,
         InputKind.USER_INPUT: INPUT}

_PRIMITIVE = (int, float, bool, str, type(None), torch.dtype, torch.device)
# What a traced forward may return besides tensors (export keeps these as constants).
_OUTPUT_LEAVES = (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool, *_PRIMITIVE)
# Loggers whose failure reports (e.g. fake_tensor's "failed while attempting to run meta" with a
# traceback) would print next to the TraceError; silenced while export runs.
_TORCH_LOGGERS = ("torch", "torch._subclasses.fake_tensor", "torch._dynamo", "torch.export",
                  "torch._export", "torch.fx.experimental.symbolic_shapes", "torch._guards",
                  "torch._functorch", "torch.fx.experimental.recording")


def trace(model: nn.Module, meta_inputs: tuple | dict, *, name: str | None = None,
          stack_traces: bool = False, decompose_if: Callable[[Any], bool] | None = None,
          precision: str = "fp32", by_blocks: bool = True, param_casts: str = "shared") -> TracedGraph:
    """Trace ``model``'s forward on ``meta_inputs`` (positional tuple or keyword dict).

    Tensors may be real, meta or fake; they are replaced by fake tensors of the same shape,
    dtype and stride on the model's device. Non-tensor values are bound as constants.
    Hugging Face models: ``use_cache=False`` for the trace (configs restored afterwards) and
    cache objects in the outputs become ``None``.
    ``stack_traces=True`` keeps each node's Python stack in ``meta["stack_trace"]``; it costs
    about a third of the tracing time on large models, so it is off unless asked for (failures
    name the source line either way: that comes from the exception's own traceback).
    ``decompose_if(op)``: ops to replace by their PyTorch decompositions after export (the
    planner passes ``autopar.strategies.needs_decomposition``); ``TracedGraph.decomposed``
    records what each became. ``precision``: ``"bf16"``/``"fp16"`` rewrite the graph to compute
    in that dtype with fp32 master weights (``autopar.tracer.precision``; ``param_casts``: one
    cast per parameter, or ``"per_module"``, one per reading module, as pipelines trace).
    ``by_blocks``: a model looping over one ``nn.ModuleList`` of identical blocks is exported
    with four of them and expanded to the same graph (``autopar.tracer.unroll``: tracing time
    does not grow with depth); False, or a model it does not recognise, exports every block.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"trace() needs an nn.Module, got {type(model).__name__}")
    compute_dtype(precision)  # a bad precision fails before the trace
    if isinstance(meta_inputs, torch.Tensor):
        meta_inputs = (meta_inputs,)
    if not isinstance(meta_inputs, (tuple, list, dict)):
        raise ValueError(f"meta_inputs must be a tuple (positional) or a dict (keyword), "
                         f"got {type(meta_inputs).__name__}")
    model_name = name or type(model).__name__
    device = _model_device(model, meta_inputs)
    if device.type == "meta":
        # Trace as on a real device: meta kernels pick other code paths than real ones (math
        # attention instead of the fused kernel, hence other strides and extra copies).
        device = torch.device("cpu")
    kwargs = _as_kwargs(model, meta_inputs)
    if hf.wants_use_cache(model.forward, kwargs):
        kwargs["use_cache"] = False  # a constant: caches are inference state, not training
    # Keyword values without tensors are bound as constants; *args entries stay positional.
    tensors = {k: v for k, v in kwargs.items() if _has_tensor(v) or k.startswith("args[")}
    constants = {k: v for k, v in kwargs.items() if k not in tensors}
    _check_leaves(tensors, model_name)

    def export_and_build(module: nn.Module) -> TracedGraph:
        fake_mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
        fake = {k: pytree.tree_map(lambda v: _to_fake(v, fake_mode, device), v)
                for k, v in tensors.items()}
        with _fake_state(module, fake_mode, device), hf.caches_off(module), experts_as_ops(module), \
                _no_distribution_checks(), custom_functions():  # each one op with its own backward
            ep = _export(module, fake, constants, model_name, stack_traces)
        return _build(module, ep, model_name)

    with frozen_heap():  # the model and the interpreter's modules: out of full GC passes
        traced = trace_shallow(model, export_and_build) if by_blocks else None
        if traced is None:
            traced = export_and_build(model)
        # Every op a pure function of its inputs: layouts and recompute regions cannot lose a write.
        traced.functionalize()
        if decompose_if is not None:  # the planner's "no rule, but a decomposition" (tracer/decompose.py)
            traced.decompose(decompose_if)
        return apply_precision(traced, precision, param_casts=param_casts)


@contextlib.contextmanager
def _no_distribution_checks():
    """``torch.distributions`` without argument validation while tracing: a distribution checks
    its parameters' values (``constraint.check(value).all()``, a branch on data), which shapes
    alone cannot decide -- transformers' time-series heads (StudentT) fail export on it. The
    check only ever raises; the values it would check do not exist until a step runs."""
    saved = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        torch.distributions.Distribution.set_default_validate_args(saved)


# ---- inputs ------------------------------------------------------------------------------------
def _model_device(model: nn.Module, inputs: Any) -> torch.device:
    for tensor in _first(model.parameters()), _first(model.buffers()):
        if tensor is not None:
            return tensor.device
    leaves = [v for v in pytree.tree_leaves(inputs) if isinstance(v, torch.Tensor)]
    return leaves[0].device if leaves else torch.device("meta")


def _first(it):
    return next(iter(it), None)


def _has_tensor(value: Any) -> bool:
    return any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(value))


def _as_kwargs(model: nn.Module, inputs: tuple | list | dict) -> dict:
    """Positional inputs become keyword inputs, named after forward's parameters."""
    if isinstance(inputs, dict):
        return dict(inputs)
    params = inspect.signature(model.forward).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return {f"args[{i}]": v for i, v in enumerate(inputs)}
    try:
        return dict(inspect.signature(model.forward).bind(*inputs).arguments)
    except TypeError as err:
        raise ValueError(f"{len(inputs)} positional inputs do not fit "
                         f"{type(model).__name__}.forward{inspect.signature(model.forward)}: {err}"
                         ) from None


def _check_leaves(inputs: dict, model_name: str) -> None:
    """Inside a structure that holds tensors, every other leaf must be a basic constant."""
    for path, leaf in pytree.tree_flatten_with_path(inputs)[0]:
        if not isinstance(leaf, (torch.Tensor, *_PRIMITIVE)):
            raise TraceError(
                f"cannot trace {model_name}: input {keyword_path(path)} is a "
                f"{type(leaf).__name__}, neither a tensor nor a basic constant",
                hint="pass it as a constant: give it as its own keyword input (non-tensor "
                     "keyword inputs are bound as constants), or register its type with "
                     "torch.utils._pytree")


def _to_fake(value: Any, fake_mode: FakeTensorMode, device: torch.device) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    with fake_mode:  # empty_strided under fake mode allocates nothing
        return torch.empty_strided(tuple(value.shape), tuple(value.stride()), dtype=value.dtype,
                                   device=device)


@contextlib.contextmanager
def _fake_state(model: nn.Module, fake_mode: FakeTensorMode, device: torch.device):
    """Temporarily replace every parameter and buffer by a fake tensor on ``device``.

    Tied tensors stay tied (one fake per original tensor); the originals are put back after.
    """
    fakes: dict[int, torch.Tensor] = {}
    saved: list[tuple[dict, str, Any]] = []
    for module in model.modules():
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for key, tensor in list(table.items()):
                if tensor is None:
                    continue
                if id(tensor) not in fakes:
                    fake = _to_fake(tensor, fake_mode, device)
                    if is_param:
                        fake = nn.Parameter(fake, requires_grad=tensor.requires_grad)
                    fakes[id(tensor)] = fake
                saved.append((table, key, tensor))
                table[key] = fakes[id(tensor)]
    try:
        yield
    finally:
        for table, key, tensor in saved:
            table[key] = tensor


# ---- export with diagnosis ----------------------------------------------------------------------
def _export(model: nn.Module, fake: dict, constants: dict, model_name: str, stack_traces: bool):
    positional = [k for k in fake if k.startswith("args[")]
    args = tuple(fake[k] for k in positional)
    kwargs = {k: v for k, v in fake.items() if k not in positional}
    paths = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    stack: list[str] = []

    def push(module, _inputs):
        stack.append(paths.get(id(module), type(module).__name__))

    def pop(module, _inputs, _output):
        if stack:
            stack.pop()

    check_no_backward_hooks(model, model_name)
    hooks = [nn.modules.module.register_module_forward_pre_hook(push),
             nn.modules.module.register_module_forward_hook(pop)]
    bound = "forward" in vars(model)
    original = model.forward
    model.forward = _traced_forward(original, constants, model_name)
    # torch 2.13's switch; older releases (the GPU machines' images) always emit stack traces
    emit_before = getattr(fx_config, "do_not_emit_stack_traces", None)
    if emit_before is not None:
        fx_config.do_not_emit_stack_traces = not stack_traces
    try:
        # export prints the partial graph on failure; the TraceError says it better
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
                _quiet_torch_logs(), refusing_tensor_hooks(model_name, stack):
            return torch.export.export(model, args, kwargs=kwargs, strict=False)
    except TraceError:  # raised by _traced_forward: already names the output
        raise
    except Exception as err:  # noqa: BLE001 - every export failure becomes a TraceError
        where = list(stack)  # the module export failed in, before an eager run moves the stack
        raise _diagnose(err, where, model_name,
                        eager=lambda: _eager_failure(original, args, kwargs, constants)) from err
    finally:
        if emit_before is not None:
            fx_config.do_not_emit_stack_traces = emit_before
        for hook in hooks:
            hook.remove()
        if bound:
            model.forward = original
        else:
            del model.forward


def _traced_forward(original, constants: dict, model_name: str):
    """``original`` with the constants bound (they are not graph inputs), caches dropped from
    its output and every other output leaf checked: export's own error for an unknown output
    type says neither which output nor what to do."""
    @functools.wraps(original)
    def forward(*args, **kwargs):
        output = hf.drop_caches(original(*args, **constants, **kwargs))
        _check_outputs(output, model_name)
        return output

    if constants:  # the signature export sees: without the bound constants, as before
        forward.__wrapped__ = functools.partial(original, **constants)
    return forward


def _check_outputs(output: Any, model_name: str) -> None:
    try:
        leaves = [("output" + pytree.keystr(path), leaf)
                  for path, leaf in pytree.tree_flatten_with_path(output)[0]]
    except ValueError:  # a type registered without key paths: name the output as a whole
        leaves = [("output", leaf) for leaf in pytree.tree_leaves(output)]
    for name, leaf in leaves:
        if isinstance(leaf, _OUTPUT_LEAVES):
            continue
        if register_dataclass_output(leaf):  # its fields are leaves now: check them (nested dataclasses too)
            _check_outputs(output, model_name)
            return
        holds = " holding tensors" if _has_tensor(list(getattr(leaf, "__dict__", {}).values())) else ""
        raise TraceError(
            f"cannot trace {model_name}: {name} is a {type(leaf).__name__}{holds}, which "
            f"torch.export cannot return",
            hint=f"make forward return tensors (in tuples, lists, dicts or a ModelOutput) "
                 f"instead of {name}, or register {type(leaf).__name__} with "
                 f"torch.utils._pytree.register_pytree_node (a dataclass: "
                 f"torch.export.register_dataclass) so its tensors can be flattened")


@contextlib.contextmanager
def _quiet_torch_logs():
    """Disable torch's loggers while export runs (their failure reports duplicate the
    TraceError, with torch-internal tracebacks); restore each logger's state after."""
    names = {*_TORCH_LOGGERS, *(n for n in logging.root.manager.loggerDict if n.startswith("torch."))}
    loggers = [logging.getLogger(n) for n in sorted(names)]
    saved = [(logger, logger.disabled) for logger in loggers]
    for logger in loggers:
        logger.disabled = True
    try:
        yield
    finally:
        for logger, disabled in saved:
            logger.disabled = disabled


def _eager_failure(forward: Callable, args: tuple, kwargs: dict, constants: dict) -> BaseException | None:
    """What ``forward`` raises outside torch.export on the same fake inputs and state (None: it
    runs). Model code may branch on being exported (transformers' ``is_torchdynamo_compiling()``:
    Switch Transformers then builds no default attention mask and indexes ``None``), so an error
    in the model's code under export is not proof that the model fails when run."""
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode(pytree.tree_leaves((args, kwargs)))
    try:
        with mode if mode is not None else contextlib.nullcontext(), torch.no_grad(), \
                contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
                _quiet_torch_logs():
            forward(*args, **constants, **kwargs)
    except Exception as err:  # noqa: BLE001 - reported, not raised: export's error is the one to raise
        return err
    return None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


_EXPORT_ONLY = ("the model's code fails only under torch.export: on the same inputs, run eagerly, "
                "it works -- it takes another path while exported (transformers' "
                "is_torchdynamo_compiling() / is_tracing() checks, e.g. skipping a default "
                "attention mask or building a 4-D one); pass the inputs that path leaves out "
                "(an explicit attention_mask) or a config under which both paths agree")


def _diagnose(err: Exception, stack: list[str], model_name: str, *,
              eager: Callable[[], BaseException | None] = lambda: None) -> TraceError:
    """``eager``: what the forward raises run eagerly on the same inputs (asked only where the
    hint would otherwise claim that it fails the same way)."""
    op = _failing_op(err)
    source = _user_source(err)
    text = str(err)
    first_line = _first_line(err)
    missing = _missing_config_attribute(err)
    if missing is not None:
        config, attr = missing
        hint = (f"the model's config ({type(config).__name__}) has no attribute {attr!r}, which "
                f"the model's code reads: a setting missing from the config (the model fails "
                f"the same way when run eagerly); set config.{attr} and trace again")
    elif refused_function(err):
        hint = "autopar runs each custom autograd.Function as one op with its own backward; change it as the cause says"
    elif "data-dependent" in text or "GuardOnDataDependent" in type(err).__name__:
        hint = ("data-dependent control flow or shape: the code branches on, or sizes a tensor "
                "by, a tensor's value, unknown when tracing with shapes only; use torch.where / "
                "torch.cond, or pass that value as a constant (a Python number, not a tensor)")
    elif "in output" in text and "not a known type" in text:
        hint = ("forward returns an object torch.export cannot flatten: return tensors (in "
                "tuples, dicts or a ModelOutput), or register its type with "
                "torch.utils._pytree.register_pytree_node")
    elif "pytree" in text.lower() or "unsupported input" in text.lower() or "input type" in text:
        hint = "a non-tensor input cannot be traced: pass it as a constant (a Python value)"
    elif (in_kernel := _raised_in(err, _META_KERNEL_FILES)) or _raised_in_model_code(err):
        eager_err = eager()
        if eager_err is None:
            hint = _EXPORT_ONLY
        else:
            same = type(eager_err) is type(err) and _first_line(eager_err) == first_line
            eagerly = ("it fails the same way when run eagerly" if same else
                       f"run eagerly on the same fake inputs it fails otherwise: "
                       f"{type(eager_err).__name__}: {_first_line(eager_err)}")
            hint = (f"the op rejects the shapes or dtypes it was given ({eagerly}): check the "
                    f"shapes and dtypes of the inputs given to trace"
                    if in_kernel else
                    f"the model's own code raised this error ({eagerly}): check the inputs "
                    f"given to trace and the model's config")
    else:
        hint = "the op or Python construct is not supported by torch.export (non-strict)"
    return TraceError(f"cannot trace {model_name}: {type(err).__name__}", op=op,
                      module_path=stack[-1] if stack else "", source=source, hint=hint,
                      cause=first_line)


# Where torch's shape checks live: an error raised here is the op refusing its arguments.
_META_KERNEL_FILES = tuple(os.path.join(_TORCH_DIR, name) for name in (
    "_meta_registrations.py", "_refs", "_prims_common", "_prims", "_decomp"))


def _chain(err: BaseException):
    """``err`` and the exceptions it was raised from or while handling, innermost last."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def _missing_config_attribute(err: Exception) -> tuple[Any, str] | None:
    """(config, attribute) when the failure is an AttributeError on a Hugging Face config."""
    for exc in _chain(err):
        if isinstance(exc, AttributeError) and hf.is_config(getattr(exc, "obj", None)) \
                and getattr(exc, "name", None):
            return exc.obj, exc.name
    return None


def _innermost_file(err: BaseException) -> str:
    frames = traceback.extract_tb(err.__traceback__)
    return frames[-1].filename if frames else ""


def _raised_in(err: Exception, prefixes: tuple[str, ...]) -> bool:
    """Some frame of the traceback (the raise may sit in a helper such as torch._check) is in
    one of these files."""
    return any(f.filename.startswith(prefixes) for f in traceback.extract_tb(err.__traceback__))


def _raised_in_model_code(err: Exception) -> bool:
    """The exception was raised outside torch and autopar: in the model's (or its library's) code."""
    filename = _innermost_file(err)
    return bool(filename) and not filename.startswith((_TORCH_DIR, _AUTOPAR_DIR, "<"))


def _failing_op(err: Exception) -> str:
    """The innermost op being dispatched when export failed (from the traceback's frames)."""
    found = ""
    tb = err.__traceback__
    while tb is not None:
        func = tb.tb_frame.f_locals.get("func")
        if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            found = str(func)
        elif callable(func) and tb.tb_frame.f_code.co_name.startswith("__torch_"):
            qualname = getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))
            found = qualname.replace("TensorBase.", "Tensor.")
        tb = tb.tb_next
    return found


def _user_source(err: Exception) -> str:
    """Innermost traceback frame outside torch and autopar: the model's own code."""
    # Attribute hooks (a config's __getattribute__) are plumbing: the line that read it counts.
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not f.filename.startswith((_TORCH_DIR, _AUTOPAR_DIR, "<string>"))
              and f.name not in ("__getattribute__", "__getattr__")]
    if not frames:
        return ""
    frame = frames[-1]
    line = f": {frame.line.strip()}" if frame.line else ""
    return f"{frame.filename}:{frame.lineno} in {frame.name}{line}"


# ---- post-processing ----------------------------------------------------------------------------
def _build(model: nn.Module, ep, model_name: str) -> TracedGraph:
    gm = ep.graph_module
    graph = gm.graph
    aliases = _alias_groups(model)
    trainable = {fqn: p.requires_grad for fqn, p in model.named_parameters(remove_duplicate=False)}
    placeholders: list[Placeholder] = []
    canonical_nodes: dict[str, fx.Node] = {}
    input_paths = _input_paths(ep)
    spec_by_name = {spec.arg.name: spec for spec in ep.graph_signature.input_specs
                    if hasattr(spec.arg, "name")}
    for node in list(graph.nodes):
        if node.op != "placeholder":
            continue
        spec = spec_by_name.get(node.name)
        kind = _KIND.get(spec.kind, CONSTANT) if spec is not None else INPUT
        val = node.meta.get("val")
        if kind == INPUT and not isinstance(val, torch.Tensor):
            kind = CONSTANT
        if kind in (PARAMETER, BUFFER):
            names = aliases.get(spec.target, (spec.target,))
            fqn = names[0]
            if fqn in canonical_nodes:  # a tied weight already seen under its canonical name
                node.replace_all_uses_with(canonical_nodes[fqn])
                graph.erase_node(node)
                continue
            canonical_nodes[fqn] = node
        else:
            fqn = spec.target if spec is not None and spec.target else input_paths.get(node.name,
                                                                                        node.name)
            names = (fqn,)
        is_tensor = isinstance(val, torch.Tensor)
        info = Placeholder(name=node.name, kind=kind, fqn=fqn, aliases=tuple(names),
                           shape=tuple(val.shape) if is_tensor else (),
                           dtype=val.dtype if is_tensor else None,
                           requires_grad=kind == PARAMETER and trainable.get(fqn, False))
        node.meta[PLACEHOLDER_KEY] = info
        placeholders.append(info)
    for node in graph.nodes:
        node.meta[MODULE_KEY] = export_module_path(node)
    check_no_parameter_writes(gm, model_name)
    graph.lint()
    gm.recompile()
    return TracedGraph(gm, placeholders=tuple(placeholders), in_spec=ep.call_spec.in_spec,
                       out_spec=ep.call_spec.out_spec, constants=dict(ep.constants),
                       loss_name=_loss_name(gm, ep), model_name=model_name)


def _alias_groups(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """FQN -> all FQNs of the same tensor object, canonical (first registered) first."""
    by_id: dict[int, list[str]] = {}
    for fqn, tensor in [*model.named_parameters(remove_duplicate=False),
                        *model.named_buffers(remove_duplicate=False)]:
        by_id.setdefault(id(tensor), []).append(fqn)
    return {fqn: tuple(names) for names in by_id.values() for fqn in names}


def _input_paths(ep) -> dict[str, str]:
    """User-input placeholder name -> its path in the (args, kwargs) input structure."""
    user = [s.arg.name for s in ep.graph_signature.input_specs
            if s.kind == InputKind.USER_INPUT and hasattr(s.arg, "name")]
    try:
        leaves = pytree.tree_flatten_with_path(
            pytree.tree_unflatten([None] * ep.call_spec.in_spec.num_leaves, ep.call_spec.in_spec),
            is_leaf=lambda x: x is None)[0]
    except Exception:  # noqa: BLE001 - paths are cosmetic; fall back to node names
        return {}
    paths = [_keystr(path) for path, _ in leaves]
    return dict(zip(user, paths)) if len(paths) == len(user) else {}


def _keystr(path) -> str:
    """'input_ids' for a keyword input, 'args[0]' for a positional one (path[0] picks which)."""
    if getattr(path[0], "idx", 1) == 0:
        return "args" + pytree.keystr(path[1:])
    return keyword_path(path[1:])


def _loss_name(gm: fx.GraphModule, ep) -> str | None:
    """The first user output that is a floating-point scalar."""
    outputs = {spec.arg.name for spec in ep.graph_signature.output_specs
               if spec.kind.name == "USER_OUTPUT" and hasattr(spec.arg, "name")}
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    for arg in pytree.tree_leaves(out_node.args[0]):
        if isinstance(arg, fx.Node) and arg.name in outputs:
            val = arg.meta.get("val")
            if isinstance(val, torch.Tensor) and val.dim() == 0 and val.dtype.is_floating_point:
                return arg.name
    return None
