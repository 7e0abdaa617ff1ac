"""Shardings of arrays derived from a parameter: optimizer state, sketch probes. A bottom-layer module (jax only).

One derivation, `follow_spec`: every dim of the derived array that corresponds to a dim of the parameter keeps
that dim's mesh axes; the mesh axes of the parameter's dims the array has no counterpart for (the width a row
moment reduces over) move onto the array's dims they divide — last corresponding dims first (the rows, before a
stacked-layers axis a scan slices), then the array's own dims (the rank) — so the array is split as finely as its
parameter whenever its shape allows.

Which dims correspond is either declared or inferred:
- declared: a LoGRA target names its batch, row and width axes (`logra_jax.optim.targets.Target.state_spec`), and
  its per-row state (*batch, *rows, ...) follows them — no guessing, square kernels included;
- inferred (`derive_spec`): for layouts nobody declares (optax's own states: adafactor's factored moments,
  GaLore's projectors), dims are matched to equal-sized parameter dims in order (`match_dims`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from jax.sharding import Mesh, PartitionSpec

MeshAxes = str | tuple[str, ...] | None


def as_tuple(mesh_axes: MeshAxes) -> tuple[str, ...]:
    """A PartitionSpec entry as a tuple of mesh axis names (None → ())."""
    if mesh_axes is None:
        return ()
    return (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)


def entry(group: Sequence[str]) -> MeshAxes:
    """The PartitionSpec entry for a group of mesh axes: None, one name, or a tuple."""
    return None if not group else group[0] if len(group) == 1 else tuple(group)


def full_spec(spec: PartitionSpec, rank: int) -> PartitionSpec:
    """`spec` with one entry per dim of a rank-`rank` array (missing trailing entries are None)."""
    return PartitionSpec(*spec, *(None,) * (rank - len(spec)))


def follow_spec(shape: Sequence[int], source_spec: PartitionSpec, source_rank: int,
                match: Sequence[int | None], mesh: Mesh) -> PartitionSpec:
    """PartitionSpec of an array of `shape` derived from a parameter of rank `source_rank` sharded `source_spec`.

    Args:
      shape: the derived array's shape.
      source_spec: the parameter's PartitionSpec (may be shorter than its rank).
      source_rank: the parameter's number of dims.
      match: per dim of `shape`, the parameter dim it corresponds to, or None for a dim of its own.
      mesh: the mesh (for the axis sizes that must divide a dim).

    Returns:
      Corresponding dims keep the parameter's mesh axes; the axes of uncorresponded parameter dims go, in order,
      to the first dim (last corresponding dims first, then the array's own dims) whose size they divide together
      with the axes it already has; an axis no dim can take is dropped (that part is replicated).

    Raises:
      ValueError: `match` does not have one entry per dim, or names a parameter dim twice or out of range.

    Example (a row moment [L, d] of a kernel [L, k, d] sharded (None, 'fsdp', 'tensor')):
      >>> import jax
      >>> mesh = jax.make_mesh((1, 1), ("fsdp", "tensor"), devices=jax.devices()[:1])
      >>> follow_spec((2, 8), PartitionSpec(None, "fsdp", "tensor"), 3, (0, 2), mesh)
      P(None, ('tensor', 'fsdp'))
    """
    shape, match = tuple(shape), tuple(match)
    used = [j for j in match if j is not None]
    if len(match) != len(shape) or len(set(used)) != len(used) or any(not 0 <= j < source_rank for j in used):
        raise ValueError(f"follow_spec: match {match} is not a map of the dims of {shape} onto distinct dims of a "
                         f"rank-{source_rank} parameter")
    source = tuple(full_spec(source_spec, source_rank))
    groups = [list(as_tuple(source[j])) if j is not None else [] for j in match]
    leftover = [a for j, axes in enumerate(source) if j not in used for a in as_tuple(axes)]
    order = [i for i, j in reversed(list(enumerate(match))) if j is not None] + [
        i for i, j in enumerate(match) if j is None]
    for axis in leftover:
        for i in order:
            if shape[i] % (math.prod(mesh.shape[a] for a in groups[i]) * mesh.shape[axis]) == 0:
                groups[i].append(axis)
                break
    return PartitionSpec(*(entry(g) for g in groups))


def match_dims(shape: Sequence[int], source: Sequence[int]) -> tuple[int | None, ...]:
    """Order-preserving map of `shape`'s dims onto equal-sized dims of `source` (None: unmatched), for layouts
    nobody declares. Most matched dims wins; among equals, later source dims (weight rows are last in the Flax
    layout).

    Example:
      >>> match_dims((3, 8, 5), (3, 16, 8))
      (0, 2, None)
    """
    shape, source = tuple(shape), tuple(source)

    @functools.cache
    def best(i: int, j: int) -> tuple[tuple[int, int], tuple[int | None, ...]]:
        if i == len(shape):
            return (0, 0), ()
        (n, pos), rest = best(i + 1, j)
        options = [((n, pos), (None, *rest))]
        for jj in range(j, len(source)):
            if source[jj] == shape[i] and shape[i] > 1:
                (n, pos), rest = best(i + 1, jj + 1)
                options.append(((n + 1, pos + jj), (jj, *rest)))
        return max(options, key=lambda option: option[0])

    return best(0, 0)[1]


def derive_spec(shape: Sequence[int], source_shape: Sequence[int], source_spec: PartitionSpec,
                mesh: Mesh) -> PartitionSpec:
    """`follow_spec` with the corresponding dims inferred by size (`match_dims`): for state whose layout no one
    declares. An array of the parameter's own shape takes its spec.

    Example (a sketch [L, d, r] of a kernel [L, k, d] sharded (None, 'fsdp', 'tensor')):
      >>> import jax
      >>> mesh = jax.make_mesh((1, 1), ("fsdp", "tensor"), devices=jax.devices()[:1])
      >>> derive_spec((2, 8, 4), (2, 6, 8), PartitionSpec(None, "fsdp", "tensor"), mesh)
      P(None, ('tensor', 'fsdp'), None)
    """
    shape, source_shape = tuple(shape), tuple(source_shape)
    if shape == source_shape:
        return full_spec(source_spec, len(source_shape))
    return follow_spec(shape, source_spec, len(source_shape), match_dims(shape, source_shape), mesh)
