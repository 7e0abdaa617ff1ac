"""Targets as data: which parameters LoGRA sketches, and how an N-d kernel is viewed as matrices.

A rule is a regex searched on a parameter's canonical path ("blocks.attn.q_proj.kernel") plus dimension numbers
(`MatrixDims`) naming the kernel axes that form the rows (LoGRA's d, the output features) and the width (LoGRA's
k, the reduced input features). Every other axis is a batch axis: each batch slice is an independent target
matrix W [d, k] with its own projection (our decoder stacks layers on axis 0, so one slice = one layer).

Layouts used throughout logra_jax.optim, for a kernel of shape `shape`:
  sketch S, factor U:  (*batch_shape, *rows_shape, r)   rows keep their own axes so row sharding follows W
  row moment v:        (*batch_shape, *rows_shape)
  projection A:        (*batch_shape, r, k)
Batch, row and width axes are each taken in weight order; the width axes flatten row-major into k.
Nothing transposes the kernel: the contractions are einsums over its own axes (`Target.subscripts`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from logra_jax.core.tree_paths import path_keys, path_str
from logra_jax.parallel.derived_specs import follow_spec, full_spec


def _normalise_axes(axes: Sequence[int], ndim: int) -> tuple[int, ...] | None:
    out = []
    for a in axes:
        if not -ndim <= a < ndim:
            return None
        out.append(a % ndim)
    return tuple(sorted(out))


@dataclasses.dataclass(frozen=True)
class MatrixDims:
    """Axes of a kernel that form the matrix rows (output features d) and the reduced width (input features k).

    Axes may be negative. Every axis in neither tuple is a batch axis (one independent target per batch slice).

    Attributes:
      rows: axes whose product is d (LoGRA's output rows; the row moment has one entry per row).
      width: axes whose product is k (contracted with the projection A [r, k]).

    Example:
      >>> MatrixDims(rows=(-1,), width=(-2,))   # Flax [in, out] kernels, stacked or not
      MatrixDims(rows=(-1,), width=(-2,))
      >>> MatrixDims(rows=(1, 2), width=(0,))   # Tunix q einsum kernel [D, N, H]
      MatrixDims(rows=(1, 2), width=(0,))
    """

    rows: tuple[int, ...] = (-1,)
    width: tuple[int, ...] = (-2,)

    def __post_init__(self) -> None:
        for name in ("rows", "width"):
            value = getattr(self, name)
            if (not isinstance(value, tuple) or not value
                    or not all(isinstance(a, int) and not isinstance(a, bool) for a in value)):
                raise TypeError(f"MatrixDims.{name} must be a non-empty tuple of ints, got {value!r}")


@dataclasses.dataclass(frozen=True)
class TargetRule:
    """A parameter whose canonical path matches `pattern` (re.search) is a target viewed through `dims`.

    Example:
      >>> rule = TargetRule(r"attn\\.q_einsum\\.w$", MatrixDims(rows=(1, 2), width=(0,)))
      >>> bool(re.search(rule.pattern, "layers.0.attn.q_einsum.w"))
      True
    """

    pattern: str
    dims: MatrixDims = MatrixDims()

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str):
            raise TypeError(f"TargetRule.pattern must be a str, got {self.pattern!r}")
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ValueError(f"TargetRule.pattern {self.pattern!r} is not a valid regex: {e}") from e
        if not isinstance(self.dims, MatrixDims):
            raise TypeError(f"TargetRule.dims must be a MatrixDims, got {self.dims!r}")


DEFAULT_TARGET_RULES: tuple[TargetRule, ...] = (
    TargetRule(r"(^|\.)(q|k|v|o|gate|up|down)_proj\.kernel$", MatrixDims(rows=(-1,), width=(-2,))),
)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class DeclaredTargets:
    """A static (leafless) node of an optimizer state: its per-target state is keyed and laid out by the targets
    `rules` find, so its shardings follow their declared dims (`logra_jax.optim.spec.state_targets`). The
    SketchSpec in LoGRA's state declares the same through its own rules.

    Example:
      >>> jax.tree.leaves({"v": 1.0, "declared": DeclaredTargets()})
      [1.0]
    """

    rules: tuple[TargetRule, ...] = DEFAULT_TARGET_RULES


@dataclasses.dataclass(frozen=True)
class Target:
    """One target parameter: its canonical path, shape and (normalised, non-negative, sorted) matrix axes.

    Attributes:
      path: canonical path ("blocks.attn.q_proj.kernel").
      keys: the path's components (used to key per-target optimizer state).
      shape: the kernel's shape.
      dims: the rule's MatrixDims with axes made non-negative and sorted.
      batch_axes: the remaining axes, sorted.

    Example:
      >>> t = match_target("blocks.q_proj.kernel", ("blocks", "q_proj", "kernel"), (28, 3584, 512),
      ...                  DEFAULT_TARGET_RULES)
      >>> t.batch_shape, t.rows_shape, t.k, t.slice_paths[1]
      ((28,), (512,), 3584, 'blocks.q_proj.kernel.1')
    """

    path: str
    keys: tuple[str, ...]
    shape: tuple[int, ...]
    dims: MatrixDims
    batch_axes: tuple[int, ...]

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return tuple(self.shape[a] for a in self.batch_axes)

    @property
    def rows_shape(self) -> tuple[int, ...]:
        return tuple(self.shape[a] for a in self.dims.rows)

    @property
    def width_shape(self) -> tuple[int, ...]:
        return tuple(self.shape[a] for a in self.dims.width)

    @property
    def d(self) -> int:
        """Rows of each target matrix (product of the row axes)."""
        return math.prod(self.rows_shape)

    @property
    def k(self) -> int:
        """Width of each target matrix (product of the width axes)."""
        return math.prod(self.width_shape)

    @property
    def num_slices(self) -> int:
        """Number of independent target matrices (product of the batch axes; 1 when unbatched)."""
        return math.prod(self.batch_shape)

    @property
    def slice_paths(self) -> tuple[str, ...]:
        """Canonical path of each batch slice, flat row-major: "path.i" (just "path" when unbatched)."""
        if not self.batch_axes:
            return (self.path,)
        return tuple(f"{self.path}.{i}" for i in range(self.num_slices))

    @property
    def geometry(self) -> Target:
        """This target without its name: the static key of compiled per-target code, shared by equal shapes."""
        return dataclasses.replace(self, path="", keys=())

    @property
    def subscripts(self) -> tuple[str, str, str, str]:
        """einsum letters (weight, batch, rows, width), each in weight-axis order; "z" is reserved for the rank."""
        letters = "abcdefghijklmnopqrstuvwxy"
        if len(self.shape) > len(letters):
            raise ValueError(f"target {self.path}: too many axes ({len(self.shape)})")
        pick = lambda axes: "".join(letters[a] for a in axes)
        return (letters[:len(self.shape)], pick(self.batch_axes), pick(self.dims.rows), pick(self.dims.width))

    def state_spec(self, shape: Sequence[int], weight_spec: PartitionSpec, mesh: Mesh) -> PartitionSpec | None:
        """PartitionSpec of this target's state of `shape` on `mesh`, given the kernel's PartitionSpec: the one
        derivation of optimizer-state (and sketch-probe) sharding from the declared dims.

        The kernel's own shape takes its spec. Per-row state (*batch_shape, *rows_shape, *own dims: the row
        moment, a sketch, a factor, a sketch probe) keeps the batch and row axes' mesh axes, and the width's mesh
        axes move onto the rows (then the batch axes, then the own dims) where they divide
        (`logra_jax.parallel.derived_specs.follow_spec`), so the state is split as finely as the kernel: the same spec
        eagerly (`place_rows`) and under jit (`logra_jax.parallel.sharding.opt_state_shardings`).

        Returns:
          The PartitionSpec, or None when `shape` is neither the kernel's nor laid out per row.

        Example (a row moment [L, d] of a kernel [L, k, d] sharded (None, 'fsdp', 'tensor')):
          >>> mesh = jax.make_mesh((1, 1), ("fsdp", "tensor"), devices=jax.devices()[:1])
          >>> t = match_target("q_proj.kernel", ("q_proj", "kernel"), (2, 6, 8), DEFAULT_TARGET_RULES)
          >>> t.state_spec((2, 8), PartitionSpec(None, "fsdp", "tensor"), mesh)
          P(None, ('tensor', 'fsdp'))
        """
        shape = tuple(shape)
        if shape == self.shape:
            return full_spec(weight_spec, len(self.shape))
        lead = self.batch_axes + self.dims.rows
        if shape[:len(lead)] != (*self.batch_shape, *self.rows_shape):
            return None
        match = lead + (None,) * (len(shape) - len(lead))
        return follow_spec(shape, weight_spec, len(self.shape), match, mesh)


def _rules_text(rules: Sequence[TargetRule]) -> str:
    return "[" + ", ".join(f"{r.pattern!r} {r.dims}" for r in rules) + "]"


def check_rules(rules: Sequence[TargetRule]) -> tuple[TargetRule, ...]:
    """Validate `rules` (a non-empty sequence of TargetRule) and return them as a tuple."""
    if isinstance(rules, TargetRule) or not isinstance(rules, Sequence) or not rules:
        raise TypeError(f"rules must be a non-empty sequence of TargetRule, got {rules!r}")
    for r in rules:
        if not isinstance(r, TargetRule):
            raise TypeError(f"rules must contain TargetRule instances, got {r!r}")
    return tuple(rules)


def match_target(path: str, keys: tuple[str, ...], shape: Sequence[int],
                 rules: Sequence[TargetRule]) -> Target | None:
    """The Target for a parameter at `path` (components `keys`) with `shape` under the first matching rule.

    Returns:
      The Target, or None when no rule's pattern is found in `path`.

    Raises:
      ValueError: the matching rule's dims cannot view this shape as matrices (an axis out of range or used
        twice); the message names the rule, the path and all rules.

    Example:
      >>> match_target("norm.scale", ("norm", "scale"), (8,), DEFAULT_TARGET_RULES) is None
      True
      >>> match_target("o_proj.kernel", ("o_proj", "kernel"), (8,), DEFAULT_TARGET_RULES)
      Traceback (most recent call last):
      ...
      ValueError: target 'o_proj.kernel' with shape (8,) cannot be viewed as a matrix ...
    """
    shape = tuple(int(s) for s in shape)
    for rule in rules:
        if re.search(rule.pattern, path) is None:
            continue
        ndim = len(shape)
        rows = _normalise_axes(rule.dims.rows, ndim)
        width = _normalise_axes(rule.dims.width, ndim)
        if rows is None or width is None or len(set(rows + width)) != len(rows) + len(width):
            raise ValueError(
                f"target {path!r} with shape {shape} cannot be viewed as a matrix by rule {rule.pattern!r} "
                f"{rule.dims}: axes out of range or repeated (rules: {_rules_text(rules)})")
        batch = tuple(a for a in range(ndim) if a not in rows + width)
        return Target(path=path, keys=keys, shape=shape, dims=MatrixDims(rows=rows, width=width),
                      batch_axes=batch)
    return None


def find_targets(params: Any, rules: Sequence[TargetRule] = DEFAULT_TARGET_RULES) -> dict[str, Target]:
    """All target parameters of `params` (any pytree: nested dicts, nnx.State, ShapeDtypeStruct leaves).

    Args:
      params: the parameter tree; leaves need a `.shape` (arrays or jax.ShapeDtypeStruct).
      rules: TargetRule sequence; the first rule whose pattern is found in a leaf's canonical path applies.

    Returns:
      {canonical path: Target}, in tree order.

    Raises:
      ValueError: no leaf matches any rule, two leaves share a canonical path, or a matched leaf cannot be
        viewed as a matrix (the message names the rules and the path).

    Example:
      >>> import jax.numpy as jnp
      >>> params = {"attn": {"q_proj": {"kernel": jnp.zeros((4, 8))}}, "norm": {"scale": jnp.ones(4)}}
      >>> t = find_targets(params)["attn.q_proj.kernel"]
      >>> (t.d, t.k, t.batch_shape)
      (8, 4, ())
    """
    rules = check_rules(rules)
    found: dict[str, Target] = {}
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = path_keys(keypath)
        path = ".".join(keys)
        target = match_target(path, keys, np.shape(leaf), rules)
        if target is None:
            continue
        if path in found:
            raise ValueError(f"two parameters share the canonical path {path!r}")
        found[path] = target
    if not found:
        raise ValueError(f"no parameter matches the target rules {_rules_text(rules)}")
    return found


@dataclasses.dataclass(frozen=True)
class RankRule:
    """Targets whose canonical path matches `pattern` (re.search, like TargetRule) take sketch rank `rank`.

    A SketchSpec's rank rules are tried in order and the first match wins; a target no rule matches takes the
    spec's `rank`. Every batch slice of a target (each layer, each expert) shares its rank: the factor of a
    target is one array (*batch, *rows, r).

    Example:
      >>> str(RankRule("mlp", 8))
      'mlp=8'
    """

    pattern: str
    rank: int

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str) or not self.pattern:
            raise TypeError(f"RankRule.pattern must be a non-empty str, got {self.pattern!r}")
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ValueError(f"RankRule.pattern {self.pattern!r} is not a valid regex: {e}") from e
        if isinstance(self.rank, bool) or not isinstance(self.rank, (int, np.integer)) or self.rank < 1:
            raise ValueError(f"RankRule {self.pattern!r}: rank must be a positive int, got {self.rank!r}")
        object.__setattr__(self, "rank", int(self.rank))

    def __str__(self) -> str:
        return f"{self.pattern}={self.rank}"


def parse_rank_rules(rules: str | Mapping[str, int] | Iterable[Any]) -> tuple[RankRule, ...]:
    """Rank rules from their text "pattern=rank, pattern=rank, ..." (a pattern holds no ','; it may hold '=',
    the rank follows the last one), a {pattern: rank} mapping (in its order), or RankRules / (pattern, rank)
    pairs. "" or an empty mapping: no rule.

    Raises:
      ValueError: an item without "=rank", a rank that is not a positive integer, an invalid regex or a pattern
        given twice (the message names the item).

    Example:
      >>> [str(r) for r in parse_rank_rules("mlp=8, attn=16")]
      ['mlp=8', 'attn=16']
    """
    if isinstance(rules, str):
        pairs = []
        for item in (x.strip() for x in rules.split(",")):
            if not item:
                continue
            pattern, eq, rank = item.rpartition("=")
            if not eq or not pattern.strip() or not rank.strip().lstrip("+").isdigit():
                raise ValueError(f"rank rule {item!r} is not 'pattern=rank' with a positive integer rank")
            pairs.append((pattern.strip(), int(rank)))
    elif isinstance(rules, Mapping):
        pairs = list(rules.items())
    else:
        pairs = [(r.pattern, r.rank) if isinstance(r, RankRule) else tuple(r) for r in rules]
    out = tuple(RankRule(*pair) for pair in pairs)
    patterns = [r.pattern for r in out]
    twice = sorted({p for p in patterns if patterns.count(p) > 1})
    if twice:
        raise ValueError(f"rank rules give the pattern(s) {twice} twice (the first match wins: drop the others)")
    return out


def resolve_rank(path: str, rank: int, rank_rules: Sequence[RankRule] = ()) -> tuple[int, RankRule | None]:
    """(the sketch rank of the target at canonical `path`, the rule that gave it or None for the default `rank`).

    Example:
      >>> resolve_rank("blocks.mlp.up_proj.kernel", 16, (RankRule("attn", 4), RankRule("mlp", 8)))
      (8, RankRule(pattern='mlp', rank=8))
    """
    for rule in rank_rules:
        if re.search(rule.pattern, path) is not None:
            return rule.rank, rule
    return rank, None


def check_rank_fits(targets: Mapping[str, Target] | Iterable[Target], rank: int,
                    rank_rules: Sequence[RankRule] = ()) -> None:
    """Raise ValueError if a target's sketch rank exceeds its width k, or a rank rule gives no target its rank.

    The projection A [r, k] of a target spans at most k directions: with r > k the sketch S = G Aᵀ [d, r] has
    r − k redundant columns (memory and compute for nothing) and RowAdam's moments are no longer those of a
    rank-r sketch. k is the product of the target's width axes (`Target.k`, from its MatrixDims). Each target's
    rank is the first matching rank rule's, else `rank` (`resolve_rank`).

    Args:
      targets: {path: Target} as returned by `find_targets`, or Targets.
      rank: the sketch rank r of targets no rank rule matches.
      rank_rules: RankRule sequence (first match wins).

    Raises:
      ValueError: a rank rule that gives no target its rank (it matches none, or only targets an earlier rule
        took), naming the rule and the targets; or, naming the narrowest target (path, shape, width k) and the
        rule that set its rank, a rank above a target's width, with how many targets are narrower than it.

    Example:
      >>> import jax.numpy as jnp
      >>> targets = find_targets({"q_proj": {"kernel": jnp.zeros((8, 4))}})
      >>> check_rank_fits(targets, 8)
      >>> check_rank_fits(targets, 16)
      Traceback (most recent call last):
      ...
      ValueError: rank 16 exceeds the width k = 8 of target 'q_proj.kernel' (shape (8, 4), width axes (0,); ...
      >>> check_rank_fits(targets, 16, (RankRule("q_proj", 32),))
      Traceback (most recent call last):
      ...
      ValueError: rank rule 'q_proj=32': rank 32 exceeds the width k = 8 of target 'q_proj.kernel' ...
    """
    values = list(targets.values() if isinstance(targets, Mapping) else targets)
    groups: dict[RankRule | None, list[Target]] = {rule: [] for rule in rank_rules}
    for t in values:
        r, rule = resolve_rank(t.path, rank, rank_rules)
        groups.setdefault(rule, []).append(t)
    for rule in rank_rules:
        if not groups[rule]:
            raise ValueError(f"rank rule {str(rule)!r} gives no target its rank: its pattern matches none of the "
                             f"targets {[t.path for t in values]} that an earlier rule did not take")
    for rule, group in groups.items():
        r = rank if rule is None else rule.rank
        narrow = [t for t in group if r > t.k]
        if narrow:
            t = min(narrow, key=lambda x: x.k)  # the narrowest (the first of them in order on a tie)
            where = "" if rule is None else f"rank rule {str(rule)!r}: "
            raise ValueError(
                f"{where}rank {r} exceeds the width k = {t.k} of target {t.path!r} (shape {t.shape}, width axes "
                f"{t.dims.width}; {len(narrow)} target(s) narrower than the rank): the projection A [r, k] spans "
                f"at most k directions. Choose rank <= {min(x.k for x in narrow)}, give such targets a smaller rank "
                "by a rank rule, or leave them out of the target rules.")


def _named_sharding(x: Any) -> NamedSharding | None:
    """x's NamedSharding when x is a concrete (not traced) jax.Array placed by one, else None."""
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and isinstance(x.sharding, NamedSharding):
        return x.sharding
    return None


def place_rows(x: jax.Array, target: Target, weight: Any) -> jax.Array:
    """Place per-row state x (*batch_shape, *rows_shape, ...) of `target` by `Target.state_spec` of `weight`'s
    sharding (the target's kernel).

    Only concrete weights carrying a NamedSharding are followed (an eager `init` on sharded parameters); under
    jit or eval_shape `x` is returned unchanged and its sharding comes from the caller's out_shardings
    (`logra_jax.parallel.sharding.opt_state_shardings` with the targets, which uses the same `Target.state_spec`).
    """
    sharding = _named_sharding(weight)
    if sharding is None:
        return x
    spec = target.state_spec(x.shape, sharding.spec, sharding.mesh)
    if spec is None:
        raise ValueError(f"place_rows: state of shape {tuple(x.shape)} is not laid out per row of target "
                         f"{target.path!r} (shape {target.shape}; expected {(*target.batch_shape, *target.rows_shape)}"
                         " followed by the state's own dims)")
    return jax.device_put(x, NamedSharding(sharding.mesh, spec))


def zero_row_moments(params: Any, targets: Mapping[str, Target]) -> dict[str, jax.Array]:
    """{path: float32 zeros (*batch_shape, *rows_shape)} for each of `targets` found in `params`, in tree order,
    each placed like its kernel's rows (`place_rows`): the initial row moments of RowAdam and its dense ablation.
    """
    return {t.path: place_rows(jnp.zeros((*t.batch_shape, *t.rows_shape), jnp.float32), t, weight)
            for keypath, weight in jax.tree_util.tree_flatten_with_path(params)[0]
            if (t := targets.get(path_str(keypath))) is not None}


def place_replicated(x: jax.Array, params: Any) -> jax.Array:
    """Replicate x on the mesh of the first NamedSharding-placed concrete leaf of `params` (else unchanged), so
    that scalar state keeps its placement through jitted updates on sharded parameters."""
    for leaf in jax.tree.leaves(params):
        sharding = _named_sharding(leaf)
        if sharding is not None:
            return jax.device_put(x, NamedSharding(sharding.mesh, PartitionSpec()))
    return x
