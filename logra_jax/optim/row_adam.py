"""scale_by_row_adam: one second moment per output row, no first moment (docs/method.md §4).

Per target batch slice (one layer) with sketch S [d, r], row moment v [d] (float32) and t = updates + 1:
  v ← β₂ v + (1 − β₂) · mean_j S_ij²
  ρ_i = sqrt(v_i / (1 − β₂^t))
  paper: den_i = ρ_i + max(ε · mean_i ρ_i, tiny);  s_i ∝ 1/den_i with unit RMS over rows;  D̃ = diag(s) S;
         D = D̃ · ‖S‖_F / ‖D̃‖_F          (only redistributes magnitude across rows; D = 0 when S = 0)
  nemo:  D = S / (ρ + ε)                (absolute ε; pair with a learning rate and weight decay)
  sgd:   D = S                          (reference; no row moment)
`tiny` is the smallest normal float32. The row moment is indexed by output row, so it survives projection
refresh. The paper's unit-RMS s is computed as (min_i den_i / den_i) rescaled to unit RMS: the same vector,
without overflowing 1/den when ρ underflows.

implementation="xla" runs the jnp code below; "pallas" runs `logra_jax.kernels.row_moment` (one fused pass over
each layer's S, vmapped over the stacked layers), the same equations in another order of float32 operations
(equal to ~1e-6 relative, not bitwise).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from logra_jax.core.tree_paths import path_keys
from logra_jax.kernels.backend import Implementation, check_kernel_settings
from logra_jax.kernels.row_moment import row_moment
from logra_jax.optim.lowrank import LowRankUpdate, is_lowrank
from logra_jax.optim.targets import (
    DEFAULT_TARGET_RULES,
    Target,
    TargetRule,
    check_rules,
    find_targets,
    place_replicated,
    zero_row_moments,
)

Variant = Literal["paper", "nemo", "sgd"]
VARIANTS: tuple[str, ...] = ("paper", "nemo", "sgd")
_TINY = float(np.finfo(np.float32).tiny)


class RowAdamState(NamedTuple):
    """count: completed updates (int32). row_moment: nested dict keyed by each target's path components
    ({"blocks": {"attn": {"q_proj": {"kernel": v}}}}), v of shape (*batch_shape, *rows_shape) float32;
    empty for the sgd variant."""

    count: jax.Array
    row_moment: dict[str, Any]


def _nest(items: Mapping[tuple[str, ...], jax.Array]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for keys, value in items.items():
        node = tree
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    return tree


def _lookup(tree: Mapping[str, Any], target: Target) -> jax.Array:
    node: Any = tree
    for key in target.keys:
        if not isinstance(node, Mapping) or key not in node:
            raise ValueError(f"scale_by_row_adam: no row moment for target {target.path!r}; was the state "
                             "initialised with the same parameters?")
        node = node[key]
    return node


def row_adam_direction(s: jax.Array, v: jax.Array, count: jax.Array, target: Target, variant: Variant,
                       b2: float | jax.Array, eps: float | jax.Array, *, implementation: Implementation = "xla",
                       interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """One RowAdam step of one target: (D, new v) from sketch s (*batch, *rows, r) and v (*batch, *rows).

    `count` is the number of completed updates (t = count + 1). Statistics are per batch slice (per layer).
    implementation "pallas" runs the `row_moment` kernel on each slice (rows flattened to d; `interpret` for CPU).

    Example:
      >>> import jax.numpy as jnp
      >>> from logra_jax.optim.targets import find_targets
      >>> t = find_targets({"q_proj": {"kernel": jnp.zeros((8, 4))}})["q_proj.kernel"]
      >>> s = jnp.array([[1.0, 1.0], [2.0, 2.0], [0.0, 0.0], [4.0, 4.0]])
      >>> d, v = row_adam_direction(s, jnp.zeros(4), jnp.int32(0), t, "paper", 0.95, 1e-8)
      >>> [round(float(x), 3) for x in jnp.linalg.norm(d, axis=1)]   # rows equalised, total norm kept
      [3.742, 3.742, 0.0, 3.742]
    """
    if variant == "sgd":
        return s, v
    if implementation == "pallas":
        return _row_moment_slices(s, v, count, target, variant, b2, eps, interpret)
    nb, nr = len(target.batch_shape), len(target.rows_shape)
    rows = tuple(range(nb, nb + nr))
    v = b2 * v + (1.0 - b2) * jnp.mean(jnp.square(s), axis=-1)
    t = (count + 1).astype(jnp.float32)
    rho = jnp.sqrt(v / (1.0 - jnp.power(jnp.asarray(b2, jnp.float32), t)))
    if variant == "nemo":
        return s / (rho + eps)[..., None], v
    den = rho + jnp.maximum(eps * jnp.mean(rho, axis=rows, keepdims=True), _TINY)
    inv = jnp.min(den, axis=rows, keepdims=True) / den
    scale = inv / jnp.sqrt(jnp.mean(jnp.square(inv), axis=rows, keepdims=True))
    d_tilde = scale[..., None] * s
    norm_axes = (*rows, nb + nr)
    norm_s = jnp.sqrt(jnp.sum(jnp.square(s), axis=norm_axes, keepdims=True))
    norm_d = jnp.sqrt(jnp.sum(jnp.square(d_tilde), axis=norm_axes, keepdims=True))
    restore = jnp.where(norm_d > 0, norm_s / jnp.where(norm_d > 0, norm_d, 1.0), 0.0)
    return d_tilde * restore, v


def _row_moment_slices(s: jax.Array, v: jax.Array, count: jax.Array, target: Target, variant: Variant,
                       b2: float | jax.Array, eps: float | jax.Array, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """The Pallas row_moment kernel on every batch slice: S_l viewed as [d, r], v_l as [d], vmapped over l."""
    n, r = target.num_slices, s.shape[-1]

    def one(s_l: jax.Array, v_l: jax.Array) -> tuple[jax.Array, jax.Array]:
        return row_moment(s_l, v_l, count, b2=b2, eps=eps, variant=variant, implementation="pallas",
                          interpret=interpret)

    v_new, d = jax.vmap(one)(s.reshape(n, target.d, r), v.reshape(n, target.d))
    return d.reshape(s.shape), v_new.reshape(v.shape)


def scale_by_row_adam(variant: Variant = "paper", b2: float = 0.95, eps: float = 1e-8,
                      rules: tuple[TargetRule, ...] = DEFAULT_TARGET_RULES, *, implementation: Implementation = "xla",
                      interpret: bool = False) -> optax.GradientTransformationExtraArgs:
    """RowAdam on low-rank updates: factor S → D per docs/method.md §4 (see the module docstring for the equations).

    Acts on LowRankUpdate leaves (place after `scale_by_sketch`); other leaves pass through unchanged.

    Args:
      variant: "paper" (relative ε, unit-RMS row scale, norm restoration), "nemo" (D = S/(ρ+ε)) or "sgd".
      b2: β₂ of the row second moment.
      eps: ε (relative to mean ρ for "paper", absolute for "nemo").
      rules: the TargetRule sequence used by `scale_by_sketch` (init finds the targets in the params with it).
      implementation: "xla" (jnp) or "pallas" (the fused `kernels.row_moment`, one pass over each layer's S).
      interpret: Pallas only: run the kernel in the Pallas interpreter (required on CPU).

    Returns:
      An optax.GradientTransformationExtraArgs with RowAdamState (row moments [*batch, *rows] float32 per
      target, placed like the weight rows when init gets concretely sharded parameters).

    Raises:
      ValueError: unknown variant or implementation, b2 outside [0, 1), eps < 0; at update, a low-rank leaf
        without row moment.
      TypeError: interpret is not a bool.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from logra_jax.optim.sketch import scale_by_sketch
      >>> params = {"q_proj": {"kernel": jnp.ones((8, 4))}}
      >>> tx = optax.chain(scale_by_sketch(rank=2), scale_by_row_adam())
      >>> updates, state = tx.update(params, tx.init(params))
      >>> state[1].row_moment["q_proj"]["kernel"].shape
      (4,)
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    # Arrays (from optax.inject_hyperparams, possibly traced) cannot be checked here.
    if isinstance(b2, (int, float)) and not 0 <= b2 < 1:
        raise ValueError(f"b2 must be in [0, 1), got {b2!r}")
    if isinstance(eps, (int, float)) and not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    rules = check_rules(rules)
    implementation, interpret = check_kernel_settings(implementation, interpret, "scale_by_row_adam")

    def init_fn(params: Any) -> RowAdamState:
        targets = find_targets(params, rules)
        moments = {}
        if variant != "sgd":
            moments = {targets[p].keys: v for p, v in zero_row_moments(params, targets).items()}
        return RowAdamState(count=place_replicated(jnp.zeros((), jnp.int32), params), row_moment=_nest(moments))

    def update_fn(updates: Any, state: RowAdamState, params: Any = None, **extra_args: Any
                  ) -> tuple[Any, RowAdamState]:
        del params, extra_args
        new_moments: dict[tuple[str, ...], jax.Array] = {}

        def one(u: Any) -> Any:
            if not isinstance(u, LowRankUpdate):
                return u
            u.check_step()
            t = u.target
            v = jnp.zeros((), jnp.float32) if variant == "sgd" else _lookup(state.row_moment, t)
            d, v = row_adam_direction(u.factor.astype(jnp.float32), v, state.count, t, variant, b2, eps,
                                      implementation=implementation, interpret=interpret)
            if variant != "sgd":
                new_moments[t.keys] = v.astype(jnp.float32)
            return u.replace(factor=d)

        out = jax.tree.map(one, updates, is_leaf=is_lowrank)
        moments = {path_keys(kp): v for kp, v in jax.tree_util.tree_flatten_with_path(state.row_moment)[0]}
        moments.update(new_moments)
        return out, RowAdamState(count=optax.safe_increment(state.count), row_moment=_nest(moments))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
