"""The PyTorch port of the projections (logra_jax.rollout.vllm.torch_projection) against JAX's: Rademacher (the default)
bit for bit; Gaussian within a few ulp, since XLA's own float32 log1p changes with its CPU compile options (JAX's
Gaussian draws differ between XLA's default pipeline and -O0 in a few percent of entries, by up to 3 ulp)."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# torch and the port (which imports it) are imported by the tests, not at collection, and the module runs on the
# one worker that imports torch (tests/models/conftest.py)
pytestmark = pytest.mark.xdist_group("torch")


@pytest.fixture(scope="module")
def tp(torch):  # the `torch` fixture: tests/vllm/conftest.py
    return importlib.import_module("logra_jax.rollout.vllm.torch_projection")

# logra_jax.optim re-exports a function named `projection`, which shadows the module as an attribute.
jp = importlib.import_module("logra_jax.optim.projection")

PATHS = ("blocks.attn.q_proj.kernel.0", "blocks.attn.q_proj.kernel.29", "blocks.mlp.down_proj.kernel.7",
         "lm_head.kernel", "embed.embedding", "ünïcode.path.3")
SHAPES = ((1, 1), (1, 7), (4, 8), (3, 33), (16, 576), (8, 1536))
SEED_STEPS = ((0, 0), (42, 0), (42, 1), (42, 39), (7, 12345), (2**40 + 3, 2**31 - 1), (123, 65536))
CASES = [(seed, step, path, SHAPES[(3 * i + j) % len(SHAPES)])
         for i, (seed, step) in enumerate(SEED_STEPS) for j, path in enumerate(PATHS)]


GAUSSIAN_ULP = 4  # measured: at most 3 against either XLA CPU pipeline


def _bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


def _check(got: np.ndarray, want: np.ndarray, distribution: str, case: object) -> None:
    """Rademacher: same bit patterns; Gaussian: same signs and at most GAUSSIAN_ULP apart."""
    if distribution == "rademacher":
        mismatch = int((_bits(got) != _bits(want)).sum())
        assert mismatch == 0, (case, mismatch)
        return
    assert np.array_equal(np.signbit(got), np.signbit(want)), case
    ulp = np.abs(_bits(got).astype(np.int64) - _bits(want).astype(np.int64))
    assert int(ulp.max()) <= GAUSSIAN_ULP, (case, int(ulp.max()))


def test_known_answer_and_jax_hash(tp, torch):
    """Threefry-2x32 against the Random123 vectors and against JAX's primitive on random words."""
    k = (0x13198A2E, 0x03707344)
    out = tp.threefry2x32(k, torch.tensor([0x243F6A88]), torch.tensor([0x85A308D3]))
    assert [int(w) for w in out] == [0xC4923A9C, 0x483DF7A0]
    out = tp.threefry2x32((0, 0), torch.tensor([0]), torch.tensor([0]))
    assert [int(w) for w in out] == [0x6B200159, 0x99BA4EFE]
    from jax._src.random.threefry2x32 import threefry_2x32
    rng = np.random.default_rng(0)
    key = rng.integers(0, 2**32, 2, dtype=np.uint64)
    count = rng.integers(0, 2**32, 64, dtype=np.uint64)
    want = np.asarray(threefry_2x32(jnp.asarray(key, jnp.uint32), jnp.asarray(count, jnp.uint32)))
    x = torch.tensor(count.astype(np.int64))
    got = torch.cat(tp.threefry2x32((int(key[0]), int(key[1])), x[:32], x[32:]))
    np.testing.assert_array_equal(got.numpy().astype(np.uint32), want)


@pytest.mark.parametrize("seed,shape", [(0, (5,)), (2**62 - 1, (3, 11)), (42, (2, 3, 4))])
def test_random_bits_equal_jax(seed, shape, tp):
    key = jax.random.wrap_key_data(np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32), impl="threefry2x32")
    want = np.asarray(jax.random.bits(key, shape, jnp.uint32))
    np.testing.assert_array_equal(tp.random_bits(seed, shape).numpy().astype(np.uint32), want)


@pytest.mark.parametrize("base,step,path", [(0, 0, "a"), (42, 7, "blocks.mlp.up_proj.kernel.3"),
                                            (2**50, 2**31 - 1, "ü")])
def test_layer_seed_equal_jax(base, step, path, tp):
    assert tp.layer_seed(base, step, path) == jp.layer_seed(base, step, path)
    assert tp.path_digest(path) == jp.path_digest(path)


@pytest.mark.parametrize("distribution", ["rademacher", "gaussian"])
def test_projection_equal_jax_on_many_cases(distribution, tp):
    """(seed, step, path, shape) cases against logra_jax.optim.projection.projection."""
    for base, step, path, (rank, width) in CASES:
        seed = jp.layer_seed(base, step, path)
        want = np.asarray(jp.projection(seed, rank, width, distribution))
        got = tp.projection(tp.layer_seed(base, step, path), rank, width, distribution).numpy()
        _check(got, want, distribution, (base, step, path, rank, width))


@pytest.mark.parametrize("distribution", ["rademacher", "gaussian"])
def test_slice_projections_equal_jax_batched(distribution, tp):
    """The stacked slices of a batched target ("path.i"), as the merge draws them (jitted, vmapped)."""
    paths = [f"blocks.attn.k_proj.kernel.{i}" for i in range(5)]
    want = np.asarray(jp.slice_projections(42, 3, jp.digest_words(paths), 8, 96, distribution))
    got = tp.slice_projections(42, 3, paths, 8, 96, distribution).numpy()
    _check(got, want, distribution, paths)


def test_gaussian_tails_close_to_jax(tp):
    """Uniforms at the edges of [0, 1) (w ≥ 5 branch of erfinv, the clamp at −1) on a large draw."""
    seed = tp.layer_seed(1, 2, "tails")
    want = np.asarray(jp.projection(seed, 1, 50_000, "gaussian"))
    got = tp.projection(seed, 1, 50_000, "gaussian").numpy()
    assert np.abs(want).max() > 3.5  # the draw reaches the w ≥ 5 branch (|x| > 2.9)
    _check(got, want, "gaussian", "tails")


def test_bad_arguments_named(tp):
    with pytest.raises(ValueError, match="distribution"):
        tp.projection(0, 2, 2, "uniform")
    with pytest.raises(ValueError, match="rank"):
        tp.projection(0, 0, 2)
    with pytest.raises(ValueError, match="step"):
        tp.layer_seed(0, -1, "p")
    with pytest.raises(TypeError, match="paths"):
        tp.slice_projections(0, 0, "p", 2, 2)
