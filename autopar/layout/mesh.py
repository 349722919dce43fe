"""``MeshSpec``: a logical device mesh described by numbers only, never by devices.

A mesh is a shape (1-D to N-D, any sizes), one name per axis, per-axis link costs (``alpha``
seconds of latency per collective, ``beta`` seconds per byte on the bottleneck link), and the
per-device peak FLOP/s, memory bandwidth (bytes/s) and memory capacity (bytes).

Two peaks: ``peak_flops`` in fp32 (what an fp32 model gets: torch does not use TF32 for matmuls
by default) and ``half_peak_flops`` in bf16/fp16 (tensor cores on a GPU; ``None`` where half
precision is no faster, e.g. a CPU). ``flops_at(itemsize)`` picks the one an op runs at.

Presets come from public spec sheets, for planning without hardware. Devices fill nodes in
row-major order (the last mesh axis is innermost); an axis whose devices all sit in one node
gets NVLink costs, an axis that crosses nodes gets InfiniBand costs. The real machine comes
from ``autopar.calibrate`` (``autopar.runtime.calibrate``), which writes the same JSON with a
``MachineProfile`` (``machine``: measured compute rates per op class, size and dtype, and
alpha/beta per collective kind and axis; ``autopar.layout.machine``) and the measured
``comm_overlap``. Wherever a preset name is accepted, the path of such a file is too
(``MeshSpec.coerce``, ``is_profile_path``); a profile serves only the mesh shape it was measured on.

Host tier (offload): ``host_capacity`` bytes of host memory per device
(None: no host tier), the host<->device link per device (``host_alpha`` s per transfer,
``host_beta`` s per byte per direction) and ``host_mem_bandwidth`` (bytes/s of host memory per
device: what a CPU optimizer step streams through).

Overlap: ``comm_overlap`` in [0, 1] is the share of *asynchronously issued* communication
(gradient buckets all-reduced during backward, ZeRO-2 reduce-scatters) that hides under the
compute running beside it on this backend (``autopar.solver.overlap``). 0 prices every collective
in full, as if issued on the critical path; 1 hides all of it, up to the compute it runs beside.
It is a property of the backend (separate streams, progress threads, cores left for the
transport), so each preset carries one and a calibration measures it.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from dataclasses import asdict, dataclass, replace
from typing import Sequence

from autopar.layout.machine import MachineProfile

__all__ = ["MeshSpec", "PRESETS", "parse_mesh_shape", "parse_bytes", "resolve_preset", "is_profile_path",
           "preset_pipeline_action_s"]

GiB = 1024**3
# 2: half_peak_flops added and peak_flops became the fp32 peak (1: one peak, see from_json).
# 3: the host tier (host_capacity, host_alpha, host_beta, host_mem_bandwidth); 2 has none.
# 4: the calibrated machine (machine: a MachineProfile or null); comm_overlap is read from 3 too.
# 5: the machine's blocking_s (a blocking collective's mid-step wait per axis); a version-4 machine
#    has none: 0, priced as it was.
# 6: the machine's pipeline_action_s (a pipeline schedule action's overhead); a version-5 machine has
#    none: the preset's default (``layout.cost.pipeline_action_seconds``).
# 7: link fits and blocking waits over several mesh axes (a link's "axes", the machine's
#    blocking_over); a version-6 machine has per-axis ones only, priced as it was (``layout.cost``).
# 8: the machine's pipeline_transfer_s (a pipeline point-to-point's measured latency); a version-7
#    machine has none: the links' alpha prices it, as it did.
# 9: the machine's pointwise factors (math functions' kernels over the elementwise rate); a
#    version-8 machine has none: every pointwise op at the elementwise rate, as it was.
JSON_VERSION = 9


@dataclass(frozen=True, slots=True)
class _Device:
    peak_flops: float  # dense FLOP/s in fp32 (no TF32)
    half_peak_flops: float | None  # dense FLOP/s in bf16/fp16 (tensor cores); None: as fp32
    mem_bandwidth: float  # bytes/s
    mem_capacity: int  # bytes
    node_size: int  # devices per node
    intra_alpha: float  # s per collective inside a node
    intra_beta: float  # s per byte, per direction, inside a node
    inter_alpha: float  # s per collective across nodes
    inter_beta: float  # s per byte across nodes (one NIC per device)
    host_capacity: int | None = None  # host memory bytes per device (None: no host tier)
    host_alpha: float = 0.0  # s per host<->device transfer
    host_beta: float = 0.0  # s per byte per direction on the device's host link
    host_mem_bandwidth: float = 0.0  # host memory bytes/s per device (CPU optimizer step)
    comm_overlap: float = 0.0  # share of async communication hidden under compute (module docstring)
    # Seconds one pipeline schedule action costs beyond its work and transfer (``MachineProfile.
    # pipeline_action_s``; the figure a mesh of this preset prices pipelines with).
    pipeline_action_s: float = 0.0


# Public spec-sheet numbers. FLOP/s are dense (no 2:4 sparsity): A100 fp32 19.5 T, bf16 312 T;
# H100 SXM fp32 67 T, bf16 989 T (the marketed 1979 T is sparse). NVLink figures are per
# direction (half the marketed bidirectional bandwidth); inter-node is one HDR (200 Gb/s) or
# NDR (400 Gb/s) NIC per GPU.
#
# Host tier, per GPU. Link: one PCIe x16 per GPU. PCIe 4.0 (16 GT/s/lane, 128b/130b):
# 16 x 16 / 8 x 128/130 = 31.5 GB/s per direction, ~25 GB/s achieved by pinned cudaMemcpy;
# PCIe 5.0 (32 GT/s/lane): 63 GB/s, ~50 GB/s achieved. alpha: ~10 us per copy (launch + DMA
# set-up; an estimate, not a spec figure). Memory: DGX A100 (80 GB) and DGX H100 ship 2 TB of
# system memory for 8 GPUs: 256 GB per GPU. Host memory bandwidth (the CPU optimizer's roofline):
# DGX A100 2x EPYC 7742, 8 channels DDR4-3200 each = 409.6 GB/s, /8 = 51 GB/s per GPU; DGX H100
# 2x Xeon 8480C, 8 channels DDR5-4800 each = 614 GB/s, /8 = 77 GB/s per GPU.
#
# Overlap. NCCL runs its kernels on their own stream and copy engines: a bucket's all-reduce hides
# almost entirely under the backward kernels beside it (DDP's premise); the last bucket, ready
# when backward ends, is what stays exposed, hence a little under 1. On this 2-core machine gloo's
# transport threads take the cores the backward pass computes on: a Qwen2-style decoder on 2 ranks
# (4 layers, hidden 256, batch 8 x 128) ran DDP in 171.6 ms where its compute is ~142 ms and its
# gradient all-reduce ~58 ms, i.e. about half of the all-reduce hid.
_GPU_OVERLAP = 0.9
_CPU_OVERLAP = 0.5
#
# Pipeline schedule actions (``MachineProfile.pipeline_action_s``). On a GPU an action is the
# schedule's Python bookkeeping (a few us), the stage's buffer handling and a batched NCCL
# send/receive launched on its own stream (~10 us apiece to issue): tens of microseconds, with
# the ranks' waits for each other on the device, not in a sleeping thread. On this 2-core machine,
# torch's 1F1B over 2 gloo ranks with trivial stages measured 3.7-4.4 ms per micro-batch at load
# ~4 (two actions, less the links' ~0.4 ms price of its transfers): ~1.7 ms per action, mostly a
# rank woken late from a receive it slept in (``runtime/calibrate_pipeline.py``).
_GPU_ACTION_S = 30e-6
_CPU_ACTION_S = 1.7e-3
PRESETS: dict[str, _Device] = {
    "a100-80gb": _Device(
        peak_flops=19.5e12, half_peak_flops=312e12, mem_bandwidth=2.039e12, mem_capacity=80 * GiB, node_size=8,
        intra_alpha=10e-6, intra_beta=1 / 300e9, inter_alpha=25e-6, inter_beta=1 / 25e9,
        host_capacity=256 * 10**9, host_alpha=10e-6, host_beta=1 / 25e9, host_mem_bandwidth=51e9,
        comm_overlap=_GPU_OVERLAP, pipeline_action_s=_GPU_ACTION_S,
    ),
    "h100-80gb": _Device(
        peak_flops=67e12, half_peak_flops=989e12, mem_bandwidth=3.35e12, mem_capacity=80 * GiB, node_size=8,
        intra_alpha=8e-6, intra_beta=1 / 450e9, inter_alpha=20e-6, inter_beta=1 / 50e9,
        host_capacity=256 * 10**9, host_alpha=10e-6, host_beta=1 / 50e9, host_mem_bandwidth=77e9,
        comm_overlap=_GPU_OVERLAP, pipeline_action_s=_GPU_ACTION_S,
    ),
    # This kind of machine: 2 cores, gloo over loopback (~20 ms per 1 MB all-reduce on 4 ranks).
    # Without AVX512-BF16/AMX, bf16 and fp16 matmuls are emulated: ~1.3 GFLOP/s against ~73 fp32
    # (one thread, 512^3), so half precision is priced ~50x slower -- as it runs.
    "cpu": _Device(
        peak_flops=50e9, half_peak_flops=1e9, mem_bandwidth=10e9, mem_capacity=24 * GiB, node_size=1 << 30,
        intra_alpha=200e-6, intra_beta=1 / 1e9, inter_alpha=200e-6, inter_beta=1 / 1e9,
        # Both tiers are this machine's memory: a "host link" is a memcpy (~10 GB/s, one core).
        host_capacity=24 * GiB, host_alpha=5e-6, host_beta=1 / 10e9, host_mem_bandwidth=10e9,
        comm_overlap=_CPU_OVERLAP, pipeline_action_s=_CPU_ACTION_S,
    ),
}


@dataclass(frozen=True, slots=True)
class MeshSpec:
    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    alpha: tuple[float, ...]  # per axis, seconds per collective
    beta: tuple[float, ...]  # per axis, seconds per byte
    peak_flops: float  # dense FLOP/s in fp32
    mem_bandwidth: float
    mem_capacity: int
    name: str = "custom"
    # Dense FLOP/s in bf16/fp16; None: the same as peak_flops. Last because it has a default.
    half_peak_flops: float | None = None
    # Host tier (see the module docstring); host_capacity None: none (offload is refused).
    host_capacity: int | None = None
    host_alpha: float = 0.0
    host_beta: float = 0.0
    host_mem_bandwidth: float = 0.0
    # Share of asynchronously issued communication hidden under compute (module docstring); 0
    # (every collective priced in full) for a mesh built by hand or read from a file without it.
    comm_overlap: float = 0.0
    # What calibration measured (None: the spec-sheet roofline above prices everything).
    machine: MachineProfile | None = None

    def __post_init__(self) -> None:
        for field in ("shape", "axis_names", "alpha", "beta"):
            object.__setattr__(self, field, tuple(getattr(self, field)))
        n = len(self.shape)
        if n == 0 or any((not isinstance(s, int)) or s < 1 for s in self.shape):
            raise ValueError(f"mesh shape must be a non-empty tuple of positive ints, got {self.shape!r}")
        for field in ("axis_names", "alpha", "beta"):
            if len(getattr(self, field)) != n:
                raise ValueError(
                    f"MeshSpec.{field} has {len(getattr(self, field))} entries for a {n}-D mesh "
                    f"{self.shape}"
                )
        if len(set(self.axis_names)) != n:
            raise ValueError(f"mesh axis names must be distinct, got {self.axis_names!r}")
        if min(self.peak_flops, self.mem_bandwidth, self.mem_capacity) <= 0:
            raise ValueError(
                f"peak_flops, mem_bandwidth and mem_capacity must be positive, got "
                f"{self.peak_flops}, {self.mem_bandwidth}, {self.mem_capacity}"
            )
        if self.half_peak_flops is not None and not self.half_peak_flops > 0:
            raise ValueError(f"half_peak_flops must be positive (or None), got {self.half_peak_flops}")
        if self.host_capacity is not None:
            if isinstance(self.host_capacity, bool) or not isinstance(self.host_capacity, int) \
                    or self.host_capacity <= 0:
                raise ValueError(f"host_capacity must be positive bytes (or None: no host tier), "
                                 f"got {self.host_capacity!r}")
            if not (self.host_alpha >= 0 and self.host_beta > 0 and self.host_mem_bandwidth > 0):
                raise ValueError(
                    f"a host tier needs host_alpha >= 0, host_beta > 0 and host_mem_bandwidth > 0, got "
                    f"{self.host_alpha}, {self.host_beta}, {self.host_mem_bandwidth}")
        self._check_measured()

    def _check_measured(self) -> None:
        if isinstance(self.comm_overlap, bool) or not isinstance(self.comm_overlap, (int, float)) \
                or not 0.0 <= self.comm_overlap <= 1.0:
            raise ValueError(f"MeshSpec.comm_overlap must be a number in [0, 1] (the share of asynchronous "
                             f"communication hidden under compute), got {self.comm_overlap!r}")
        object.__setattr__(self, "comm_overlap", float(self.comm_overlap))
        if self.machine is None:
            return
        if not isinstance(self.machine, MachineProfile):
            raise ValueError(f"MeshSpec.machine must be a MachineProfile or None, got {type(self.machine).__name__}")
        bad = sorted({a for f in self.machine.links for a in f.axes if a >= self.ndim})
        if bad:
            raise ValueError(f"machine profile has link fits for axes {bad} of a {self.ndim}-D mesh {self.shape}")

    def select_axes(self, keep: Sequence[int], *, axis_names: Sequence[str] | None = None) -> "MeshSpec":
        """The sub-mesh of axes ``keep`` (their links, per-kind fits and device kept)."""
        keep = tuple(keep)
        return replace(self, shape=tuple(self.shape[i] for i in keep),
                       axis_names=tuple(axis_names) if axis_names else tuple(self.axis_names[i] for i in keep),
                       alpha=tuple(self.alpha[i] for i in keep), beta=tuple(self.beta[i] for i in keep),
                       machine=None if self.machine is None else self.machine.select_axes(keep))

    @property
    def has_host_tier(self) -> bool:
        return self.host_capacity is not None

    def with_host(self, *, capacity: int | str | None = None, alpha: float | None = None,
                  beta: float | None = None, mem_bandwidth: float | None = None) -> "MeshSpec":
        """This mesh with its host tier's fields replaced where given (``capacity``: bytes or a
        size such as ``"512GB"``, per device)."""
        return replace(
            self, host_capacity=self.host_capacity if capacity is None else parse_bytes(capacity),
            host_alpha=self.host_alpha if alpha is None else alpha,
            host_beta=self.host_beta if beta is None else beta,
            host_mem_bandwidth=self.host_mem_bandwidth if mem_bandwidth is None else mem_bandwidth)

    def host_str(self) -> str:
        """The host tier in words (``"no host tier"`` without one)."""
        if self.host_capacity is None:
            return "no host tier"
        return (f"host {self.host_capacity / 1e9:.0f} GB/device, link {1 / self.host_beta / 1e9:.0f} GB/s, "
                f"host memory {self.host_mem_bandwidth / 1e9:.0f} GB/s")

    # --------------------------------------------------------------------------- factories
    @classmethod
    def preset(cls, name: str, shape: Sequence[int] | str, *, axis_names: Sequence[str] | None = None,
               host_memory: int | str | None = None) -> "MeshSpec":
        """A mesh of ``shape`` built from the named device preset (``a100-80gb``, ``h100-80gb``, ``cpu``);
        ``host_memory``: host bytes per device instead of the preset's."""
        if name not in PRESETS:
            raise ValueError(f"unknown device preset {name!r}; known: {sorted(PRESETS)}")
        mesh = cls._of(name, PRESETS[name], parse_mesh_shape(shape), axis_names)
        return mesh if host_memory is None else mesh.with_host(capacity=host_memory)

    @classmethod
    def cluster(cls, *, nodes: int, devices_per_node: int, device: str = "h100-80gb",
                shape: Sequence[int] | str | None = None, axis_names: Sequence[str] | None = None,
                host_memory: int | str | None = None) -> "MeshSpec":
        """``nodes`` x ``devices_per_node`` devices of preset ``device``, as a mesh of ``shape``
        (default ``(nodes, devices_per_node)``; one node: ``(devices_per_node,)``). Devices fill
        nodes in row-major order, so the inner axes get the intra-node links (an axis whose groups
        stay inside a node) and the outer ones the inter-node links. ``host_memory``: host bytes
        per device instead of the preset's (the node's system memory over its devices)."""
        if device not in PRESETS:
            raise ValueError(f"unknown device preset {device!r}; known: {sorted(PRESETS)}")
        for what, n in (("nodes", nodes), ("devices_per_node", devices_per_node)):
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"{what} must be a positive int, got {n!r}")
        if shape is None:
            shape = (devices_per_node,) if nodes == 1 else (nodes, devices_per_node)
        shape = parse_mesh_shape(shape)
        if math.prod(shape) != nodes * devices_per_node:
            raise ValueError(f"mesh {shape} has {math.prod(shape)} devices, the cluster {nodes} x "
                             f"{devices_per_node} = {nodes * devices_per_node}")
        dev = PRESETS[device]
        if dev.node_size != devices_per_node:
            dev = replace(dev, node_size=devices_per_node)
        mesh = cls._of(device, dev, shape, axis_names)
        return mesh if host_memory is None else mesh.with_host(capacity=host_memory)

    @classmethod
    def _of(cls, name: str, dev: _Device, shape: tuple[int, ...], axis_names) -> "MeshSpec":
        total = math.prod(shape)
        if total > dev.node_size and total % dev.node_size != 0:
            raise ValueError(
                f"mesh {shape} has {total} devices, not a multiple of the {dev.node_size} "
                f"devices per node of preset {name!r}"
            )
        alpha, beta = [], []
        inner = 1
        for size in reversed(shape):
            inner *= size
            # Groups along this axis stay inside one node only if they tile nodes exactly.
            inside = size == 1 or total <= dev.node_size or (
                inner <= dev.node_size and dev.node_size % inner == 0
            )
            alpha.append(dev.intra_alpha if inside else dev.inter_alpha)
            beta.append(dev.intra_beta if inside else dev.inter_beta)
        return cls(
            shape=shape,
            axis_names=tuple(axis_names) if axis_names else default_axis_names(len(shape)),
            alpha=tuple(reversed(alpha)),
            beta=tuple(reversed(beta)),
            peak_flops=dev.peak_flops,
            mem_bandwidth=dev.mem_bandwidth,
            mem_capacity=dev.mem_capacity,
            name=name,
            half_peak_flops=dev.half_peak_flops,
            host_capacity=dev.host_capacity, host_alpha=dev.host_alpha, host_beta=dev.host_beta,
            host_mem_bandwidth=dev.host_mem_bandwidth, comm_overlap=dev.comm_overlap,
        )

    @classmethod
    def coerce(cls, mesh: "MeshSpec | Sequence[int] | str", *, preset: str | None = None,
               device: str | None = None) -> "MeshSpec":
        """Accept a MeshSpec, a shape tuple or ``"2x4"``, or the path of a calibrated profile (its
        mesh, whatever ``preset`` says); shapes get the ``preset`` device preset
        (default ``"cpu"``) or, when ``preset`` is the path of a calibrated profile, that file's
        mesh (``from_profile``: its shape must be the one asked for). ``device`` is the old name
        of ``preset`` (deprecated)."""
        preset = resolve_preset(preset, device)
        if isinstance(mesh, MeshSpec):
            return mesh
        if isinstance(mesh, (str, os.PathLike)) and is_profile_path(mesh):  # the mesh a profile was measured on
            return cls.from_profile(mesh)
        if is_profile_path(preset):
            return cls.from_profile(preset, mesh)
        return cls.preset(preset, mesh)

    @classmethod
    def from_profile(cls, path: str, shape: Sequence[int] | str | None = None) -> "MeshSpec":
        """The mesh in the profile (``autopar calibrate``) or mesh JSON at ``path``; ``shape``
        given: it must be the shape the profile was measured on (links are per axis, so a (4,)
        profile does not describe a (2, 2) mesh: calibrate that mesh)."""
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ValueError(f"mesh profile {path!r} not found (make one with: autopar calibrate --mesh ... "
                             f"--out {path})")
        spec = cls.load(path)
        if shape is not None and parse_mesh_shape(shape) != spec.shape:
            want = "x".join(map(str, parse_mesh_shape(shape)))
            raise ValueError(f"mesh profile {path!r} was measured on mesh {spec.shape}, not the {want} mesh asked "
                             f"for: calibrate that mesh (autopar calibrate --mesh {want} --out FILE) or ask for "
                             f"mesh {spec.shape}")
        return spec

    # ----------------------------------------------------------------------------- queries
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    def flops_at(self, itemsize: int) -> float:
        """Peak FLOP/s of an op computing in ``itemsize``-byte floats: 2 (bf16/fp16) gets the
        half-precision peak, anything else the fp32 peak."""
        if itemsize == 2 and self.half_peak_flops is not None:
            return self.half_peak_flops
        return self.peak_flops

    def axis_index(self, axis: int | str) -> int:
        if isinstance(axis, str):
            if axis not in self.axis_names:
                raise ValueError(f"unknown mesh axis {axis!r}; axes are {self.axis_names}")
            return self.axis_names.index(axis)
        if not 0 <= axis < self.ndim:
            raise ValueError(f"mesh axis {axis} out of range for mesh {self.shape}")
        return axis

    def __str__(self) -> str:
        return f"{self.name}:{'x'.join(map(str, self.shape))}"

    # ------------------------------------------------------------------------------- JSON
    def to_json(self) -> str:
        data = asdict(self)
        data["machine"] = None if self.machine is None else self.machine.to_dict()
        return json.dumps({"version": JSON_VERSION, **data}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> "MeshSpec":
        data = json.loads(text)
        version = data.pop("version", 1)
        if version == 1:
            # Version 1 had one peak, "at training precision": a profiled GPU's was a bf16 matmul
            # and the GPU presets were bf16. Pricing half precision at it keeps old files' plans
            # as they were (fp32 ops too: there is no fp32 figure to price them better).
            if "half_peak_flops" in data:
                raise ValueError("malformed MeshSpec JSON: version 1 has no half_peak_flops (use version 2)")
            if "peak_flops" in data:
                data["half_peak_flops"] = data["peak_flops"]
        if version in (1, 2):
            # Versions 1 and 2 had no host tier: read as none (offload refused, as it was).
            if any(k.startswith("host_") for k in data):
                raise ValueError(f"malformed MeshSpec JSON: version {version} has no host tier (use version 3)")
        # comm_overlap may be absent in any version (files written before it): the field's
        # default, 0, prices communication in full as those files' plans were.
        elif version not in (3, 4, 5, 6, 7, 8, JSON_VERSION):
            raise ValueError(f"MeshSpec JSON version {version} is not supported (expected 1 to {JSON_VERSION})")
        if version < 4 and data.get("machine") is not None:
            raise ValueError(f"malformed MeshSpec JSON: version {version} has no machine profile (use version 4)")
        if data.get("machine") is not None:
            if not isinstance(data["machine"], dict):
                raise ValueError(f"malformed MeshSpec JSON: machine must be an object or null, got {data['machine']!r}")
            if version < 5 and "blocking_s" in data["machine"]:
                raise ValueError(f"malformed MeshSpec JSON: version {version} has no blocking_s (use version 5)")
            if version < 6 and "pipeline_action_s" in data["machine"]:
                raise ValueError(f"malformed MeshSpec JSON: version {version} has no pipeline_action_s "
                                 f"(use version 6)")
            links = data["machine"].get("links")
            if version < 7 and ("blocking_over" in data["machine"] or isinstance(links, list) and any(
                    isinstance(f, dict) and "axes" in f for f in links)):
                raise ValueError(f"malformed MeshSpec JSON: version {version} has no link fits over several axes "
                                 f"or blocking_over (use version 7)")
            if version < 8 and "pipeline_transfer_s" in data["machine"]:
                raise ValueError(f"malformed MeshSpec JSON: version {version} has no pipeline_transfer_s "
                                 f"(use version 8)")
            if version < 9 and "pointwise" in data["machine"]:
                raise ValueError(f"malformed MeshSpec JSON: version {version} has no pointwise factors (use version 9)")
            data["machine"] = MachineProfile.from_dict(data["machine"])
        try:
            return cls(**data)
        except TypeError as exc:
            raise ValueError(f"malformed MeshSpec JSON: {exc}") from None

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str) -> "MeshSpec":
        with open(path) as f:
            return cls.from_json(f.read())


def preset_pipeline_action_s(name: str) -> float:
    """The pipeline action overhead a mesh named ``name`` defaults to (``_Device.pipeline_action_s``):
    its preset's; a calibrated mesh's (``profiled-cpu``, ``profiled-cuda``; a refit one's name
    carries a suffix) its device's; a mesh built by hand the GPU figure."""
    base = name.split(" ")[0]
    base = {"profiled-cpu": "cpu"}.get(base, base)
    return PRESETS[base].pipeline_action_s if base in PRESETS else _GPU_ACTION_S


def resolve_preset(preset: str | None, device: str | None) -> str:
    """The preset name from ``preset=`` or its deprecated old name ``device=`` (a FutureWarning;
    both given: ValueError); neither: ``"cpu"``."""
    if device is None:
        return "cpu" if preset is None else preset
    if preset is not None:
        raise ValueError(f"pass preset= only (device= is its deprecated old name), got preset={preset!r} "
                         f"and device={device!r}")
    warnings.warn(f"device={device!r} names a mesh preset: pass preset={device!r} instead (device= is "
                  f"deprecated)", FutureWarning, stacklevel=3)
    return device


def is_profile_path(preset: str) -> bool:
    """Whether ``preset`` names a mesh profile file rather than a preset: a ``.json`` name or a path."""
    return isinstance(preset, (str, os.PathLike)) and (
        os.fspath(preset).endswith(".json") or os.path.sep in os.fspath(preset))


def default_axis_names(ndim: int) -> tuple[str, ...]:
    return tuple(f"ax{i}" for i in range(ndim))


def parse_mesh_shape(shape: Sequence[int] | str | int) -> tuple[int, ...]:
    """``(2, 4)``, ``[2, 4]``, ``"2x4"``, ``"2,4"`` or ``8`` -> ``(2, 4)`` / ``(8,)``."""
    if isinstance(shape, int):
        shape = (shape,)
    if isinstance(shape, str):
        parts = shape.replace(",", "x").lower().split("x")
        try:
            shape = tuple(int(p) for p in parts if p.strip())
        except ValueError:
            raise ValueError(f"cannot parse mesh shape {shape!r}; expected e.g. '2x4'") from None
    shape = tuple(shape)
    if not shape or any((not isinstance(s, int)) or s < 1 for s in shape):
        raise ValueError(f"mesh shape must be positive ints, got {shape!r}")
    return shape


_SIZE = re.compile(r"(\d+(?:\.\d*)?(?:e\d+)?)([kmgt]?i?b?)")
_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(value: int | float | str) -> int:
    """``"16GiB"``, ``"40 GB"``, ``1e9`` or ``123`` -> bytes (int)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"a memory size must be positive, got {value!r}")
        return int(value)
    if isinstance(value, str):
        m = _SIZE.fullmatch(value.strip().lower().replace(" ", ""))
        if m and m.group(2) in _UNITS:
            result = int(float(m.group(1)) * _UNITS[m.group(2)])
            if result > 0:
                return result
    raise ValueError(f"cannot parse memory size {value!r}; expected e.g. '16GiB', '40GB' or bytes")
