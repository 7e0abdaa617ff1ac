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
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from logra_jax.kernels.backend import Implementation, check_kernel_settings
from logra_jax.kernels.merge import merge as merge_kernel
from logra_jax.optim.projection import (
    Distribution,
    check_nonneg_int,
    check_projection_args,
    digest_words,
    key_from_digest,
    projection,
)
from logra_jax.optim.targets import Target

_HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class LowRankMeta:
    """Static description of a low-rank update: which target, how its projections are regenerated, and how it is
    merged (bf16 rounding of the factor; `implementation` "xla" | "pallas" of the merge, `interpret` for Pallas on
    CPU)."""

    target: Target
    base_seed: int
    rank: int
    distribution: Distribution
    refresh: bool
    round_bf16: bool
    implementation: Implementation = "xla"
    interpret: bool = False


@jax.tree_util.register_pytree_with_keys_class
class LowRankUpdate:
    """Update of one target: dense equivalent ΔW = U·A (+ c·W), with U = `factor`, A from the seed triple.

    Children (traced): factor (*batch_shape, *rows_shape, r) float32; step int32 scalar (completed updates when
    the sketch was taken); decay: None or a float32 scalar c. Static: `meta` (LowRankMeta: target, base_seed,
    rank, distribution, refresh, round_bf16, implementation, interpret). The projection of batch slice i is drawn
    for step `step if refresh else 0` and path "target.path.i" (just the path when the target has no batch axes).

    Generic optax transforms treat every leaf as a float: place them before `scale_by_sketch` (on the dense
    gradient), not after it, or they would also rescale `step`. Post-sketch transforms in logra_jax.optim
    act on `factor` (and `decay`) only.

    Raises:
      TypeError/ValueError: a bad target, rank, distribution, base_seed or implementation, or a factor of the
        wrong shape.

    Example:
      >>> import jax.numpy as jnp
      >>> from logra_jax.optim.targets import find_targets
      >>> t = find_targets({"q_proj": {"kernel": jnp.zeros((8, 4))}})["q_proj.kernel"]
      >>> u = LowRankUpdate(jnp.ones((4, 2)), jnp.int32(0), target=t, base_seed=42, rank=2)
      >>> u.to_dense().shape
      (8, 4)
    """

    def __init__(self, factor: jax.Array, step: jax.Array | int, *, target: Target, base_seed: int, rank: int,
                 distribution: Distribution = "rademacher", refresh: bool = True, round_bf16: bool = False,
                 decay: jax.Array | None = None, implementation: Implementation = "xla", interpret: bool = False):
        if not isinstance(target, Target):
            raise TypeError(f"target must be a Target, got {target!r}")
        check_projection_args(rank, distribution)
        check_nonneg_int("base_seed", base_seed)
        expected = (*target.batch_shape, *target.rows_shape, rank)
        if tuple(jnp.shape(factor)) != expected:
            raise ValueError(f"LowRankUpdate for {target.path}: factor shape must be {expected} "
                             f"(*batch, *rows, rank), got {tuple(jnp.shape(factor))}")
        self.factor = factor
        self.step = jnp.asarray(step, jnp.int32)
        self.decay = decay
        self.meta = LowRankMeta(target=target, base_seed=int(base_seed), rank=int(rank),
                                distribution=distribution, refresh=bool(refresh), round_bf16=bool(round_bf16),
                                **_merge_settings(implementation, interpret, f"LowRankUpdate for {target.path}"))

    @property
    def target(self) -> Target:
        return self.meta.target

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
                f"step={self.step!r}, decay={self.decay!r}, rank={self.meta.rank}, "
                f"distribution={self.meta.distribution!r}, refresh={self.meta.refresh})")

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
        settings = _merge_settings(implementation, interpret, f"LowRankUpdate for {self.meta.target.path}")
        return LowRankUpdate.tree_unflatten(dataclasses.replace(self.meta, **settings),
                                            (self.factor, self.step, self.decay))

    def check_step(self) -> None:
        """Raise TypeError unless `step` is an int32 scalar (a generic float transform after sketching breaks it)."""
        dtype = getattr(self.step, "dtype", None)
        if dtype != jnp.int32 or jnp.shape(self.step) != ():
            raise TypeError(
                f"LowRankUpdate for {self.meta.target.path}: step must be an int32 scalar, got {self.step!r}. "
                "A generic optax transform was probably placed after scale_by_sketch; put it before (on the "
                "dense gradient) or use the low-rank-aware transforms of logra_jax.optim.")

    def _draw(self) -> tuple[_Draw, jax.Array, np.ndarray]:
        """Static projection settings, the step the projections are drawn for (0 without refresh), digests."""
        self.check_step()
        m = self.meta
        step = self.step if m.refresh else jnp.zeros((), jnp.int32)
        return (m.target.geometry, m.base_seed, m.rank, m.distribution), step, digest_words(m.target.slice_paths)

    def wire_factor(self) -> jax.Array:
        """The factor as merged: rounded to bf16 when `round_bf16` (the wire format), as float32."""
        u = self.factor.astype(jnp.bfloat16) if self.meta.round_bf16 else self.factor
        return u.astype(jnp.float32)

    def projection_gram(self) -> jax.Array:
        """A_l A_lᵀ for every batch slice l: (num_slices, r, r) float32, one A in memory at a time.

        ‖U_l A_l‖²_F = ⟨U_l (A_l A_lᵀ), U_l⟩ needs only this r×r Gram matrix, never U_l A_l.
        """
        return _gram(*self._draw())

    def to_dense(self, weight: jax.Array | None = None) -> jax.Array:
        """The dense update (weight layout, float32) that `apply_updates` adds: U·A, plus c·W with a decay.

        Args:
          weight: the current weight; required only when `decay` is set.

        Raises:
          ValueError: `decay` is set and `weight` is None.
        """
        draw, step, digests = self._draw()
        delta = _dense(draw, self.wire_factor(), step, digests)
        if self.decay is not None:
            if weight is None:
                raise ValueError(f"LowRankUpdate for {self.meta.target.path} has a decay term: to_dense needs "
                                 "the weight")
            delta = delta + self.decay * jnp.asarray(weight, jnp.float32)
        return delta

    def merge(self, weight: jax.Array) -> jax.Array:
        """W ← (1 + c)·W + U·A, one batch slice at a time (never more than one slice's ΔW in memory; with
        implementation "pallas" never more than one block of it)."""
        m = self.meta
        t = m.target
        if tuple(jnp.shape(weight)) != t.shape:
            raise ValueError(f"apply_updates: parameter {t.path} has shape {tuple(jnp.shape(weight))}, its "
                             f"low-rank update expects {t.shape}")
        draw, step, digests = self._draw()
        return _merge(draw, (m.implementation, m.interpret), self.wire_factor(), step, digests, self.decay, weight)


def _merge_settings(implementation: str, interpret: bool, where: str) -> dict[str, Any]:
    implementation, interpret = check_kernel_settings(implementation, interpret, where)
    return {"implementation": implementation, "interpret": interpret}


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


@functools.partial(jax.jit, static_argnums=(0, 1))
def _merge(draw: _Draw, how: tuple[str, bool], u: jax.Array, step: jax.Array, digests: jax.Array,
           decay: jax.Array | None, weight: jax.Array) -> jax.Array:
    t = draw[0]
    implementation, interpret = how
    u = u.reshape(t.num_slices, *t.rows_shape, draw[2])
    w = to_slices(weight, t)

    def body(i: jax.Array, w: jax.Array) -> jax.Array:
        w_i = w[i]
        if decay is not None:
            w_i = (1.0 + decay.astype(jnp.float32)) * w_i.astype(jnp.float32)
        if implementation == "pallas":
            merged = _slice_merge_kernel(draw, step, u[i], digests[i], w_i, interpret)
        else:
            merged = w_i.astype(jnp.float32) + _slice_delta(draw, step, u[i], digests[i])
        return w.at[i].set(merged.astype(w.dtype))

    return _from_slices(jax.lax.fori_loop(0, t.num_slices, body, w), t)


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


def apply_updates(params: Any, updates: Any) -> Any:
    """params + updates, merging low-rank leaves: W ← (1 + c)·W + bf16?(U)·A layer by layer.

    Each low-rank leaf is merged by its own `meta.implementation` ("xla" or "pallas", set by the optimizer, e.g.
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
      >>> u = LowRankUpdate(jnp.ones((4, 2)), 0, target=t, base_seed=42, rank=2)
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
