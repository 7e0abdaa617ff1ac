"""Mesh, logical-axis rules and the shardings of everything a train step touches.

A (data, fsdp, tensor) mesh with Auto axis types (GSPMD propagation). Parameters carry logical axis names in
their `axes` metadata; a rules table maps them to mesh axes (`logical_to_spec`). All other shardings are derived
by pure functions: `param_shardings` (metadata; sketch probes follow their kernel's rows), `opt_state_shardings`
(each state leaf follows the parameter its path ends with: by the LoGRA target's declared dims when the caller
passes the targets, `logra_jax.optim.spec.state_targets`, else by size; one `derived_specs.follow_spec` under
both), `batch_shardings`.
Activations are constrained with `constrain(x, logical_axes)` while `use_rules` is active, which
`jit_train_step` arranges while it jits with in/out shardings and donation. `init_sharded` creates state in its
shardings (eval_shape → shardings → jit(out_shardings)).

Typical use, with init_fn() -> (TrainState, rest) and a step from logra_jax.job.train_step (run end to end by
tests/sharding/test_sharded_step.py, and across processes by logra_jax.job.train in
tests/sharding/test_multihost_main.py):
  mesh = make_mesh(MeshConfig(data=2, fsdp=4))
  (state, rest), (state_sh, rest_sh) = init_sharded(init_fn, lambda s: step_shardings(*s, mesh))
                          # logra_jax.job.train_step.step_shardings: train_state_shardings + param_shardings, with
                          # the optimizer's LoGRA targets (logra_jax.optim.state_targets) as declared layouts
  step = jit_train_step(step_fn, mesh, in_shardings=(state_sh, rest_sh, batch_shardings(batch, mesh)),
                        out_shardings=(state_sh, replicated(mesh)))
  state, metrics = step(state, rest, jax.device_put(batch, batch_shardings(batch, mesh)))
Compile-only: `logra_jax.planner.memory_analysis.step_memory(step_fn, init_fn, abstract_batch, mesh)` lowers the same
sharded step from abstract inputs and returns XLA's per-device bytes.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from jaxlib import version as jaxlib_version

from logra_jax.core.tree_paths import path_keys
from logra_jax.kernels.backend import compiling_for
from logra_jax.parallel.derived_specs import MeshAxes, as_tuple, derive_spec, entry

T = TypeVar("T")
LogicalRules = Sequence[tuple[str, MeshAxes]]

MESH_AXES = ("data", "fsdp", "tensor")

# The logical axis of an expert dimension under expert parallelism (`logra_jax.models.expert_parallel`); the
# default "expert" has no rule (every expert's width is split over fsdp like any block weight).
EXPERT_SHARD = "expert_shard"
# Earlier rules have priority (`logical_to_spec`). fsdp splits the model width of every block weight; tensor
# splits heads / mlp / vocab (Megatron-style); the vocabulary takes fsdp as well, so the [V, D] embedding and the
# [D, V] head are split over V only and logits are computed vocab-parallel instead of gathering the head. An
# expert-parallel kernel [E, D, F] gives fsdp to its experts first (whole experts per device, F over tensor).
PARAM_RULES: tuple[tuple[str, MeshAxes], ...] = (
    ("layers", None), (EXPERT_SHARD, "fsdp"), ("vocab", ("tensor", "fsdp")), ("embed", "fsdp"), ("q_heads", "tensor"),
    ("kv_heads", "tensor"), ("mlp", "tensor"), ("norm", None))
# The batch is split over every data-parallel axis; heads and mlp activations follow their weights.
ACTIVATION_RULES: tuple[tuple[str, MeshAxes], ...] = (
    ("batch", ("data", "fsdp")), ("length", None), ("act_embed", None), ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"), ("act_mlp", "tensor"), ("act_vocab", "tensor"))
DEFAULT_RULES = PARAM_RULES + ACTIVATION_RULES

_ACTIVE: contextvars.ContextVar[tuple[Mesh, LogicalRules] | None] = contextvars.ContextVar(
    "logra_jax_logical_rules", default=None)


@dataclasses.dataclass(frozen=True, slots=True)
class MeshConfig:
    """Sizes of the (data, fsdp, tensor) mesh axes; one of them may be -1 (all remaining devices).

    Example:
      >>> MeshConfig(data=2, fsdp=-1).axis_sizes(8)
      (2, 4, 1)
    """

    data: int = 1
    fsdp: int = -1
    tensor: int = 1

    def __post_init__(self) -> None:
        sizes = {name: getattr(self, name) for name in MESH_AXES}
        for name, size in sizes.items():
            if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
                raise ValueError(f"MeshConfig.{name} must be a positive integer or -1, got {size!r}")
        if sum(size == -1 for size in sizes.values()) > 1:
            raise ValueError(f"MeshConfig: at most one axis may be -1, got {sizes}")

    def axis_sizes(self, num_devices: int) -> tuple[int, int, int]:
        """(data, fsdp, tensor) for `num_devices` devices, the -1 axis filled in.

        Raises:
          ValueError: the sizes do not multiply to `num_devices`.
        """
        sizes = [getattr(self, name) for name in MESH_AXES]
        fixed = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % fixed:
                raise ValueError(f"MeshConfig {self}: {num_devices} devices are not divisible by {fixed}")
            sizes[sizes.index(-1)] = num_devices // fixed
        if math.prod(sizes) != num_devices:
            raise ValueError(f"MeshConfig {self} needs {math.prod(sizes)} devices, got {num_devices}")
        return tuple(sizes)


def make_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The (data, fsdp, tensor) mesh over `devices` (default: all global devices) with Auto axis types.

    Devices are ordered by the physical topology (`jax.make_mesh`), except devices that are single TensorCores of
    a multi-core chip (TPU v4's compile-only devices, `logra_jax.planner.aot`), which are laid out in the order given.

    Auto (not Explicit, `jax.make_mesh`'s default in this JAX) keeps GSPMD's sharding propagation: shardings of
    intermediates are inferred from inputs, outputs and `constrain` calls. In a multi-process run
    (logra_jax.parallel.multihost) the default devices span every process.

    Args:
      config: the axis sizes.
      devices: the devices to lay out (default `jax.devices()`).

    Returns:
      A jax.sharding.Mesh with axes ("data", "fsdp", "tensor").

    Raises:
      ValueError: the config's sizes do not fit the number of devices.

    Example:
      >>> mesh = make_mesh(MeshConfig(fsdp=-1), jax.devices()[:1])
      >>> dict(mesh.shape)
      {'data': 1, 'fsdp': 1, 'tensor': 1}
    """
    devices = jax.devices() if devices is None else list(devices)
    sizes = config.axis_sizes(len(devices))
    if any(getattr(d, "core_on_chip", 0) for d in devices):
        # one device per TensorCore (TPU v4's compile-only topology): JAX's topology-aware ordering wants one
        # device per chip, so they are laid out in the order given
        return Mesh(np.asarray(devices, dtype=object).reshape(sizes), MESH_AXES,
                    axis_types=(AxisType.Auto,) * len(MESH_AXES))
    return jax.make_mesh(sizes, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def logical_to_spec(axes: Sequence[str | None], rules: LogicalRules, *, shape: Sequence[int] | None = None,
                    mesh: Mesh | None = None) -> PartitionSpec:
    """PartitionSpec for logical `axes` under `rules`.

    Rules are applied in table order, so earlier rules have priority: a mesh axis shards at most one dimension,
    the one whose rule comes first (with ('vocab', ('tensor', 'fsdp')) listed before ('embed', 'fsdp'), a [V, D]
    embedding is split over the vocabulary only). A logical name's first rule is its only rule. With `shape` and
    `mesh`, a mesh axis is kept on a dimension only while the product of the kept axes divides the dimension
    (e.g. 9 heads stay replicated on a tensor axis of 2).

    Args:
      axes: one logical name (or None) per dimension.
      rules: (logical name, mesh axis | tuple of mesh axes | None) pairs.
      shape, mesh: the array's shape and the mesh, to drop mesh axes that do not divide a dimension.

    Returns:
      The PartitionSpec.

    Raises:
      ValueError: only one of shape / mesh given, or len(shape) != len(axes).

    Example:
      >>> logical_to_spec(("layers", "embed", "q_heads"), DEFAULT_RULES)
      P(None, 'fsdp', 'tensor')
    """
    if (shape is None) != (mesh is None):
        raise ValueError("logical_to_spec: pass both shape and mesh, or neither")
    if shape is not None and len(shape) != len(axes):
        raise ValueError(f"logical_to_spec: axes {tuple(axes)} do not match shape {tuple(shape)}")
    groups: list[list[str]] = [[] for _ in axes]
    used: set[str] = set()
    seen: set[str] = set()
    for name, mesh_axes in rules:
        if name in seen:
            continue
        seen.add(name)
        for dim in (d for d, a in enumerate(axes) if a == name):
            product = 1
            for a in as_tuple(mesh_axes):
                if a in used or (shape is not None and shape[dim] % (product * mesh.shape[a])):
                    continue
                groups[dim].append(a)
                used.add(a)
                if shape is not None:
                    product *= mesh.shape[a]
    spec = [entry(g) for g in groups]
    return PartitionSpec(*spec)


@contextlib.contextmanager
def use_rules(mesh: Mesh, rules: LogicalRules = DEFAULT_RULES) -> Iterator[None]:
    """Activate `rules` on `mesh` for `constrain` calls traced inside the block.

    Enter it inside the function being jitted (the jit cache does not see context variables); `jit_train_step`
    does this for you.
    """
    token = _ACTIVE.set((mesh, tuple(rules)))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_rules() -> tuple[Mesh, LogicalRules] | None:
    """The (mesh, rules) that `use_rules` activated for the code being traced, or None outside any `use_rules`."""
    return _ACTIVE.get()


def batch_shards() -> int:
    """How many ways the active rules split the 'batch' axis (data × fsdp devices under `use_rules`; 1 without).

    Example:
      >>> mesh = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
      >>> with use_rules(mesh):
      ...     batch_shards()
      1
    """
    active = _ACTIVE.get()
    if active is None:
        return 1
    mesh, rules = active
    return math.prod(mesh.shape[a] for a in as_tuple(logical_to_spec(("batch",), rules)[0]))


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Sharding constraint on an activation by logical axis names; identity when no rules are active.

    Args:
      x: the activation.
      axes: one logical name (or None) per dimension of x, e.g. ("batch", "length", "act_embed").

    Returns:
      x, constrained to `logical_to_spec(axes, rules, shape=x.shape, mesh=mesh)` under `use_rules(mesh, rules)`.

    Example:
      >>> mesh = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
      >>> def f(x):
      ...     with use_rules(mesh):
      ...         return constrain(x, ("batch", "act_embed")) * 2
      >>> jax.jit(f)(jax.numpy.ones((2, 3))).shape
      (2, 3)
    """
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    spec = logical_to_spec(axes, rules, shape=x.shape, mesh=mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def param_shardings(abstract_state: T, mesh: Mesh, rules: LogicalRules = DEFAULT_RULES, *,
                    derived: Mapping[str, str] | None = None, sources: Any = None,
                    targets: Mapping[str, DeclaredLayout] | None = None) -> T:
    """NamedShardings for an nnx.State (or any tree of nnx.Variables) from each Variable's `axes` metadata.

    Args:
      abstract_state: the state (arrays or ShapeDtypeStructs inside nnx.Variables); leaves outside Variables,
        or whose `axes` do not match their rank, are replicated.
      mesh: the device mesh.
      rules: logical → mesh axes.
      derived: {variable name: sibling name}: such variables follow their sibling's sharding instead of their
        own metadata (`state_leaf_spec`). Default {"sketch_probe": "kernel"}: a LoGRA probe [L, d, r] is split
        like its kernel's rows and as finely as the kernel.
      sources: another tree of Variables where siblings are looked up too (the params, when `abstract_state`
        is the non-Param `rest` holding the probes).
      targets: {canonical parameter path: declared layout} (`logra_jax.optim.spec.state_targets`): a sibling
        that is a target lays its derived variables out by its declared dims.

    Returns:
      The same tree with NamedShardings in place of the arrays (usable as jit in/out shardings).

    Example:
      >>> mesh = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
      >>> state = {"kernel": nnx.Param(jax.numpy.zeros((4, 6)), axes=("embed", "mlp"))}
      >>> param_shardings(state, mesh)["kernel"].get_value().spec
      P('fsdp', 'tensor')
    """
    derived = {"sketch_probe": "kernel"} if derived is None else dict(derived)
    is_var = lambda x: isinstance(x, nnx.Variable)

    def own_spec(var: Any) -> PartitionSpec:
        axes = var.get_metadata().get("axes") if is_var(var) else None
        shape = var.shape if is_var(var) else getattr(var, "shape", ())
        if axes is None or len(axes) != len(shape):
            return PartitionSpec()
        return logical_to_spec(axes, rules, shape=shape, mesh=mesh)

    by_path = {path_keys(p): v for tree in (sources, abstract_state) if tree is not None
               for p, v in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_var)[0]}

    def sharding(keypath: Any, var: Any) -> Any:
        path = path_keys(keypath)
        spec = own_spec(var)
        sibling = (*path[:-1], derived.get(path[-1], "")) if path else ()
        if path and path[-1] in derived and sibling in by_path:
            source = by_path[sibling]
            spec = state_leaf_spec(var.shape, ".".join(sibling), source.shape, own_spec(source), mesh, targets)
        out = NamedSharding(mesh, spec)
        return var.replace(value=out) if is_var(var) else out

    return jax.tree_util.tree_map_with_path(sharding, abstract_state, is_leaf=is_var)


class DeclaredLayout(Protocol):
    """A parameter that declares how its derived state is laid out (`logra_jax.optim.targets.Target`)."""

    def state_spec(self, shape: Sequence[int], weight_spec: PartitionSpec, mesh: Mesh) -> PartitionSpec | None:
        """The PartitionSpec of derived state of `shape`, or None when the layout is not one it declares."""


def state_leaf_spec(shape: Sequence[int], path: str, source_shape: Sequence[int], source_spec: PartitionSpec,
                    mesh: Mesh, targets: Mapping[str, DeclaredLayout] | None = None) -> PartitionSpec:
    """PartitionSpec of an array derived from the parameter at `path` (its optimizer state, its sketch probe).

    The parameter's declared layout (`targets[path].state_spec`) when it has one for `shape`; otherwise the
    layout inferred by size (`logra_jax.parallel.derived_specs.derive_spec`: the parameter's own shape takes its spec,
    a reduced shape such as adafactor's factored moments follows the equal-sized dims). Both end in the same
    `follow_spec`.
    """
    layout = (targets or {}).get(path)
    spec = None if layout is None else layout.state_spec(shape, source_spec, mesh)
    return derive_spec(shape, source_shape, source_spec, mesh) if spec is None else spec


def opt_state_shardings(abstract_opt_state: T, params_shardings: Any, abstract_params: Any,
                        targets: Mapping[str, DeclaredLayout] | None = None) -> T:
    """NamedShardings for an optimizer state, derived from the parameters' shardings.

    A state leaf whose path ends with a parameter's path (optax moments: `mu.blocks.attn.q_proj.kernel`; state
    keyed by canonical path strings works too) follows that parameter (`state_leaf_spec`: by the target's declared
    dims when `targets` has it, by size otherwise); every other leaf (step counts, scalars) is replicated.

    Args:
      abstract_opt_state: the state from `jax.eval_shape(tx.init, params)` (or a real state).
      params_shardings: the parameters' NamedShardings (`param_shardings`).
      abstract_params: the parameters (for their shapes), same structure as `params_shardings`.
      targets: {canonical parameter path: declared layout}, e.g. the LoGRA targets of the optimizer
        (`logra_jax.optim.spec.state_targets(abstract_opt_state, abstract_params)`); None: infer every layout.

    Returns:
      The optimizer state's tree with NamedShardings as leaves.

    Raises:
      ValueError: `params_shardings` and `abstract_params` differ in their number of leaves, or are empty.

    Example:
      >>> import optax
      >>> mesh = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
      >>> params = {"kernel": nnx.Param(jax.numpy.zeros((4, 6)), axes=("embed", "mlp"))}
      >>> shardings = opt_state_shardings(optax.adam(1e-3).init(params), param_shardings(params, mesh), params)
      >>> shardings[0].mu["kernel"].get_value().spec, shardings[0].count.spec
      (P('fsdp', 'tensor'), P())
    """
    sh_leaves = jax.tree_util.tree_flatten_with_path(params_shardings)[0]
    shapes = jax.tree.leaves(abstract_params)
    if not sh_leaves or len(sh_leaves) != len(shapes):
        raise ValueError(f"opt_state_shardings: params_shardings has {len(sh_leaves)} leaves, abstract_params "
                         f"{len(shapes)}")
    index = {".".join(path_keys(p)): (tuple(x.shape), s) for (p, s), x in zip(sh_leaves, shapes)}
    mesh = sh_leaves[0][1].mesh

    def sharding(keypath: Any, leaf: Any) -> NamedSharding:
        path = path_keys(keypath)
        for start in range(len(path)):
            name = ".".join(path[start:])
            hit = index.get(name)
            if hit is not None and getattr(leaf, "ndim", 0) > 0:
                return NamedSharding(mesh, state_leaf_spec(leaf.shape, name, hit[0], hit[1].spec, mesh, targets))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree_util.tree_map_with_path(sharding, abstract_opt_state)


def train_state_shardings(abstract_state: T, mesh: Mesh, rules: LogicalRules = DEFAULT_RULES,
                          targets: Mapping[str, DeclaredLayout] | None = None) -> T:
    """Shardings of a TrainState-like NamedTuple (params, opt_state, step).

    params: `param_shardings` (metadata); opt_state: `opt_state_shardings` (derived from the params, by the
    declared layouts of `targets` where given); step: replicated.

    Raises:
      TypeError: `abstract_state` is not a NamedTuple with fields params, opt_state and step.
    """
    if not all(hasattr(abstract_state, f) for f in ("params", "opt_state", "step", "_replace")):
        raise TypeError(f"train_state_shardings: need a NamedTuple with params, opt_state and step, got "
                        f"{type(abstract_state).__name__}")
    params = param_shardings(abstract_state.params, mesh, rules)
    return abstract_state._replace(
        params=params,
        opt_state=opt_state_shardings(abstract_state.opt_state, params, abstract_state.params, targets),
        step=NamedSharding(mesh, PartitionSpec()))


def batch_shardings(abstract_batch: T, mesh: Mesh, rules: LogicalRules = DEFAULT_RULES) -> T:
    """Leading axis of every batch leaf over the 'batch' rule's mesh axes (data, fsdp); the rest replicated.

    Example:
      >>> mesh = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
      >>> batch_shardings({"tokens": jax.ShapeDtypeStruct((8, 16), jax.numpy.int32)}, mesh)["tokens"].spec
      P(('data', 'fsdp'), None)
    """
    def sharding(x: Any) -> NamedSharding:
        axes = ("batch",) + (None,) * (len(x.shape) - 1)
        return NamedSharding(mesh, logical_to_spec(axes, rules, shape=x.shape, mesh=mesh))
    return jax.tree.map(sharding, abstract_batch)


def replicated(mesh: Mesh) -> NamedSharding:
    """The fully replicated sharding on `mesh` (scalars, metrics)."""
    return NamedSharding(mesh, PartitionSpec())


def process_rows(sharding: jax.sharding.Sharding, shape: Sequence[int]) -> tuple[int, int]:
    """The rows [start, stop) of the leading axis that this process's devices hold of an array of `shape`
    under `sharding` (all rows in a single-process run).

    Raises:
      ValueError: the process holds no rows, or rows that are not one contiguous block (a mesh whose device
        order interleaves processes along the batch axes).
    """
    spans = set()
    for index in sharding.addressable_devices_indices_map(tuple(shape)).values():
        first = index[0] if index else slice(None)
        spans.add((first.start or 0, shape[0] if first.stop is None else first.stop))
    spans = sorted(spans)
    if not spans or any(a[1] != b[0] for a, b in itertools.pairwise(spans)):
        raise ValueError(f"process {jax.process_index()} holds rows {spans} of a {tuple(shape)} array sharded "
                         f"{sharding}; rows must form one contiguous block per process (order the mesh's "
                         "devices by process)")
    return spans[0][0], spans[-1][1]


def global_rows(local: Any, sharding: jax.sharding.Sharding, global_shape: Sequence[int]) -> jax.Array:
    """The global array whose rows `process_rows(sharding, global_shape)` are this process's `local` rows
    (`jax.make_array_from_process_local_data`: nothing is sent between processes)."""
    return jax.make_array_from_process_local_data(sharding, local, tuple(global_shape))


def local_rows(x: jax.Array) -> Any:
    """A host (numpy) copy of the rows of global array `x` that this process holds (all of them in a
    single-process run); nothing is gathered from other processes."""
    import numpy as np
    if x.is_fully_addressable:
        return np.asarray(x)
    start, stop = process_rows(x.sharding, x.shape)
    out = None
    for shard in x.addressable_shards:
        rows = shard.index[0] if shard.index else slice(None)
        lo, hi = rows.start or 0, x.shape[0] if rows.stop is None else rows.stop
        if out is None:
            out = np.empty((stop - start, *x.shape[1:]), x.dtype)
        out[(slice(lo - start, hi - start), *shard.index[1:])] = np.asarray(shard.data)
    return out


def to_global(tree: T, shardings: Any) -> T:
    """Place a tree held whole by every process (the same values everywhere, e.g. a model every process
    initialised from the same seed) into `shardings`; each process keeps only its own shards."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)
    if isinstance(shardings, jax.sharding.Sharding):  # one sharding for every leaf
        shardings = jax.tree.map(lambda _: shardings, tree)
    host = jax.device_get(tree)
    return jax.tree.map(lambda h, s: jax.make_array_from_callback(h.shape, s, lambda index: h[index]),
                        host, shardings)


def abstract_sharded(abstract: T, shardings: Any) -> T:
    """ShapeDtypeStructs carrying `shardings`: compile-only inputs (`jit(...).lower(...)`), nothing allocated."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)


def init_sharded(init_fn: Callable[[], T], shardings_fn: Callable[[T], Any], *,
                 compiler_options: Mapping[str, Any] | None = None) -> tuple[T, Any]:
    """Run `init_fn` under jit with the shardings `shardings_fn` derives from its abstract output.

    Every array is created directly in its shards (eval_shape → shardings → jit(out_shardings)): no host or
    single-device copy of the whole state ever exists.

    Args:
      init_fn: builds the state (no arguments; close over seeds and configs).
      shardings_fn: abstract state (ShapeDtypeStructs) -> its shardings (e.g. `train_state_shardings`).
      compiler_options: XLA options for this compilation (see `jit_train_step`).

    Returns:
      (state, shardings).

    Example:
      >>> mesh = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
      >>> init = lambda: {"w": nnx.Param(jax.numpy.ones((4, 2)), axes=("embed", "mlp"))}
      >>> state, sh = init_sharded(init, lambda s: param_shardings(s, mesh))
      >>> state["w"][...].sharding.spec
      P('fsdp', 'tensor')
    """
    shardings = shardings_fn(jax.eval_shape(init_fn))
    jitted = jax.jit(init_fn, out_shardings=shardings,
                     compiler_options=None if compiler_options is None else dict(compiler_options))
    return jitted(), shardings


def jit_train_step(step: Callable[..., Any], mesh: Mesh, rules: LogicalRules = DEFAULT_RULES, *,
                   in_shardings: Any, out_shardings: Any, donate_argnums: int | Sequence[int] = (0,),
                   static_argnames: str | Sequence[str] = (), compiler_options: Mapping[str, Any] | None = None
                   ) -> Any:
    """`jax.jit(step)` with in/out shardings and donation, tracing `step` with `rules` active on `mesh`.

    Args:
      step: a pure step function; its positional arguments are sharded by `in_shardings`.
      mesh, rules: activated (`use_rules`) while `step` is traced, so the model's `constrain` calls apply; the
        Pallas kernels are chosen for the mesh's devices (`kernels.backend.compiling_for`).
      in_shardings: per positional argument (a tree of NamedShardings or a prefix).
      out_shardings: for the outputs; a None entry leaves a sub-tree to the compiler.
      donate_argnums: arguments whose buffers the outputs may reuse (default: the train state).
      static_argnames: keyword arguments treated as compile-time constants.
      compiler_options: XLA options for this compilation (e.g. {"xla_backend_optimization_level": 0} to
        compile faster where run time does not matter: tests, memory analysis).

    Returns:
      The jitted step (call it, or `.lower(*abstract_args)` for compile-only analysis).

    Example:
      >>> mesh = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
      >>> step = lambda w, x: (w - 0.1 * constrain(x, ("batch", "act_embed")).mean(0), x.sum())
      >>> sh = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None))
      >>> jitted = jit_train_step(step, mesh, in_shardings=(replicated(mesh), sh),
      ...                         out_shardings=(replicated(mesh), replicated(mesh)))
      >>> w, total = jitted(jax.numpy.ones(3), jax.numpy.ones((2, 3)))
      >>> float(total)
      6.0
    """
    @functools.wraps(step)
    def traced(*args: Any, **kwargs: Any) -> Any:
        with use_rules(mesh, rules), compiling_for(mesh):  # kernels follow the mesh's devices, not the host
            return step(*args, **kwargs)

    return jax.jit(traced, in_shardings=in_shardings, out_shardings=out_shardings, donate_argnums=donate_argnums,
                   static_argnames=static_argnames,
                   compiler_options=None if compiler_options is None else dict(compiler_options))


def device_bytes(tree: Any, *, whole: bool = False) -> int:
    """Bytes one device holds of a tree of sharded arrays or ShapeDtypeStructs (the largest shard: every device
    of an evenly sharded leaf holds the same); whole: the bytes of the whole arrays instead (each counted once,
    however it is sharded or replicated). Leaves that are not arrays are skipped."""
    total = 0
    for x in jax.tree.leaves(tree):
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):  # a static argument (graph definition, config)
            continue
        sharded = not whole and getattr(x, "sharding", None) is not None
        shape = x.sharding.shard_shape(x.shape) if sharded else x.shape
        total += math.prod(shape) * x.dtype.itemsize  # extended dtypes (PRNG keys) carry their own itemsize
    return total


# XLA:CPU's classic loop emitters, cheaper to compile than its fusion emitters, and the flag that chose between them
# (an unknown flag is an error) exist up to jaxlib 0.11.0; from 0.11.1 on only the fusion emitters remain.
CPU_LOOP_EMITTERS: bool = jaxlib_version.__version_info__ < (0, 11, 1)

# Cheaper XLA:CPU code generation for compile-only analysis (no LLVM optimisation; the classic loop emitters where
# XLA still has them): faster compiles. Buffer assignment happens before code generation, so the per-device bytes
# are the default pipeline's up to alignment.
FAST_CPU_COMPILE: Mapping[str, Any] = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
                                       **({"xla_cpu_use_fusion_emitters": False} if CPU_LOOP_EMITTERS else {})}


def xla_flags(options: Mapping[str, Any] = FAST_CPU_COMPILE) -> str:
    """`options` as XLA_FLAGS text, for a process that must compile every program with them (the tests' jobs).

      >>> xla_flags({"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False})
      '--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false'
    """
    return " ".join(f"--{name}={str(value).lower()}" for name, value in options.items())
