"""scale_by_sketch: dense gradient G → sketch S = G Aᵀ of every target (dense-gradient mode, docs/method.md §3).

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

from logra_jax.core.tree_paths import path_keys
from logra_jax.kernels.backend import Implementation
from logra_jax.optim.lowrank import LowRankUpdate, is_lowrank, slice_projection, to_slices
from logra_jax.optim.projection import Distribution, digest_words
from logra_jax.optim.spec import SketchSpec, build_spec
from logra_jax.optim.targets import (
    RankRule,
    Target,
    TargetRule,
    find_targets,
    match_target,
    place_replicated,
)


class SketchState(NamedTuple):
    """count: number of completed updates (int32), the step the next sketch's projections are drawn for;
    spec: the transform's SketchSpec (static: a pytree node without leaves, so checkpoints and shardings see
    only `count`)."""

    count: jax.Array
    spec: SketchSpec


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


def scale_by_sketch(rank: int | None = None, base_seed: int | None = None, distribution: Distribution | None = None,
                    refresh: bool | None = None, rules: Sequence[TargetRule] | None = None,
                    round_bf16: bool | None = None, *, implementation: Implementation | None = None,
                    interpret: bool | None = None, rank_rules: str | Sequence[RankRule] | None = None,
                    spec: SketchSpec | None = None) -> optax.GradientTransformationExtraArgs:
    """Replace each target's dense gradient by its sketch, as a `LowRankUpdate` with factor S.

    Per batch slice l of a target (one layer), with t = number of completed updates (the state count):
      A_l = projection(seed(base_seed, spec.draw_step(t), "path.l"), r, k)   [r, k]
    (draw_step(t) = κ·⌊t/κ⌋ with refresh, period κ = refresh_every; 0 without; r = spec.rank_for(path), the
    target's own rank by a rank rule, else `rank`)
      S_l = G_l A_lᵀ                                                                  [d, r], float32
    Non-target leaves pass through unchanged. Leaves that already are a LowRankUpdate (sketch-native mode, where
    the backward pass produces S directly) pass through too, after checking that their spec's projection
    settings equal this transform's. Every update leaving this transform carries this transform's SketchSpec:
    this is where a chain decides how `apply_updates` will merge it. The spec is also in the state
    (`SketchState.spec`, static), where `logra_jax.optim.sketch_spec` finds it. Generic optax transforms (e.g.
    clip_by_global_norm) belong before this one.

    Args (each None: SketchSpec's default, declared there):
      rank: r, a positive Python int (static).
      base_seed: base of every projection seed (static).
      distribution: "rademacher" (±1/√r) or "gaussian" (N(0, 1/r)).
      refresh: draw fresh projections (True, every `spec.refresh_every` steps) or keep those of step 0 (False).
      rules: TargetRule sequence selecting targets and their matrix axes.
      round_bf16: set on the produced updates: `apply_updates` rounds the final factor to bf16 before merging.
      implementation: how `apply_updates` merges the produced updates: "xla" (einsum) or "pallas"
        (`logra_jax.kernels.merge`, block-tiled, in place).
      interpret: Pallas only: run the merge kernel in the Pallas interpreter (required on CPU).
      rank_rules: RankRule sequence or its text "pattern=rank, ..." giving matching targets their own rank.
      spec: the settings above as one SketchSpec (then leave them None).

    Returns:
      An optax.GradientTransformationExtraArgs with SketchState (extra args are ignored).

    Raises:
      TypeError/ValueError: bad settings (the message starts "scale_by_sketch:"), settings given beside spec;
        at init/update when no parameter matches the rules or a match cannot be viewed as a matrix; at init when
        a target's rank exceeds its width or a rank rule gives no target its rank (`check_rank_fits`); at update
        when an incoming LowRankUpdate was sketched with other projection settings.

    Example:
      >>> import jax.numpy as jnp
      >>> params = {"q_proj": {"kernel": jnp.ones((8, 4))}, "norm": jnp.ones(4)}
      >>> tx = scale_by_sketch(rank=2)
      >>> updates, state = tx.update(params, tx.init(params))
      >>> updates["q_proj"]["kernel"].factor.shape, int(state.count)
      ((4, 2), 1)
    """
    spec = build_spec("scale_by_sketch", spec, rank=rank, base_seed=base_seed, distribution=distribution,
                      refresh=refresh, rules=rules, round_bf16=round_bf16, implementation=implementation,
                      interpret=interpret, rank_rules=rank_rules)

    def init_fn(params: Any) -> SketchState:
        spec.check_fits(find_targets(params, spec.rules))
        return SketchState(count=place_replicated(jnp.zeros((), jnp.int32), params), spec=spec)

    def update_fn(updates: Any, state: SketchState, params: Any = None, **extra_args: Any
                  ) -> tuple[Any, SketchState]:
        del params, extra_args
        step = state.count
        draw_step = spec.draw_step(step)
        matched = []

        def one(keypath: Any, g: Any) -> Any:
            if isinstance(g, LowRankUpdate):
                # it must draw the same A and round alike; how it merges is this transform's call
                if not g.spec.draws_like(spec) or g.spec.round_bf16 != spec.round_bf16:
                    raise ValueError(f"scale_by_sketch: incoming LowRankUpdate for {g.target.path} has spec "
                                     f"{g.spec}, this transform has {spec}")
                matched.append(g.target.path)
                return g.with_merge(spec.implementation, spec.interpret)
            keys = path_keys(keypath)
            target = match_target(".".join(keys), keys, jnp.shape(g), spec.rules)
            if target is None:
                return g
            matched.append(target.path)
            s = _sketch(target.geometry, spec.base_seed, spec.rank_for(target.path), spec.distribution, g, draw_step,
                        digest_words(target.slice_paths))
            return LowRankUpdate(s, step, target=target, spec=spec)

        sketched = jax.tree_util.tree_map_with_path(one, updates, is_leaf=is_lowrank)
        if not matched:
            find_targets(updates, spec.rules)  # raises the no-match ValueError naming the rules
        return sketched, SketchState(count=optax.safe_increment(step), spec=spec)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
