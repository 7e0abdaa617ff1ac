"""scale_by_sketch: dense gradient G → sketch S = G Aᵀ of every target (dense-gradient mode, LOGRA.md §3).

The layers of a stacked target are sketched one at a time (`lax.map`): only one layer's A [r, k] exists at any
moment, instead of all L of them (at Qwen2.5-7B, r = 256, A of all 28 down_proj layers is 0.5 GiB per device).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from logra_jax.kernels.backend import Implementation, check_kernel_settings
from logra_jax.optim.lowrank import LowRankUpdate, is_lowrank, slice_projection, to_slices
from logra_jax.optim.projection import (
    Distribution,
    check_nonneg_int,
    check_projection_args,
    digest_words,
)
from logra_jax.optim.targets import (
    DEFAULT_TARGET_RULES,
    Target,
    TargetRule,
    check_rank_fits,
    check_rules,
    find_targets,
    match_target,
    place_replicated,
)
from logra_jax.tree_paths import path_keys


class SketchState(NamedTuple):
    """count: number of completed updates (int32), the step the next sketch's projections are drawn for."""

    count: jax.Array


# Jitted with static geometry and seed settings (the path's digests are an input), so eager use compiles once per
# shape and distribution.
@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _sketch(geometry: Target, base_seed: int, rank: int, distribution: Distribution, g: jax.Array,
            step: jax.Array, digests: jax.Array) -> jax.Array:
    """S = G Aᵀ for every batch slice: (*batch_shape, *rows_shape, r) float32, contracting the width axes.

    One slice at a time: A_l is drawn inside the loop body, so a single [r, k] projection is live at once.
    """
    w, batch, rows, width = geometry.subscripts
    slice_w = "".join(c for c in w if c not in batch)
    g = to_slices(g, geometry)  # slice l of the loop is batch slice l (row-major, as in slice_paths)

    def one(xs: tuple[jax.Array, jax.Array]) -> jax.Array:
        g_l, digest = xs
        a = slice_projection((geometry, base_seed, rank, distribution), step, digest)
        a = a.reshape(rank, *geometry.width_shape).astype(g_l.dtype)
        return jnp.einsum(f"{slice_w},z{width}->{rows}z", g_l, a, preferred_element_type=jnp.float32)

    s = jax.lax.map(one, (g, jnp.asarray(digests, jnp.uint32)))
    return s.reshape(*geometry.batch_shape, *geometry.rows_shape, rank)


def scale_by_sketch(rank: int, base_seed: int = 42, distribution: Distribution = "rademacher",
                    refresh: bool = True, rules: Sequence[TargetRule] = DEFAULT_TARGET_RULES,
                    round_bf16: bool = False, *, implementation: Implementation = "xla",
                    interpret: bool = False) -> optax.GradientTransformationExtraArgs:
    """Replace each target's dense gradient by its sketch, as a `LowRankUpdate` with factor S.

    Per batch slice l of a target (one layer), with t = number of completed updates (the state count):
      A_l = projection(seed(base_seed, t if refresh else 0, "path.l"), rank, k)        [r, k]
      S_l = G_l A_lᵀ                                                                  [d, r], float32
    Non-target leaves pass through unchanged. Leaves that already are a LowRankUpdate (sketch-native mode, where
    the backward pass produces S directly) pass through too, after checking that their static seed settings
    equal this transform's. Every update leaving this transform carries its merge settings (`implementation`,
    `interpret`): this is where a chain decides how `apply_updates` will merge it. Generic optax transforms (e.g.
    clip_by_global_norm) belong before this one.

    Args:
      rank: r, a positive Python int (static).
      base_seed: base of every projection seed (static).
      distribution: "rademacher" (±1/√r) or "gaussian" (N(0, 1/r)).
      refresh: draw fresh projections every step (True) or keep those of step 0 (False).
      rules: TargetRule sequence selecting targets and their matrix axes.
      round_bf16: set on the produced updates: `apply_updates` rounds the final factor to bf16 before merging.
      implementation: how `apply_updates` merges the produced updates: "xla" (einsum) or "pallas"
        (`logra_jax.kernels.merge`, block-tiled, in place).
      interpret: Pallas only: run the merge kernel in the Pallas interpreter (required on CPU).

    Returns:
      An optax.GradientTransformationExtraArgs with SketchState (extra args are ignored).

    Raises:
      TypeError/ValueError: bad rank, base_seed, distribution, rules, implementation or interpret; at
        init/update when no parameter matches the rules or a match cannot be viewed as a matrix; at init when
        the rank exceeds a target's width (`check_rank_fits`).

    Example:
      >>> import jax.numpy as jnp
      >>> params = {"q_proj": {"kernel": jnp.ones((8, 4))}, "norm": jnp.ones(4)}
      >>> tx = scale_by_sketch(rank=2)
      >>> updates, state = tx.update(params, tx.init(params))
      >>> updates["q_proj"]["kernel"].factor.shape, int(state.count)
      ((4, 2), 1)
    """
    check_projection_args(rank, distribution)
    check_nonneg_int("base_seed", base_seed)
    rules = check_rules(rules)
    refresh, round_bf16 = bool(refresh), bool(round_bf16)
    settings = dict(base_seed=base_seed, rank=rank, distribution=distribution, refresh=refresh,
                    round_bf16=round_bf16)
    implementation, interpret = check_kernel_settings(implementation, interpret, "scale_by_sketch")
    merge_settings = dict(implementation=implementation, interpret=interpret)

    def init_fn(params: Any) -> SketchState:
        check_rank_fits(find_targets(params, rules), rank)
        return SketchState(count=place_replicated(jnp.zeros((), jnp.int32), params))

    def update_fn(updates: Any, state: SketchState, params: Any = None, **extra_args: Any
                  ) -> tuple[Any, SketchState]:
        del params, extra_args
        step = state.count
        draw_step = step if refresh else jnp.zeros((), jnp.int32)
        matched = []

        def one(keypath: Any, g: Any) -> Any:
            if isinstance(g, LowRankUpdate):
                got = {name: getattr(g.meta, name) for name in settings}
                if got != settings:
                    raise ValueError(f"scale_by_sketch: incoming LowRankUpdate for {g.target.path} has settings "
                                     f"{got}, this transform has {settings}")
                matched.append(g.target.path)
                return g.with_merge(**merge_settings)
            keys = path_keys(keypath)
            target = match_target(".".join(keys), keys, jnp.shape(g), rules)
            if target is None:
                return g
            matched.append(target.path)
            s = _sketch(target.geometry, base_seed, rank, distribution, g, draw_step,
                        digest_words(target.slice_paths))
            return LowRankUpdate(s, step, target=target, **settings, **merge_settings)

        sketched = jax.tree_util.tree_map_with_path(one, updates, is_leaf=is_lowrank)
        if not matched:
            find_targets(updates, rules)  # raises the no-match ValueError naming the rules
        return sketched, SketchState(count=optax.safe_increment(step))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
