"""Low-rank updates: the factor U plus the seed triple, merged layer by layer as W ← W + U·A.

Sign convention = optax's: an update is ADDED to the parameter, so the LoGRA step W ← W − D·A arrives here as
U = −D (the chain negates at its end). Per batch slice i (one layer) of a target,
  ΔW_i = bf16?(U_i) · A_i        (U_i [*rows, r] widened to float32, A_i [r, k] regenerated from the seed triple)
  W_i ← ((1 + c)·W_i + ΔW_i)     in float32, cast back to W's dtype,
where c is the optional dense decay coefficient (decoupled weight decay, NeMo variant; None = 0) and the bf16
rounding of U (the "wire" format) is on when `round_bf16` is set. The merge runs with the update's
`implementation`: "xla" (one einsum per slice) or "pallas" (`logra_jax.kernels.merge`, block-tiled, the slice
updated in place; `interpret=True` on CPU). Both compute the same formula but need not agree to the last bit, so
the implementation is part of the update's static fields: a rollout engine that receives (U, step) and the static
fields (implementation included) repeats exactly this arithmetic.

The dense route (`to_dense(W)`, used by `densify_lowrank` and `logra(..., dense_updates=True)`) returns a float32
ΔW such that optax's own merge, W ← dtype_W(float32(W) + ΔW) (`optax.apply_updates` promotes W + ΔW to float32),
gives the merged weight bit for bit:
  without decay:  ΔW = bf16?(U)·A                       W + ΔW is the very sum the "xla" merge rounds;
  with decay c:   ΔW = float32(merge(W)) − float32(W)   exact (Sterbenz) wherever the new weight lies in
                                                        [W/2, 2W], i.e. for any step smaller than half of W.
Generic optax transforms cannot act on a LowRankUpdate (they would treat its int32 `step` as a float and do not
see ΔW = U·A): every consumer here checks the update (`check_step`) and raises MISUSE_ADVICE.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from logra_jax.kernels.backend import Implementation
from logra_jax.kernels.merge import merge as merge_kernel
from logra_jax.optim.projection import digest_words, key_from_digest, projection
from logra_jax.optim.spec import SketchSpec
from logra_jax.optim.targets import Target

_HIGHEST = jax.lax.Precision.HIGHEST

MISUSE_ADVICE = (
    "generic optax transforms cannot follow logra / scale_by_sketch: they treat a LowRankUpdate's int32 step as a "
    "float and never see its dense ΔW = U·A. Put generic transforms before logra (they then act on the dense "
    "gradient), use the low-rank versions after it (logra_jax.optim.scale_lowrank, add_decayed_weights_lowrank, "
    "clip_by_global_norm_lowrank), or build logra(..., dense_updates=True), whose updates are dense ΔW arrays "
    "that any optax transform may follow and optax.apply_updates / nnx.Optimizer merge.")
# Attribute set on the update function of a transform that accepts LowRankUpdate leaves (`mark_lowrank_aware`).
LOWRANK_AWARE_ATTR = "logra_lowrank_aware"


@dataclasses.dataclass(frozen=True)
class LowRankMeta:
    """Static description of a low-rank update: which target, and the SketchSpec its projections are regenerated
    and it is merged by (rank, or the target's own by a rank rule, seed base, distribution, refresh, bf16 rounding
    of the factor, and `implementation` "xla" | "pallas" of the merge with `interpret` for Pallas on CPU)."""

    target: Target
    spec: SketchSpec


@jax.tree_util.register_pytree_with_keys_class
class LowRankUpdate:
    """Update of one target: dense equivalent ΔW = U·A (+ c·W), with U = `factor`, A from the seed triple.

    Children (traced): factor (*batch_shape, *rows_shape, r) float32 (r = `rank`, the spec's rank for this
    target: `SketchSpec.rank_for(target.path)`); step int32 scalar (completed updates when
    the sketch was taken); decay: None or a float32 scalar c. Static: `meta` (LowRankMeta: the target and the
    SketchSpec). The projection of batch slice i is drawn for step `spec.draw_step(step)` and path
    "target.path.i" (just the path when the target has no batch axes).

    Generic optax transforms treat every leaf as a float (they would rescale `step`, or fail on it) and never see
    ΔW: place them before `scale_by_sketch` / `logra` (on the dense gradient). After it, use the low-rank-aware
    transforms of logra_jax.optim (scale_lowrank, add_decayed_weights_lowrank, clip_by_global_norm_lowrank), which
    act on `factor` (and `decay`) only, or turn the updates dense with `densify_lowrank()` /
    `logra(..., dense_updates=True)`. `logra` refuses a generic successor at trace time, every consumer of a
    LowRankUpdate (apply_updates, to_dense, the update ratio) refuses a broken one (`check_step`), and `W + u`
    (optax.apply_updates) raises TypeError; each error says this.

    Raises:
      TypeError/ValueError: a target that is not a Target, a spec that is not a SketchSpec, or a factor of the
        wrong shape.

    Example:
      >>> import jax.numpy as jnp
      >>> from logra_jax.optim.targets import find_targets
      >>> t = find_targets({"q_proj": {"kernel": jnp.zeros((8, 4))}})["q_proj.kernel"]
      >>> u = LowRankUpdate(jnp.ones((4, 2)), jnp.int32(0), target=t, spec=SketchSpec(rank=2))
      >>> u.to_dense().shape
      (8, 4)
    """

    def __init__(self, factor: jax.Array, step: jax.Array | int, *, target: Target, spec: SketchSpec,
                 decay: jax.Array | None = None):
        if not isinstance(target, Target):
            raise TypeError(f"target must be a Target, got {target!r}")
        if not isinstance(spec, SketchSpec):
            raise TypeError(f"LowRankUpdate for {target.path}: spec must be a SketchSpec, got {spec!r}")
        expected = (*target.batch_shape, *target.rows_shape, spec.rank_for(target.path))
        if tuple(jnp.shape(factor)) != expected:
            raise ValueError(f"LowRankUpdate for {target.path}: factor shape must be {expected} "
                             f"(*batch, *rows, rank), got {tuple(jnp.shape(factor))}")
        self.factor = factor
        self.step = jnp.asarray(step, jnp.int32)
        self.decay = decay
        self.meta = LowRankMeta(target=target, spec=spec)

    @property
    def target(self) -> Target:
        return self.meta.target

    @property
    def spec(self) -> SketchSpec:
        return self.meta.spec

    @property
    def rank(self) -> int:
        """This target's sketch rank r: the spec's `rank_for(target.path)`."""
        return self.meta.spec.rank_for(self.meta.target.path)

    def tree_flatten_with_keys(self) -> tuple[tuple[tuple[Any, Any], ...], LowRankMeta]:
        children = ((jax.tree_util.GetAttrKey("factor"), self.factor),
                    (jax.tree_util.GetAttrKey("step"), self.step),
                    (jax.tree_util.GetAttrKey("decay"), self.decay))
        return children, self.meta

    @classmethod
    def tree_unflatten(cls, meta: LowRankMeta, children: Any) -> LowRankUpdate:
        # Bypass __init__: jax rebuilds nodes with placeholders (None, tracers, sentinels) as children.
        new = object.__new__(cls)
        new.factor, new.step, new.decay = children
        new.meta = meta
        return new

    def __repr__(self) -> str:
        return (f"LowRankUpdate(path={self.meta.target.path!r}, factor={getattr(self.factor, 'shape', self.factor)}, "
                f"step={self.step!r}, decay={self.decay!r}, rank={self.rank}, "
                f"distribution={self.spec.distribution!r}, refresh={self.spec.refresh})")

    def _refuse_arithmetic(self, other: Any) -> Any:
        raise TypeError(f"LowRankUpdate for {self.meta.target.path} cannot be added to an array: merge low-rank "
                        "updates with logra_jax.optim.apply_updates, or build logra(..., dense_updates=True) for "
                        "optax.apply_updates / nnx.Optimizer. " + MISUSE_ADVICE)

    # optax.apply_updates computes `p + u`: say what to do instead of "unsupported operand type(s)".
    __add__ = __radd__ = __sub__ = __rsub__ = _refuse_arithmetic

    def replace(self, **children: Any) -> LowRankUpdate:
        """A copy with some of the children (factor, step, decay) replaced."""
        unknown = set(children) - {"factor", "step", "decay"}
        if unknown:
            raise ValueError(f"LowRankUpdate.replace: unknown field(s) {sorted(unknown)}")
        values = {"factor": self.factor, "step": self.step, "decay": self.decay, **children}
        return LowRankUpdate.tree_unflatten(self.meta, (values["factor"], values["step"], values["decay"]))

    def with_merge(self, implementation: Implementation, interpret: bool = False) -> LowRankUpdate:
        """The same update, merged by `implementation` ("xla" | "pallas"; `interpret` runs Pallas on CPU).

        Raises:
          ValueError: an unknown implementation; TypeError: a non-bool interpret.
        """
        try:
            spec = self.spec.with_merge(implementation, interpret)
        except (TypeError, ValueError) as e:
            raise type(e)(f"LowRankUpdate for {self.meta.target.path}: {e}") from e
        meta = LowRankMeta(self.meta.target, spec)
        return LowRankUpdate.tree_unflatten(meta, (self.factor, self.step, self.decay))

    def check_step(self) -> None:
        """Raise TypeError (with MISUSE_ADVICE) unless `step` is an int32 scalar and `factor` a floating array of
        shape (*batch, *rows, rank): what a generic optax transform placed after the sketch breaks."""
        t = self.meta.target
        expected = (*t.batch_shape, *t.rows_shape, self.rank)
        dtype = getattr(self.step, "dtype", None)
        if dtype != jnp.int32 or jnp.shape(self.step) != ():
            problem = f"step must be an int32 scalar, got {self.step!r}"
        elif (tuple(jnp.shape(self.factor)) != expected
              or not jnp.issubdtype(getattr(self.factor, "dtype", np.dtype(object)), jnp.floating)):
            problem = (f"factor must be a float array of shape {expected} (*batch, *rows, rank), got "
                       f"{getattr(self.factor, 'dtype', type(self.factor).__name__)}{tuple(jnp.shape(self.factor))}")
        else:
            return
        raise TypeError(f"LowRankUpdate for {t.path}: {problem}. A generic optax transform probably ran after "
                        f"the sketch: {MISUSE_ADVICE}")

    def _draw(self) -> tuple[_Draw, jax.Array, np.ndarray]:
        """Static projection settings, the step the projections are drawn for (`SketchSpec.draw_step`), digests."""
        self.check_step()
        spec, t = self.spec, self.meta.target
        step = spec.draw_step(self.step)
        return (t.geometry, spec.base_seed, self.rank, spec.distribution), step, digest_words(t.slice_paths)

    def wire_factor(self) -> jax.Array:
        """The factor as merged: rounded to bf16 when `round_bf16` (the wire format), as float32."""
        u = self.factor.astype(jnp.bfloat16) if self.spec.round_bf16 else self.factor
        return u.astype(jnp.float32)

    def projection_gram(self) -> jax.Array:
        """A_l A_lᵀ for every batch slice l: (num_slices, r, r) float32, one A in memory at a time.

        ‖U_l A_l‖²_F = ⟨U_l (A_l A_lᵀ), U_l⟩ needs only this r×r Gram matrix, never U_l A_l.
        """
        return _gram(*self._draw())

    def to_dense(self, weight: jax.Array | None = None) -> jax.Array:
        """The dense update (weight layout, float32) that adds to W like `apply_updates` merges it.

          no decay:  ΔW = bf16?(U)·A                                   (the very term the merge adds to W)
          decay c:   ΔW = float32(merge(W)) − float32(W),  merge(W) = dtype_W((1 + c)·W + bf16?(U)·A)
        so dtype_W(float32(W) + ΔW), which is what `optax.apply_updates(W, ΔW)` computes, is the merged weight
        bit for bit: without decay always for the "xla" merge (same float32 sum, same rounding; a "pallas" merge
        agrees to its kernel's rounding), with decay wherever the subtraction is exact (the new weight within
        [W/2, 2W], e.g. any step smaller than half of W), and otherwise to within a rounding of it.

        Args:
          weight: the current weight; required only when `decay` is set.

        Raises:
          ValueError: `decay` is set and `weight` is None, or `weight` has the wrong shape.
          TypeError: a broken update (see `check_step`).
        """
        draw, step, digests = self._draw()
        if self.decay is None:
            return _dense(draw, self.wire_factor(), step, digests)
        if weight is None:
            raise ValueError(f"LowRankUpdate for {self.meta.target.path} has a decay term: to_dense needs "
                             "the weight")
        # The merge's own result minus W: exact (Sterbenz) where the new weight is within [W/2, 2W], so W + ΔW
        # rounds to the merged weight whatever the compiler fuses ((1 + c)·W + U·A may become an FMA).
        merged = self.merge(weight)
        return merged.astype(jnp.float32) - jnp.asarray(weight).astype(jnp.float32)

    def dense_norm_sq(self, weight: jax.Array | None = None) -> jax.Array:
        """‖ΔW‖²_F (float32 scalar) of the dense update ΔW = bf16?(U)·A + c·W without forming it:
          Σ_l ⟨U_l (A_l A_lᵀ), U_l⟩ + 2c ⟨U_l, W_l A_lᵀ⟩ + c² ‖W_l‖²     (one A_l [r, k] in memory at a time).

        Args:
          weight: the current weight; required only when `decay` is set.

        Raises:
          ValueError: `decay` is set and `weight` is None, or `weight` has the wrong shape.
        """
        draw, step, digests = self._draw()
        if self.decay is not None:
            if weight is None:
                raise ValueError(f"LowRankUpdate for {self.meta.target.path} has a decay term: its norm needs "
                                 "the weight")
            self._check_weight(weight, "dense_norm_sq")
        return _norm_sq(draw, self.wire_factor(), step, digests, self.decay, weight)

    def _check_weight(self, weight: jax.Array, where: str) -> None:
        t = self.meta.target
        if tuple(jnp.shape(weight)) != t.shape:
            raise ValueError(f"{where}: parameter {t.path} has shape {tuple(jnp.shape(weight))}, its "
                             f"low-rank update expects {t.shape}")

    def merge(self, weight: jax.Array) -> jax.Array:
        """W ← (1 + c)·W + U·A, one batch slice at a time (never more than one slice's ΔW in memory; with
        implementation "pallas" never more than one block of it).

        With `spec.stochastic_round` (`optimizer.weight_dtype="bfloat16"`) a bfloat16 weight takes the float32 sum
        rounded stochastically (`stochastic_round_bf16`: up or down with the probabilities that make the rounding
        unbiased), from a key of (seed, this update's step, the slice's path) apart from the projections' keys:
        every holder of the weights that applies the same update gets the same bits, and no update smaller than
        bfloat16's spacing is lost on average. With implementation "pallas" the merge kernel then forms the
        float32 sum (the slice widened to float32 first) and the rounding follows in XLA. Without it a bfloat16
        weight rounds to nearest, as optax does.
        """
        spec = self.spec
        self._check_weight(weight, "apply_updates")
        draw, step, digests = self._draw()
        return _merge(draw, (spec.implementation, spec.interpret, spec.stochastic_round), self.wire_factor(), step,
                      digests, self.decay, weight, jnp.asarray(self.step, jnp.int32))


# (target geometry, base_seed, rank, distribution): everything static that selects the projections; the slices'
# digest words are an input, so targets of one shape share compiled code.
_Draw = tuple[Target, int, int, str]


def slice_projection(draw: _Draw, step: jax.Array, digest: jax.Array) -> jax.Array:
    """A [r, k] of one slice: draw = (target geometry, base seed, rank, distribution), its digest, the step."""
    geometry, base_seed, rank, distribution = draw
    return projection(key_from_digest(base_seed, step, digest), rank, geometry.k, distribution)


def _slice_delta(draw: _Draw, step: jax.Array, u_i: jax.Array, digest_i: jax.Array) -> jax.Array:
    """ΔW_i = U_i · A_i in the kernel's slice layout (batch axes removed), float32."""
    t, rank = draw[0], draw[2]
    weight, batch, rows, width = t.subscripts
    out = "".join(c for c in weight if c not in batch)
    a = slice_projection(draw, step, digest_i).reshape(rank, *t.width_shape)
    return jnp.einsum(f"{rows}z,z{width}->{out}", u_i, a, precision=_HIGHEST)


@functools.partial(jax.jit, static_argnums=0)
def _gram(draw: _Draw, step: jax.Array, digests: jax.Array) -> jax.Array:
    def gram(digest: jax.Array) -> jax.Array:
        a = slice_projection(draw, step, digest)
        return jnp.einsum("zk,yk->zy", a, a, precision=_HIGHEST)

    return jax.lax.map(gram, digests)


@functools.partial(jax.jit, static_argnums=0)
def _dense(draw: _Draw, u: jax.Array, step: jax.Array, digests: jax.Array) -> jax.Array:
    t = draw[0]
    u = u.reshape(t.num_slices, *t.rows_shape, draw[2])
    delta = jax.lax.map(lambda xs: _slice_delta(draw, step, *xs), (u, digests))
    return _from_slices(delta, t)


@functools.partial(jax.jit, static_argnums=0)
def _norm_sq(draw: _Draw, u: jax.Array, step: jax.Array, digests: jax.Array, decay: jax.Array | None,
             weight: jax.Array | None) -> jax.Array:
    """‖U·A + c·W‖²_F summed over slices, through A Aᵀ and W Aᵀ (never U·A)."""
    t, rank = draw[0], draw[2]
    w, batch, rows, width = t.subscripts
    slice_w = "".join(c for c in w if c not in batch)
    u = u.reshape(t.num_slices, *t.rows_shape, rank)
    w_slices = None if decay is None else to_slices(weight, t)

    def one(i: jax.Array) -> jax.Array:
        a = slice_projection(draw, step, digests[i])
        u_i = u[i]
        gram = jnp.einsum("zk,yk->zy", a, a, precision=_HIGHEST)
        sq = jnp.einsum(f"{rows}z,zy,{rows}y->", u_i, gram, u_i, precision=_HIGHEST)
        if decay is None:
            return sq
        w_i = w_slices[i].astype(jnp.float32)
        c = decay.astype(jnp.float32)
        w_at = jnp.einsum(f"{slice_w},z{width}->{rows}z", w_i, a.reshape(rank, *t.width_shape), precision=_HIGHEST)
        return sq + 2.0 * c * jnp.sum(u_i * w_at) + c * c * jnp.sum(jnp.square(w_i))

    return jnp.sum(jax.lax.map(one, jnp.arange(t.num_slices)))


def _slice_merge_kernel(draw: _Draw, step: jax.Array, u_i: jax.Array, digest_i: jax.Array, w_i: jax.Array,
                        interpret: bool) -> jax.Array:
    """w_i + U_i A_i by the Pallas merge kernel, which wants the slice as K [k, d]: a transpose (no-op for
    Flax-layout [k, d] kernels) and reshapes there and back."""
    t, rank = draw[0], draw[2]
    non_batch = [a for a in range(len(t.shape)) if a not in t.batch_axes]
    perm = [non_batch.index(a) for a in t.dims.width + t.dims.rows]
    kernel = jnp.transpose(w_i, perm).reshape(t.k, t.d)
    a = slice_projection(draw, step, digest_i)
    out = merge_kernel(kernel, u_i.reshape(t.d, rank), a, implementation="pallas", interpret=interpret)
    return jnp.transpose(out.reshape(*t.width_shape, *t.rows_shape), np.argsort(perm))


# Folded into a slice's key for the stochastic rounding of a bfloat16 merge: a stream apart from the projections'.
_ROUNDING_STREAM = 0x5352


def stochastic_round_bf16(x: jax.Array, key: jax.Array) -> jax.Array:
    """float32 → bfloat16, rounded up or down at random so that E[result] = x (for finite x within range).

    bfloat16 keeps the top 16 bits of a float32: adding 16 uniform random bits to the 16 that are dropped carries
    into the kept part with probability (dropped bits) / 2^16, i.e. the distance to the lower neighbour over the
    spacing (sign-magnitude, so negative values round likewise in magnitude). Non-finite values round to nearest.

    Example:
      >>> x = jnp.full((4096,), 1.0 + 2.0 ** -10, jnp.float32)  # an eighth of the way to the next bfloat16
      >>> y = stochastic_round_bf16(x, jax.random.key(0)).astype(jnp.float32)
      >>> sorted(set(y.tolist())), round(float(jnp.mean(y == 1.0)), 1)
      ([1.0, 1.0078125], 0.9)
    """
    x = x.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    noise = jax.random.bits(key, x.shape, jnp.uint32) >> 16
    rounded = jax.lax.bitcast_convert_type((bits + noise) & jnp.uint32(0xFFFF0000), jnp.float32)
    return jnp.where(jnp.isfinite(x), rounded, x).astype(jnp.bfloat16)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _merge(draw: _Draw, how: tuple[str, bool, bool], u: jax.Array, step: jax.Array, digests: jax.Array,
           decay: jax.Array | None, weight: jax.Array, update_step: jax.Array) -> jax.Array:
    t = draw[0]
    implementation, interpret, stochastic_round = how
    stochastic = stochastic_round and weight.dtype == jnp.bfloat16

    def one(u_i: jax.Array, digest_i: jax.Array, w_i: jax.Array) -> jax.Array:
        if decay is not None:
            w_i = (1.0 + decay.astype(jnp.float32)) * w_i.astype(jnp.float32)
        if implementation == "pallas":  # stochastic: the kernel sums in float32, the rounding follows in XLA
            merged = _slice_merge_kernel(draw, step, u_i, digest_i,
                                         w_i.astype(jnp.float32) if stochastic else w_i, interpret)
        else:
            merged = w_i.astype(jnp.float32) + _slice_delta(draw, step, u_i, digest_i)
        if stochastic:
            key = jax.random.fold_in(key_from_digest(draw[1], update_step, digest_i), _ROUNDING_STREAM)
            merged = stochastic_round_bf16(merged, key)
        return merged.astype(weight.dtype)

    # A loop over the first batch axis (layers), the slices of the others (experts [L, E, k, d]) merged together:
    # an axis split over devices stays split (expert parallelism: each device merges its own experts, where a
    # dynamic index into that axis would gather the whole weight onto every device).
    outer = t.batch_shape[0] if t.batch_shape else 1
    inner = t.num_slices // outer
    if inner > 1:
        one = jax.vmap(one)
    w = jnp.moveaxis(weight, t.batch_axes, tuple(range(len(t.batch_axes))))
    rest = w.shape[len(t.batch_axes):]
    w = w.reshape(outer, *((inner,) if inner > 1 else ()), *rest)
    u = u.reshape(*w.shape[:w.ndim - len(rest)], *t.rows_shape, draw[2])
    digests = digests.reshape(*w.shape[:w.ndim - len(rest)], digests.shape[-1])
    w = jax.lax.fori_loop(0, outer, lambda i, w: w.at[i].set(one(u[i], digests[i], w[i])), w)
    return jnp.moveaxis(w.reshape(*t.batch_shape, *rest), tuple(range(len(t.batch_axes))), t.batch_axes)


def to_slices(w: jax.Array, t: Target) -> jax.Array:
    """Kernel → (num_slices, *non-batch axes in weight order); a no-op view when batch axes lead."""
    w = jnp.moveaxis(w, t.batch_axes, tuple(range(len(t.batch_axes))))
    return w.reshape(t.num_slices, *w.shape[len(t.batch_axes):])


def _from_slices(x: jax.Array, t: Target) -> jax.Array:
    """Inverse of `to_slices`."""
    x = x.reshape(*t.batch_shape, *x.shape[1:])
    return jnp.moveaxis(x, tuple(range(len(t.batch_axes))), t.batch_axes)


def is_lowrank(x: Any) -> bool:
    """True for a LowRankUpdate (use as `is_leaf` when mapping over update trees).

    Example:
      >>> is_lowrank(1.0)
      False
    """
    return isinstance(x, LowRankUpdate)


def mark_lowrank_aware(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """`tx`, declared able to take LowRankUpdate leaves, so that logra accepts it as its successor in a chain.

    logra refuses (at trace time, see logra_jax.optim.alias) to be followed by a transform not so marked; the
    low-rank transforms of logra_jax.optim are marked already. Mark your own only if it handles LowRankUpdate
    leaves (acts on `factor` / `decay`, keeps `step`).

    Example:
      >>> import optax
      >>> is_lowrank_aware(mark_lowrank_aware(optax.identity()).update)
      True
    """
    tx = optax.with_extra_args_support(tx)

    def update_fn(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> tuple[Any, Any]:
        return tx.update(updates, state, params, **extra_args)

    setattr(update_fn, LOWRANK_AWARE_ATTR, True)
    return optax.GradientTransformationExtraArgs(tx.init, update_fn)


def is_lowrank_aware(update_fn: Any) -> bool:
    """True for the update function of a transform marked by `mark_lowrank_aware` (or built marked)."""
    return bool(getattr(update_fn, LOWRANK_AWARE_ATTR, False))


def apply_updates(params: Any, updates: Any) -> Any:
    """params + updates, merging low-rank leaves: W ← (1 + c)·W + bf16?(U)·A layer by layer.

    Each low-rank leaf is merged by its own `spec.implementation` ("xla" or "pallas", set by the optimizer, e.g.
    `logra(implementation=...)`), so a rollout engine rebuilding the same updates repeats the same arithmetic.
    Plain leaves add as in `optax.apply_updates` (result cast to the parameter's dtype); None or
    optax.MaskedNode updates leave the parameter unchanged.

    Args:
      params: the parameter tree (nested dicts, nnx.State, ...).
      updates: a tree with params' structure whose leaves are arrays, None, MaskedNode or LowRankUpdate.

    Returns:
      The updated parameters, same structure and dtypes as `params`.

    Example:
      >>> import jax.numpy as jnp
      >>> from logra_jax.optim.targets import find_targets
      >>> params = {"q_proj": {"kernel": jnp.zeros((8, 4))}, "b": jnp.zeros(3)}
      >>> t = find_targets(params)["q_proj.kernel"]
      >>> u = LowRankUpdate(jnp.ones((4, 2)), 0, target=t, spec=SketchSpec(rank=2))
      >>> new = apply_updates(params, {"q_proj": {"kernel": u}, "b": jnp.ones(3)})
      >>> bool(jnp.allclose(new["q_proj"]["kernel"], u.to_dense())), float(new["b"][0])
      (True, 1.0)
    """

    def one(p: Any, u: Any) -> Any:
        if u is None or isinstance(u, optax.MaskedNode):
            return p
        if isinstance(u, LowRankUpdate):
            return u.merge(p)
        return jnp.asarray(p + u).astype(jnp.asarray(p).dtype)

    return jax.tree.map(one, params, updates, is_leaf=lambda x: x is None)
