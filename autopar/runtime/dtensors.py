"""autopar layouts as ``torch.distributed.tensor`` placements, and local shards as ``DTensor``s.

``S(d)`` is ``Shard(d)`` and ``R`` is ``Replicate()``, one placement per mesh axis on the
``DeviceMesh`` of the ``ProcessMesh`` (dim names = the ``MeshSpec`` axis names). A tensor dim
sharded by several axes (``S0S0``) needs no conversion: autopar's shard index is the mixed-radix
number of the coordinates on those axes with the lower axis as the major digit
(``TensorSpec.local_slices``), which is DTensor's default order for ``(Shard(0), Shard(0))`` --
mesh dim 0 splits first, mesh dim 1 splits each of its pieces (tests/runtime/test_dtensor.py
checks it against ``distribute_tensor``). A segmented shard ``S(d/k)`` is DTensor's
``_StridedShard(d, split_factor=k)``: the same pieces (``[seg0_r | ... ]`` on coordinate ``r``),
so ``full_tensor`` and ``distribute_tensor`` (checkpoints, optimizer state) reorder them.
``P`` never describes a value at rest: refused.

The emitted graph runs on local tensors; ``to_dtensor`` wraps a local shard WITHOUT copying
(``DTensor.from_local(..., run_check=False)`` with the global shape given), so the DTensor and
the graph's view share storage. The graph reads each trained parameter through a ``LocalLeaf``:
its local tensor as a persistent leaf whose gradient is delivered into the DTensor's ``.grad``
(a DTensor with its placements, accumulated like autograd does) or handed to the parameter's
gradient bucket: per parameter, ``to_local``'s own backward and autograd's accumulation of a
DTensor gradient (a wrapper it cannot steal, so it copies) cost about 0.2 ms on CPU. As with
bucketed gradients, the gradients arrive in ``.grad`` (``loss.backward()``), not through
``torch.autograd.grad``.
"""

from __future__ import annotations

import weakref
from typing import Callable, Sequence

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from autopar.layout.placement import Partial, TensorSpec
from autopar.layout.placement import Shard as AutoparShard
from autopar.runtime.process_mesh import ProcessMesh

__all__ = ["dtensor_placements", "to_dtensor", "local_of", "LocalLeaf", "grad_like"]


def dtensor_placements(spec: TensorSpec) -> tuple[Placement, ...]:
    """The DTensor placements of an autopar layout at rest (one per mesh axis)."""
    out: list[Placement] = []
    for p in spec.placements:
        if isinstance(p, Partial):
            raise ValueError(f"a value at rest cannot have a partial layout: {spec}")
        if isinstance(p, AutoparShard) and p.segments > 1:
            out.append(_StridedShard(p.dim, split_factor=p.segments))
        else:
            out.append(Shard(p.dim) if isinstance(p, AutoparShard) else Replicate())
    return tuple(out)


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(int(size), 1)
    return tuple(reversed(stride))


def to_dtensor(local: torch.Tensor, spec: TensorSpec, pmesh: ProcessMesh,
               global_shape: Sequence[int]) -> DTensor:
    """``local`` (this rank's shard under ``spec``) as a DTensor sharing its storage."""
    want = spec.local_shape(tuple(global_shape), pmesh.shape)
    if tuple(local.shape) != tuple(want):
        raise ValueError(f"local shard of shape {tuple(local.shape)} does not fit layout {spec} of a "
                         f"{tuple(global_shape)} tensor on mesh {pmesh.shape} (expected {tuple(want)})")
    return DTensor.from_local(local.detach(), pmesh.device_mesh, dtensor_placements(spec), run_check=False,
                              shape=torch.Size(global_shape), stride=_contiguous_stride(global_shape))


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (its storage, no autograd), else ``t`` itself.

    ``_local_tensor`` is what ``to_local()`` returns under ``no_grad``; read directly, it skips
    the grad-mode switch and the method call, which the step pays for every parameter (forward's
    local views, each gradient delivered): about 1.5 us each on CPU against 0.05 us."""
    if isinstance(t, DTensor):
        return t._local_tensor
    return t


def grad_like(local: torch.Tensor, param: DTensor) -> DTensor:
    """``local`` (this rank's gradient of ``param``, contiguous) as a DTensor with ``param``'s
    placements, shape and stride, without copying: what ``DTensor.from_local(local,
    param.device_mesh, param.placements, run_check=False, shape=param.shape,
    stride=param.stride())`` returns. The parameter's spec is reused as is (a gradient has its
    parameter's layout and global shape; ``to_dtensor`` gives parameters contiguous strides), so
    each delivered gradient costs one wrapper (about 2 us) instead of ``from_local``'s autograd
    function and spec construction (about 17 us), once per parameter per step."""
    spec = param._spec
    meta = spec.tensor_meta
    if (meta is None or local.dtype != meta.dtype or not local.is_contiguous()
            or tuple(meta.stride) != _contiguous_stride(meta.shape)):
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return DTensor(local, spec, requires_grad=False)


class LocalLeaf:
    """``param``'s local tensor as a persistent autograd leaf the emitted graph reads, whose
    gradient goes to ``sink(grad)`` instead of accumulating in the leaf (default: into
    ``param.grad`` as a DTensor with its placements, accumulated like autograd does).

    Made once per parameter (the module remakes it when the parameter, its local tensor or that
    tensor's memory is replaced): the leaf shares the local tensor's storage and version counter, so the
    optimizer's in-place updates are what the next forward reads. The gradient is taken by a
    pre-hook on the leaf's ``AccumulateGrad`` node (kept here: a leaf holds its accumulator only
    weakly), which hands it on and lets nothing accumulate -- one Python call per parameter in
    backward and none in forward, where an autograd function over the local views cost one node
    in forward and one call in backward per step, and a gradient bucket's own autograd function
    (``runtime.bucketing``) one more of each per parameter."""

    __slots__ = ("param", "base", "leaf", "node", "sink", "__weakref__")

    def __init__(self, param: torch.Tensor, sink: "Callable[[torch.Tensor], None] | None" = None) -> None:
        self.param = param
        self.base = local_of(param)
        self.leaf = self.base.detach().requires_grad_(True)
        self.node = self.leaf.view_as(self.leaf).grad_fn.next_functions[0][0]
        self.sink = self.deliver if sink is None else sink
        ref = weakref.ref(self)  # the node is ours: a strong reference back would be a cycle
        self.node.register_prehook(lambda grads: _take(ref, grads))

    def current(self, param: torch.Tensor) -> bool:
        """Still the leaf of ``param``: not replaced, nor its local tensor, nor that tensor's memory
        (the chunk runtime points a local tensor at another buffer with ``set_``)?"""
        return self.param is param and self.base is local_of(param) and self.leaf.data_ptr() == self.base.data_ptr()

    @torch.no_grad()
    def deliver(self, grad: torch.Tensor) -> None:
        param = self.param
        if param.grad is not None:
            local_of(param.grad).add_(grad)
        elif isinstance(param, DTensor):
            param.grad = grad_like(grad.contiguous(), param)
        else:
            param.grad = grad.clone(memory_format=torch.contiguous_format)


def _take(ref: "weakref.ref[LocalLeaf]", grads: tuple) -> tuple:
    leaf = ref()
    if leaf is not None and grads[0] is not None:
        leaf.sink(grads[0])
    return (None,)  # nothing accumulates in the leaf itself
