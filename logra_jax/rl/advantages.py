"""Advantage estimators (per-response advantages from scalar rewards), selected by name, and dynamic sampling.

Rewards come flat as [B·n], group-contiguous: row b·n + j is sample j of prompt b (the sampler's layout).
With group g = {r_1..r_n}, mean r̄_g, unbiased std s_g, batch mean r̄ and std s:
  grpo          A_i = (r_i − r̄_g) / (s_g + ε)                                      (DeepSeekMath; n ≥ 2)
  dr_grpo       A_i = r_i − r̄_g                                                    (Dr. GRPO: no std division)
  rloo          A_i = r_i − (Σ_{j≠i} r_j)/(n − 1) = n/(n − 1) · (r_i − r̄_g)         (leave-one-out; n ≥ 2)
  reinforce     A_i = r_i − b_k, with b_k = EMA of the mean rewards of earlier batches:
                b_1 = r̄_batch(0), b_{k+1} = (1 − m) b_k + m r̄_batch(k), b for the first batch = 0
                (docs/method.md §7: single response, m = 0.1)
  reinforce++   A_i = (r_i − r̄) / (s + ε) over the whole batch (REINFORCE++ global normalisation; with
                group_baseline the group mean is subtracted first: REINFORCE++-baseline). Mean and std are
                over responses by default; whiten="token" weights each response by its length, as verl does
Every estimator is an `AdvantageEstimator(init, update)` pair (optax style): `update(rewards, state)` returns
(advantages, new_state); stateless estimators carry an empty state. Unknown names raise ValueError.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


def _groups(rewards: jax.Array, group_size: int) -> jax.Array:
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 1 or rewards.shape[0] % group_size:
        raise ValueError(f"advantages: rewards must be [B·n] with n = group_size = {group_size}, got shape "
                         f"{rewards.shape}")
    return rewards.reshape(-1, group_size)


def _centred(g: jax.Array) -> jax.Array:
    """g − mean over the last axis, shifted by the first entry first so equal entries centre to exactly 0 (a plain
    float32 mean can round off the common value, and std normalisation would amplify that residue)."""
    d = g - g[..., :1]
    return d - d.mean(axis=-1, keepdims=True)


def _check_group_size(group_size: int, minimum: int, name: str) -> None:
    if not isinstance(group_size, int) or group_size < minimum:
        raise ValueError(f"{name}: group_size must be an integer >= {minimum}, got {group_size!r}")


def grpo_advantages(rewards: jax.Array, group_size: int, *, eps: float = 1e-6) -> jax.Array:
    """A_i = (r_i − mean_g) / (std_g + ε), std unbiased (ddof 1); a group of equal rewards gets A = 0.

    Example:
      >>> grpo_advantages(jnp.array([1.0, 0.0, 0.5, 0.5]), 2).round(4)
      Array([ 0.7071, -0.7071,  0.    ,  0.    ], dtype=float32)
    """
    _check_group_size(group_size, 2, "grpo_advantages")
    centred = _centred(_groups(rewards, group_size))
    std = jnp.sqrt(jnp.sum(centred**2, axis=1, keepdims=True) / (group_size - 1))
    return (centred / (std + eps)).reshape(-1)


def dr_grpo_advantages(rewards: jax.Array, group_size: int) -> jax.Array:
    """A_i = r_i − mean_g (Dr. GRPO drops the std normalisation).

    Example:
      >>> dr_grpo_advantages(jnp.array([1.0, 0.0, 0.0, 0.0]), 4)
      Array([ 0.75, -0.25, -0.25, -0.25], dtype=float32)
    """
    _check_group_size(group_size, 1, "dr_grpo_advantages")
    return _centred(_groups(rewards, group_size)).reshape(-1)


def rloo_advantages(rewards: jax.Array, group_size: int) -> jax.Array:
    """A_i = r_i − mean of the other n − 1 rewards of the group.

    Example:
      >>> rloo_advantages(jnp.array([1.0, 0.0, 0.0]), 3)
      Array([ 1. , -0.5, -0.5], dtype=float32)
    """
    _check_group_size(group_size, 2, "rloo_advantages")
    d = _groups(rewards, group_size)
    d = d - d[:, :1]  # shift-invariant; equal rewards give exactly 0
    others = (d.sum(axis=1, keepdims=True) - d) / (group_size - 1)
    return (d - others).reshape(-1)


WHITENINGS: tuple[str, ...] = ("response", "token")


def reinforce_pp_advantages(rewards: jax.Array, group_size: int = 1, *, group_baseline: bool = False,
                            eps: float = 1e-6, whiten: str = "response", lengths: jax.Array | None = None
                            ) -> jax.Array:
    """A_i = (x_i − μ) / (σ + ε) over the batch, x = r (or r − mean_g with group_baseline), with weights w_i:

      μ = Σ w_i x_i,  σ² = Σ w_i (x_i − μ)²      (population variance: a whitening step)
      whiten="response" (default): w_i = 1/N, every response counts once
      whiten="token":              w_i = L_i / Σ_j L_j, every response token counts once (verl's masked_whiten of
                                   the response-broadcast returns; verl also applies Bessel's correction over
                                   tokens and adds 1e-8 to σ², which differ negligibly at thousands of tokens)

    Args:
      rewards: [B·n] rewards, group-contiguous.
      group_size: n.
      group_baseline: subtract each group's mean first (REINFORCE++-baseline).
      eps: ε added to σ.
      whiten: "response" or "token".
      lengths: [B·n] response lengths L_i (tokens); required by whiten="token" and only used there.

    Raises:
      ValueError: an unknown `whiten`, `lengths` missing for "token" (or given for "response"), or of the wrong
        shape.

    Example:
      >>> reinforce_pp_advantages(jnp.array([1.0, 0.0])).round(4)
      Array([ 1., -1.], dtype=float32)
      >>> a = reinforce_pp_advantages(jnp.array([1.0, 0.0]), whiten="token", lengths=jnp.array([3, 1]))
      >>> [round(float(x), 3) for x in a]  # μ = 0.75, σ = sqrt(0.1875)
      [0.577, -1.732]
    """
    _check_group_size(group_size, 1, "reinforce_pp_advantages")
    if whiten not in WHITENINGS:
        raise ValueError(f"reinforce_pp_advantages: whiten must be one of {WHITENINGS}, got {whiten!r}")
    if (lengths is None) == (whiten == "token"):
        raise ValueError(f"reinforce_pp_advantages: lengths is required by whiten='token' and only used there, "
                         f"got whiten={whiten!r} with lengths={'None' if lengths is None else 'given'}")
    x = dr_grpo_advantages(rewards, group_size) if group_baseline else _groups(rewards, group_size).reshape(-1)
    if lengths is None:
        weights = jnp.full(x.shape, 1.0 / x.shape[0], jnp.float32)
    else:
        lengths = jnp.asarray(lengths, jnp.float32)
        if lengths.shape != x.shape:
            raise ValueError(f"reinforce_pp_advantages: lengths must be [B·n] = {x.shape}, got {lengths.shape}")
        weights = lengths / jnp.maximum(lengths.sum(), 1.0)
    d = x - x[:1]  # shift first, as _centred: equal values centre to exactly 0
    centred = d - jnp.sum(weights * d)
    return centred / (jnp.sqrt(jnp.sum(weights * centred**2)) + eps)


class BaselineState(NamedTuple):
    """Running baseline b (float32 scalar) and the number of batches folded into it (int32 scalar)."""

    baseline: jax.Array
    count: jax.Array


def init_baseline() -> BaselineState:
    """The state before any batch: no baseline yet (the first batch is scored against b = 0)."""
    return BaselineState(baseline=jnp.zeros((), jnp.float32), count=jnp.zeros((), jnp.int32))


def reinforce_advantages(rewards: jax.Array, state: BaselineState, *, momentum: float = 0.1
                         ) -> tuple[jax.Array, BaselineState]:
    """A_i = r_i − b (b from earlier batches only), then b ← (1 − m) b + m · mean(r) (b ← mean(r) at first).

    Example:
      >>> adv, state = reinforce_advantages(jnp.array([1.0, 0.0]), init_baseline())
      >>> adv, reinforce_advantages(jnp.array([1.0, -0.01]), state)[0]
      (Array([1., 0.], dtype=float32), Array([ 0.5 , -0.51], dtype=float32))
    """
    if not 0 < momentum <= 1:
        raise ValueError(f"reinforce_advantages: momentum must be in (0, 1], got {momentum!r}")
    r = _groups(rewards, 1).reshape(-1)
    advantages = r - state.baseline
    mean = r.mean()
    baseline = jnp.where(state.count > 0, (1.0 - momentum) * state.baseline + momentum * mean, mean)
    return advantages, BaselineState(baseline=baseline.astype(jnp.float32), count=state.count + 1)


class AdvantageEstimator(NamedTuple):
    """init() → state;  update(rewards [B·n], state) → (advantages [B·n], new state)."""

    init: Callable[[], Any]
    update: Callable[[jax.Array, Any], tuple[jax.Array, Any]]


def _stateless(fn: Callable[[jax.Array], jax.Array]) -> AdvantageEstimator:
    return AdvantageEstimator(init=lambda: (), update=lambda rewards, state: (fn(rewards), state))


def _grpo(group_size: int, eps: float = 1e-6) -> AdvantageEstimator:
    _check_group_size(group_size, 2, "grpo")
    return _stateless(functools.partial(grpo_advantages, group_size=group_size, eps=eps))


def _dr_grpo(group_size: int) -> AdvantageEstimator:
    _check_group_size(group_size, 1, "dr_grpo")
    return _stateless(functools.partial(dr_grpo_advantages, group_size=group_size))


def _rloo(group_size: int) -> AdvantageEstimator:
    _check_group_size(group_size, 2, "rloo")
    return _stateless(functools.partial(rloo_advantages, group_size=group_size))


def _reinforce(group_size: int = 1, momentum: float = 0.1) -> AdvantageEstimator:
    _check_group_size(group_size, 1, "reinforce")
    return AdvantageEstimator(init=init_baseline,
                              update=functools.partial(reinforce_advantages, momentum=momentum))


def _reinforce_pp(group_size: int = 1, group_baseline: bool = False, eps: float = 1e-6,
                  whiten: str = "response") -> AdvantageEstimator:
    """whiten="token" needs the response lengths at each update: `update(rewards, state, lengths=L)`."""
    _check_group_size(group_size, 1, "reinforce++")
    if whiten not in WHITENINGS:
        raise ValueError(f"reinforce++: whiten must be one of {WHITENINGS}, got {whiten!r}")
    fn = functools.partial(reinforce_pp_advantages, group_size=group_size, group_baseline=group_baseline, eps=eps,
                           whiten=whiten)
    return AdvantageEstimator(init=lambda: (),
                              update=lambda rewards, state, lengths=None: (fn(rewards, lengths=lengths), state))


ESTIMATORS: dict[str, Callable[..., AdvantageEstimator]] = {
    "grpo": _grpo,
    "dr_grpo": _dr_grpo,
    "rloo": _rloo,
    "reinforce": _reinforce,
    "reinforce++": _reinforce_pp,
}


def advantage_estimator(name: str, *, group_size: int, **hparams: Any) -> AdvantageEstimator:
    """The estimator registered as `name`, built for groups of `group_size` responses per prompt.

    Args:
      name: one of ESTIMATORS ("grpo", "dr_grpo", "rloo", "reinforce", "reinforce++").
      group_size: n, responses per prompt.
      **hparams: estimator options (grpo: eps; reinforce: momentum; reinforce++: group_baseline, eps, whiten —
        with whiten="token" its update takes the response lengths: `update(rewards, state, lengths=L)`).

    Raises:
      ValueError: for an unknown name (listing the known ones) or an invalid group size.
      TypeError: for an option the estimator does not take.

    Example:
      >>> est = advantage_estimator("rloo", group_size=2)
      >>> est.update(jnp.array([1.0, 0.0]), est.init())[0]
      Array([ 1., -1.], dtype=float32)
    """
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; known: {sorted(ESTIMATORS)}")
    return ESTIMATORS[name](group_size=group_size, **hparams)


def dynamic_sampling_mask(rewards: jax.Array, group_size: int, *, atol: float = 0.0) -> jax.Array:
    """[B·n] bool: True for rows whose group's rewards are not all equal (max − min > atol).

    Dynamic sampling (DAPO) drops groups with zero reward variance: they carry no group-relative signal. Use the
    mask to select rows on the host (`rows[np.asarray(mask)]`) or to zero their loss mask under jit.

    Example:
      >>> dynamic_sampling_mask(jnp.array([1.0, 1.0, 0.0, 1.0]), 2)
      Array([False, False,  True,  True], dtype=bool)
    """
    _check_group_size(group_size, 1, "dynamic_sampling_mask")
    g = _groups(rewards, group_size)
    keep = (g.max(axis=1) - g.min(axis=1)) > atol
    return jnp.repeat(keep, group_size)
