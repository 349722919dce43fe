"""Depth-independent tracing: export a model with its repeated blocks cut to four, then expand.

A model whose forward loops over one ``nn.ModuleList`` of N identical blocks is exported with the
list cut to blocks 0, 1, 2 and N-1 (the real objects, under their own indices, so module paths,
parameter names and any per-block attribute of the last block are the full model's). The traced
graph is then expanded: blocks 3 .. N-2 are copies of block 2 (its ops, shapes and metadata, with
their own parameters), the last block reads block N-2, and every node gets the name the full
export gives it (fx numbers each base name in order; the per-block step is read off blocks 1 and
2 and checked against block N-1). Whatever is not recognised returns None: the caller exports the
full model, never a guessed graph.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Callable

import torch.fx as fx
from torch import nn

from autopar.layout.blocks import split_block
from autopar.tracer.depth import BlockStructure, block_structure
from autopar.tracer.graph import (BUFFER, MODULE_KEY, PARAMETER, PLACEHOLDER_KEY, Placeholder, TracedGraph,
                                  lazy_graph_module)

_MIN_DEPTH = 6  # shallower models export in full: the cut would save little
_KEEP = 3       # blocks 0 .. _KEEP-1 stay, then the last one
_NAME = re.compile(r"^(.*?)(?:_(\d+))?$")


def repeated_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The one ``nn.ModuleList`` of >= _MIN_DEPTH blocks that look alike (same class, parameters,
    buffers and settings); None when there is none, or more than one."""
    found = [(path, m) for path, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) >= _MIN_DEPTH]
    if len(found) != 1:
        return None
    path, blocks = found[0]
    # The graph names blocks by their outermost indexed module (layout.blocks): a list nested in
    # another indexed module (ResNet's stages.3.layers) would not be the graph's blocks.
    if not path or split_block(path) is not None:
        return None
    if _shares_tensors(model, path) or len({id(b) for b in blocks}) != len(blocks):
        return None  # tied across blocks: the cut model would name fewer aliases
    template = _fingerprint(blocks[_KEEP - 1])  # (once: every later block is compared with it)
    if not all(_alike(template, _KEEP - 1, blocks[i], i) for i in range(_KEEP, len(blocks) - 1)):
        return None
    return path, blocks


def _shares_tensors(model: nn.Module, path: str) -> bool:
    """A parameter or buffer inside the list is also registered under another name."""
    names: dict[int, int] = {}
    inside: set[int] = set()
    for fqn, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        names[id(t)] = names.get(id(t), 0) + 1
        if fqn.startswith(path + "."):
            inside.add(id(t))
    return any(names[i] > 1 for i in inside)


def _alike(fa: tuple | None, i: int, b: nn.Module, k: int) -> bool:
    """Block ``i`` (its ``_fingerprint`` ``fa``) and block ``k`` trace alike: same classes, tensor
    shapes/dtypes and plain settings, except settings equal to the block's own index in both
    (``layer_idx``)."""
    fb = _fingerprint(b)
    if fa is None or fb is None or fa[0] != fb[0] or fa[1].keys() != fb[1].keys():
        return False
    return all(va == vb or (type(va) is int and type(vb) is int and (va, vb) == (i, k))
               for (key, va), vb in zip(fa[1].items(), fb[1].values()))


def _fingerprint(block: nn.Module) -> tuple[tuple, dict] | None:
    """(classes and tensor shapes/dtypes, {(module, attribute): plain setting}); None: hooked."""
    shape, settings = [], {}
    for path, m in block.named_modules():
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks:
            return None
        tensors = tuple((k, None if t is None else (tuple(t.shape), t.dtype, t.requires_grad))
                        for table in (m._parameters, m._buffers) for k, t in table.items())
        shape.append((path, type(m), m.training, tensors))
        for key, value in sorted((k, v) for k, v in vars(m).items() if not k.startswith("_")):
            if isinstance(value, (bool, int, float, str, type(None))):
                settings[(path, key)] = value
            elif isinstance(value, (tuple, list)) and all(isinstance(v, (bool, int, float, str)) for v in value):
                settings[(path, key)] = tuple(value)
            else:  # configs, functions, modules: the same object in every block
                settings[(path, key)] = (type(value).__name__, id(value))
    return tuple(shape), settings


@contextlib.contextmanager
def cut(blocks: nn.ModuleList):
    """``blocks`` holds only blocks 0 .. _KEEP-1 and the last one (under their own keys)."""
    saved = blocks._modules
    keys = list(saved)
    blocks._modules = type(saved)((k, saved[k]) for k in (*keys[:_KEEP], keys[-1]))
    try:
        yield
    finally:
        blocks._modules = saved


def trace_shallow(model: nn.Module, export_and_build: Callable[[nn.Module], TracedGraph]
                  ) -> TracedGraph | None:
    """The full model's traced graph from a trace of its cut copy; None when not applicable."""
    found = repeated_list(model)
    if found is None:
        return None
    path, blocks = found
    depth = len(blocks)
    if list(blocks._modules) != [str(i) for i in range(depth)]:
        return None
    with cut(blocks):
        try:
            shallow = export_and_build(model)
        except Exception:  # noqa: BLE001 - e.g. a forward indexing block N-1 by position: full path
            return None
    trainable = {fqn: p.requires_grad for fqn, p in model.named_parameters(remove_duplicate=False)}
    return expand(shallow, depth, trainable)


def expand(shallow: TracedGraph, depth: int, trainable: dict[str, bool]) -> TracedGraph | None:
    """``shallow`` (blocks 0, 1, 2 and depth-1) with blocks 3 .. depth-2 put back."""
    s = block_structure(shallow, indices=(*range(_KEEP), depth - 1), min_blocks=_KEEP + 1)
    if s is None:
        return None
    namer = _Namer.build(s)
    own_t, own_last = f"{s.prefix}.{_KEEP - 1}", f"{s.prefix}.{depth - 1}"
    params = _block_placeholders(shallow, own_t)
    if namer is None or params is None or params != _block_placeholders(shallow, own_last):
        return None
    try:
        return _Expansion(shallow, s, depth, namer, trainable).run()
    except _Mismatch:
        return None


class _Mismatch(Exception):
    """A name or placeholder the expansion cannot reproduce exactly: fall back."""


def _block_placeholders(traced: TracedGraph, own: str) -> dict | None:
    """Kind -> [(relative FQN, shape, dtype)] of one block's parameters and buffers (None: tied)."""
    out: dict = {PARAMETER: [], BUFFER: []}
    for p in traced.placeholders:
        if p.kind in out and p.fqn.startswith(own + "."):
            if len(p.aliases) > 1:
                return None
            out[p.kind].append((p.fqn[len(own):], p.shape, p.dtype))
    return out


class _Namer:
    """The names the full export gives: fx numbers each base name in graph order ("add",
    "add_1", ...), so block k's node is block 2's plus (k-2) per-block steps of its base."""

    def __init__(self, step: dict[str, int]) -> None:
        self.step = step
        self._split: dict[str, tuple[str, int]] = {}  # name -> (base, index): template names recur

    @staticmethod
    def build(s: BlockStructure) -> "_Namer | None":
        step: dict[str, int] = {}
        for one, two, last in zip(s.blocks[_KEEP - 2], s.blocks[_KEEP - 1], s.blocks[_KEEP]):
            (b1, i1), (b2, i2), (b3, i3) = _split(one.name), _split(two.name), _split(last.name)
            if not b1 == b2 == b3 or step.setdefault(b2, i2 - i1) != i2 - i1 or i3 - i2 != i2 - i1:
                return None
        return _Namer(step)

    def shifted(self, name: str, blocks: int) -> str:
        parts = self._split.get(name)
        if parts is None:
            parts = self._split[name] = _split(name)
        base, idx = parts
        idx += self.step.get(base, 0) * blocks
        return f"{base}_{idx}" if idx else base


def _placeholder_name(kind, fqn: str) -> str:
    """How torch.export names a parameter's or buffer's placeholder (checked on block 2's)."""
    return ("p_" if kind == PARAMETER else "b_") + re.sub(r"[^a-zA-Z0-9]", "_", fqn.lower())


def _split(name: str) -> tuple[str, int]:
    m = _NAME.match(name)
    return m.group(1), int(m.group(2) or 0)


def _moved_meta(meta: dict, src: str, dst: str, stacks: dict | None = None) -> dict:
    """Node metadata with module paths in block ``src`` moved to block ``dst``. ``stacks``:
    moved ``nn_module_stack``s of this move by content (a block's ops share a few stacks);
    each node gets its own copy."""
    def move(path: Any) -> Any:
        if isinstance(path, str) and (path == src or path.startswith(src + ".")):
            return dst + path[len(src):]
        return path
    out = dict(meta)
    if MODULE_KEY in out:
        out[MODULE_KEY] = move(out[MODULE_KEY])
    stack = out.get("nn_module_stack")
    if stack is not None:
        key = tuple(stack.items()) if stacks is not None else None
        moved = stacks.get(key) if key is not None else None
        if moved is None:
            moved = {k: (move(v[0]), *v[1:]) for k, v in stack.items()}
            if key is not None:
                stacks[key] = moved
        out["nn_module_stack"] = dict(moved)
    return out


class _Expansion:
    """One pass over the shallow graph, copying it into the full one (see :func:`expand`)."""

    def __init__(self, shallow: TracedGraph, s: BlockStructure, depth: int, namer: _Namer,
                 trainable: dict[str, bool]) -> None:
        self.shallow, self.s, self.depth, self.namer, self.trainable = shallow, s, depth, namer, trainable
        self.graph = fx.Graph()
        self.env: dict[Any, fx.Node] = {}
        self.placeholders: list[Placeholder] = []
        self.own_t = f"{s.prefix}.{_KEEP - 1}"
        self.template = s.blocks[_KEEP - 1]
        self.pos = {n: j for j, n in enumerate(self.template)}
        self.prev_pos = {n: j for j, n in enumerate(s.blocks[_KEEP - 2])}
        self.last = set(s.blocks[_KEEP])
        self.template_params = {n for n in shallow.graph.nodes if n.op == "placeholder"
                                and n.meta[PLACEHOLDER_KEY].fqn.startswith(self.own_t + ".")
                                and n.meta[PLACEHOLDER_KEY].kind in (PARAMETER, BUFFER)}

    def copy(self, node: fx.Node, mapping: Callable[[fx.Node], fx.Node], name: str, meta: dict,
             target: Any = None) -> fx.Node:
        # Created bare, then wired: create_node walks the arguments with pytree looking for raw
        # SymInts (a warning; export's graphs have none), the longest part of copying a node.
        new = self.graph.create_node(node.op, node.target if target is None else target, name=name,
                                     type_expr=node.type)
        if new.name != name:
            raise _Mismatch(name)
        # What ``new.args = ...; new.kwargs = ...`` run, in one call: the attribute route also
        # takes the node out of and back into the graph's lookup table (keyed by op and target,
        # which do not change here) once per attribute.
        new._update_args_kwargs(fx.node.map_arg(node.args, mapping), fx.node.map_arg(node.kwargs, mapping))
        new.meta = meta
        return new

    def run(self) -> TracedGraph:
        s, env, depth = self.s, self.env, self.depth
        own_last = f"{s.prefix}.{depth - 1}"
        first_of_last = {}
        for node in self.shallow.graph.nodes:
            info = node.meta.get(PLACEHOLDER_KEY)
            if node.op == "placeholder" and info.kind in (PARAMETER, BUFFER) and info.fqn.startswith(own_last + "."):
                first_of_last.setdefault(info.kind, node)
        inserted = False
        for node in self.shallow.graph.nodes:
            if node.op == "placeholder":
                info = node.meta[PLACEHOLDER_KEY]
                if first_of_last.get(info.kind) is node:
                    self.insert_placeholders(info.kind)
                env[node] = self.copy(node, lambda a: a, node.name, node.meta)
                self.placeholders.append(info)
                continue
            if node is s.blocks[_KEEP][0]:
                for k in range(_KEEP, depth - 1):
                    self.insert_block(k)
                inserted = True
            if node in self.last:
                mapping = self.last_inputs
            else:
                mapping = env.__getitem__
            # after the inserted blocks, fx's counters have moved on by N-4 blocks' worth
            name = self.namer.shifted(node.name, depth - _KEEP - 1) if inserted and node.op != "output" else node.name
            env[node] = self.copy(node, mapping, name, node.meta)
        if not inserted:
            raise _Mismatch("no blocks")
        self.graph.lint()
        gm = lazy_graph_module(self.shallow.gm, self.graph)
        loss = self.shallow.loss_node
        traced = TracedGraph(gm, placeholders=tuple(self.placeholders), in_spec=self.shallow.in_spec,
                             out_spec=self.shallow.out_spec, constants=self.shallow.constants,
                             loss_name=env[loss].name if loss is not None else None,
                             model_name=self.shallow.model_name)
        # The full graph's blocks are known: the shallow graph's (checked alike by
        # ``block_structure``) and the copies of block 2 put between them. Re-discovering them
        # would walk every node again (the profile and the builder ask for them).
        traced._blocks = (self.full_structure(),)
        return traced

    def full_structure(self) -> BlockStructure:
        s, env = self.s, self.env
        ours = [tuple(env[n] for n in run) for run in s.blocks[:_KEEP]]
        ours += [tuple(env[(k, n)] for n in self.template) for k in range(_KEEP, self.depth - 1)]
        ours.append(tuple(env[n] for n in s.blocks[_KEEP]))
        return BlockStructure(s.prefix, tuple(ours), tuple(env[n] for n in s.before),
                              tuple(env[n] for n in s.after))

    def insert_placeholders(self, kind) -> None:
        """Blocks 3 .. N-2's parameters (or buffers), named as the full export names them."""
        srcs = [n for n in self.shallow.graph.nodes if n in self.template_params
                and n.meta[PLACEHOLDER_KEY].kind == kind]
        for k in range(_KEEP, self.depth - 1):
            own = f"{self.s.prefix}.{k}"
            for src in srcs:
                p = src.meta[PLACEHOLDER_KEY]
                fqn = own + p.fqn[len(self.own_t):]
                if p.name != _placeholder_name(kind, p.fqn):
                    raise _Mismatch(p.name)
                name = _placeholder_name(kind, fqn)
                info = Placeholder(name=name, kind=kind, fqn=fqn, aliases=(fqn,), shape=p.shape,
                                   dtype=p.dtype, requires_grad=kind == PARAMETER and self.trainable.get(fqn, False))
                self.env[(k, src)] = self.copy(src, lambda a: a, name, {**src.meta, PLACEHOLDER_KEY: info},
                                               target=name)
                self.placeholders.append(info)

    def insert_block(self, k: int) -> None:
        env = self.env

        def inputs(a: fx.Node) -> fx.Node:
            if a in self.pos or a in self.template_params:
                return env[(k, a)]
            if a in self.prev_pos:  # block k-1: block 2 itself, or an inserted copy
                t = self.template[self.prev_pos[a]]
                return env[(k - 1, t)] if k - 1 >= _KEEP else env[t]
            return env[a]

        own = f"{self.s.prefix}.{k}"
        stacks: dict = {}
        for src in self.template:
            env[(k, src)] = self.copy(src, inputs, self.namer.shifted(src.name, k - _KEEP + 1),
                                      _moved_meta(src.meta, self.own_t, own, stacks))

    def last_inputs(self, a: fx.Node) -> fx.Node:
        """The last block reads block N-2 where the shallow one read block 2."""
        if a in self.pos:
            return self.env[(self.depth - 2, a)]
        return self.env[a]
