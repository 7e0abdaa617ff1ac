"""The optimizer choices of a run, as optax transformations plus what the train step needs to drive them.

  adamw      optax.adamw on every parameter (dense gradients; the memory baseline), or with targets_only on
             exactly LoGRA's targets (the rest frozen: the like-for-like baseline).
  adafactor  optax.adafactor on every parameter (factored second moments).
  galore  optax.contrib GaLore (Adam inside, rank r) on each layer of the stacked target kernels, AdamW elsewhere.
  logra   logra_jax.optim.logra on the targets (dense-gradient or sketch-native), non-targets frozen (the paper's
          recipe; an MoE's routers included), AdamW, or AdamW on the MoE routers alone (non_targets="router"),
          optionally with a sketch-space momentum (optimizer.momentum, refresh_every) and predicted-KL step control.
  row_adam   LoGRA's RowAdam and update ratio on the targets' dense gradients, no sketch (the ablation that
             separates sketching from the row-wise preconditioner); non-targets frozen.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import optax
from flax import nnx

from logra_jax.core.tree_paths import path_str
from logra_jax.job.run_config import OptimizerSection
from logra_jax.job.train_step import KLProbeConfig, Trainable, densely_trained
from logra_jax.models.decoder import cast_matrices
from logra_jax.native.sketch_probes import attach_sketch_probes
from logra_jax.optim import SketchSpec, logra
from logra_jax.optim.alias import NON_TARGET_LABEL, TARGET_LABEL, resolve_round_bf16, target_labels
from logra_jax.optim.dense_row_adam import scale_by_dense_row_adam
from logra_jax.optim.targets import DEFAULT_TARGET_RULES, Target, check_rank_fits, find_targets, parse_rank_rules

GALORE_UPDATE_GAP = 200
# An MoE router's kernel (`logra_jax.models.moe.MoE.router`): what non_targets="router" trains densely.
ROUTER_PATTERN = r"(^|\.)router\.kernel$"


def per_layer(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` applied to each slice of the leading (layers) axis on its own, one layer at a time (`lax.map`)."""
    def init(params):
        return jax.vmap(tx.init)(params)

    def update(updates, state, params=None):
        del params
        return jax.lax.map(lambda us: tx.update(us[0], us[1]), (updates, state))

    return optax.GradientTransformation(init, update)


def _adamw(cfg: OptimizerSection) -> optax.GradientTransformation:
    adamw = optax.adamw(cfg.learning_rate, b1=cfg.adam_b1, weight_decay=cfg.weight_decay)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw) if cfg.grad_clip else adamw


def is_router(path: tuple[Any, ...], _: Any = None) -> bool:
    """Whether the parameter at `path` (its key components) is an MoE router kernel."""
    return re.search(ROUTER_PATTERN, ".".join(map(str, path))) is not None


def _routers_only(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` on the MoE router kernels, every other leaf it is given frozen (optax.set_to_zero)."""
    labels = lambda tree: jax.tree_util.tree_map_with_path(
        lambda k, _: "router" if re.search(ROUTER_PATTERN, path_str(k)) else "frozen", tree)
    return optax.partition({"router": tx, "frozen": optax.set_to_zero()}, labels)


def _non_target_tx(cfg: OptimizerSection, model: nnx.Module) -> optax.GradientTransformation | None:
    """LoGRA's non_target_tx for `cfg.non_targets`: None (frozen), AdamW, or AdamW on the routers alone.

    Raises:
      ValueError: non_targets="router" on a model without an MoE router.
    """
    if cfg.non_targets == "frozen":
        return None
    if cfg.non_targets == "adamw":
        return _adamw(cfg)
    paths = [path_str(k) for k, _ in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))]
    if not any(re.search(ROUTER_PATTERN, p) for p in paths):
        raise ValueError(f"config.optimizer.non_targets = 'router': the model has no MoE router (no parameter "
                         f"matches {ROUTER_PATTERN!r})")
    return _routers_only(_adamw(cfg))


def _targets_and_rest(target_tx: optax.GradientTransformation, other_tx: optax.GradientTransformation
                      ) -> optax.GradientTransformation:
    """`target_tx` on LoGRA's default targets, `other_tx` on every other parameter (optax.partition)."""
    return optax.partition({TARGET_LABEL: target_tx, NON_TARGET_LABEL: other_tx},
                           lambda tree: target_labels(tree, DEFAULT_TARGET_RULES))


@dataclasses.dataclass(frozen=True)
class OptimizerPlan:
    """tx plus how the train step must run it (see logra_jax.job.train_step.make_train_step); targets: LoGRA's
    targets by path (what policy sync ships as low-rank factors), None for the dense optimizers. The sketch
    settings are not repeated here: they live in tx's SketchSpec (`logra_jax.optim.sketch_spec` of its state)."""

    tx: optax.GradientTransformation
    mode: str = "dense"
    trainable: Trainable | None = None
    targets: dict[str, Target] | None = None
    kl_probe: KLProbeConfig | None = None

    def dense_paths(self, params: Any) -> list[str]:
        """Paths of the parameters updated densely (what policy sync ships besides low-rank factors)."""
        paths = [path_str(k) for k, _ in jax.tree_util.tree_leaves_with_path(params)]
        low_rank, trained = set(self.targets or ()), densely_trained(self.mode, self.trainable)
        return [p for p in paths if p not in low_rank and trained(tuple(p.split(".")))]


def store_weights(model: nnx.Module, dtype: str) -> None:
    """Store the decoder's matrices (kernels, embeddings) in `dtype` from here on, in place, and say so in its
    config (`param_dtype`: the rollout engine builds its copy from it); norm scales and biases stay float32.
    With bfloat16 LoGRA's merge rounds stochastically (`logra_jax.optim.lowrank.LowRankUpdate.merge`), so small
    steps survive on average."""
    cast_matrices(model, dtype)
    model.config = model.config.replace(param_dtype=dtype)


def check_optimizer_fits(cfg: OptimizerSection, model: nnx.Module) -> None:
    """Fail fast (before the SFT warm start and any compilation) when the optimizer cannot run on `model`:
    LoGRA's rank must fit every target's width, and each of `optimizer.rank_rules` give some target its rank
    (the error names the field, the rule, the layer and its width).

    Raises:
      ValueError: no target matches, a target's rank (`optimizer.rank`, or its rank rule's) exceeds its width, or
        a rank rule gives no target its rank.
    """
    if cfg.name != "logra":
        return
    targets = find_targets(nnx.state(model, nnx.Param), DEFAULT_TARGET_RULES)
    try:
        check_rank_fits(targets, cfg.rank, parse_rank_rules(cfg.rank_rules))
    except ValueError as e:
        field = (f"config.optimizer.rank_rules = {cfg.rank_rules!r}" if str(e).startswith("rank rule ") else
                 f"config.optimizer.rank = {cfg.rank}")
        raise ValueError(f"{field}: {e}") from e


def build_optimizer(cfg: OptimizerSection, model: nnx.Module, *, temperature: float = 1.0) -> OptimizerPlan:
    """The transformation and step settings for `cfg`; attaches sketch probes to `model` when LoGRA needs them
    (sketch-native mode, or predicted-KL probing which injects tangents through the same hooks)."""
    if cfg.name == "adamw" and not cfg.targets_only:
        return OptimizerPlan(_adamw(cfg))
    if cfg.name == "adafactor":
        return OptimizerPlan(optax.adafactor(cfg.learning_rate))
    targets = find_targets(nnx.state(model, nnx.Param), DEFAULT_TARGET_RULES)  # none is an error naming the rules
    is_target = lambda path, _: ".".join(map(str, path)) in targets
    if cfg.name in ("adamw", "row_adam"):  # dense gradients of the targets only, the rest frozen
        tx = _adamw(cfg) if cfg.name == "adamw" else optax.chain(
            scale_by_dense_row_adam(cfg.update_ratio, b2=cfg.b2, eps=cfg.eps), optax.scale(-1.0))
        return OptimizerPlan(_targets_and_rest(tx, optax.set_to_zero()), trainable=is_target)
    if cfg.name == "galore":
        galore = per_layer(optax.contrib.scale_by_galore(rank=cfg.rank, update_proj_gap=GALORE_UPDATE_GAP,
                                                         base_optimizer=optax.scale_by_adam()))
        galore = optax.chain(galore, optax.add_decayed_weights(cfg.weight_decay), optax.scale(-cfg.learning_rate))
        return OptimizerPlan(_targets_and_rest(galore, optax.adamw(cfg.learning_rate, weight_decay=cfg.weight_decay)))
    if cfg.weight_dtype != "float32":
        store_weights(model, cfg.weight_dtype)
    non_target_tx = _non_target_tx(cfg, model)
    # The one declaration of the sketch settings: logra and the model's sketch probes take this same object.
    spec = SketchSpec(rank=cfg.rank, rank_rules=cfg.rank_rules, base_seed=cfg.base_seed,
                      distribution=cfg.distribution, refresh=cfg.refresh,
                      refresh_every=cfg.refresh_every,
                      round_bf16=resolve_round_bf16(cfg.round_bf16, cfg.variant),
                      implementation=cfg.implementation, interpret=cfg.interpret,
                      stochastic_round=cfg.weight_dtype != "float32")
    kl = None
    if cfg.kl_control:
        kl = dict(kl_budget=cfg.kl_budget, kl_budget_final=cfg.kl_budget_final,
                  schedule_steps=cfg.kl_schedule_steps, alpha_max=cfg.alpha_max,
                  subtract_mismatch=cfg.subtract_mismatch)
    tx = logra(spec=spec, variant=cfg.variant, b2=cfg.b2, eps=cfg.eps, momentum=cfg.momentum,
               update_ratio=cfg.update_ratio, ratio_scope=cfg.ratio_scope,
               lr=cfg.learning_rate if cfg.variant == "nemo" else None,
               weight_decay=cfg.weight_decay if cfg.variant == "nemo" else 0.0,
               non_target_tx=non_target_tx, kl_control=kl)
    if cfg.sketch_native:  # trainable = the non-targets trained densely
        trainable = {"frozen": None, "adamw": lambda path, v: not is_target(path, v), "router": is_router}[
            cfg.non_targets]
    else:  # trainable = everything that gets a dense gradient
        trainable = {"frozen": is_target, "adamw": None,
                     "router": lambda path, v: is_target(path, v) or is_router(path)}[cfg.non_targets]
    if cfg.sketch_native or cfg.kl_control:
        attach_sketch_probes(model, spec)
    kl_probe = KLProbeConfig(temperature=temperature, undo_above=cfg.kl_undo_above) if cfg.kl_control else None
    return OptimizerPlan(tx, mode="sketch_native" if cfg.sketch_native else "dense", trainable=trainable,
                         targets=targets, kl_probe=kl_probe)
