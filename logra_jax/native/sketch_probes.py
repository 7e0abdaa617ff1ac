"""Sketch-native mode: target layers hand the optimizer S = G Aᵀ directly; no dense gradient is ever formed.

`attach_sketch_probes(model, spec)` gives every LoGRA target Linear of an NNX model
  - a `SketchProbe` [*batch, d, r] (zeros; its gradient is the sketch S, logical axes follow the weight rows),
  - a `SketchDigest` [*batch, 2] (BLAKE2b digest words of each slice's canonical path, docs/method.md §2),
  - a hook that, inside `sketching(step)`, regenerates A = projection(seed(base, step, path)) per layer and runs
    `kernels.sketched_linear` (forward keeps X Aᵀ, backward returns Hᵀ(X Aᵀ) into the probe) with the spec's
    `implementation` ("xla" einsums, or the fused Pallas kernels; `interpret=True` runs those on CPU).
Outside a `sketching` block the hooked layers compute the plain y = x·K, so rollouts and evaluation are unchanged.
Inside `sketching(step, kind="tangent")` they compute y = x·K + (X Aᵀ)·Pᵀ, whose JVP with respect to the probes
with tangent U gives δy = (X Aᵀ) Uᵀ = X·ΔKᵀ-free: the factored form of the low-rank update ΔW = U·A, used by the
predicted-KL probe (docs/method.md §5) without building ΔW.

The step must be traced inside the function being jitted: enter `sketching` inside it, never around a jit call
(the jit cache does not see context variables).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.custom_derivatives import SymbolicZero

from logra_jax.kernels.project import sketched_linear
from logra_jax.models.layers import Linear
from logra_jax.models.moe import ExpertLinear
from logra_jax.native.expert_probes import sketched_ragged_linear, tangent_ragged_linear
from logra_jax.optim.projection import digest_words, key_from_digest, projection
from logra_jax.optim.spec import SketchSpec
from logra_jax.optim.targets import Target, find_targets


class SketchProbe(nnx.Variable):
    """Zero-valued receiver [*batch, d, r] whose gradient is the layer's sketch S = G Aᵀ (float32)."""


class SketchDigest(nnx.Variable):
    """uint32 [*batch, 2]: (hi, lo) words of the BLAKE2b digest of each slice's canonical parameter path."""


class _Mode(NamedTuple):
    kind: str
    step: jax.Array


_MODE: contextvars.ContextVar[_Mode | None] = contextvars.ContextVar("logra_sketch_mode", default=None)


@contextlib.contextmanager
def sketching(step: jax.Array | int, kind: Literal["sketch", "tangent"] = "sketch") -> Iterator[None]:
    """Make hooked target layers sketch (or accept tangents) with the projections of update `step`."""
    if kind not in ("sketch", "tangent"):
        raise ValueError(f"sketching: kind must be 'sketch' or 'tangent', got {kind!r}")
    token = _MODE.set(_Mode(kind, jnp.asarray(step, jnp.int32)))
    try:
        yield
    finally:
        _MODE.reset(token)


@dataclasses.dataclass(frozen=True)
class LowRankHook:
    """The callable installed on a target Linear; hashable so it can live in the NNX graphdef. `rank` is the
    target's own (`spec.rank_for(path)`)."""

    spec: SketchSpec
    rank: int

    def projection(self, step: jax.Array, digest: jax.Array, width: int) -> jax.Array:
        step = self.spec.draw_step(step)
        key = key_from_digest(self.spec.base_seed, step, digest)
        return projection(key, self.rank, width, self.spec.distribution)

    def __call__(self, x: jax.Array, kernel: jax.Array, probe: jax.Array, digest: jax.Array) -> jax.Array:
        mode = _MODE.get()
        if mode is None:
            return jnp.einsum("...k,kd->...d", x, kernel.astype(x.dtype))
        a = self.projection(mode.step, digest, kernel.shape[-2])
        if mode.kind == "sketch":
            return sketched_linear(x, jax.lax.stop_gradient(kernel), jax.lax.stop_gradient(a), probe,
                                   implementation=self.spec.implementation, interpret=self.spec.interpret)
        return _tangent_linear(x, kernel, a, probe)


@dataclasses.dataclass(frozen=True)
class ExpertLowRankHook:
    """The callable installed on a target ExpertLinear: (x [M, k] sorted by expert, kernel [E, k, d], probe
    [E, d, r], digest [E, 2], group_sizes [E]) → y [M, d]. Expert e draws its own A_e from digest[e]; inside
    `sketching` its sketch comes from its own tokens only (`logra_jax.native.expert_probes`, XLA ragged products
    whatever the spec's implementation). `rank` is the target's own (`spec.rank_for(path)`), every expert's."""

    spec: SketchSpec
    rank: int

    def projections(self, step: jax.Array, digests: jax.Array, width: int) -> jax.Array:
        """A [E, r, k] of update `step`, row e from the digest words digests[e]."""
        step = self.spec.draw_step(step)
        one = lambda digest: projection(key_from_digest(self.spec.base_seed, step, digest), self.rank, width,
                                        self.spec.distribution)
        return jax.vmap(one)(digests)

    def __call__(self, x: jax.Array, kernel: jax.Array, probe: jax.Array, digest: jax.Array,
                 group_sizes: jax.Array) -> jax.Array:
        mode = _MODE.get()
        if mode is None:
            return jax.lax.ragged_dot(x, kernel.astype(x.dtype), group_sizes)
        a = self.projections(mode.step, digest, kernel.shape[-2])
        if mode.kind == "sketch":
            return sketched_ragged_linear(x, jax.lax.stop_gradient(kernel), jax.lax.stop_gradient(a), probe,
                                          group_sizes)
        return tangent_ragged_linear(x, kernel, a, probe, group_sizes)


@jax.custom_jvp
def _tangent_linear(x: jax.Array, kernel: jax.Array, a: jax.Array, probe: jax.Array) -> jax.Array:
    """y = x·K + (X Aᵀ)·Pᵀ for a zero-valued probe P: the primal is x·K (no [*, d] product with zeros).

    Its JVP is δy = δx·K + x·δK + (X Aᵀ)·δPᵀ, with symbolic-zero tangents skipped: the probe's JVP forms only
    the products its tangent needs.
    """
    del a, probe  # the probe is the zero receiver attach_sketch_probes creates: it adds nothing to the primal
    return jnp.einsum("...k,kd->...d", x, kernel.astype(x.dtype))


def _tangent_linear_jvp(primals, tangents):
    x, kernel, a, probe = primals
    dx, dkernel, _, dprobe = tangents
    y = _tangent_linear(x, kernel, a, probe)
    terms = []
    if not isinstance(dx, SymbolicZero):
        terms.append(jnp.einsum("...k,kd->...d", dx.astype(x.dtype), kernel.astype(x.dtype)))
    if not isinstance(dkernel, SymbolicZero):
        terms.append(jnp.einsum("...k,kd->...d", x, dkernel.astype(x.dtype)))
    if not isinstance(dprobe, SymbolicZero):
        p = jnp.einsum("...k,rk->...r", x, a.astype(x.dtype))
        terms.append(jnp.einsum("...r,dr->...d", p, dprobe.astype(x.dtype)))
    return y, sum(terms[1:], terms[0]) if terms else jnp.zeros_like(y)


_tangent_linear.defjvp(_tangent_linear_jvp, symbolic_zeros=True)


def _module_at(model: nnx.Module, path: str) -> nnx.Module:
    node = model
    for name in path.split("."):
        node = node[int(name)] if name.isdigit() else getattr(node, name)
    return node


def attach_sketch_probes(model: nnx.Module, spec: SketchSpec) -> dict[str, Target]:
    """Install sketch probes, digests and hooks on every target Linear of `model` (in place).

    Args:
      model: an NNX model whose target weights are `Linear.kernel`s in Flax layout [*batch, k, d].
      spec: the SketchSpec (logra_jax.optim.spec): rank (each target's `spec.rank_for(path)`, by the rank rules),
        seed base, distribution and refresh of the projections,
        the target rules, and the `kernels.sketched_linear` implementation. Give the optimizer the same one
        (`logra(spec=spec)`): the train step reads it from the optimizer state.

    Returns:
      The targets found, by canonical path ("blocks.attn.q_proj.kernel").

    Raises:
      ValueError: no target matches, a target's rank exceeds its width or a rank rule gives no target its rank
        (`SketchSpec.check_fits`), or a target is not
        the kernel of a Linear with rows on the last axis and the width on the one before (sketch-native mode
        needs the layer to own its matmul).
    """
    if not isinstance(spec, SketchSpec):
        raise TypeError(f"attach_sketch_probes: spec must be a logra_jax.optim.SketchSpec, got {spec!r}")
    targets = find_targets(nnx.state(model, nnx.Param), spec.rules)
    spec.check_fits(targets)
    for path, target in targets.items():
        owner, _, leaf = path.rpartition(".")
        module = _module_at(model, owner) if owner else model
        ndim = len(target.shape)
        if leaf != "kernel" or not isinstance(module, (Linear, ExpertLinear)) or target.dims.rows != (ndim - 1,) \
                or target.dims.width != (ndim - 2,):
            raise ValueError(
                f"sketch-native mode needs target {path!r} to be a Linear or ExpertLinear kernel [*batch, k, d] with "
                f"rows=(-1,) and width=(-2,); got module {type(module).__name__} and dims {target.dims}")
        axes = module.kernel.get_metadata().get("axes")
        batch_axes = tuple(axes[:-2]) if axes else (None,) * len(target.batch_shape)
        n = int(np.prod(target.batch_shape, dtype=np.int64))
        slice_paths = [f"{path}.{i}" for i in range(n)] if target.batch_shape else [path]
        words = digest_words(slice_paths).reshape(*target.batch_shape, 2)
        rank = spec.rank_for(path)
        module.sketch_probe = SketchProbe(
            jnp.zeros((*target.batch_shape, *target.rows_shape, rank), jnp.float32),
            axes=(*batch_axes, axes[-1] if axes else None, None))
        module.sketch_digest = SketchDigest(jnp.asarray(words, jnp.uint32), axes=(*batch_axes, None))
        module.lowrank_hook = (ExpertLowRankHook if isinstance(module, ExpertLinear) else LowRankHook)(spec, rank)
    return targets


def check_probes_match(model: nnx.Module, spec: SketchSpec) -> None:
    """Raise ValueError unless every sketch probe hook of `model` draws its projections like `spec` (rank and rank
    rules, base seed, distribution, refresh): the optimizer's spec, which builds the step's LowRankUpdates, and the
    hooks, which sketched the gradient, must draw the same A."""
    for path, module in nnx.iter_modules(model):
        hook = getattr(module, "lowrank_hook", None)
        if hook is not None and not hook.spec.draws_like(spec):
            raise ValueError(f"the sketch probes of {'.'.join(map(str, path))} were attached with {hook.spec}, the "
                             f"optimizer sketches with {spec}: attach them with the optimizer's spec "
                             "(attach_sketch_probes(model, spec); logra(spec=spec))")
