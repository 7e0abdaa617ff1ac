"""scale_by_subspace_momentum: a first moment in sketch coordinates that survives projection changes.

RowAdam (docs/method.md §4) has no first moment. This stage, placed after it, keeps one per target: M [*batch, *rows, r]
float32, the size of one sketch, in the coordinates of the projection A_t the step is merged with. Per target
batch slice (one layer), with D_t = RowAdam's direction, τ = this stage's updates + 1 and b = the draw step M is
expressed in (`SketchSpec.draw_step`; κ = `refresh_every`):
  if draw_step(t) ≠ b:  M ← M · A_b A_tᵀ (A_t A_tᵀ + λI)⁻¹,   λ = 10⁻⁵ · tr(A_t A_tᵀ)/r        (transfer)
  M ← β₁ M + (1 − β₁) D_t
  out = M / (1 − β₁^τ)                                                     (bias correction, as Adam's m̂)
and the update stays a LowRankUpdate in A_t's coordinates, ΔW = −U·A_t with U the scaled `out`: the policy sync
ships the same (U, step) as without momentum, and the predicted-KL controller after this stage sizes the step that
includes it. A_b and A_t are regenerated from (base seed, step, path), one layer at a time (`lax.map`); the
transfer needs only the r×r products A_b A_tᵀ and A_t A_tᵀ and an r×r Cholesky solve per layer, never a dense
buffer. It runs only when the projection changed (a `lax.cond`; κ = 1: every step; refresh=False: never).

Why this transfer. M·A_b is the dense direction the momentum stands for. Its least-squares image in the new
subspace, argmin_X ‖X A_t − M A_b‖_F = M A_b A_tᵀ (A_t A_tᵀ)⁻¹, makes X·A_t the orthogonal projection of M·A_b onto
the row space of A_t: the part of the old direction the new subspace can express, no more and no noise added. This is
LDAdam's projection-aware transfer (Robert et al. 2024: m ← P_tᵀ P_{t−1} m with orthonormal bases, where the
inverse is I) written for our non-orthonormal ±1/√r projections; λ (relative 10⁻⁵) only guards the solve when r = k.
FLORA (Hao et al. 2024) re-sketches instead, m ← m A_b A_tᵀ without the inverse: unbiased (E[A_tᵀA_t] = I) but
each transfer multiplies the carried momentum's energy by ≈ k/r, so with β₁² k/r > 1 (β₁ = 0.9: any k > 1.23 r)
momentum carried over many draws is dominated by projection noise; FLORA redraws every κ = 1000 steps, where that
does not matter. GaLore (Zhao et al. 2024, optax.contrib) holds its projection for T = 200 steps and keeps Adam's
moments unchanged in the new basis (no transfer); LDAdam's error feedback needs a dense [d, k] buffer, which LoGRA
exists to avoid, so it is not used here.

What the transfer keeps. For fresh independent draws the row space of A_t is a random r-dimensional subspace of
the k-dimensional input space, so the projection keeps E = r/k of M·A_b's energy per transfer. With κ = 1 the
momentum's memory of a step i draws back is (β₁² r/k)^i in energy: at the paper's r = 256 of k = 3584 (Qwen2.5-7B
q/o) r/k = 7.1% and at k = 18944 (down_proj) 1.4%, so a per-step refresh turns β₁ = 0.9 into almost no momentum
(the carried part is 6.4% · 0.81 of the fresh one after one step). A momentum with horizon 1/(1 − β₁) = 10 steps
means something only when the projection is held that long: κ ≥ 1/(1 − β₁) (κ = 10–20 at β₁ = 0.9), or κ = ∞
(refresh=False) where M is exact but every update stays in one r-dimensional subspace. On the demo model
(r = 64 of k = 128 / 384) a per-step transfer keeps 50% / 17%. experiments/momentum measures κ ∈ {1, 10, ∞}.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from logra_jax.core.tree_paths import path_keys, path_str
from logra_jax.optim.lowrank import LowRankUpdate, _Draw, is_lowrank, mark_lowrank_aware, slice_projection
from logra_jax.optim.projection import digest_words
from logra_jax.optim.row_adam import _nest
from logra_jax.optim.spec import SketchSpec
from logra_jax.optim.targets import (
    DEFAULT_TARGET_RULES,
    RankRule,
    TargetRule,
    find_targets,
    place_replicated,
    place_rows,
)

_HIGHEST = jax.lax.Precision.HIGHEST
# Relative ridge of the transfer's solve: λ = RIDGE · tr(A Aᵀ)/r (tr(A Aᵀ)/r = k/r for Rademacher).
RIDGE = 1e-5


class SubspaceMomentumState(NamedTuple):
    """count: updates of this stage (int32); basis: the draw step the momentum is expressed in (int32, the
    `SketchSpec.draw_step` of the last update); first_moment: nested dict keyed by each target's path components, M of
    shape (*batch_shape, *rows_shape, r) float32 (laid out per row like RowAdam's row moments)."""

    count: jax.Array
    basis: jax.Array
    first_moment: dict[str, Any]


def transfer_matrix(a_old: jax.Array, a_new: jax.Array) -> jax.Array:
    """T = A_old A_newᵀ (A_new A_newᵀ + λI)⁻¹ [r, r] for one layer's projections A [r, k], float32, so that
    (M T) A_new is the orthogonal projection of M A_old onto A_new's row space (up to the ridge λ).

    Example:
      >>> from logra_jax.optim.projection import projection
      >>> a = projection(7, 4, 16)
      >>> bool(jnp.allclose(transfer_matrix(a, a), jnp.eye(4), atol=1e-3))   # same projection: M unchanged
      True
    """
    gram = jnp.einsum("zk,yk->zy", a_new, a_new, precision=_HIGHEST)
    cross = jnp.einsum("zk,yk->zy", a_old, a_new, precision=_HIGHEST)
    ridge = RIDGE * jnp.trace(gram) / gram.shape[0]
    chol = jax.scipy.linalg.cho_factor(gram + ridge * jnp.eye(gram.shape[0], dtype=gram.dtype))
    # T = cross · gram⁻¹ = (gram⁻¹ crossᵀ)ᵀ (gram is symmetric)
    return jax.scipy.linalg.cho_solve(chol, cross.T).T


def _transfer(draw: _Draw, m: jax.Array, old_step: jax.Array, new_step: jax.Array, digests: jax.Array
              ) -> jax.Array:
    """M·T_l for every batch slice l, one layer's two projections in memory at a time."""
    t, rank = draw[0], draw[2]

    def one(xs: tuple[jax.Array, jax.Array]) -> jax.Array:
        m_l, digest = xs
        tm = transfer_matrix(slice_projection(draw, old_step, digest), slice_projection(draw, new_step, digest))
        return jnp.einsum("iz,zy->iy", m_l, tm, precision=_HIGHEST)

    m_slices = m.reshape(t.num_slices, t.d, rank)
    return jax.lax.map(one, (m_slices, jnp.asarray(digests, jnp.uint32))).reshape(m.shape)


def _blend(m: jax.Array, d: jax.Array, b1: jax.Array | float) -> jax.Array:
    """The first moment's update: β₁·M + (1 − β₁)·D."""
    return b1 * m + (1.0 - b1) * d


@functools.partial(jax.jit, static_argnums=0)
def _carry_and_blend(draw: _Draw, m: jax.Array, d: jax.Array, b1: jax.Array, old_step: jax.Array,
                     new_step: jax.Array, digests: jax.Array) -> jax.Array:
    """β₁·M·T + (1 − β₁)·D when the draw step changed (the transfer of the module docstring), else β₁·M + (1 − β₁)·D.
    The blend is inside both branches, so the cond's result is the new state itself: a cond around the transfer
    alone returns a second full-size M beside the state. Jitted whole, so that eager use compiles once per target
    geometry."""
    return jax.lax.cond(old_step != new_step, lambda m: _blend(_transfer(draw, m, old_step, new_step, digests), d, b1),
                        lambda m: _blend(m, d, b1), m)


def _momentum_of(tree: dict[str, Any], keys: tuple[str, ...], path: str) -> jax.Array:
    node: Any = tree
    for key in keys:
        if not isinstance(node, dict) or key not in node:
            raise ValueError(f"scale_by_subspace_momentum: no momentum for target {path!r}; was the state "
                             "initialised with the same parameters?")
        node = node[key]
    return node.astype(jnp.float32)


def scale_by_subspace_momentum(b1: float = 0.9, rank: int = SketchSpec.rank,
                               rules: tuple[TargetRule, ...] = DEFAULT_TARGET_RULES, *,
                               rank_rules: str | Sequence[RankRule] = ()) -> optax.GradientTransformationExtraArgs:
    """A first moment of each low-rank factor, carried across projection changes (module docstring).

      M ← β₁ · transfer(M) + (1 − β₁) · D_t,   out = M / (1 − β₁^τ)

    Acts on LowRankUpdate leaves (place after `scale_by_row_adam`, before the step size); other leaves pass
    through. The projections come from each update's own SketchSpec; one `basis` (the draw step M is expressed
    in) serves every target, so all updates must share the projection schedule (`refresh`, `refresh_every`) and
    carry the one step of the sketch stage that made them.

    Args:
      b1: β₁ in [0, 1); 0 passes D through unchanged (the state then holds the last D).
      rank: the sketch rank r (static; must equal the updates' rank).
      rules: the TargetRule sequence of the sketch (init finds the targets in the params with it).
      rank_rules: the sketch's rank rules (RankRules or "pattern=rank, ..."): a target a rule matches has that
        rule's rank instead of `rank` (`SketchSpec.rank_for`).

    Returns:
      An optax.GradientTransformationExtraArgs with SubspaceMomentumState (M (*batch, *rows, r) float32 per
      target, placed like the weight rows when init gets concretely sharded parameters).

    Raises:
      ValueError: b1 outside [0, 1); at update, a target without momentum, an update of another rank, or updates
        whose specs schedule their projections differently (refresh, refresh_every; both targets named).
      TypeError: a rank that is not a positive int.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from logra_jax.optim.sketch import scale_by_sketch
      >>> params = {"q_proj": {"kernel": jnp.ones((8, 4))}}
      >>> tx = optax.chain(scale_by_sketch(rank=2), scale_by_subspace_momentum(0.9, rank=2))
      >>> updates, state = tx.update(params, tx.init(params))
      >>> state[1].first_moment["q_proj"]["kernel"].shape
      (4, 2)
    """
    if isinstance(b1, (int, float)) and not 0 <= b1 < 1:
        raise ValueError(f"scale_by_subspace_momentum: b1 must be in [0, 1), got {b1!r}")
    ranks = SketchSpec(rank=rank, rules=rules, rank_rules=rank_rules)  # validated like every sketch's ranks
    rules = ranks.rules

    def init_fn(params: Any) -> SubspaceMomentumState:
        targets = find_targets(params, rules)
        moments = {}
        for keypath, weight in jax.tree_util.tree_flatten_with_path(params)[0]:
            t = targets.get(path_str(keypath))
            if t is not None:
                zeros = jnp.zeros((*t.batch_shape, *t.rows_shape, ranks.rank_for(t.path)), jnp.float32)
                moments[t.keys] = place_rows(zeros, t, weight)
        # two buffers, not one array twice: a train step donates its state leaf by leaf
        count, basis = (place_replicated(jnp.zeros((), jnp.int32), params) for _ in range(2))
        return SubspaceMomentumState(count=count, basis=basis, first_moment=_nest(moments))

    def update_fn(updates: Any, state: SubspaceMomentumState, params: Any = None, **extra_args: Any
                  ) -> tuple[Any, SubspaceMomentumState]:
        del params, extra_args
        new_moments: dict[tuple[str, ...], jax.Array] = {}
        bases: list[jax.Array] = []
        schedules: dict[tuple[bool, int], str] = {}  # (refresh, refresh_every) → the first target with it
        correction = 1.0 - jnp.power(jnp.asarray(b1, jnp.float32), (state.count + 1).astype(jnp.float32))

        def one(u: Any) -> Any:
            if not isinstance(u, LowRankUpdate):
                return u
            u.check_step()
            if u.rank != ranks.rank_for(u.target.path):
                raise ValueError(f"scale_by_subspace_momentum: update for {u.target.path} has rank {u.rank}, "
                                 f"this stage was built with rank={ranks.rank_for(u.target.path)} for it")
            schedules.setdefault((u.spec.refresh, u.spec.refresh_every), u.target.path)
            if len(schedules) > 1:
                (first, path), (other, _) = schedules.items()
                raise ValueError(f"scale_by_subspace_momentum: one basis serves every target, but {path!r} has "
                                 f"(refresh, refresh_every) = {first} and {u.target.path!r} {other}")
            m = _momentum_of(state.first_moment, u.target.keys, u.target.path)
            basis = u.spec.draw_step(u.step)
            spec, t = u.spec, u.target
            draw = (t.geometry, spec.base_seed, u.rank, spec.distribution)
            d = u.factor.astype(jnp.float32)
            if spec.refresh:  # M ← β₁·transfer(M) + (1 − β₁)·D
                m = _carry_and_blend(draw, m, d, jnp.asarray(b1, jnp.float32), jnp.asarray(state.basis, jnp.int32),
                                     basis, digest_words(t.slice_paths))
            else:  # one fixed projection: nothing to transfer, ever
                m = _blend(m, d, b1)
            new_moments[u.target.keys] = m
            bases.append(basis)
            return u.replace(factor=m / correction)

        out = jax.tree.map(one, updates, is_leaf=is_lowrank)
        moments = {path_keys(kp): v for kp, v in jax.tree_util.tree_flatten_with_path(state.first_moment)[0]}
        moments.update(new_moments)
        basis = bases[0] if bases else state.basis
        return out, SubspaceMomentumState(count=optax.safe_increment(state.count), basis=basis,
                                          first_moment=_nest(moments))

    return mark_lowrank_aware(optax.GradientTransformationExtraArgs(init_fn, update_fn))
