"""SketchSpec: the one declaration of how LoGRA sketches and merges (docs/method.md §2–§3).

Every setting that must agree between the places that draw a projection or merge a low-rank update lives here
once: rank r (and the rank rules giving some targets their own), projection base seed and distribution, refresh
(and its period), the target rules, bf16 rounding of the merged factor, and the kernel implementation ("xla" |
"pallas", `interpret` for Pallas on CPU). Its owners:
  - `logra(...)` / `scale_by_sketch(...)` build it from their arguments (or take one: `spec=`);
  - every `LowRankUpdate` carries it (`update.meta.spec`), so a merge or a sync receiver regenerates exactly the
    projections the optimizer drew;
  - the optimizer state carries it as static data (`SketchState.spec`, no leaves), so the train step reads it
    from the optimizer it is given (`sketch_spec(opt_state)`) instead of being told it again;
  - sketch-native hooks (`logra_jax.native.attach_sketch_probes`) take the same object;
  - the policy-sync payload writes its wire fields (`wire_fields`) and rebuilds it on the rollout side.
A target's rank is `rank_for(path)`: the first rank rule whose pattern matches its path, else `rank`. Everything
else about a target's projections (its seed, its draw) does not depend on the rules, so a target whose rank a rule
leaves unchanged is sketched and merged exactly as without rules; `for_target(path)` is the spec one target sees
(its rank, no rules): what a sync payload carries per target.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from logra_jax.kernels.backend import Implementation, check_implementation, check_interpret
from logra_jax.optim.projection import Distribution, check_nonneg_int, check_projection_args
from logra_jax.optim.targets import (
    DEFAULT_TARGET_RULES,
    DeclaredTargets,
    RankRule,
    Target,
    TargetRule,
    check_rank_fits,
    check_rules,
    find_targets,
    parse_rank_rules,
    resolve_rank,
)

# The fields that select the projections A: two specs that agree on them draw the same A for a target and step.
DRAW_FIELDS = ("rank", "rank_rules", "base_seed", "distribution", "refresh", "refresh_every")
# The fields a policy-sync payload carries per target (the rules stay on the trainer: the target is sent whole, with
# its own rank: `for_target`).
WIRE_FIELDS = ("base_seed", "rank", "distribution", "refresh", "refresh_every", "round_bf16", "implementation",
               "interpret", "stochastic_round")


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class SketchSpec:
    """How targets are sketched and merged. Frozen and hashable (it is static: a jit cache key, aux data of
    LowRankUpdate, a pytree node without leaves in the optimizer state, part of an NNX graphdef through the
    sketch-native hooks).

    Attributes:
      rank: sketch rank r, a positive Python int (the paper's 256 by default), of every target no rank rule
        matches.
      rank_rules: RankRule sequence (stored as a tuple; also given as the text "pattern=rank, ..." or a
        {pattern: rank} mapping, `parse_rank_rules`): a target whose canonical path a rule's pattern matches
        (re.search, first match wins) takes that rule's rank; () (default): every target takes `rank`.
      base_seed: base of every projection seed (non-negative Python int).
      distribution: "rademacher" (±1/√r) or "gaussian" (N(0, 1/r)).
      refresh: fresh projections (True) or those of step 0 for ever (False: a fixed projection, κ = ∞).
      refresh_every: with refresh, the period κ ≥ 1 of the draws: the projections of step t are those drawn for
        step κ·⌊t/κ⌋ (`draw_step`); κ = 1 (default) is a fresh draw every step, the paper's.
      rules: the TargetRule sequence choosing the targets and their matrix axes (stored as a tuple).
      round_bf16: the merged factor is rounded to bf16 (the paper's wire format) before U·A is added to W.
      implementation: "xla" (einsums) or "pallas" (fused kernels of logra_jax.kernels) for the sketch-native
        layer and the merge.
      interpret: Pallas only: run the kernels in the Pallas interpreter (required on CPU).
      stochastic_round: a bfloat16 weight's merge rounds the float32 sum stochastically, keyed by (base seed,
        step, path), instead of to nearest (`optimizer.weight_dtype="bfloat16"`; float32 weights are unaffected).

    Example:
      >>> SketchSpec(rank=8, implementation="pallas", interpret=True).implementation
      'pallas'
    """

    rank: int = 256
    rank_rules: tuple[RankRule, ...] = ()
    base_seed: int = 42
    distribution: Distribution = "rademacher"
    refresh: bool = True
    refresh_every: int = 1
    rules: tuple[TargetRule, ...] = DEFAULT_TARGET_RULES
    round_bf16: bool = False
    implementation: Implementation = "xla"
    interpret: bool = False
    stochastic_round: bool = False

    def __post_init__(self) -> None:
        try:
            check_projection_args(self.rank, self.distribution)
        except (TypeError, ValueError) as e:
            raise type(e)(f"SketchSpec.{e}") from e
        every = check_nonneg_int("SketchSpec.refresh_every", self.refresh_every)
        if every < 1:
            raise ValueError(f"SketchSpec.refresh_every must be >= 1 (refresh=False holds the projection for ever), "
                             f"got {self.refresh_every!r}")
        try:
            rank_rules = parse_rank_rules(self.rank_rules)
        except (TypeError, ValueError) as e:
            raise type(e)(f"SketchSpec.rank_rules: {e}") from e
        normal = dict(rank=int(self.rank), rank_rules=rank_rules,
                      base_seed=check_nonneg_int("SketchSpec.base_seed", self.base_seed),
                      refresh=bool(self.refresh), refresh_every=every, round_bf16=bool(self.round_bf16),
                      rules=check_rules(self.rules),
                      implementation=check_implementation(self.implementation, "SketchSpec.implementation"),
                      interpret=check_interpret(self.interpret, "SketchSpec"),
                      stochastic_round=bool(self.stochastic_round))
        for name, value in normal.items():  # frozen: normalised in place (numpy ints → int, a rule list → tuple)
            object.__setattr__(self, name, value)

    def draw_step(self, step: jax.Array | int) -> jax.Array:
        """The step whose projections step `step` uses (int32, traceable): κ·⌊step/κ⌋ with refresh, else 0.

        Example:
          >>> [int(SketchSpec(refresh_every=3).draw_step(t)) for t in range(7)]
          [0, 0, 0, 3, 3, 3, 6]
        """
        step = jnp.asarray(step, jnp.int32)
        if not self.refresh:  # not zeros_like: its result would carry step's sharding into a shard_map's body
            return jnp.zeros(jnp.shape(step), jnp.int32)
        return step if self.refresh_every == 1 else step - step % self.refresh_every

    def rank_for(self, path: str) -> int:
        """The sketch rank of the target at canonical `path`: the first matching rank rule's, else `rank`.

        Example:
          >>> spec = SketchSpec(rank=16, rank_rules="mlp=8")
          >>> spec.rank_for("blocks.mlp.up_proj.kernel"), spec.rank_for("blocks.attn.q_proj.kernel")
          (8, 16)
        """
        return resolve_rank(path, self.rank, self.rank_rules)[0]

    def for_target(self, path: str) -> SketchSpec:
        """The spec as the target at `path` sees it: its own rank and no rank rules (every other field kept). It
        draws, sketches and merges that target exactly as this spec does.

        Example:
          >>> SketchSpec(rank=16, rank_rules="mlp=8").for_target("blocks.mlp.up_proj.kernel").rank
          8
        """
        if not self.rank_rules:
            return self
        return dataclasses.replace(self, rank=self.rank_for(path), rank_rules=())

    def check_fits(self, targets: Mapping[str, Target]) -> None:
        """Raise ValueError unless every target's rank fits its width and every rank rule gives some target its
        rank (`logra_jax.optim.targets.check_rank_fits`)."""
        check_rank_fits(targets, self.rank, self.rank_rules)

    def draws_like(self, other: SketchSpec) -> bool:
        """Whether `other` draws the same projections (DRAW_FIELDS equal), however either rounds or merges."""
        return all(getattr(self, name) == getattr(other, name) for name in DRAW_FIELDS)

    def wire_fields(self) -> dict[str, Any]:
        """The settings a receiver needs to regenerate one target's projections and merge like the trainer
        (JSON-able; `from_wire` inverts it). With rank rules, take them from `for_target(path)`.

        Raises:
          ValueError: the spec has rank rules (the wire carries one target's rank).
        """
        if self.rank_rules:
            raise ValueError(f"SketchSpec.wire_fields: a spec with rank rules {[str(r) for r in self.rank_rules]} "
                             "has no one rank: write spec.for_target(path).wire_fields() for each target")
        return {name: getattr(self, name) for name in WIRE_FIELDS}

    @classmethod
    def from_wire(cls, fields: Mapping[str, Any]) -> SketchSpec:
        """The spec `wire_fields` wrote (with the default rules, which a receiver given the target does not use).

        Raises:
          KeyError: a wire field is missing; TypeError/ValueError: a field SketchSpec rejects.
        """
        return cls(**{name: fields[name] for name in WIRE_FIELDS})

    def with_merge(self, implementation: Implementation, interpret: bool = False) -> SketchSpec:
        """The same spec, merged (and sketched) by `implementation`."""
        return dataclasses.replace(self, implementation=implementation, interpret=interpret)


def build_spec(where: str, spec: SketchSpec | None = None, /, **settings: Any) -> SketchSpec:
    """`spec`, or a SketchSpec of `settings`; an error names `where` (the factory the user called). A setting
    that is None takes the SketchSpec default.

    With `spec` given, every one of `settings` must be None (the settings are declared once: in the spec or in
    the arguments, not in both).

    Raises:
      TypeError/ValueError: a bad setting (names `where` and the field), `spec` not a SketchSpec, or a setting
        given beside `spec`.
    """
    settings = {k: v for k, v in settings.items() if v is not None}
    if spec is not None:
        if not isinstance(spec, SketchSpec):
            raise TypeError(f"{where}: spec must be a SketchSpec, got {spec!r}")
        given = sorted(settings)
        if given:
            raise ValueError(f"{where}: pass the sketch settings either in spec= or as arguments, not both; got "
                             f"spec= and {given}")
        return spec
    try:
        return SketchSpec(**settings)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{where}: {e}") from e


def _static_nodes(opt_state: Any, kind: type | types.UnionType) -> set[Any]:
    """The distinct static nodes of type `kind` anywhere in `opt_state` (they are leafless pytree nodes)."""
    return {x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, kind)) if isinstance(x, kind)}


def sketch_spec(opt_state: Any) -> SketchSpec | None:
    """The SketchSpec of the optimizer whose state is `opt_state` (any nesting: chain, partition,
    inject_hyperparams, MultiSteps), None when it sketches nothing.

    Raises:
      ValueError: the state holds two different specs.
    """
    found = _static_nodes(opt_state, SketchSpec)
    if len(found) > 1:
        raise ValueError(f"the optimizer state holds {len(found)} different SketchSpecs: {sorted(map(str, found))}")
    return next(iter(found), None)


def state_targets(opt_state: Any, params: Any) -> dict[str, Target]:
    """{canonical path: Target} of the parameters whose per-target state the optimizer keeps (the rules of each
    SketchSpec or DeclaredTargets in `opt_state`; {} when there is none): the declared layouts that state is
    sharded by (`logra_jax.parallel.sharding.opt_state_shardings(..., targets=)`, the same `Target.state_spec` an eager
    `init` on sharded parameters places the row moments by).

    Args:
      opt_state: the optimizer's state, real or abstract (`jax.eval_shape(tx.init, params)`).
      params: the parameters it was initialised on (arrays or ShapeDtypeStructs).

    Raises:
      ValueError: two declarations view the same parameter differently (the message names it).

    Example:
      >>> import jax.numpy as jnp
      >>> from logra_jax.optim import logra
      >>> params = {"q_proj": {"kernel": jnp.zeros((8, 4))}, "norm": jnp.zeros(4)}
      >>> list(state_targets(logra(rank=2).init(params), params))
      ['q_proj.kernel']
    """
    rule_sets = {x.rules for x in _static_nodes(opt_state, SketchSpec | DeclaredTargets)}
    targets: dict[str, Target] = {}
    for rules in sorted(rule_sets, key=repr):
        for path, t in find_targets(params, rules).items():
            if targets.setdefault(path, t) != t:
                raise ValueError(f"state_targets: {path!r} is declared as two different targets: {targets[path]} "
                                 f"and {t}")
    return targets
