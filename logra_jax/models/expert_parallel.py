"""Expert parallelism: the experts of every MoE layer split over the fsdp mesh axis, each computed where it lives.

Layout. The expert dimension of every expert kernel [(L,) E, in, out] takes the logical axis "expert_shard", which
the sharding rules map to fsdp ahead of "embed" (`logra_jax.parallel.sharding.PARAM_RULES`): device f of the fsdp
group holds experts f·E/g … (f+1)·E/g − 1 whole in their model width (their "mlp" width still split over tensor),
instead of a 1/g slice of every expert's width. The router, attention and everything else keep their layout; so do
LoGRA's sketch probes and digests of the expert kernels, which follow the kernels' metadata. Without
`install_expert_parallel` nothing changes (the default layout: "expert" unmapped, every expert's width over fsdp).

Dispatch (`ExpertDispatch`, the `MoE.dispatch_hook`), in a `jax.shard_map` manual over the batch's mesh axes and
fsdp (tensor stays automatic), per device of an fsdp group of g devices holding n tokens each:

    all-gather the group's tokens x [g·n, D], their expert ids and routing weights [g·n, k] over fsdp
    sort the g·n·k (token, slot) pairs with those of the device's own E/g experts first, by expert
    scan 2g equal chunks of them, computing a chunk only if it holds any of the device's pairs (`lax.cond`):
        ragged_dot over the local kernels (gate, up, SwiGLU, down), each local expert on its own rows only,
        y_partial[token] += weight · expert output   (float32)
    psum_scatter over fsdp: token owner i gets y_i = Σ over the g devices (each token's k experts, wherever they live)

Dropless and capacity-free: the shapes are static (a device may own all g·n·k pairs) and nothing is ever dropped,
while the work follows the pairs a device really owns (≈ n·k under balanced routing: about 2 of the 2g chunks),
whether or not a backend's ragged_dot stops at Σ group_sizes (the compiled cost charges a ragged_dot every row it
is given: one over the whole buffer counts 8× the expert rows on 8 devices, experiments/moe/README.md). The
transpose of the all-gather is a reduce-scatter and vice versa, so the backward moves the same bytes. Against an
all-to-all of the (token, slot) pairs (`jax.lax.ragged_all_to_all`), which sends n·k·(g−1)/g rows per device, the
all-gather receives n·(g−1): the same bytes at k = g (Qwen3-MoE's top-8 on 8 devices), k/g of them for fewer
experts per token, with no offsets exchanged first and no data-dependent sizes. Per device the expert weights
never move, against FSDP's all-gather of every expert's whole kernels (3·E·D·F elements per layer, forward and
backward) and reduce-scatter of their gradients.

A LoGRA sketch hook on an expert kernel (`logra_jax.native.sketch_probes.ExpertLowRankHook`) runs inside the map on
the device's own experts, their probes, digests and group sizes: the sketch of expert e is still G_e·A_eᵀ on e's
own tokens (all of them: the group's tokens are gathered).

Under no active sharding rules, or an fsdp axis of one device (the rollout engine's decode layout), the hook runs
the layer's own `MoE.experts`.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from logra_jax.core.tree_paths import flat_params, path_str
from logra_jax.models.moe import ExpertLinear, MoE
from logra_jax.parallel.derived_specs import as_tuple
from logra_jax.parallel.sharding import EXPERT_SHARD, active_rules, logical_to_spec, param_shardings

EXPERT_AXIS = "fsdp"  # the mesh axis the experts are split over (`PARAM_RULES`' rule for "expert_shard")
_LINEARS = ("gate_proj", "up_proj", "down_proj")


class ExpertDispatch(nnx.Module, pytree=False):
    """`MoE.dispatch_hook` of expert parallelism: (flat [N, D], weights [N, k], ids [N, k]) → y [N, D], computed
    where the experts live (module docstring).

    It holds its MoE layer (a back-reference: the layer's parameters keep their own paths, and `nnx.split` /
    `nnx.merge` rebuild the reference on the merged layer), so it reads the kernels of the layer it serves, of one
    layer of a scan included. It is not a JAX pytree itself (a pytree cycle would never end); split the model
    with `nnx.split` as everywhere else.
    """

    def __init__(self, moe: MoE):
        self.moe = nnx.data(moe)

    def __call__(self, flat: jax.Array, weights: jax.Array, ids: jax.Array) -> jax.Array:
        active = active_rules()
        if active is None or active[0].shape.get(EXPERT_AXIS, 1) == 1:
            return self.moe.experts(flat, weights, ids)
        mesh, rules = active
        num_experts = self.moe.router.kernel.shape[-1]
        check_divides(num_experts, mesh)
        token_axes = tuple(a for a in as_tuple(logical_to_spec(("batch",), rules, shape=flat.shape[:1], mesh=mesh)[0])
                           if mesh.shape[a] > 1)
        gather = EXPERT_AXIS in token_axes
        manual = frozenset({*token_axes, EXPERT_AXIS})
        linears = [getattr(self.moe, name) for name in _LINEARS]
        # each linear's kernel, and its probe and digest when a LoGRA sketch hook is installed on it
        arrays = [tuple(getattr(lin, a)[...] for a in ("kernel", "sketch_probe", "sketch_digest")
                        if lin.lowrank_hook is not None or a == "kernel") for lin in linears]
        tokens = P(token_axes or None)
        experts = jax.tree.map(lambda _: P(EXPERT_AXIS), arrays)
        k, g = self.moe.k, mesh.shape[EXPERT_AXIS]

        # the kernel-side inputs vary like the tokens do over the other token axes (their cotangents are summed there)
        others = tuple(a for a in token_axes if a != EXPERT_AXIS)

        def local(x, w, e, arrays):
            arrays = jax.tree.map(lambda a: jax.lax.pcast(a, others, to="varying") if others else a, arrays)
            if gather:
                x, w, e = (jax.lax.all_gather(t, EXPERT_AXIS, axis=0, tiled=True) for t in (x, w, e))
            # 2g chunks of the pairs (≈ 2 of them hold a device's own under balanced routing), else fewer
            chunks = next(c for c in (2 * g, g, 1) if x.shape[0] * k % c == 0)
            y = local_experts(x, w, e, linears, arrays, k, jax.lax.axis_index(EXPERT_AXIS), chunks,
                              tuple(sorted(manual)))
            if gather:
                return jax.lax.psum_scatter(y, EXPERT_AXIS, scatter_dimension=0, tiled=True)
            return jax.lax.psum(y, EXPERT_AXIS)

        mapped = jax.shard_map(local, mesh=mesh, in_specs=(tokens, tokens, tokens, experts), out_specs=tokens,
                               axis_names=manual)
        return mapped(flat, weights, ids, arrays)


def local_experts(x: jax.Array, weights: jax.Array, ids: jax.Array, linears: list[ExpertLinear],
                  arrays: list[tuple[jax.Array, ...]], k: int, shard: jax.Array, chunks: int = 1,
                  varying: tuple[str, ...] = ()) -> jax.Array:
    """The weighted sum over the slots routed to this device's experts [M, D] of tokens x [M, D] routed to ids
    [M, k] with weights [M, k]: the experts shard·E_l … shard·E_l + E_l − 1 (E_l = the local kernels' leading
    size), each multiplying its own rows only (ragged_dot).

    The M·k (token, slot) pairs are sorted with this device's first; a scan over `chunks` equal chunks of them
    computes only the chunks that hold any of its pairs (`lax.cond`), so the work follows the rows the device
    really has (≈ M·k / g under balanced routing) and not the static M·k its buffer must allow: dropless with no
    capacity. Each chunk's outputs, times their routing weights, are added to their tokens' rows.

    Args:
      x, weights, ids: the tokens, routing weights and global expert ids.
      linears: the layer's gate, up and down `ExpertLinear`s (for their LoGRA sketch hooks).
      arrays: per linear, its local kernel [E_l, in, out] and, with a sketch hook, its probe and digest.
      k: experts per token.
      shard: this device's index along the expert axis.
      chunks: how many chunks the M·k pairs are cut into (must divide M·k).
      varying: inside a shard_map, the manual mesh axes the result varies over.

    Returns:
      [M, D] in x's dtype (summed in float32).
    """
    local_count = arrays[0][0].shape[0]
    M, D = x.shape
    pairs = M * k
    size = pairs // chunks
    index = ids.reshape(-1) - shard * local_count
    mine = (index >= 0) & (index < local_count)
    key = jnp.where(mine, index, local_count)  # other devices' pairs sort last
    order = jnp.argsort(key, stable=True)
    ends = jnp.cumsum(jnp.bincount(key, length=local_count + 1)[:local_count]).astype(jnp.int32)
    starts, total = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]]), ends[-1]
    kept = jnp.take(jnp.where(mine, weights.reshape(-1), 0), order)
    gate, up, down = linears

    def compute(y: jax.Array, lo: jax.Array) -> jax.Array:
        pair = jax.lax.dynamic_slice_in_dim(order, lo, size)
        valid = lo + jnp.arange(size) < total
        rows = jnp.take(x, pair // k, axis=0) * valid[:, None].astype(x.dtype)
        group_sizes = jnp.clip(ends, lo, lo + size) - jnp.clip(starts, lo, lo + size)

        def apply(linear: ExpertLinear, h: jax.Array, parts: tuple[jax.Array, ...]) -> jax.Array:
            if linear.lowrank_hook is not None:
                return linear.lowrank_hook(h, *parts, group_sizes)
            return jax.lax.ragged_dot(h, parts[0].astype(h.dtype), group_sizes)

        h = jax.nn.silu(apply(gate, rows, arrays[0])) * apply(up, rows, arrays[1])
        out = apply(down, h, arrays[2]).astype(jnp.float32)
        w = jax.lax.dynamic_slice_in_dim(kept, lo, size) * valid
        return y.at[pair // k].add(out * w[:, None])

    def chunk(y: jax.Array, j: jax.Array) -> tuple[jax.Array, None]:
        lo = j * size
        return jax.lax.cond(lo < total, compute, lambda y, _: y, y, lo), None

    y = jnp.zeros((M, D), jnp.float32)
    if varying:  # the sum varies over the mesh axes its terms do (inside a shard_map): so must its start
        y = jax.lax.pcast(y, varying, to="varying")
    y = jax.lax.scan(chunk, y, jnp.arange(chunks, dtype=jnp.int32))[0]
    return y.astype(x.dtype)


def check_divides(num_experts: int, mesh: Mesh) -> None:
    """Raise ValueError unless the mesh's expert axis divides `num_experts` (names config.model.expert_parallel)."""
    size = int(mesh.shape.get(EXPERT_AXIS, 1))
    if num_experts % size:
        raise ValueError(f"config.model.expert_parallel = True: the {num_experts} experts do not split over the "
                         f"{size} devices of the mesh's {EXPERT_AXIS} axis (train.mesh_fsdp); pick a size that "
                         f"divides {num_experts}")


def moe_layers(model: nnx.Module) -> list[MoE]:
    """The MoE layers of `model`, in graph order."""
    return [m for _, m in nnx.iter_modules(model) if isinstance(m, MoE)]


def install_expert_parallel(model: nnx.Module, mesh: Mesh | None = None) -> int:
    """Make every MoE layer of `model` expert-parallel, in place: the expert dimension of its expert kernels (and
    of any LoGRA probes and digests already attached to them) gets the logical axis "expert_shard" (split over
    fsdp by the sharding rules) and its `dispatch_hook` an `ExpertDispatch`.

    Only metadata and the hook change: place the weights with `expert_parallel_shardings` (or let
    `init_sharded` / a train step's shardings derive them from the relabelled metadata).

    Args:
      model: a decoder (real or abstract) with MoE layers.
      mesh: the mesh the model will run on, to check that its fsdp axis divides the experts (None: unchecked).

    Returns:
      The number of MoE modules made expert-parallel (one per stack of scanned layers).

    Raises:
      ValueError: `model` has no MoE layer, or the mesh's fsdp size does not divide the number of experts (both
        name config.model.expert_parallel).
    """
    layers = moe_layers(model)
    if not layers:
        raise ValueError("config.model.expert_parallel = True needs a mixture-of-experts model (num_experts > 0); "
                         f"{type(model).__name__} has no MoE layer")
    for layer in layers:
        if mesh is not None:
            check_divides(layer.router.kernel.shape[-1], mesh)
        for name in _LINEARS:
            linear = getattr(layer, name)
            for attr in ("kernel", "sketch_probe", "sketch_digest"):
                variable = getattr(linear, attr, None)
                axes = None if variable is None else variable.get_metadata().get("axes")
                if axes and "expert" in axes:
                    variable.set_metadata("axes", tuple(EXPERT_SHARD if a == "expert" else a for a in axes))
        layer.dispatch_hook = nnx.data(ExpertDispatch(layer))
    return len(layers)


def expert_parallel_shardings(abstract: nnx.Module, mesh: Mesh) -> dict[str, NamedSharding]:
    """{canonical parameter path: NamedSharding} of an abstract model's parameters with its experts split over
    fsdp (`install_expert_parallel` on `abstract`, which it modifies): for `models.load(..., shardings=...)` or
    an init's out_shardings.

    Raises:
      ValueError: as `install_expert_parallel`.
    """
    install_expert_parallel(abstract, mesh)
    return flat_params(param_shardings(nnx.state(abstract, nnx.Param), mesh))


def shardings_like(tree: Any, by_path: dict[str, NamedSharding]) -> Any:
    """`tree` (a state of Variables) with each leaf replaced by `by_path[its canonical path]`."""
    return jax.tree_util.tree_map_with_path(lambda path, _: by_path[path_str(path)], tree)


def init_expert_parallel_model(config: Any, mesh: Mesh, seed: int = 0) -> nnx.Module:
    """`models.decoder.init_sharded_model` with the experts split over fsdp: the weights are created under jit
    straight into the expert-parallel layout (bit for bit `init_model(config, seed)`), and the model returned
    is expert-parallel (`install_expert_parallel`).

    Raises:
      ValueError: as `install_expert_parallel`.
    """
    from logra_jax.models.decoder import abstract_model, init_model

    by_path = expert_parallel_shardings(abstract_model(config), mesh)
    graphdef, abstract = nnx.split(abstract_model(config))
    state = jax.jit(lambda: nnx.split(init_model(config, seed))[1], out_shardings=shardings_like(abstract, by_path))()
    model = nnx.merge(graphdef, state)
    install_expert_parallel(model, mesh)
    return model


def expert_kernel_bytes(model: nnx.Module) -> int:
    """Bytes of the whole expert kernels of `model` (every MoE layer's gate, up and down stacks)."""
    return sum(math.prod(getattr(m, n).kernel.shape) * getattr(m, n).kernel.dtype.itemsize
               for m in moe_layers(model) for n in _LINEARS)
