"""Optimizer-state memory at Qwen2.5-7B shapes (abstract: nothing is allocated): LoGRA ≤ 1% of optax.adamw."""

import math

import jax
import optax
from flax import nnx

from logra_jax.models.config import preset
from logra_jax.models.decoder import abstract_model
from logra_jax.optim import logra


def state_bytes(tree) -> int:
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def test_logra_state_is_under_one_percent_of_adamw_at_qwen7b():
    config = preset("qwen2.5-7b")
    params = nnx.state(abstract_model(config), nnx.Param)
    logra_bytes = state_bytes(jax.eval_shape(logra(rank=256).init, params))
    adamw_bytes = state_bytes(jax.eval_shape(optax.adamw(1e-6).init, params))
    print(f"Qwen2.5-7B optimizer state: logra(rank=256) {logra_bytes / 2**20:.2f} MiB, "
          f"optax.adamw {adamw_bytes / 2**30:.2f} GiB, ratio {logra_bytes / adamw_bytes:.2e}")
    # One fp32 row moment per output row of each q/k/v/o/gate/up/down layer, plus a few counters.
    c = config
    rows = c.q_size + 2 * c.kv_size + c.hidden_size + 2 * c.intermediate_size + c.hidden_size
    assert logra_bytes <= 4 * c.num_layers * rows + 64
    assert adamw_bytes >= 2 * 4 * c.num_params()
    assert logra_bytes <= 0.01 * adamw_bytes
