"""LoGRA as composable optax transformations (dense-gradient mode; docs/method.md §1–§4).

  tx = logra(rank=256)                                  # or logra(spec=SketchSpec(...)), or chain the pieces
  updates, state = tx.update(grads, state, params)
  params = apply_updates(params, updates)               # merges W ← W − U·A layer by layer

  tx = logra(rank=256, momentum=0.9, refresh_every=16)  # + a first moment carried across projection changes
  tx = logra(rank=256, dense_updates=True)              # drop-in: dense ΔW = U·A formed inside the update,
  params = optax.apply_updates(params, updates)         # so optax.apply_updates / nnx.Optimizer work unchanged

Seed plumbing (path digests, per-layer keys) stays in `logra_jax.optim.projection`; sketch-native mode and the
predicted-KL probe, which need a model, are in `logra_jax.native`.
"""

from logra_jax.core.tree_paths import path_keys, path_str
from logra_jax.optim.alias import NON_TARGET_LABEL, TARGET_LABEL, logra, target_labels
from logra_jax.optim.lowrank import (
    MISUSE_ADVICE,
    LowRankMeta,
    LowRankUpdate,
    apply_updates,
    is_lowrank,
    is_lowrank_aware,
    mark_lowrank_aware,
)
from logra_jax.optim.lowrank_scale import (
    add_decayed_weights_lowrank,
    clip_by_global_norm_lowrank,
    densify_lowrank,
    scale_lowrank,
)
from logra_jax.optim.momentum import SubspaceMomentumState, scale_by_subspace_momentum
from logra_jax.optim.predicted_kl import PredictedKLState, kl_budget_schedule, scale_by_predicted_kl
from logra_jax.optim.projection import DISTRIBUTIONS, projection, slice_projections, target_projection
from logra_jax.optim.row_adam import VARIANTS, RowAdamState, row_adam_direction, scale_by_row_adam
from logra_jax.optim.sketch import SketchState, scale_by_sketch
from logra_jax.optim.spec import SketchSpec, sketch_spec, state_targets
from logra_jax.optim.targets import (
    DEFAULT_TARGET_RULES,
    DeclaredTargets,
    MatrixDims,
    RankRule,
    Target,
    TargetRule,
    check_rank_fits,
    find_targets,
    match_target,
    parse_rank_rules,
)
from logra_jax.optim.update_ratio import scale_by_update_ratio, update_ratio_factor

__all__ = [
    "DEFAULT_TARGET_RULES",
    "DISTRIBUTIONS",
    "MISUSE_ADVICE",
    "NON_TARGET_LABEL",
    "TARGET_LABEL",
    "VARIANTS",
    "DeclaredTargets",
    "LowRankMeta",
    "LowRankUpdate",
    "MatrixDims",
    "PredictedKLState",
    "RankRule",
    "RowAdamState",
    "SketchSpec",
    "SketchState",
    "SubspaceMomentumState",
    "Target",
    "TargetRule",
    "add_decayed_weights_lowrank",
    "apply_updates",
    "check_rank_fits",
    "clip_by_global_norm_lowrank",
    "densify_lowrank",
    "find_targets",
    "is_lowrank",
    "is_lowrank_aware",
    "kl_budget_schedule",
    "logra",
    "mark_lowrank_aware",
    "match_target",
    "parse_rank_rules",
    "path_keys",
    "path_str",
    "projection",
    "row_adam_direction",
    "scale_by_predicted_kl",
    "scale_by_row_adam",
    "scale_by_sketch",
    "scale_by_subspace_momentum",
    "scale_by_update_ratio",
    "scale_lowrank",
    "sketch_spec",
    "slice_projections",
    "state_targets",
    "target_labels",
    "target_projection",
    "update_ratio_factor",
]
