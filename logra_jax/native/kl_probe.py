"""The predicted-KL probe: q of a proposed low-rank update on probe responses, and the realised KL (docs/method.md §5).

  p = softmax(z/T), u = δz/T,   q_t = ½ Σ_v p_v (u_v − Σ_w p_w u_w)²        (KL(π_θ ‖ π_θ+αΔ) = α² q + O(α³))
  q = Σ_t q_t / #t over the probed (generated) positions

δz is the JVP of the logits along the update, computed in factored form by the sketch-native hooks in tangent
mode (`sketch_probes.sketching(step, kind="tangent")`): δy = (X Aᵀ) Uᵀ at every target, never a dense ΔW. The
optax transform that turns q into a step scale is `logra_jax.optim.predicted_kl.scale_by_predicted_kl`; the
train step (`logra_jax.job.train_step`) hands it the probe built here.

Through a mixture-of-experts layer (`logra_jax.models.moe`) the routing is piecewise constant in the weights: the
JVP holds each token's top-k experts (and so the sorted grouping) fixed and differentiates everything else, the
router's softmax weights over those k experts included (they move with the layer's input), and each expert's
tangent is (X_e A_eᵀ) U_eᵀ on its own tokens (`logra_jax.native.expert_probes`). The realised KL re-routes: a token
whose top-k changes under the step contributes a jump the prediction cannot see, rare for the small steps the
controller takes (tests/native/test_moe_sketch.py checks predicted against realised on the tiny MoE).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from logra_jax.native.sketch_probes import SketchProbe, sketching
from logra_jax.optim.lowrank import LowRankUpdate, apply_updates
from logra_jax.parallel.sharding import batch_shards


def kl_quadratic(logits: jax.Array, dlogits: jax.Array, temperature: float = 1.0) -> jax.Array:
    """Per-position q_t = ½ Σ_v p_v (u_v − E_p[u])² with p = softmax(z/T), u = δz/T; float32 [...]."""
    z = logits.astype(jnp.float32) / temperature
    u = dlogits.astype(jnp.float32) / temperature
    p = jax.nn.softmax(z, axis=-1)
    mean_u = jnp.sum(p * u, axis=-1, keepdims=True)
    return 0.5 * jnp.sum(p * jnp.square(u - mean_u), axis=-1)


def exact_kl(logits: jax.Array, new_logits: jax.Array, temperature: float = 1.0) -> jax.Array:
    """Per-position KL(softmax(z/T) ‖ softmax(z'/T)) in float32 [...]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    logq = jax.nn.log_softmax(new_logits.astype(jnp.float32) / temperature, axis=-1)
    return jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)


def _chunked_positions(fn: Callable[..., jax.Array], arrays: tuple[jax.Array, ...], mask: jax.Array,
                       chunk: int) -> tuple[jax.Array, jax.Array]:
    """Σ_t fn(chunk)·mask and Σ mask over T-chunks of [B, T, ...] arrays (temporaries bounded by the chunk)."""
    B, T = mask.shape
    chunk = min(chunk, T)
    n = -(-T // chunk)
    pad = n * chunk - T
    padded = [jnp.pad(a, ((0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 2)) for a in arrays]
    maskp = jnp.pad(mask.astype(jnp.float32), ((0, 0), (0, pad)))
    split = [a.reshape(B, n, chunk, *a.shape[2:]).swapaxes(0, 1) for a in padded]
    masks = maskp.reshape(B, n, chunk).swapaxes(0, 1)

    def one(xs):
        *parts, m = xs
        return jnp.sum(fn(*parts) * m)

    sums = jax.lax.map(one, (*split, masks))
    return jnp.sum(sums), jnp.sum(maskp)


def predicted_kl_terms(hidden: jax.Array, dhidden: jax.Array, head: jax.Array, mask: jax.Array,
                       temperature: float = 1.0, chunk: int = 256) -> tuple[jax.Array, jax.Array]:
    """(Σ_t q_t, #t) over positions where mask is set, from final hidden states and their JVP.

    Args:
      hidden, dhidden: [B, T, D] final-norm hidden states and their tangent along the proposed update.
      head: the (frozen) output projection [D, V]; logits z = h·head, δz = δh·head.
      mask: [B, T] 1 at generated-token positions whose next-token distribution is probed.
      temperature: the sampling temperature T.
      chunk: positions per chunk, so the [B, chunk, V] temporaries stay bounded.

    Returns:
      (sum of q_t, count) as float32 scalars: reduce both across data-parallel shards before dividing.
    """
    # The head's compute-dtype copy is made once the hidden states exist (an ordering barrier, no arithmetic):
    # left free, the scheduler may cast it at the start of the step and hold it across the train step's peak.
    head, hidden, dhidden = jax.lax.optimization_barrier((head, hidden, dhidden))
    head = head.astype(hidden.dtype)

    def q_of(h, dh):
        z = jnp.einsum("btd,dv->btv", h, head, preferred_element_type=jnp.float32)
        dz = jnp.einsum("btd,dv->btv", dh, head.astype(dh.dtype), preferred_element_type=jnp.float32)
        return kl_quadratic(z, dz, temperature)

    return _chunked_positions(q_of, (hidden, dhidden), mask, chunk)


def realised_kl_terms(hidden: jax.Array, new_hidden: jax.Array, head: jax.Array, mask: jax.Array,
                      temperature: float = 1.0, chunk: int = 256, *, new_head: jax.Array | None = None
                      ) -> tuple[jax.Array, jax.Array]:
    """(Σ_t KL_t, #t): exact KL between the policies before and after an update, chunked like the prediction
    (`new_head`: the output projection after the update when it was trained too; default `head`)."""
    head2 = head if new_head is None else new_head
    # As in `predicted_kl_terms`: the compute-dtype heads are made once both hidden states exist.
    head, head2, hidden, new_hidden = jax.lax.optimization_barrier((head, head2, hidden, new_hidden))
    head, head2 = head.astype(hidden.dtype), head2.astype(new_hidden.dtype)

    def kl_of(h, h2):
        z = jnp.einsum("btd,dv->btv", h, head, preferred_element_type=jnp.float32)
        z2 = jnp.einsum("btd,dv->btv", h2, head2, preferred_element_type=jnp.float32)
        return exact_kl(z, z2, temperature)

    return _chunked_positions(kl_of, (hidden, new_hidden), mask, chunk)


def lowrank_factors(updates: Any) -> dict[str, jax.Array]:
    """{target path: factor} of every LowRankUpdate in an update tree (masked and plain leaves skipped)."""
    leaves = jax.tree.leaves(updates, is_leaf=lambda x: isinstance(x, LowRankUpdate))
    return {u.target.path: u.factor for u in leaves if isinstance(u, LowRankUpdate)}


def probe_passes(rows: int, passes: int | None = None) -> int:
    """How many sequential passes the probe's `rows` are split into: `passes`, or by default (None) one probe
    row per batch shard per pass (`logra_jax.parallel.sharding.batch_shards` under the active rules), so a device holds
    the JVP's activations of one response at a time whatever the number of probe responses (the largest
    divisor of `rows` up to rows / shards when the shards do not divide the rows).

    Raises:
      ValueError: passes < 1, or not a divisor of rows.
    """
    if passes is None:
        passes = max(d for d in range(1, max(1, rows // batch_shards()) + 1) if rows % d == 0)
    if passes < 1 or rows % passes:
        raise ValueError(f"probe passes must divide the probe's {rows} rows, got {passes}")
    return passes


def _split_rows(x: jax.Array, passes: int) -> jax.Array:
    """[B, ...] → [passes, B/passes, ...], rows interleaved (pass m holds rows m, m + passes, ...): each pass
    spreads evenly over the data-parallel shards of a batch sharded on its rows."""
    return x.reshape(x.shape[0] // passes, passes, *x.shape[1:]).swapaxes(0, 1)


def _join_rows(x: jax.Array) -> jax.Array:
    """The inverse of `_split_rows`: [passes, B/passes, ...] → [B, ...]."""
    return x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def make_kl_probe(graphdef: nnx.GraphDef, params: nnx.State, rest: nnx.State, step: jax.Array,
                  probe: Mapping[str, jax.Array], temperature: float = 1.0, chunk: int = 256, *,
                  passes: int | None = None) -> Callable[[Any], tuple[jax.Array, jax.Array]]:
    """kl_probe(updates) -> (Σ q_t, #t) for `scale_by_predicted_kl`, by one forward-mode JVP of the model.

    After a call, `kl_probe.hidden_before` holds the JVP's primal (the probe's final hidden states under
    `params`) for `realised_kl`, which then needs no copy of the old weights once the update is merged in place.

    The tangent of every target's sketch probe is its update factor U ([*batch, d, r]); in tangent mode the
    hooked layers add (X Aᵀ)·Pᵀ, so the JVP injects δy = (X Aᵀ) Uᵀ at every target output — the factored form of
    x·ΔWᵀ with ΔW = U·A, never built. Non-target updates are not part of the prediction (they are frozen in the
    paper's recipe).

    Args:
      graphdef, params, rest: the model split as `nnx.split(model, nnx.Param, ...)` with sketch probes attached.
      step: the update count whose projections the factors belong to.
      probe: 'tokens' [B, T], 'attention_mask' [B, T] and 'kl_mask' [B, T] (1 at the positions whose
        next-token distribution is probed: the positions that generated a response token).
      temperature: the sampling temperature.
      chunk: positions per chunk of the [B, chunk, V] temporaries.
      passes: run the JVP over the probe rows in this many sequential slices (`probe_passes`; default: one row
        per batch shard at a time). Σ q_t and #t are summed over the slices.
    """
    probes, others = nnx.split_state(rest, SketchProbe, ...)
    probe_paths = [(k, ".".join(map(str, k[:-1])) + ".kernel") for k, _ in nnx.to_flat_state(probes)]

    def features(probe_values: nnx.State, rows: Mapping[str, jax.Array]) -> jax.Array:
        with sketching(step, kind="tangent"):
            model = nnx.merge(graphdef, params, nnx.merge_state(probe_values, others))
            return model.features(rows["tokens"], attention_mask=rows["attention_mask"])

    def kl_probe(updates: Any) -> tuple[jax.Array, jax.Array]:
        with jax.named_scope("kl_probe"):  # names the probe's buffers in compiled memory reports
            return predict(updates)

    def predict(updates: Any) -> tuple[jax.Array, jax.Array]:
        factors = lowrank_factors(updates)
        flat = dict(nnx.to_flat_state(probes))
        tangent = nnx.from_flat_state([
            (k, flat[k].replace(factors[target].astype(jnp.float32) if target in factors
                                else jnp.zeros_like(flat[k][...])))
            for k, target in probe_paths])
        head = nnx.merge(graphdef, params, rest).head_weight()

        def one_pass(rows: Mapping[str, jax.Array]) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
            hidden, dhidden = jax.jvp(lambda pv: features(pv, rows), (probes,), (tangent,))
            return hidden, predicted_kl_terms(hidden, dhidden, head, rows["kl_mask"], temperature, chunk)

        n = probe_passes(probe["tokens"].shape[0], passes)
        if n == 1:
            hidden, terms = one_pass(probe)
        else:
            def body(carry, rows):
                hidden, (q, count) = one_pass(rows)
                return (carry[0] + q, carry[1] + count), hidden

            zero = jnp.zeros((), jnp.float32)
            terms, hiddens = jax.lax.scan(body, (zero, zero), {k: _split_rows(v, n) for k, v in probe.items()})
            hidden = _join_rows(hiddens)
        kl_probe.hidden_before = hidden  # the JVP's primal: the realised KL reuses it (no second old forward)
        return terms

    kl_probe.hidden_before = None
    return kl_probe


def realised_kl(graphdef: nnx.GraphDef, params: nnx.State, new_params: nnx.State, rest: nnx.State,
                probe: Mapping[str, jax.Array], temperature: float = 1.0, chunk: int = 256, *,
                hidden_before: jax.Array | None = None, passes: int | None = None) -> tuple[jax.Array, jax.Array]:
    """(Σ_t KL_t, #t): exact KL(π_params ‖ π_new_params) at the probed positions (probe as in `make_kl_probe`).

    hidden_before: the probe's final hidden states under `params` when already computed (`kl_probe.hidden_before`
    of `make_kl_probe`): then only the head of `params` is read, and the old weights need not outlive the merge.
    passes: forward the probe rows in this many sequential slices (`probe_passes`, as in `make_kl_probe`).
    """
    with jax.named_scope("realised_kl"):  # names the buffers in compiled memory reports
        old = nnx.merge(graphdef, params, rest)
        new = nnx.merge(graphdef, new_params, rest)

        def one_pass(rows: Mapping[str, jax.Array], h_old: jax.Array | None) -> tuple[jax.Array, jax.Array]:
            if h_old is None:
                h_old = old.features(rows["tokens"], attention_mask=rows["attention_mask"])
            h_new = new.features(rows["tokens"], attention_mask=rows["attention_mask"])
            return realised_kl_terms(h_old, h_new, old.head_weight(), rows["kl_mask"], temperature, chunk,
                                     new_head=new.head_weight())

        n = probe_passes(probe["tokens"].shape[0], passes)
        if n == 1:
            return one_pass(probe, hidden_before)

        def body(carry, xs):
            kl, count = one_pass(*xs)
            return (carry[0] + kl, carry[1] + count), None

        zero = jnp.zeros((), jnp.float32)
        rows = {k: _split_rows(v, n) for k, v in probe.items()}
        h_old = None if hidden_before is None else _split_rows(hidden_before, n)
        return jax.lax.scan(body, (zero, zero), (rows, h_old))[0]


def predicted_and_realised_kl(graphdef: nnx.GraphDef, params: nnx.State, rest: nnx.State, step: jax.Array,
                              updates: Any, probe: Mapping[str, jax.Array], temperature: float = 1.0,
                              chunk: int = 256) -> tuple[jax.Array, jax.Array]:
    """(predicted q, realised KL) per probed token for applying `updates` (LowRankUpdates, apply_updates) to
    `params`: the quadratic prediction and the exact KL(π_before ‖ π_after) on the same positions."""
    q_sum, count = make_kl_probe(graphdef, params, rest, step, probe, temperature, chunk)(updates)
    kl_sum, _ = realised_kl(graphdef, params, apply_updates(params, updates), rest, probe, temperature, chunk)
    denom = jnp.maximum(count, 1.0)
    return q_sum / denom, kl_sum / denom
