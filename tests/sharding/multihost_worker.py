"""One process of the 2-process test: joins the run, takes one sharded AdamW step on a global mesh, saves results.

  python tests/sharding/multihost_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_NPZ TIMEOUT_S

Each process owns 4 fake CPU devices; the (data=2, fsdp=4) mesh spans all 8. Process 0 writes the gathered
loss and parameters to OUT_NPZ. `make_problem` is shared with the test, which computes the single-process
reference from the same seeds.
"""

from __future__ import annotations

import os
import sys

import numpy as np

BATCH, LENGTH, SEED = 8, 17, 0


def make_problem():
    """(init_fn, step_fn, batch as numpy) for the tiny decoder with AdamW (imports JAX lazily)."""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from logra_jax.models.config import preset
    from logra_jax.models.decoder import init_model
    from logra_jax.train_step import TrainState, make_train_step, next_token_loss

    config = preset("tiny")
    tx = optax.adamw(1e-3, eps=1e-6)

    def init_fn():
        _, params, rest = nnx.split(init_model(config, SEED), nnx.Param, ...)
        return TrainState(params, tx.init(params), jnp.zeros((), jnp.int32)), rest

    graphdef = nnx.split(nnx.eval_shape(lambda: init_model(config, SEED)), nnx.Param, ...)[0]
    rng = np.random.default_rng(SEED)
    batch = {"tokens": rng.integers(0, config.vocab_size, (BATCH, LENGTH)).astype(np.int32),
             "attention_mask": np.ones((BATCH, LENGTH), np.int32),
             "loss_mask": (rng.random((BATCH, LENGTH)) < 0.8).astype(np.int32)}
    return init_fn, make_train_step(graphdef, next_token_loss, tx), batch


def main(process_id: int, num_processes: int, port: int, out: str, timeout_s: int) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    from jax.experimental import multihost_utils

    from logra_jax import multihost
    from logra_jax import sharding as shd

    multihost.initialize(multihost.DistributedConfig(f"127.0.0.1:{port}", num_processes, process_id,
                                                     timeout_s=timeout_s))
    mesh = shd.make_mesh(shd.MeshConfig(data=2, fsdp=4))
    init_fn, step_fn, batch = make_problem()
    (state, rest), (state_sh, rest_sh) = shd.init_sharded(
        init_fn, lambda s: (shd.train_state_shardings(s[0], mesh), shd.param_shardings(s[1], mesh)),
        compiler_options=shd.FAST_CPU_COMPILE)
    batch_sh = shd.batch_shardings(batch, mesh)
    global_batch = {k: jax.make_array_from_callback(v.shape, batch_sh[k], lambda idx, v=v: v[idx])
                    for k, v in batch.items()}
    step = shd.jit_train_step(step_fn, mesh, in_shardings=(state_sh, rest_sh, batch_sh),
                              out_shardings=(state_sh, shd.replicated(mesh)), compiler_options=shd.FAST_CPU_COMPILE)
    state, metrics = step(state, rest, global_batch)
    params = multihost_utils.process_allgather(jax.tree.leaves(state.params), tiled=True)
    loss = multihost_utils.process_allgather(metrics["loss"], tiled=True)
    if process_id == 0:
        np.savez(out, loss=np.asarray(loss), devices=jax.device_count(), processes=jax.process_count(),
                 **{f"p{i}": np.asarray(p) for i, p in enumerate(params)})
    multihost.shutdown()


if __name__ == "__main__":
    pid, n, port, out, timeout = sys.argv[1:6]
    main(int(pid), int(n), int(port), out, int(timeout))
