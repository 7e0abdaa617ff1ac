"""logra_jax: LoGRA (low-rank gradient sketches, RowAdam, predicted-KL step control) for RL post-training in JAX."""

__version__ = "0.1.0"
