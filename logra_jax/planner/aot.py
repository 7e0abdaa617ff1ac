"""Compile-only devices for named accelerator targets: the real TPU and NVIDIA compilers, without the hardware.

A target names a chip and how many of it, e.g. `v5e:2x4` (8 TPU v5e chips), `h100:8` (8 H100s) or `cpu:8` (fake
CPU devices). `devices(target)` returns compile-only `jax.Device`s for it: `jax.jit(f).lower(...)` with shardings
over them runs that chip's compiler (libtpu's for TPUs; XLA:GPU, Triton and ptxas for NVIDIA GPUs) on this CPU
host, and `compiled.memory_analysis()` / `cost_analysis()` report what it planned; nothing executes. Kernels
traced for a mesh of these devices are chosen for them (`logra_jax.kernels.backend.compiling_for`, which
`sharding.jit_train_step` enters for its mesh).

Each compiler lives in its own virtualenv, beside the main one, so that the main one never probes for an
accelerator:
  make venv-tpu    # .venv-tpu: jax[tpu] (libtpu)   for v4 / v5e / v5p / v6e targets
  make venv-cuda   # .venv-cuda: jax[cuda13]        for h100 / h200 / a100 targets
Run under them with JAX_PLATFORMS=cpu, e.g.
  JAX_PLATFORMS=cpu .venv-tpu/bin/python experiments/memory/run.py --target v5e:2x2

`target_info(target)` needs no compiler: the chip's published HBM size, peak bf16 FLOP/s, HBM bandwidth and
inter-chip bandwidth (ICI per TPU chip, NVLink per GPU; per device, with the sources cited in `_CHIPS`), the TPU
VMEM the compiler allocates (measured) and the GPU shared memory per block. `roofline(flops, hbm_bytes,
collective_bytes, info)` turns a step's cost (`logra_jax.planner.hlo_cost`) into a time on that chip. GPU targets are
described to XLA by a `GpuTargetConfigProto` (text format) written from the vendors' published specifications
(`gpu_target_config`).

Example:
  >>> info = target_info("v5e:2x4")
  >>> info.platform, info.num_devices, info.hbm_bytes / 2**30
  ('tpu', 8, 16.0)
  >>> len(devices("cpu:1"))
  1
  >>> r = roofline(197e12, 819e9, 200e9, info)  # 1 s of peak flops, 1 s of HBM, 1 s of ICI on v5e
  >>> round(r.compute, 3), round(r.memory, 3), round(r.collective, 3), round(r.seconds, 3), r.bound
  (1.0, 1.0, 1.0, 2.0, 'compute')
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import sys

import jax

from logra_jax.kernels.backend import TPU_VMEM_BYTES
from logra_jax.parallel import sharding as shd

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class _Chip:
    """Per-device published figures of one accelerator (a TPU chip is one device unless `devices_per_chip`)."""

    platform: str  # "tpu" | "gpu"
    device_kind: str  # jax.Device.device_kind of its compile-only devices
    hbm_bytes: int
    peak_bf16_flops: float  # dense bf16 matmul FLOP/s
    hbm_bandwidth: float  # bytes/s
    link_bandwidth: float  # bytes/s a chip receives over all its inter-chip links (ICI, NVLink): one direction
    sources: tuple[str, ...]
    devices_per_chip: int = 1  # TPU v4's compile-only topology has one device per TensorCore (2 per chip)
    gpu: dict[str, float] | None = None  # the GpuDeviceInfoProto fields of a GPU (see `gpu_target_config`)


_TPU_DOCS = "https://cloud.google.com/tpu/docs/{}"
_CUDA_GUIDE = ("NVIDIA CUDA C++ Programming Guide, 'Technical Specifications per Compute Capability' (shared memory "
               "per SM / per block opt-in, 64 K 32-bit registers per SM and per block, 1024 threads per block, "
               "2048 per SM, warp 32)")
# Shared memory per block without opting in is 48 KiB on every compute capability (same guide).
_SMEM_DEFAULT = 48 * 1024

_SCALING_BOOK = ("How to Scale Your Model (JAX team), 'How to Think About TPUs': ICI bandwidth per link, one-way "
                 "and bidirectional, https://jax-ml.github.io/scaling-book/tpus/")
_CHIPS: dict[str, _Chip] = {
    # Google Cloud TPU system-architecture pages, per chip: peak bf16 compute, HBM capacity and bandwidth, and the
    # bidirectional ICI bandwidth per chip (v5e 400 GB/s, v5p 1200 GB/s, v6e 800 GB/s), of which one direction
    # (half) is what a chip receives. The v4 page gives none: 6 links × 45 GB/s one-way (the scaling book's
    # per-link figure for v4, whose 3D torus has 6 links per chip, as v5p's).
    "v4": _Chip("tpu", "TPU v4", 32 * GIB, 275e12, 1200e9, 6 * 45e9, (_TPU_DOCS.format("v4"), _SCALING_BOOK),
                devices_per_chip=2),
    "v5e": _Chip("tpu", "TPU v5 lite", 16 * GIB, 197e12, 819e9, 400e9 / 2, (_TPU_DOCS.format("v5e"),)),
    "v5p": _Chip("tpu", "TPU v5", 95 * GIB, 459e12, 2765e9, 1200e9 / 2, (_TPU_DOCS.format("v5p"),)),
    "v6e": _Chip("tpu", "TPU v6 lite", 32 * GIB, 918e12, 1640e9, 800e9 / 2, (_TPU_DOCS.format("v6e"),)),
    # NVIDIA datasheets (SXM parts): bf16 tensor-core peak without sparsity (half the "with sparsity" figure),
    # memory size and bandwidth, SM count and boost clock; architecture whitepapers for FP32 cores per SM and
    # L2 size; the CUDA guide for per-SM and per-block limits. Memory sizes are the nominal "80 GB" / "141 GB"
    # read as GiB; a process gets a little less (the driver's and CUDA context's share). NVLink: the datasheets'
    # total (both directions) per GPU, of which half is what a GPU receives.
    "h100": _Chip("gpu", "NVIDIA H100 80GB HBM3", 80 * GIB, 989.4e12, 3.35e12, 900e9 / 2, (
        "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM: 1,979 TFLOPS bf16 with sparsity, 80 GB, 3.35 TB/s, "
        "NVLink 900 GB/s, 132 SMs)",
        "NVIDIA H100 Tensor Core GPU Architecture whitepaper (128 FP32 cores per SM, 50 MB L2, 1.98 GHz max boost)",
        _CUDA_GUIDE + ": compute capability 9.0, 228 KiB per SM, 227 KiB per block"),
        gpu={"major": 9, "minor": 0, "core_count": 132, "fpus_per_core": 128, "clock_rate_ghz": 1.98,
             "shared_memory_per_core": 228 * 1024, "shared_memory_per_block_optin": 227 * 1024,
             "l2_cache_size": 50 * 2**20}),
    "h200": _Chip("gpu", "NVIDIA H200", 141 * GIB, 989.4e12, 4.8e12, 900e9 / 2, (
        "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM: 1,979 TFLOPS bf16 with sparsity, 141 GB HBM3e, "
        "4.8 TB/s, NVLink 900 GB/s)",
        "the H100's Hopper die (GH100: 132 SMs, 50 MB L2, 1.98 GHz), per the H100 whitepaper",
        _CUDA_GUIDE + ": compute capability 9.0, 228 KiB per SM, 227 KiB per block"),
        gpu={"major": 9, "minor": 0, "core_count": 132, "fpus_per_core": 128, "clock_rate_ghz": 1.98,
             "shared_memory_per_core": 228 * 1024, "shared_memory_per_block_optin": 227 * 1024,
             "l2_cache_size": 50 * 2**20}),
    "a100": _Chip("gpu", "NVIDIA A100-SXM4-80GB", 80 * GIB, 312e12, 2039e9, 600e9 / 2, (
        "NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM: 312 TFLOPS bf16 dense, 80 GB HBM2e, 2,039 GB/s, "
        "NVLink 600 GB/s)",
        "NVIDIA A100 Tensor Core GPU Architecture whitepaper (108 SMs, 64 FP32 cores per SM, 40 MB L2, "
        "1.41 GHz boost)", _CUDA_GUIDE + ": compute capability 8.0, 164 KiB per SM, 163 KiB per block"),
        gpu={"major": 8, "minor": 0, "core_count": 108, "fpus_per_core": 64, "clock_rate_ghz": 1.41,
             "shared_memory_per_core": 164 * 1024, "shared_memory_per_block_optin": 163 * 1024,
             "l2_cache_size": 40 * 2**20}),
}

TARGETS: tuple[str, ...] = ("v4:2x2x1", "v5e:2x4", "v5p:2x2x1", "v6e:2x4", "h100:8", "h200:8", "a100:8", "cpu:8")
# Cloud TPU accelerator-type names (v4 and v5p count TensorCores, two per chip; v5e and v6e count chips).
_ACCELERATOR_TYPE = {"v4": "v4-{cores}", "v5e": "v5litepod-{chips}", "v5p": "v5p-{cores}", "v6e": "v6e-{chips}"}
_VENVS = {"tpu": ("libtpu", "make venv-tpu", ".venv-tpu"), "gpu": ("jax_cuda13_plugin", "make venv-cuda", ".venv-cuda")}
# The CUDA runtime and cuDNN of the jax[cuda13] wheels the target config describes (13.x; cuDNN 9 from its pins).
_CUDA_RUNTIME, _CUDNN = (13, 0, 0), (9, 0, 0)


@dataclasses.dataclass(frozen=True)
class TargetInfo:
    """A named target: how many devices of which chip, and the chip's published per-device figures.

    hbm_bytes, peak_bf16_flops (dense FLOP/s), hbm_bandwidth and link_bandwidth (bytes/s; link: what a device
    receives over the chip's inter-chip links, ICI or NVLink, in one direction) are per device (None for CPU);
    vmem_bytes is the VMEM a TPU kernel may use (measured with the compiler: kernels.backend.TPU_VMEM_BYTES);
    shared_memory_per_block the GPU's opt-in limit per thread block (default 48 KiB without opting in).
    """

    target: str
    chip: str
    platform: str
    topology: str
    num_devices: int
    device_kind: str
    hbm_bytes: int | None
    peak_bf16_flops: float | None
    hbm_bandwidth: float | None
    link_bandwidth: float | None
    vmem_bytes: int | None
    shared_memory_per_block: int | None
    venv: str | None  # the virtualenv whose compiler this target needs (None: any)
    sources: tuple[str, ...]


# TPU topologies of 1, 4 and 8 devices (v4: 2 devices per chip); GPUs and CPUs are simply "<chip>:<count>".
_TPU_TOPOLOGIES = {("v5e", 1): "1x1", ("v6e", 1): "1x1", ("v4", 8): "2x2x1", ("v5e", 4): "2x2", ("v5e", 8): "2x4",
                   ("v5p", 4): "2x2x1", ("v5p", 8): "2x2x2", ("v6e", 4): "2x2", ("v6e", 8): "2x4"}


def target_for(chip: str, num_devices: int) -> str:
    """The target of `num_devices` devices of `chip`, e.g. ("v5e", 4) → "v5e:2x2", ("h100", 4) → "h100:4".

    Raises:
      ValueError: an unknown chip, or a TPU device count with no topology listed here.
    """
    if chip == "cpu" or (chip in _CHIPS and _CHIPS[chip].platform == "gpu"):
        return f"{chip}:{num_devices}"
    if (chip, num_devices) not in _TPU_TOPOLOGIES:
        raise ValueError(f"target_for: no topology of {num_devices} devices for chip {chip!r}; known: "
                         f"{sorted(_TPU_TOPOLOGIES)}")
    return f"{chip}:{_TPU_TOPOLOGIES[chip, num_devices]}"


def _split(target: str) -> tuple[str, str]:
    chip, sep, topology = str(target).partition(":")
    if not sep or not topology or (chip not in _CHIPS and chip != "cpu"):
        raise ValueError(f"target must be '<chip>:<topology>' with chip one of {[*_CHIPS, 'cpu']} (e.g. "
                         f"{', '.join(TARGETS)}), got {target!r}")
    return chip, topology


def _count(target: str, topology: str, sep: str) -> int:
    try:
        sizes = [int(n) for n in topology.split(sep)]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ValueError(f"target {target!r}: topology {topology!r} must be positive integers joined by {sep!r}")
    return math.prod(sizes)


def target_info(target: str) -> TargetInfo:
    """The chip, device count and published per-device figures of `target` (no compiler needed).

    Raises:
      ValueError: an unknown chip or a malformed topology (`v5e:2x4`, `h100:8`, `cpu:8`).
    """
    chip, topology = _split(target)
    if chip == "cpu":
        n = _count(target, topology, "x")
        return TargetInfo(target, chip, "cpu", topology, n, "cpu", None, None, None, None, None, None, None, ())
    spec = _CHIPS[chip]
    if spec.platform == "tpu":
        n = _count(target, topology, "x") * spec.devices_per_chip
        share = spec.devices_per_chip
        return TargetInfo(target, chip, "tpu", topology, n, spec.device_kind, spec.hbm_bytes // share,
                          spec.peak_bf16_flops / share, spec.hbm_bandwidth / share, spec.link_bandwidth / share,
                          TPU_VMEM_BYTES[spec.device_kind], None, _VENVS["tpu"][2], spec.sources)
    n = _count(target, topology, "x")
    return TargetInfo(target, chip, "gpu", topology, n, spec.device_kind, spec.hbm_bytes, spec.peak_bf16_flops,
                      spec.hbm_bandwidth, spec.link_bandwidth, None, int(spec.gpu["shared_memory_per_block_optin"]),
                      _VENVS["gpu"][2], spec.sources)


@dataclasses.dataclass(frozen=True)
class Roofline:
    """A step's time on one chip by the roofline, in seconds per device, and its parts.

    compute = flops / peak bf16 FLOP/s; memory = HBM bytes / HBM bandwidth; collective = collective bytes / link
    bandwidth; seconds = max(compute, memory) + collective: compute overlaps HBM traffic fully, collectives overlap
    neither (an upper bound on their share; with full overlap the time would be the largest of the three).
    """

    compute: float
    memory: float
    collective: float

    @property
    def seconds(self) -> float:
        return max(self.compute, self.memory) + self.collective

    @property
    def bound(self) -> str:
        """"compute" or "memory": the larger of the two overlapped terms (ties: compute)."""
        return "compute" if self.compute >= self.memory else "memory"


def roofline(flops: float, hbm_bytes: float, collective_bytes: float, info: TargetInfo | str) -> Roofline:
    """The roofline time of a step costing `flops`, `hbm_bytes` and `collective_bytes` per device (e.g. the fields
    of `logra_jax.planner.hlo_cost.HloCost`) on `info`'s chip (a TargetInfo or a target name): see `Roofline`.

    Raises:
      ValueError: a CPU target (no published figures), or a negative cost.
    """
    info = target_info(info) if isinstance(info, str) else info
    if info.peak_bf16_flops is None or info.hbm_bandwidth is None or info.link_bandwidth is None:
        raise ValueError(f"roofline: target {info.target!r} has no published FLOP/s and bandwidths (a CPU target); "
                         f"use a chip: {', '.join(t for t in TARGETS if not t.startswith('cpu'))}")
    if min(flops, hbm_bytes, collective_bytes) < 0:
        raise ValueError(f"roofline: costs must be >= 0, got flops={flops}, hbm_bytes={hbm_bytes}, "
                         f"collective_bytes={collective_bytes}")
    return Roofline(flops / info.peak_bf16_flops, hbm_bytes / info.hbm_bandwidth,
                    collective_bytes / info.link_bandwidth)


def roofline_seconds(flops: float, hbm_bytes: float, collective_bytes: float, info: TargetInfo | str) -> float:
    """`roofline(...).seconds`: max(flops / peak, HBM bytes / bandwidth) + collective bytes / link bandwidth."""
    return roofline(flops, hbm_bytes, collective_bytes, info).seconds


def gpu_target_config(chip: str) -> str:
    """The `GpuTargetConfigProto` (text format) describing one `chip` ("h100", "h200", "a100") to XLA:GPU.

    Every number comes from `_CHIPS[chip]` (vendors' published specifications, cited there): compute capability,
    SMs, FP32 cores per SM, boost clock, shared memory per SM and per block (48 KiB default, the opt-in maximum),
    64 K registers per SM and per block, HBM size and bandwidth, L2; CUDA 13 runtime and cuDNN 9 as in jax[cuda13].
    """
    spec = _CHIPS.get(chip)
    if spec is None or spec.gpu is None:
        raise ValueError(f"gpu_target_config: chip must be one of {[c for c, s in _CHIPS.items() if s.gpu]}, "
                         f"got {chip!r}")
    g = spec.gpu
    return f"""gpu_device_info {{
  cuda_compute_capability {{ major: {g['major']} minor: {g['minor']} }}
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: {_SMEM_DEFAULT}
  shared_memory_per_block_optin: {g['shared_memory_per_block_optin']}
  shared_memory_per_core: {g['shared_memory_per_core']}
  threads_per_core_limit: 2048
  core_count: {g['core_count']}
  fpus_per_core: {g['fpus_per_core']}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(spec.hbm_bandwidth)}
  l2_cache_size: {g['l2_cache_size']}
  clock_rate_ghz: {g['clock_rate_ghz']}
  device_memory_size: {spec.hbm_bytes}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: {_CUDNN[0]} minor: {_CUDNN[1]} patch: {_CUDNN[2]} }}
runtime_version {{ major: {_CUDA_RUNTIME[0]} minor: {_CUDA_RUNTIME[1]} patch: {_CUDA_RUNTIME[2]} }}
device_description_str: "{spec.device_kind}"
"""


def compiler_available(target: str) -> bool:
    """Whether this Python has the compiler `target` needs (libtpu for TPUs, the CUDA 13 plugin for GPUs)."""
    platform = target_info(target).platform
    return platform == "cpu" or importlib.util.find_spec(_VENVS[platform][0]) is not None


def devices(target: str) -> list[jax.Device]:
    """Compile-only devices of `target` (`v5e:2x4`, `h100:8`, ...), or the first N CPU devices for `cpu:N`.

    TPU and GPU devices come from `jax.experimental.topologies.get_topology_desc`; they can be lowered and
    compiled for, never run on. For `cpu:N` start JAX with XLA_FLAGS=--xla_force_host_platform_device_count=N.

    Raises:
      ValueError: a malformed target, or fewer than N CPU devices.
      RuntimeError: the target's compiler is not installed in this Python, naming the make command for it.
    """
    info = target_info(target)
    if info.platform == "cpu":
        cpus = jax.devices("cpu")
        if len(cpus) < info.num_devices:
            raise ValueError(f"target {target!r} needs {info.num_devices} CPU devices, JAX has {len(cpus)}: set "
                             f"XLA_FLAGS=--xla_force_host_platform_device_count={info.num_devices} before JAX starts")
        return cpus[:info.num_devices]
    if info.platform == "tpu":  # each target names its own accelerator type, its devices cached or not
        os.environ["TPU_ACCELERATOR_TYPE"] = accelerator_type(target)
    return list(_compile_only_devices(target))


def accelerator_type(target: str) -> str:
    """The Cloud TPU accelerator type of a TPU target, e.g. "v5e:2x4" → "v5litepod-8", "v5p:2x2x1" → "v5p-8".

    Raises:
      ValueError: a malformed or non-TPU target.
    """
    info = target_info(target)
    if info.platform != "tpu":
        raise ValueError(f"accelerator_type: {target!r} is not a TPU target")
    return _ACCELERATOR_TYPE[info.chip].format(cores=info.num_devices * 2 // _CHIPS[info.chip].devices_per_chip,
                                               chips=info.num_devices // _CHIPS[info.chip].devices_per_chip)


# libtpu lays a topology out on hosts of 2x2x1 chips unless told otherwise, and refuses a smaller one ("v5e:1x1 is
# not divisible by the given (or default) chips_per_host_bounds 2x2x1").
_DEFAULT_CHIPS_PER_HOST = (2, 2, 1)


def _chips_per_host(topology: str) -> dict[str, tuple[int, ...]]:
    """libtpu's `chips_per_host_bounds` for a TPU topology that the default host (2x2x1) does not divide: per axis
    the largest divisor of both (a single chip, "1x1", is one host of 1x1x1); no argument for the others, which
    keep libtpu's default."""
    dims = [int(n) for n in topology.split("x")]
    dims += [1] * (len(_DEFAULT_CHIPS_PER_HOST) - len(dims))
    bounds = tuple(math.gcd(d, b) for d, b in zip(dims, _DEFAULT_CHIPS_PER_HOST, strict=True))
    return {} if bounds == _DEFAULT_CHIPS_PER_HOST else {"chips_per_host_bounds": bounds}


@functools.cache
def _compile_only_devices(target: str) -> tuple[jax.Device, ...]:
    """One set of device objects per target: traces cached for a mesh of them stay valid for the next mesh."""
    info = target_info(target)
    module, command, venv = _VENVS[info.platform]
    if not compiler_available(target):
        raise RuntimeError(f"target {target!r} needs the {info.platform.upper()} compiler ({module}), which this "
                           f"Python ({sys.prefix}) lacks: create it with `{command}` and run under {venv}/bin/python "
                           "with JAX_PLATFORMS=cpu")
    from jax.experimental import topologies

    if info.platform == "tpu":
        # Without these (and TPU_ACCELERATOR_TYPE, set by `devices`) libtpu probes for the TPU VM's metadata and
        # workers (and logs an error); nothing runs here.
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only processes share no chip
        found = topologies.get_topology_desc(topology_name=target, platform="tpu",
                                             **_chips_per_host(info.topology)).devices
    else:
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver or GPU to check here
        found = topologies.get_topology_desc(info.chip, platform="cuda", target_config=gpu_target_config(info.chip),
                                             topology=f"1x1x{info.num_devices}").devices
    if len(found) != info.num_devices or found[0].device_kind != info.device_kind:
        raise RuntimeError(f"target {target!r}: the compiler gave {len(found)} × {found[0].device_kind!r}, expected "
                           f"{info.num_devices} × {info.device_kind!r}")
    return tuple(found)


def mesh(target: str, config: shd.MeshConfig | None = None) -> jax.sharding.Mesh:
    """The (data, fsdp, tensor) mesh of `config` (default: FSDP over all) over `devices(target)`: `sharding.make_mesh`,
    the job's own mesh builder (`phases.job_mesh`), so that what is compiled here is laid out as the job lays it.
    """
    return shd.make_mesh(config or shd.MeshConfig(), devices(target))

