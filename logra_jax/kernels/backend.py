"""What every Pallas kernel of logra_jax shares: the implementation switch, block sizes, edge masks, compiler params.

`implementation="pallas"` selects, by the platform the function is compiled for (`pallas_target`; the devices
given to `compiling_for`, which `sharding.jit_train_step` enters for its mesh, else JAX's default backend):
- TPU: the portable kernels of merge.py, row_moment.py and project.py (`pl.pallas_call` with a grid and
  BlockSpecs, jnp ops inside), compiled by Mosaic TPU with the dimension semantics given here (reductions on the
  last, "arbitrary" grid axes; an output block that is revisited stays resident in VMEM and is written back once).
- GPU (CUDA): the kernels of gpu.py, lowered through Triton and written for GPU grids (K loops inside programs,
  a split reduction for S = HᵀP, power-of-2 masked tiles); Mosaic GPU, the default GPU lowering of `pallas_call`,
  has no rule for the TPU kernels' `dot_general` and minor-axis reductions.
- interpret=True: the TPU kernels in the Pallas interpreter, anywhere (the GPU kernels run interpreted through
  gpu.py's own functions); CPU has no compiled Pallas.
Both sets lower on this CPU machine (cross-lowering tests for "tpu" and "cuda"); `default_implementation()`
answers "pallas" only on platforms listed in `_VERIFIED_PALLAS_PLATFORMS`, where a run on the chip showed the
kernels equal to their references and no slower than XLA (experiments/device/check.sh for GPUs).

Inside a sharded step every kernel runs per device (`per_device`) on a split of its arrays; where the split does not
divide, it runs on the whole, gathered arrays and says so once (`warn_once`). A kernel asked for by
implementation="pallas" is never swapped for its XLA twin behind the caller's back: what it cannot run raises.

Array sizes need not be multiples of the blocks: an edge block is partial. Rows or columns past the end of an
array hold garbage (NaN in interpret mode), which is harmless where it only reaches output positions that are
dropped on the write-back, and is zeroed with `zero_outside` where it would enter a reduction (TPU kernels); the
GPU kernels mask every load and store instead.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import warnings
from collections.abc import Iterator
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

Implementation = Literal["xla", "pallas"]
IMPLEMENTATIONS: tuple[str, ...] = ("xla", "pallas")
PALLAS_TARGETS: tuple[str, ...] = ("tpu", "gpu")  # the kernel sets implementation="pallas" can select

# Mosaic TPU's default scoped-VMEM limit is 16-32 MiB depending on the chip (16 MiB on v5e); kernels whose resident
# blocks need more ask for it explicitly, up to what the chip has (`TPU_VMEM_BYTES`).
_DEFAULT_VMEM_BYTES = 16 << 20

# VMEM per TPU device (bytes) by `jax.Device.device_kind`, as the TPU compiler (libtpu 0.0.42.1) allocates it:
# measured by compiling a kernel whose scratch is too large, which it refuses with "would exceed memory
# (size=N)" (experiments/kernels/aot/README.md). v4's compile-only devices are single TensorCores.
TPU_VMEM_BYTES: dict[str, int] = {"TPU v4": 16 << 20, "TPU v5 lite": 128 << 20, "TPU v5": 64 << 20,
                                  "TPU v6 lite": 128 << 20}


@dataclasses.dataclass(frozen=True)
class KernelTarget:
    """What a kernel is compiled for: the platform ("tpu", "gpu", "cpu", ...) and the device kind.

    Hashable, so jitted kernel wrappers take it as a static argument: a trace made for one chip is never reused
    for another (the jit cache does not see context variables).
    """

    platform: str
    device_kind: str = ""

    @property
    def vmem_bytes(self) -> int | None:
        """VMEM a TPU kernel may use on this chip (`TPU_VMEM_BYTES`); None for a chip not listed there."""
        return TPU_VMEM_BYTES.get(self.device_kind)


def _platform_of(device: Any) -> str:
    platform = str(device.platform).lower()
    return "gpu" if platform in ("cuda", "rocm") else platform


def target_of(devices: Any) -> KernelTarget:
    """The KernelTarget of a device, a sequence or array of devices, or a Mesh (its first device)."""
    if isinstance(devices, KernelTarget):
        return devices
    if isinstance(devices, jax.sharding.Mesh):
        devices = devices.devices
    first = np.asarray(devices, dtype=object).reshape(-1)[0] if not hasattr(devices, "platform") else devices
    return KernelTarget(_platform_of(first), str(getattr(first, "device_kind", "")))


_COMPILING_FOR: contextvars.ContextVar[KernelTarget | None] = contextvars.ContextVar("compiling_for", default=None)
_MESH: contextvars.ContextVar[jax.sharding.Mesh | None] = contextvars.ContextVar("kernel_mesh", default=None)


@contextlib.contextmanager
def compiling_for(devices: Any) -> Iterator[KernelTarget]:
    """Kernels traced inside the block are chosen for `devices` (device(s), a Mesh or a KernelTarget).

    Enter it around tracing/lowering (`jax.jit(f).lower(...)`), or inside the function being jitted;
    `logra_jax.parallel.sharding.jit_train_step` enters it for its mesh, so a step lowered for compile-only TPU or GPU
    devices (logra_jax.planner.aot) gets those platforms' kernels on a CPU host. jit's cache keys on the arguments and
    their shardings, not on this context: lower for a target with arguments placed on its devices (as
    `jit_train_step` and logra_jax.planner.aot do), or use a fresh function. For a GPU it also names the device kind to
    the Triton lowering (`_naming_gpu`).
    """
    target = target_of(devices)
    token = _COMPILING_FOR.set(target)
    mesh_token = _MESH.set(devices if isinstance(devices, jax.sharding.Mesh) else None)
    try:
        with _naming_gpu(target):
            yield target
    finally:
        _MESH.reset(mesh_token)
        _COMPILING_FOR.reset(token)


def _naming_gpu(target: KernelTarget) -> contextlib.AbstractContextManager[Any]:
    """For a GPU target, an empty abstract mesh that names its device kind: from jax 0.11 on, a process without
    that GPU (a CPU host lowering for compile-only devices) lowers Triton kernels only for an abstract device it
    is given (jax 0.10.x assumed compute capability 9.0); axes none, so no sharding changes."""
    if target.platform != "gpu" or not target.device_kind:
        return contextlib.nullcontext()
    device = jax.sharding.AbstractDevice(device_kind=target.device_kind, num_cores=None, platform="gpu")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device))


def current_mesh() -> jax.sharding.Mesh | None:
    """The mesh of the innermost `compiling_for(mesh)`; None outside one or when it was given bare devices."""
    return _MESH.get()


_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    """`message` as a RuntimeWarning the first time this process gives it (a kernel is traced again for every step
    function and shape; the warning is not)."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def per_device(fn: Any, mesh: jax.sharding.Mesh | None, in_specs: tuple, out_specs: Any) -> Any:
    """`fn` run on each device's block of `mesh` (`jax.shard_map`), or `fn` itself without a mesh of > 1 device.

    GSPMD cannot partition a Mosaic (TPU) kernel ("Mosaic kernels cannot be automatically partitioned"), and
    would replicate a Triton one: inside a sharded step every Pallas call runs per device. Specs name the axes
    with `split` (all mesh axes on one dimension) or `PartitionSpec()` (replicated: the block is gathered).
    """
    if mesh is None or mesh.size == 1:
        return fn
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def split(mesh: jax.sharding.Mesh | None, ndim: int, axis: int) -> jax.sharding.PartitionSpec:
    """A PartitionSpec splitting dimension `axis` of an `ndim`-d array over all of `mesh`'s axes."""
    spec: list[Any] = [None] * ndim
    spec[axis] = None if mesh is None else tuple(mesh.axis_names)
    return jax.sharding.PartitionSpec(*spec)


def current_target() -> KernelTarget:
    """The target of the innermost `compiling_for`, else JAX's default backend (and its first device's kind)."""
    target = _COMPILING_FOR.get()
    if target is not None:
        return target
    platform = jax.default_backend()
    device = jax.devices()[0]
    kind = str(device.device_kind) if _platform_of(device) == platform else ""
    return KernelTarget(platform, kind)


def check_implementation(implementation: str, where: str) -> str:
    """Returns `implementation` if it is 'xla' or 'pallas'; raises ValueError naming `where` otherwise."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{where}: implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    return implementation


def check_interpret(interpret: Any, where: str) -> bool:
    """`interpret` as a bool if it is a Python or numpy bool; raises TypeError naming `where` otherwise."""
    if not isinstance(interpret, (bool, np.bool_)):
        raise TypeError(f"{where}: interpret must be a bool, got {interpret!r}")
    return bool(interpret)


def check_kernel_settings(implementation: str, interpret: Any, where: str) -> tuple[str, bool]:
    """(implementation, interpret) after `check_implementation` and `check_interpret`, both naming `where`."""
    return check_implementation(implementation, where), check_interpret(interpret, where)


# Platforms where the Pallas kernels have been compiled and checked against their references on the chip. Add one
# only after such a run (a cross-lowering proves that the kernels lower, not that they are right or fast).
_VERIFIED_PALLAS_PLATFORMS: frozenset[str] = frozenset()


def default_implementation(platform: str | None = None) -> Implementation:
    """The implementation to use on `platform` (default: the platform compiled for, `current_target`).

    "pallas" only on platforms where the kernels have been verified on the hardware; none yet (they lower for
    TPU but have not run on one), so this is "xla" everywhere and Pallas is opt-in with `implementation="pallas"`.

    Example:
      >>> default_implementation("cpu"), default_implementation("tpu")
      ('xla', 'xla')
    """
    platform = current_target().platform if platform is None else platform
    return "pallas" if platform in _VERIFIED_PALLAS_PLATFORMS else "xla"


def check_block(name: str, value: Any, where: str) -> int:
    """Returns the block size `value` as an int; raises ValueError unless it is a positive integer."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{where}: {name} must be a positive integer, got {value!r}")
    return value


def fit_block(size: int, block: int) -> int:
    """The block actually used along an axis of `size`: the whole axis when it fits in one block.

    A block equal to the full axis is always a legal TPU block shape, whatever its alignment.
    """
    return size if size <= block else block


def num_blocks(size: int, block: int) -> int:
    """Grid extent covering `size` with blocks of `block` (the last block may be partial)."""
    return math.ceil(size / block)


def zero_outside(x: jax.Array, axis: int, block_index: jax.Array, block: int, size: int) -> jax.Array:
    """Zeroes the entries of block `x` that lie past `size` along `axis` (the edge of a reduction).

    `block_index` is the block's position along that axis (a `pl.program_id` read at the top of the kernel: the
    interpreter does not evaluate program ids inside `pl.when` bodies). Nothing is emitted when `size` is a
    multiple of `block`: only the last block of an axis can be partial. `where` rather than a multiply, so NaN
    garbage in the padding cannot leak through 0·NaN.
    """
    if size % block == 0:
        return x
    index = block_index * block + jax.lax.broadcasted_iota(jnp.int32, x.shape, axis)
    return jnp.where(index < size, x, jnp.zeros_like(x))


def pallas_target(where: str, interpret: bool, platform: str | None = None) -> str:
    """Which Pallas kernels `where` runs: "tpu" (also for interpret=True, anywhere) or "gpu" (compiled on CUDA).

    `platform` defaults to the platform being compiled for (`current_target`), not the host's.

    Raises:
      ValueError: compiled (interpret=False) on CPU, where Pallas only interprets.
      NotImplementedError: compiled on another platform (e.g. ROCm), naming the kernel and the platform.
    """
    if interpret:
        return "tpu"
    platform = current_target().platform if platform is None else platform
    if platform in ("tpu", "gpu"):
        return platform
    if platform == "cpu":
        raise ValueError(f"{where}: implementation='pallas' runs on CPU only with interpret=True")
    raise NotImplementedError(
        f"{where}: no Pallas kernel for platform {platform!r} (there are kernels for TPU and NVIDIA GPUs); use "
        "implementation='xla' (or interpret=True to check).")


def round_factor(factor: jax.Array, round_bf16: bool) -> jax.Array:
    """The update factor U as float32, first rounded to bfloat16 (the wire format) when `round_bf16`."""
    factor = factor.astype(jnp.bfloat16) if round_bf16 else factor
    return factor.astype(jnp.float32)


def block_or(value: Any, default: int) -> Any:
    """A block-size argument, `default` when the caller left it None."""
    return default if value is None else value


def cost_estimate(flops: int, *arrays: Any) -> pl.CostEstimate:
    """A kernel's declared cost: its matmul flops and the bytes of its inputs and outputs (`arrays`: arrays or
    ShapeDtypeStructs). The TPU compiler keeps it on the kernel's custom call, where XLA's cost analysis and
    `logra_jax.planner.hlo_cost` read it (a Pallas call is otherwise opaque to both).

    Example:
      >>> c = cost_estimate(2 * 4 * 8 * 16, jax.ShapeDtypeStruct((4, 8), jnp.float32))
      >>> c.flops, c.bytes_accessed
      (1024, 128)
    """
    nbytes = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in arrays)
    return pl.CostEstimate(flops=int(flops), transcendentals=0, bytes_accessed=int(nbytes))


def compiler_params(dimension_semantics: tuple[str, ...], vmem_bytes: int | None = None,
                    target: KernelTarget | None = None) -> Any:
    """Mosaic TPU compiler params for a kernel whose grid axes are 'parallel' or 'arbitrary' (sequential).

    Args:
      dimension_semantics: one entry per grid axis; 'arbitrary' marks axes along which an output block is
        revisited (reductions), which must run in order on one core.
      vmem_bytes: estimated VMEM footprint of the blocks; above the 16 MiB every chip allows by default, a
        limit with 25% + 4 MiB headroom is requested, capped at the chip's VMEM where it is known
        (`KernelTarget.vmem_bytes`).
      target: the chip compiled for (default `current_target()`).

    Returns:
      `pltpu.CompilerParams` when compiling for a TPU, else None (the interpreter needs none).
    """
    target = current_target() if target is None else target
    if target.platform != "tpu":
        return None
    limit = None
    if vmem_bytes is not None and vmem_bytes > _DEFAULT_VMEM_BYTES:
        limit = int(vmem_bytes * 1.25) + (4 << 20)
        limit = limit if target.vmem_bytes is None else min(limit, target.vmem_bytes)
    return pltpu.CompilerParams(dimension_semantics=dimension_semantics, vmem_limit_bytes=limit)
