"""Per-target rank rules (`SketchSpec.rank_rules`): each target is sketched, stepped and merged at its own rank.

Oracles: numpy G·Aᵀ with each target's own projection A [r_t, k] (float64) for the sketch; numpy W + U·A for the
merge; and, for every target whose rank a rule leaves unchanged, the run without rules, bit for bit.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from logra_jax.optim import (
    RankRule,
    SketchSpec,
    apply_updates,
    check_rank_fits,
    find_targets,
    logra,
    parse_rank_rules,
    path_str,
    scale_by_sketch,
    target_projection,
)

RANK = 4
RULES = "up_proj=2, o_proj=3"
UP, Q, OUT = "blocks.mlp.up_proj.kernel", "attn.q_proj.kernel", "o_proj.kernel"
RANKS = {UP: 2, Q: RANK, OUT: 3}


def make_params(seed=0):
    """A stacked [L, in, out] target (k 16), two plain targets (k 16 and 12) and a frozen norm."""
    k = jax.random.split(jax.random.key(seed), 3)
    return {"blocks": {"mlp": {"up_proj": {"kernel": jax.random.normal(k[0], (3, 16, 24))}}},
            "attn": {"q_proj": {"kernel": jax.random.normal(k[1], (16, 12))}},
            "o_proj": {"kernel": jax.random.normal(k[2], (12, 16))},
            "norm": jnp.ones(16)}


def flat(tree):
    return {path_str(k): v for k, v in jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: hasattr(x, "factor"))[0]}


def grads(params, seed):
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(100 + seed), len(leaves))
    return jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])


def test_rules_parse_resolve_and_are_checked():
    spec = SketchSpec(rank=RANK, rank_rules=RULES)
    assert spec.rank_rules == (RankRule("up_proj", 2), RankRule("o_proj", 3))
    assert spec == SketchSpec(rank=RANK, rank_rules={"up_proj": 2, "o_proj": 3})  # a mapping, in its order
    assert hash(spec) == hash(SketchSpec(rank=RANK, rank_rules=[("up_proj", 2), RankRule("o_proj", 3)]))
    assert {p: spec.rank_for(p) for p in RANKS} == RANKS
    assert SketchSpec(rank=RANK, rank_rules="proj=5, up_proj=2").rank_for(UP) == 5  # the first match wins
    assert parse_rank_rules("") == () and parse_rank_rules(" a.*=3 ,") == (RankRule("a.*", 3),)
    assert parse_rank_rules("x=y=7") == (RankRule("x=y", 7),)  # the rank follows the last '='
    for text, message in [("up_proj=0", "rank must be a positive int, got 0"),
                          ("up_proj", "rank rule 'up_proj' is not 'pattern=rank'"),
                          ("up_proj=2.5", "is not 'pattern=rank'"),
                          ("(=2", "not a valid regex"),
                          ("a=2, a=3", r"the pattern\(s\) \['a'\] twice")]:
        with pytest.raises(ValueError, match=r"SketchSpec\.rank_rules: .*" + message):
            SketchSpec(rank_rules=text)
    assert not spec.draws_like(SketchSpec(rank=RANK)) and spec.draws_like(dataclasses.replace(spec, interpret=True))


def test_each_target_sees_its_own_rank_on_the_wire():
    spec = SketchSpec(rank=RANK, base_seed=9, round_bf16=True, rank_rules=RULES)
    with pytest.raises(ValueError, match=r"has no one rank: write spec\.for_target"):
        spec.wire_fields()
    for path, r in RANKS.items():
        one = spec.for_target(path)
        assert one.rank == r and one.rank_rules == () and one.rank_for(path) == r
        assert one == dataclasses.replace(spec, rank=r, rank_rules=())
        assert SketchSpec.from_wire(one.wire_fields()) == one  # the default target rules: spec's are too
    plain = SketchSpec(rank=RANK)
    assert plain.for_target(UP) is plain


def test_rank_fits_and_every_rule_matching_are_checked_at_init():
    params = make_params()
    targets = find_targets(params)
    check_rank_fits(targets, RANK, parse_rank_rules(RULES))
    cases = [("nothing=2", "rank rule 'nothing=2' gives no target its rank"),
             ("proj=2, up_proj=3", "rank rule 'up_proj=3' gives no target its rank"),  # shadowed by 'proj'
             ("up_proj=17", r"rank rule 'up_proj=17': rank 17 exceeds the width k = 16 of target "
                            r"'blocks.mlp.up_proj.kernel'")]
    for rules, message in cases:
        with pytest.raises(ValueError, match=message):
            check_rank_fits(targets, RANK, parse_rank_rules(rules))
        for tx in (scale_by_sketch(rank=RANK, rank_rules=rules), logra(rank=RANK, rank_rules=rules)):
            with pytest.raises(ValueError, match=message):
                tx.init(params)
    # rank 13 is wider than o_proj (k = 12): a rule giving that one target a smaller rank makes it fit
    with pytest.raises(ValueError, match=r"^rank 13 exceeds the width k = 12 of target 'o_proj.kernel'"):
        logra(rank=13).init(params)
    logra(rank=13, rank_rules="o_proj=12").init(params)


def test_sketch_of_each_target_is_g_times_its_own_projection():
    """Dense-gradient mode at steps 0 and 1: S = G·Aᵀ with A [r_t, k] of each target's own rank (numpy float64);
    the target a rule leaves at the default rank is the rule-less sketch bit for bit."""
    params = make_params()
    targets = find_targets(params)
    tx, plain = scale_by_sketch(rank=RANK, rank_rules=RULES), scale_by_sketch(rank=RANK)
    state, plain_state = tx.init(params), plain.init(params)
    for step in range(2):
        g = grads(params, step)
        out, state = tx.update(g, state)
        ref, plain_state = plain.update(g, plain_state)
        got, want_plain, g = flat(out), flat(ref), flat(g)
        for path, t in targets.items():
            s = np.asarray(got[path].factor)
            assert s.shape == (*t.batch_shape, *t.rows_shape, RANKS[path]) and got[path].rank == RANKS[path]
            a = np.asarray(target_projection(t, 42, step, RANKS[path]), np.float64)  # [*batch, r, k]
            w = np.asarray(g[path], np.float64)  # [*batch, k, d]
            want = np.einsum("...kd,...rk->...dr", w, a)
            np.testing.assert_allclose(s, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        np.testing.assert_array_equal(got[Q].factor, want_plain[Q].factor)


def _run(tx, params, steps=2):
    state = tx.init(params)
    step = jax.jit(lambda p, s, g: _apply(tx, p, s, g))
    history = []
    for i in range(steps):
        params, state, updates = step(params, state, grads(params, i))
        history.append((params, updates))
    return history


def _apply(tx, params, state, g):
    updates, state = tx.update(g, state, params)
    return apply_updates(params, updates), state, updates


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_logra_steps_with_mixed_ranks(momentum):
    """Two logra steps (RowAdam, per-layer update ratio, bf16 factor, with and without the sketch-space momentum):
    every target's merge is W + bf16(U)·A with its own A (numpy); the default-rank target follows the rule-less
    run bit for bit; rules that give every target the default rank are the rule-less run bit for bit."""
    params = make_params()
    targets = find_targets(params)
    kw = dict(rank=RANK, momentum=momentum, update_ratio=1e-2, ratio_scope="layer")
    mixed = _run(logra(rank_rules=RULES, **kw), params)
    plain = _run(logra(**kw), params)
    same = _run(logra(rank_rules=".=4", **kw), params)
    before = params
    for step, ((p, u), (p_plain, _), (p_same, _)) in enumerate(zip(mixed, plain, same)):
        jax.tree.map(np.testing.assert_array_equal, p_same, p_plain)
        np.testing.assert_array_equal(flat(p)[Q], flat(p_plain)[Q])
        for path, t in targets.items():
            factor = np.asarray(flat(u)[path].factor.astype(jnp.bfloat16), np.float64)  # the paper's bf16 wire
            assert factor.shape[-1] == RANKS[path]
            a = np.asarray(target_projection(t, 42, step, RANKS[path]), np.float64)
            want = np.asarray(flat(before)[path], np.float64) + np.einsum("...dr,...rk->...kd", factor, a)
            np.testing.assert_allclose(np.asarray(flat(p)[path]), want, rtol=1e-6, atol=1e-6)
        before = p
    assert not np.array_equal(flat(mixed[-1][0])[UP], flat(plain[-1][0])[UP])


def test_dense_route_equals_low_rank_route_with_mixed_ranks():
    params = make_params()
    low = logra(rank=RANK, rank_rules=RULES, update_ratio=1e-2)
    dense = logra(rank=RANK, rank_rules=RULES, update_ratio=1e-2, dense_updates=True)
    g = grads(params, 0)
    u_low, _ = jax.jit(low.update)(g, low.init(params), params)
    u_dense, _ = jax.jit(dense.update)(g, dense.init(params), params)
    jax.tree.map(np.testing.assert_array_equal, apply_updates(params, u_low), optax.apply_updates(params, u_dense))


def test_sharded_equals_unsharded_with_mixed_ranks():
    """8 fake devices, kernels split on their width (the state's split moves onto the rows): the weights and the
    state (row moments, momentum [L, d, r_t] at each target's rank) equal one device's after two steps (the
    second transfers the momentum), and every state leaf keeps the placement the jitted step's out_shardings
    derive from the targets."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from logra_jax.optim import state_targets
    from logra_jax.parallel.sharding import opt_state_shardings

    assert jax.device_count() == 8
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    rng = np.random.default_rng(0)
    params = {"blocks": {n: {"kernel": jnp.asarray(rng.normal(size=(2, 16, 32)), jnp.float32)}
                         for n in ("up_proj", "q_proj")}}
    g = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params) for _ in range(2)]
    tx = logra(rank=RANK, rank_rules="up_proj=2", momentum=0.9, update_ratio=1e-2, round_bf16=False)

    def run(params, grads):
        state = init = tx.init(params)
        step = jax.jit(lambda p, s, g: _apply(tx, p, s, g)[:2])
        for gr in grads:
            params, state = step(params, state, gr)
        return params, init, state

    want, _, want_state = run(params, g)
    assert {m.shape[-1] for m in jax.tree.leaves(want_state) if m.ndim == 3} == {2, RANK}  # momentum at r_t
    for spec in (P(None, "x", None),):
        shard = lambda tree, spec=spec: jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, spec)), tree)
        got, init, state = run(shard(params), [shard(gr) for gr in g])
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), state, want_state)
        sharded = shard(params)
        derived = opt_state_shardings(init, jax.tree.map(lambda x: x.sharding, sharded), sharded,
                                      targets=state_targets(init, sharded))
        for leaf, placed, out in zip(jax.tree.leaves(init), jax.tree.leaves(derived), jax.tree.leaves(state)):
            assert leaf.sharding.is_equivalent_to(placed, leaf.ndim), (leaf.shape, leaf.sharding, placed)
            assert out.sharding.is_equivalent_to(leaf.sharding, leaf.ndim), (leaf.shape, out.sharding)
