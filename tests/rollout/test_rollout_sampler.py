"""The slot engine's sampler against a full teacher-forced forward of the same model: greedy = argmax (and token
for token the plain batched greedy decoder), log-probs = log-softmax, EOS and masks, padding, seeding, top-k/top-p
exclusion; results independent of the schedule (slots, decode steps, length buckets); no recompilation."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from logra_jax.models.config import preset
from logra_jax.models.decoder import abstract_model, init_model, layer_source, per_layer_state
from logra_jax.models.greedy import greedy_generate
from logra_jax.rollout import slots as slots_lib
from logra_jax.rollout.sampling import SamplingConfig, filter_logits, sample_tokens
from logra_jax.rollout.slots import Sampler, generate
from logra_jax.rollout.sync import flat_params

P = 5
PROMPTS = np.array([[0, 0, 5, 6, 7], [9, 10, 11, 12, 13], [0, 0, 0, 40, 41]], np.int32)
MASK = PROMPTS != 0


@pytest.fixture(scope="module")
def model():
    # Untied head and weights 4x the init scale: sharper, more varied next-token distributions than the
    # 0.02-std tied init (which mostly repeats its input), so argmax gaps dwarf float error and samples vary.
    graphdef, state = nnx.split(init_model(preset("tiny", tie_embeddings=False), seed=1))
    state = jax.tree.map(lambda x: 4.0 * x if x.ndim >= 2 else x, state)
    return nnx.merge(graphdef, state)


@functools.partial(jax.jit, static_argnums=0)
def _full_logits(graphdef, state, tokens, mask):
    return nnx.merge(graphdef, state)(tokens, attention_mask=mask)


def _step_logits(model, out):
    """Logits that predicted each response token, from one full forward over [prompt | response]: [R, N, V]."""
    graphdef, state = nnx.split(model)
    logits = np.asarray(_full_logits(graphdef, state, out.tokens, out.attention_mask()), np.float64)
    return logits[:, P - 1:-1]


def _log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_greedy_equals_argmax_of_full_forward_and_padding_side_does_not_matter(model):
    sampler = Sampler(model, SamplingConfig(max_new_tokens=10, eos_id=1, pad_id=0, temperature=0.0))
    out = sampler(jnp.asarray(PROMPTS), jnp.asarray(MASK), jax.random.key(0))
    assert out.tokens.shape == (3, P + 10) and out.logprobs.shape == (3, 10)
    np.testing.assert_array_equal(out.tokens[:, :P], PROMPTS)  # already left-padded: unchanged
    z = _step_logits(model, out)
    response = np.asarray(out.tokens[:, P:])
    valid = np.asarray(out.response_mask)
    chosen = np.take_along_axis(z, response[..., None], -1)[..., 0]
    # The sampled token is the argmax of the full forward (up to float ties far below the observed gaps).
    assert np.all((chosen >= z.max(-1) - 1e-4)[valid])
    np.testing.assert_allclose(np.asarray(out.logprobs)[valid],
                               np.take_along_axis(_log_softmax(z), response[..., None], -1)[..., 0][valid],
                               rtol=1e-4, atol=1e-4)
    # The same prompts right-padded give the same rollout (the sampler re-packs to left padding).
    right = np.array([np.concatenate([row[m], row[~m]]) for row, m in zip(PROMPTS, MASK)])
    right_mask = right != 0
    out_right = sampler(jnp.asarray(right), jnp.asarray(right_mask), jax.random.key(0))
    np.testing.assert_array_equal(out_right.tokens, out.tokens)
    np.testing.assert_allclose(out_right.logprobs, out.logprobs, atol=1e-5)


def test_eos_ends_responses_with_masks_padding_and_lengths(model):
    sampler = Sampler(model, SamplingConfig(max_new_tokens=10, eos_id=1, pad_id=0, temperature=0.0))
    greedy = np.asarray(sampler(jnp.asarray(PROMPTS), jnp.asarray(MASK), jax.random.key(0)).tokens[:, P:])
    assert 1 not in greedy
    # Make EOS (token 1) the greedy choice exactly where token x was: its head column becomes x's, scaled by
    # 1 + 1e-3 (the winning logit is positive), so every row stops at its first x. New parameters: no recompile.
    cut = next(t for t in range(2, 10) if greedy[0, t] not in greedy[0, :t])
    x = int(greedy[0, cut])
    state = jax.tree.map(jnp.array, sampler.state)  # a copy: the sampler's own parameters stay untouched
    head = state["lm_head"]["kernel"][...]
    state["lm_head"]["kernel"] = state["lm_head"]["kernel"].replace(head.at[:, 1].set(head[:, x] * (1 + 1e-3)))
    out = sampler(jnp.asarray(PROMPTS), jnp.asarray(MASK), jax.random.key(0), state=state)
    tokens, mask = np.asarray(out.tokens[:, P:]), np.asarray(out.response_mask)
    for row in range(3):
        hits = np.flatnonzero(greedy[row] == x)
        length = int(hits[0]) + 1 if hits.size else 10
        assert int(out.lengths[row]) == length
        assert bool(out.finished[row]) == bool(hits.size)
        np.testing.assert_array_equal(tokens[row, :length - 1], greedy[row, :length - 1])
        assert tokens[row, length - 1] == (1 if hits.size else greedy[row, -1])
        np.testing.assert_array_equal(tokens[row, length:], 0)
        np.testing.assert_array_equal(mask[row], np.arange(10) < length)
        np.testing.assert_array_equal(np.asarray(out.logprobs)[row, length:], 0.0)
        assert (np.asarray(out.logprobs)[row, :length] < 0).all()
    assert int(out.lengths[0]) == cut + 1 and bool(out.finished[0])
    assert not bool(out.finished.all())  # a response cut at max_new_tokens is reported as unfinished


def _programs():
    return sum(f._cache_size() for f in (slots_lib.start, slots_lib.refill, slots_lib.decode, slots_lib.finish))


def test_no_recompilation_across_parameters_prompts_and_keys(model):
    sampler = Sampler(model, SamplingConfig(max_new_tokens=10, eos_id=1, pad_id=0, temperature=0.0,
                                            length_buckets=1))
    sampler(jnp.asarray(PROMPTS), jnp.asarray(MASK), jax.random.key(0))
    compiled = _programs()
    new_state = jax.tree.map(lambda x: x * 1.01, sampler.state)
    shuffled = jnp.asarray(PROMPTS[::-1].copy())
    out = sampler(shuffled, shuffled != 0, jax.random.key(5), state=new_state)
    sampler(jnp.asarray(PROMPTS), jnp.asarray(MASK), jax.random.key(6))
    assert _programs() == compiled
    assert out.tokens.shape == (3, P + 10)


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    order = np.argsort(-probs, kind="stable")
    sorted_probs = probs[order]
    keep_sorted = np.cumsum(sorted_probs) - sorted_probs < top_p
    keep = np.zeros(probs.shape, bool)
    keep[order[keep_sorted]] = True
    return keep


def test_sampling_logprobs_seeds_layout_and_top_k_top_p_exclusion(model):
    n, top_k, top_p, temperature = 16, 6, 0.7, 0.8
    sampler = Sampler(model, SamplingConfig(max_new_tokens=8, eos_id=1, pad_id=0, num_samples=n,
                                            temperature=temperature, top_k=top_k, top_p=top_p))
    out = sampler(jnp.asarray(PROMPTS), jnp.asarray(MASK), jax.random.key(3))
    assert out.tokens.shape == (3 * n, P + 8)
    np.testing.assert_array_equal(out.tokens[:, :P], np.repeat(PROMPTS, n, axis=0))
    np.testing.assert_array_equal(out.prompt_mask, np.repeat(MASK, n, axis=0))
    z = _step_logits(model, out) / temperature
    response = np.asarray(out.tokens[:, P:])
    valid = np.asarray(out.response_mask)
    # Log-probs are those of the tempered distribution before truncation.
    expected = np.take_along_axis(_log_softmax(z), response[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(out.logprobs)[valid], expected[valid], rtol=1e-4, atol=1e-4)
    # Every sampled token lies in the top-k, then top-p, set of the full forward's distribution at its step.
    for r, t in zip(*np.nonzero(valid)):
        logits = z[r, t]
        in_top_k = logits >= np.sort(logits)[-top_k] - 1e-5
        probs = np.where(in_top_k, np.exp(logits - logits.max()), 0.0)
        allowed = in_top_k & _nucleus(probs / probs.sum(), top_p + 1e-5)
        assert allowed[response[r, t]], (r, t)
    assert len(set(response[:n, 0])) > 1  # the n samples of a prompt differ
    again = sampler(jnp.asarray(PROMPTS), jnp.asarray(MASK), jax.random.key(3))
    np.testing.assert_array_equal(again.tokens, out.tokens)
    np.testing.assert_array_equal(again.logprobs, out.logprobs)
    other = sampler(jnp.asarray(PROMPTS), jnp.asarray(MASK), jax.random.key(4))
    assert (np.asarray(other.tokens) != np.asarray(out.tokens)).any()


def test_filtered_sampling_matches_the_renormalised_distribution():
    probs = np.array([0.30, 0.22, 0.18, 0.12, 0.08, 0.05, 0.03, 0.02])
    logits = jnp.log(jnp.asarray(probs, jnp.float32))
    rows = 20_000
    for top_k, top_p, allowed in [(3, 1.0, [0, 1, 2]), (0, 0.6, [0, 1, 2]), (0, 0.5, [0, 1]), (5, 0.8, [0, 1, 2, 3]),
                                  (0, 1.0, list(range(8)))]:
        config = SamplingConfig(max_new_tokens=1, eos_id=0, pad_id=0, top_k=top_k, top_p=top_p)
        keys = jax.random.split(jax.random.key(top_k * 10 + 7), rows)
        tokens, logp = sample_tokens(jnp.broadcast_to(logits, (rows, 8)), keys, config)
        counts = np.bincount(np.asarray(tokens), minlength=8)
        excluded = np.setdiff1d(np.arange(8), allowed)
        assert counts[excluded].sum() == 0, (top_k, top_p, counts)
        target = np.zeros(8)
        target[allowed] = probs[allowed] / probs[allowed].sum()
        # 5 standard deviations of a binomial frequency at 20k draws is < 0.017.
        np.testing.assert_allclose(counts / rows, target, atol=0.017)
        np.testing.assert_allclose(logp, np.log(probs)[np.asarray(tokens)], rtol=1e-5)


def test_filter_logits_by_hand():
    z = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    assert np.isinf(np.asarray(filter_logits(z, top_k=2))[0, 2:]).all()
    np.testing.assert_array_equal(np.isfinite(filter_logits(z, top_p=0.8)), [[True, True, False, False]])
    np.testing.assert_array_equal(np.isfinite(filter_logits(z, top_p=0.81)), [[True, True, True, False]])
    np.testing.assert_array_equal(np.isfinite(filter_logits(z, top_p=0.1)), [[True, False, False, False]])
    np.testing.assert_array_equal(filter_logits(z), z)


def test_validation(model):
    with pytest.raises(ValueError, match=r"SamplingConfig\.top_p"):
        SamplingConfig(max_new_tokens=4, eos_id=1, pad_id=0, top_p=0.0)
    with pytest.raises(ValueError, match=r"SamplingConfig\.max_new_tokens"):
        SamplingConfig(max_new_tokens=0, eos_id=1, pad_id=0)
    with pytest.raises(ValueError, match=r"SamplingConfig\.temperature"):
        SamplingConfig(max_new_tokens=4, eos_id=1, pad_id=0, temperature=-1.0)
    with pytest.raises(ValueError, match="eos_id=500"):
        Sampler(model, SamplingConfig(max_new_tokens=4, eos_id=500, pad_id=0))
    sampler = Sampler(model, SamplingConfig(max_new_tokens=510, eos_id=1, pad_id=0))
    with pytest.raises(ValueError, match="max_seq_len"):
        sampler(jnp.asarray(PROMPTS), jnp.asarray(MASK), jax.random.key(0))
    sampler = Sampler(model, SamplingConfig(max_new_tokens=4, eos_id=1, pad_id=0))
    with pytest.raises(ValueError, match=r"rows \[1\] have no real token"):
        sampler(jnp.asarray(PROMPTS), jnp.asarray(np.array([MASK[0], np.zeros(P, bool), MASK[2]])),
                jax.random.key(0))
    with pytest.raises(ValueError, match="same shape"):
        sampler(jnp.asarray(PROMPTS), jnp.asarray(MASK[:, 1:]), jax.random.key(0))


def _varied_eos(model, config, key):
    """(graphdef, state, eos): the token that, taken as EOS, ends `config`'s rollout rows at the most different
    lengths (a row's tokens before its first EOS do not depend on which token is EOS)."""
    graphdef, state = nnx.split(model)
    probe = generate(graphdef, state, jnp.asarray(PROMPTS), jnp.asarray(MASK), key,
                     dataclasses.replace(config, eos_id=1))
    tokens, N = np.asarray(probe.tokens[:, P:]), config.max_new_tokens
    def spread(x):
        hit = tokens == x
        return len(set(np.where(hit.any(1), hit.argmax(1) + 1, N + 1).tolist()))
    return graphdef, state, max(set(tokens.ravel().tolist()) - {0, 1}, key=spread)


@pytest.mark.slow
def test_schedule_does_not_change_the_result(model):
    """Rows of different lengths decoded with every row at once, in 2 or 5 slots refilled as rows end, with other
    decode_steps and length buckets: the same tokens, lengths and finished flags (a row's draws depend on (key,
    prompt, sample, t), not on its slot or its time), and the same log-probs up to float rounding (the batch and
    attention widths differ, and with them XLA's summation order)."""
    base = SamplingConfig(max_new_tokens=9, eos_id=1, pad_id=0, num_samples=4, temperature=1.0)
    graphdef, state, eos = _varied_eos(model, base, jax.random.key(2))
    results = []
    for slots, steps, buckets in [(0, 9, 1), (2, 3, 3), (5, 2, 4), (7, 4, 2)]:
        config = dataclasses.replace(base, eos_id=eos, slots=slots, decode_steps=steps, length_buckets=buckets)
        results.append(generate(graphdef, state, jnp.asarray(PROMPTS), jnp.asarray(MASK), jax.random.key(2),
                                config))
    lengths = np.asarray(results[0].lengths)
    assert len(set(lengths.tolist())) >= 3 and results[0].finished.any() and not results[0].finished.all()
    for other in results[1:]:
        for name in other._fields:
            compare = np.testing.assert_array_equal if name != "logprobs" else functools.partial(
                np.testing.assert_allclose, rtol=0, atol=1e-5)
            compare(np.asarray(getattr(other, name)), np.asarray(getattr(results[0], name)), err_msg=name)


def test_greedy_equals_the_batched_greedy_decoder_token_for_token(model):
    """Greedy rollouts in 2 slots (rows refilled as others end at EOS) equal `greedy_generate`, the plain batched
    greedy decoder over one shared cache, token for token."""
    base = SamplingConfig(max_new_tokens=10, eos_id=1, pad_id=0, temperature=0.0)
    graphdef, state = nnx.split(model)
    reference = greedy_generate(model, [row[m].tolist() for row, m in zip(PROMPTS, MASK)], max_new_tokens=10,
                                stop_ids=[1])
    eos = reference[1][3]  # a token that ends row 1 early; the others end where they meet it or at the budget
    reference = greedy_generate(model, [row[m].tolist() for row, m in zip(PROMPTS, MASK)], max_new_tokens=10,
                                stop_ids=[eos])
    out = generate(graphdef, state, jnp.asarray(PROMPTS), jnp.asarray(MASK), jax.random.key(0),
                   dataclasses.replace(base, eos_id=eos, slots=2, decode_steps=2))
    got = [np.asarray(out.tokens[r, P:P + int(out.lengths[r])]).tolist() for r in range(3)]
    assert got == reference
    assert len({len(r) for r in reference}) > 1


@pytest.mark.parametrize("name", ["tiny", "tiny-gemma3"])
@pytest.mark.slow
def test_a_per_layer_cache_decodes_as_the_stacked_one(name):
    """`ModelConfig.decode_unroll` (the GPU engine's layout: one module per layer holding that layer of the stacked
    weights, `per_layer_state`, and a per-layer KV cache, the layers unrolled, each attending in place over its
    buffer up to the length bucket) samples what the stacked weights and cache under the layer scan sample:
    the same tokens, lengths and finished flags, log-probs up to float rounding, through refills and length
    buckets (and past Gemma 3's sliding window of 8, whose per-layer pattern and RoPE bases follow the layer's
    index)."""
    graphdef, state = nnx.split(init_model(preset(name, tie_embeddings=False), seed=1))
    state = jax.tree.map(lambda x: 4.0 * x if x.ndim >= 2 else x, state)
    unrolled, per_layer = nnx.split(abstract_model(preset(name, tie_embeddings=False, decode_unroll=True)))
    per_layer = per_layer_state(state, per_layer)
    assert len(flat_params(per_layer)) > len(flat_params(state))  # one leaf per layer
    cache = nnx.merge(unrolled, per_layer).init_cache(2, 4)
    assert isinstance(cache.k, tuple) and len(cache.k) == preset(name).num_layers and cache.k[0].ndim == 4
    base = SamplingConfig(max_new_tokens=9, eos_id=1, pad_id=0, num_samples=4, temperature=1.0)
    for slots, steps, buckets in [(0, 9, 1), (5, 2, 4)]:
        config = dataclasses.replace(base, slots=slots, decode_steps=steps, length_buckets=buckets)
        ref, got = (generate(g, s, jnp.asarray(PROMPTS), jnp.asarray(MASK), jax.random.key(3), config)
                    for g, s in ((graphdef, state), (unrolled, per_layer)))
        for field in ref._fields:
            compare = np.testing.assert_array_equal if field != "logprobs" else functools.partial(
                np.testing.assert_allclose, rtol=0, atol=1e-5)
            compare(np.asarray(getattr(got, field)), np.asarray(getattr(ref, field)), err_msg=f"{slots=} {field}")
    assert P + base.max_new_tokens > preset("tiny-gemma3").sliding_window


def test_a_per_layer_decoder_is_the_stacked_one_cut_into_layers():
    """`init_model` under `ModelConfig.decode_unroll` holds layer i of the same seed's stacked weights at
    blocks.{i}.<path> (`layer_source`), every parameter once, and computes the stacked decoder's logits."""
    stacked = init_model(preset("tiny-gemma3"), seed=3)
    per_layer = init_model(preset("tiny-gemma3", decode_unroll=True), seed=3)
    theirs, ours = flat_params(nnx.state(stacked)), flat_params(nnx.state(per_layer))
    L = preset("tiny-gemma3").num_layers
    assert len(ours) == len(theirs) + (L - 1) * sum(p.startswith("blocks.") for p in theirs)
    for path, leaf in ours.items():
        source, layer = layer_source(path)
        assert (layer is None) == (not path.startswith("blocks.")), path
        np.testing.assert_array_equal(leaf, theirs[source] if layer is None else theirs[source][layer], path)
    assert layer_source("blocks.12.mlp.up_proj.kernel") == ("blocks.mlp.up_proj.kernel", 12)
    tokens = jnp.asarray(PROMPTS)
    np.testing.assert_allclose(per_layer(tokens, attention_mask=jnp.asarray(MASK)),
                               stacked(tokens, attention_mask=jnp.asarray(MASK)), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"blocks\.mlp\.up_proj\.kernel"):
        per_layer_state({k: v for k, v in theirs.items() if k != "blocks.mlp.up_proj.kernel"}, nnx.state(per_layer))
