"""Logical axis names → mesh axes.

Every parameter of the model carries logical axis names in its `axes` metadata; activations are constrained
with `constrain(x, axes)`, which is a no-op unless a mesh and a rules table are active (`use_rules`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

LogicalRules = Sequence[tuple[str, str | tuple[str, ...] | None]]

_ACTIVE: contextvars.ContextVar[tuple[Mesh, LogicalRules] | None] = contextvars.ContextVar(
    "logra_jax_logical_rules", default=None)


def logical_to_spec(axes: Sequence[str | None], rules: LogicalRules) -> PartitionSpec:
    """PartitionSpec for logical `axes` under `rules` (first matching rule wins; a mesh axis is used once)."""
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for name in axes:
        mesh_axes = table.get(name) if name is not None else None
        if mesh_axes is None:
            spec.append(None)
            continue
        group = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
        group = tuple(a for a in group if a not in used)
        used.update(group)
        spec.append(group[0] if len(group) == 1 else (group or None))
    return PartitionSpec(*spec)


@contextlib.contextmanager
def use_rules(mesh: Mesh, rules: LogicalRules) -> Iterator[None]:
    """Activate `rules` on `mesh` for `constrain` calls traced inside the block."""
    token = _ACTIVE.set((mesh, tuple(rules)))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Sharding constraint on an activation by logical axis names; identity when no rules are active."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(axes, rules)))
