"""Canonical parameter paths: the one way the project names a leaf of a parameter (or state) tree.

"blocks.attn.q_proj.kernel": dict keys, attribute names and sequence indices joined with "."; the trailing `.value`
under which an nnx.Variable holds its array is dropped, so an nnx.State, its `nnx.to_pure_dict` and the optimizer's
state trees name a parameter alike. Target rules (logra_jax.optim.targets), sharding rules
(logra_jax.parallel.sharding),
policy-sync payloads and the optimizer builders all use it. A bottom-layer module: it imports only jax.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

# flax.nnx Variables flatten their payload under this attribute; it is not part of the parameter's name.
_VARIABLE_VALUE_KEY = "value"


def _key_name(key: Any) -> str:
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return key.name
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx)
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return str(key.key)
    raise TypeError(f"path_str: unsupported key type {type(key).__name__} ({key!r})")


def path_keys(keypath: Sequence[Any]) -> tuple[str, ...]:
    """The canonical path components of a jax tree keypath (see `path_str`).

    Example:
      >>> import jax
      >>> [path_keys(p) for p, _ in jax.tree_util.tree_flatten_with_path({"a": [1.0]})[0]]
      [('a', '0')]
    """
    keys = list(keypath)
    if keys and isinstance(keys[-1], jax.tree_util.GetAttrKey) and keys[-1].name == _VARIABLE_VALUE_KEY:
        keys.pop()
    return tuple(_key_name(k) for k in keys)


def path_str(keypath: Sequence[Any]) -> str:
    """Canonical "a.b.c" path of a jax tree keypath.

    Dict keys, attribute names and sequence indices ("3") are joined with "."; the trailing `.value` under which
    an nnx.Variable holds its array is dropped, so an nnx.State and its `nnx.to_pure_dict` give the same paths.

    Args:
      keypath: a keypath from `jax.tree_util.tree_flatten_with_path` (or `tree_map_with_path`).

    Returns:
      The canonical path string.

    Raises:
      TypeError: for a key type other than DictKey, GetAttrKey, SequenceKey or FlattenedIndexKey.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> tree = {"blocks": [{"q_proj": {"kernel": jnp.zeros((2, 3))}}]}
      >>> [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
      ['blocks.0.q_proj.kernel']
    """
    return ".".join(path_keys(keypath))


def flat_params(tree: Any) -> dict[str, Any]:
    """{canonical path: leaf} of a parameter (or state) tree — nnx.State, nested dicts, ... — in tree order.

    Example:
      >>> flat_params({"blocks": [{"kernel": 1.0}], "embed": 2.0})
      {'blocks.0.kernel': 1.0, 'embed': 2.0}
    """
    return {path_str(k): v for k, v in jax.tree_util.tree_leaves_with_path(tree)}
