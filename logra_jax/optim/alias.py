"""logra(...): the LoGRA optimizer as one optax GradientTransformation (LOGRA.md §1–§4).

  targets:      chain(scale_by_sketch, scale_by_row_adam, <step size>, [scale_by_predicted_kl], negation)
                  paper / sgd: <step size> = scale_by_update_ratio(update_ratio), negation = scale_lowrank(−1)
                  nemo:        add_decayed_weights_lowrank(weight_decay), scale_lowrank(−lr)
  non-targets:  non_target_tx (default optax.set_to_zero(): frozen, the paper's recipe)
routed by optax.partition with labels "logra" / "non_target" from the target rules. Updates of targets are
LowRankUpdate leaves: merge them with `logra_jax.optim.apply_updates`, not optax.apply_updates.
Keyword extra args given to `update` reach every transform in the chain: with `kl_control`, the predicted-KL
step control (LOGRA.md §5) sits just before the negation and takes `kl_probe=` / `kl_prediction=`.
`implementation="pallas"` runs RowAdam's row moment and the merge through the Pallas kernels of logra_jax.kernels
(pair it with `SketchSpec(implementation="pallas")` in sketch-native mode); "xla" is the default everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax

from logra_jax.kernels.backend import Implementation
from logra_jax.optim.lowrank import is_lowrank
from logra_jax.optim.lowrank_scale import add_decayed_weights_lowrank, scale_lowrank
from logra_jax.optim.predicted_kl import scale_by_predicted_kl
from logra_jax.optim.projection import Distribution
from logra_jax.optim.row_adam import Variant, scale_by_row_adam
from logra_jax.optim.sketch import scale_by_sketch
from logra_jax.optim.targets import DEFAULT_TARGET_RULES, TargetRule, check_rules, match_target, path_keys
from logra_jax.optim.update_ratio import scale_by_update_ratio

TARGET_LABEL = "logra"
NON_TARGET_LABEL = "non_target"
# Each variant's own wire format for the merged factor: the paper's code ships bf16, NeMo merges in fp32.
ROUND_BF16_BY_VARIANT: dict[str, bool] = {"paper": True, "sgd": True, "nemo": False}


def resolve_round_bf16(round_bf16: bool | None, variant: str) -> bool:
    """`round_bf16` as a bool; None means the variant's own convention (ROUND_BF16_BY_VARIANT).

    Raises:
      ValueError: an unknown variant.
      TypeError: round_bf16 neither a bool nor None.

    Example:
      >>> resolve_round_bf16(None, "paper"), resolve_round_bf16(None, "nemo"), resolve_round_bf16(True, "nemo")
      (True, False, True)
    """
    if variant not in ROUND_BF16_BY_VARIANT:
        raise ValueError(f"logra: variant must be one of {tuple(ROUND_BF16_BY_VARIANT)}, got {variant!r}")
    if round_bf16 is None:
        return ROUND_BF16_BY_VARIANT[variant]
    if not isinstance(round_bf16, (bool, np.bool_)):
        raise TypeError(f"logra: round_bf16 must be a bool or None (the variant's convention), got {round_bf16!r}")
    return bool(round_bf16)


def target_labels(tree: Any, rules: Sequence[TargetRule] = DEFAULT_TARGET_RULES) -> Any:
    """"logra" for target leaves (or LowRankUpdate leaves), "non_target" elsewhere: labels for optax.partition.

    Example:
      >>> import jax.numpy as jnp
      >>> target_labels({"q_proj": {"kernel": jnp.zeros((2, 2))}, "norm": jnp.zeros(2)})
      {'norm': 'non_target', 'q_proj': {'kernel': 'logra'}}
    """
    rules = check_rules(rules)

    def label(keypath: Any, leaf: Any) -> str:
        if is_lowrank(leaf):
            return TARGET_LABEL
        keys = path_keys(keypath)
        hit = match_target(".".join(keys), keys, jax.numpy.shape(leaf), rules)
        return NON_TARGET_LABEL if hit is None else TARGET_LABEL

    return jax.tree_util.tree_map_with_path(label, tree, is_leaf=is_lowrank)


def logra(rank: int = 256, *, base_seed: int = 42, distribution: Distribution = "rademacher", refresh: bool = True,
          variant: Variant = "paper", b2: float = 0.95, eps: float = 1e-8, update_ratio: float = 6e-5,
          ratio_scope: str = "global",
          lr: float | optax.Schedule | None = None, weight_decay: float = 0.0,
          rules: Sequence[TargetRule] = DEFAULT_TARGET_RULES,
          non_target_tx: optax.GradientTransformation | None = None,
          round_bf16: bool | None = None,
          kl_control: Mapping[str, Any] | None = None,
          implementation: Implementation = "xla", interpret: bool = False) -> optax.GradientTransformationExtraArgs:
    """LoGRA: sketch → RowAdam → global step size → negation on targets; non-targets frozen or any optax tx.

    Per target layer l (LOGRA.md): S_l = G_l A_lᵀ; D_l = RowAdam(S_l);
      paper/sgd: W_l ← W_l − bf16(factor · D_l) A_l, factor = update_ratio · sqrt(Σ‖W‖² / Σ‖D A‖²)
      nemo:      W_l ← (1 − lr·wd) W_l − lr · D_l A_l
    bf16(·): the factor rounded at merge time when round_bf16, by default for paper/sgd (their wire format) and
    not for nemo (NeMo merges the fp32 factor). Apply with `logra_jax.optim.apply_updates`.

    Args:
      rank: sketch rank r (static).
      base_seed: projection base seed (static).
      distribution: "rademacher" or "gaussian".
      refresh: fresh projections every step (True) or those of step 0 (False).
      variant: "paper", "nemo" or "sgd" (see scale_by_row_adam).
      b2: RowAdam β₂.
      eps: RowAdam ε (relative for paper, absolute for nemo).
      update_ratio: update-to-weight norm ratio (paper and sgd variants).
      ratio_scope: "global" (the paper's: one ratio over all targets together) or "layer" (each layer moves by
        update_ratio of its own norm; see scale_by_update_ratio).
      lr: learning rate or schedule (nemo variant only; required there).
      weight_decay: decoupled weight decay λ (nemo variant only).
      rules: TargetRule sequence choosing the targets.
      non_target_tx: transformation for non-target parameters; None freezes them (optax.set_to_zero()).
      round_bf16: round the final factor to bf16 when merging; None (default): the variant's own convention,
        bf16 for paper and sgd (the paper's wire format), fp32 for nemo (NeMo merges the fp32 factor).
      kl_control: None, or keyword arguments of `scale_by_predicted_kl` ({} for its defaults) to scale each step
        to a predicted-KL budget; `update` then needs `kl_probe=fn(updates)` or `kl_prediction=(q_sum, count)`.
      implementation: "xla" or "pallas": the kernels of RowAdam's row moment (`kernels.row_moment`) and of the
        merge done by `apply_updates` (`kernels.merge`, carried on each LowRankUpdate).
      interpret: Pallas only: run the kernels in the Pallas interpreter (required on CPU).

    Returns:
      An optax.GradientTransformationExtraArgs (an optax.partition; extra args flow to every transform).

    Raises:
      ValueError/TypeError: invalid hyperparameters, round_bf16 or implementation, lr missing for nemo or given for
        paper/sgd, weight_decay for paper/sgd; at init, no target in the params.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from logra_jax.optim import apply_updates
      >>> params = {"mlp": {"up_proj": {"kernel": jnp.ones((8, 16))}}, "norm": jnp.ones(8)}
      >>> tx = logra(rank=4, update_ratio=1e-3)
      >>> state = tx.init(params)
      >>> grads = jax.tree.map(jnp.ones_like, params)
      >>> updates, state = tx.update(grads, state, params)
      >>> new = apply_updates(params, updates)
      >>> bool((new["norm"] == params["norm"]).all())
      True
    """
    rules = check_rules(rules)
    round_bf16 = resolve_round_bf16(round_bf16, variant)
    if variant == "nemo":
        if lr is None:
            raise ValueError("logra: variant='nemo' needs a learning rate lr")
        step_size = [add_decayed_weights_lowrank(weight_decay)]
        negation = scale_lowrank((lambda n: -lr(n)) if callable(lr) else -lr)
    else:
        if lr is not None:
            raise ValueError(f"logra: lr is only used by variant='nemo', got lr={lr!r} with variant={variant!r}")
        if isinstance(weight_decay, (int, float)) and weight_decay != 0:
            raise ValueError(f"logra: weight_decay is only used by variant='nemo', got {weight_decay!r} with "
                             f"variant={variant!r}")
        step_size = [scale_by_update_ratio(update_ratio, scope=ratio_scope)]
        negation = scale_lowrank(-1.0)
    if kl_control is not None:
        step_size.append(scale_by_predicted_kl(**kl_control))
    target_tx = optax.chain(
        scale_by_sketch(rank, base_seed, distribution, refresh, rules, round_bf16, implementation=implementation,
                        interpret=interpret),
        scale_by_row_adam(variant, b2, eps, rules, implementation=implementation, interpret=interpret),
        *step_size,
        negation,
    )
    frozen = optax.set_to_zero() if non_target_tx is None else non_target_tx
    return optax.partition({TARGET_LABEL: target_tx, NON_TARGET_LABEL: frozen},
                           lambda tree: target_labels(tree, rules))
