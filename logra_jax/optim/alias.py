"""logra(...): the LoGRA optimizer as one optax GradientTransformation (docs/method.md §1–§4).

  targets:      named_chain(("sketch", scale_by_sketch), ("row_adam", scale_by_row_adam),
                            [("momentum", scale_by_subspace_momentum)], <step size>,
                            [("predicted_kl", scale_by_predicted_kl)], <negation>)
                  paper / sgd: ("update_ratio", scale_by_update_ratio(update_ratio)), ("negation", scale_lowrank(−1))
                  nemo:        ("weight_decay", add_decayed_weights_lowrank(weight_decay)),
                               ("learning_rate", scale_lowrank(−lr))
                the stages are addressable by name: optax.tree_utils.tree_get(state, "row_adam").row_moment
  non-targets:  non_target_tx (default optax.set_to_zero(): frozen, the paper's recipe)
routed by optax.partition with labels "logra" / "non_target" from the target rules. Updates of targets are
LowRankUpdate leaves: merge them with `logra_jax.optim.apply_updates`, not optax.apply_updates — or build
`logra(..., dense_updates=True)`, which ends with `densify_lowrank()` (dense float32 ΔW = U·A inside the same
update) so that optax.apply_updates and nnx.Optimizer work unchanged and give the same weights.

Misuse check (low-rank route only). A generic optax transform after logra would treat LowRankUpdate leaves as
floats (clip_by_global_norm fails inside lax.select, optax.scale silently turns `step` into a float). No
transform can see what follows it, but Python can: at trace time logra's update walks the interpreter frames
above it (sys._getframe). A frame running optax.chain's or optax.named_chain's update loop is recognised by its
code object (taken at import from `optax.chain(...).update.__code__`, not by name); its locals say which
transform of the loop is running (`len(new_state)` = its index, in `update_fns` / `transforms`), hence which one
follows. When logra (or whatever wraps it: inject_hyperparams, MultiSteps, partition) is last in that chain the
walk continues outward. The first successor found must be low-rank-aware (marked by `mark_lowrank_aware`, as are
scale_lowrank, add_decayed_weights_lowrank, clip_by_global_norm_lowrank, densify_lowrank; seen through optax's
extra-args wrapper, nested chains and inject_hyperparams), else a ValueError names it and says what to do. An
unrecognised frame layout (another optax version) makes the check a no-op: it is diagnostic only. The backstop
is at every consumer of a LowRankUpdate (`LowRankUpdate.check_step`: a non-int32 step or a mis-shaped factor
raises TypeError with the same advice), and `W + u` raises TypeError saying which merge to use.
Keyword extra args given to `update` reach every transform in the chain: with `kl_control`, the predicted-KL
step control (docs/method.md §5) sits just before the negation and takes `kl_probe=` / `kl_prediction=`.
`implementation="pallas"` runs RowAdam's row moment and the merge through the Pallas kernels of logra_jax.kernels
(in sketch-native mode build the SketchSpec once and give it to both `attach_sketch_probes` and `logra(spec=...)`);
"xla" is the default everywhere.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax

from logra_jax.core.tree_paths import path_keys
from logra_jax.kernels.backend import Implementation
from logra_jax.optim.lowrank import MISUSE_ADVICE, is_lowrank, is_lowrank_aware
from logra_jax.optim.lowrank_scale import (
    add_decayed_weights_lowrank,
    clip_by_global_norm_lowrank,
    densify_lowrank,
    scale_lowrank,
)
from logra_jax.optim.momentum import scale_by_subspace_momentum
from logra_jax.optim.predicted_kl import scale_by_predicted_kl
from logra_jax.optim.projection import Distribution
from logra_jax.optim.row_adam import Variant, scale_by_row_adam
from logra_jax.optim.sketch import scale_by_sketch
from logra_jax.optim.spec import SketchSpec, build_spec
from logra_jax.optim.targets import DEFAULT_TARGET_RULES, RankRule, TargetRule, check_rules, match_target
from logra_jax.optim.update_ratio import scale_by_update_ratio

TARGET_LABEL = "logra"
NON_TARGET_LABEL = "non_target"
# Each variant's own wire format for the merged factor: the paper's code ships bf16, NeMo merges in fp32.
ROUND_BF16_BY_VARIANT: dict[str, bool] = {"paper": True, "sgd": True, "nemo": False}

# Code objects of optax's combinators, taken from live instances (not matched by name): see the module docstring.
_IDENTITY = optax.identity()
_CHAIN_CODE = optax.chain(_IDENTITY).update.__code__
_NAMED_CHAIN_CODE = optax.named_chain(("_", _IDENTITY)).update.__code__
_EXTRA_ARGS_CODE = optax.with_extra_args_support(
    optax.GradientTransformation(_IDENTITY.init, lambda u, s, p=None: (u, s))).update.__code__
_INJECT_CODE = optax.inject_hyperparams(optax.scale)(1.0).update.__code__
# Factories whose transforms take LowRankUpdate leaves, recognised inside optax.inject_hyperparams.
_LOWRANK_FACTORIES = (scale_lowrank, add_decayed_weights_lowrank, clip_by_global_norm_lowrank, densify_lowrank)


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


def _closure(fn: Any) -> dict[str, Any]:
    """The closure variables of a Python function, by name ({} for anything else)."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or cells is None:
        return {}
    try:
        return {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells)}
    except ValueError:  # an empty cell
        return {}


def _first_step(fn: Any) -> tuple[bool, str]:
    """(is fn low-rank-aware, its name), looking through optax's extra-args wrapper, nested (named) chains and
    inject_hyperparams to the update function that runs first."""
    for _ in range(32):  # nesting depth bound; deeper than any real chain
        code, free = getattr(fn, "__code__", None), _closure(fn)
        if code is _EXTRA_ARGS_CODE and "tx" in free:
            fn = free["tx"].update
        elif code is _CHAIN_CODE and free.get("update_fns"):
            fn = free["update_fns"][0]
        elif code is _NAMED_CHAIN_CODE and free.get("transforms"):
            fn = free["transforms"][0][1].update
        elif code is _INJECT_CODE and "inner_factory" in free:
            factory = free["inner_factory"]
            return factory in _LOWRANK_FACTORIES, f"inject_hyperparams({getattr(factory, '__qualname__', factory)})"
        else:
            break
    return is_lowrank_aware(fn), getattr(fn, "__qualname__", repr(fn))


def _successor(frame: types.FrameType | None) -> Any:
    """The update function that receives logra's output in the innermost enclosing optax chain that has one;
    None when there is none or the frames are not laid out as expected (see the module docstring)."""
    while frame is not None:
        code = frame.f_code
        if code is _CHAIN_CODE or code is _NAMED_CHAIN_CODE:
            local = frame.f_locals
            steps = local.get("update_fns") if code is _CHAIN_CODE else local.get("transforms")
            done = local.get("new_state")
            if not isinstance(steps, (list, tuple)) or done is None or not len(done) < len(steps):
                return None  # unrecognised layout: diagnostic only
            i = len(done)  # the index of the transform now running (it holds logra)
            if i + 1 < len(steps):
                nxt = steps[i + 1]
                return nxt if code is _CHAIN_CODE else nxt[1].update
        frame = frame.f_back
    return None


def _check_successor(frame: types.FrameType | None) -> None:
    """Raise ValueError if, walking out from `frame`, a transform that is not low-rank-aware follows logra in an
    optax chain (see the module docstring); do nothing if none follows or the frames are not recognised.

    Raises:
      ValueError: naming the successor and saying what to do (MISUSE_ADVICE).
    """
    fn = _successor(frame)
    if fn is None:
        return
    ok, name = _first_step(fn)
    if not ok:
        raise ValueError(
            f"logra is followed in an optax chain by {name}, which does not handle LowRankUpdate leaves: "
            f"{MISUSE_ADVICE} (a transform of your own that handles them: wrap it in "
            "logra_jax.optim.mark_lowrank_aware)")


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


def logra(rank: int | None = None, *, base_seed: int | None = None, distribution: Distribution | None = None,
          refresh: bool | None = None, refresh_every: int | None = None, momentum: float = 0.0,
          variant: Variant = "paper", b2: float = 0.95, eps: float = 1e-8, update_ratio: float = 6e-5,
          ratio_scope: str = "global",
          lr: float | optax.Schedule | None = None, weight_decay: float = 0.0,
          rules: Sequence[TargetRule] | None = None,
          non_target_tx: optax.GradientTransformation | None = None,
          round_bf16: bool | None = None,
          kl_control: Mapping[str, Any] | None = None,
          implementation: Implementation | None = None, interpret: bool | None = None,
          dense_updates: bool = False, rank_rules: str | Sequence[RankRule] | None = None,
          spec: SketchSpec | None = None) -> optax.GradientTransformationExtraArgs:
    """LoGRA: sketch → RowAdam → global step size → negation on targets; non-targets frozen or any optax tx.

    Per target layer l (docs/method.md): S_l = G_l A_lᵀ; D_l = RowAdam(S_l); with momentum β₁ > 0,
    D_l ← M_l/(1 − β₁^τ), M_l ← β₁·transfer(M_l) + (1 − β₁)·D_l (`scale_by_subspace_momentum`: the first moment in
    sketch coordinates, carried into the new projection whenever it changes, every refresh_every steps);
      paper/sgd: W_l ← W_l − bf16(factor · D_l) A_l, factor = update_ratio · sqrt(Σ‖W‖² / Σ‖D A‖²)
      nemo:      W_l ← (1 − lr·wd) W_l − lr · D_l A_l
    bf16(·): the factor rounded at merge time when round_bf16, by default for paper/sgd (their wire format) and
    not for nemo (NeMo merges the fp32 factor). Apply with `logra_jax.optim.apply_updates` (the memory-lean
    default: target updates stay LowRankUpdate(U, step) and merge layer by layer), or, with dense_updates=True,
    with `optax.apply_updates` / `nnx.Optimizer`: each target's update is then the dense float32
      ΔW_l = bf16?(U_l)·A_l   (nemo with decay c: merged W_l − W_l, see LowRankUpdate.to_dense)
    formed inside the same update, and optax.apply_updates gives the low-rank route's weights bit for bit (fp32
    and bf16 weights; optax adds W + ΔW in float32 and casts to W's dtype), at the cost of one float32 ΔW per
    target in the step (experiments/dropin: bytes per route at SmolLM2-135M and Qwen2.5-1.5B).
    Generic optax transforms belong before logra (on the dense gradient), or after it only with
    dense_updates=True; in the low-rank route a generic successor raises ValueError at trace time (the module
    docstring says how it is found), and the low-rank versions (scale_lowrank, add_decayed_weights_lowrank,
    clip_by_global_norm_lowrank) may follow.
    With optax.inject_hyperparams name the static arguments: `optax.inject_hyperparams(logra,
    static_args=("rank", "base_seed"))(rank=16, update_ratio=1e-3)`; update_ratio (and b2, eps, lr,
    weight_decay) then live in `state.hyperparams` and may change between steps without recompiling.

    The sketch settings (rank, rank_rules, base_seed, distribution, refresh, refresh_every, rules, round_bf16,
    implementation, interpret) become one SketchSpec, carried by every LowRankUpdate and (static) by the state,
    where the train step reads it (`logra_jax.optim.sketch_spec`); each left None takes SketchSpec's default
    (declared there only), except round_bf16 (the variant's convention). A SketchSpec built once may be given
    instead (`spec=`, e.g. the one the sketch-native probes were attached with), with those arguments left None.

    Args:
      rank: sketch rank r (static; default 256, the paper's).
      base_seed: projection base seed (static; default 42).
      distribution: "rademacher" (default) or "gaussian".
      refresh: fresh projections (True, default) or those of step 0 for ever (False: fixed, κ = ∞).
      refresh_every: with refresh, draw new projections every κ steps (static; default 1, the paper's).
      momentum: β₁ of the first moment in sketch coordinates (`scale_by_subspace_momentum`); 0 (default): none,
        RowAdam as in the paper (a Python 0 adds no stage; an array, e.g. from optax.inject_hyperparams, does).
        Its state is one float32 [*batch, *rows, r] array per target.
      variant: "paper", "nemo" or "sgd" (see scale_by_row_adam).
      b2: RowAdam β₂.
      eps: RowAdam ε (relative for paper, absolute for nemo).
      update_ratio: update-to-weight norm ratio (paper and sgd variants).
      ratio_scope: "global" (the paper's: one ratio over all targets together) or "layer" (each layer moves by
        update_ratio of its own norm; see scale_by_update_ratio).
      lr: learning rate or schedule (nemo variant only; required there).
      weight_decay: decoupled weight decay λ (nemo variant only).
      rules: TargetRule sequence choosing the targets (default DEFAULT_TARGET_RULES).
      non_target_tx: transformation for non-target parameters; None freezes them (optax.set_to_zero()).
      round_bf16: round the final factor to bf16 when merging; None (default): the variant's own convention,
        bf16 for paper and sgd (the paper's wire format), fp32 for nemo (NeMo merges the fp32 factor).
      kl_control: None, or keyword arguments of `scale_by_predicted_kl` ({} for its defaults) to scale each step
        to a predicted-KL budget; `update` then needs `kl_probe=fn(updates)` or `kl_prediction=(q_sum, count)`.
      implementation: "xla" (default) or "pallas": the kernels of RowAdam's row moment (`kernels.row_moment`) and of the
        merge done by `apply_updates` (`kernels.merge`, carried on each LowRankUpdate).
      interpret: Pallas only: run the kernels in the Pallas interpreter (required on CPU).
      dense_updates: False (default): target updates are LowRankUpdate leaves for `logra_jax.optim.apply_updates`;
        True: dense float32 ΔW arrays (`densify_lowrank`) for optax.apply_updates / nnx.Optimizer, after which
        any optax transform may follow. The optimizer state is the same either way.
      rank_rules: RankRule sequence or its text "pattern=rank, ..." (e.g. "mlp=8"): a target whose path a rule's
        pattern matches (first match wins) is sketched at that rule's rank; the others at `rank`.
      spec: the sketch settings as one SketchSpec (then leave the arguments above that it holds None).

    Returns:
      An optax.GradientTransformationExtraArgs (an optax.partition, then densify_lowrank when dense_updates; extra
      args flow to every transform).

    Raises:
      ValueError/TypeError: invalid hyperparameters, round_bf16, dense_updates or implementation, lr missing for
        nemo or given for paper/sgd, weight_decay for paper/sgd; at init, no target in the params, a target's
        rank wider than the target or a rank rule that gives no target its rank (`check_rank_fits`); at update
        (low-rank route), a generic optax transform after logra in a chain.

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
      >>> import optax
      >>> dense_tx = logra(rank=4, update_ratio=1e-3, dense_updates=True)
      >>> dense, _ = dense_tx.update(grads, dense_tx.init(params), params)
      >>> bool((optax.apply_updates(params, dense)["mlp"]["up_proj"]["kernel"]
      ...       == new["mlp"]["up_proj"]["kernel"]).all())
      True
    """
    if not isinstance(dense_updates, (bool, np.bool_)):
        raise TypeError(f"logra: dense_updates must be a bool, got {dense_updates!r}")
    if isinstance(momentum, (int, float)) and not 0 <= momentum < 1:
        raise ValueError(f"logra: momentum must be in [0, 1) (0 = none), got {momentum!r}")
    if kl_control is not None and not isinstance(kl_control, Mapping):
        raise TypeError(f"logra: kl_control must be None or a mapping of scale_by_predicted_kl's keyword arguments, "
                        f"got {kl_control!r}")
    if non_target_tx is not None and not isinstance(non_target_tx, optax.GradientTransformation):
        raise TypeError(f"logra: non_target_tx must be None or an optax.GradientTransformation, got {non_target_tx!r}")
    spec = build_spec("scale_by_sketch", spec, rank=rank, base_seed=base_seed, distribution=distribution,
                      refresh=refresh, refresh_every=refresh_every, rules=rules, implementation=implementation,
                      interpret=interpret, rank_rules=rank_rules,
                      round_bf16=resolve_round_bf16(round_bf16, variant) if spec is None else round_bf16)
    step_size, negation = _step_size(variant, update_ratio, ratio_scope, lr, weight_decay)
    if kl_control is not None:
        step_size.append(("predicted_kl", scale_by_predicted_kl(**kl_control)))
    target_tx = optax.named_chain(
        ("sketch", scale_by_sketch(spec=spec)),
        ("row_adam", scale_by_row_adam(variant, b2, eps, spec.rules, implementation=spec.implementation,
                                       interpret=spec.interpret)),
        *([] if isinstance(momentum, (int, float)) and momentum == 0 else
          [("momentum", scale_by_subspace_momentum(momentum, spec.rank, spec.rules,
                                                                 rank_rules=spec.rank_rules))]),
        *step_size,
        negation,
    )
    frozen = optax.set_to_zero() if non_target_tx is None else non_target_tx
    routed = optax.partition({TARGET_LABEL: target_tx, NON_TARGET_LABEL: frozen},
                             lambda tree: target_labels(tree, spec.rules))
    return _densified(routed, spec) if dense_updates else _refusing_generic_successors(routed)


def _step_size(variant: str, update_ratio: float | jax.Array, ratio_scope: str, lr: float | optax.Schedule | None,
               weight_decay: float | jax.Array) -> tuple[list[tuple[str, Any]], tuple[str, Any]]:
    """The named stages after RowAdam ([update ratio] for paper/sgd, [weight decay] for nemo) and the final
    negation (−1, or −lr for nemo), checking that lr and weight_decay are given only to nemo."""
    if variant == "nemo":
        if lr is None:
            raise ValueError("logra: variant='nemo' needs a learning rate lr")
        negation = ("learning_rate", scale_lowrank((lambda n: -lr(n)) if callable(lr) else -lr))
        return [("weight_decay", add_decayed_weights_lowrank(weight_decay))], negation
    if lr is not None:
        raise ValueError(f"logra: lr is only used by variant='nemo', got lr={lr!r} with variant={variant!r}")
    if isinstance(weight_decay, (int, float)) and weight_decay != 0:
        raise ValueError(f"logra: weight_decay is only used by variant='nemo', got {weight_decay!r} with "
                         f"variant={variant!r}")
    return ([("update_ratio", scale_by_update_ratio(update_ratio, scope=ratio_scope))],
            ("negation", scale_lowrank(-1.0)))


def _densified(routed: optax.GradientTransformation, spec: SketchSpec) -> optax.GradientTransformationExtraArgs:
    """`routed` followed by `densify_lowrank()` in the same update (the dense_updates=True route)."""
    if spec.stochastic_round:
        raise ValueError("logra: dense_updates=True cannot keep spec.stochastic_round: a dense ΔW is merged by "
                         "optax.apply_updates, which rounds to nearest; use the low-rank route "
                         "(logra_jax.optim.apply_updates)")
    densify = densify_lowrank()

    def update(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> tuple[Any, Any]:
        updates, state = routed.update(updates, state, params, **extra_args)
        return densify.update(updates, optax.EmptyState(), params)[0], state

    return optax.GradientTransformationExtraArgs(routed.init, update)


def _refusing_generic_successors(routed: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """`routed` whose update first refuses a generic successor in an enclosing optax chain (`_check_successor`:
    the only place that reads the interpreter's frames; see the module docstring for why nothing else can)."""

    def update(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> tuple[Any, Any]:
        _check_successor(sys._getframe(1))
        return routed.update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(routed.init, update)
